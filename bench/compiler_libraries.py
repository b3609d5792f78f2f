"""Private copies of the compiler libraries libbcc links (libLLVM, libclang-cpp).

The kernel does not page out file pages another process maps too: a bench
that measures the agent's memory on a host where another BCC tool holds
libLLVM runs the agent on private copies, so it sees what a node where the
agent is the only BCC user would (bench/footprint.py, bench/memcg.py, and the
kernel test of the compiler's release).
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["COMPILER_LIBRARIES", "LIBRARY_DIRS", "private_compiler_libraries"]

COMPILER_LIBRARIES = ("libLLVM-14.so.1", "libclang-cpp.so.14")
LIBRARY_DIRS = (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/llvm-14/lib"))


def private_compiler_libraries(into: Path) -> dict[str, str]:
    """Copy the compiler libraries libbcc links into `into`; the environment
    that makes the agent load them from there (no other process maps them)."""
    for name in COMPILER_LIBRARIES:
        src = next((d / name for d in LIBRARY_DIRS if (d / name).exists()), None)
        if src is None:
            raise RuntimeError(f"{name} not found in {', '.join(map(str, LIBRARY_DIRS))}: is python3-bpfcc installed?")
        shutil.copy2(src.resolve(), into / name)
    return {"LD_LIBRARY_PATH": str(into)}

"""`python -m tests.support.seccomp SYSCALL[,SYSCALL] -- CMD...`: exec CMD under
a seccomp filter that answers EPERM to the named syscalls, as a container
runtime's profile does (a classic BPF program installed with prctl; x86_64)."""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

SYSCALLS = {"bpf": 321, "perf_event_open": 298}  # x86_64
AUDIT_ARCH_X86_64 = 0xC000003E
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
RET_ALLOW = 0x7FFF0000
RET_ERRNO_EPERM = 0x00050000 | 1


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def install(names: list[str]) -> None:
    if platform.machine() != "x86_64":
        raise SystemExit("seccomp: x86_64 only")
    prog = [_insn(0x20, 0, 0, 4),                                   # A = arch
            _insn(0x15, 1, 0, AUDIT_ARCH_X86_64),                   # arch ok: skip the next
            _insn(0x06, 0, 0, RET_ALLOW),
            _insn(0x20, 0, 0, 0)]                                   # A = syscall nr
    for name in names:
        prog += [_insn(0x15, 0, 1, SYSCALLS[name]), _insn(0x06, 0, 0, RET_ERRNO_EPERM)]
    prog.append(_insn(0x06, 0, 0, RET_ALLOW))
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fbuf, 0, 0) != 0:
        raise SystemExit(f"seccomp: prctl failed: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    names, sep, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert sep == "--" and cmd
    install(names.split(","))
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()

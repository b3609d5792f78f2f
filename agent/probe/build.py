"""Compiles, loads and attaches the BPF programs in a short-lived process, and
hands the result to the agent as file descriptors.

BCC compiles with clang/LLVM inside the process that calls it: ~110 MiB more
resident for one second, which a process that runs for weeks would otherwise
keep as its peak (and, until paged out, as its pages). So the agent runs
a child process instead (`python -c` calling main() below, so
that it imports this very package). That child imports bcc, compiles
bpf/sched.bpf.c, loads and attaches the programs (and the BTF-typed ones,
agent/probe/tracing.py), then sends back over a Unix socket pair, with
SCM_RIGHTS, every descriptor the agent needs: the maps, the programs and the
attachments (perf events of classic tracepoints, raw-tracepoint fds, bpf
links), which keep the programs attached while any process holds them. It
then leaves at once with os._exit(): BCC's exit handlers would disable the
perf events the agent now shares. The agent reads the maps with the bpf(2)
system call (agent/probe/bpfsys.py) and never maps libbcc or the compiler.

With a cache directory, the child first looks there for the programs of the
same compile (agent/probe/cache.py): found, it creates, loads and attaches
them with bpf(2) (agent/probe/bpfload.py) and never imports BCC; else, or if
the kernel refuses them, it compiles as above and records the result for the
next start. The reply says which, and why the cache was not used.
"""

from __future__ import annotations

import ctypes as ct
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import agent
from agent.probe.btf import TRACEPOINTS, WATCH_TRACEPOINTS
from agent.probe.cache import CacheMiss, CacheProblem, ProgramCache, Programs, cache_key, kernel_identity
from agent.probe.footprint import compiler_files, drop_page_cache, resident_peak

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300.0   # the compile takes ~1 s here, minutes under an emulator
MAX_MESSAGE = 1 << 20
MAX_FDS = 250             # SCM_MAX_FD is 253


class BuildError(Exception):
    """The child could not compile, load or attach the programs; its message is BCC's or the kernel's."""


class MapMemoryError(Exception):
    """The kernel refused a BPF map's memory: under a memory cgroup's limit, the
    maps' kernel memory is charged on top of what the compile holds."""

    def __str__(self) -> str:
        return ("the kernel refused memory for the BPF maps (Cannot allocate memory): the memory cgroup's "
                "limit is too small for the maps' kernel memory on top of the compile's peak; raise the "
                "container's memory limit (BENCHMARKS.md, 'Memory cgroup charge')")


class BuildKilledError(MapMemoryError):
    """The build process was killed (SIGKILL) before it answered: under a
    memory cgroup's limit, the kernel's OOM killer takes the largest process,
    which during the compile is the build process."""

    def __str__(self) -> str:
        return ("the BPF build process was killed (SIGKILL) before handing over the programs: under a memory "
                "limit, the kernel's OOM killer takes the compile first; raise the container's memory limit "
                "(BENCHMARKS.md, 'Memory cgroup charge')")


@dataclass
class Built:
    """What the child handed over. The fds are this process's own now."""

    maps: dict[str, int]                       # map name -> fd
    types: dict[str, tuple[str, str]]          # map name -> BCC's key and value type descriptions (JSON)
    programs: dict[str, int]                   # tracepoint -> program fd
    attachments: list[int]                     # closing these detaches the programs
    peak_bytes: int | None = None              # the child's VmHWM: the compile's resident peak
    # Where the programs came from: "hit" (the cache), else compiled because
    # the cache had no record ("miss"), could not use it ("refused"; the
    # record is dropped and written again), was denied the bpf(2) calls
    # ("unprivileged"), or is "off". cache_note says why.
    cache: str = "off"
    cache_note: str = ""

    def close(self) -> None:
        for fd in [*self.attachments, *self.programs.values(), *self.maps.values()]:
            try:
                os.close(fd)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise
        self.attachments, self.programs, self.maps = [], {}, {}


class BuildProcess:
    """The child, started before the agent knows what to ask: it imports BCC
    (~0.2 s) while the agent reads its config and the kernel's features
    (unless the cache holds programs it will likely load instead), then
    waits for its one request. cancel() stops it if none comes. cache_dir:
    where compiled programs are kept (agent/probe/cache.py), None for none."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # This process's own agent package first, not one the working directory may hold.
        root = str(Path(agent.__file__).resolve().parent.parent)
        code = f"import sys; sys.path.insert(0, {root!r}); from agent.probe.build import main; main(sys.argv[1:])"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno()), str(cache_dir or "")],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()

    def cancel(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sock.close()


class PendingBuild:
    """The child at work; result() takes what it hands over, cancel() stops it.
    The agent does the rest of its start-up meanwhile. `process`: a child
    started ahead (BuildProcess), else one is started here."""

    def __init__(self, src: Path, cflags: list[str], mode: str, trace_ids: dict[str, int],
                 process: BuildProcess | None = None) -> None:
        self._process = process = process or BuildProcess()
        self._sock, self._proc = process.sock, process.proc
        try:
            self._sock.sendall(json.dumps({"src": str(src), "cflags": cflags, "mode": mode,
                                           "trace_ids": trace_ids}).encode())
        except OSError:
            process.cancel()
            raise BuildError(_no_answer(self._proc.returncode or 0)) from None

    def cancel(self) -> None:
        self._process.cancel()

    def result(self, timeout: float = BUILD_TIMEOUT_S) -> Built:
        """What the child handed over. Raises MapMemoryError,
        tracing.TracingError (the kernel refused the BTF-typed programs) or
        BuildError, each with the child's reason."""
        from agent.probe.tracing import TracingError  # noqa: PLC0415  (no bcc: only the error class)

        try:
            self._sock.settimeout(timeout)
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, MAX_FDS)
            except ConnectionResetError:  # it exited without a word
                data, fds = b"", []
        except socket.timeout:
            self.cancel()
            raise BuildError(f"the BPF build process gave no answer in {timeout:.0f} s") from None
        except BaseException:
            self.cancel()
            raise
        status = self._proc.wait()
        self._sock.close()
        if data:
            # The compiler's files were read into the page cache for this one
            # compile and nobody maps them now: dropped, or they would stay
            # charged to the agent's memory cgroup (~140 MiB: BENCHMARKS.md).
            _, error = drop_page_cache(json.loads(data).get("compiler_files", []))
            if error:
                log.warning("the compiler's page cache stays charged to this process's memory cgroup: %s", error)
        if not data:
            if status == -signal.SIGKILL:
                raise BuildKilledError()
            raise BuildError(_no_answer(status))
        reply = json.loads(data)
        if "error" in reply:
            for fd in fds:
                os.close(fd)
            if reply["kind"] == "enomem":
                raise MapMemoryError()
            if reply["kind"] == "tracing":
                raise TracingError(reply["error"])
            raise BuildError(reply["error"])
        return Built(maps={k: fds[i] for k, i in reply["maps"].items()},
                     types={k: tuple(v) for k, v in reply["types"].items()},
                     programs={k: fds[i] for k, i in reply["programs"].items()},
                     attachments=[fds[i] for i in reply["attachments"]], peak_bytes=reply["peak_bytes"],
                     cache=reply.get("cache", "off"), cache_note=reply.get("cache_note", ""))


def _no_answer(status: int) -> str:
    """Why the child handed nothing over, from its exit status."""
    if status < 0:
        return f"the BPF build process was killed by {signal.Signals(-status).name} before handing over the programs"
    return f"the BPF build process exited with status {status} before handing over the programs"


def _bcc_maps(bpf) -> tuple[dict[str, int], dict[str, tuple[str, str]]]:
    """Every map of the compiled module: name -> fd, and BCC's key/value type descriptions."""
    lib = __import__("bcc").libbcc.lib
    for fn, restype in (("bpf_num_tables", ct.c_ulonglong), ("bpf_table_name", ct.c_char_p),
                        ("bpf_table_fd_id", ct.c_int), ("bpf_table_key_desc_id", ct.c_char_p),
                        ("bpf_table_leaf_desc_id", ct.c_char_p)):
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = [ct.c_void_p] if fn == "bpf_num_tables" else [ct.c_void_p, ct.c_ulonglong]
    fds, types = {}, {}
    for i in range(lib.bpf_num_tables(bpf.module)):
        name = lib.bpf_table_name(bpf.module, i).decode()
        fds[name] = lib.bpf_table_fd_id(bpf.module, i)
        types[name] = ((lib.bpf_table_key_desc_id(bpf.module, i) or b"").decode(),
                       (lib.bpf_table_leaf_desc_id(bpf.module, i) or b"").decode())
    return fds, types


def detach_watch_programs(bpf) -> None:
    """BCC attaches every raw-tracepoint program as it loads them; the
    WATCH_TRACEPOINTS ones are the agent's to attach while it watches."""
    for name in WATCH_TRACEPOINTS:
        if name.encode() in bpf.raw_tracepoint_fds:
            bpf.detach_raw_tracepoint(tp=name.encode())


def _compile_and_attach(request: dict) -> tuple[dict, list[int], Callable[[str], Programs] | None]:
    """Compile, load, attach: the reply, its fds, and what records the
    result for the cache (given the key)."""
    from bcc import BPF  # noqa: PLC0415  (only this process maps the compiler)

    from agent.probe.tracing import TracingPrograms  # noqa: PLC0415

    try:
        bpf = BPF(src_file=request["src"].encode(), cflags=request["cflags"])
    except Exception:
        # libbcc's errno when it gave up (ctypes keeps it): ENOMEM is a map
        # the kernel could not charge, BCC's message says "failed to compile".
        if ct.get_errno() == errno.ENOMEM:
            return {"error": "ENOMEM", "kind": "enomem"}, [], None
        raise
    maps, types = _bcc_maps(bpf)
    programs = {name.decode().rsplit("__", 1)[-1]: fn.fd for name, fn in bpf.funcs.items()}
    detach_watch_programs(bpf)
    attachments = [*bpf.tracepoint_fds.values(), *bpf.raw_tracepoint_fds.values()]
    if request["mode"] == "btf":
        tracing = TracingPrograms(bpf, request["trace_ids"])
        tracing.attach(TRACEPOINTS)
        programs.update(tracing.prog_fds)
        attachments += tracing.link_fds
    reply, fds = _reply(maps, types, programs, attachments,
                        compiler_files(Path("/proc/self/maps").read_text()))

    return reply, fds, lambda key: _record(key, bpf, request["trace_ids"], maps, types, programs)


def _record(key: str, bpf, trace_ids: dict[str, int], maps: dict[str, int], types: dict[str, tuple[str, str]],
            programs: dict[str, int]) -> Programs:
    """What loading the compiled programs again needs (agent/probe/cache.py),
    from BCC's module and the kernel's own description of what it loaded."""
    from agent.probe.bpfsys import map_info, prog_info  # noqa: PLC0415
    from agent.probe.cache import MapDef, ProgramDef, relocate  # noqa: PLC0415
    from agent.probe.layout import INNER_MAPS  # noqa: PLC0415
    from agent.probe.tracing import BPF_TRACE_RAW_TP, PREFIX  # noqa: PLC0415

    lib = __import__("bcc").libbcc.lib
    defs = []
    for name, fd in maps.items():
        info = map_info(fd)
        defs.append(MapDef(name, info.type, info.key_size, info.value_size, info.max_entries, info.flags, info.name,
                           *types[name], inner=INNER_MAPS.get(name)))
    index = {fd: i for i, fd in enumerate(maps.values())}
    # (function in the module, tracepoint, attach, category, BTF id of the tracepoint)
    functions = [(PREFIX + name.encode(), name, "btf", "", btf_id) for name, btf_id in trace_ids.items()]
    for fname in bpf.funcs:
        kind, *where = fname.decode().split("__")
        if kind not in ("tracepoint", "raw_tracepoint"):
            raise CacheProblem(f"the compiled {fname.decode()} program is of a kind the cache cannot attach")
        classic = kind == "tracepoint"
        functions.append((fname, where[-1], "perf" if classic else "raw", where[0] if classic else "", 0))
    progs = []
    for fname, name, attach, category, btf_id in functions:
        prog_type, kernel_name, _ = prog_info(programs[name])
        insns, refs = relocate(bpf.dump_func(fname), index)
        progs.append(ProgramDef(name, kernel_name, prog_type, attach, insns, refs, category,
                                BPF_TRACE_RAW_TP if attach == "btf" else 0, btf_id))
    return Programs(key=key, license=lib.bpf_module_license(bpf.module).decode(),
                    kern_version=int(lib.bpf_module_kern_version(bpf.module)), maps=tuple(defs),
                    programs=tuple(progs))


def _reply(maps: dict[str, int], types: dict[str, tuple[str, str]], programs: dict[str, int],
           attachments: list[int], compiler: list[str]) -> tuple[dict, list[int]]:
    """The reply to the agent, with its fds in the order the reply's indices name."""
    fds: list[int] = []

    def index(fd: int) -> int:
        fds.append(fd)
        return len(fds) - 1

    reply = {"maps": {k: index(fd) for k, fd in maps.items()}, "types": types,
             "programs": {k: index(fd) for k, fd in programs.items()},
             "attachments": [index(fd) for fd in attachments], "peak_bytes": resident_peak(),
             "compiler_files": compiler}
    return reply, fds


def _from_cache(cache: ProgramCache, key: str) -> tuple[dict, list[int]]:
    """The programs of the record `key`, created, loaded and attached without
    the compiler. Raises CacheProblem (the message says why) for anything
    that makes the record unusable, OSError(ENOMEM) for the memory limit,
    PermissionError where this process may not load programs at all (the
    record is kept: the compile fails the same way and says so)."""
    from agent.probe import bpfload  # noqa: PLC0415
    from agent.probe.bpfsys import ProgramRefused  # noqa: PLC0415
    from agent.probe.features import find_tracefs  # noqa: PLC0415

    programs = cache.read(key)
    try:
        loaded = bpfload.load(programs, find_tracefs() or Path("/sys/kernel/tracing"))
    except ProgramRefused as e:
        if e.errno == errno.EPERM:   # a capability, not the program: the verifier answers EACCES or EINVAL
            raise PermissionError(errno.EPERM, str(e)) from None
        cache.discard(key)
        raise CacheProblem(f"{e} (a cached program)") from None
    except CacheProblem:
        cache.discard(key)
        raise
    except OSError as e:
        if e.errno in (errno.ENOMEM, errno.EPERM):
            raise
        raise CacheProblem(f"the cached programs could not be loaded: {e}") from None
    types = {m.name: (m.key_desc, m.value_desc) for m in programs.maps}
    return _reply(loaded.maps, types, loaded.programs, loaded.attachments, [])


def _key(request: dict) -> str:
    return cache_key(Path(request["src"]).parent, request["cflags"], request["mode"], request["trace_ids"],
                     agent.__version__, kernel_identity())


def _serve(request: dict, cache: ProgramCache | None) -> tuple[dict, list[int]]:
    """The reply to one request: from the cache if it can, else compiled (and recorded)."""
    key, state, note = None, "off", ""
    if cache is not None and not cache.has_records():
        # Nothing to read: the key is hashed after the compile, whose peak
        # then holds no hashing library (agent/probe/cache.py).
        state, note = "miss", f"no compiled programs in {cache.dir}"
    elif cache is not None:
        try:
            key = _key(request)
            reply, fds = _from_cache(cache, key)
            reply.update(cache="hit", cache_note=str(cache.path(key)))
            return reply, fds
        except CacheMiss as e:
            state, note = "miss", str(e)
        except CacheProblem as e:
            state, note = "refused", str(e)
        except OSError as e:
            if e.errno == errno.ENOMEM:
                return {"error": "ENOMEM", "kind": "enomem"}, []
            # EPERM: the compile meets the same refusal and names it; the record stays.
            state, note = ("unprivileged" if e.errno == errno.EPERM else "refused"), f"the cache cannot be used: {e}"
        except Exception as e:  # noqa: BLE001  (whatever a record does wrong, the compile is the answer)
            if key:
                cache.discard(key)
            state, note = "refused", f"the cached programs could not be used ({type(e).__name__}: {e})"
    reply, fds, record = _compile_and_attach(request)
    if cache is None or "error" in reply:
        reply.update(cache=state, cache_note=note)
        return reply, fds
    try:
        note += f"; compiled and stored in {cache.store(record(key or _key(request)))}"
    except Exception as e:  # noqa: BLE001  (the programs are attached: a record that fails only costs the next start)
        note += f"; compiled, not stored: {e}"
    reply.update(cache=state, cache_note=note)
    return reply, fds


def main(argv: list[str]) -> int:
    """The child: one request in, one reply (with the fds) out, then exit
    without BCC's clean-up. argv: the socket's fd, the cache directory ("" for none)."""
    sock = socket.socket(fileno=int(argv[0]))
    cache = ProgramCache(Path(argv[1])) if len(argv) > 1 and argv[1] else None
    status = 0
    try:
        if cache is None or not cache.has_records():
            try:  # imported before the request comes, while the agent is still starting
                import bcc  # noqa: F401, PLC0415

                import agent.probe.tracing  # noqa: F401, PLC0415
            except Exception:  # noqa: BLE001  (the compile imports them again and answers with the reason)
                pass
        message = sock.recv(MAX_MESSAGE)
        if not message:  # the agent gave up before asking (a bad config, no privileges)
            os._exit(0)
        request = json.loads(message)
        try:
            reply, fds = _serve(request, cache)
        except Exception as e:  # noqa: BLE001  (BCC raises bare Exception; the message goes to the agent)
            from agent.probe.tracing import TracingError  # noqa: PLC0415

            reply, fds = {"error": str(e).strip() or type(e).__name__,
                          "kind": "tracing" if isinstance(e, TracingError) else "other"}, []
        socket.send_fds(sock, [json.dumps(reply).encode()], fds)
    except BaseException as e:  # noqa: BLE001  (the agent sees the exit status and this line)
        print(f"slatrace BPF build: {e}", file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The compiled BPF programs, kept on disk so that a restart loads them
without the compiler.

Compiling bpf/sched.bpf.c takes about a second of clang, the largest part of
a start. What the compile yields is fixed by its inputs: the source files,
the -D values (which carry the running kernel's offsets and the map sizes),
the attach mode, the kernel itself and the agent's version. So after a
compile the build process (agent/probe/build.py) records what loading needs,
and the next start with the same inputs loads that record with bpf(2)
(agent/probe/bpfload.py) instead:

- each program's instructions as BCC produced them, with every map reference
  (a 16-byte load whose immediate is a map's fd) zeroed and listed as
  (instruction, map index) to be patched with the new map's fd;
- each map's definition as the kernel holds it (type, key and value size,
  entries, flags, name), BCC's descriptions of its key and value types, and
  for a map of maps the map it was created from;
- each program's type, kernel name, attach point, and for a BTF-typed
  tracepoint its expected attach type and the BTF id of the tracepoint;
- the license and kernel version the programs were loaded with.

The key is a hash of all the inputs; a record is one file named by it,
written whole under a temporary name and renamed, with a hash of its body in
its first line. Whatever is wrong with a record (absent, cut short, another
key, another format, a file others may write) is a CacheProblem: the build
process compiles instead and says why in one log line. Nothing here loads,
imports bcc or touches the kernel but to read who it is.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = 1
MAGIC = "slatrace-bpf-cache"
SUFFIX = ".bpfcache"
KEEP = 4                 # records kept: one per attach mode and size set a node may switch between
VMLINUX = Path("/sys/kernel/btf/vmlinux")
DEFAULT_DIR = Path("/var/cache/slatrace/bpf")

# A 16-byte load of a 64-bit immediate (BPF_LD | BPF_IMM | BPF_DW) whose
# source register says the immediate is a map's fd (BPF_PSEUDO_MAP_FD) or a
# map's fd and an offset into its value (BPF_PSEUDO_MAP_VALUE).
LD_IMM64 = 0x18
PSEUDO_MAP_FD = 1
PSEUDO_MAP_VALUE = 2


class CacheProblem(Exception):
    """Why a record cannot be used; the message ends the log line."""


class CacheMiss(CacheProblem):
    """No record for this key: a first start, or the inputs changed."""


@dataclass(frozen=True)
class MapDef:
    name: str                # the map's name in the source (bpf/sched.bpf.c)
    type: int                # enum bpf_map_type
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    kernel_name: str         # as the kernel shows it (15 characters at most)
    key_desc: str            # BCC's JSON description of the key type
    value_desc: str
    inner: str | None = None  # a map of maps: the map whose shape its entries have


@dataclass(frozen=True)
class ProgramDef:
    name: str                # the tracepoint
    kernel_name: str
    type: int                # enum bpf_prog_type
    attach: str              # "perf" (classic tracepoint), "raw" (raw tracepoint), "btf" (BTF-typed)
    insns: bytes             # map references zeroed
    map_refs: tuple[tuple[int, int], ...]   # (instruction index, index into Programs.maps)
    category: str = ""       # a classic tracepoint's subsystem (tracefs events/<category>/<name>)
    expected_attach_type: int = 0
    attach_btf_id: int = 0


@dataclass(frozen=True)
class Programs:
    """Everything a load without the compiler needs."""

    key: str
    license: str
    kern_version: int
    maps: tuple[MapDef, ...]
    programs: tuple[ProgramDef, ...]


def _sha256():
    """hashlib, imported when something is hashed: it maps OpenSSL's libcrypto
    (~4 MiB resident), which a first start's build process then takes on
    only after its compile's peak."""
    import hashlib  # noqa: PLC0415

    return hashlib.sha256()


def _hex(data: bytes) -> str:
    h = _sha256()
    h.update(data)
    return h.hexdigest()


def kernel_identity(btf: Path = VMLINUX) -> dict[str, str]:
    """Who the running kernel is: its release and build, and a hash of its
    BTF, which changes with any change to the types the offsets come from."""
    u = os.uname()
    h = _sha256()
    # In pieces: a 5 MiB read would raise malloc's mmap threshold and stay in
    # the heap of the process that compiles next.
    chunk = bytearray(1 << 16)
    try:
        with open(btf, "rb", buffering=0) as f:
            while n := f.readinto(chunk):
                h.update(memoryview(chunk)[:n])
        btf_hash = h.hexdigest()
    except OSError:
        btf_hash = "none"
    return {"release": u.release, "build": u.version, "machine": u.machine, "btf": btf_hash}


def cache_key(src_dir: Path, cflags: list[str], mode: str, trace_ids: dict[str, int], version: str,
              kernel: dict[str, str]) -> str:
    """The hash of every input of a compile: each file of the BPF source
    directory, the compiler's flags, the attach mode and the BTF ids of the
    tracepoints, the agent's version, the kernel."""
    sources = {p.name: _hex(p.read_bytes()) for p in sorted(src_dir.iterdir()) if p.is_file()}
    doc = {"format": FORMAT, "sources": sources, "cflags": list(cflags), "mode": mode,
           "trace_ids": sorted(trace_ids.items()), "version": version, "kernel": kernel}
    return _hex(json.dumps(doc, sort_keys=True).encode())


def relocate(insns: bytes, map_fds: dict[int, int]) -> tuple[bytes, tuple[tuple[int, int], ...]]:
    """The instructions with every map fd zeroed, and where each was: (index,
    map index). map_fds: fd -> map index. CacheProblem for a reference to a
    map that is not one of the module's (it could not be recreated)."""
    if len(insns) % 8:
        raise CacheProblem(f"a program of {len(insns)} bytes is not whole instructions")
    out = bytearray(insns)
    refs = []
    i = 0
    while i < len(insns) // 8:
        code, regs = insns[8 * i], insns[8 * i + 1]
        if code == LD_IMM64:
            if regs >> 4 in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE):
                fd = int.from_bytes(insns[8 * i + 4:8 * i + 8], "little", signed=True)
                if fd not in map_fds:
                    raise CacheProblem(f"instruction {i} refers to fd {fd}, which is none of the module's maps")
                refs.append((i, map_fds[fd]))
                out[8 * i + 4:8 * i + 8] = bytes(4)
            i += 2   # the second half of the 16-byte load
            continue
        i += 1
    return bytes(out), tuple(refs)


def patch(program: ProgramDef, fds: list[int]) -> bytes:
    """The program's instructions with the maps' new fds (fds: by map index)."""
    out = bytearray(program.insns)
    for i, m in program.map_refs:
        if not 0 <= 8 * i < len(out) or out[8 * i] != LD_IMM64 or not 0 <= m < len(fds):
            raise CacheProblem(f"the {program.name} program's map reference at instruction {i} is not a map load")
        out[8 * i + 4:8 * i + 8] = fds[m].to_bytes(4, "little")
    return bytes(out)


def encode(programs: Programs) -> bytes:
    """The record file: one header line with the body's hash, then the body (JSON)."""
    doc = asdict(programs)
    for p in doc["programs"]:
        p["insns"] = base64.b64encode(p["insns"]).decode()
    body = json.dumps(doc, separators=(",", ":")).encode()
    return f"{MAGIC} {FORMAT} {_hex(body)}\n".encode() + body


def decode(data: bytes, key: str) -> Programs:
    """The record in `data`, which must be `key`'s; CacheProblem otherwise."""
    header, _, body = data.partition(b"\n")
    parts = header.decode(errors="replace").split()
    if len(parts) != 3 or parts[0] != MAGIC:
        raise CacheProblem("not a program cache record")
    if parts[1] != str(FORMAT):
        raise CacheProblem(f"a record of format {parts[1]}, this agent reads {FORMAT}")
    if _hex(body) != parts[2]:
        raise CacheProblem("the record is damaged (its hash does not match)")
    try:
        doc = json.loads(body)
        maps = tuple(MapDef(**m) for m in doc["maps"])
        progs = tuple(ProgramDef(**{**p, "insns": base64.b64decode(p["insns"], validate=True),
                                    "map_refs": tuple((int(i), int(m)) for i, m in p["map_refs"])})
                      for p in doc["programs"])
        programs = Programs(key=doc["key"], license=doc["license"], kern_version=int(doc["kern_version"]),
                            maps=maps, programs=progs)
    except (ValueError, KeyError, TypeError) as e:
        raise CacheProblem(f"the record does not parse ({type(e).__name__}: {e})") from None
    if programs.key != key:
        raise CacheProblem("the record is another compile's")
    if not programs.programs:
        raise CacheProblem("the record holds no program")
    return programs


class ProgramCache:
    """Records in one directory, one file per key; the newest KEEP stay."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def path(self, key: str) -> Path:
        return self.dir / f"{key[:32]}{SUFFIX}"

    def has_records(self) -> bool:
        """Whether any record is there: a start with none will compile, so the
        build process imports BCC ahead."""
        try:
            return any(p.suffix == SUFFIX and not p.name.startswith(".") for p in self.dir.iterdir())
        except OSError:
            return False

    def read(self, key: str) -> Programs:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                _check_owner(os.fstat(f.fileno()), path)
                _check_owner(os.stat(self.dir), self.dir)
                data = f.read()
        except FileNotFoundError:
            raise CacheMiss(f"no compiled programs for this kernel and build in {self.dir}") from None
        except OSError as e:
            raise CacheProblem(f"cannot read {path}: {e.strerror or e}") from None
        return decode(data, key)

    def store(self, programs: Programs) -> Path:
        """Write the record (atomically) and drop all but the newest KEEP; OSError if the directory refuses."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_owner(os.stat(self.dir), self.dir, OSError)
        path = self.path(programs.key)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode(programs))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._prune()
        return path

    def discard(self, key: str) -> None:
        """Remove a record the kernel refused or that is damaged: the compile rewrites it."""
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def _prune(self) -> None:
        """Keep the newest KEEP records; drop what a writer killed mid-way left (a day old)."""
        try:
            files = [p for p in self.dir.iterdir() if p.suffix == SUFFIX]
            records = sorted((p for p in files if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime,
                             reverse=True)
            stale = [p for p in files if p.name.startswith(".") and p.stat().st_mtime < time.time() - 86400]
        except OSError:
            return
        for old in records[KEEP:] + stale:
            try:
                old.unlink()
            except OSError:
                pass


def _check_owner(st: os.stat_result, path: Path, error: type[Exception] = CacheProblem) -> None:
    """Programs loaded into the kernel come from here: the record and its
    directory must be this user's, writable by no one else."""
    if st.st_uid != os.geteuid():
        raise error(f"{path} belongs to uid {st.st_uid}, not this process's {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise error(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")

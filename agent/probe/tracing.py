"""Loads and attaches BTF-typed tracepoint programs (tp_btf), which BCC
compiles but cannot load.

A tp_btf program is a BPF_PROG_TYPE_TRACING program whose attach point is
the kernel's BTF type of the tracepoint (the typedef btf_trace_<name>): the
verifier then knows its arguments as typed kernel pointers, which is what
task-local storage needs. BCC 0.26 loads tracing programs only for function
entry and exit, so the programs it compiled (bpf/sched.bpf.c, named
tp_btf__<tracepoint>) are taken from its module as instructions, with the
maps' file descriptors already in them, and loaded here with the bpf(2)
system call. The attributes are the kernel's stable ABI
(include/uapi/linux/bpf.h); a field this module does not set stays zero.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os

from agent.errors import SlatraceError
from agent.probe.features import syscall

# bpf(2) commands, program type and attach type (include/uapi/linux/bpf.h)
BPF_PROG_LOAD = 5
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_PROG_TYPE_TRACING = 26
BPF_TRACE_RAW_TP = 23
PREFIX = b"tp_btf__"
LOG_SIZE = 1 << 20


class TracingError(SlatraceError):
    """The kernel refused a BTF-typed tracepoint program."""


class _ProgLoad(ct.Structure):
    _fields_ = [("prog_type", ct.c_uint32), ("insn_cnt", ct.c_uint32), ("insns", ct.c_uint64),
                ("license", ct.c_uint64), ("log_level", ct.c_uint32), ("log_size", ct.c_uint32),
                ("log_buf", ct.c_uint64), ("kern_version", ct.c_uint32), ("prog_flags", ct.c_uint32),
                ("prog_name", ct.c_char * 16), ("prog_ifindex", ct.c_uint32),
                ("expected_attach_type", ct.c_uint32), ("prog_btf_fd", ct.c_uint32),
                ("func_info_rec_size", ct.c_uint32), ("func_info", ct.c_uint64), ("func_info_cnt", ct.c_uint32),
                ("line_info_rec_size", ct.c_uint32), ("line_info", ct.c_uint64), ("line_info_cnt", ct.c_uint32),
                ("attach_btf_id", ct.c_uint32), ("attach_prog_fd", ct.c_uint32)]


class _RawTracepointOpen(ct.Structure):
    _fields_ = [("name", ct.c_uint64), ("prog_fd", ct.c_uint32), ("_pad", ct.c_uint32)]


def _bpf(cmd: int, attr: ct.Structure) -> int:
    """The fd bpf(2) returned, or -errno."""
    return syscall("bpf", ct.c_int(cmd), ct.byref(attr), ct.c_uint(ct.sizeof(attr)))


class TracingPrograms:
    """The tp_btf__ programs of a compiled BCC module, loaded; attach() and
    detach() switch them on and off (the benchmark toggles them), close()
    releases them. names: tracepoint name -> BTF type id of its btf_trace_
    typedef."""

    def __init__(self, bpf, trace_ids: dict[str, int]) -> None:
        lib = __import__("bcc").libbcc.lib
        self.prog_fds: dict[str, int] = {}
        self._links: dict[str, int] = {}
        try:
            license_ = lib.bpf_module_license(bpf.module)
            for name, btf_id in trace_ids.items():
                fn = PREFIX + name.encode()
                start = lib.bpf_function_start(bpf.module, fn)
                size = lib.bpf_function_size(bpf.module, fn)
                if not start or not size:
                    raise TracingError(f"the compiled programs have no {fn.decode()}")
                self.prog_fds[name] = self._load(name, start, size, license_, btf_id)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _load(name: str, insns: int, size: int, license_: bytes, btf_id: int) -> int:
        attr = _ProgLoad(prog_type=BPF_PROG_TYPE_TRACING, insn_cnt=size // 8, insns=insns,
                         license=ct.cast(ct.c_char_p(license_), ct.c_void_p).value,
                         prog_name=name.encode()[:15], expected_attach_type=BPF_TRACE_RAW_TP,
                         attach_btf_id=btf_id)
        fd = _bpf(BPF_PROG_LOAD, attr)
        if fd >= 0:
            return fd
        # Again with the verifier's log, for the message.
        log = ct.create_string_buffer(LOG_SIZE)
        attr.log_level, attr.log_size, attr.log_buf = 1, LOG_SIZE, ct.addressof(log)
        fd = _bpf(BPF_PROG_LOAD, attr)
        if fd >= 0:
            return fd
        # The verifier's reason is its last line but the statistics it ends with.
        lines = [ln for ln in log.value.decode(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith(("processed ", "verification time"))]
        why = lines[-1] if lines else os.strerror(-fd)
        raise TracingError(f"the kernel refused the BTF-typed {name} program ({os.strerror(-fd)}): {why}")

    def attach(self) -> None:
        for name, fd in self.prog_fds.items():
            if name in self._links:
                continue
            link = _bpf(BPF_RAW_TRACEPOINT_OPEN, _RawTracepointOpen(name=0, prog_fd=fd))
            if link < 0:
                raise TracingError(f"cannot attach the BTF-typed {name} program ({os.strerror(-link)})")
            self._links[name] = link

    @property
    def link_fds(self) -> list[int]:
        """The attachments: closing them detaches the programs."""
        return list(self._links.values())

    def detach(self) -> None:
        for link in self._links.values():
            os.close(link)
        self._links.clear()

    def close(self) -> None:
        self.detach()
        for fd in self.prog_fds.values():
            try:
                os.close(fd)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise
        self.prog_fds.clear()

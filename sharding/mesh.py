"""Device meshes from a spec string, multi-slice (ICI × DCN) layouts, and multi-host start-up.

A mesh spec names each mesh axis and its size: `"data=2,fsdp=4,tensor=1"`. Axes are laid out in a
canonical order, slowest-communicating first — `data`, `fsdp`, `tensor`, then any others in the
order given — because `mesh_utils` assigns the last axes to the closest devices (tensor
parallelism all-reduces every layer; data parallelism once a step).

On a multi-slice TPU pod (or several GPU hosts) part of an axis crosses the slower data-centre
network (DCN). `dcn={"data": 2}` says that `data` spans 2 slices/hosts; the rest of every axis
stays inside a slice, on the chip interconnect (ICI).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

# Slowest-communicating first: mesh_utils gives the trailing axes the nearest devices.
CANONICAL_AXES = ("data", "fsdp", "tensor")

MeshSpec = str | Mapping[str, int]


def parse_mesh_spec(spec: MeshSpec, num_devices: int | None = None) -> dict[str, int]:
    """`"data=2,fsdp=4,tensor=1"` → `{"data": 2, "fsdp": 4, "tensor": 1}` in canonical order.

    Any identifier is a valid axis name (strategies ignore axes they do not use). With
    `num_devices`, the product of the sizes must equal it.
    """
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in (p.strip() for p in str(spec).split(",")):
            if not part:
                continue
            name, sep, size = part.partition("=")
            if not sep:
                raise ValueError(f"mesh spec {spec!r}: {part!r} is not of the form name=size")
            items.append((name.strip(), size.strip()))
    if not items:
        raise ValueError(f"mesh spec {spec!r} names no axis (expected e.g. 'data=2,fsdp=4')")
    sizes: dict[str, int] = {}
    for name, size in items:
        if not name.isidentifier():
            raise ValueError(f"mesh spec {spec!r}: axis name {name!r} is not an identifier")
        if name in sizes:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        try:
            n = int(size)
        except (TypeError, ValueError):
            n = 0
        if isinstance(size, bool) or n < 1 or str(n) != str(size).strip():
            raise ValueError(
                f"mesh spec {spec!r}: size of axis {name!r} is {size!r}, expected a positive int"
            )
        sizes[name] = n
    total = math.prod(sizes.values())
    if num_devices is not None and total != num_devices:
        raise ValueError(
            f"mesh spec {spec!r} has {total} devices ({' x '.join(map(str, sizes.values()))}) "
            f"but there are {num_devices} devices"
        )
    return _canonical(sizes)


def _canonical(sizes: Mapping[str, int]) -> dict[str, int]:
    first = [a for a in CANONICAL_AXES if a in sizes]
    return {a: sizes[a] for a in first + [a for a in sizes if a not in CANONICAL_AXES]}


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    """The inverse of `parse_mesh_spec`: `{"data": 2, "fsdp": 4}` → `"data=2,fsdp=4"`."""
    return ",".join(f"{a}={n}" for a, n in sizes.items())


def split_dcn(sizes: Mapping[str, int], dcn: MeshSpec | None) -> tuple[dict[str, int], dict[str, int]]:
    """(ICI sizes, DCN sizes) per axis, with `ici[a] * dcn[a] == sizes[a]`; `dcn` as a mapping or
    a spec string (`"data=2"`)."""
    dcn = parse_mesh_spec(dcn) if isinstance(dcn, str) else dict(dcn or {})
    unknown = sorted(set(dcn) - set(sizes))
    if unknown:
        raise ValueError(f"dcn names axes {unknown} that the mesh {format_mesh_spec(sizes)!r} does not have")
    ici = {}
    for a, n in sizes.items():
        d = dcn.get(a, 1)
        if isinstance(d, bool) or not isinstance(d, int) or d < 1 or n % d:
            raise ValueError(f"dcn size {d!r} of axis {a!r} must be a positive int dividing its size {n}")
        ici[a] = n // d
    return ici, {a: dcn.get(a, 1) for a in sizes}


def device_grid(sizes: Mapping[str, int], dcn: MeshSpec | None, devices: Sequence[Any]) -> np.ndarray:
    """Devices arranged as an array of shape `sizes.values()`, topology-aware where JAX knows how.

    With a DCN part: slices (TPU `slice_index`) or else processes are the DCN granules, and each
    granule holds the ICI part of the mesh. Without: `create_device_mesh`, which falls back to a
    plain reshape for devices it has no topology for.
    """
    shape = tuple(sizes.values())
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh {format_mesh_spec(sizes)!r} has {math.prod(shape)} devices but there are {len(devices)}"
        )
    ici, dcn_sizes = split_dcn(sizes, dcn)
    n_granules = math.prod(dcn_sizes.values())
    if n_granules > 1:
        by_slice = hasattr(devices[0], "slice_index")
        granules = {getattr(d, "slice_index" if by_slice else "process_index") for d in devices}
        if len(granules) == 1 and all(d.platform == "cpu" for d in devices):
            # Virtual CPU devices (tests, the planner) stand in for a multi-host job: contiguous
            # blocks of the device list play the slices, as they do in a real hybrid mesh.
            return _hybrid_layout(
                np.asarray(devices, dtype=object), tuple(dcn_sizes.values()), tuple(ici.values())
            )
        if len(granules) != n_granules:
            kind = "slices" if by_slice else "processes"
            raise ValueError(
                f"dcn {format_mesh_spec(dcn_sizes)!r} spans {n_granules} {kind} "
                f"but the devices come from {len(granules)}"
            )
        return mesh_utils.create_hybrid_device_mesh(
            tuple(ici.values()), tuple(dcn_sizes.values()), devices, process_is_granule=not by_slice
        )
    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # A topology mesh_utils cannot tile (e.g. a TPU sub-slice shape): any order is still
        # correct, only the collectives may take longer paths.
        return np.asarray(devices, dtype=object).reshape(shape)


def _hybrid_layout(flat: np.ndarray, dcn: tuple[int, ...], ici: tuple[int, ...]) -> np.ndarray:
    """Granule-major devices → mesh where axis k's index is `dcn_index[k] * ici[k] + ici_index[k]`
    (the layout `create_hybrid_device_mesh` builds)."""
    n = len(dcn)
    grid = flat.reshape(dcn + ici)  # [d0, d1, ..., i0, i1, ...]
    grid = grid.transpose([j for k in range(n) for j in (k, n + k)])  # [d0, i0, d1, i1, ...]
    return grid.reshape(tuple(d * i for d, i in zip(dcn, ici, strict=True)))


def make_mesh(spec: MeshSpec, *, dcn: MeshSpec | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A `Mesh` over `devices` (default: all devices of all processes) for `spec`.

    Axes are `Auto`: shardings are propagated by the compiler from the constraints the strategy
    places on parameters and activations.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, len(devices))
    grid = device_grid(sizes, dcn, devices)
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def abstract_mesh(spec: MeshSpec) -> AbstractMesh:
    """A device-less mesh of the same shape, enough to compute shardings for a planner."""
    sizes = parse_mesh_spec(spec)
    return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


# ---- multi-host start-up ------------------------------------------------------------------------
# Environment variables that mean "this process is one of several": an explicit JAX coordinator,
# a multi-host TPU slice (GKE/QueuedResources set these), Open MPI, and SLURM with >1 task.
_MULTI_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri")


def _cluster_detected() -> bool:
    env = os.environ
    if any(v in env for v in _MULTI_PROCESS_ENV):
        return True
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return True
    # A Cloud TPU VM (libtpu installed, TPU chips attached): JAX reads the worker list from the
    # metadata server; a single-host VM gets a one-process job, which is harmless.
    tpu_chips = os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
    return tpu_chips and importlib.util.find_spec("libtpu") is not None


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Join the multi-process JAX job if there is one; True when running multi-process.

    Call it first thing, before any JAX computation. Every argument may be left out where JAX can
    detect the cluster (Cloud TPU pod slices, SLURM, Open MPI, `JAX_COORDINATOR_ADDRESS` with
    `JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`); on two GPU hosts pass the coordinator `host:port`,
    the number of processes and this host's id. Calling it again is a no-op, and so is calling it
    in a single process with nothing detected.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    explicit = coordinator is not None or (num_processes or 1) > 1 or process_id is not None
    if not explicit and not _cluster_detected():
        return False
    kw: dict[str, Any] = {}
    if coordinator is not None:
        kw["coordinator_address"] = coordinator
    nproc = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if nproc is not None:
        kw["num_processes"] = nproc
    if pid is not None:
        kw["process_id"] = pid
    jax.distributed.initialize(**kw)
    return jax.process_count() > 1


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else int(value)

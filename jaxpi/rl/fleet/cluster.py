"""The Ray cluster a GRPO run's rollouts run on: joined at `collect.ray_address`, or started for
the run on this machine.

    collect.backend=ray                                   a local cluster, started and stopped by the run
    collect.backend=ray collect.ray_address=HOST:PORT     a running one (`ray start --head ...`)

Ray is an optional dependency (`pip install 'jaxpi[ray]'`); it is imported when a run asks for
it. Ray 2.60 turns token authentication on for a cluster a driver starts (writing
`~/.ray/auth_token`), and `ray start` turns it on when that file exists; joining such a cluster,
the run sends the token too (`RAY_AUTH_MODE=token`), unless `RAY_AUTH_MODE` says otherwise. The processes Ray starts for the run's workers do not inherit the trainer's environment, so
the variables that decide what XLA compiles and where its cache lives (`XLA_FLAGS`,
`JAX_PLATFORMS`, `JAXPI_COMPILE_CACHE`, ...) are handed to them in the job's runtime environment:
a worker compiles exactly the programs the trainer would, which is what makes a Ray collection
token for token a local one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

# Variables a worker takes from the trainer (the first decide what XLA compiles and how).
PASSED_ENV = (
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "JAX_ENABLE_X64",
    "JAXPI_COMPILE_CACHE",
    "TF_CPP_MIN_LOG_LEVEL",
    "JAXPI_PI_PREFIX",
    "PYTHONPATH",
)


class FleetError(RuntimeError):
    """The Ray cluster cannot be used: not installed, not reachable, or too small for the run."""


def ray_module() -> Any:
    """`ray`, or a FleetError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise FleetError("collect.backend=ray needs Ray: pip install 'jaxpi[ray]' (ray==2.60.0)") from None
    return ray


def worker_env() -> dict[str, str]:
    """The trainer's variables the workers must run with."""
    return {k: os.environ[k] for k in PASSED_ENV if k in os.environ}


def _token_available() -> bool:
    """Whether Ray would find an authentication token here (its env variables or ~/.ray)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(path)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    address: str  # "" for a cluster started by this run
    started: bool  # started by this run (and stopped at its end)
    cpus: float
    nodes: int


@contextlib.contextmanager
def connect(address: str = "", *, cpus: int | None = None) -> Iterator[ClusterInfo]:
    """Join the cluster at `address` ("" starts one on this machine with `cpus` CPUs, default all)
    for the block; the driver detaches (and a cluster it started stops) when the block ends."""
    ray = ray_module()
    if ray.is_initialized():
        raise FleetError("a Ray driver is already connected in this process")
    kw: dict[str, Any] = {
        "runtime_env": {"env_vars": worker_env()},
        "logging_level": "ERROR",
        "log_to_driver": False,
        "configure_logging": False,
    }
    if address and "RAY_AUTH_MODE" not in os.environ and _token_available():
        # What `ray start` itself does (Ray 2.60): with a token on this machine the cluster it
        # started checks tokens, so the driver must send it too.
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        if address:
            ray.init(address=address, **kw)
        else:
            # "local": a new cluster, never one a `ray start` left on this machine (which
            # ray.init() without an address would join).
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, **kw)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise FleetError(f"cannot reach the Ray cluster at {address or 'a new local one'}: {e}") from e
    try:
        res = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        yield ClusterInfo(address, not address, float(res.get("CPU", 0.0)), nodes)
    finally:
        ray.shutdown()

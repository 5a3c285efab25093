"""The environments `jaxpi grpo` runs, by `env.name`: a registry of `EnvEntry`s.

"lookup" is the toy tool-lookup environment (`jaxpi.envs.toy`), collected by the trainer's own
agent loop; "pi" is real Pi sessions (`jaxpi.rl.pi_env`), which bring a collector of their own.
A new environment registers here with `register_env` (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpi.envs.toy import LookupEnv, make_tasks
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.fleet.collector import make_fleet_collector
from jaxpi.rl.fleet.pi import make_fleet_pi_collector
from jaxpi.rl.pi_env import PiCollector, make_pi_env


@dataclasses.dataclass(frozen=True)
class EnvEntry:
    """How the trainer gets an environment: `make(cfg) -> (env, task pool, held-out tasks)`,
    optionally its own collector class (same constructor and `run` as `Collector`), and how its
    collections run on a Ray fleet (`collect.backend=ray`): `fleet(cfg, policy, tokenizer, env,
    render_cfg, version, log)` -> a collector (default: rollout workers with engines of their own)."""

    make: Any
    collector: Any = None
    fleet: Any = make_fleet_collector


_ENVS: dict[str, EnvEntry] = {}


def register_env(name: str, make: Any, collector: Any = None, fleet: Any = make_fleet_collector) -> None:
    """Make `env.name: <name>` available to `jaxpi grpo`."""
    _ENVS[name] = EnvEntry(make, collector, fleet)


def env_entry(name: str) -> EnvEntry:
    if name not in _ENVS:
        raise ValueError(f"unknown env.name {name!r}; registered: {sorted(_ENVS)}")
    return _ENVS[name]


def make_env(cfg: GRPOConfig) -> tuple[Any, list[Any], list[Any]]:
    """(environment, training task pool, held-out tasks)."""
    return env_entry(cfg.env.name).make(cfg)


def _make_lookup(cfg: GRPOConfig) -> tuple[LookupEnv, list[Any], list[Any]]:
    e = cfg.env
    kw = {"keys_per_task": e.keys_per_task, "max_value": e.max_value}
    pool = make_tasks(e.train_tasks, e.seed, **kw)
    held = make_tasks(e.eval_tasks, e.seed + 1_000_003, **kw)
    return LookupEnv(), pool, held


register_env("lookup", _make_lookup)
register_env("pi", make_pi_env, PiCollector, make_fleet_pi_collector)

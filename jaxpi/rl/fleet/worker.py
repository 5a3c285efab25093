"""A rollout worker of the Ray fleet: one process with its own engine on the run's base, which
samples whole waves of attempts (`jaxpi.rl.collect.Wave`) with the adapter of a given version.

The worker builds its model as the trainer does (`load_hf` of the run's base, `add_lora` with the
run's LoRA shape) and takes the adapter's values from the trainer, by version: a wave names the
version it must be sampled with and carries a reference to that adapter in Ray's object store,
fetched only when the worker holds another one. A wave therefore never mixes versions, and a
worker that Ray restarted (its process died, its node left) picks up where it must from the next
wave it is given. The base is read from the same path on every node (a shared file system, the same
image, or a base the run builds deterministically, as the toy bases are).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxpi.convert.hf import load_hf
from jaxpi.data.render import load_tokenizer
from jaxpi.envs.agent_loop import Trajectory
from jaxpi.lora import LoraConfig, add_lora
from jaxpi.rl.collect import Wave, run_wave
from jaxpi.rl.config import GRPOConfig
from jaxpi.rollout.jax_engine import JaxEngine


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its engine (everything picklable)."""

    cfg: GRPOConfig
    base_dir: str
    tokenizer_dir: str
    lora: LoraConfig
    batch_size: int  # engine rows: the wave size
    env: Any  # the environment object the agent loop calls (`run_tool`, `verify`)
    render_cfg: Any


@dataclasses.dataclass(frozen=True)
class WaveResult:
    trajectories: list[Trajectory]
    version: int  # the adapter version that sampled every attempt of the wave
    seconds: float  # the worker's time on it (engine and environment)
    started: float  # wall clock when the worker began it (queue wait = started - submitted)
    worker: str  # host:pid


class RolloutWorker:
    """Wrapped by `ray.remote` in `jaxpi.rl.fleet.collector`; also usable in-process (tests)."""

    def __init__(self, spec: WorkerSpec) -> None:
        c = spec.cfg
        _, model = load_hf(spec.base_dir, jnp.dtype(c.model.dtype), config_overrides=c.model.overrides())
        add_lora(model, spec.lora, key=jax.random.key(0))  # the values come with the first wave
        self.engine = JaxEngine(model, max_len=c.collect.max_context, batch_size=spec.batch_size)
        self.spec, self.tok = spec, load_tokenizer(spec.tokenizer_dir)
        self.version: int | None = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def info(self) -> dict[str, Any]:
        return {"worker": self.name, "pid": os.getpid(), "version": self.version}

    def run(self, wave: Wave, version: int, adapter: list[Any]) -> WaveResult:
        """Sample `wave` with adapter `version` (`adapter[0]`: its object reference, resolved only
        when this worker holds another version)."""
        started = time.time()
        if self.version != version:
            state, ray = adapter[0], sys.modules.get("ray")
            if ray is not None and isinstance(state, ray.ObjectRef):  # in a Ray worker: fetch it once
                state = ray.get(state)
            self.engine.update_weights(state)
            self.version = version
        t0 = time.perf_counter()
        s = self.spec
        trajs = run_wave(s.cfg, self.engine, self.tok, s.env, s.render_cfg, wave)
        return WaveResult(trajs, version, time.perf_counter() - t0, started, self.name)

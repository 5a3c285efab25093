"""Where a GRPO run's attempts come from: the rollout engine, the environment's collector on it,
and what keeps the engine's policy the trainer's.

With `collect.engine=jax` the engine is a `JaxEngine` on the trainer's own weights, updated in
place after every update. With `collect.engine=vllm` it is a vLLM server (`jaxpi.vllm`): before
each collection the current adapter is exported to `vllm_adapters/policy-v{N}`, loaded into the
server and probed (vLLM's log-probs of a fixed sequence must match the trainer's for the same
adapter; results in probes.jsonl). A collection the server fails (down, killed, timing out,
replying nonsense) is discarded whole, its lost attempts logged to failures.jsonl with the reason
and counted in the next metrics record (`Sampler.take_pending`); it is redone up to
`collect.collection_retries` times, then the run stops (`CollectionFailedError`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.envs.agent_loop import Trajectory
from jaxpi.rl.collect import admit_fresh
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.policy import Policy
from jaxpi.rl.progress import CollectionProgress
from jaxpi.rollout.jax_engine import JaxEngine
from jaxpi.train.checkpoint import CheckpointStore
from jaxpi.vllm.rollouts import RECOVERABLE, VLLMBackend, VLLMSettings


class CollectionFailedError(RuntimeError):
    """The rollout engine failed a collection more often than `collect.collection_retries` allows."""


def start_vllm(cfg: GRPOConfig, pol: Policy, run_dir: Path, out: Any) -> VLLMBackend:
    """The vLLM backend for this run: a server on the base checkpoint unless `collect.vllm_url`."""
    c = cfg.collect
    settings = VLLMSettings(
        url=c.vllm_url,
        max_len=c.max_context,
        batch_size=c.engine_batch or cfg.rows,
        concurrency=c.vllm_concurrency,
        timeout_s=c.request_timeout_s,
        retries=c.request_retries,
        wait_s=c.retry_wait_s,
        probe_tol=c.probe_tol,
        keep_versions=c.max_staleness + 1,
    )
    backend = VLLMBackend(
        settings,
        pol.base_dir,
        pol.lora,
        pol.model_cfg.vocab_size,
        run_dir / "vllm_adapters",
        log=lambda msg: print(msg, file=out, flush=True),
    )
    try:
        backend.start()
    except BaseException:
        backend.close()
        raise
    return backend


def open_engine(cfg: GRPOConfig, pol: Policy, run_dir: Path, out: Any) -> tuple[Any, VLLMBackend | None]:
    """The rollout engine of `collect.engine`, and the vLLM backend behind it (None for jax)."""
    if cfg.collect.engine == "vllm":
        backend = start_vllm(cfg, pol, run_dir, out)
        return backend.engine, backend
    engine = JaxEngine(
        nnx.merge(pol.graphdef, pol.train, pol.rest),
        max_len=cfg.collect.max_context,
        batch_size=cfg.collect.engine_batch or cfg.rows,
    )
    return engine, None


class Sampler:
    """Collections on the engine (`open_engine`) by the environment's collector on it.

    `pol.train` is read at every push: the trainer replaces it after each update. `logp` is the
    run's log-prob program (`Programs.logp`), for the vLLM probe; `store` names the last
    checkpoint when the run has to stop.
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        pol: Policy,
        logp: Callable[[Any, Any, jax.Array], jax.Array],
        engine: Any,
        backend: VLLMBackend | None,
        collector: Any,
        run_dir: Path,
        store: CheckpointStore,
        out: Any,
    ) -> None:
        self.cfg, self.pol, self.logp = cfg, pol, logp
        self.engine, self.backend, self.collector = engine, backend, collector
        self.run_dir, self.store, self.out = run_dir, store, out
        self.failures_path = run_dir / "failures.jsonl"
        self.pending: dict[str, float] = {}  # engine failures and probe results, for the next metrics record
        self.probe: dict[str, Any] = {}

    def push(self, version: int) -> None:
        """Export + load + probe the current adapter as `version` (vLLM only; once per version)."""
        backend, pol, probe = self.backend, self.pol, self.probe
        if backend is None or probe.get("version") == version:
            return
        if "base" not in probe:
            ids = np.asarray([backend.probe_ids()], np.int32)
            zero = jax.tree.map(jnp.zeros_like, pol.train)
            probe["ids"] = ids
            probe["base"] = np.asarray(self.logp(zero, pol.rest, jnp.asarray(ids)))[0, 1:]
        expected = np.asarray(self.logp(pol.train, pol.rest, jnp.asarray(probe["ids"])))[0, 1:]
        res = backend.push(nnx.merge(pol.graphdef, pol.train, pol.rest), version, expected, probe["base"])
        self.pending.update(res.metrics())
        with (self.run_dir / "probes.jsonl").open("a") as f:
            f.write(json.dumps({**dataclasses.asdict(res), "time": time.time()}) + "\n")
        probe["version"] = version

    def collect(
        self,
        split: str,
        step: int,
        tasks: Sequence[Any],
        group: int,
        seed: int,
        progress: CollectionProgress | None = None,
    ) -> tuple[list[Trajectory], list[int]]:
        """One collection by the policy after `step` updates, and the policy version behind each
        attempt; redone whole after an engine failure (nothing of a failed try is kept, the
        `progress` count starts over)."""
        tries = self.cfg.collect.collection_retries + 1
        for attempt in range(tries):
            try:
                self.push(step)
                if progress is not None:
                    progress.begin()
                trajs = self.collector.run(tasks, group, seed, None if progress is None else progress.done)
                if progress is not None:
                    progress.end()
                return self.finish(trajs, self.collector.versions, step, split)
            except RECOVERABLE as e:
                lost = len(tasks) * len(self.cfg.reward.levels) * group
                self._failed(e, split, step, lost, attempt + 1, tries)
        raise AssertionError("unreachable")

    def submit(self, tasks: Sequence[Any], group: int, seed: int) -> Any:
        """Hand a collection to the fleet (asynchronous GRPO); sampled by the policy set last."""
        return self.collector.submit(tasks, group, seed)

    def wait(
        self, handle: Any, step: int, progress: CollectionProgress | None = None
    ) -> tuple[list[Trajectory], list[int]]:
        """A submitted collection's trajectories (stale ones not admitted), trained at `step`."""
        if progress is not None:
            progress.begin()
        trajs, versions = self.collector.wait(handle, None if progress is None else progress.done)
        if progress is not None:
            progress.end()
        return self.finish(trajs, versions, step)

    def finish(
        self, trajs: list[Trajectory], versions: Sequence[int | None], step: int, split: str = "train"
    ) -> tuple[list[Trajectory], list[int]]:
        """A collection's trajectories with the stale ones not admitted, and the version behind
        each (unknown: `step`); the collector's own numbers (`last_stats`) go to the next record,
        an evaluation's under eval/."""
        versions = [step if v is None else v for v in versions] or [step] * len(trajs)
        prefix = "" if split == "train" else f"{split}/"
        self.pending.update({prefix + k: v for k, v in getattr(self.collector, "last_stats", {}).items()})
        return admit_fresh(trajs, versions, step, self.cfg.collect.max_staleness), versions

    def _failed(self, e: Exception, split: str, step: int, lost: int, attempt: int, tries: int) -> None:
        """Log a failed try; stop the run after the last one, else recover the engine for a redo."""
        kind = getattr(e, "kind", "server")
        with self.failures_path.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "split": split,
                        "step": step,
                        "try": attempt,
                        "kind": kind,
                        "lost_attempts": lost,
                        "error": str(e)[:2000],
                        "time": time.time(),
                    }
                )
                + "\n"
            )
        self.pending[f"engine/failures/{kind}"] = self.pending.get(f"engine/failures/{kind}", 0) + 1
        self.pending["engine/lost_attempts"] = self.pending.get("engine/lost_attempts", 0) + lost
        print(
            f"{split} collection at update {step}: engine failure ({e}); {lost} attempts not admitted "
            f"(try {attempt}/{tries})",
            file=self.out,
            flush=True,
        )
        if attempt == tries:
            raise CollectionFailedError(
                f"the {split} collection after update {step} failed {tries} times (last: {e}); no update "
                f"was made from it. The last checkpoint is step {self.store.latest_step() or 0} in "
                f"{self.run_dir}; bring the rollout server back and rerun the same command to resume. "
                f"Failures are logged in {self.failures_path}"
            ) from e
        self.probe.pop("version", None)
        try:
            self.backend.recover() if self.backend is not None else None
        except RECOVERABLE as e2:
            print(f"recovery failed: {e2}", file=self.out, flush=True)

    def updated(self, version: int) -> None:
        """After an update (the policy is now `version`): the embedded engine takes the new
        adapters at once, the Ray fleet for the waves submitted from now on (vLLM gets them pushed
        and probed before the next collection, inside its retries)."""
        if hasattr(self.collector, "set_policy"):
            self.collector.set_policy(version, self.pol.train)
        elif self.backend is None:
            self.engine.update_weights(self.pol.train)

    def take_pending(self) -> dict[str, float]:
        """The engine failures and probe results since the last call."""
        out, self.pending = self.pending, {}
        return out

    def close(self) -> None:
        if hasattr(self.collector, "close"):  # collectors with servers of their own (env.name=pi)
            self.collector.close()
        if self.backend is not None:
            self.backend.close()

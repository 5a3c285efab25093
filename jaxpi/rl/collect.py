"""One GRPO collection: which tasks and seeds (functions of the run seed and the update count),
the in-process collector over the agent loop, which attempts are admitted, and the records
attempts.jsonl keeps of them.

Which non-admitted attempts `reward.malformed="fail"` scores as failures (`collection_attempts`):
only those the agent loop ended as "malformed" (a turn whose tool call, answer or thinking block
did not parse: the model's own output broke the format) and that are not stale. Attempts cut by
the budgets ("length", "max_turns", "max_tokens") are admitted failures already, under both
settings. Left out under both: stale attempts (sampled by a policy the ratio no longer fits),
collections lost to engine failures (discarded whole, never scored), and attempts the Pi runner
did not admit (timeout, sandbox limit, upstream / verifier / Pi errors, split samples), whose
end the model did not decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxpi.envs.agent_loop import Trajectory, run_attempts
from jaxpi.envs.base import Attempt
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.reward import CollectionScore
from jaxpi.rollout.engine import SamplingParams
from jaxpi.vllm.sync import stale

SPLITS = ("train", "eval")


def collection_seed(seed: int, step: int, split: str) -> int:
    """A 31-bit seed for (run seed, update count, split): sampling keys, environment seeds."""
    return int(np.random.SeedSequence([seed, step, SPLITS.index(split)]).generate_state(1)[0] >> 1)


def draw_tasks(n_pool: int, n: int, seed: int, step: int) -> list[int]:
    """Indices of the tasks of collection `step`: n distinct tasks of the pool, a function of (seed, step)."""
    rng = np.random.default_rng([seed, step, 7])
    return sorted(rng.choice(n_pool, size=n, replace=False).tolist())


@dataclasses.dataclass(frozen=True)
class Wave:
    """One engine call's worth of a collection: attempts `start .. start + len(pairs)` of it."""

    start: int
    pairs: list[tuple[Any, str]]  # (task, level)
    params: SamplingParams
    env_seed: int


def collection_waves(
    cfg: GRPOConfig, tasks: Sequence[Any], group: int, seed: int, batch_size: int
) -> list[Wave]:
    """Every task at every level, `group` attempts each, in waves of at most `collect.engine_batch`
    (else `batch_size`) sessions: the one layout the in-process collector and the Ray fleet share,
    so both sample every attempt with the same keys."""
    c = cfg.collect
    pairs = [(t, level) for t in tasks for level in cfg.reward.levels for _ in range(group)]
    size = min(len(pairs), c.engine_batch or batch_size)
    waves = []
    for start in range(0, len(pairs), size):
        # Seeds follow the attempt's index in the collection, not the wave layout's.
        params = SamplingParams(
            temperature=c.temperature,
            top_p=c.top_p,
            max_new_tokens=c.max_new_tokens,
            seed=seed + 104_729 * start,
        )
        waves.append(Wave(start, pairs[start : start + size], params, seed + start))
    return waves


def run_wave(
    cfg: GRPOConfig,
    engine: Any,
    tokenizer: Any,
    env: Any,
    render_cfg: Any,
    wave: Wave,
    progress: Callable[[bool, int], Any] | None = None,
) -> list[Trajectory]:
    """The attempts of one wave through the agent loop on `engine`."""
    c = cfg.collect
    return run_attempts(
        engine,
        tokenizer,
        wave.pairs,
        wave.params,
        env=env,
        render_cfg=render_cfg,
        max_turns=c.max_turns,
        max_tokens=c.max_tokens,
        max_context=c.max_context,
        seed=wave.env_seed,
        on_end=progress,
    )


class Collector:
    """Runs (task, level) attempts on the engine in waves of at most `engine_batch` sessions."""

    def __init__(self, cfg: GRPOConfig, engine: Any, tokenizer: Any, env: Any, render_cfg: Any) -> None:
        self.cfg, self.engine, self.tok, self.env, self.render_cfg = cfg, engine, tokenizer, env, render_cfg
        self.versions: list[int | None] = []  # policy version of each attempt of the last `run`

    def run(
        self, tasks: Sequence[Any], group: int, seed: int, progress: Callable[[bool, int], Any] | None = None
    ) -> list[Trajectory]:
        """Every task at every level, `group` attempts each; `progress(success, tokens)` as each ends."""
        out: list[Trajectory] = []
        for wave in collection_waves(self.cfg, tasks, group, seed, self.engine.batch_size):
            out += run_wave(self.cfg, self.engine, self.tok, self.env, self.render_cfg, wave, progress)
        # None: the engine does not track versions (JaxEngine holds the current policy by construction).
        self.versions = [getattr(self.engine, "policy_version", None)] * len(out)
        return out


def admit_fresh(
    trajectories: Sequence[Trajectory], versions: Sequence[int], current: int, max_staleness: int
) -> list[Trajectory]:
    """Attempts sampled by a policy more than `max_staleness` updates older than `current` become
    not admitted (marked malformed, with the reason): GRPO's ratio assumes a recent sampler."""
    out = []
    for t, v, old in zip(trajectories, versions, stale(versions, current, max_staleness), strict=True):
        if old and t.admitted:
            reason = f"stale: sampled by policy v{v}, {current - v} updates old (collect.max_staleness={max_staleness})"
            t = dataclasses.replace(t, malformed=True, reason=reason)
        out.append(t)
    return out


def collection_attempts(
    trajectories: Sequence[Trajectory], versions: Sequence[int], current: int, max_staleness: int
) -> list[Attempt]:
    """The reward module's records of one collection: `malformed` set on the non-admitted attempts
    the agent loop ended as "malformed" that are not stale (the module docstring says why only
    those); `reward.malformed` then decides whether they count as failures."""
    out: list[Attempt] = []
    for t, old in zip(trajectories, stale(versions, current, max_staleness), strict=True):
        a = t.to_attempt()
        if not a.admitted and t.finish_reason == "malformed" and not old:
            a = dataclasses.replace(a, malformed=True)
        out.append(a)
    return out


def attempt_records(
    split: str,
    step: int,
    trajectories: Sequence[Trajectory],
    score: CollectionScore,
    policy_versions: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The attempts.jsonl lines of one collection (`jaxpi report` reads them); `policy_versions`
    (default: `step` for every attempt) is the number of updates behind the policy that sampled each."""
    out = []
    versions = [step] * len(trajectories) if policy_versions is None else list(policy_versions)
    for t, r, a, v, s in zip(
        trajectories, score.rewards, score.advantages, versions, score.scored, strict=True
    ):
        out.append(
            {
                "split": split,
                "step": step,
                "collection": step,
                "task_id": t.task_id,
                "level": t.level,
                "attempt_id": t.attempt_id,
                "admitted": t.admitted,
                "success": t.success,
                "reasoning_tokens": t.reasoning_tokens,
                "output_tokens": t.output_tokens,
                "turns": t.turns,
                "tool_calls": t.tool_calls,
                "finish_reason": t.finish_reason,
                "reason": t.reason,
                "reward": float(r),
                "advantage": float(a),
                "policy_version": int(v),
                "scored": bool(s),
            }
        )
    return out

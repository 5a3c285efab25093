"""How a toy SFT run behaves: `evaluate_toy` samples a model through `JaxEngine` + `run_attempts`
and reports, per level, the pass rate and reasoning tokens, with the ordering ratios T_L/T_M and
T_M/T_H (`python -m jaxpi.experiments.toy eval RUN_DIR`).

Measured on the unkeyed tasks, values 0-9 (2 CPU cores shared with other jobs;
`jaxpi sft --config configs/sft/toy.yaml output.dir=runs/sft-toy`, then
`python -m jaxpi.experiments.toy eval runs/sft-toy --tasks 16 --attempts 4`: temperature 1, 128
new tokens a turn, 3 turns, context 512):

    toy-copy pre-training   120 steps of 8 rows, 160 s: loss 0.027, held-out answer token right
                            on 64/64 sessions (pretrain.json)
    LoRA SFT, ranges low 34-52, medium 12-28, xhigh 52-80 (4-5, 1-2, 6-7 phrases):
                            150 steps of 4 rows, ~3 min: loss 0.010, val 0.011
    level    attempts  pass  malformed  reasoning mean ± std (min-max)
    low          64    0.91    0.03        44.4 ±  9.5 (4-55)
    medium       64    0.98    0.02        18.5 ±  2.9 (10-23)
    xhigh        64    0.97    0.02        65.8 ±  7.6 (24-87)
    T_L/T_M = 2.40, T_M/T_H = 0.28     (64 s)

With the default ranges (low 1-7 phrases, medium 3-4, xhigh 7-9; configs/sft/toy.yaml, 300 steps,
in `jaxpi demo --full`), the held-out evaluation before GRPO (24 tasks x 2 attempts a level):
pass 0.98 / 1.00 / 1.00, reasoning 40.0 / 33.9 / 75.2 tokens (low / medium / xhigh), T_L/T_M 1.18
[1.04, 1.34], T_M/T_H 0.45; admitted 98 / 100 / 96%. Low's mean sits nearer medium than the
ranges' (41 vs 35.5 per the data) because its spread is wide; one collection of 16 low attempts
can come out shorter than medium.

A guess passes 1 time in 10, so these pass rates are the copy, and the ordering violation is the
one the data put there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxpi.convert.hf import load_hf
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.envs.agent_loop import Trajectory, run_attempts
from jaxpi.envs.base import Task
from jaxpi.envs.toy import LookupEnv
from jaxpi.lora import add_lora
from jaxpi.rollout.engine import SamplingParams
from jaxpi.rollout.jax_engine import JaxEngine
from jaxpi.train.checkpoint import load_adapter


def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def summarize(trajs: Sequence[Trajectory], levels: Sequence[str]) -> dict[str, Any]:
    """Per level: attempts, pass rate, malformed share, reasoning tokens (mean, std, min, max, of
    successes), output tokens, finish reasons; the share of (task, level) groups with both a
    success and a failure (the ones GRPO learns from); ordering ratios of mean reasoning tokens."""
    out: dict[str, Any] = {"levels": {}}
    for level in levels:
        ts = [t for t in trajs if t.level == level]
        r = [t.reasoning_tokens for t in ts]
        groups: dict[str, list[bool]] = {}
        for t in ts:
            groups.setdefault(t.task_id, []).append(t.success)
        reasons: dict[str, int] = {}
        for t in ts:
            reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
        out["levels"][level] = {
            "attempts": len(ts),
            "pass_rate": _mean([float(t.success) for t in ts]),
            "malformed": _mean([float(t.malformed) for t in ts]),
            "reasoning_mean": _mean(r),
            "reasoning_std": float(np.std(r)) if r else None,
            "reasoning_min": min(r) if r else None,
            "reasoning_max": max(r) if r else None,
            "reasoning_success_mean": _mean([t.reasoning_tokens for t in ts if t.success]),
            "output_mean": _mean([t.output_tokens for t in ts]),
            "mixed_groups": _mean([float(any(g) and not all(g)) for g in groups.values()]),
            "finish": reasons,
        }
    lv = out["levels"]

    def ratio(a: str, b: str) -> float | None:
        if a in lv and b in lv and lv[a]["reasoning_mean"] and lv[b]["reasoning_mean"]:
            return lv[a]["reasoning_mean"] / lv[b]["reasoning_mean"]
        return None

    out["T_L/T_M"], out["T_M/T_H"] = ratio("low", "medium"), ratio("medium", "xhigh")
    return out


def evaluate_toy(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    levels: Sequence[str],
    attempts: int,
    seed: int,
    *,
    render_cfg: RenderConfig | None = None,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    max_turns: int = 3,
    max_context: int = 512,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Sample `attempts` sessions per (task, level) with the embedded engine; `summarize` them.

    `max_new_tokens` caps each turn, `max_turns` the turns of an attempt, `max_context` the
    session (the engine's `max_len`). The result also holds the settings it ran with.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    render_cfg = render_cfg or RenderConfig(tokenizer.name_or_path)
    jobs = [(t, lv) for t in tasks for lv in levels for _ in range(attempts)]
    engine = JaxEngine(model, max_len=max_context, batch_size=min(batch_size, len(jobs)))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    trajs: list[Trajectory] = []
    # The engine holds batch_size sessions at once: run the jobs in slices of that size.
    for s in range(0, len(jobs), engine.batch_size):
        trajs += run_attempts(
            engine,
            tokenizer,
            jobs[s : s + engine.batch_size],
            dataclasses.replace(params, seed=seed + s),
            env=LookupEnv(),
            render_cfg=render_cfg,
            max_turns=max_turns,
            max_tokens=max_turns * max_new_tokens,
            seed=seed + s,
        )
    out = summarize(trajs, levels)
    out["settings"] = {
        "tasks": len(tasks),
        "attempts": attempts,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "max_turns": max_turns,
        "max_context": max_context,
    }
    return out


def load_run(run_dir: str | Path) -> tuple[Any, Any, RenderConfig]:
    """(model with the run's adapter, tokenizer, render config) of an SFT run's latest checkpoint."""
    state, lora_cfg, meta = load_adapter(run_dir)
    _, model = load_hf(meta["base"], meta.get("dtype", "float32"))
    add_lora(model, lora_cfg)
    nnx.update(model, state)
    tok_dir = meta.get("tokenizer") or meta["base"]
    return model, load_tokenizer(tok_dir), RenderConfig(tok_dir)

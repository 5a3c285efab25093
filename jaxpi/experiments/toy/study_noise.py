"""How noisy is one evaluation (`jaxpi study --eval-noise N`): the step-0 evaluation of one SFT
start sampled with several seeds, through the GRPO trainer's own policy loading, engine and
collector, so that the spread of T_L/T_M between samplings of one policy can be set against the
spread between seeds.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxpi.configfile import load_config
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.experiments.toy.study_config import GRPO_CONFIG, StudySpec
from jaxpi.experiments.toy.study_stats import PAIRS, est_value
from jaxpi.rl.collect import Collector, attempt_records, collection_attempts, collection_seed
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.envs import make_env
from jaxpi.rl.policy import load_policy
from jaxpi.rl.reward import score_collection
from jaxpi.rollout.jax_engine import JaxEngine
from jaxpi.stats.levels import level_stats, ordering_ratios


def eval_noise(
    adapter: str | Path,
    spec: StudySpec,
    samplings: Sequence[int],
    say: Callable[[str], Any] = print,
    reference: Mapping[int, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The GRPO run's step-0 evaluation of one policy (`adapter`, an SFT run) sampled with several
    seeds: the trainer's own policy loading, engine, collector and eval seeds
    (`collection_seed(seed, 0, "eval")`), so sampling i is exactly the start evaluation a
    `jaxpi grpo` run with train.seed=i makes. Returns each sampling's T_L/T_M, T_M/T_X and pass
    rates and their spread over samplings."""
    reference = reference or {}
    cfg = load_config(GRPOConfig, GRPO_CONFIG, [*spec.grpo_overrides, f"model.adapter={adapter}"])
    levels = cfg.reward.levels
    with tempfile.TemporaryDirectory() as tmp:
        pol = load_policy(cfg, Path(tmp), jax.random.fold_in(jax.random.key(0), 1))
    tok = load_tokenizer(pol.tokenizer_dir)
    render_cfg = RenderConfig(tokenizer_dir=str(pol.tokenizer_dir))
    _, _, held = make_env(cfg)
    engine = JaxEngine(
        nnx.merge(pol.graphdef, pol.train, pol.rest),
        max_len=cfg.collect.max_context,
        batch_size=cfg.collect.engine_batch or cfg.rows,
    )
    collector = Collector(cfg, engine, tok, make_env(cfg)[0], render_cfg)
    rows = []
    for seed in samplings:
        t0 = time.time()
        trajs = collector.run(held, cfg.train.eval_group, collection_seed(seed, 0, "eval"))
        attempts = collection_attempts(trajs, [0] * len(trajs), 0, cfg.collect.max_staleness)
        recs = attempt_records("eval", 0, trajs, score_collection(attempts, cfg.reward))
        ratios = ordering_ratios(recs, levels)
        stats = level_stats(recs, levels)
        row = {
            "seed": seed,
            "ordering": {k: est_value(v) for k, v in ratios.items()},
            "T": {lv: est_value(st.reasoning_tokens) for lv, st in stats.items()},
            "pass": {lv: est_value(st.pass_rate) for lv, st in stats.items()},
            "sched": {lv: est_value(st.pass_rate_scheduled) for lv, st in stats.items()},
            "seconds": round(time.time() - t0, 1),
        }
        if seed in reference:  # the start evaluation a study run with this seed made
            row["matches_run"] = json.loads(json.dumps(recs)) == reference[seed]
        rows.append(row)
        say(
            f"sampling seed {seed}: T_L/T_M {row['ordering']['low/medium']:.3f}, "
            f"T_M/T_X {row['ordering']['medium/xhigh']:.3f} ({row['seconds']:.0f} s)"
        )
    spread = {}
    for pair in PAIRS:
        xs = np.asarray([r["ordering"][pair] for r in rows], np.float64)
        spread[pair] = {
            "mean": float(xs.mean()),
            "sd": float(xs.std(ddof=1)) if xs.size > 1 else math.nan,
            "min": float(xs.min()),
            "max": float(xs.max()),
        }
    return {
        "adapter": str(adapter),
        "tasks": len(held),
        "attempts_per_level": len(held) * cfg.train.eval_group,
        "samplings": rows,
        "spread": spread,
    }

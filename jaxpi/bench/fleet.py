"""Attempts per minute of GRPO collections on a Ray fleet, against the number of rollout workers.

    jaxpi bench fleet [--workers 1,2,4] [--collections 3] [--ray-address HOST:PORT] [--json] [--out FILE]

The toy lookup environment on a tiny random base (configs/grpo/tiny.yaml, two layers), collections
of 4 tasks x 3 levels x 4 attempts in waves of 6 sessions (8 waves), the same collections for
every worker count. For each count: a fleet of that many workers (`collect.ray_workers`, one Ray
CPU each) on the cluster at `--ray-address` (default: one started for the count on this machine),
one untimed collection (the workers compile their engines), then `--collections` timed ones. Per
count: attempts per minute (median over the timed collections), sampled tokens per second, the
workers' busy share of the wall time (busy seconds / (wall x workers)), and the CPU state.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from jaxpi.bench.config import FleetRunConfig
from jaxpi.configfile import load_config
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.rl.collect import collection_seed, draw_tasks
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.envs import make_env
from jaxpi.rl.fleet.collector import make_fleet_collector
from jaxpi.rl.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (
    "model.tiny_layers=2",
    "collect.tasks=4",
    "collect.group=4",
    "collect.engine_batch=6",
    "collect.max_new_tokens=48",
    "collect.max_tokens=96",
    "output.loggers=[]",
)


def _cpu() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(), "load_avg": os.getloadavg()}


def run(cfg: FleetRunConfig) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="jaxpi-bench-fleet-") as tmp:
        grpo = load_config(GRPOConfig, ROOT / "configs" / "grpo" / "tiny.yaml", [*SHAPE, f"output.dir={tmp}"])
        pol = load_policy(grpo, Path(tmp), jax.random.key(0))
        tok = load_tokenizer(pol.tokenizer_dir)
        render_cfg = RenderConfig(tokenizer_dir=str(pol.tokenizer_dir))
        env, pool, _ = make_env(grpo)
        c = grpo.collect

        def tasks(s: int) -> list[Any]:
            return [pool[i] for i in draw_tasks(len(pool), c.tasks, grpo.train.seed, s)]

        rows = []
        for k in cfg.workers:
            g = dataclasses.replace(
                grpo, collect=dataclasses.replace(c, ray_workers=k, ray_address=cfg.ray_address)
            )
            t0 = time.perf_counter()
            fleet = make_fleet_collector(g, pol, tok, env, render_cfg, 0)
            try:
                fleet.run(tasks(0), c.group, collection_seed(0, 0, "train"))  # the workers compile
                start_s = time.perf_counter() - t0
                per_min, tok_s, busy = [], [], []
                for s in range(1, cfg.collections + 1):
                    fleet.run(tasks(s), c.group, collection_seed(0, s, "train"))
                    st = fleet.last_stats
                    per_min.append(st["fleet/attempts_per_min"])
                    tok_s.append(st["fleet/sampled_tokens_per_s"])
                    busy.append(st["fleet/busy_s"] / (st["fleet/wall_s"] * k))
            finally:
                fleet.close()
            rows.append(
                {
                    "workers": k,
                    "attempts_per_collection": grpo.rows,
                    "waves_per_collection": -(-grpo.rows // c.engine_batch),
                    "attempts_per_min": statistics.median(per_min),
                    "attempts_per_min_values": per_min,
                    "sampled_tokens_per_s": statistics.median(tok_s),
                    "busy_share": statistics.median(busy),
                    "start_s": start_s,
                }
            )
    return {
        "env": {**_cpu(), "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__},
        "config": dataclasses.asdict(cfg),
        "results": rows,
    }


def table(report: dict[str, Any]) -> str:
    e = report["env"]
    head = f"{e['cpu']} ({e['cores']} cores, load {e['load_avg'][0]:.1f}), {e['date']}"
    lines = [head, "workers  attempts/min  sampled tok/s  busy share  start s"]
    for r in report["results"]:
        lines.append(
            f"{r['workers']:7d}  {r['attempts_per_min']:12.0f}  {r['sampled_tokens_per_s']:13.0f}  "
            f"{r['busy_share']:10.2f}  {r['start_s']:7.1f}"
        )
    return "\n".join(lines)

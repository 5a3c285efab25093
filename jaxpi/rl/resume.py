"""What a resumed `jaxpi grpo` run may change and what it redoes.

Rerunning the command on an `output.dir` with checkpoints continues after the latest one. The
sections that define what a checkpoint means (`FIXED_ON_RESUME`) must be the same; the fields
that only say how to reach the rollout server (`RESUME_FREE`) may change. The collections after
the checkpoint are redone, so their attempt records are dropped first (`truncate_attempts`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxpi.atomic import write_text
from jaxpi.configfile import to_dict
from jaxpi.rl.config import CollectConfig, GRPOConfig

# collect.* fields that only say how to reach the rollout server: a resumed run may change them
# (a restarted server has another address).
RESUME_FREE = (
    "vllm_url",
    "vllm_concurrency",
    "request_timeout_s",
    "request_retries",
    "collection_retries",
    "retry_wait_s",
    "probe_tol",
    # the fleet: a resumed run may join another cluster, or run its waves on more or fewer workers
    # (or in this process: a synchronous Ray collection is the local one, token for token)
    "backend",
    "ray_address",
    "ray_workers",
    "ray_worker_cpus",
    "worker_retries",
    "fleet_wait_s",
    "gateway_host",
)
# Sections that define what a checkpoint means: a resumed run must not change them.
FIXED_ON_RESUME = (
    "model",
    "lora",
    "env",
    *(f"collect.{f.name}" for f in dataclasses.fields(CollectConfig) if f.name not in RESUME_FREE),
    "reward",
    "loss",
    "optim",
    "train.collections",
    "train.seed",
    "train.grad_accum",
    "train.eval_every",
    "train.eval_group",
    "train.async",  # which policy samples each collection
)


def changed_keys(saved: dict[str, Any], current: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """Dotted keys (sections or `section.field`) whose values differ between two config dicts."""
    diffs = []
    for key in keys:
        section, _, field = key.partition(".")
        a, b = saved.get(section, {}), current.get(section, {})
        if (a.get(field) if field else a) != (b.get(field) if field else b):
            diffs.append(key)
    return diffs


def with_later_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved config with the fields added since filled in by their defaults (the
    engine settings collect.*, reward.malformed, ...): a field is added with a default that keeps
    the old behaviour, so the older run behaved as that default does and may resume under it."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for section, fields in to_dict(GRPOConfig()).items():
        for key, value in fields.items():
            out.setdefault(section, {}).setdefault(key, value)
    return out


def check_resume(run_dir: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume the run in `run_dir` (saved config) under a config that changes what its
    checkpoints mean."""
    diffs = changed_keys(with_later_defaults(saved), current, FIXED_ON_RESUME)
    if diffs:
        raise ValueError(
            f"{run_dir} holds a run with a different {', '.join(diffs)}; "
            "resume with the same settings or choose another output.dir"
        )


def truncate_attempts(path: Path, start: int) -> int:
    """Keep what the checkpoint after `start` updates had seen: the training attempts of the
    collections before it (steps < start) and the evaluations up to it (steps <= start: the
    evaluation after an update runs before its checkpoint), nothing for a run without a
    checkpoint (start 0); a resumed run redoes the rest. Drops a torn last line. Returns the
    number kept."""
    if not path.exists():
        return 0
    kept = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a kill mid-write tears only the last line
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
        if rec["step"] < start or (rec.get("split") == "eval" and 0 < rec["step"] == start):
            kept.append(line)
    write_text(path, "".join(x + "\n" for x in kept))
    return len(kept)

"""`jaxpi study`: the toy-scale effort-ordering result over K seeds, with statistics across seeds.

One run of each arm cannot tell a method from a seed. A study runs, for every seed k, a toy SFT
start and effort-ordered and binary GRPO from it, resumably (`study_run`: the processes, resume,
the seconds of every process), with the settings fixed in `study.json` (`study_config`). Then
`report/`: per seed the start's and each arm's end, across seeds the means with 95% t-intervals,
the paired differences and the criteria (`study_stats`), the tables and `ordering.png`
(`study_tables`), and `study.json` with all of it.

`--short` is the two-update machinery version (toy-random base, values 0-1, as `make demo`): it
shows that the pipeline runs, not the result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from jaxpi import atomic
from jaxpi.experiments.toy.study_config import StudySpec, prepare
from jaxpi.experiments.toy.study_run import plan, run_jobs
from jaxpi.experiments.toy.study_stats import aggregate, read_seed
from jaxpi.experiments.toy.study_tables import plot_study, tables
from jaxpi.stats.table import finite


def machine() -> dict[str, Any]:
    """What ran it: CPU model, cores, whether the CPU has AVX-512, XLA_FLAGS, jax version."""
    model, flags = platform.processor() or "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
    }


def report(root: Path, spec: StudySpec, state: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read every finished run of the study and write `report/` (tables, picture, study.json)."""
    levels = ("low", "medium", "xhigh")
    starts = Path(spec.starts) if spec.starts else None
    seeds = [s for k in spec.seeds if (s := read_seed(root, k, spec.arms, starts)) is not None]
    out = {
        "out": str(root),
        "spec": dataclasses.asdict(spec),
        "machine": machine(),
        "state": dict(state or {}),
    }
    if not seeds:
        out.update(seeds=[], table="no finished GRPO run yet", images=[])
        return out
    agg = aggregate(seeds, spec.arms, levels)
    table = tables(seeds, agg, spec.arms, levels)
    not_identical = [s["seed"] for s in seeds if not s["start_identical"]]
    if not_identical:
        table += f"\n\nWARNING: the arms' start evaluations differ in seeds {not_identical} (same policy, same seed)"
    image = plot_study(seeds, spec.arms, root / "report" / "ordering.png", agg["rows"])
    run_seconds = sum(a["seconds"] for s in seeds for a in s["arms"].values()) + sum(
        s.get("sft_seconds", 0) for s in seeds
    )
    out.update(seeds=seeds, summary=agg, table=table, images=[str(image)], run_seconds=round(run_seconds, 1))
    text = json.dumps(finite(out), indent=2) + "\n"
    atomic.write_text(root / "report" / "study.json", text)
    atomic.write_text(root / "report" / "table.md", table + "\n")
    return out


def run_study(
    root: str | Path,
    spec: StudySpec,
    *,
    parallel: int = 2,
    env: Mapping[str, str] | None = None,
    say: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run (or resume) the study under `root`, then report it."""
    root = Path(root).absolute()
    prepare(root, spec)
    t0 = time.time()
    state = run_jobs(plan(root, spec), root / "logs", parallel=parallel, env=env, say=say)
    result = report(root, spec, state)
    result["wall_seconds"] = round(time.time() - t0, 1)
    return result

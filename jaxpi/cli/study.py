"""`jaxpi study`: the toy effort-ordering result over K seeds (`jaxpi.experiments.toy.study`).

    jaxpi study --out DIR [--seeds K] [--first-seed S] [--arms effort_ordered,binary] [--jobs N]
                [--short] [--sft KEY=VALUE ...] [--grpo KEY=VALUE ...] [--starts STUDY_DIR]
                [--report-only] [--eval-noise N] [--json]

The study's modules load jax (they resolve the trainers' configs), so they are imported when the
command runs, not for `--help`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from jaxpi.cli.registry import help_for
from jaxpi.stats.table import finite


def add_subparser(sub: Any) -> None:
    """Register `jaxpi study` on the CLI's subparsers."""
    p = sub.add_parser(
        "study",
        help=help_for("study"),
        description="For every seed k: a toy SFT start (configs/sft/toy.yaml, train.seed=k), then "
        "effort-ordered and binary GRPO from it (configs/grpo/toy.yaml, train.seed=k), each a `jaxpi` "
        "subprocess, --jobs at a time. Rerunning the command skips finished runs and resumes interrupted "
        "ones from their checkpoints. Writes OUT/report/ (table.md, ordering.png, study.json): per seed "
        "the start's and the ends' T_L/T_M, T_M/T_X and pass rates; across seeds the means with 95% "
        "t-intervals and the paired difference effort-ordered - binary.",
    )
    p.add_argument("--out", required=True, help="the study's directory (rerun with the same one to resume)")
    p.add_argument("--seeds", type=int, default=5, help="seeds first-seed .. first-seed+K-1 (default 5)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--arms", default="effort_ordered,binary", help="reward kinds to run (comma list)")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="runs at a time (default: 2 where there are 2 cores; docs/grpo.md measures 1 against 2)",
    )
    p.add_argument("--short", action="store_true", help="the two-update machinery version (toy-random base)")
    p.add_argument(
        "--sft", action="append", default=[], metavar="KEY=VALUE", help="SFT config override (repeatable)"
    )
    p.add_argument(
        "--grpo", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override (repeatable)"
    )
    p.add_argument(
        "--starts",
        default=None,
        metavar="STUDY_DIR",
        help="reuse another study's finished SFT runs as the starts",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="start nothing; report the finished runs of the study in --out (its own settings)",
    )
    p.add_argument(
        "--eval-noise",
        type=int,
        default=0,
        metavar="N",
        help="start nothing: sample the first seed's start evaluation (as `jaxpi grpo` makes it) with N "
        "sampling seeds and print how T_L/T_M varies between samplings of one policy",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the tables")
    p.set_defaults(fn=cmd_study)


def cmd_study(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.first_seed < 0:
        raise ValueError(f"--seeds must be >= 1 and --first-seed >= 0, got {args.seeds}, {args.first_seed}")
    from jaxpi.experiments.toy.study import report, run_study
    from jaxpi.experiments.toy.study_config import ARMS, StudySpec, saved_spec
    from jaxpi.experiments.toy.study_stats import eval_records

    spec = StudySpec(
        seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)),
        arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        short=args.short,
        sft=tuple(args.sft),
        grpo=tuple(args.grpo),
        starts=str(Path(args.starts).absolute()) if args.starts else None,
    )
    say = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if args.json
        else (lambda line: print(line, flush=True))
    )
    if args.eval_noise:
        k = spec.seeds[0]
        adapter = Path(spec.starts or args.out).absolute() / f"seed-{k}" / "sft"
        if not (adapter / "done.json").exists():
            raise FileNotFoundError(f"{adapter}: no finished SFT run to evaluate")
        # Sampling k first: the start evaluation of the study's own seed-k runs, where they exist.
        ref = {}
        for arm in spec.arms:
            path = Path(args.out).absolute() / f"seed-{k}" / ARMS[arm] / "attempts.jsonl"
            if path.exists():
                ref[k] = eval_records(path.parent, 0)
                break
        from jaxpi.experiments.toy.study_noise import eval_noise

        seeds = [k, *range(1000, 1000 + args.eval_noise - 1)]
        result = eval_noise(adapter, spec, seeds, say=say, reference=ref)
        sp = result["spread"]
        print(
            json.dumps(finite(result), indent=2)
            if args.json
            else "\n".join(
                f"{pair}: mean {v['mean']:.3f}, sd {v['sd']:.3f}, range {v['min']:.3f}-{v['max']:.3f} over "
                f"{len(result['samplings'])} samplings of {result['attempts_per_level']} attempts per level"
                for pair, v in sp.items()
            )
        )
        return 0
    if args.report_only:
        root = Path(args.out).absolute()
        result = report(root, saved_spec(root, spec.seeds))
    else:
        try:
            result = run_study(args.out, spec, parallel=args.jobs, say=say)
        except KeyboardInterrupt:
            print(f"jaxpi study: stopped; rerun the same command to resume {args.out}", file=sys.stderr)
            return 130
    failed = {k: v for k, v in result["state"].items() if not v.startswith(("done", "ran"))}
    if args.json:
        print(json.dumps(finite(result), indent=2))
    else:
        print(result["table"])
        if result.get("images"):
            print("\n" + "\n".join(f"wrote {p}" for p in result["images"]))
            print(f"wrote {Path(args.out) / 'report' / 'study.json'}, table.md")
        if "wall_seconds" in result:
            print(
                f"study wall time {result['wall_seconds']:.0f} s; the runs' own time summed {result.get('run_seconds', 0):.0f} s"
            )
        for name, why in failed.items():
            print(f"{name}: {why}", file=sys.stderr)
    return 1 if failed else 0

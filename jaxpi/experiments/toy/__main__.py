"""`python -m jaxpi.experiments.toy base OUT_DIR | eval RUN_DIR`: the toy base, or the pass rate
and reasoning tokens per level of an SFT run (`jaxpi.experiments.toy.evaluate`)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from jaxpi.envs.toy import make_tasks
from jaxpi.experiments.toy.bases import make_toy_base
from jaxpi.experiments.toy.evaluate import evaluate_toy, load_run


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxpi.experiments.toy base OUT_DIR` writes the toy base; `... eval RUN_DIR` samples
    the run's latest checkpoint on fresh tasks and prints `evaluate_toy`'s result as JSON."""
    p = argparse.ArgumentParser(prog="python -m jaxpi.experiments.toy", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="write the tiny random base with a scaled LM head")
    b.add_argument("out_dir")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--attention-every", type=int, default=4)
    b.add_argument("--hidden", type=int, default=None)
    b.add_argument("--head-scale", type=float, default=6.0)
    b.add_argument("--qk-gain", type=float, default=2.5)
    e = sub.add_parser("eval", help="pass rate and reasoning tokens per level of an SFT run")
    e.add_argument("run_dir")
    e.add_argument("--tasks", type=int, default=16)
    e.add_argument("--attempts", type=int, default=4)
    e.add_argument("--seed", type=int, default=1000, help="task and sampling seed (SFT tasks use train.seed)")
    e.add_argument("--levels", default="low,medium,xhigh")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-context", type=int, default=512)
    e.add_argument("--keys-per-task", type=int, default=0, help="0: unkeyed tasks (get())")
    e.add_argument("--max-value", type=int, default=10)
    args = p.parse_args(argv)
    if args.cmd == "base":
        out = make_toy_base(
            args.out_dir,
            seed=args.seed,
            layers=args.layers,
            attention_every=args.attention_every,
            hidden=args.hidden,
            head_scale=args.head_scale,
            qk_gain=args.qk_gain,
        )
        print(out)
        return 0
    t0 = time.time()
    model, tok, render_cfg = load_run(args.run_dir)
    result = evaluate_toy(
        model,
        tok,
        make_tasks(args.tasks, seed=args.seed, keys_per_task=args.keys_per_task, max_value=args.max_value),
        args.levels.split(","),
        args.attempts,
        seed=args.seed,
        render_cfg=render_cfg,
        max_new_tokens=args.max_new_tokens,
        max_context=args.max_context,
    )
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`jaxpi eval` (agent pass rate per effort level over real Pi attempts) and `jaxpi select` (rank
checkpoints by it).

    jaxpi eval --model DIR [--adapter DIR] --tasks DIR --levels low,medium,xhigh --attempts K \\
        [--endpoint URL] [--out DIR] [--compare RESULTS_OR_CKPT] [--json]
    jaxpi select CKPT_OR_RESULTS... --tasks DIR [--levels ...] [--attempts K] [--out DIR] [--json]

Without --endpoint the command starts `jaxpi serve` on the checkpoint and the recording gateway in
front of it, and stops both at the end. `--compare` takes a saved evaluation (a directory with
results.json) or another checkpoint (evaluated the same way first).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jaxpi.cli.registry import help_for


def _levels(text: str) -> list[str]:
    from jaxpi.runner.pi_config import LEVELS

    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in LEVELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"levels must be a comma list of {LEVELS}, got {text!r}")
    return out


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", required=True, help="a task directory or a directory of them")
    p.add_argument("--levels", type=_levels, default=["low", "medium", "xhigh"], help="e.g. low,medium,xhigh")
    p.add_argument("--attempts", type=int, default=1, help="attempts per task and level (K)")
    p.add_argument("--jobs", type=int, default=2, help="attempts at once")
    p.add_argument("--max-len", type=int, default=8192, help="served context per request (tokens)")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="tokens per model call")
    p.add_argument("--wall-seconds", type=float, default=0.0, help="per attempt; 0 = the task's limit")
    p.add_argument(
        "--tools", default="", help="Pi's tool allowlist, e.g. bash (default: Pi's read,bash,edit,write)"
    )
    p.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the server's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the first call; attempts draw apart from it")
    p.add_argument("--json", action="store_true", help="no progress bar; print one JSON object")


def add_subparser(sub: Any) -> None:
    """Register `jaxpi eval` and `jaxpi select`."""
    ev = sub.add_parser(
        "eval",
        help=help_for("eval"),
        description="Runs every task x level x K real Pi attempts (sandboxed, verifier-scored) against the "
        "model and prints the per-level table: pass rate with its 95%% Wilson interval, mean reasoning "
        "tokens (task-bootstrap interval), output tokens, turns, wall time. Saves results.json, table.txt "
        "and frontier.png (pass rate vs reasoning tokens, arrows L->M->X) in --out.",
    )
    ev.add_argument("--model", default=None, help="checkpoint to serve (HF dir or jaxpi run/checkpoint)")
    ev.add_argument("--adapter", default=None, help="adapter on top of --model")
    ev.add_argument("--endpoint", default=None, help="use a running OpenAI-compatible endpoint instead")
    ev.add_argument("--model-id", default=None, help="model name sent to --endpoint")
    ev.add_argument("--api-key", default=None, help="the API key Pi sends to --endpoint (its --api-key)")
    ev.add_argument("--name", default=None, help="name in tables and plots (default: the model dir)")
    ev.add_argument("--out", default=None, help="output directory (default: runs/eval/<name>)")
    ev.add_argument("--compare", default=None, help="a saved eval (dir/results.json) or a checkpoint")
    _common(ev)
    ev.set_defaults(fn=cmd_eval)
    se = sub.add_parser(
        "select",
        help=help_for("select"),
        description="Each argument is a saved `jaxpi eval` output (dir with results.json, reused as is) or "
        "a checkpoint (evaluated on --tasks first). Ranked by the pass rate pooled over levels.",
    )
    se.add_argument("ckpts", nargs="+", metavar="CKPT_OR_RESULTS")
    se.add_argument("--out", default="runs/select", help="where new evaluations are written")
    _common(se)
    se.set_defaults(fn=cmd_select)


def _eval_one(args: argparse.Namespace, model: str | None, adapter: str | None, name: str, out: Path) -> dict:
    from jaxpi.eval.endpoint import policy_endpoint
    from jaxpi.eval.run import evaluate
    from jaxpi.runner.attempt import RunnerConfig
    from jaxpi.tasks.task import load_tasks

    tasks = load_tasks(args.tasks)
    with policy_endpoint(
        model=model,
        adapter=adapter,
        endpoint=getattr(args, "endpoint", None),
        model_id=getattr(args, "model_id", None),
        api_key=getattr(args, "api_key", None),
        max_len=args.max_len,
        max_new_tokens=args.max_new_tokens,
        # As many engine rows as attempts in flight: one engine call serves all their turns.
        batch=max(1, args.jobs),
    ) as ep:
        cfg = RunnerConfig(
            model_id=ep.model_id,
            context_window=args.max_len,
            max_tokens_per_call=args.max_new_tokens,
            wall_seconds=args.wall_seconds,
            jobs=args.jobs,
            tools=tuple(t for t in args.tools.split(",") if t),
            temperature=args.temperature,
            seed=args.seed,
        )
        meta = {"model": model, "adapter": adapter, "tasks_dir": str(args.tasks), "attempts": args.attempts}
        return evaluate(
            tasks,
            args.levels,
            args.attempts,
            ep.url,
            out,
            name=name,
            runner_cfg=cfg,
            trace=ep.trace,
            key=ep.key,
            meta=meta,
            progress=not args.json,
        )


def cmd_eval(args: argparse.Namespace) -> int:
    from jaxpi.eval.run import compare, load_results

    if (args.model is None) == (args.endpoint is None):
        raise ValueError("give exactly one of --model and --endpoint")
    name = args.name or Path(args.model or "endpoint").resolve().name
    out = Path(args.out or f"runs/eval/{name}")
    res = _eval_one(args, args.model, args.adapter, name, out)
    report: dict[str, Any] = {
        "out": str(out),
        "results": str(out / "results.json"),
        "png": str(out / "frontier.png"),
        "table": res["table"],
        "overall": res["overall"],
    }
    text = res["table_text"]
    if args.compare:
        cp = Path(args.compare)
        if (cp / "results.json").is_file() or cp.suffix == ".json":
            other = load_results(cp)
        else:
            other = _eval_one(args, str(cp), None, cp.resolve().name, out / "compare" / cp.resolve().name)
        cmp = compare(res, other, out)
        report["compare"] = {k: v for k, v in cmp.items() if k != "text"}
        text += "\n\n" + cmp["text"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(text)
        print(f"\nresults: {out / 'results.json'}\nplot:    {out / 'frontier.png'}")
    return 0


def cmd_select(args: argparse.Namespace) -> int:
    from jaxpi.eval.run import load_results, rank

    results = []
    for c in args.ckpts:
        p = Path(c)
        if (p / "results.json").is_file() or (p.is_file() and p.suffix == ".json"):
            results.append(load_results(p))
        else:
            name = p.resolve().name
            if not args.json:
                print(f"evaluating {name} ...", file=sys.stderr, flush=True)
            results.append(_eval_one(args, str(p), None, name, Path(args.out) / name))
    ranking = rank(results)
    if args.json:
        print(json.dumps({"ranking": ranking}, indent=2))
        return 0
    for i, r in enumerate(ranking, 1):
        pr = r["pass_rate"]
        shown = (
            "-"
            if pr is None
            else f"{100 * pr['value']:.0f}% [{100 * pr['lo']:.0f}, {100 * pr['hi']:.0f}] (n={pr['n']})"
        )
        print(f"{i}. {r['name']}: {shown}")
    return 0

"""`jaxpi eval` (agent pass rate per effort level over real Pi attempts) and `jaxpi select` (rank
checkpoints by it).

    jaxpi eval --model DIR [--adapter DIR] --tasks DIR --levels low,medium,xhigh --attempts K \\
        [--endpoint URL] [--out DIR] [--compare RESULTS_OR_CKPT] [--json]
    jaxpi select CKPT_OR_RESULTS... --tasks DIR [--levels ...] [--attempts K] [--out DIR] [--json]

Both take --config NAME (configs/eval/, configs/select/) and trailing key=value overrides of the
keys their --help lists. Without --endpoint the command starts `jaxpi serve` on the checkpoint and
the recording gateway in front of it, and stops both at the end. `--compare` takes a saved
evaluation (a directory with results.json) or another checkpoint (evaluated the same way first)
and prints the paired pass-rate differences and the tool-call change on the tasks both solve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for
from jaxpi.eval.config import AttemptsConfig, EvalConfig, SelectConfig


def _levels(text: str) -> list[str]:
    from jaxpi.runner.pi_config import LEVELS

    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in LEVELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"levels must be a comma list of {LEVELS}, got {text!r}")
    return out


COMMON = (
    Flag("--tasks", "tasks", "a task directory or a directory of them"),
    Flag("--levels", "levels", "e.g. low,medium,xhigh", type=_levels),
    Flag("--attempts", "attempts", "attempts per task and level (K)"),
    Flag("--jobs", "jobs", "attempts at once"),
    Flag("--max-len", "max_len", "served context per request (tokens)"),
    Flag("--max-new-tokens", "max_new_tokens", "tokens per model call"),
    Flag("--wall-seconds", "wall_seconds", "per attempt; 0 = the task's limit"),
    Flag("--max-turns", "max_turns", "model calls per attempt (Pi makes one per turn); 0 = the task's limit"),
    Flag("--tools", "tools", "Pi's tool allowlist, e.g. bash (default: Pi's read,bash,edit,write)"),
    Flag("--temperature", "temperature", "sampling temperature (default: the server's)"),
    Flag("--top-p", "top_p", "nucleus sampling (default: the server's)"),
    Flag("--seed", "seed", "seed of the first call; attempts draw apart from it"),
)
EVAL = ConfigSpec(
    EvalConfig,
    "eval",
    (
        Flag("--model", "model", "checkpoint to serve (HF dir or jaxpi run/checkpoint)"),
        Flag("--adapter", "adapter", "adapter on top of --model"),
        Flag("--endpoint", "endpoint", "use a running OpenAI-compatible endpoint instead"),
        Flag("--model-id", "model_id", "model name sent to --endpoint"),
        Flag("--api-key", "api_key", "the API key Pi sends to --endpoint (its --api-key)"),
        Flag("--name", "name", "name in tables and plots (default: the model dir)"),
        Flag("--out", "out", "output directory (default: runs/eval/<name>)"),
        Flag("--compare", "compare", "a saved eval (dir/results.json) or a checkpoint"),
        *COMMON,
    ),
)
SELECT = ConfigSpec(
    SelectConfig,
    "select",
    (
        Flag(
            "ckpts",
            "ckpts",
            "saved evaluations or checkpoints (key.sub=value items among them set config keys)",
            nargs="+",
            metavar="CKPT_OR_RESULTS",
        ),
        Flag("--out", "out", "where new evaluations are written"),
        *COMMON,
    ),
)
JSON_HELP = "no progress bar; print one JSON object"


def add_subparser(sub: Any) -> None:
    """Register `jaxpi eval` and `jaxpi select`."""
    ev = add_command_parser(
        sub,
        "eval",
        help=help_for("eval"),
        description="Runs every task x level x K real Pi attempts (sandboxed, verifier-scored) against the "
        "model and prints the per-level table: pass rate with its 95% Wilson interval, mean reasoning "
        "tokens (task-bootstrap interval), output tokens, turns, tool calls, model calls, wall time. Saves "
        "results.json, table.txt and frontier.png (pass rate vs reasoning tokens, arrows L->M->X) in --out. "
        "--compare adds paired pass-rate differences and the tool-call change on the tasks both solve "
        "(compare.json, compare.png, tool_calls.png).",
    )
    add_config_arguments(ev, EVAL)
    ev.add_argument("--json", action="store_true", help=JSON_HELP)
    ev.set_defaults(fn=cmd_eval)
    se = add_command_parser(
        sub,
        "select",
        help=help_for("select"),
        description="Each argument is a saved `jaxpi eval` output (dir with results.json, reused as is) or "
        "a checkpoint (evaluated on --tasks first). Ranked by the pass rate pooled over levels.",
    )
    add_config_arguments(se, SELECT)
    se.add_argument("--json", action="store_true", help=JSON_HELP)
    se.set_defaults(fn=cmd_select)


def _eval_one(
    cfg: AttemptsConfig, model: str | None, adapter: str | None, name: str, out: Path, as_json: bool
) -> dict:
    from jaxpi.eval.endpoint import policy_endpoint
    from jaxpi.eval.run import evaluate
    from jaxpi.tasks.task import load_tasks

    tasks = load_tasks(cfg.tasks)
    with policy_endpoint(
        model=model,
        adapter=adapter,
        endpoint=getattr(cfg, "endpoint", None),
        model_id=getattr(cfg, "model_id", None),
        api_key=getattr(cfg, "api_key", None),
        max_len=cfg.max_len,
        max_new_tokens=cfg.max_new_tokens,
        # As many engine rows as attempts in flight: one engine call serves all their turns.
        batch=max(1, cfg.jobs),
    ) as ep:
        meta = {"model": model, "adapter": adapter, "tasks_dir": cfg.tasks, "attempts": cfg.attempts}
        return evaluate(
            tasks,
            list(cfg.levels),
            cfg.attempts,
            ep.url,
            out,
            name=name,
            runner_cfg=cfg.runner(ep.model_id),
            trace=ep.trace,
            key=ep.key,
            meta=meta,
            progress=not as_json,
        )


def cmd_eval(args: argparse.Namespace) -> int:
    from jaxpi.eval.run import compare, load_results

    cfg: EvalConfig = build_config(args)
    name = cfg.name or Path(cfg.model or "endpoint").resolve().name
    out = Path(cfg.out or f"runs/eval/{name}")
    res = _eval_one(cfg, cfg.model, cfg.adapter, name, out, args.json)
    report: dict[str, Any] = {
        "out": str(out),
        "results": str(out / "results.json"),
        "png": str(out / "frontier.png"),
        "table": res["table"],
        "overall": res["overall"],
    }
    text = res["table_text"]
    plots = f"plot:    {out / 'frontier.png'}"
    if cfg.compare:
        cp = Path(cfg.compare)
        if (cp / "results.json").is_file() or cp.suffix == ".json":
            other = load_results(cp)
        else:
            other = _eval_one(
                cfg, str(cp), None, cp.resolve().name, out / "compare" / cp.resolve().name, args.json
            )
        cmp = compare(res, other, out)
        report["compare"] = {k: v for k, v in cmp.items() if k != "text"}
        text += "\n\n" + cmp["text"]
        report["tool_calls_png"] = str(out / "tool_calls.png")
        plots += f"\n         {out / 'compare.png'}\n         {out / 'tool_calls.png'}"
    emit(report, args.json, f"{text}\n\nresults: {out / 'results.json'}\n{plots}")
    return 0


def cmd_select(args: argparse.Namespace) -> int:
    from jaxpi.eval.run import load_results, rank

    cfg: SelectConfig = build_config(args)
    results = []
    for c in cfg.ckpts:
        p = Path(c)
        if (p / "results.json").is_file() or (p.is_file() and p.suffix == ".json"):
            results.append(load_results(p))
        else:
            name = p.resolve().name
            if not args.json:
                print(f"evaluating {name} ...", file=sys.stderr, flush=True)
            results.append(_eval_one(cfg, str(p), None, name, Path(cfg.out) / name, args.json))
    ranking = rank(results)
    lines = []
    for i, r in enumerate(ranking, 1):
        pr = r["pass_rate"]
        shown = (
            "-"
            if pr is None
            else f"{100 * pr['value']:.0f}% [{100 * pr['lo']:.0f}, {100 * pr['hi']:.0f}] (n={pr['n']})"
        )
        lines.append(f"{i}. {r['name']}: {shown}")
    emit({"ranking": ranking}, args.json, "\n".join(lines))
    return 0

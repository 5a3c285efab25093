"""`jaxpi`: the command-line front door.

jaxpi parity --hf-dir DIR [--seq-len N] [--batch B] [--dtype float32|bfloat16] [--reference auto|fp64|fp32]
             [--segments K] [--inject BUG] [--json]
jaxpi convert --from DIR --to OUT [--dtype bfloat16] [--max-shard-size 5GB] [--check] [--json]
jaxpi tiny-checkpoint OUT [--kind causal|conditional] [--layers N] [--seed S] [--dtype float32]
jaxpi data check PATHS... [--tokenizer DIR] [--json]
jaxpi sft --config configs/sft/tiny.yaml [key.sub=value ...] [--json]
jaxpi export --adapter RUN_OR_CKPT [--base HF_DIR] --out DIR [--merged] [--json]
jaxpi plan --preset NAME | --model M --mesh SPEC --strategy S ... [--json]
jaxpi demo [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxpi.data import cli as data_cli
from jaxpi.plan.presets import load_preset, prepare_plan_process

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[unit]
    return int(float(m.group(1)) * scale)


def _print(obj: dict, as_json: bool, text: str) -> None:
    print(json.dumps(obj, indent=2) if as_json else text)


def cmd_parity(args: argparse.Namespace) -> int:
    from jaxpi.parity import run_parity

    report = run_parity(
        args.hf_dir,
        seq_len=args.seq_len,
        batch=args.batch,
        dtype=args.dtype,
        seed=args.seed,
        inject=args.inject,
        reference=args.reference,
        segments=args.segments,
    )
    _print(report.to_json(), args.json, report.table(args.top))
    return 0 if report.passed else 1


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxpi.convert.hf import check_dir, load_hf, save_hf

    src = Path(args.src)
    only_check = args.check or args.dst is None
    # config.json, index and headers always; the NaN/Inf scan reads every weight, so only for --check
    summary = check_dir(src, scan=only_check, progress=not args.json)
    if only_check:
        _print(summary, args.json, "\n".join(f"{k}: {v}" for k, v in summary.items()) + "\ncheckpoint OK")
        return 0
    _, model = load_hf(src, dtype=args.load_dtype, progress=not args.json)
    out = save_hf(
        model,
        args.dst,
        source=src,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.json,
    )
    files = sorted(p.name for p in out.iterdir())
    summary.update(output=str(out), files=files)
    _print(summary, args.json, f"wrote {out} ({len(files)} files)")
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import make_checkpoint, make_hf_checkpoint

    if args.hf_config is not None:
        try:
            text = json.loads(args.hf_config)
        except json.JSONDecodeError as e:
            print(f"jaxpi tiny-checkpoint: --hf-config is not JSON: {e}", file=sys.stderr)
            return 2
        out = make_hf_checkpoint(
            args.out,
            text,
            kind=args.kind,
            tie=args.tied,
            weights=args.weights,
            strong_decay=args.strong_decay,
            seed=args.seed,
        )
    else:
        cfg = TINY.replace(num_hidden_layers=args.layers, tie_word_embeddings=args.tied)
        out = make_checkpoint(args.out, cfg, kind=args.kind, seed=args.seed, dtype=args.dtype)
    print(out)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Parity, a short LoRA SFT on the demo Pi sessions, export, and the adapter reloaded in peft."""
    from jaxpi.demo import run_demo

    return run_demo(args.out, seed=args.seed, seq_len=args.seq_len, as_json=args.json, full=args.full)


def _plan_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill --mesh / --device-memory / --dcn / --strategy from --preset where not given."""
    if args.preset:
        p = load_preset(args.preset)
        args.mesh = args.mesh or p["mesh"]
        args.dcn = args.dcn or p.get("dcn")
        if args.device_memory is None and p.get("device_memory"):
            args.device_memory = _size(str(p["device_memory"]))
        if not args.strategy and not args.compare:
            args.strategy = p.get("strategy")
    if not args.mesh:
        raise ValueError("give --mesh (e.g. fsdp=64) or --preset")
    return args


def cmd_plan(args: argparse.Namespace) -> int:
    from jaxpi.plan import PlanRequest, format_table, plan

    args = _plan_args(args)
    names = args.compare.split(",") if args.compare else [args.strategy or "fsdp"]
    results = []
    for name in names:
        req = PlanRequest(
            model=args.model,
            mesh=args.mesh,
            strategy=name.strip(),
            seq_len=args.seq_len,
            batch_per_device=args.batch_per_device,
            lora_rank=args.lora_rank,
            device_memory=args.device_memory,
            dtype=args.dtype,
            remat=args.remat,
            dcn=args.dcn,
            loss_chunk=args.loss_chunk,
            attn_impl=args.attn_impl,
            gdn_impl=args.gdn_impl,
        )
        results.append(plan(req, progress=not args.json))
    if args.json:
        print(json.dumps([r.to_json() for r in results] if args.compare else results[0].to_json(), indent=2))
    else:
        print(format_table(results))
    return 0 if all(r.fits is not False for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxpi", description="Qwen3.5 in JAX: HF weights in and out, parity with transformers."
    )
    sub = p.add_subparsers(dest="command", required=True)

    par = sub.add_parser("parity", help="compare logits, loss and every gradient against transformers")
    par.add_argument(
        "--hf-dir", required=True, help="HF checkpoint directory (CausalLM or ConditionalGeneration)"
    )
    par.add_argument("--seq-len", type=int, default=64)
    par.add_argument("--batch", type=int, default=2)
    par.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    par.add_argument("--seed", type=int, default=0)
    from jaxpi.kernels.inject import KNOWN_BUGS

    par.add_argument(
        "--reference",
        choices=["auto", "fp64", "fp32"],
        default="auto",
        help="what the errors are measured against: transformers in float64 (auto: where it fits in "
        "memory) or transformers' own run of --dtype",
    )
    par.add_argument(
        "--segments",
        type=int,
        default=1,
        help="pack each row with this many sequences of random lengths (transformers runs each alone)",
    )
    par.add_argument(
        "--inject",
        choices=sorted(KNOWN_BUGS),
        default=None,
        help="swap in a known-bad backward (norms, conv, DeltaNet); the harness must fail and name the "
        "parameters (segment-reset-off-by-one needs --segments 2 or more)",
    )
    par.add_argument("--top", type=int, default=15, help="gradient rows shown in the table")
    par.add_argument("--json", action="store_true", help="print one JSON object")
    par.set_defaults(fn=cmd_parity)

    conv = sub.add_parser(
        "convert",
        help="check a HF checkpoint, or re-export it through jaxpi (dtype, shard size)",
        description="Validate a HF Qwen3.5 checkpoint against its config (names, shapes, dtypes), and with "
        "--to write it back out through jaxpi: HF layout, <= --max-shard-size shards + index, tokenizer "
        "files copied, vision/MTP tensors carried byte for byte, written atomically.",
    )
    conv.add_argument("--from", dest="src", required=True, help="source HF checkpoint directory")
    conv.add_argument("--to", dest="dst", default=None, help="output directory (omit to only check)")
    conv.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the written text tensors (default: the source's)",
    )
    conv.add_argument("--load-dtype", choices=["float32", "bfloat16"], default="float32")
    conv.add_argument("--max-shard-size", type=_size, default=5 * 1024**3, help="e.g. 5GB (default), 500MB")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    conv.add_argument("--check", action="store_true", help="only validate the source")
    conv.add_argument("--json", action="store_true")
    conv.set_defaults(fn=cmd_convert)

    tiny = sub.add_parser("tiny-checkpoint", help="write a tiny random Qwen3.5 checkpoint with transformers")
    tiny.add_argument("out")
    tiny.add_argument("--kind", choices=["causal", "conditional"], default="causal")
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--tied", action="store_true", help="tie_word_embeddings")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    tiny.add_argument(
        "--hf-config",
        default=None,
        help="a text config as JSON (config.json's fields), built with transformers instead of the tiny preset",
    )
    tiny.add_argument(
        "--weights",
        choices=["init", "random"],
        default="init",
        help="with --hf-config: transformers' init with norms and gates perturbed, or every weight random",
    )
    tiny.add_argument(
        "--strong-decay",
        action="store_true",
        help="with --hf-config: A_log in [1, 3], dt_bias in [1, 4] (decays of -10 to -80 per token)",
    )
    tiny.set_defaults(fn=cmd_tiny)

    pl = sub.add_parser(
        "plan",
        help="memory per device and collectives of a sharded training step, compiled for N virtual devices",
        description="Build the training step with abstract arrays only, compile it for the mesh (as N virtual "
        "CPU devices), and report per device: parameter, trainable and optimizer bytes, temporaries, peak, and "
        "the collectives per step, each next to an analytic estimate. Nothing is allocated.",
    )
    pl.add_argument("--model", default="qwen3_5_27b", help="model preset (qwen3_5_27b, tiny)")
    pl.add_argument("--mesh", default=None, help="e.g. fsdp=64 or data=2,fsdp=4,tensor=2")
    pl.add_argument("--dcn", default=None, help="the part of each axis across slices/hosts, e.g. data=2")
    pl.add_argument("--preset", default=None, help="configs/sharding/NAME.yaml: mesh, dcn, device memory")
    pl.add_argument("--strategy", default=None, help="dp, fsdp, tp, fsdp_tp (default fsdp)")
    pl.add_argument("--compare", default=None, help="comma-separated strategies, one column each")
    pl.add_argument("--seq-len", type=int, default=8192)
    pl.add_argument("--batch-per-device", type=int, default=1)
    pl.add_argument(
        "--lora-rank", type=int, default=None, help="LoRA on all linear layers (default: full FT)"
    )
    pl.add_argument(
        "--device-memory", type=_size, default=None, help="e.g. 95GiB; exit 1 when it does not fit"
    )
    pl.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    from jaxpi.config import REMAT_POLICIES

    pl.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default="full",
        help="what each layer group saves for the backward (mlp: its MLP gate/up outputs; mlp_out: "
        "those and each layer's output)",
    )
    pl.add_argument(
        "--loss-chunk", type=int, default=0, help="LM head this many positions at a time (0: all at once)"
    )
    from jaxpi.config import ATTN_IMPLS, GDN_IMPLS

    pl.add_argument(
        "--attn-impl",
        choices=ATTN_IMPLS,
        default="jax",
        help="model.attn_impl: jax keeps each query block's scores for the backward, pallas (flash) "
        "only a log-sum-exp per query (on CPU the kernel compiles in Pallas' interpreter)",
    )
    pl.add_argument(
        "--gdn-impl",
        choices=GDN_IMPLS,
        default="jax",
        help="model.gdn_impl, compiled as given (the analytic figure counts every impl as the plain scan)",
    )
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    demo = sub.add_parser(
        "demo",
        help="what `make demo` runs: parity table, LoRA SFT on the demo Pi sessions, export, peft reload",
    )
    demo.add_argument(
        "--out", default=None, help="where to keep checkpoints and the run (default: a temp dir)"
    )
    demo.add_argument("--seq-len", type=int, default=48, help="sequence length of the parity check")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true")
    demo.add_argument(
        "--full", action="store_true", help="run the whole effort-ordered vs binary GRPO comparison (longer)"
    )
    demo.set_defaults(fn=cmd_demo)
    from jaxpi.bench import cli as bench_cli

    bench_cli.add_subparser(sub)
    from jaxpi.train import sft as sft_cli

    sft_cli.add_subparser(sub)
    data_cli.add_subparser(sub)
    from jaxpi.convert import export_cli

    export_cli.add_subparser(sub)
    from jaxpi.rl import report as report_cli

    report_cli.add_subparser(sub)
    from jaxpi.rl import trainer as grpo_cli

    grpo_cli.add_subparser(sub)
    from jaxpi.rl import study as study_cli

    study_cli.add_subparser(sub)
    from jaxpi.tasks import cli as tasks_cli

    tasks_cli.add_subparser(sub)
    from jaxpi.gateway import cli as gateway_cli
    from jaxpi.serve import cli as serve_cli

    serve_cli.add_subparser(sub)
    gateway_cli.add_subparser(sub)
    from jaxpi.eval import cli as eval_cli
    from jaxpi.runner import cli as pi_cli

    pi_cli.add_subparser(sub)
    eval_cli.add_subparser(sub)
    from jaxpi.vllm import cli as vllm_cli

    vllm_cli.add_subparser(sub)
    return p


# Commands that compile the model reuse programs across processes (jaxpi/compile_cache.py); `bench`
# times compiles and `plan` compiles for a stand-in device count, so they always compile afresh.
COMPILE_CACHED = frozenset({"sft", "grpo", "serve", "gateway", "eval", "pi", "demo", "parity", "convert"})


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        prepare_plan_process(argv)
    args = build_parser().parse_args(argv)
    if args.command in COMPILE_CACHED:
        from jaxpi import compile_cache

        compile_cache.enable()
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"jaxpi {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

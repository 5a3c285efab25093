"""`jaxpi demo`: what `make demo` runs."""

from __future__ import annotations

import argparse
from typing import Any

from jaxpi.cli.registry import help_for

DESCRIPTION = """\
What `make demo` runs, on the tiny Qwen3.5 with JAX on the CPU, in six stages:
  1. parity  a tiny random transformers checkpoint in jaxpi: logits and every gradient compared
  2. sft     configs/sft/tiny.yaml: LoRA SFT on the bundled demo Pi sessions (loss per step)
  3. export  the last checkpoint as a peft adapter directory
  4. reload  the adapter in peft on the transformers base: its logits against jaxpi's
  5. deploy  the SFT model merged and exported as FP8 (reloaded by transformers) and as GGUF
             BF16, Q8_0 and Q4_K_M with an importance matrix from the demo sessions (reloaded
             by llama.cpp), their held-out perplexity in llama.cpp
  6. grpo    the toy effort-ordering result: an SFT that breaks the cost ordering of effort
             levels, then effort-ordered and binary GRPO from it, their table and pictures
             (short: the toy-random base, two updates each; --full: the whole comparison on
             the toy-copy base, configs/sft/toy.yaml and configs/grpo/toy.yaml)
Each stage is skipped when its output under --out exists, so a rerun picks up where it stopped."""


def add_subparser(sub: Any) -> None:
    """Register `jaxpi demo`."""
    demo = sub.add_parser(
        "demo",
        help=help_for("demo"),
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument(
        "--out", default=None, help="where to keep checkpoints and the run (default: a temp dir)"
    )
    demo.add_argument("--seq-len", type=int, default=48, help="sequence length of the parity check")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="no progress; print one JSON object at the end")
    demo.add_argument(
        "--full",
        action="store_true",
        help="stage 5: the whole effort-ordered vs binary GRPO comparison (longer)",
    )
    demo.add_argument(
        "--family",
        choices=["qwen3_5", "qwen3"],
        default="qwen3_5",
        help="qwen3: stages 1-4 (parity, sft, export, reload) on the tiny Qwen3 dense",
    )
    demo.set_defaults(fn=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """Parity, a short LoRA SFT on the demo Pi sessions, export, and the adapter reloaded in peft."""
    from jaxpi.demo import run_demo

    return run_demo(
        args.out, seed=args.seed, seq_len=args.seq_len, as_json=args.json, full=args.full, family=args.family
    )

"""`jaxpi tiny-checkpoint`: a tiny random checkpoint built by transformers (Qwen3.5, or with
`--family qwen3` the Qwen3 dense), with the bundled tiny tokenizer and its chat template, so `jaxpi serve --model OUT` serves it as it is
(a --hf-config checkpoint has no tokenizer: its vocabulary is the config's)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> None:
    """Register `jaxpi tiny-checkpoint`."""
    tiny = sub.add_parser("tiny-checkpoint", help=help_for("tiny-checkpoint"))
    tiny.add_argument("out")
    tiny.add_argument(
        "--family",
        choices=["qwen3_5", "qwen3"],
        default="qwen3_5",
        help="the model family's tiny preset (qwen3: the Qwen3 dense, Qwen3ForCausalLM)",
    )
    tiny.add_argument("--kind", choices=["causal", "conditional"], default="causal")
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument(
        "--tied",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie_word_embeddings (default: the family's tiny preset: off for qwen3_5, on for qwen3)",
    )
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
    tiny.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    tiny.set_defaults(fn=cmd_tiny)


def cmd_tiny(args: argparse.Namespace) -> int:
    from jaxpi.atomic import atomic_dir
    from jaxpi.convert.tiny import tiny_config
    from jaxpi.hf_fixtures import make_checkpoint, make_hf_checkpoint

    text = None
    if args.hf_config is not None:
        try:
            text = json.loads(args.hf_config)
        except json.JSONDecodeError as e:
            print(f"jaxpi tiny-checkpoint: --hf-config is not JSON: {e}", file=sys.stderr)
            return 2
    # Written into a hidden temporary beside OUT, renamed to OUT when complete (jaxpi.atomic).
    with atomic_dir(args.out, overwrite=args.overwrite) as tmp:
        if text is not None:
            make_hf_checkpoint(
                tmp,
                text,
                kind=args.kind,
                tie=bool(args.tied),
                weights=args.weights,
                strong_decay=args.strong_decay,
                seed=args.seed,
            )
        else:
            tiny = tiny_config(args.family)
            tied = tiny.tie_word_embeddings if args.tied is None else args.tied
            cfg = tiny.replace(num_hidden_layers=args.layers, tie_word_embeddings=tied)
            # With the tiny tokenizer (its chat template included): `jaxpi serve --model OUT` runs as is.
            make_checkpoint(tmp, cfg, kind=args.kind, seed=args.seed, dtype=args.dtype, tokenizer=True)
    print(args.out)
    return 0

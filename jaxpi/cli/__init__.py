"""`jaxpi`: the command-line front door.

jaxpi parity --hf-dir DIR [--seq-len N] [--batch B] [--dtype float32|bfloat16] [--reference auto|fp64|fp32]
             [--segments K] [--inject BUG] [--json]
jaxpi convert --from DIR --to OUT [--dtype bfloat16] [--max-shard-size 5GB] [--check] [--json]
jaxpi tiny-checkpoint OUT [--kind causal|conditional] [--layers N] [--seed S] [--dtype float32]
jaxpi data check PATHS... [--tokenizer DIR] [--json]
jaxpi sft --config configs/sft/tiny.yaml [key.sub=value ...] [--json]
jaxpi export --adapter RUN_OR_CKPT [--base HF_DIR] --out DIR [--merged | --format fp8] [--json]
jaxpi export --format fp8 --base HF_DIR --out DIR | --size-of qwen3_5_27b [--json]
jaxpi plan --preset NAME | --model M --mesh SPEC --strategy S ... [--json]
jaxpi demo [--out DIR] [--json]
... and the rest of `jaxpi --help`; `jaxpi --version` prints the package's version.

Every command is a row of `jaxpi.cli.registry.COMMANDS` and a module with `add_subparser`; a
command's module is imported only when that command runs (or its --help is asked for), so
`jaxpi --help` and the light commands start without jax. Exit status: 0 ok, 1 the command ran and
a check failed (parity, plan's fit, an audit, ...), 2 bad input (arguments, config, a missing
file); the trainers' own stops are 3 and up (docs/sft.md, docs/grpo.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence

from jaxpi.cli.errors import BAD_INPUT, BAD_INPUT_ERRORS
from jaxpi.cli.registry import BY_NAME, COMMANDS
from jaxpi.configfile.help import add_defaults

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ALL = "*"


def build_parser(command: str | None = ALL) -> argparse.ArgumentParser:
    """The `jaxpi` parser with `command`'s own arguments (every command's with ALL); the other
    commands get a placeholder with their help line, so their modules are not imported."""
    p = argparse.ArgumentParser(
        prog="jaxpi", description="Qwen3.5 in JAX: HF weights in and out, parity with transformers."
    )
    p.add_argument("--version", action="version", version=f"jaxpi {importlib.metadata.version('jaxpi')}")
    sub = p.add_subparsers(dest="command", required=True)
    wanted = BY_NAME[command].module if command in BY_NAME else None
    registered: set[str] = set()
    for cmd in COMMANDS:
        if command == ALL or cmd.module == wanted:
            if cmd.module not in registered:  # one module may register several commands (eval, select)
                importlib.import_module(cmd.module).add_subparser(sub)
                registered.add(cmd.module)
        else:
            sub.add_parser(cmd.name, help=cmd.help)
    add_defaults(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(command).parse_args(argv)
    if BY_NAME[args.command].compile_cache:
        from jaxpi import compile_cache

        compile_cache.enable()
    try:
        return args.fn(args)
    except BAD_INPUT_ERRORS as e:
        print(f"jaxpi {args.command}: error: {e}", file=sys.stderr)
        return BAD_INPUT

"""`jaxpi grpo`: effort-ordered GRPO (or the binary baseline) on an environment (`jaxpi.rl.trainer`).

    jaxpi grpo --config configs/grpo/tiny.yaml reward.kind=binary output.dir=runs/binary [--json]

Rerunning the same command resumes from the latest checkpoint in `output.dir`. Exit codes past
the common ones: 3 a non-finite loss, 4 the rollout engine failed a collection past its retries,
5 the vLLM server is missing or does not serve the trainer's policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxpi.cli.config_args import CONFIG_DIR
from jaxpi.cli.registry import help_for
from jaxpi.configfile import load_config, resolve_path
from jaxpi.configfile.help import add_config_help


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi grpo` on the CLI's subparsers."""
    p = sub.add_parser(
        "grpo",
        help=help_for("grpo"),
        description="Collect attempts at every effort level, score them with the effort-ordered (or binary) "
        "reward, one LoRA update per collection. Rerunning the same command resumes from the latest "
        "checkpoint in output.dir. `jaxpi report RUN_DIR` draws the run.",
    )
    p.add_argument(
        "--config", required=True, help="YAML file, e.g. configs/grpo/tiny.yaml, or a NAME of configs/grpo/"
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override any config field")
    p.add_argument("--json", action="store_true", help="no progress bar; print a JSON summary at the end")
    p.set_defaults(fn=cmd_grpo)
    add_config_help(p, _grpo_config)  # the config's module imports jax: only when --help prints
    return p


def _grpo_config() -> type:
    from jaxpi.rl.config import GRPOConfig

    return GRPOConfig


def cmd_grpo(args: argparse.Namespace) -> int:
    # The trainer (jax, orbax, the engines) is imported when a run starts: `--help` stays light.
    from jaxpi.rl.config import GRPOConfig
    from jaxpi.rl.fleet.cluster import FleetError
    from jaxpi.rl.sampling import CollectionFailedError
    from jaxpi.rl.trainer import run_grpo
    from jaxpi.vllm.server import ServerError
    from jaxpi.vllm.sync import AdapterProbeError

    cfg = load_config(GRPOConfig, resolve_path(args.config, CONFIG_DIR / "grpo"), args.overrides)
    try:
        summary = run_grpo(cfg, progress=not args.json, out=sys.stderr if args.json else sys.stdout)
    except FloatingPointError as e:
        print(f"jaxpi grpo: {e}", file=sys.stderr)
        return 3
    except (CollectionFailedError, FleetError) as e:
        # The engine or the Ray fleet failed a collection: no update was made from it.
        print(f"jaxpi grpo: stopped: {e}", file=sys.stderr)
        return 4
    except (AdapterProbeError, ServerError) as e:
        # The served policy is not the trainer's, or no server: collecting now would train on garbage.
        print(f"jaxpi grpo: stopped: {e}", file=sys.stderr)
        return 5
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"done: {summary['collections']} updates, checkpoint {summary['checkpoint']}")
    return 0

"""`SFTConfig`, what `jaxpi sft --config FILE [key.sub=value ...]` sets: the base model, the data,
LoRA, the optimizer, the loop, the mesh and the output directory. docs/sft.md has every field."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxpi.configfile import to_dict
from jaxpi.data.gates import GateConfig
from jaxpi.lora import LoraConfig
from jaxpi.sft.data import BUILT_IN, is_source, source_names
from jaxpi.train.base import ModelConfig
from jaxpi.train.loggers import logger_errors
from jaxpi.train.schedule import OptimConfig

DEMO_SESSIONS = str(Path(__file__).resolve().parents[1] / "assets" / "demo" / "sessions")


def _one_of(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "sessions" (Pi sessions, rendered) | "synthetic" (random-token test data) | a registered
    # source (jaxpi.sft.data), e.g. "toy_lookup" (the toy lookup study's scripted sessions)
    source: str = "sessions"
    sessions: tuple[str, ...] = (DEMO_SESSIONS,)  # files or directories of sessions
    tokenizer: str = ""  # tokenizer directory; "" = the base checkpoint's own
    seq_len: int = 2048
    batch_size: int = 8  # rows per microbatch (global, all hosts); a step sees grad_accum of them
    packing: str = "first_fit"  # first_fit | best_fit | none
    overlong: str = "truncate"  # truncate | drop
    shuffle: bool = True
    val_fraction: float = 0.1  # share of sessions held out for validation loss
    synthetic_examples: int = 64  # source "synthetic" only
    # source "toy_lookup" only (jaxpi.experiments.toy.sessions): scripted LookupEnv sessions, levels
    # in turn, toy_reasoning = (lo, hi) reasoning tokens per level of toy_levels, flattened; () = defaults
    toy_examples: int = 384
    toy_levels: tuple[str, ...] = ("low", "medium", "xhigh")
    toy_reasoning: tuple[int, ...] = ()
    toy_max_value: int = 100  # the tasks' values are 0 .. toy_max_value-1 (ToySFTConfig.max_value)
    gate: GateConfig = dataclasses.field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        errors = []
        if self.source not in BUILT_IN and not is_source(self.source):
            errors.append(f"data.source must be {_one_of(source_names())}, got {self.source!r}")
        if self.source == "sessions" and not self.sessions:
            errors.append("data.sessions must name at least one file or directory")
        if self.seq_len < 2:
            errors.append(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            errors.append(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.packing not in ("first_fit", "best_fit", "none"):
            errors.append(f"data.packing must be first_fit, best_fit or none, got {self.packing!r}")
        if self.overlong not in ("truncate", "drop"):
            errors.append(f"data.overlong must be truncate or drop, got {self.overlong!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            errors.append(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.synthetic_examples < 2:
            errors.append(f"data.synthetic_examples must be >= 2, got {self.synthetic_examples}")
        if self.toy_examples < 2:
            errors.append(f"data.toy_examples must be >= 2, got {self.toy_examples}")
        if not self.toy_levels:
            errors.append("data.toy_levels must name at least one effort level")
        if self.toy_reasoning and len(self.toy_reasoning) != 2 * len(self.toy_levels):
            errors.append(
                f"data.toy_reasoning must hold (lo, hi) for each of the {len(self.toy_levels)} toy_levels "
                f"({2 * len(self.toy_levels)} numbers), got {len(self.toy_reasoning)}"
            )
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer updates
    grad_accum: int = 1  # microbatches per update
    seed: int = 0
    eval_every: int = 0  # validation loss every N steps (and at the end); 0 = only at the end
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    eval_hook: str = ""  # "module:function", called as fn(checkpoint_dir, step) after each checkpoint
    # a plain log line every N steps (and at the last) when stderr is not a terminal or with --json
    # (a progress bar on a terminal); 0 = none
    log_every: int = 10

    def __post_init__(self) -> None:
        errors = []
        if self.steps < 1:
            errors.append(f"train.steps must be >= 1, got {self.steps}")
        if self.grad_accum < 1:
            errors.append(f"train.grad_accum must be >= 1, got {self.grad_accum}")
        if not 0 <= self.seed < 2**32:
            errors.append(f"train.seed must be in [0, 2**32), got {self.seed}")
        if self.eval_every < 0:
            errors.append(f"train.eval_every must be >= 0, got {self.eval_every}")
        if self.checkpoint_every < 1:
            errors.append(f"train.checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            errors.append(f"train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.log_every < 0:
            errors.append(f"train.log_every must be >= 0, got {self.log_every}")
        if self.eval_hook and ":" not in self.eval_hook:
            errors.append(f"train.eval_hook must be 'module:function', got {self.eval_hook!r}")
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    strategy: str = ""  # dp | fsdp | tp | fsdp_tp; "" with no mesh = one device
    mesh: str = ""  # e.g. "fsdp=8" or "data=2,fsdp=4"; "" = one device

    def __post_init__(self) -> None:
        if self.strategy and not self.mesh:
            raise ValueError("sharding.strategy needs sharding.mesh (e.g. fsdp=8)")


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs/sft"
    # where step records go besides <dir>/metrics.jsonl: tensorboard (<dir>/tb), wandb, mlflow
    # (the extras jaxpi[wandb], jaxpi[mlflow]; docs/sft.md, "Logging"); [] = metrics.jsonl only
    loggers: tuple[str, ...] = ("tensorboard",)

    def __post_init__(self) -> None:
        errors = logger_errors(self.loggers)
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)


# Sections that must not change when a run resumes (they define what the checkpoint means).
FIXED_ON_RESUME = ("model", "data", "lora", "optim", "train.seed", "train.grad_accum")
_MISSING = object()


def resume_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys of `FIXED_ON_RESUME` whose values differ between two config dicts.

    A field the saved config lacks (a run saved before the field existed) counts as its default:
    it differs only when the current run sets it to something else.
    """
    diffs = []
    defaults = to_dict(SFTConfig())

    def walk(a: Any, b: Any, default: Any, key: str) -> None:
        if a is _MISSING:
            a = default
        if isinstance(a, dict) and isinstance(b, dict):
            d = default if isinstance(default, dict) else {}
            for k in sorted(set(a) | set(b)):
                walk(a.get(k, _MISSING), b.get(k), d.get(k), f"{key}.{k}")
        elif a != b:
            diffs.append(key)

    for key in FIXED_ON_RESUME:
        section, _, field = key.partition(".")
        a, b, d = (c.get(section, {}) for c in (saved, current, defaults))
        if field:
            a, b, d = a.get(field, _MISSING), b.get(field), d.get(field)
        walk(a, b, d, key)
    return diffs

"""The base model a run trains on: `ModelConfig` (the `model:` section of `jaxpi sft` and
`jaxpi grpo`) and `prepare_base`, which turns `model.base` into a checkpoint directory.

`model.base` is an HF checkpoint directory or the name of a registered base. A named base is
written into `<run dir>/base` once, from the run's seed (a temporary directory renamed into place,
so a killed start never leaves a half-written base). "tiny-random" (the tiny Qwen3.5 written by
transformers, `jaxpi.convert.tiny`) and "tiny-random-qwen3" (the tiny Qwen3 dense) are built in; others are registered with `register_base`, or by
an installed package through the `jaxpi.bases` entry-point group (`name = "module:builder"`), so
the trainers never import the experiments that define them. A builder is called as
`builder(out_dir, request)` with a `BaseRequest` and returns the written directory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from jaxpi.atomic import atomic_dir
from jaxpi.config import ATTN_IMPLS, GDN_IMPLS, REMAT_POLICIES, parse_attn_kernel, parse_gdn_kernel

TINY_RANDOM = "tiny-random"
ENTRY_POINT_GROUP = "jaxpi.bases"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    # HF checkpoint directory, or a named base written into the run dir: "tiny-random", or one
    # registered through the jaxpi.bases entry points ("toy-random", "toy-copy": the toy study's)
    base: str = TINY_RANDOM
    dtype: str = "bfloat16"  # frozen base weights; adapters and optimizer state are float32
    remat: str = "none"  # QwenConfig.remat: none | full | dots | dots_no_batch | mlp | mlp_out
    tiny_layers: int = 4  # depth of the "tiny-random" base
    gdn_impl: str = "jax"  # QwenConfig.gdn_impl: the chunked gated delta rule, one of GDN_IMPLS
    # QwenConfig.gdn_kernel: the Pallas paths' kernel settings, e.g. "block_v=16,num_stages=2"
    gdn_kernel: str = ""
    norm_impl: str = "jax"  # QwenConfig.norm_impl: RMSNorm and gated RMSNorm, "jax" | "pallas"
    attn_impl: str = "jax"  # QwenConfig.attn_impl: causal self-attention, "jax" | "pallas" (flash)
    # QwenConfig.attn_kernel: the flash attention's settings, e.g. "block_q=32,block_k=32"
    attn_kernel: str = ""
    # QwenConfig.loss_chunk: the loss runs the LM head this many positions at a time, so the
    # [B, T, V] logits never exist whole (0 = at once; e.g. 1024 for a 248k vocabulary at long T)
    loss_chunk: int = 0

    def __post_init__(self) -> None:
        if not self.base:
            raise ValueError(
                "model.base must be an HF checkpoint directory or a named base (e.g. 'tiny-random')"
            )
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"model.dtype must be bfloat16 or float32, got {self.dtype!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.tiny_layers < 1:
            raise ValueError(f"model.tiny_layers must be >= 1, got {self.tiny_layers}")
        if self.gdn_impl not in GDN_IMPLS:
            raise ValueError(f"model.gdn_impl must be one of {GDN_IMPLS}, got {self.gdn_impl!r}")
        try:
            kernel = parse_gdn_kernel(self.gdn_kernel)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None
        if kernel and not self.gdn_impl.startswith("pallas"):
            raise ValueError(
                f"model.gdn_kernel {self.gdn_kernel!r} applies only to gdn_impl pallas / pallas_split"
            )
        if self.norm_impl not in ("jax", "pallas"):
            raise ValueError(f"model.norm_impl must be jax or pallas, got {self.norm_impl!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"model.attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        try:
            attn_kernel = parse_attn_kernel(self.attn_kernel)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None
        if attn_kernel and self.attn_impl != "pallas":
            raise ValueError(f"model.attn_kernel {self.attn_kernel!r} applies only to attn_impl pallas")
        if self.loss_chunk < 0:
            raise ValueError(f"model.loss_chunk must be >= 0 (0: the LM head at once), got {self.loss_chunk}")

    def overrides(self) -> dict[str, str | int]:
        """The runtime knobs of QwenConfig this section sets (for `load_hf(config_overrides=...)`)."""
        return {
            "remat": self.remat,
            "gdn_impl": self.gdn_impl,
            "gdn_kernel": self.gdn_kernel,
            "norm_impl": self.norm_impl,
            "attn_impl": self.attn_impl,
            "attn_kernel": self.attn_kernel,
            "loss_chunk": self.loss_chunk,
        }


@dataclasses.dataclass(frozen=True)
class BaseRequest:
    """What a named base is built from: the run's seed, `model.tiny_layers`, and the trainer's
    options for it (e.g. the toy bases' `max_value`: SFT's `data.toy_max_value`, GRPO's
    `env.max_value`)."""

    seed: int
    layers: int
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


BaseBuilder = Callable[[Path, BaseRequest], Path]


def _tiny_random(out_dir: Path, request: BaseRequest, family: str = "qwen3_5") -> Path:
    from jaxpi.convert.tiny import make_checkpoint, tiny_config  # torch and transformers, when asked for

    model_cfg = tiny_config(family).replace(num_hidden_layers=request.layers)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        make_checkpoint(tmp, model_cfg, seed=request.seed, tokenizer=True)  # the bundled tiny tokenizer
    return out_dir


# "tiny-random" (Qwen3.5) and "tiny-random-qwen3" (the tiny Qwen3 dense)
_BUILDERS: dict[str, BaseBuilder] = {
    TINY_RANDOM: _tiny_random,
    f"{TINY_RANDOM}-qwen3": functools.partial(_tiny_random, family="qwen3"),
}


def register_base(name: str, build: BaseBuilder) -> None:
    """Make `model.base: name` build its checkpoint with `build(out_dir, request)`."""
    _BUILDERS[name] = build


def _registered(name: str) -> BaseBuilder | None:
    if name not in _BUILDERS:
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            _BUILDERS[name] = ep.load()
    return _BUILDERS.get(name)


def base_names() -> list[str]:
    """Every named base: built in, registered, and from installed entry points."""
    return sorted(set(_BUILDERS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def prepare_base(
    model: ModelConfig, run_dir: Path, *, seed: int, options: Mapping[str, Any] | None = None
) -> Path:
    """The base checkpoint directory of `model.base`: the HF directory itself, or a named base
    written into `<run_dir>/base` once (reused when its config.json is there)."""
    build = _registered(model.base)
    if build is None:
        base = Path(model.base).absolute()
        if not (base / "config.json").exists():
            names = ", ".join(base_names())
            raise FileNotFoundError(
                f"model.base {base} has no config.json (expected an HF checkpoint dir or one of: {names})"
            )
        return base
    base = Path(run_dir) / "base"
    if (base / "config.json").exists():
        return base
    return build(base, BaseRequest(seed=seed, layers=model.tiny_layers, options=dict(options or {})))

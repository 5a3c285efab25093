"""LoRA adapters on every linear layer of the Qwen3.5 text model.

For a frozen projection W (stored input-major, `[*in, *out]`) the adapted layer computes

    y = x·W + s · (x·A)·B          A: [*in, r]   B: [r, *out]   s = alpha / r

with B initialised to zero, so an adapter starts as the identity (as `peft` does). Targets are named
as `peft`/HF name the modules: attention `q_proj k_proj v_proj o_proj`, DeltaNet
`in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj`, MLP `gate_proj up_proj down_proj`. HF's fused
`in_proj_qkv` is stored by jaxpi as three projections, so its adapter has one shared A and one B per
part (`b_q`, `b_k`, `b_v`), which concatenate to `peft`'s `lora_B`.

Adapter weights are `LoRAParam` variables (float32, with logical axes like every parameter), kept
apart from the frozen `nnx.Param` base weights: `nnx.state(model, LoRAParam)` is the trainable state.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.config import FULL
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_plan


class LoRAParam(nnx.Variable):
    """A trainable adapter weight (the base model's `nnx.Param`s stay frozen)."""


# HF module name -> (owning block, our projection attributes). One A per HF module, one B per part.
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "q_proj": ("attn", ("q_proj",)),
    "k_proj": ("attn", ("k_proj",)),
    "v_proj": ("attn", ("v_proj",)),
    "o_proj": ("attn", ("o_proj",)),
    "in_proj_qkv": ("gdn", ("q_proj", "k_proj", "v_proj")),
    "in_proj_z": ("gdn", ("z_proj",)),
    "in_proj_b": ("gdn", ("b_proj",)),
    "in_proj_a": ("gdn", ("a_proj",)),
    "out_proj": ("gdn", ("out_proj",)),
    "gate_proj": ("mlp", ("gate_proj",)),
    "up_proj": ("mlp", ("up_proj",)),
    "down_proj": ("mlp", ("down_proj",)),
}
ALL_LINEAR = tuple(TARGETS)
# Number of leading (input) dims of each stored projection; the rest are output dims.
_IN_DIMS = {"o_proj": 2, "out_proj": 2}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_LINEAR

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; known: {list(TARGETS)}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def a_name(hf: str) -> str:
    return f"lora_a_{hf}"


def b_name(proj: str) -> str:
    return f"lora_b_{proj}"


def _stacked(value: jax.Array, axes: tuple, g: int | None) -> LoRAParam:
    if g is not None:
        axes = ("layers", *axes)
    return LoRAParam(value, out_sharding=tuple(axes), eager_sharding=False)


def _add_to_module(module: nnx.Module, owner: str, lcfg: LoraConfig, key: jax.Array, g: int | None) -> None:
    lead = () if g is None else (g,)
    for hf in lcfg.targets:
        kind, projs = TARGETS[hf]
        if kind != owner:
            continue
        base = getattr(module, projs[0])
        shape = base.get_value().shape[len(lead) :]
        axes = base.get_metadata()["out_sharding"][len(lead) :]
        n_in = _IN_DIMS.get(projs[0], 1)
        fan_in = math.prod(shape[:n_in])
        key, sub = jax.random.split(key)
        # peft's default: kaiming-uniform(a=√5) for A, i.e. U(±1/√fan_in); zeros for B.
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(sub, (*lead, *shape[:n_in], lcfg.rank), jnp.float32, -bound, bound)
        setattr(module, a_name(hf), _stacked(a, (*axes[:n_in], "lora_rank"), g))
        for proj in projs:
            pshape = getattr(module, proj).get_value().shape[len(lead) :]
            paxes = getattr(module, proj).get_metadata()["out_sharding"][len(lead) :]
            b = jnp.zeros((*lead, lcfg.rank, *pshape[n_in:]), jnp.float32)
            setattr(module, b_name(proj), _stacked(b, ("lora_rank", *paxes[n_in:]), g))
    module.lora_scale = lcfg.scale


def add_lora(
    model: Qwen3_5ForCausalLM, lcfg: LoraConfig, *, key: jax.Array | None = None
) -> Qwen3_5ForCausalLM:
    """Attach fresh adapters (A random, B zero) to every targeted projection, in place."""
    if lcfg.dropout:
        raise NotImplementedError("LoRA dropout is not implemented yet; use dropout=0.0")
    key = jax.random.key(0) if key is None else key
    cfg = model.cfg
    _, g = layer_plan(cfg)
    blocks = [(blk, g) for blk in (model.groups.blocks if model.groups is not None else [])]
    blocks += [(blk, None) for blk in model.tail]
    for i, (blk, groups) in enumerate(blocks):
        key_i = jax.random.fold_in(key, i)
        owner = "attn" if blk.layer_type == FULL else "gdn"
        _add_to_module(blk.mixer, owner, lcfg, jax.random.fold_in(key_i, 0), groups)
        _add_to_module(blk.mlp, "mlp", lcfg, jax.random.fold_in(key_i, 1), groups)
    model.lora_config = lcfg
    return model


def merge_lora(model: Qwen3_5ForCausalLM) -> Qwen3_5ForCausalLM:
    """Fold every adapter into its base weight (W ← W + s·A·B, in W's dtype) and drop the adapters."""
    for module, lead in _adapted_modules(model):
        scale = module.lora_scale
        for hf, (_, projs) in TARGETS.items():
            a_var = getattr(module, a_name(hf), None)
            if a_var is None:
                continue
            a = a_var.get_value()
            a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])  # [(G,) in, r]
            for proj in projs:
                base = getattr(module, proj)
                w = base.get_value()
                b = getattr(module, b_name(proj)).get_value()
                b2 = b.reshape(*b.shape[: lead + 1], -1)  # [(G,) r, out]
                delta = jnp.matmul(a2, b2).reshape(w.shape)
                base.set_value((w.astype(jnp.float32) + scale * delta).astype(w.dtype))
                delattr(module, b_name(proj))
            delattr(module, a_name(hf))
        del module.lora_scale
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def _adapted_modules(model: Qwen3_5ForCausalLM) -> list[tuple[nnx.Module, int]]:
    """(module, number of stacking axes) for every block module carrying adapters."""
    groups = list(model.groups.blocks) if model.groups is not None else []
    out = []
    for blocks, lead in ((groups, 1), (list(model.tail), 0)):
        for blk in blocks:
            out += [(m, lead) for m in (blk.mixer, blk.mlp) if hasattr(m, "lora_scale")]
    return out

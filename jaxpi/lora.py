"""LoRA adapters on the linear layers of the Qwen3.5 text model.

For a frozen projection W (stored input-major, `[*in, *out]`) the adapted layer computes

    y = x·W + s · (drop(x)·A)·B          A: [*in, r]   B: [r, *out]   s = alpha / r

with B initialised to zero, so an adapter starts as the identity (as `peft` does), and `drop` the
inverted dropout `peft` applies to the adapter's input (only when the forward pass is given a
`dropout_key`). Targets are named as `peft`/HF name the modules: attention
`q_proj k_proj v_proj o_proj`, DeltaNet `in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj`, MLP
`gate_proj up_proj down_proj`. HF's fused `in_proj_qkv` is stored by jaxpi as three projections, so
its adapter has one shared A and one B per part (`b_q`, `b_k`, `b_v`), which concatenate to `peft`'s
`lora_B`.

Which modules get an adapter: every module named in `targets`, optionally narrowed to some layers
(`layers`) and/or to the HF module paths a regex fullmatches (`pattern`, over paths relative to the
text model such as `layers.3.self_attn.q_proj`). In a scanned layer group the adapters of one
position are stacked over the groups; when only some of those layers are selected, a `LoRAMask`
(1.0 / 0.0 per group) zeroes the others' update, and so their gradients.

Adapter weights are `LoRAParam` variables (float32, with logical axes like every parameter), kept
apart from the frozen `nnx.Param` base weights: `nnx.state(model, LoRAParam)` is the trainable state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.config import FULL, QwenConfig
from jaxpi.convert.table import LINEAR_MODULES, LINEAR_NAMES
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_location, layer_plan


class LoRAParam(nnx.Variable):
    """A trainable adapter weight (the base model's `nnx.Param`s stay frozen)."""


class LoRAMask(nnx.Variable):
    """Per-group 1.0 / 0.0 of a stacked adapter whose layers are only partly selected (not trained)."""


# Views of the HF table's linear modules (`jaxpi.convert.table.LINEAR_MODULES`).
# HF module name -> (owning block, our projection attributes). One A per HF module, one B per part.
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {m.hf: (m.block, m.parts) for m in LINEAR_MODULES}
ALL_LINEAR = LINEAR_NAMES
# Our block -> the HF submodule that holds it inside `layers.N`.
HF_BLOCK = {m.block: m.hf_block for m in LINEAR_MODULES}
# Number of leading (input) dims of each stored projection (when not 1); the rest are output dims.
_IN_DIMS = {p: m.n_in for m in LINEAR_MODULES for p in m.parts if m.n_in != 1}


def _layers(value: object) -> tuple[int, ...] | None:
    """`layers` as a sorted tuple: from ints, a range, or text like "0,3,8-11" (YAML / CLI)."""
    if value is None:
        return None
    if isinstance(value, str):
        out: list[int] = []
        for part in value.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"LoRA layers {value!r}: expected indices like '0,3,8-11'")
            out += range(int(lo), int(hi or lo) + 1)
        value = out
    if not isinstance(value, Iterable):
        raise ValueError(f"LoRA layers must be layer indices, got {value!r}")
    items = list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"LoRA layers must be non-negative integers, got {items}")
    if not items:
        raise ValueError("LoRA layers is empty: give at least one layer index (or None for all)")
    return tuple(sorted(set(items)))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapter shape and placement.

    `targets`: HF module names. `layers`: layer indices (a list, a range or "0,3,8-11"; None = all).
    `pattern`: a regex that must fullmatch a module's path relative to the text model, e.g.
    `layers\\.(1|3)\\..*\\.q_proj` (paths look like `layers.0.linear_attn.in_proj_qkv`,
    `layers.3.self_attn.o_proj`, `layers.5.mlp.up_proj`). A module is adapted when all given
    criteria select it; `select_modules` resolves them against a model and rejects an empty match.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_LINEAR
    layers: tuple[int, ...] | None = None
    pattern: str | None = None

    def __post_init__(self) -> None:
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "layers", _layers(self.layers))
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; known: {list(TARGETS)}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"LoRA pattern {self.pattern!r} is not a valid regex: {e}") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def module_paths(cfg: QwenConfig) -> list[tuple[int, str, str]]:
    """(layer, HF module name, path relative to the text model) of every adaptable linear layer."""
    out = []
    for i, layer_type in enumerate(cfg.layer_types):
        owners = ("attn" if layer_type == FULL else "gdn", "mlp")
        out += [
            (i, hf, f"layers.{i}.{HF_BLOCK[kind]}.{hf}")
            for hf, (kind, _) in TARGETS.items()
            if kind in owners
        ]
    return out


def select_modules(cfg: QwenConfig, lcfg: LoraConfig) -> list[tuple[int, str]]:
    """The (layer, HF module name) pairs `lcfg` adapts in a model of config `cfg`, in layer order."""
    n = cfg.num_hidden_layers
    if lcfg.layers is not None and lcfg.layers[-1] >= n:
        bad = [i for i in lcfg.layers if i >= n]
        raise ValueError(f"LoRA layers {bad} out of range: the model has {n} layers (0..{n - 1})")
    paths = module_paths(cfg)
    rx = re.compile(lcfg.pattern) if lcfg.pattern is not None else None
    if rx is not None and not any(rx.fullmatch(p) for _, _, p in paths):
        raise ValueError(
            f"LoRA pattern {lcfg.pattern!r} matches no module of this model; it must fullmatch paths "
            f"like {paths[0][2]!r} or 'layers.{n - 1}.mlp.down_proj'"
        )
    chosen = [
        (i, hf)
        for i, hf, p in paths
        if hf in lcfg.targets
        and (lcfg.layers is None or i in lcfg.layers)
        and (rx is None or rx.fullmatch(p))
    ]
    if not chosen:
        raise ValueError(
            f"LoRA selection matches no module: targets={list(lcfg.targets)}, layers={lcfg.layers}, "
            f"pattern={lcfg.pattern!r} (attention modules live in {cfg.layer_types.count(FULL)} of "
            f"{n} layers, DeltaNet modules in the rest)"
        )
    return chosen


def a_name(hf: str) -> str:
    return f"lora_a_{hf}"


def b_name(proj: str) -> str:
    return f"lora_b_{proj}"


def mask_name(hf: str) -> str:
    return f"lora_mask_{hf}"


def _stacked(cls: type[nnx.Variable], value: jax.Array, axes: tuple, stacked: bool) -> nnx.Variable:
    if stacked:
        axes = ("layers", *axes)
    return cls(value, out_sharding=tuple(axes), eager_sharding=False)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One adapter to create: A's and each B's shape, and which stacked rows are selected (None = all)."""

    hf: str
    a_shape: tuple[int, ...]
    b_shapes: tuple[tuple[int, ...], ...]
    fan_in: int
    rows: tuple[bool, ...] | None


@functools.partial(jax.jit, static_argnums=1)
def _init_adapters(key: jax.Array, plans: tuple[_Plan, ...]) -> list[tuple[jax.Array, list[jax.Array]]]:
    """Every (A, [B...]) in one program: A from one stream of uniforms (one random-bits op, so one
    small compile rather than one per shape), B zeros. Abstract under `nnx.eval_shape`."""
    sizes = [math.prod(p.a_shape) for p in plans]
    u = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
    out, start = [], 0
    for p, n in zip(plans, sizes, strict=True):
        # peft's default: kaiming-uniform(a=√5) for A, i.e. U(±1/√fan_in); zeros for B.
        a = u[start : start + n].reshape(p.a_shape) / math.sqrt(p.fan_in)
        start += n
        if p.rows is not None:  # unselected layers of a stacked adapter hold zeros
            a = a * jnp.asarray(p.rows, jnp.float32).reshape(-1, *([1] * (a.ndim - 1)))
        out.append((a, [jnp.zeros(s, jnp.float32) for s in p.b_shapes]))
    return out


def _plan_module(
    module: nnx.Module,
    owner: str,
    lcfg: LoraConfig,
    layers: list[int],
    chosen: set[tuple[int, str]],
    stacked: bool,
) -> list[_Plan]:
    """The adapters `module` gets: its HF modules selected in any of `layers` (one per group)."""
    lead = (len(layers),) if stacked else ()
    plans = []
    for hf in lcfg.targets:
        kind, projs = TARGETS[hf]
        if kind != owner:
            continue
        rows = tuple((i, hf) in chosen for i in layers)
        if not any(rows):
            continue
        shape = getattr(module, projs[0]).get_value().shape[len(lead) :]
        n_in = _IN_DIMS.get(projs[0], 1)
        a_shape = (*lead, *shape[:n_in], lcfg.rank)
        b_shapes = tuple(
            (*lead, lcfg.rank, *getattr(module, proj).get_value().shape[len(lead) + n_in :]) for proj in projs
        )
        plans.append(_Plan(hf, a_shape, b_shapes, math.prod(shape[:n_in]), None if all(rows) else rows))
    return plans


def _attach(
    module: nnx.Module, plan: _Plan, a: jax.Array, bs: list[jax.Array], lcfg: LoraConfig, stacked: bool
) -> None:
    lead = 1 if stacked else 0
    projs = TARGETS[plan.hf][1]
    n_in = _IN_DIMS.get(projs[0], 1)
    axes = getattr(module, projs[0]).get_metadata()["out_sharding"][lead:]
    if plan.rows is not None:
        mask = jnp.asarray(np.asarray(plan.rows, np.float32))  # [G]
        setattr(module, mask_name(plan.hf), LoRAMask(mask, out_sharding=("layers",), eager_sharding=False))
    setattr(module, a_name(plan.hf), _stacked(LoRAParam, a, (*axes[:n_in], "lora_rank"), stacked))
    for proj, b in zip(projs, bs, strict=True):
        paxes = getattr(module, proj).get_metadata()["out_sharding"][lead:]
        setattr(module, b_name(proj), _stacked(LoRAParam, b, ("lora_rank", *paxes[n_in:]), stacked))
    module.lora_scale = lcfg.scale
    module.lora_dropout = lcfg.dropout


def add_lora(
    model: Qwen3_5ForCausalLM, lcfg: LoraConfig, *, key: jax.Array | None = None
) -> Qwen3_5ForCausalLM:
    """Attach fresh adapters (A random, B zero) to every selected projection, in place."""
    if hasattr(model, "lora_config"):
        raise ValueError("the model already has LoRA adapters (merge_lora them first)")
    key = jax.random.key(0) if key is None else key
    cfg = model.cfg
    chosen = set(select_modules(cfg, lcfg))
    p, g = layer_plan(cfg)
    # (block, the HF layers it computes, stacked?): a group position runs layers j, j+P, j+2P, ...
    blocks = (
        [(blk, [k * p + j for k in range(g)], True) for j, blk in enumerate(model.groups.blocks)] if g else []
    )
    blocks += [(blk, [p * g + j], False) for j, blk in enumerate(model.tail)]
    todo = []
    for blk, layers, stacked in blocks:
        owner = "attn" if blk.layer_type == FULL else "gdn"
        for module, kind in ((blk.mixer, owner), (blk.mlp, "mlp")):
            todo += [
                (module, plan, stacked) for plan in _plan_module(module, kind, lcfg, layers, chosen, stacked)
            ]
    arrays = _init_adapters(key, tuple(plan for _, plan, _ in todo))
    for (module, plan, stacked), (a, bs) in zip(todo, arrays, strict=True):
        _attach(module, plan, a, bs, lcfg, stacked)
    model.lora_config = lcfg
    return model


def adapter_module(model: Qwen3_5ForCausalLM, layer: int, hf: str) -> tuple[nnx.Module, int | None]:
    """The module holding HF layer `layer`'s adapter `hf`, and its row in the stacked arrays (or None)."""
    kind = TARGETS[hf][0]
    where, pos, g = layer_location(model.cfg, layer)
    blk = model.groups.blocks[pos] if where == "groups" else model.tail[pos]
    return (blk.mlp if kind == "mlp" else blk.mixer), (g if where == "groups" else None)


def _delta(module: nnx.Module, hf: str, proj: str, lead: int) -> jax.Array:
    """s·A·B for one stored projection, in W's shape (float32; unselected groups zero)."""
    a = getattr(module, a_name(hf)).get_value()
    b = getattr(module, b_name(proj)).get_value()
    a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])  # [(G,) in, r]
    b2 = b.reshape(*b.shape[: lead + 1], -1)  # [(G,) r, out]
    w_shape = getattr(module, proj).get_value().shape
    delta = (module.lora_scale * jnp.matmul(a2, b2)).reshape(w_shape)
    mask = getattr(module, mask_name(hf), None)
    if mask is not None:
        delta = delta * mask.get_value().reshape(-1, *([1] * (delta.ndim - 1)))
    return delta


def _apply(model: Qwen3_5ForCausalLM, sign: float) -> None:
    for module, lead in _adapted_modules(model):
        for hf, (_, projs) in TARGETS.items():
            if getattr(module, a_name(hf), None) is None:
                continue
            for proj in projs:
                base = getattr(module, proj)
                w = base.get_value()
                base.set_value(
                    (w.astype(jnp.float32) + sign * _delta(module, hf, proj, lead)).astype(w.dtype)
                )


def merge_lora(model: Qwen3_5ForCausalLM, *, keep_adapters: bool = False) -> Qwen3_5ForCausalLM:
    """Fold every adapter into its base weight (W ← W + s·A·B, in W's dtype), in place.

    By default the adapters are then dropped. With `keep_adapters=True` they stay, switched off
    in the forward pass, so that `unmerge_lora` can subtract them back out (as peft's
    `merge_adapter` / `unmerge_adapter`).
    """
    if any(getattr(m, "lora_merged", False) for m, _ in _adapted_modules(model)):
        raise ValueError("the adapters are already merged (unmerge_lora first)")
    _apply(model, 1.0)
    for module, _ in _adapted_modules(model):
        if keep_adapters:
            module.lora_merged = True
            continue
        for hf, (_, projs) in TARGETS.items():
            if getattr(module, a_name(hf), None) is None:
                continue
            for proj in projs:
                delattr(module, b_name(proj))
            delattr(module, a_name(hf))
            if getattr(module, mask_name(hf), None) is not None:
                delattr(module, mask_name(hf))
        del module.lora_scale, module.lora_dropout
    if not keep_adapters and hasattr(model, "lora_config"):
        del model.lora_config
    return model


def unmerge_lora(model: Qwen3_5ForCausalLM) -> Qwen3_5ForCausalLM:
    """Undo `merge_lora(keep_adapters=True)`: W ← W − s·A·B and the adapters are live again.

    Exact up to one rounding of W's dtype (float32: ~1e-7 relative; bf16 loses the low bits).
    """
    modules = _adapted_modules(model)
    if not modules or not all(getattr(m, "lora_merged", False) for m, _ in modules):
        raise ValueError("no merged adapters to unmerge (merge_lora(model, keep_adapters=True) first)")
    _apply(model, -1.0)
    for module, _ in modules:
        del module.lora_merged
    return model


def _adapted_modules(model: Qwen3_5ForCausalLM) -> list[tuple[nnx.Module, int]]:
    """(module, number of stacking axes) for every block module carrying adapters."""
    groups = list(model.groups.blocks) if model.groups is not None else []
    out = []
    for blocks, lead in ((groups, 1), (list(model.tail), 0)):
        for blk in blocks:
            out += [(m, lead) for m in (blk.mixer, blk.mlp) if hasattr(m, "lora_scale")]
    return out

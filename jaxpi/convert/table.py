"""The one declarative table between HF tensor names (Qwen3.5, Qwen3) and jaxpi parameters.

Both families name their tensors alike (`model.layers.N.self_attn.q_proj.weight`, ...); the
rules follow the config's data: each layer's type, whether q_proj carries the output gate, the
sizes. A Qwen3 config has full-attention layers only, so its table has no DeltaNet rule.

Each `Rule` maps one HF tensor to one or more of our parameters with a transform:

- `copy`     same array;
- `linear`   HF `[out, in]` → ours `[in, *out_shape]` (transpose, then split `out` into heads);
- `linear_t` HF `[out, in]` → ours `[*in_shape, out]` (the output projections);
- `split`    HF's fused rows (`in_proj_qkv`) → one `linear` part per stored projection;
- `conv`     HF's depthwise conv `[C, 1, K]` → per-part `[K, heads, head_dim]`.

Every transform has an exact inverse (used by `save_hf`), so HF → jaxpi → HF is byte-exact.

The linear modules (`LINEAR_MODULES`) are the one place their HF names are spelled: LoRA's targets,
peft's `target_modules`, and the FLOP count's projection shapes are read from it.
`to_ours` / `to_hf` return new arrays; the converter uses their streaming forms `part_into` /
`hf_into`, which write into a preallocated buffer without tensor-sized temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpi.config import FULL, LINEAR, QwenConfig
from jaxpi.models.qwen3_5 import layer_location

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Rule:
    hf: str  # full HF key (text-model prefix applied by the caller)
    kind: str  # copy | linear | linear_t | split | conv
    ours: tuple[Path_, ...]  # our parameter paths (model-relative), one per part
    part_shapes: tuple[tuple[int, ...], ...]  # our per-layer shape of each part (no stacking axis)
    layer: int = -1  # HF layer index, or -1 for model-level tensors

    @property
    def hf_shape(self) -> tuple[int, ...]:
        if self.kind == "copy":
            return self.part_shapes[0]
        if self.kind == "linear":
            (s,) = self.part_shapes
            return (int(np.prod(s[1:])), s[0])
        if self.kind == "linear_t":
            (s,) = self.part_shapes
            return (s[-1], int(np.prod(s[:-1])))
        if self.kind == "split":
            return (sum(int(np.prod(s[1:])) for s in self.part_shapes), self.part_shapes[0][0])
        if self.kind == "conv":
            return (sum(int(np.prod(s[1:])) for s in self.part_shapes), 1, self.part_shapes[0][0])
        raise AssertionError(self.kind)

    def to_ours(self, a: np.ndarray) -> list[np.ndarray]:
        """HF array (already shape-checked) → our per-part arrays."""
        if self.kind == "copy":
            return [a]
        if self.kind == "linear":
            return [a.T.reshape(self.part_shapes[0])]
        if self.kind == "linear_t":
            return [a.T.reshape(self.part_shapes[0])]
        rows = a if self.kind == "split" else a[:, 0, :]  # [C, D] or [C, K]
        out, start = [], 0
        for s in self.part_shapes:
            n = int(np.prod(s[1:]))
            out.append(rows[start : start + n].T.reshape(s))
            start += n
        return out

    def part_rows(self, part: int) -> tuple[int, int] | None:
        """The rows [start, stop) of the HF tensor that part `part` comes from (fused kinds only)."""
        if self.kind not in ("split", "conv"):
            return None
        start = sum(int(np.prod(t[1:])) for t in self.part_shapes[:part])
        return start, start + int(np.prod(self.part_shapes[part][1:]))

    def part_into(self, a: np.ndarray, part: int, out: np.ndarray, row_offset: int = 0) -> None:
        """Write part `part` of the HF array `a` into `out` (our per-layer shape, C-contiguous).

        The streaming form of `to_ours`: one strided (and, across dtypes, casting) copy straight
        into the destination, with no tensor-sized temporary. For the fused kinds `a` may hold
        only some rows of the HF tensor, starting at `row_offset` (see `part_rows`).
        """
        s = self.part_shapes[part]
        if self.kind == "copy":
            out[...] = a
        elif self.kind == "linear":
            _view(out, (s[0], -1))[...] = a.T
        elif self.kind == "linear_t":
            _view(out, (-1, s[-1]))[...] = a.T
        else:
            rows = a if self.kind == "split" else a[:, 0, :]
            start, stop = self.part_rows(part)
            _view(out, (s[0], stop - start))[...] = rows[start - row_offset : stop - row_offset].T

    def hf_into(self, parts: list[np.ndarray], out: np.ndarray) -> None:
        """Write our per-part arrays into `out` (the HF shape, C-contiguous): the streaming `to_hf`."""
        if self.kind == "copy":
            out[...] = parts[0]
        elif self.kind == "linear":
            out.T[...] = parts[0].reshape(parts[0].shape[0], -1)
        elif self.kind == "linear_t":
            out.T[...] = parts[0].reshape(-1, parts[0].shape[-1])
        else:
            rows = out if self.kind == "split" else out[:, 0, :]
            start = 0
            for p in parts:
                n = int(np.prod(p.shape[1:]))
                rows[start : start + n].T[...] = p.reshape(p.shape[0], n)
                start += n

    def to_hf(self, parts: list[np.ndarray]) -> np.ndarray:
        """Our per-part arrays → the HF array (exact inverse of `to_ours`)."""
        if self.kind == "copy":
            return parts[0]
        if self.kind == "linear":
            s = parts[0].shape
            return parts[0].reshape(s[0], -1).T
        if self.kind == "linear_t":
            return parts[0].reshape(-1, parts[0].shape[-1]).T
        rows = np.concatenate([p.reshape(p.shape[0], -1).T for p in parts], axis=0)
        return rows if self.kind == "split" else rows[:, None, :]


@dataclass(frozen=True)
class LinearModule:
    """One HF linear module of a layer (`layers.N.<hf_block>.<hf>`) and the projections it is
    stored as in jaxpi (`<block>.<part>` of the layer's mixer or MLP)."""

    hf: str  # HF (and peft) module name: "in_proj_qkv"
    hf_block: str  # HF submodule of the layer: "self_attn" | "linear_attn" | "mlp"
    block: str  # our block: "attn" | "gdn" (both the layer's mixer) | "mlp"
    parts: tuple[str, ...]  # our projections, one per stored part: ("q_proj", "k_proj", "v_proj")
    kind: str  # table rule: "linear" ([in, *out]) | "linear_t" ([*in, out]) | "split" (fused rows)

    @property
    def layer_type(self) -> str | None:
        """The layer type that has this module (None: every layer)."""
        return {"attn": FULL, "gdn": LINEAR}.get(self.block)

    @property
    def n_in(self) -> int:
        """Leading input dims of each stored part (`linear_t` keeps the heads: `[heads, dim, out]`)."""
        return 2 if self.kind == "linear_t" else 1

    @property
    def attr(self) -> str:
        """The layer's attribute holding the parts: "mixer" or "mlp"."""
        return "mlp" if self.block == "mlp" else "mixer"


# In LoRA's (and peft's `target_modules`) order.
LINEAR_MODULES: tuple[LinearModule, ...] = (
    LinearModule("q_proj", "self_attn", "attn", ("q_proj",), "linear"),
    LinearModule("k_proj", "self_attn", "attn", ("k_proj",), "linear"),
    LinearModule("v_proj", "self_attn", "attn", ("v_proj",), "linear"),
    LinearModule("o_proj", "self_attn", "attn", ("o_proj",), "linear_t"),
    LinearModule("in_proj_qkv", "linear_attn", "gdn", ("q_proj", "k_proj", "v_proj"), "split"),
    LinearModule("in_proj_z", "linear_attn", "gdn", ("z_proj",), "linear"),
    LinearModule("in_proj_b", "linear_attn", "gdn", ("b_proj",), "linear"),
    LinearModule("in_proj_a", "linear_attn", "gdn", ("a_proj",), "linear"),
    LinearModule("out_proj", "linear_attn", "gdn", ("out_proj",), "linear_t"),
    LinearModule("gate_proj", "mlp", "mlp", ("gate_proj",), "linear"),
    LinearModule("up_proj", "mlp", "mlp", ("up_proj",), "linear"),
    LinearModule("down_proj", "mlp", "mlp", ("down_proj",), "linear"),
)
LINEAR_BY_NAME = {m.hf: m for m in LINEAR_MODULES}
LINEAR_NAMES = tuple(LINEAR_BY_NAME)  # every adaptable module: peft's "all-linear"


def linear_modules(layer_type: str) -> list[LinearModule]:
    """The linear modules of a layer of `layer_type` (its mixer's, then the MLP's)."""
    if layer_type not in (FULL, LINEAR):
        raise ValueError(f"unknown layer type {layer_type!r}")
    return [m for m in LINEAR_MODULES if m.layer_type in (None, layer_type)]


def linear_part_shapes(cfg: QwenConfig, layer_type: str) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Our per-layer shape of each stored part of every linear module of a `layer_type` layer."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    if layer_type == FULL:
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        mixer = {
            # the query and its output gate (Qwen3.5), the query alone (Qwen3)
            "q_proj": ((d, hq, 2 * hd if cfg.attn_output_gate else hd),),
            "k_proj": ((d, hkv, hd),),
            "v_proj": ((d, hkv, hd),),
            "o_proj": ((hq, hd, d),),
        }
    elif layer_type == LINEAR:
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixer = {
            "in_proj_qkv": ((d, nk, dk), (d, nk, dk), (d, nv, dv)),
            "in_proj_z": ((d, nv, dv),),
            "in_proj_b": ((d, nv),),
            "in_proj_a": ((d, nv),),
            "out_proj": ((nv, dv, d),),
        }
    else:
        raise ValueError(f"unknown layer type {layer_type!r}")
    mlp = {"gate_proj": ((d, f),), "up_proj": ((d, f),), "down_proj": ((f, d),)}
    return {**mixer, **mlp}


def _view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`a` reshaped without copying (raises rather than silently writing into a copy)."""
    return np.reshape(a, shape, copy=False)


def text_rules(cfg: QwenConfig, prefix: str) -> list[Rule]:
    """All rules of the text model; `prefix` is "model." (CausalLM) or "model.language_model."."""
    d, v = cfg.hidden_size, cfg.vocab_size
    rules = [
        Rule(f"{prefix}embed_tokens.weight", "copy", (("embed",),), ((v, d),)),
        Rule(f"{prefix}norm.weight", "copy", (("norm",),), ((d,),)),
    ]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("lm_head.weight", "linear", (("lm_head",),), ((d, v),)))
    for i, layer_type in enumerate(cfg.layer_types):
        rules += _layer_rules(cfg, i, layer_type, f"{prefix}layers.{i}.")
    return rules


def _layer_rules(cfg: QwenConfig, i: int, layer_type: str, hf: str) -> list[Rule]:
    where, pos, _ = layer_location(cfg, i)
    base: Path_ = ("groups", "blocks", pos) if where == "groups" else ("tail", pos)
    d = cfg.hidden_size
    shapes = linear_part_shapes(cfg, layer_type)

    def r(name: str, kind: str, ours: list[str], shapes: list[tuple[int, ...]]) -> Rule:
        paths = tuple((*base, *o.split(".")) for o in ours)
        return Rule(hf + name, kind, paths, tuple(shapes), layer=i)

    def lin(name: str) -> Rule:  # a linear module, from LINEAR_MODULES
        m = LINEAR_BY_NAME[name]
        return r(
            f"{m.hf_block}.{m.hf}.weight", m.kind, [f"{m.attr}.{p}" for p in m.parts], list(shapes[name])
        )

    rules = [
        r("input_layernorm.weight", "copy", ["input_norm"], [(d,)]),
        r("post_attention_layernorm.weight", "copy", ["post_norm"], [(d,)]),
        lin("gate_proj"),
        lin("up_proj"),
        lin("down_proj"),
    ]
    if layer_type == FULL:
        hd = cfg.head_dim
        a = "self_attn."
        return rules + [
            lin("q_proj"),
            lin("k_proj"),
            lin("v_proj"),
            lin("o_proj"),
            r(a + "q_norm.weight", "copy", ["mixer.q_norm"], [(hd,)]),
            r(a + "k_norm.weight", "copy", ["mixer.k_norm"], [(hd,)]),
        ]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    a = "linear_attn."
    return rules + [
        lin("in_proj_qkv"),
        lin("in_proj_z"),
        lin("in_proj_b"),
        lin("in_proj_a"),
        r(
            a + "conv1d.weight",
            "conv",
            ["mixer.conv_q", "mixer.conv_k", "mixer.conv_v"],
            [(kw, nk, dk), (kw, nk, dk), (kw, nv, dv)],
        ),
        r(a + "dt_bias", "copy", ["mixer.dt_bias"], [(nv,)]),
        r(a + "A_log", "copy", ["mixer.A_log"], [(nv,)]),
        r(a + "norm.weight", "copy", ["mixer.norm"], [(dv,)]),
        lin("out_proj"),
    ]


def stack_index(cfg: QwenConfig, rule: Rule) -> int | None:
    """The group index of a scanned layer's rule (its slice of the stacked arrays), else None."""
    if rule.layer < 0:
        return None
    where, _, g = layer_location(cfg, rule.layer)
    return g if where == "groups" else None


def mtp_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    """The 15 tensors of the one-layer MTP head (`mtp.*`) released Qwen3.5 checkpoints carry and
    jaxpi does not model (it is carried byte for byte): a full-attention decoder layer, the
    projection of [embedding; hidden] back to the width, and three norms."""
    d = cfg.hidden_size
    layer = {r.hf: r.hf_shape for r in _layer_rules(cfg, 0, FULL, "mtp.layers.0.")}
    return {
        "mtp.fc.weight": (d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": (d,),
        "mtp.pre_fc_norm_hidden.weight": (d,),
        "mtp.norm.weight": (d,),
        **layer,
    }

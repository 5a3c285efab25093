"""`QwenConfig`: a Qwen text architecture as a frozen dataclass, symmetric with HF `config.json`.

Two families share it (`FAMILIES`, looked up by the HF `model_type`):

- Qwen3.5 (`qwen3_5`): the hybrid stack. `from_hf` accepts both checkpoint kinds:
  `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`), the text settings at the top level, and
  `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`), the text settings under `text_config`;
- Qwen3 dense (`qwen3`, `Qwen3ForCausalLM`): every layer full attention, no output gate, plain
  `w · x̂` norms, rotary over the whole head.

The model reads what differs from data (`layer_types`, `attn_output_gate`, `norm_offset`,
`partial_rotary_factor`), never from the family's name. `to_hf` writes the family's text
settings back (the caller merges them into the outer config of a multimodal checkpoint, see
`jaxpi.convert.hf`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxpi.hf_schema import HFConfigError, qwen3_fields, text_fields

LINEAR = "linear_attention"
FULL = "full_attention"
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "mlp", "mlp_out")


# `gdn_impl` values: see jaxpi.kernels.gated_delta.chunk_gated_delta_rule
GDN_IMPLS = ("jax", "jax_assoc", "jax_split", "pallas", "pallas_split")
ATTN_IMPLS = ("jax", "pallas")  # causal self-attention: blocked plain JAX | flash kernel
# `gdn_kernel` knobs of the Pallas gated delta rule (jaxpi.kernels.pallas.KernelOptions), by type
GDN_KERNEL_KNOBS = {"block_v": int, "num_warps": int, "num_stages": int, "precision": str}
GDN_KERNEL_PRECISIONS = ("default", "tf32", "highest")
# `attn_kernel` knobs of the flash attention (jaxpi.kernels.pallas.attention.AttentionOptions)
ATTN_KERNEL_KNOBS = {
    "block_q": int,
    "block_k": int,
    "block_backward": int,
    "num_warps": int,
    "num_stages": int,
}


def _parse_kernel(field: str, spec: str, knobs: dict[str, type]) -> dict[str, int | str]:
    """ "name=value,..." -> {name: value}: names from `knobs`, int values positive, str values one
    of GDN_KERNEL_PRECISIONS (the one string knob); errors name the field and the bad part."""
    out: dict[str, int | str] = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq or name not in knobs:
            raise ValueError(f"{field} {spec!r}: {part!r} is not NAME=VALUE with NAME in {tuple(knobs)}")
        if knobs[name] is int:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{field} {spec!r}: {name} must be a positive integer, got {value!r}")
            out[name] = int(value)
        elif value not in GDN_KERNEL_PRECISIONS:
            raise ValueError(
                f"{field} {spec!r}: {name} must be one of {GDN_KERNEL_PRECISIONS}, got {value!r}"
            )
        else:
            out[name] = value
    return out


def parse_gdn_kernel(spec: str) -> dict[str, int | str]:
    """`gdn_kernel` -> keyword arguments of the Pallas gated delta rule.

    "block_v=16,num_warps=4,num_stages=2,precision=tf32" (any subset, any order; "" for none).
    Checks names, types and ranges here; that block_v divides the value head dim is checked when
    the kernels are built.
    """
    return _parse_kernel("gdn_kernel", spec, GDN_KERNEL_KNOBS)


def parse_attn_kernel(spec: str) -> dict[str, int | str]:
    """`attn_kernel` -> fields of the flash attention's options ("block_q=32,block_k=32,
    block_backward=16,num_warps=4,num_stages=1", any subset; "" for none). The blocks' power-of-two
    rule is checked when the kernel is built."""
    return _parse_kernel("attn_kernel", spec, ATTN_KERNEL_KNOBS)


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Gated DeltaNet sizes (Qwen3.5); 0 in a family without DeltaNet layers
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262_144
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    # the embedding row `transformers` builds with `padding_idx`: it gets no gradient (None: none)
    pad_token_id: int | None = None
    # The family (a key of FAMILIES): how config.json is written back, which HF classes load it.
    family: str = "qwen3_5"
    # attention output gate `o ⊙ sigmoid(gate)`, its rows interleaved into q_proj (Qwen3.5 only)
    attn_output_gate: bool = True
    # every RMSNorm computes `x̂ · (norm_offset + w)`: 1.0 zero-centred (Qwen3.5), 0.0 plain (Qwen3)
    norm_offset: float = 1.0
    # Runtime knobs, not part of the HF architecture (never written by `to_hf`).
    gdn_chunk_size: int = 64
    # the chunked gated delta rule, one of GDN_IMPLS: "jax" (plain JAX, sequential over chunks),
    # "jax_assoc" (plain JAX, chunks composed in log depth: for GPU/TPU), "jax_split" (plain JAX,
    # a state-only scan and chunk-parallel products), "pallas" / "pallas_split" (kernels)
    gdn_impl: str = "jax"
    # the Pallas paths' kernel settings, `parse_gdn_kernel`'s "block_v=16,num_stages=2" ("": defaults)
    gdn_kernel: str = ""
    norm_impl: str = "jax"  # RMSNorm and gated RMSNorm: "jax" (plain JAX) or "pallas" (kernels)
    # causal self-attention (training, prefill without a cache): "jax" (blocked, plain JAX) or
    # "pallas" (flash attention, jaxpi.kernels.pallas.attention: JAX's Pallas GPU / TPU kernels)
    attn_impl: str = "jax"
    # the flash attention's settings, `parse_attn_kernel`'s "block_q=32,block_k=32" ("": defaults)
    attn_kernel: str = ""
    # Losses apply the LM head this many positions at a time (0: all at once), see jaxpi.kernels.lm_head
    loss_chunk: int = 0
    remat: str = "none"
    scan_layers: bool = True
    # HF fields we carry through untouched (token ids, rope extras such as mrope_section).
    hf_extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(
                self,
                "layer_types",
                tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers)),
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        errors = []
        if len(self.layer_types) != self.num_hidden_layers:
            errors.append(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            errors.append(f"unknown layer types {unknown} (expected {LINEAR!r} or {FULL!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            errors.append("num_attention_heads must be a multiple of num_key_value_heads")
        if LINEAR in self.layer_types:
            sizes = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
            bad = [n for n in (*sizes, "linear_value_head_dim") if getattr(self, n) < 1]
            if bad:
                errors.append(f"{', '.join(bad)} must be positive: the stack has DeltaNet layers")
            elif self.linear_num_value_heads % self.linear_num_key_heads:
                errors.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.family not in FAMILIES:
            errors.append(f"family {self.family!r} is not one of {sorted(FAMILIES)}")
        if self.norm_offset not in (0.0, 1.0):
            errors.append(f"norm_offset {self.norm_offset} must be 0.0 (plain) or 1.0 (zero-centred)")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            errors.append(
                f"rotary dim {self.rotary_dim} (head_dim * partial_rotary_factor) must be even and in (0, head_dim]"
            )
        if self.hidden_act != "silu":
            errors.append(f"hidden_act {self.hidden_act!r} is not supported (Qwen3.5 uses 'silu')")
        if self.attention_bias:
            errors.append("attention_bias=True is not supported (Qwen3.5 has no attention biases)")
        if self.remat not in REMAT_POLICIES:
            errors.append(f"remat {self.remat!r} is not one of {REMAT_POLICIES}")
        if self.gdn_chunk_size < 1 or self.gdn_chunk_size & (self.gdn_chunk_size - 1):
            errors.append(f"gdn_chunk_size {self.gdn_chunk_size} must be a power of two")
        if self.gdn_impl not in GDN_IMPLS:
            errors.append(f"gdn_impl {self.gdn_impl!r} is not one of {GDN_IMPLS}")
        try:
            if parse_gdn_kernel(self.gdn_kernel) and not self.gdn_impl.startswith("pallas"):
                errors.append(
                    f"gdn_kernel {self.gdn_kernel!r} applies only to gdn_impl pallas / pallas_split"
                )
        except ValueError as e:
            errors.append(str(e))
        if self.norm_impl not in ("jax", "pallas"):
            errors.append(f"norm_impl {self.norm_impl!r} is not one of ('jax', 'pallas')")
        if self.attn_impl not in ATTN_IMPLS:
            errors.append(f"attn_impl {self.attn_impl!r} is not one of {ATTN_IMPLS}")
        try:
            if parse_attn_kernel(self.attn_kernel) and self.attn_impl != "pallas":
                errors.append(f"attn_kernel {self.attn_kernel!r} applies only to attn_impl pallas")
        except ValueError as e:
            errors.append(str(e))
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            errors.append(f"pad_token_id {self.pad_token_id} is not in [0, vocab_size {self.vocab_size})")
        if self.loss_chunk < 0:
            errors.append(f"loss_chunk {self.loss_chunk} must be >= 0 (0: the LM head at once)")
        if errors:
            raise ValueError("invalid QwenConfig: " + "; ".join(errors))

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def replace(self, **changes: Any) -> QwenConfig:
        """`dataclasses.replace`, re-deriving `layer_types` when only the depth changes (a stack of
        full attention only, as Qwen3's, stays one)."""
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            dense = set(self.layer_types) == {FULL}
            changes["layer_types"] = (FULL,) * changes["num_hidden_layers"] if dense else ()
        return dataclasses.replace(self, **changes)

    # ---- HF interop ----------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> QwenConfig:
        """Read a HF `config.json` (a checkpoint directory, the file itself, or its parsed dict).

        Fields are type-checked (`jaxpi.hf_schema`): a mistyped, out-of-range or unsupported field
        raises `HFConfigError` (a ValueError) naming it. Defaults are `transformers`' own.
        """
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise FileNotFoundError(f"no config.json at {path}")
            try:
                raw = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise HFConfigError(f"config.json is not valid JSON: {e}") from None
        return family_of(raw).from_hf(raw)

    def to_hf(self) -> dict[str, Any]:
        """The text config as the family's CausalLM checkpoint writes it (`Family.to_hf`)."""
        return FAMILIES[self.family].to_hf(self)


def _qwen3_5_from_hf(raw: dict[str, Any]) -> QwenConfig:
    """A Qwen3.5 config.json (CausalLM or ConditionalGeneration) -> QwenConfig."""
    text, tie, _ = text_fields(raw)
    body = raw.get("text_config", raw) if "text_config" in raw else raw
    kwargs: dict[str, Any] = {k: getattr(text, k) for k in _REQUIRED}
    kwargs["linear_conv_kernel_dim"] = text.linear_conv_kernel_dim
    kwargs["rms_norm_eps"] = float(text.rms_norm_eps)
    if text.max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = text.max_position_embeddings
    if text.layer_types is not None:
        kwargs["layer_types"] = tuple(text.layer_types)
    else:  # transformers' rule: full attention every `full_attention_interval` (4) layers
        n = text.full_attention_interval or 4
        kwargs["layer_types"] = tuple(
            FULL if (i + 1) % n == 0 else LINEAR for i in range(text.num_hidden_layers)
        )
    rope = text.rope_parameters or text.rope_scaling
    # transformers' defaults when a checkpoint gives none: theta 10000, a quarter rotated
    theta = (rope and rope.rope_theta) or text.rope_theta or 10_000.0
    factor = (rope and rope.partial_rotary_factor) or text.partial_rotary_factor or 0.25
    kwargs["rope_theta"], kwargs["partial_rotary_factor"] = float(theta), float(factor)
    kwargs["tie_word_embeddings"] = tie
    return _build(kwargs, text.pad_token_id, body, _KNOWN)


def _build(
    kwargs: dict[str, Any], pad_token_id: int | None, body: dict[str, Any], known: set[str]
) -> QwenConfig:
    """QwenConfig from a family's fields: the pad id (a negative id counts from the end, as
    nn.Embedding's), the config.json keys neither read (`known`) nor re-derived carried as extras,
    a refused value an `HFConfigError`."""
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id % kwargs["vocab_size"]
    kwargs["hf_extra"] = tuple(
        sorted((k, _freeze(v)) for k, v in body.items() if k not in known and k not in _DERIVED)
    )
    try:
        return QwenConfig(**kwargs)
    except ValueError as e:
        raise HFConfigError(str(e)) from None


def _qwen3_5_to_hf(cfg: QwenConfig) -> dict[str, Any]:
    """The text config as HF writes it for `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`)."""
    extra = {k: _thaw(v) for k, v in cfg.hf_extra}
    rope = dict(extra.pop("rope_parameters", None) or {})
    rope.update(
        rope_type="default", rope_theta=cfg.rope_theta, partial_rotary_factor=cfg.partial_rotary_factor
    )
    out: dict[str, Any] = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **{k: getattr(cfg, k) for k in _REQUIRED},
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "layer_types": list(cfg.layer_types),
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "attention_bias": cfg.attention_bias,
        **({} if cfg.pad_token_id is None else {"pad_token_id": cfg.pad_token_id}),
        "rope_parameters": rope,
        **extra,
    }
    return out


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
_OPTIONAL = (
    "linear_conv_kernel_dim",
    "layer_types",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
)
_KNOWN = (
    set(_REQUIRED)
    | set(_OPTIONAL)
    | {
        "tie_word_embeddings",
        "model_type",
        "architectures",
        "pad_token_id",
    }
)
# Fields folded into our own (rope) or re-derived, so not carried as extras.
# The storage dtype is a property of the files, written by `save_hf`, not of the architecture.
_DERIVED = {
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "full_attention_interval",
    "dtype",
    "torch_dtype",
    # settings of the layers that are checked to be the only value jaxpi implements
    "attention_dropout",
}


# ---- Qwen3 dense (`Qwen3ForCausalLM`) ------------------------------------------------------------
# config.json fields of Qwen3 read into our own, or re-derived (so not carried as extras)
# the fields `_qwen3_to_hf` writes as they are in QwenConfig
_QWEN3_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
)
_QWEN3_KNOWN = {
    *_QWEN3_FIELDS,
    "model_type",
    "architectures",
    "pad_token_id",
    "rope_parameters",
    # checked to be the one value jaxpi implements (no sliding window, every layer full attention)
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
}


def _qwen3_from_hf(raw: dict[str, Any]) -> QwenConfig:
    """A Qwen3 config.json -> QwenConfig: every layer full attention, rotary over the whole head,
    no output gate, plain norms, no DeltaNet sizes."""
    text = qwen3_fields(raw)
    rope = text.rope_parameters or text.rope_scaling
    theta = (rope and rope.rope_theta) or text.rope_theta or 10_000.0  # transformers' default
    kwargs: dict[str, Any] = {
        k: getattr(text, k)
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim")
    }
    kwargs.update(
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads or text.num_attention_heads,
        layer_types=(FULL,) * text.num_hidden_layers,
        rms_norm_eps=float(text.rms_norm_eps),
        rope_theta=float(theta),
        partial_rotary_factor=1.0,
        tie_word_embeddings=bool(text.tie_word_embeddings),
        family="qwen3",
        attn_output_gate=False,
        norm_offset=0.0,
    )
    if text.max_position_embeddings is not None:
        kwargs["max_position_embeddings"] = text.max_position_embeddings
    return _build(kwargs, text.pad_token_id, raw, _QWEN3_KNOWN)


def _qwen3_to_hf(cfg: QwenConfig) -> dict[str, Any]:
    """The config as HF writes it for `Qwen3ForCausalLM` (model_type `qwen3`)."""
    extra = {k: _thaw(v) for k, v in cfg.hf_extra}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **{k: getattr(cfg, k) for k in _QWEN3_FIELDS},
        "use_sliding_window": False,
        **({} if cfg.pad_token_id is None else {"pad_token_id": cfg.pad_token_id}),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **extra,
    }


# ---- the family registry -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family at the config level: which HF `model_type`s are read as it, and how its
    config.json is read and written. The rest of a family is registered by name where its layer
    lives: the model class (`jaxpi.models.families`), the tiny builder (`jaxpi.convert.tiny`),
    the float64 reference's modeling module (`jaxpi.torch_reference`); the HF tensor table
    (`jaxpi.convert.table`) follows the config's data (layer types, gate, sizes)."""

    name: str
    model_types: tuple[str, ...]  # HF `model_type` values (outer and text config) read as this family
    from_hf: Callable[[dict[str, Any]], QwenConfig]
    to_hf: Callable[[QwenConfig], dict[str, Any]]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("qwen3_5", ("qwen3_5_text", "qwen3_5"), _qwen3_5_from_hf, _qwen3_5_to_hf),
        Family("qwen3", ("qwen3",), _qwen3_from_hf, _qwen3_to_hf),
    )
}
MODEL_TYPES = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of(raw: Any) -> Family:
    """The family of a parsed config.json, by its `model_type` (none given: Qwen3.5's text config,
    as before families existed). An unknown one is an `HFConfigError` naming the known ones."""
    if not isinstance(raw, dict):
        raise HFConfigError(f"config.json must be a JSON object, not {type(raw).__name__}")
    kind = raw.get("model_type")
    if kind is None and "text_config" not in raw:
        return FAMILIES["qwen3_5"]
    if "text_config" in raw and kind is None:
        kind = "qwen3_5"
    if not isinstance(kind, str) or kind not in MODEL_TYPES:
        raise HFConfigError(
            f"model_type: {kind!r} is not a model jaxpi knows (not a Qwen3.5 text model nor a Qwen3 "
            f"dense one); known model types: {', '.join(repr(t) for t in sorted(MODEL_TYPES))}"
        )
    return MODEL_TYPES[kind]


def _freeze(v: Any) -> Any:
    """JSON value -> hashable (so the frozen dataclass stays hashable for `jax.jit` static args)."""
    if isinstance(v, dict):
        return ("__dict__", tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    if isinstance(v, list):
        return ("__list__", tuple(_freeze(x) for x in v))
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__dict__":
        return {k: _thaw(x) for k, x in v[1]}
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__list__":
        return [_thaw(x) for x in v[1]]
    return v


# Qwen3.5-27B text model. Every number is from the `text_config` of the public
# Qwen/Qwen3.5-27B `config.json` (Qwen3_5ForConditionalGeneration; Qwen3.6-27B shares it):
# hidden 5120, 64 layers (full attention every 4th), 24 q / 4 kv heads of 256, partial rotary 0.25,
# rope_theta 1e7, DeltaNet 16 key / 48 value heads of 128, conv kernel 4, intermediate 17408,
# vocab 248320, untied embeddings, rms_norm_eps 1e-6, max_position_embeddings 262144.
QWEN3_5_27B = QwenConfig(
    vocab_size=248_320,
    hidden_size=5_120,
    intermediate_size=17_408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=262_144,
    tie_word_embeddings=False,
    hf_extra=(
        ("eos_token_id", 248_044),
        ("rope_parameters", _freeze({"mrope_interleaved": True, "mrope_section": [11, 11, 10]})),
    ),
)

# Qwen3.5-9B text model, the same architecture at about a third of the size: hidden 4096, 32
# layers (8 groups of 3 DeltaNet + 1 full attention), 16 q / 4 kv heads of 256, DeltaNet 16 key /
# 32 value heads of 128, intermediate 12288, vocab 248320, untied embeddings, rope_theta 1e7,
# partial rotary 0.25 (64 of 256 dims). The numbers are those of Qwen's model card for
# Qwen/Qwen3.5-9B and of the `text_config` of its `config.json` as published copies of it give
# them (the checkpoint cannot be downloaded here); `QwenConfig.from_hf` on the real file is the
# check: it must equal this preset up to `hf_extra`.
QWEN3_5_9B = QWEN3_5_27B.replace(
    hidden_size=4_096,
    intermediate_size=12_288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
)

# A tiny config for tests and the demo: every structural feature of the 27B (hybrid 3:1 stack,
# GQA, Hv = 3 * Hk DeltaNet, partial rotary) at a size that runs in seconds on a CPU.
TINY = QwenConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    gdn_chunk_size=16,
)

# Qwen3-8B (dense), every number from the public config.json,
# https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json: hidden 4096, 36 layers, 32 q / 8 kv
# heads of 128, intermediate 12288, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6,
# max_position_embeddings 40960, untied embeddings, no sliding window.
QWEN3_8B = QwenConfig(
    vocab_size=151_936,
    hidden_size=4_096,
    intermediate_size=12_288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    layer_types=(FULL,) * 36,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    partial_rotary_factor=1.0,
    max_position_embeddings=40_960,
    tie_word_embeddings=False,
    family="qwen3",
    attn_output_gate=False,
    norm_offset=0.0,
    hf_extra=(("bos_token_id", 151_643), ("eos_token_id", 151_645)),
)

# A tiny Qwen3 for tests and `jaxpi demo --family qwen3`: GQA, q/k norms, tied embeddings (as
# the small Qwen3 sizes have them).
QWEN3_TINY = QWEN3_8B.replace(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=(FULL,) * 4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    hf_extra=(),
)

PRESETS: dict[str, QwenConfig] = {
    "qwen3_5_27b": QWEN3_5_27B,
    "qwen3_5_9b": QWEN3_5_9B,
    "tiny": TINY,
    "qwen3_8b": QWEN3_8B,
    "qwen3_tiny": QWEN3_TINY,
}


def preset(name: str) -> QwenConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None

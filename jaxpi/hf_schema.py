"""HF `config.json` of a Qwen3.5 or Qwen3 checkpoint, read through typed schemas (pydantic, strict).

Every field `transformers`' `Qwen3_5TextConfig` / `Qwen3_5Config` define is either honoured by
jaxpi or refused with an error that names it (docs/parity.md, "What jaxpi does with each HF
config field"); fields it does not define are carried through to `to_hf` untouched. Types are
checked as `transformers`' strict dataclasses check them: `"false"` is not a boolean, `1.0` is not
an integer, `"tiny"` is not a number.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


def _not_an_int(value: Any) -> Any:
    """transformers' strict dataclasses refuse an int for a float field (`"rms_norm_eps": 1`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"expected a float, got the int {value}")
    return value


PosInt = Annotated[int, Field(gt=0)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# a float field of transformers' own dataclass (not a key of a dict such as rope_parameters)
HFFloat = Annotated[float, BeforeValidator(_not_an_int), Field(gt=0, allow_inf_nan=False)]


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class RopeParameters(_Schema):
    """`rope_parameters` (or the older `rope_scaling`): only the default (unscaled) RoPE exists in
    Qwen3.5; M-RoPE's sections are honoured trivially, since text-only positions are equal on all
    three axes and every section then rotates by the same position."""

    rope_type: Literal["default"] = "default"
    rope_theta: PosFloat | None = None
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    mrope_section: list[Annotated[int, Field(ge=0)]] | None = None
    mrope_interleaved: bool | None = None


class TextConfig(_Schema):
    """The text model's fields (top level of `Qwen3_5ForCausalLM`, `text_config` of
    `Qwen3_5ForConditionalGeneration`)."""

    model_type: Literal["qwen3_5_text", "qwen3_5"] | None = None
    vocab_size: PosInt
    hidden_size: PosInt
    intermediate_size: PosInt
    num_hidden_layers: PosInt
    num_attention_heads: PosInt
    num_key_value_heads: PosInt
    head_dim: PosInt
    linear_num_key_heads: PosInt
    linear_num_value_heads: PosInt
    linear_key_head_dim: PosInt
    linear_value_head_dim: PosInt
    linear_conv_kernel_dim: PosInt = 4
    layer_types: list[Literal["linear_attention", "full_attention"]] | None = None
    full_attention_interval: PosInt | None = None
    rms_norm_eps: HFFloat = 1e-6
    max_position_embeddings: PosInt | None = None
    tie_word_embeddings: bool | None = None
    hidden_act: Literal["silu"] = "silu"
    attention_bias: Literal[False] = False
    attention_dropout: Annotated[float, Field(ge=0, le=0)] = 0.0
    rope_parameters: RopeParameters | None = None
    rope_scaling: RopeParameters | None = None
    rope_theta: PosFloat | None = None
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: Annotated[float, BeforeValidator(_not_an_int)] | None = None
    use_cache: bool | None = None


class OuterConfig(_Schema):
    """The top level of a `Qwen3_5ForConditionalGeneration` checkpoint (the text under
    `text_config`); its `tie_word_embeddings` is the one `transformers` ties by."""

    model_type: Literal["qwen3_5"]
    text_config: dict[str, Any]
    tie_word_embeddings: bool = False


class Qwen3Fields(_Schema):
    """A `Qwen3ForCausalLM` config.json (`transformers`' `Qwen3Config`): dense, every layer full
    attention; the sliding window (off in every released Qwen3) is refused."""

    model_type: Literal["qwen3"]
    vocab_size: PosInt
    hidden_size: PosInt
    intermediate_size: PosInt
    num_hidden_layers: PosInt
    num_attention_heads: PosInt
    num_key_value_heads: PosInt | None = 32  # transformers' defaults (None: one per query head)
    head_dim: PosInt = 128  # (not hidden_size / heads)
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: PosInt | None = None
    rms_norm_eps: HFFloat = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | None = None
    rope_scaling: RopeParameters | None = None
    rope_theta: PosFloat | None = None
    attention_bias: Literal[False] = False
    attention_dropout: Annotated[float, Field(ge=0, le=0)] = 0.0
    use_sliding_window: Literal[False] = False
    sliding_window: PosInt | None = None  # unused without use_sliding_window
    max_window_layers: Annotated[int, Field(ge=0)] | None = None
    layer_types: list[Literal["full_attention"]] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: Annotated[float, BeforeValidator(_not_an_int)] | None = None
    use_cache: bool | None = None


# Why a field is refused, for the error message (the schema's own message names the value).
_REFUSED = {
    "model_type": "not a Qwen3.5 text model",
    "hidden_act": "Qwen3.5 uses 'silu' (the MLP and the DeltaNet conv); jaxpi implements no other activation",
    "attention_bias": "Qwen3.5 has no attention biases; jaxpi's attention has none",
    "attention_dropout": "jaxpi trains without attention dropout; set it to 0.0",
    "rope_type": "only the default (unscaled) RoPE of Qwen3.5 is implemented",
    "use_sliding_window": "jaxpi's attention has no sliding window",
    "layer_types": "jaxpi implements Qwen3's full-attention layers only",
    "partial_rotary_factor": "Qwen3 rotates the whole head",
}


class HFConfigError(ValueError):
    """A config.json field that is missing, mistyped, out of range or not supported; the message
    names the field (with its `text_config.` prefix where it sits there)."""


def _explain(err: ValidationError, prefix: str) -> HFConfigError:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        why = _REFUSED.get(str(e["loc"][-1]) if e["loc"] else "", "")
        got = "" if e["type"] == "missing" else f" (got {e['input']!r})"
        parts.append(f"{prefix}{loc}: {e['msg']}{got}" + (f" — {why}" if why else ""))
    return HFConfigError("; ".join(parts))


def text_fields(raw: Any) -> tuple[TextConfig, bool, str]:
    """Validate a parsed config.json. Returns (the text fields, tie_word_embeddings as
    `transformers` applies it, the prefix of the text fields: "" or "text_config.")."""
    if not isinstance(raw, dict):
        raise HFConfigError(f"config.json must be a JSON object, not {type(raw).__name__}")
    if raw.get("model_type") == "qwen3_5" or "text_config" in raw:
        try:
            outer = OuterConfig.model_validate(raw)
        except ValidationError as e:
            raise _explain(e, "") from None
        prefix, body, tie = "text_config.", outer.text_config, outer.tie_word_embeddings
    else:
        prefix, body, tie = "", raw, None
    try:
        text = TextConfig.model_validate(body)
    except ValidationError as e:
        raise _explain(e, prefix) from None
    if tie is None:  # a CausalLM checkpoint ties by its own (top-level) field
        tie = bool(text.tie_word_embeddings)
    if text.pad_token_id is not None and not -text.vocab_size <= text.pad_token_id < text.vocab_size:
        raise HFConfigError(
            f"{prefix}pad_token_id: {text.pad_token_id} is not an embedding row (vocab_size {text.vocab_size})"
        )
    for name in ("rope_theta", "partial_rotary_factor"):
        value = getattr(text, name)
        if value is not None and not math.isfinite(value):
            raise HFConfigError(f"{prefix}{name}: must be finite (got {value!r})")
    return text, tie, prefix


def qwen3_fields(raw: dict[str, Any]) -> Qwen3Fields:
    """Validate a Qwen3 config.json (errors name the field, as `text_fields`')."""
    try:
        text = Qwen3Fields.model_validate(raw)
    except ValidationError as e:
        raise _explain(e, "") from None
    rope = text.rope_parameters or text.rope_scaling
    if rope is not None and rope.partial_rotary_factor not in (None, 1.0):
        raise HFConfigError(
            f"rope_parameters.partial_rotary_factor: {rope.partial_rotary_factor} is not supported — "
            + _REFUSED["partial_rotary_factor"]
        )
    if text.pad_token_id is not None and not -text.vocab_size <= text.pad_token_id < text.vocab_size:
        raise HFConfigError(
            f"pad_token_id: {text.pad_token_id} is not an embedding row (vocab_size {text.vocab_size})"
        )
    if text.num_key_value_heads is not None and text.num_attention_heads % text.num_key_value_heads:
        raise HFConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    return text

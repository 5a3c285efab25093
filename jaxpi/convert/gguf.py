"""GGUF: a HF Qwen3.5 checkpoint as llama.cpp's `qwen35` model, and a LoRA adapter as a llama.cpp
adapter, written with the `gguf` package (what `jaxpi export --format gguf` writes first; the
quantized variants are then made by llama.cpp's own quantizer, `jaxpi.llamacpp`).

The tensor names are the `gguf` package's for `MODEL_ARCH.QWEN35`; the values are the HF ones
with the changes llama.cpp's graph expects (the same as its reference converter's):

- every RMSNorm weight but the DeltaNet's gated norm is stored as `1 + w` (HF keeps the offset);
- `A_log` is stored as `ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`;
- the depthwise conv `[C, 1, K]` loses its middle axis;
- the DeltaNet's value heads go from HF's grouped order (the heads of key head 0, then of key
  head 1, ...) to ggml's tiled order (head 0 of each key head, then head 1, ...) along every axis
  that has them: the V rows of `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_a`, `in_proj_b`,
  `A_log`, `dt_bias`, the V channels of the conv and the columns of `out_proj`;
- a 2-D weight `[out, in]` is written as is: GGUF's dimension order is numpy's reversed, so
  llama.cpp reads `{in, out}`.

Not written: the MTP head (the `gguf` package's qwen35 table has no MTP tensors; llama.cpp uses
it only for speculative decoding) and the vision tower (llama.cpp takes it as a separate mmproj
file). The tokenizer (`tokenizer.json`, byte-level BPE) and chat template are embedded.

Streaming: tensor infos are declared first, then each tensor is read, transformed and written in
turn, so host memory peaks at about the largest tensor.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxpi.config import FULL, LINEAR, QwenConfig
from jaxpi.convert.hf import check_checkpoint, read_config, text_prefix
from jaxpi.convert.safetensors_io import CheckpointError, TensorInfo, read_array, read_index, read_json

ARCH = "qwen35"
WEIGHT_DTYPES = ("BF16", "F16", "F32")
# The pre-tokenizer regexes llama.cpp knows for Qwen tokenizers, as tokenizer.json spells them.
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = {_QWEN35_REGEX: "qwen35", _QWEN2_REGEX: "qwen2"}


def gguf_package() -> Any:
    import gguf  # a core dependency; imported here so `jaxpi --help` stays quick

    return gguf


# ---- the tensor table ---------------------------------------------------------------------------

# HF module (under a text layer) -> the gguf package's MODEL_TENSOR name.
_LINEAR_TENSORS = {
    "self_attn.q_proj": "ATTN_Q",
    "self_attn.k_proj": "ATTN_K",
    "self_attn.v_proj": "ATTN_V",
    "self_attn.o_proj": "ATTN_OUT",
    "linear_attn.in_proj_qkv": "ATTN_QKV",
    "linear_attn.in_proj_z": "ATTN_GATE",
    "linear_attn.in_proj_b": "SSM_BETA",
    "linear_attn.in_proj_a": "SSM_ALPHA",
    "linear_attn.out_proj": "SSM_OUT",
    "mlp.gate_proj": "FFN_GATE",
    "mlp.up_proj": "FFN_UP",
    "mlp.down_proj": "FFN_DOWN",
}
_LAYER_TENSORS = {
    "input_layernorm.weight": ("ATTN_NORM", "norm+1"),
    "post_attention_layernorm.weight": ("ATTN_POST_NORM", "norm+1"),
    "self_attn.q_norm.weight": ("ATTN_Q_NORM", "norm+1"),
    "self_attn.k_norm.weight": ("ATTN_K_NORM", "norm+1"),
    "linear_attn.norm.weight": ("SSM_NORM", "f32"),
    "linear_attn.conv1d.weight": ("SSM_CONV1D", "conv"),
    "linear_attn.A_log": ("SSM_A", "a_log"),
    "linear_attn.dt_bias": ("SSM_DT", "dt_bias"),
    **{f"{m}.weight": (t, "linear") for m, t in _LINEAR_TENSORS.items()},
}


def v_head_order(cfg: QwenConfig, head_dim: int) -> np.ndarray | None:
    """The permutation taking the DeltaNet's value-head axis (heads x `head_dim`) from HF's grouped
    order to ggml's tiled order (`new = old[perm]`), or None when there is one value head per key
    head (nothing to reorder)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nk == nv:
        return None
    return np.arange(nv * head_dim).reshape(nk, nv // nk, head_dim).transpose(1, 0, 2).reshape(-1)


def gguf_name(tensor: str, layer: int | None = None, suffix: str = ".weight") -> str:
    g = gguf_package()
    base = g.TENSOR_NAMES[getattr(g.MODEL_TENSOR, tensor)]
    return (base.format(bid=layer) if layer is not None else base) + suffix


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF's ne reversed)
    dtype: str  # F32 | F16 | BF16
    produce: Callable[[], np.ndarray]
    source: str  # the HF tensor it comes from

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * (4 if self.dtype == "F32" else 2)


def _cast(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "F16":
        return np.ascontiguousarray(a.astype(np.float32).astype(np.float16))
    return np.ascontiguousarray(a.astype(np.float32).astype(ml_dtypes.bfloat16)).view(np.uint16)


def _transform(
    cfg: QwenConfig, kind: str, module: str, info: TensorInfo
) -> Callable[[np.ndarray], np.ndarray]:
    """The array transform of one HF tensor (float32 in, float32 out)."""
    dv, dk, nk = cfg.linear_value_head_dim, cfg.linear_key_head_dim, cfg.linear_num_key_heads
    per_v = v_head_order(cfg, dv)
    per_1 = v_head_order(cfg, 1)
    qk = 2 * nk * dk

    def rows_v(a: np.ndarray, offset: int, perm: np.ndarray | None) -> np.ndarray:
        if perm is None:
            return a
        out = a.copy()
        out[offset:] = a[offset:][perm]
        return out

    if kind == "norm+1":
        return lambda a: a + np.float32(1)
    if kind == "f32":
        return lambda a: a
    if kind == "a_log":
        return lambda a: -np.exp(a if per_1 is None else a[per_1])
    if kind == "dt_bias":
        return lambda a: a if per_1 is None else a[per_1]
    if kind == "conv":
        return lambda a: rows_v(a[:, 0, :], qk, per_v)
    if module == "linear_attn.in_proj_qkv.weight":
        return lambda a: rows_v(a, qk, per_v)
    if module == "linear_attn.in_proj_z.weight":
        return lambda a: rows_v(a, 0, per_v)
    if module in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
        return lambda a: rows_v(a, 0, per_1)
    if module == "linear_attn.out_proj.weight":
        return lambda a: a if per_v is None else a[:, per_v]
    return lambda a: a


def plan_tensors(cfg: QwenConfig, index: dict[str, TensorInfo], dtype: str = "BF16") -> list[GGUFTensor]:
    """Every GGUF tensor of the checkpoint `index` (checked against `cfg` by the caller), in
    llama.cpp's order: embeddings, layers, output."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"GGUF weight dtype must be one of {list(WEIGHT_DTYPES)}, not {dtype!r}")
    prefix = text_prefix(index)
    out: list[GGUFTensor] = []

    def add(hf: str, name: str, kind: str, module: str, shape: tuple[int, ...], wdtype: str) -> None:
        info = index[hf]
        fn = _transform(cfg, kind, module, info)

        def produce(info: TensorInfo = info, fn: Callable = fn, wdtype: str = wdtype) -> np.ndarray:
            a = fn(np.asarray(read_array(info), dtype=np.float32))
            if not np.isfinite(a).all():
                raise CheckpointError(f"{info.file}: tensor {info.name!r} holds NaN or Inf")
            return _cast(a, wdtype)

        out.append(GGUFTensor(name, shape, wdtype, produce, hf))

    emb = f"{prefix}embed_tokens.weight"
    add(emb, gguf_name("TOKEN_EMBD"), "copy", "", index[emb].shape, dtype)
    for i, layer_type in enumerate(cfg.layer_types):
        for suffix, (tensor, kind) in _LAYER_TENSORS.items():
            mixer = suffix.split(".")[0]
            if (mixer == "self_attn" and layer_type != FULL) or (
                mixer == "linear_attn" and layer_type != LINEAR
            ):
                continue
            hf = f"{prefix}layers.{i}.{suffix}"
            shape = index[hf].shape
            if kind == "conv":
                shape = (shape[0], shape[2])
            is_weight = kind == "linear"
            name = gguf_name(
                tensor, i, ".bias" if kind == "dt_bias" else ("" if kind == "a_log" else ".weight")
            )
            add(hf, name, kind, suffix, shape, dtype if is_weight else "F32")
    add(
        f"{prefix}norm.weight",
        gguf_name("OUTPUT_NORM"),
        "norm+1",
        "",
        index[f"{prefix}norm.weight"].shape,
        "F32",
    )
    if not cfg.tie_word_embeddings and "lm_head.weight" in index:
        add("lm_head.weight", gguf_name("OUTPUT"), "copy", "", index["lm_head.weight"].shape, dtype)
    return out


# ---- metadata -----------------------------------------------------------------------------------


def check_supported(cfg: QwenConfig, where: str) -> None:
    """llama.cpp's qwen35 graph runs hybrid stacks and reads one head size for the DeltaNet's keys
    and values."""
    if set(cfg.layer_types) != {FULL, LINEAR}:
        raise CheckpointError(
            f"{where}: llama.cpp's qwen35 model runs hybrid stacks only (it aborts on an empty KV cache or "
            f"recurrent state): this checkpoint has only {cfg.layer_types[0]} layers; every Qwen3.5 mixes both"
        )
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise CheckpointError(
            f"{where}: llama.cpp's qwen35 model needs linear_key_head_dim == linear_value_head_dim "
            f"(it reads one, ssm.state_size); this checkpoint has {cfg.linear_key_head_dim} and "
            f"{cfg.linear_value_head_dim}"
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise CheckpointError(f"{where}: linear_num_value_heads is not a multiple of linear_num_key_heads")


def _covers(sec: list[int], pairs: int) -> bool:
    """Whether llama.cpp's interleaved M-RoPE gives every rotary pair a text position stream with
    these sections (pair i takes stream i % 3 while i < 3 * sections[i % 3], else the 4th)."""
    return sum(sec) == pairs and all(i < 3 * sec[i % 3] for i in range(pairs))


def _mrope_sections(cfg: QwenConfig, raw: dict[str, Any]) -> list[int]:
    """The rotary pairs per position stream (time, height, width, -). For text every stream holds
    the token's position, so any split that gives each pair one of the first three streams
    rotates alike: the config's (transformers' default [11, 11, 10] covers the 27B's 32 pairs)
    when it does, else the balanced split of this model's pairs."""
    text = raw.get("text_config", raw)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    sec = rope.get("mrope_section") if isinstance(rope, dict) else None
    pairs = cfg.rotary_dim // 2
    if (
        isinstance(sec, list)
        and sec
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sec)
    ):
        sec = (list(sec) + [0, 0, 0, 0])[:4]
    else:
        sec = [11, 11, 10, 0]
    if _covers(sec, pairs):
        return sec
    return [-(-pairs // 3), -(-(pairs - 1) // 3), -(-(pairs - 2) // 3), 0]


def add_model_metadata(w: Any, cfg: QwenConfig, raw: dict[str, Any], name: str, file_type: int) -> None:
    g = gguf_package()
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(g.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_rope_dimension_sections(_mrope_sections(cfg, raw))
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    interval = raw.get("text_config", raw).get("full_attention_interval", 4)
    w.add_full_attention_interval(interval if isinstance(interval, int) and interval > 0 else 4)
    # Which layers are DeltaNet layers, explicitly: llama.cpp otherwise assumes every 4th is full.
    w.add_array(f"{ARCH}.attention.recurrent_layers", [t == LINEAR for t in cfg.layer_types])


def _read_tokenizer(src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    tok_file = src / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(
            f"{src}: no tokenizer.json; the GGUF embeds the tokenizer (copy the base model's tokenizer files here)"
        )
    tok = read_json(tok_file, "tokenizer", limit=512 * 2**20)
    conf_file = src / "tokenizer_config.json"
    conf = read_json(conf_file, "tokenizer config", limit=64 * 2**20) if conf_file.is_file() else {}
    if not isinstance(tok, dict) or not isinstance(conf, dict):
        raise CheckpointError(f"{src}: tokenizer.json / tokenizer_config.json is not a JSON object")
    return tok, conf


def _pre_tokenizer(tok: dict[str, Any], where: Path) -> str:
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
    regex = None
    for step in steps:
        if not isinstance(step, dict):
            continue
        if step.get("type") == "Split" and isinstance(step.get("pattern"), dict):
            regex = step["pattern"].get("Regex")
        if step.get("type") == "ByteLevel" and step.get("use_regex", True) and regex is None:
            return "gpt-2"
    if regex in _PRE:
        return _PRE[regex]
    raise CheckpointError(
        f"{where}: a pre-tokenizer llama.cpp's qwen35 model does not know (expected Qwen's split regex "
        f"or GPT-2's byte-level one; found {str(regex or pre)[:120]!r})"
    )


def add_tokenizer_metadata(w: Any, src: Path, vocab_size: int) -> dict[str, int]:
    """Embed `src`'s byte-level BPE tokenizer and chat template; returns the special token ids."""
    g = gguf_package()
    tok, conf = _read_tokenizer(src)
    where = src / "tokenizer.json"
    model = tok.get("model") or {}
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise CheckpointError(
            f"{where}: not a BPE tokenizer (model.type {model.get('type')!r}); GGUF export needs one"
        )
    tokens: dict[int, tuple[str, int]] = {}
    for text, i in model["vocab"].items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise CheckpointError(
                f"{where}: token {text!r} has id {i!r}, not in [0, vocab_size {vocab_size})"
            )
        tokens[i] = (text, int(g.TokenType.NORMAL))
    for added in tok.get("added_tokens") or []:
        i, text = added.get("id"), added.get("content")
        if not isinstance(i, int) or not isinstance(text, str) or not 0 <= i < vocab_size:
            raise CheckpointError(f"{where}: added token {added!r} has no id in [0, vocab_size {vocab_size})")
        kind = g.TokenType.CONTROL if added.get("special") else g.TokenType.USER_DEFINED
        tokens[i] = (text, int(kind))
    names = [tokens.get(i, (f"[PAD{i}]", int(g.TokenType.UNUSED)))[0] for i in range(vocab_size)]
    types = [tokens.get(i, ("", int(g.TokenType.UNUSED)))[1] for i in range(vocab_size)]
    merges = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer(tok, where))
    w.add_token_list(names)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = {text: i for i, (text, _) in tokens.items()}
    special: dict[str, int] = {}
    for key, adder in (
        ("eos_token", w.add_eos_token_id),
        ("pad_token", w.add_pad_token_id),
        ("bos_token", w.add_bos_token_id),
    ):
        value = conf.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in ids:
            adder(ids[value])
            special[key] = ids[value]
    w.add_add_bos_token(bool(conf.get("add_bos_token", False)))
    template = conf.get("chat_template")
    jinja = src / "chat_template.jinja"
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text()
    if isinstance(template, str):
        w.add_chat_template(template)
    return special


# ---- writing ------------------------------------------------------------------------------------

_RAW = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def write_gguf(
    w: Any, path: Path, tensors: Iterable[GGUFTensor], progress: Callable[[str], None] | None = None
) -> int:
    """Declare, then stream `tensors` into the writer `w` (metadata already added) at `path`."""
    g = gguf_package()
    tensors = list(tensors)
    for t in tensors:
        np_dtype = np.dtype(
            np.float32 if t.dtype == "F32" else (np.float16 if t.dtype == "F16" else np.uint16)
        )
        raw = None if t.dtype != "BF16" else g.GGMLQuantizationType.BF16
        w.add_tensor_info(t.name, t.shape, np_dtype, t.nbytes, raw_dtype=raw)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, t in enumerate(tensors):
        a = t.produce()
        if a.shape != tuple(t.shape):
            raise CheckpointError(f"tensor {t.source!r}: shape {list(a.shape)}, expected {list(t.shape)}")
        w.write_tensor_data(a)
        if progress is not None and (k + 1) % 50 == 0:
            progress(f"  {k + 1}/{len(tensors)} tensors")
    w.close()
    return sum(t.nbytes for t in tensors)


FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}


def write_base_gguf(
    src: str | os.PathLike,
    path: str | os.PathLike,
    *,
    dtype: str = "BF16",
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The HF checkpoint `src` as one GGUF file at `path` (not atomic: the caller writes into a
    temporary directory). The checkpoint is checked as `jaxpi convert --check` checks it first."""
    g = gguf_package()
    src, path = Path(src), Path(path)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such checkpoint directory")
    cfg = read_config(src)
    raw = read_json(src / "config.json", "config", limit=64 * 2**20)
    if "quantization_config" in raw or "quantization_config" in raw.get("text_config", {}):
        raise CheckpointError(
            f"{src}/config.json: the checkpoint is quantized already; GGUF export needs a float one"
        )
    check_supported(cfg, f"{src}/config.json")
    index = read_index(src)
    check_checkpoint(cfg, index)
    tensors = plan_tensors(cfg, index, dtype)
    w = g.GGUFWriter(None, ARCH)
    add_model_metadata(w, cfg, raw, name or src.name, FILE_TYPES[dtype])
    special = add_tokenizer_metadata(w, src, cfg.vocab_size)
    nbytes = write_gguf(w, path, tensors, progress)
    warnings = []
    if cfg.rms_norm_eps != 1e-6:
        warnings.append(
            f"rms_norm_eps is {cfg.rms_norm_eps:g}: llama.cpp also uses it for the DeltaNet's q/k L2 norm, where "
            "transformers (and jaxpi) use 1e-6, so llama.cpp's logits differ slightly (every Qwen3.5 has 1e-6)"
        )
    return {"file": str(path), "tensors": len(tensors), "bytes": path.stat().st_size, "tensor_bytes": nbytes,
            "dtype": dtype, "special_tokens": special, "warnings": warnings}  # fmt: skip


# ---- the LoRA adapter ---------------------------------------------------------------------------

_PEFT_KEY = re.compile(
    r"^base_model\.model\.(?:model\.language_model\.|model\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$"
)


def write_adapter_gguf(
    peft_dir: str | os.PathLike, cfg: QwenConfig, path: str | os.PathLike, *, name: str = "adapter"
) -> dict[str, Any]:
    """A peft LoRA adapter (as `jaxpi export` writes it) as a llama.cpp LoRA GGUF at `path`: per
    adapted weight `W`, `<gguf name of W>.lora_a` `[r, in]` and `.lora_b` `[out, r]` (F32), the
    value-head reorder applied to B's rows (or to A's columns for `out_proj`); llama.cpp applies
    `W + (alpha / r) * scale * B A`."""
    g = gguf_package()
    peft_dir, path = Path(peft_dir), Path(path)
    conf = read_json(peft_dir / "adapter_config.json", "adapter config")
    if (
        not isinstance(conf, dict)
        or not isinstance(conf.get("r"), int)
        or not isinstance(conf.get("lora_alpha"), (int, float))
    ):
        raise CheckpointError(f"{peft_dir}/adapter_config.json: needs integer r and numeric lora_alpha")
    if conf.get("use_dora") or conf.get("use_rslora"):
        raise CheckpointError(
            f"{peft_dir}/adapter_config.json: DoRA / rsLoRA adapters have no llama.cpp form"
        )
    check_supported(cfg, str(peft_dir))
    index = read_index(peft_dir)
    pairs: dict[tuple[int, str], dict[str, TensorInfo]] = {}
    for key, info in index.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise CheckpointError(
                f"{info.file}: tensor {key!r} is not a LoRA factor of a text layer's linear module"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in _LINEAR_TENSORS or not 0 <= layer < cfg.num_hidden_layers:
            raise CheckpointError(f"{info.file}: tensor {key!r}: no GGUF tensor for layer {layer} {module}")
        pairs.setdefault((layer, module), {})[ab] = info
    dv = cfg.linear_value_head_dim
    nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    tensors: list[GGUFTensor] = []
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{peft_dir}: layer {layer} {module} has lora_{''.join(ab)} only")
        a_info, b_info = ab["A"], ab["B"]
        if len(a_info.shape) != 2 or len(b_info.shape) != 2 or a_info.shape[0] != b_info.shape[1]:
            raise CheckpointError(
                f"{a_info.file}: layer {layer} {module}: lora_A {list(a_info.shape)} and lora_B "
                f"{list(b_info.shape)} are not [r, in] and [out, r]"
            )
        base = gguf_name(_LINEAR_TENSORS[module], layer)
        weight = f"{module}.weight"
        perm_b, perm_a, offset = None, None, 0
        if weight == "linear_attn.in_proj_qkv.weight":
            perm_b, offset = v_head_order(cfg, dv), 2 * nk * dk
        elif weight == "linear_attn.in_proj_z.weight":
            perm_b = v_head_order(cfg, dv)
        elif weight in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
            perm_b = v_head_order(cfg, 1)
        elif weight == "linear_attn.out_proj.weight":
            perm_a = v_head_order(cfg, dv)

        def make_a(info: TensorInfo = a_info, perm: np.ndarray | None = perm_a) -> np.ndarray:
            a = np.asarray(read_array(info), dtype=np.float32)
            return np.ascontiguousarray(a if perm is None else a[:, perm])

        def make_b(
            info: TensorInfo = b_info, perm: np.ndarray | None = perm_b, off: int = offset
        ) -> np.ndarray:
            b = np.array(read_array(info), dtype=np.float32)
            if perm is not None:
                b[off:] = b[off:][perm]
            return np.ascontiguousarray(b)

        tensors.append(GGUFTensor(base + ".lora_a", a_info.shape, "F32", make_a, a_info.name))
        tensors.append(GGUFTensor(base + ".lora_b", b_info.shape, "F32", make_b, b_info.name))
    if not tensors:
        raise CheckpointError(f"{peft_dir}: the adapter holds no LoRA factors")
    w = g.GGUFWriter(None, ARCH)
    w.add_name(name)
    w.add_type(g.GGUFType.ADAPTER)
    w.add_string(g.Keys.Adapter.TYPE, "lora")
    w.add_float32(g.Keys.Adapter.LORA_ALPHA, float(conf["lora_alpha"]))
    write_gguf(w, path, tensors)
    return {"file": str(path), "tensors": len(tensors), "rank": conf["r"], "alpha": conf["lora_alpha"],
            "modules": len(pairs), "bytes": path.stat().st_size}  # fmt: skip

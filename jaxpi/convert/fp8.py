"""Block-wise FP8 checkpoints: `export_fp8` turns a HF Qwen3.5 checkpoint into the FP8 format of
Qwen's and DeepSeek's official FP8 releases (what `jaxpi export --format fp8` writes).

The format, as transformers' `FineGrainedFP8` and vLLM's `Fp8Config` read it:

- every quantized linear weight `W [out, in]` is stored as `float8_e4m3fn` in blocks of
  128 x 128 with one float32 scale per block, `<module>.weight_scale_inv
  [ceil(out / 128), ceil(in / 128)]`; the weight is `W ≈ q * weight_scale_inv` blockwise (the
  name is the convention's: it is the inverse of the factor the weight was multiplied by);
- `config.json` gains `quantization_config = {quant_method: fp8, fmt: e4m3, activation_scheme:
  dynamic, weight_block_size: [128, 128], modules_to_not_convert: [...]}` (activations are
  quantized per token group at run time, so no calibration data is needed);
- everything else keeps its precision: the embeddings, the LM head, every norm, the Gated
  DeltaNet's convolution, `A_log`, `dt_bias` and its two small projections `in_proj_a` /
  `in_proj_b` (one output per value head: 48 rows on the 27B, less than one block), the vision
  tower `model.visual.*` and the MTP head `mtp.*`. `modules_to_not_convert` names each kept
  linear module in full (transformers matches a name as a module prefix, vLLM exactly).

Quantization is transformers' own arithmetic (`Fp8Quantize`), in float32: per block
`amax = max|W|`, `f = 448 * (1 / amax)` (1 for an all-zero block), `q = clip(W * f, -448, 448)`
rounded to nearest-even E4M3, `weight_scale_inv = 1 / f`; the codes and scales are those of
transformers' quantizer bit for bit (tested). A ragged edge block (a dimension that is not a
multiple of 128) gets its own scale over the elements it has, as vLLM's block-FP8 layers expect;
every Qwen3.5 release has its quantized dimensions in whole blocks, small test models may not
(the summary lists such weights under `ragged`).

Streaming: one tensor is read, quantized and written at a time, so host memory peaks at about
the largest tensor (as the converter); the output is written through `atomic_dir` in <= 5 GB
shards with an index.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxpi.atomic import atomic_dir
from jaxpi.convert.hf import (
    FLOAT_CODES,
    MAX_SHARD_BYTES,
    check_checkpoint,
    copy_side_files,
    read_config,
    text_prefix,
    write_shards,
)
from jaxpi.convert.safetensors_io import (
    DTYPES,
    CheckpointError,
    PlannedTensor,
    TensorInfo,
    read_array,
    read_index,
    read_json,
    read_raw,
)
from jaxpi.convert.table import LINEAR_MODULES, mtp_shapes, text_rules

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = (128, 128)
# Linear modules kept in the source precision: one output per value head (less than a block on
# every Qwen3.5), the gates of the delta rule, which every published FP8/INT8 Qwen3.5 keeps.
KEPT_LINEAR = ("in_proj_a", "in_proj_b")
FP8_MODULES = tuple(m for m in LINEAR_MODULES if m.hf not in KEPT_LINEAR)


def quantize_blockwise(w: np.ndarray, block: tuple[int, int] = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """`w [rows, cols]` -> (`q` float8_e4m3fn [rows, cols], `scale_inv` float32 [ceil(rows/bm),
    ceil(cols/bn)]) with `w ≈ q * scale_inv` per block (see the module docstring)."""
    if w.ndim != 2:
        raise ValueError(f"block-wise FP8 needs a 2-D weight, got shape {list(w.shape)}")
    bm, bn = block
    rows, cols = w.shape
    gr, gc = -(-rows // bm), -(-cols // bn)
    w32 = np.asarray(w, dtype=np.float32)
    padded = np.zeros((gr * bm, gc * bn), np.float32)  # zeros leave a ragged block's amax as is
    padded[:rows, :cols] = w32
    tiles = padded.reshape(gr, bm, gc, bn)
    amax = np.abs(tiles).max(axis=(1, 3))
    if not np.isfinite(amax).all():
        raise ValueError("the weight holds NaN or Inf: it has no FP8 scale")
    nonzero = amax > 0
    # 448 * (1 / amax) in float32: how torch evaluates transformers' `448 / amax` (a scalar over a
    # tensor is a reciprocal, then a product), so codes and scales are transformers' bit for bit.
    recip = np.float32(1) / np.where(nonzero, amax, np.float32(1))
    factor = np.where(nonzero, recip * np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    scaled = tiles * factor[:, None, :, None]
    q = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3).reshape(gr * bm, gc * bn)[:rows, :cols]
    return np.ascontiguousarray(q), (np.float32(1) / factor).astype(np.float32)


def dequantize_blockwise(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """The float32 weight `q * scale_inv` per block (ragged edges included)."""
    bm, bn = block
    rows, cols = q.shape
    if scale_inv.shape != (-(-rows // bm), -(-cols // bn)):
        raise ValueError(
            f"scale grid {list(scale_inv.shape)} does not tile a {list(q.shape)} weight in {bm}x{bn} blocks"
        )
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)[:rows, :cols]
    return q.astype(np.float32) * full


def quantized_names(cfg: Any, index: Mapping[str, Any]) -> list[str]:
    """The weights `export_fp8` stores in FP8: every text layer's linear module of `FP8_MODULES`."""
    prefix = text_prefix(index)
    out = []
    for i, layer_type in enumerate(cfg.layer_types):
        for m in FP8_MODULES:
            if m.layer_type in (None, layer_type):
                out.append(f"{prefix}layers.{i}.{m.hf_block}.{m.hf}.weight")
    return out


def kept_linear_modules(cfg: Any, index: dict[str, TensorInfo], quantized: set[str]) -> list[str]:
    """`modules_to_not_convert`: the full name of every linear module the export keeps unquantized
    (the LM head, each layer's `in_proj_a`/`in_proj_b`, the vision tower's and MTP head's linears)."""
    prefix = text_prefix(index)
    names = set()
    if "lm_head.weight" in index:
        names.add("lm_head")
    for i, layer_type in enumerate(cfg.layer_types):
        if layer_type == "linear_attention":
            names.update(f"{prefix}layers.{i}.linear_attn.{m}" for m in KEPT_LINEAR)
    for name, info in index.items():
        carried = name.startswith(("model.visual.", "mtp.")) and name not in quantized
        if carried and name.endswith(".weight") and len(info.shape) == 2:
            names.add(name.removesuffix(".weight"))
    return sorted(names)


def _kept(info: TensorInfo, dtype: str | None) -> PlannedTensor:
    if dtype is None or info.dtype not in FLOAT_CODES or info.dtype == dtype:
        return PlannedTensor(
            info.name, info.dtype, info.shape, functools.partial(read_raw, info), size=info.end - info.begin
        )
    return PlannedTensor(
        info.name, dtype, info.shape, lambda: np.ascontiguousarray(read_array(info).astype(DTYPES[dtype]))
    )


def _quantized(info: TensorInfo, block: tuple[int, int]) -> tuple[PlannedTensor, PlannedTensor]:
    """The FP8 weight and its scales; the scales computed with the weight are kept until written."""
    rows, cols = info.shape
    pending: dict[str, np.ndarray] = {}

    def quantize() -> tuple[np.ndarray, np.ndarray]:
        try:
            return quantize_blockwise(read_array(info), block)
        except ValueError as e:
            raise CheckpointError(f"{info.file}: tensor {info.name!r}: {e}") from None

    def weight() -> np.ndarray:
        q, pending["scale"] = quantize()
        return q

    def scale() -> np.ndarray:
        s = pending.pop("scale", None)
        return s if s is not None else quantize()[1]

    grid = (-(-rows // block[0]), -(-cols // block[1]))
    base = info.name.removesuffix(".weight")
    return (
        PlannedTensor(info.name, "F8_E4M3", info.shape, weight),
        PlannedTensor(f"{base}.weight_scale_inv", "F32", grid, scale),
    )


def fp8_config(raw: dict[str, Any], not_converted: list[str], block: tuple[int, int]) -> dict[str, Any]:
    """`config.json` of the export: the source's, with `quantization_config`."""
    out = dict(raw)
    out["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": not_converted,
    }
    return out


def export_fp8(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    block: tuple[int, int] = BLOCK,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Write the block-wise FP8 export of the HF checkpoint `src` to `out`; return a summary.

    `dtype` ("BF16", "F16", "F32" or None: as stored) is the precision of the tensors that stay
    unquantized. The source is checked as `jaxpi convert --check` checks it (names, shapes,
    dtypes against config.json) before anything is written.
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such checkpoint directory")
    if dtype is not None and dtype not in FLOAT_CODES:
        raise ValueError(f"dtype must be one of {list(FLOAT_CODES)} or None, not {dtype!r}")
    cfg = read_config(src)  # a missing or malformed config.json is an error naming the file
    raw = read_json(src / "config.json", "config", limit=64 * 2**20)
    if "quantization_config" in raw or "quantization_config" in raw.get("text_config", {}):
        raise CheckpointError(
            f"{src}/config.json: the checkpoint is already quantized ({raw['quantization_config']})"
        )
    index = read_index(src)
    check_checkpoint(cfg, index)
    quantized = quantized_names(cfg, index)
    qset = set(quantized)
    not_converted = kept_linear_modules(cfg, index, qset)

    planned: list[PlannedTensor] = []
    for name, info in index.items():
        if name in qset:
            planned.extend(_quantized(info, block))
        else:
            planned.append(_kept(info, dtype))
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_shards(tmp, planned, max_shard_bytes, progress)
        (tmp / "config.json").write_text(json.dumps(fp8_config(raw, not_converted, block), indent=2) + "\n")
        copy_side_files(src, tmp)
    ragged = [
        n for n in quantized if any(d > b and d % b for d, b in zip(index[n].shape, block, strict=True))
    ]
    source_bytes = sum(i.end - i.begin for i in index.values())
    written = sum(t.nbytes for t in planned)
    return {
        "source": str(src),
        "output": str(out),
        "format": "fp8",
        "block": list(block),
        "quantized_tensors": len(quantized),
        "quantized_params": int(sum(np.prod(index[n].shape) for n in quantized)),
        "kept_tensors": len(index) - len(quantized),
        "modules_to_not_convert": len(not_converted),
        # Weights with a partial edge block: vLLM reads them; transformers 5.24's CPU dequantization
        # infers the block from the scale grid and mis-scales them (docs/export.md, "FP8").
        "ragged": ragged,
        "source_bytes": source_bytes,
        "bytes": written,
    }


# The Qwen3.5 vision tower as transformers' `Qwen3_5VisionConfig` defaults describe it (27 blocks
# of width 1152), its output projected to the text model's width; the released 27B and 9B ship it.
VISION_DEFAULTS = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
}


def vision_shapes(vision: dict[str, int], out_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Qwen3.5 vision tower (`model.visual.*`) and its shape, from the
    `vision_config` fields (checked against transformers' `Qwen3_5VisionModel` in the tests)."""
    v = {**VISION_DEFAULTS, **vision}
    h, i, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    merged = h * v["spatial_merge_size"] ** 2
    p = "model.visual."
    shapes: dict[str, tuple[int, ...]] = {
        p + "patch_embed.proj.weight": (
            h,
            v["in_channels"],
            v["temporal_patch_size"],
            v["patch_size"],
            v["patch_size"],
        ),
        p + "patch_embed.proj.bias": (h,),
        p + "pos_embed.weight": (v["num_position_embeddings"], h),
    }
    for b in range(depth):
        q = f"{p}blocks.{b}."
        for norm in ("norm1", "norm2"):
            shapes |= {q + norm + ".weight": (h,), q + norm + ".bias": (h,)}
        for name, (o, n) in {
            "attn.qkv": (3 * h, h),
            "attn.proj": (h, h),
            "mlp.linear_fc1": (i, h),
            "mlp.linear_fc2": (h, i),
        }.items():
            shapes |= {q + name + ".weight": (o, n), q + name + ".bias": (o,)}
    m = p + "merger."
    shapes |= {m + "norm.weight": (h,), m + "norm.bias": (h,)}
    shapes |= {m + "linear_fc1.weight": (merged, merged), m + "linear_fc1.bias": (merged,)}
    shapes |= {m + "linear_fc2.weight": (out_hidden, merged), m + "linear_fc2.bias": (out_hidden,)}
    return shapes


def fp8_size(
    cfg: Any,
    *,
    vision: dict[str, int] | None = None,
    mtp: bool = False,
    kept_bytes: int = 2,
    block: tuple[int, int] = BLOCK,
) -> dict[str, Any]:
    """The bytes of the FP8 export of a checkpoint of `cfg` (with a vision tower of `vision`'s
    fields and an MTP head if given), without weights: the FP8 weights (1 byte), their float32
    scales, and every other tensor at `kept_bytes` (2: BF16). Returns per part and in all, with
    the BF16 checkpoint's bytes beside them."""
    prefix = "model.language_model." if vision is not None else "model."
    text = {r.hf: r.hf_shape for r in text_rules(cfg, prefix)}
    quantized = set(quantized_names(cfg, text))
    parts = {"text": text}
    if vision is not None:
        parts["vision"] = vision_shapes(vision, cfg.hidden_size)
    if mtp:
        parts["mtp"] = mtp_shapes(cfg)
    report: dict[str, Any] = {"block": list(block), "parts": {}}
    for part, shapes in parts.items():
        row = {"tensors": len(shapes), "params": 0, "fp8_params": 0, "scale_bytes": 0, "kept_params": 0}
        for name, shape in shapes.items():
            n = int(np.prod(shape, dtype=np.int64))
            row["params"] += n
            if name in quantized:
                row["fp8_params"] += n
                row["scale_bytes"] += 4 * (-(-shape[0] // block[0])) * (-(-shape[1] // block[1]))
            else:
                row["kept_params"] += n
        row["bytes"] = row["fp8_params"] + row["scale_bytes"] + kept_bytes * row["kept_params"]
        row["bf16_bytes"] = 2 * row["params"]
        report["parts"][part] = row
    for key in ("tensors", "params", "fp8_params", "scale_bytes", "kept_params", "bytes", "bf16_bytes"):
        report[key] = sum(r[key] for r in report["parts"].values())
    return report

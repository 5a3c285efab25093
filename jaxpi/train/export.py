"""`export()`: a trained adapter out as a peft LoRA adapter, merged into a full HF checkpoint, or
merged and stored as block-wise FP8 (what `jaxpi export` runs).

The adapter is a peft adapter directory (it has `adapter_config.json`) or a jaxpi trainer
checkpoint (a run directory, its `checkpoints/` directory or one step), read by
`jaxpi.train.checkpoint.load_adapter`; for those, the base defaults to the one recorded in the
checkpoint. The peft export needs only the base's `config.json` (no weights are loaded); the
merged export loads the base, folds the adapter in and writes it with `save_hf`. The FP8 export
(`jaxpi.convert.fp8`) quantizes the merged checkpoint, or with no adapter the base itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from jaxpi.atomic import atomic_dir, refuse_existing, scratch_dir
from jaxpi.config import QwenConfig
from jaxpi.convert.fp8 import export_fp8
from jaxpi.convert.gguf import write_adapter_gguf
from jaxpi.convert.gguf_export import export_gguf
from jaxpi.convert.hf import load_hf, read_config
from jaxpi.convert.quantize import dequantized
from jaxpi.convert.safetensors_io import read_index
from jaxpi.lora import add_lora, select_modules
from jaxpi.lora.peft import CONFIG_NAME, abstract_lora_model, load_peft, save_merged, save_peft
from jaxpi.quant import check_base_quant

DTYPES = ["float32", "bfloat16", "float16"]
FORMATS = ["peft", "merged", "fp8", "gguf"]
_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def export(
    adapter: str | Path | None,
    out: str | Path,
    *,
    base: str | Path | None = None,
    merged: bool = False,
    fmt: str | None = None,
    dtype: str | None = None,
    base_name: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    gguf: dict[str, Any] | None = None,
    base_quant: str | None = None,
) -> dict[str, Any]:
    """Read the adapter, write the export, return a summary (what `jaxpi export` prints).

    `fmt` is "peft" (the default), "merged" (also `merged=True`), "fp8": the merged checkpoint
    in block-wise FP8, or with `adapter=None` the base checkpoint itself in FP8; or "gguf": with
    an adapter, the adapter as a llama.cpp LoRA GGUF (with `merged=True` the merged model's
    GGUF files instead), without one the base's GGUF files; `gguf` holds `export_gguf`'s options
    (quants, imatrix, sessions, heldout, ctx, report).

    `base_quant` is the base the adapter was trained on (None: a trainer checkpoint's own
    `lora.base_quant`, "none" for a peft adapter). A merged export of a QLoRA adapter merges it
    into the weights it was trained against: the base quantized as in training, dequantized in
    float32, merged, and written in bfloat16 unless `dtype` says otherwise."""
    if base_quant is not None:
        check_base_quant(base_quant, "--base-quant")
    if fmt == "gguf":
        return _export_gguf(
            adapter,
            Path(out),
            base=base,
            merged=merged,
            options=gguf or {},
            overwrite=overwrite,
            progress=progress,
            base_quant=base_quant,
        )
    fmt = fmt or ("merged" if merged else "peft")
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    if fmt == "fp8":
        return _export_fp8(
            adapter,
            Path(out),
            base=base,
            dtype=dtype,
            overwrite=overwrite,
            progress=progress,
            base_quant=base_quant,
        )
    if adapter is None:
        raise ValueError(f"--adapter is required for the {fmt} export (only fp8 converts a base on its own)")
    merged = fmt == "merged"
    adapter = Path(adapter)
    if not adapter.exists():
        raise FileNotFoundError(f"{adapter}: no such adapter directory or checkpoint")
    if (adapter / CONFIG_NAME).exists():
        if base is None:
            raise ValueError("--base is required for a peft adapter (the HF checkpoint it was trained on)")
        source = "peft"
        cfg = QwenConfig.from_hf(Path(base))
        lcfg, state = load_peft(cfg, adapter)
        meta: dict[str, Any] = {}
    else:
        source = "jaxpi checkpoint"
        state, lcfg, meta = _load_trainer_checkpoint(adapter)
        cfg = QwenConfig.from_hf(meta["model_config"])
        base = base if base is not None else meta.get("base")
        if base is None:
            raise ValueError(f"{adapter}: the checkpoint records no base; pass --base")
    base = Path(base)
    quant = base_quant if base_quant is not None else lcfg.base_quant

    if merged and quant != "none":
        # the weights the adapter was trained against: quantized from the values in the training
        # dtype (a peft adapter's: bf16 for an all-BF16 base), dequantized in float32
        train_dtype = meta.get("dtype") or _load_dtype(base, None)
        _, model = load_hf(base, dtype=train_dtype, progress=progress, base_quant=quant)
        dequantized(model, "float32")
        add_lora(model, lcfg)
        nnx.update(model, state)
        path = save_merged(
            model,
            out,
            base_dir=base,
            dtype=dtype or "bfloat16",
            overwrite=overwrite,
            progress=progress,
            inplace=True,
        )
    elif merged:
        _, model = load_hf(base, dtype=_load_dtype(base, dtype), progress=progress)
        add_lora(model, lcfg)
        nnx.update(model, state)
        path = save_merged(
            model, out, base_dir=base, dtype=dtype, overwrite=overwrite, progress=progress, inplace=True
        )
    else:
        model = abstract_lora_model(cfg, lcfg)
        nnx.update(model, state)
        path = save_peft(
            model,
            lcfg,
            out,
            base_dir=base,
            dtype=dtype or "float32",
            base_model_name_or_path=base_name,
            overwrite=overwrite,
        )
    return {
        "source": source,
        "adapter": str(adapter),
        "base": str(base),
        "format": "merged" if merged else "peft",
        "output": str(path),
        "files": sorted(p.name for p in path.iterdir()),
        "rank": lcfg.rank,
        "alpha": lcfg.alpha,
        "modules": len(select_modules(cfg, lcfg)),
        "base_quant": quant,
    }


def _export_fp8(
    adapter: str | Path | None,
    out: Path,
    *,
    base: str | Path | None,
    dtype: str | None,
    overwrite: bool,
    progress: bool,
    base_quant: str | None = None,
) -> dict[str, Any]:
    """FP8 of `base` (no adapter), or of base + adapter merged first into a scratch directory
    beside `out` (removed afterwards, and by the next export if this one is killed)."""
    code = _CODES[dtype] if dtype is not None else None
    if adapter is None:
        if base is None:
            raise ValueError(
                "the fp8 export needs --base (a HF checkpoint) or --adapter (a run to merge first)"
            )
        summary = export_fp8(base, out, dtype=code, overwrite=overwrite, progress=progress)
        return {**summary, "adapter": None}
    refuse_existing(out, overwrite=overwrite)  # before the merge, not after it
    with scratch_dir(out) as scratch:
        merged = export(
            adapter, scratch / "merged", base=base, fmt="merged", progress=progress, base_quant=base_quant
        )
        summary = export_fp8(scratch / "merged", out, dtype=code, overwrite=overwrite, progress=progress)
    return {**summary, "source": merged["source"], "adapter": merged["adapter"], "base": merged["base"]}


def _export_gguf(
    adapter: str | Path | None,
    out: Path,
    *,
    base: str | Path | None,
    merged: bool,
    options: dict[str, Any],
    overwrite: bool,
    progress: bool,
    base_quant: str | None = None,
) -> dict[str, Any]:
    """GGUF files of `base` (no adapter); of base + adapter merged in a scratch directory first
    (`merged`); or the adapter alone as a llama.cpp LoRA GGUF (written from its peft export)."""
    if adapter is None:
        if merged:
            raise ValueError("--merged needs --adapter (the run to merge into --base)")
        if base is None:
            raise ValueError("the gguf export needs --base (a HF checkpoint) or --adapter (a run)")
        return {**export_gguf(base, out, overwrite=overwrite, progress=progress, **options), "adapter": None}
    refuse_existing(out, overwrite=overwrite)
    if merged:
        with scratch_dir(out) as scratch:
            m = export(
                adapter, scratch / "merged", base=base, fmt="merged", progress=progress, base_quant=base_quant
            )
            summary = export_gguf(
                scratch / "merged", out, overwrite=overwrite, progress=progress,
                name=options.pop("name", None) or Path(m["base"]).name + "-merged", **options,
            )  # fmt: skip
        return {**summary, "source": m["source"], "adapter": m["adapter"], "base": m["base"]}
    if set(options) - {"name"}:
        raise ValueError(
            f"{', '.join(sorted(set(options) - {'name'}))}: options of the model's GGUF files; the adapter GGUF "
            "is float32 LoRA factors (give --merged to export base + adapter as quantized GGUF files)"
        )
    with scratch_dir(out) as scratch:
        p = export(adapter, scratch / "peft", base=base, fmt="peft", progress=progress)
        cfg = read_config(p["base"])
        name = options.get("name") or f"{Path(p['adapter']).name}-lora"
        with atomic_dir(out, overwrite=overwrite) as tmp:
            info = write_adapter_gguf(scratch / "peft", cfg, tmp / f"{name}-F32.gguf", name=name)
    return {
        "source": p["source"], "adapter": p["adapter"], "base": p["base"], "format": "gguf-lora",
        "output": str(out), "file": Path(info["file"]).name, "rank": info["rank"], "alpha": info["alpha"],
        "modules": info["modules"], "bytes": info["bytes"],
    }  # fmt: skip


def _load_trainer_checkpoint(path: Path) -> tuple[nnx.State, Any, dict[str, Any]]:
    try:
        from jaxpi.train.checkpoint import load_adapter
    except ImportError as e:
        raise ValueError(
            f"{path}: not a peft adapter directory (no adapter_config.json), and jaxpi trainer checkpoints "
            f"cannot be read here ({e})"
        ) from None
    return load_adapter(path)


def _load_dtype(base: Path, dtype: str | None) -> str:
    """Load the base in bfloat16 only when that loses nothing: every weight BF16 and a bf16 output
    (the merge itself is computed in float32 and rounded once to the stored dtype)."""
    codes = {
        info.dtype
        for name, info in read_index(base).items()
        if not name.startswith(("model.visual.", "mtp."))
    }
    return "bfloat16" if codes == {"BF16"} and dtype in (None, "bfloat16") else "float32"

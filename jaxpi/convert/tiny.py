"""Tiny random checkpoints built by `transformers` itself: `jaxpi tiny-checkpoint`, the SFT
trainer's `tiny-random` base, the demo, the benchmarks and the tests.

Each family's CausalLM comes from its own `transformers` classes (`HF_CLASSES`) and its tiny
config (`TINY_CONFIGS`): Qwen3.5 (`Qwen3_5ForCausalLM`) and Qwen3 dense (`Qwen3ForCausalLM`).

Every parameter is randomised, norms included: with HF's initial values (zero-centred norms at 0,
the gated norm at 1) a backward bug that drops or doubles the norm weight would be invisible.
torch and transformers are imported only when a checkpoint is built.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.config import QWEN3_TINY, TINY, QwenConfig
from jaxpi.convert.safetensors_io import CODES, PlannedTensor, read_index, read_raw, write_file
from jaxpi.convert.table import mtp_shapes
from jaxpi.data.tiny_tokenizer import ASSETS, VOCAB_SIZE

# Each family's `transformers` text config and CausalLM classes (by name: imported when a
# checkpoint is built), and its tiny config.
HF_CLASSES: dict[str, tuple[str, str]] = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY_CONFIGS: dict[str, QwenConfig] = {"qwen3_5": TINY, "qwen3": QWEN3_TINY}


def tiny_config(family: str) -> QwenConfig:
    """The tiny config of a family (a key of `jaxpi.config.FAMILIES`)."""
    try:
        return TINY_CONFIGS[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(TINY_CONFIGS)}") from None


def _hf_class(cfg: QwenConfig, which: int) -> Any:
    import transformers

    return getattr(transformers, HF_CLASSES[cfg.family][which])


def hf_text_config(cfg: QwenConfig, dtype: str = "float32") -> Any:
    """The family's `transformers` text config for `cfg` (eager attention, fp32 unless asked)."""
    hf = _hf_class(cfg, 0)(
        **{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")}
    )
    hf._attn_implementation = "eager"
    hf.dtype = dtype
    return hf


def randomize_(model: Any, seed: int, std: float = 0.05, norm_center: float = 0.0) -> None:
    """Fill every parameter of a torch model with seeded noise (A_log, dt_bias and norms included);
    norms about `norm_center` (0 for zero-centred norms, 1 for plain ones)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(noise * 0.5 + 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif "norm" in name:
                p.copy_(norm_center + 0.2 * noise)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(std * noise)


def make_causal_lm(cfg: QwenConfig = TINY, seed: int = 0, dtype: str = "float32") -> Any:
    """A random CausalLM of `cfg`'s family (torch, eval mode)."""
    import torch

    torch.manual_seed(seed)
    model = _hf_class(cfg, 1)(hf_text_config(cfg, dtype)).to(getattr(torch, dtype)).eval()
    randomize_(model, seed, norm_center=1.0 - cfg.norm_offset)
    return model


def make_checkpoint(
    out_dir: str | os.PathLike,
    cfg: QwenConfig = TINY,
    *,
    kind: str = "causal",
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: bool = False,
) -> Path:
    """Write a random checkpoint with `save_pretrained`.

    kind "causal": `Qwen3_5ForCausalLM`. kind "conditional": `Qwen3_5ForConditionalGeneration`
    with a tiny vision tower, plus MTP-head tensors (`mtp.*`, which `transformers` does not model
    but real checkpoints carry) appended to the weights, so converters must carry both through.
    tokenizer: also copy the bundled tiny tokenizer (512 ids, with its chat template) into the
    directory, as a released checkpoint ships its own; needs `cfg.vocab_size >= 512`.
    """
    import torch

    out = Path(out_dir)
    if tokenizer:
        _copy_tiny_tokenizer(out, cfg)
    if kind == "causal":
        model = make_causal_lm(cfg, seed, dtype)
        model.save_pretrained(out, safe_serialization=True)
        return out
    if kind != "conditional":
        raise ValueError(f"kind must be 'causal' or 'conditional', not {kind!r}")
    if cfg.family != "qwen3_5":
        raise ValueError(f"kind 'conditional' is a Qwen3.5 checkpoint; family {cfg.family!r} has none")
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {k: v for k, v in cfg.to_hf().items() if k != "architectures"}
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": cfg.hidden_size,
        "num_position_embeddings": 16,
    }
    hf_cfg = Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=cfg.tie_word_embeddings
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(hf_cfg).to(getattr(torch, dtype)).eval()
    randomize_(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    _append_mtp(out, cfg, seed)
    return out


_TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 16,
}


def make_hf_checkpoint(
    out_dir: str | os.PathLike,
    text_config: dict[str, Any],
    *,
    kind: str = "causal",
    tie: bool = False,
    weights: str = "init",
    strong_decay: bool = False,
    seed: int = 0,
) -> Path:
    """A checkpoint from a raw text config (as config.json holds it), built by `transformers`.

    weights "init": transformers' own initialisation (the pad row zero, A_log = log U(0, 16),
    norms at their identity), then every norm weight, A_log and dt_bias moved by 0.1·N(0, 1) so no
    parameter sits at its init; "random": every weight random (`randomize_`). strong_decay: A_log
    ~ U(1, 3) and dt_bias ~ U(1, 4), per-token decays g of −10 to −80, the regime where a state is
    erased within a token. kind "conditional": a `Qwen3_5ForConditionalGeneration` with a tiny
    vision tower and MTP tensors, tied by its top-level flag as transformers ties it.
    """
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    if weights not in ("init", "random"):
        raise ValueError(f"weights must be 'init' or 'random', not {weights!r}")
    out = Path(out_dir)
    torch.manual_seed(seed)
    if kind == "causal":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config, tie_word_embeddings=tie))
    elif kind == "conditional":
        vision = {**_TINY_VISION, "out_hidden_size": text_config["hidden_size"]}
        hf = Qwen3_5Config(text_config=dict(text_config), vision_config=vision, tie_word_embeddings=tie)
        model = Qwen3_5ForConditionalGeneration(hf)
    else:
        raise ValueError(f"kind must be 'causal' or 'conditional', not {kind!r}")
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        if weights == "random":
            randomize_(model, seed)
        for name, p in model.named_parameters():
            if weights == "init" and ("norm" in name or name.endswith(("A_log", "dt_bias"))):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            if strong_decay and name.endswith("A_log"):
                p.copy_(1.0 + 2.0 * torch.rand(p.shape, generator=gen))
            if strong_decay and name.endswith("dt_bias"):
                p.copy_(1.0 + 3.0 * torch.rand(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    if kind == "conditional":
        _append_mtp(out, QwenConfig.from_hf(out), seed)
    return out


def _copy_tiny_tokenizer(out: Path, cfg: QwenConfig) -> None:
    if cfg.vocab_size < VOCAB_SIZE:
        raise ValueError(f"the tiny tokenizer has {VOCAB_SIZE} ids; vocab_size {cfg.vocab_size} is too small")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted((ASSETS / "tiny_tokenizer").iterdir()):
        shutil.copyfile(f, out / f.name)


def _append_mtp(out: Path, cfg: QwenConfig, seed: int) -> None:
    """Add the MTP head's 15 `mtp.*` tensors (bf16, as released checkpoints store them) to the single shard."""
    import ml_dtypes

    rng = np.random.default_rng(seed + 1)
    extra = mtp_shapes(cfg)
    index = read_index(out)
    planned = [PlannedTensor(n, i.dtype, i.shape, lambda i=i: read_raw(i)) for n, i in sorted(index.items())]
    for name, shape in extra.items():
        arr = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        planned.append(PlannedTensor(name, CODES[arr.dtype], shape, lambda a=arr: a.tobytes()))
    files = sorted({i.file for i in index.values()})
    if len(files) != 1:
        raise AssertionError("tiny fixture expected in one shard")
    tmp = files[0].with_suffix(".tmp")
    write_file(tmp, planned)
    os.replace(tmp, files[0])
    index_json = out / "model.safetensors.index.json"
    if index_json.exists():  # pragma: no cover - transformers writes one file for tiny models
        data = json.loads(index_json.read_text())
        data["weight_map"].update({n: files[0].name for n in extra})
        index_json.write_text(json.dumps(data, indent=2))

"""Adapters out to the peft format (`save_peft`) and merged into a full HF checkpoint (`save_merged`).
Both write atomically (`jaxpi.atomic.atomic_dir`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxpi.atomic import atomic_dir
from jaxpi.config import QwenConfig
from jaxpi.convert.hf import save_hf
from jaxpi.convert.safetensors_io import DTYPES, PlannedTensor, write_file
from jaxpi.lora.adapters import adapter_module
from jaxpi.lora.config import HF_BLOCK, TARGETS, LoraConfig, module_paths, select_modules
from jaxpi.lora.merge import merge_lora, merged_state
from jaxpi.lora.peft.names import CONFIG_NAME, PEFT_VERSION, WEIGHTS_NAME, base_prefix, dtype_code, peft_key
from jaxpi.models.adapters import a_name, b_name, mask_name
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM


def _module_ab(model: Qwen3_5ForCausalLM, layer: int, hf: str) -> tuple[np.ndarray, np.ndarray]:
    """One HF module's adapter in torch layout: A `[r, in]`, B `[out, r]` (float32, host)."""
    module, row = adapter_module(model, layer, hf)
    mask = getattr(module, mask_name(hf), None)
    if getattr(module, a_name(hf), None) is None or (mask is not None and not mask.get_value()[row]):
        raise ValueError(
            f"layer {layer} {hf}: the model has no adapter there (LoraConfig and model disagree)"
        )

    def take(attr: str) -> np.ndarray:
        v = getattr(module, attr).get_value()
        return np.asarray(v if row is None else v[row], np.float32)

    a = take(a_name(hf))  # [*in, r]
    a_t = a.reshape(-1, a.shape[-1]).T  # [r, in]
    bs = [take(b_name(p)) for p in TARGETS[hf][1]]  # each [r, *out_part]
    b_t = np.concatenate([b.reshape(b.shape[0], -1) for b in bs], axis=1).T  # [out, r], parts in HF order
    return np.ascontiguousarray(a_t), np.ascontiguousarray(b_t)


def adapter_tensors(model: Qwen3_5ForCausalLM, lora_cfg: LoraConfig, prefix: str) -> dict[str, np.ndarray]:
    """Every selected module's `lora_A` / `lora_B` under its peft name (float32, torch layout)."""
    out = {}
    for layer, hf in select_modules(model.cfg, lora_cfg):
        a, b = _module_ab(model, layer, hf)
        if a.shape[0] != lora_cfg.rank:
            raise ValueError(
                f"layer {layer} {hf}: adapter rank {a.shape[0]}, LoraConfig says {lora_cfg.rank}"
            )
        out[peft_key(prefix, layer, hf, "A")] = a
        out[peft_key(prefix, layer, hf, "B")] = b
    return out


def target_modules(cfg: QwenConfig, lora_cfg: LoraConfig, prefix: str) -> list[str] | str:
    """peft's `target_modules` selecting exactly the adapted modules of the HF model.

    A plain list of module names (what people usually write) when each named
    module is adapted in every layer that has it; otherwise a regex peft fullmatches against
    module paths, anchored at the text model's prefix so that nothing outside it (the vision
    tower, which has no modules of these names today) can ever match.
    """
    chosen = select_modules(cfg, lora_cfg)
    everywhere = {(i, hf) for i, hf, _ in module_paths(cfg) if hf in {h for _, h in chosen}}
    if set(chosen) == everywhere:
        return sorted({hf for _, hf in chosen})
    by_layers: dict[tuple[str, ...], list[int]] = {}
    per_layer: dict[int, list[str]] = {}
    for i, hf in chosen:
        per_layer.setdefault(i, []).append(f"{HF_BLOCK[TARGETS[hf][0]]}\\.{hf}")
    for i, mods in per_layer.items():
        by_layers.setdefault(tuple(sorted(mods)), []).append(i)
    alts = [f"(?:{'|'.join(map(str, ls))})\\.(?:{'|'.join(mods)})" for mods, ls in by_layers.items()]
    return f"{re.escape(prefix)}layers\\.(?:{'|'.join(alts)})"


def adapter_config(
    cfg: QwenConfig, lora_cfg: LoraConfig, prefix: str, base_model_name_or_path: str | None
) -> dict[str, Any]:
    """`adapter_config.json` with the fields (and defaults) peft 0.21.2 writes for a LoRA."""
    alpha = lora_cfg.alpha
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_bias": False,
        "lora_dropout": lora_cfg.dropout,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": lora_cfg.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": target_modules(cfg, lora_cfg, prefix),
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": False,
        "velora_config": None,
    }


def save_peft(
    model: Qwen3_5ForCausalLM,
    lora_cfg: LoraConfig,
    out_dir: str | os.PathLike,
    *,
    base_dir: str | os.PathLike,
    dtype: str = "float32",
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the model's adapters as a peft LoRA adapter for the base checkpoint `base_dir`.

    Names follow `base_dir`'s architecture (see the module docstring); `dtype` ("float32",
    "bfloat16", "float16") is the stored precision of A and B. `base_model_name_or_path` goes
    into the config (default: `base_dir`), which is what `PeftModel.from_pretrained` and vLLM
    read to find the base model.
    """
    code = dtype_code(dtype)
    base_cfg = QwenConfig.from_hf(Path(base_dir))
    _check_same_shape(model.cfg, base_cfg, base_dir)
    prefix = base_prefix(base_dir)
    tensors = adapter_tensors(model, lora_cfg, prefix)
    planned = [
        PlannedTensor(name, code, arr.shape, lambda a=arr: np.ascontiguousarray(a.astype(DTYPES[code])))
        for name, arr in sorted(tensors.items())
    ]
    config = adapter_config(model.cfg, lora_cfg, prefix, base_model_name_or_path or str(base_dir))

    out = Path(out_dir)
    with atomic_dir(out, overwrite=overwrite) as tmp:  # umask permissions, a killed run's leftovers cleaned
        write_file(tmp / WEIGHTS_NAME, planned)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def save_merged(
    model: Qwen3_5ForCausalLM,
    out_dir: str | os.PathLike,
    *,
    base_dir: str | os.PathLike,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    inplace: bool = False,
) -> Path:
    """Merge the adapters into the base weights and write a full HF checkpoint with the base's
    architecture and layout (`save_hf(source=base_dir)`: vision/MTP tensors and tokenizer files
    carried over, each tensor in the base's dtype unless `dtype` is given).

    By default `model` is left as it was (the pure merge, `jaxpi.lora.merged_params`, gives new
    arrays for the adapted weights only, written from a model that shares the rest); `inplace=True`
    merges `model` itself (`merge_lora`) and needs no extra memory.
    """
    if inplace:
        merged = merge_lora(model)
    else:
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        merged = nnx.merge(graphdef, merged_state(model), rest)
    return save_hf(merged, out_dir, source=base_dir, dtype=dtype, overwrite=overwrite, progress=progress)


def _check_same_shape(cfg: QwenConfig, base: QwenConfig, base_dir: Any) -> None:
    fields = (
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
        "layer_types",
    )
    diff = [f for f in fields if getattr(cfg, f) != getattr(base, f)]
    if diff:
        f = diff[0]
        raise ValueError(
            f"the model does not match the base checkpoint {base_dir}: {f} is {getattr(cfg, f)!r} here, "
            f"{getattr(base, f)!r} in its config.json"
        )

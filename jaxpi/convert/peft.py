"""LoRA adapters out to (and back from) the `peft` format, and merged HF exports.

A `peft` LoRA adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`.
Its tensor names are the HF module paths under peft's wrapper, which differ by architecture:

    Qwen3_5ForCausalLM                base_model.model.model.layers.N.<block>.<module>.lora_A.weight
    Qwen3_5ForConditionalGeneration   base_model.model.model.language_model.layers.N.<block>.<module>...

(`<block>` is `self_attn`, `linear_attn` or `mlp`). vLLM silently ignores adapter tensors whose
names do not match its modules, so the prefix is taken from the base checkpoint's `config.json`.
Layouts are torch's: `lora_A.weight` `[r, in]`, `lora_B.weight` `[out, r]`, with our multi-axis
inputs/outputs (heads × head_dim) flattened in HF's row-major order; the fused `in_proj_qkv` has
`lora_B = concat(B_q, B_k, B_v)` along `out`, HF's [q | k | v] channel order.

`save_peft` and `save_merged` write atomically (a temporary directory renamed into place).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, overload

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.atomic import atomic_dir
from jaxpi.config import QwenConfig
from jaxpi.convert.hf import save_hf
from jaxpi.convert.safetensors_io import (
    CODES,
    DTYPES,
    CheckpointError,
    PlannedTensor,
    read_array,
    read_header,
    write_file,
)
from jaxpi.lora import (
    HF_BLOCK,
    TARGETS,
    LoraConfig,
    LoRAMask,
    LoRAParam,
    a_name,
    adapter_module,
    add_lora,
    b_name,
    mask_name,
    merge_lora,
    module_paths,
    select_modules,
)
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM

PEFT_VERSION = "0.21.2"  # the peft release whose adapter_config.json fields we write
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
CAUSAL_PREFIX = "model."
CONDITIONAL_PREFIX = "model.language_model."
_KEY = re.compile(
    r"base_model\.model\.(model\.(?:language_model\.)?)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight"
)


# ---- names and layouts --------------------------------------------------------------------------
def base_prefix(base_dir: str | os.PathLike) -> str:
    """The text model's module prefix in the base checkpoint: "model." (`Qwen3_5ForCausalLM`) or
    "model.language_model." (`Qwen3_5ForConditionalGeneration`), from its `config.json`."""
    raw = _read_json(Path(base_dir) / "config.json")
    archs = raw.get("architectures") or []
    conditional = "text_config" in raw or any("ConditionalGeneration" in a for a in archs)
    return CONDITIONAL_PREFIX if conditional else CAUSAL_PREFIX


def peft_key(prefix: str, layer: int, hf: str, which: str) -> str:
    """`base_model.model.<prefix>layers.<layer>.<block>.<hf>.lora_<which>.weight`."""
    block = HF_BLOCK[TARGETS[hf][0]]
    return f"base_model.model.{prefix}layers.{layer}.{block}.{hf}.lora_{which}.weight"


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


# ---- export -------------------------------------------------------------------------------------
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
    code = _code(dtype)
    base_cfg = QwenConfig.from_hf(Path(base_dir))
    _check_same_shape(model.cfg, base_cfg, base_dir)
    prefix = base_prefix(base_dir)
    tensors = adapter_tensors(model, lora_cfg, prefix)
    planned = [
        PlannedTensor(name, code, arr.shape, lambda a=arr: np.ascontiguousarray(a.astype(DTYPES[code])))
        for name, arr in sorted(tensors.items())
    ]
    config = adapter_config(model.cfg, lora_cfg, prefix, base_model_name_or_path or str(base_dir))

    def write(tmp: Path) -> None:
        write_file(tmp / WEIGHTS_NAME, planned)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return _atomic_dir(Path(out_dir), write, overwrite)


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

    By default `model` is left as it was (the merge happens on a clone: new arrays for the adapted
    weights only); `inplace=True` merges `model` itself and needs no extra memory.
    """
    merged = merge_lora(model if inplace else nnx.clone(model))
    return save_hf(merged, out_dir, source=base_dir, dtype=dtype, overwrite=overwrite, progress=progress)


# ---- import -------------------------------------------------------------------------------------
def read_peft(
    adapter_dir: str | os.PathLike, cfg: QwenConfig
) -> tuple[LoraConfig, dict[tuple[int, str], tuple]]:
    """Validate a peft LoRA adapter against a model config.

    Returns the `LoraConfig` it amounts to and `{(layer, module): (A [r, in], B [out, r])}`.
    Keys outside the text model's linear layers, modules `target_modules` selects but the file
    lacks, modules the file has but `target_modules` does not select, and mis-shaped tensors are
    `CheckpointError`s that name the key.
    """
    adapter_dir = Path(adapter_dir)
    raw = _read_json(adapter_dir / CONFIG_NAME)
    _check_supported(raw, adapter_dir / CONFIG_NAME)
    weights = adapter_dir / WEIGHTS_NAME
    if not weights.exists():
        raise CheckpointError(f"{weights}: no such file (a peft LoRA adapter stores its tensors there)")
    infos = {i.name: i for i in read_header(weights)}
    rank = int(raw["r"])
    prefixes = {m.group(1) for k in infos if (m := _KEY.fullmatch(k))}
    if len(prefixes) > 1:
        raise CheckpointError(f"{weights}: keys mix the prefixes {sorted(prefixes)}")
    prefix = prefixes.pop() if prefixes else CAUSAL_PREFIX
    shapes = _hf_shapes(cfg)

    # What target_modules selects among the text model's modules, by peft's own matching rules.
    layers_to_transform = raw.get("layers_to_transform")
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]
    expected = {
        (i, hf)
        for i, hf, path in module_paths(cfg)
        if _peft_matches(raw["target_modules"], prefix + path)
        and (layers_to_transform is None or i in layers_to_transform)
    }
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, info in sorted(infos.items()):
        m = _KEY.fullmatch(name)
        if (
            m is None
            or (int(m.group(2)), m.group(4)) not in shapes
            or m.group(3) != HF_BLOCK[TARGETS[m.group(4)][0]]
        ):
            raise CheckpointError(
                f"unexpected key {name!r} in {weights}: not the lora_A/lora_B of a linear layer of the "
                f"{cfg.num_hidden_layers}-layer Qwen3.5 text model (expected e.g. "
                f"{peft_key(prefix, 0, module_paths(cfg)[0][1], 'A')!r})"
            )
        layer, hf, which = int(m.group(2)), m.group(4), m.group(5)
        if (layer, hf) not in expected:
            raise CheckpointError(
                f"unexpected key {name!r} in {weights}: adapter_config.json's target_modules "
                f"{raw['target_modules']!r} does not select this module"
            )
        n_out, n_in = shapes[(layer, hf)]
        want = (rank, n_in) if which == "A" else (n_out, rank)
        if tuple(info.shape) != want:
            raise CheckpointError(
                f"tensor {name!r} has shape {list(info.shape)}, expected {list(want)} (r={rank})"
            )
        found.setdefault((layer, hf), {})[which] = np.asarray(read_array(info), np.float32)
    for layer, hf in sorted(expected):
        for which in "AB":
            if which not in found.get((layer, hf), {}):
                key = peft_key(prefix, layer, hf, which)
                raise CheckpointError(
                    f"missing key {key!r} in {weights}: target_modules {raw['target_modules']!r} selects "
                    f"this module, expected shape {list(_want(shapes[(layer, hf)], rank, which))}"
                )
    chosen = sorted(found)
    names = tuple(hf for hf in TARGETS if any(h == hf for _, h in chosen))
    # The simplest LoraConfig that selects exactly these modules: names, then layers, then a regex.
    layers = sorted({i for i, _ in chosen})
    by_layers = {(i, hf) for i, hf, _ in module_paths(cfg) if hf in names and i in layers}
    exact = "|".join(re.escape(f"layers.{i}.{HF_BLOCK[TARGETS[hf][0]]}.{hf}") for i, hf in chosen)
    lcfg = LoraConfig(
        rank=rank,
        alpha=float(raw["lora_alpha"]),
        dropout=float(raw.get("lora_dropout") or 0.0),
        targets=names,
        layers=None if _everywhere(cfg, chosen) or set(chosen) != by_layers else tuple(layers),
        pattern=None if set(chosen) == by_layers else f"(?:{exact})",
    )
    return lcfg, {k: (v["A"], v["B"]) for k, v in found.items()}


@overload
def load_peft(model_or_cfg: Qwen3_5ForCausalLM, adapter_dir: str | os.PathLike) -> Qwen3_5ForCausalLM: ...
@overload
def load_peft(model_or_cfg: QwenConfig, adapter_dir: str | os.PathLike) -> tuple[LoraConfig, nnx.State]: ...
def load_peft(
    model_or_cfg: Qwen3_5ForCausalLM | QwenConfig, adapter_dir: str | os.PathLike
) -> Qwen3_5ForCausalLM | tuple[LoraConfig, nnx.State]:
    """Read a peft LoRA adapter into jaxpi.

    Given a model: attaches adapters (or fills the ones it has, which must be the same selection
    and scale) with the adapter's values, in place, and returns the model. Given a `QwenConfig`:
    returns `(lora_cfg, state)`, the `nnx.State` of `LoRAParam`s that `nnx.update` puts into a
    model of that config after `add_lora(model, lora_cfg)`.
    """
    if isinstance(model_or_cfg, QwenConfig):
        lcfg, tensors = read_peft(adapter_dir, model_or_cfg)
        model = abstract_lora_model(model_or_cfg, lcfg)
        _fill(model, tensors)
        return lcfg, nnx.state(model, LoRAParam)
    model = model_or_cfg
    lcfg, tensors = read_peft(adapter_dir, model.cfg)
    have = getattr(model, "lora_config", None)
    if have is None:
        add_lora(model, lcfg)
    elif set(select_modules(model.cfg, have)) != set(tensors) or (have.rank, have.scale) != (
        lcfg.rank,
        lcfg.scale,
    ):
        raise ValueError(
            f"the model's adapters ({have}) differ from the adapter in {adapter_dir} ({lcfg}): "
            "load it into a model without adapters"
        )
    else:
        lcfg = have
    _fill(model, tensors)
    model.lora_config = lcfg
    return model


def abstract_lora_model(cfg: QwenConfig, lora_cfg: LoraConfig) -> Qwen3_5ForCausalLM:
    """A model whose base weights are abstract (nothing allocated) and whose adapters are zeros:
    enough to hold, move and export an adapter without the base."""
    model = nnx.eval_shape(lambda: add_lora(Qwen3_5ForCausalLM(cfg, rngs=nnx.Rngs(0)), lora_cfg))
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.zeros(var.get_value().shape, jnp.float32))
    _materialize_masks(model, cfg, lora_cfg)
    return model


def _materialize_masks(model: Qwen3_5ForCausalLM, cfg: QwenConfig, lora_cfg: LoraConfig) -> None:
    """Give the abstract model's `LoRAMask`s their values (which groups' layers are selected)."""
    chosen = set(select_modules(cfg, lora_cfg))
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAMask)):
        pos, hf = int(path[2]), str(path[-1]).removeprefix("lora_mask_")
        p = len(model.groups.blocks)
        g = var.get_value().shape[0]
        var.set_value(jnp.asarray([(k * p + pos, hf) in chosen for k in range(g)], jnp.float32))


def _fill(model: Qwen3_5ForCausalLM, tensors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> None:
    """Write torch-layout A/B pairs into the model's adapters (stacked rows gathered on the host)."""
    bufs: dict[int, tuple[nnx.Variable, np.ndarray]] = {}

    def buf(var: nnx.Variable) -> np.ndarray:
        if id(var) not in bufs:
            bufs[id(var)] = (var, np.array(var.get_value(), np.float32))
        return bufs[id(var)][1]

    for (layer, hf), (a_t, b_t) in tensors.items():
        module, row = adapter_module(model, layer, hf)
        a_var = getattr(module, a_name(hf))
        a = buf(a_var)
        dst = a if row is None else a[row]
        dst[...] = a_t.T.reshape(dst.shape)  # [r, in] -> [*in, r]
        start = 0
        for proj in TARGETS[hf][1]:
            b = buf(getattr(module, b_name(proj)))
            dst = b if row is None else b[row]
            n = int(np.prod(dst.shape[1:]))
            dst[...] = b_t[start : start + n].T.reshape(dst.shape)  # rows of [out, r] -> [r, *out_part]
            start += n
    for var, arr in bufs.values():
        var.set_value(jnp.asarray(arr))


# ---- helpers ------------------------------------------------------------------------------------
def _peft_matches(target_modules: list[str] | str | None, name: str) -> bool:
    """peft's rule: a string is a regex fullmatched against the module path; a list matches a
    module whose path equals an entry or ends with "." + entry."""
    if target_modules is None:
        return False
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _hf_shapes(cfg: QwenConfig) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> the HF Linear's (out, in)."""
    from jaxpi.convert.table import text_rules

    out = {}
    for rule in text_rules(cfg, ""):
        m = re.fullmatch(r"layers\.(\d+)\.\w+\.(\w+)\.weight", rule.hf)
        if m and m.group(2) in TARGETS:
            out[(int(m.group(1)), m.group(2))] = rule.hf_shape
    return out


def _want(out_in: tuple[int, int], rank: int, which: str) -> tuple[int, int]:
    return (rank, out_in[1]) if which == "A" else (out_in[0], rank)


def _everywhere(cfg: QwenConfig, chosen: list[tuple[int, str]]) -> bool:
    names = {hf for _, hf in chosen}
    return set(chosen) == {(i, hf) for i, hf, _ in module_paths(cfg) if hf in names}


def _check_supported(raw: dict[str, Any], where: Path) -> None:
    if raw.get("peft_type") != "LORA":
        raise CheckpointError(
            f"{where}: peft_type {raw.get('peft_type')!r}, only 'LORA' adapters are supported"
        )
    for field in ("r", "lora_alpha", "target_modules"):
        if raw.get(field) is None:
            raise CheckpointError(f"{where}: missing field {field!r}")
    unsupported = {
        "use_rslora": bool(raw.get("use_rslora")),
        "use_dora": bool(raw.get("use_dora")),
        "rank_pattern": bool(raw.get("rank_pattern")),
        "alpha_pattern": bool(raw.get("alpha_pattern")),
        "modules_to_save": bool(raw.get("modules_to_save")),
        "bias": raw.get("bias", "none") != "none",
        "fan_in_fan_out": bool(raw.get("fan_in_fan_out")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise CheckpointError(
            f"{where}: {', '.join(f'{k}={raw.get(k)!r}' for k in bad)} not supported by jaxpi"
        )


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


def _code(dtype: str) -> str:
    code = CODES.get(np.dtype(jnp.dtype(dtype)))
    if code not in ("F32", "BF16", "F16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', not {dtype!r}")
    return code


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _atomic_dir(out: Path, write: Any, overwrite: bool) -> Path:
    """Run `write(tmp)` on a fresh temporary directory beside `out`, then rename it into place
    (`jaxpi.atomic.atomic_dir`: umask permissions, leftovers of killed runs cleaned)."""
    with atomic_dir(out, overwrite=overwrite) as tmp:
        write(tmp)
    return out


__all__ = [
    "adapter_config",
    "adapter_tensors",
    "base_prefix",
    "load_peft",
    "peft_key",
    "read_peft",
    "save_merged",
    "save_peft",
    "target_modules",
]

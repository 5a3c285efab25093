"""A peft LoRA adapter into jaxpi: validated against a model config (`read_peft`), attached to a
model or returned as a state (`load_peft`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, overload

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.config import QwenConfig
from jaxpi.convert.safetensors_io import CheckpointError, read_array, read_header
from jaxpi.convert.table import text_rules
from jaxpi.lora.adapters import LoRAMask, LoRAParam, adapter_module, add_lora
from jaxpi.lora.config import HF_BLOCK, TARGETS, LoraConfig, module_paths, select_modules
from jaxpi.lora.peft.names import CAUSAL_PREFIX, CONFIG_NAME, KEY, WEIGHTS_NAME, peft_key, read_json
from jaxpi.models.adapters import a_name, b_name, parse_slot
from jaxpi.models.families import model_class
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM


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
    raw = read_json(adapter_dir / CONFIG_NAME)
    _check_supported(raw, adapter_dir / CONFIG_NAME)
    weights = adapter_dir / WEIGHTS_NAME
    if not weights.exists():
        raise CheckpointError(f"{weights}: no such file (a peft LoRA adapter stores its tensors there)")
    infos = {i.name: i for i in read_header(weights)}
    rank = int(raw["r"])
    prefixes = {m.group(1) for k in infos if (m := KEY.fullmatch(k))}
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
        m = KEY.fullmatch(name)
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
    model = nnx.eval_shape(lambda: add_lora(model_class(cfg)(cfg, rngs=nnx.Rngs(0)), lora_cfg))
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.zeros(var.get_value().shape, jnp.float32))
    _materialize_masks(model, cfg, lora_cfg)
    return model


def _materialize_masks(model: Qwen3_5ForCausalLM, cfg: QwenConfig, lora_cfg: LoraConfig) -> None:
    """Give the abstract model's `LoRAMask`s their values (which groups' layers are selected)."""
    chosen = set(select_modules(cfg, lora_cfg))
    for path, var in nnx.to_flat_state(nnx.state(model, LoRAMask)):
        pos, (_, hf) = int(path[2]), parse_slot(str(path[-1]))
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

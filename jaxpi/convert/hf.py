"""HF safetensors checkpoints in and out: `load_hf` and `save_hf`.

Loading streams one HF tensor at a time into our parameters (stacked layer groups are assembled
slice by slice into one host buffer, then placed on their sharding), so host memory peaks at about
the largest jaxpi parameter plus one HF tensor, never the whole model. Saving streams the other way
into ≤ 5 GB shards written to a temporary directory that is renamed into place at the end: an
interrupted save never leaves a directory that looks complete. Tensors the text model does not own
(the vision tower `model.visual.*`, the MTP head `mtp.*`) are carried from `source` byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpi.config import QwenConfig
from jaxpi.convert.safetensors_io import (
    CODES,
    DTYPES,
    PlannedTensor,
    TensorInfo,
    read_array,
    read_index,
    read_raw,
    write_file,
)
from jaxpi.convert.table import Rule, stack_index, text_rules
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM

CARRIED_PREFIXES = ("model.visual.", "mtp.")
FLOAT_CODES = ("F32", "BF16", "F16")
MAX_SHARD_BYTES = 5 * 1024**3
# Everything in a checkpoint directory that is neither weights nor config travels with an export.
_NOT_COPIED = {"config.json", "model.safetensors.index.json"}

ShardingFn = Callable[[tuple, tuple], jax.sharding.Sharding]


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor and what was expected."""


def text_prefix(names: Any) -> str:
    """"model.language_model." for a `Qwen3_5ForConditionalGeneration` checkpoint, else "model."."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def check_checkpoint(cfg: QwenConfig, index: dict[str, TensorInfo]) -> tuple[list[Rule], list[str]]:
    """Validate names, shapes and dtypes; return the rules and the carried (untouched) names."""
    rules = text_rules(cfg, text_prefix(index))
    wanted = {r.hf for r in rules}
    missing = sorted(wanted - set(index))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more}: the config expects it but no file has it")
    carried = sorted(n for n in index if n not in wanted and n.startswith(CARRIED_PREFIXES))
    unexpected = sorted(n for n in index if n not in wanted and not n.startswith(CARRIED_PREFIXES))
    if cfg.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some writers store the tied copy; it is the embedding
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"unexpected tensor {unexpected[0]!r}{more}: not part of the Qwen3.5 text model described by "
            f"config.json, nor a carried vision/MTP tensor"
        )
    for r in rules:
        info = index[r.hf]
        if info.shape != r.hf_shape:
            raise CheckpointError(f"tensor {r.hf!r} has shape {list(info.shape)}, expected {list(r.hf_shape)}")
        if info.dtype not in FLOAT_CODES:
            raise CheckpointError(f"tensor {r.hf!r} has dtype {info.dtype}, expected one of {list(FLOAT_CODES)}")
    return rules, carried


def load_hf(
    path: str | os.PathLike,
    dtype: str | jnp.dtype = "float32",
    *,
    shardings: ShardingFn | None = None,
    config_overrides: dict[str, Any] | None = None,
    progress: bool = False,
) -> tuple[QwenConfig, Qwen3_5ForCausalLM]:
    """Load a HF Qwen3.5 checkpoint (CausalLM or ConditionalGeneration) into a jaxpi model.

    `shardings(path, logical_axes)` may return the `jax.sharding.Sharding` of each parameter
    (its path in the model state, its logical axes with "layers" first for stacked groups);
    each array is then built directly on its devices. `config_overrides` sets runtime fields of
    `QwenConfig` (e.g. `remat`, `gdn_chunk_size`).
    """
    path = Path(path)
    dtype = jnp.dtype(dtype)
    cfg = QwenConfig.from_hf(path)
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    index = read_index(path)
    rules, _ = check_checkpoint(cfg, index)
    abstract = nnx.eval_shape(lambda: Qwen3_5ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    by_path = {tuple(p): var for p, var in flat}
    sources = _sources_by_param(cfg, rules)
    if set(sources) != set(by_path):
        raise AssertionError(f"weight table and model disagree: {set(sources) ^ set(by_path)}")
    filled = []
    items = list(by_path.items())
    for p, var in tqdm(items, desc=f"loading {path.name}", disable=not progress, unit="param"):
        host = np.empty(var.get_value().shape, dtype=np.dtype(dtype))
        for rule, part, g in sources[p]:
            piece = rule.to_ours(read_array(index[rule.hf]))[part]
            if g is None:
                host[...] = piece
            else:
                host[g] = piece
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        filled.append((p, var.replace(_place(host, shardings(p, axes) if shardings else None))))
        del host
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    return cfg, model


def _place(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _sources_by_param(cfg: QwenConfig, rules: list[Rule]) -> dict[tuple, list[tuple[Rule, int, int | None]]]:
    """Our parameter path → [(rule, part index, group slice or None)]."""
    out: dict[tuple, list[tuple[Rule, int, int | None]]] = {}
    for rule in rules:
        g = stack_index(cfg, rule)
        for part, p in enumerate(rule.ours):
            out.setdefault(tuple(p), []).append((rule, part, g))
    return out


def save_hf(
    model: Qwen3_5ForCausalLM,
    out_dir: str | os.PathLike,
    *,
    source: str | os.PathLike | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write `model` as a HF checkpoint that `transformers` (and vLLM) load.

    With `source` (the checkpoint it came from), its config layout (CausalLM or
    ConditionalGeneration), tokenizer/generation files and every tensor the text model does not own
    are carried over, and each tensor keeps the source's dtype unless `dtype` is given ("float32",
    "bfloat16", "float16"). Without `source`, a `Qwen3_5ForCausalLM` checkpoint in the model's dtype.
    """
    cfg = model.cfg
    out = Path(out_dir)
    src = Path(source) if source is not None else None
    src_index = read_index(src) if src is not None else {}
    if src is not None:
        _, carried = check_checkpoint(cfg, src_index)
        prefix = text_prefix(src_index)
    else:
        carried, prefix = [], "model."
    rules = text_rules(cfg, prefix)
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {tuple(p): v.get_value() for p, v in state}

    def code_for(name: str, default: jnp.dtype) -> str:
        if dtype is not None:
            return CODES[np.dtype(jnp.dtype(dtype))]
        if name in src_index:
            return src_index[name].dtype
        return CODES[np.dtype(default)]

    planned: list[PlannedTensor] = []
    for rule in rules:
        g = stack_index(cfg, rule)
        code = code_for(rule.hf, params[tuple(rule.ours[0])].dtype)
        planned.append(PlannedTensor(rule.hf, code, rule.hf_shape, _producer(rule, params, g, code)))
    for name in carried:
        info = src_index[name]
        planned.append(PlannedTensor(name, info.dtype, info.shape, lambda info=info: read_raw(info)))

    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_shards(tmp, planned, max_shard_bytes, progress)
        (tmp / "config.json").write_text(json.dumps(_export_config(cfg, src, planned), indent=2) + "\n")
        if src is not None:
            for f in src.iterdir():
                if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(".safetensors"):
                    shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _producer(rule: Rule, params: dict[tuple, jax.Array], g: int | None, code: str) -> Callable[[], bytes]:
    def produce() -> bytes:
        parts = []
        for p in rule.ours:
            a = params[tuple(p)]
            parts.append(np.asarray(a[g] if g is not None else a))
        arr = rule.to_hf(parts).astype(DTYPES[code])
        return np.ascontiguousarray(arr).tobytes()

    return produce


def _shards(planned: list[PlannedTensor], max_bytes: int) -> Iterator[list[PlannedTensor]]:
    shard: list[PlannedTensor] = []
    size = 0
    for t in planned:
        if shard and size + t.nbytes > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append(t)
        size += t.nbytes
    if shard:
        yield shard


def _write_shards(tmp: Path, planned: list[PlannedTensor], max_bytes: int, progress: bool) -> None:
    shards = list(_shards(planned, max_bytes))
    total = sum(t.nbytes for t in planned)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="saving", disable=not progress)
    if len(shards) == 1:
        write_file(tmp / "model.safetensors", shards[0])
        bar.update(total)
        bar.close()
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_file(tmp / name, shard)
        weight_map.update({t.name: name for t in shard})
        bar.update(sum(t.nbytes for t in shard))
    bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _export_config(cfg: QwenConfig, src: Path | None, planned: list[PlannedTensor]) -> dict[str, Any]:
    text = cfg.to_hf()
    codes = {t.dtype for t in planned if not t.name.startswith(CARRIED_PREFIXES)}
    torch_dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[sorted(codes)[0]] if len(codes) == 1 else None
    if src is None:
        if torch_dtype:
            text["dtype"] = torch_dtype
        return text
    raw = json.loads((src / "config.json").read_text())
    if "text_config" in raw:
        inner = {k: v for k, v in text.items() if k != "architectures"}
        raw["text_config"] = {**raw["text_config"], **inner}
        raw["tie_word_embeddings"] = cfg.tie_word_embeddings
        if torch_dtype:
            raw["text_config"]["dtype"] = torch_dtype
        return raw
    merged = {**raw, **text}
    if torch_dtype:
        merged["dtype"] = torch_dtype
    return merged

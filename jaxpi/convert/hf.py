"""HF safetensors checkpoints in and out: `load_hf` and `save_hf`.

Loading streams one HF tensor at a time into our parameters (stacked layer groups are assembled
slice by slice into one host buffer, then placed on their sharding), so host memory peaks at about
the largest jaxpi parameter plus one HF tensor, never the whole model; on CPU the backend adopts
the host buffer as the parameter, leaving one HF tensor of overhead (docs/convert.md). Saving streams the other way
into ≤ 5 GB shards written to a temporary directory that is renamed into place at the end
(`jaxpi.atomic.atomic_dir`): an interrupted save never leaves a directory that looks complete,
the next save cleans what a killed one left, and the output gets the umask's permissions.
Tensors the text model does not own (the vision tower `model.visual.*`, the MTP head `mtp.*`)
are carried from `source` byte for byte.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpi.atomic import atomic_dir
from jaxpi.config import QwenConfig
from jaxpi.convert.quantize import QuantTarget, abstract_model, quant_targets
from jaxpi.convert.safetensors_io import (
    CODES,
    DTYPES,
    FLOAT_DTYPES,
    CheckpointError,
    PlannedTensor,
    TensorInfo,
    count_nonfinite,
    read_array,
    read_index,
    read_json,
    read_raw,
    write_file,
)
from jaxpi.convert.table import Rule, stack_index, text_rules
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.quant.stored import part_arrays, quantize_rows

CARRIED_PREFIXES = ("model.visual.", "mtp.")
FLOAT_CODES = ("F32", "BF16", "F16")
MAX_SHARD_BYTES = 5 * 1024**3
# Everything in a checkpoint directory that is neither weights nor config travels with an export.
NOT_COPIED = {"config.json", "model.safetensors.index.json"}
# Weights in any format are never copied: the export's own safetensors replace them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf", ".index.json")

ShardingFn = Callable[[tuple, tuple], jax.sharding.Sharding]


def text_prefix(names: Any) -> str:
    """ "model.language_model." for a `Qwen3_5ForConditionalGeneration` checkpoint, else "model."."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def check_checkpoint(cfg: QwenConfig, index: dict[str, TensorInfo]) -> tuple[list[Rule], list[str]]:
    """Validate names, shapes and dtypes; return the rules and the carried (untouched) names."""
    rules = text_rules(cfg, text_prefix(index))
    wanted = {r.hf for r in rules}
    missing = sorted(wanted - set(index))
    if missing:
        shape = next(list(r.hf_shape) for r in rules if r.hf == missing[0])
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"missing tensor {missing[0]!r}{more}: config.json expects shape {shape} "
            f"(dtype one of {list(FLOAT_CODES)}), found no such tensor"
        )
    carried = sorted(n for n in index if n not in wanted and n.startswith(CARRIED_PREFIXES))
    unexpected = sorted(n for n in index if n not in wanted and not n.startswith(CARRIED_PREFIXES))
    if cfg.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some writers store the tied copy; it is the embedding
        if index["lm_head.weight"].shape != (cfg.vocab_size, cfg.hidden_size):
            raise CheckpointError(
                f"tensor 'lm_head.weight' has shape {list(index['lm_head.weight'].shape)}, expected "
                f"{[cfg.vocab_size, cfg.hidden_size]} (the tied embedding)"
            )
    if unexpected:
        info = index[unexpected[0]]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"unexpected tensor {unexpected[0]!r} ({info.dtype} {list(info.shape)}){more}: expected no such "
            f"tensor, it is neither part of the text model described by config.json nor a carried "
            f"vision/MTP tensor ({' / '.join(p + '*' for p in CARRIED_PREFIXES)})"
        )
    for r in rules:
        info = index[r.hf]
        if info.shape != r.hf_shape:
            raise CheckpointError(
                f"tensor {r.hf!r} has shape {list(info.shape)}, expected {list(r.hf_shape)}"
            )
        if info.dtype not in FLOAT_CODES:
            raise CheckpointError(
                f"tensor {r.hf!r} has dtype {info.dtype}, expected one of {list(FLOAT_CODES)}"
            )
    return rules, carried


def read_config(path: str | os.PathLike) -> QwenConfig:
    """The `QwenConfig` of a checkpoint directory's `config.json`; any fault in the file is a
    `CheckpointError` that names it."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"no config.json at {f}")
    raw = read_json(f, "config", limit=64 * 2**20)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{f}: not a JSON object (a HF config is one)")
    try:
        return QwenConfig.from_hf(raw)
    except ValueError as e:  # an unknown model_type's message names the known ones
        raise CheckpointError(f"{f}: {e}") from e
    except (TypeError, AttributeError, KeyError) as e:  # a field of a type the config reader did not expect
        raise CheckpointError(f"{f}: malformed config ({type(e).__name__}: {e})") from e


def check_dir(path: str | os.PathLike, *, scan: bool = True, progress: bool = False) -> dict[str, Any]:
    """Everything `jaxpi convert --check` checks, without loading the model: config.json, the shard
    index and every safetensors header (`read_index`), names, shapes and dtypes against the config
    (`check_checkpoint`), and with `scan` every float tensor read for NaN and Inf. Returns the
    summary the command prints; raises `CheckpointError` naming the file and tensor."""
    src = Path(path)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such checkpoint directory")
    cfg = read_config(src)
    index = read_index(src)
    rules, carried = check_checkpoint(cfg, index)
    summary: dict[str, Any] = {
        "source": str(src),
        "layers": cfg.num_hidden_layers,
        "layer_types": {t: cfg.layer_types.count(t) for t in sorted(set(cfg.layer_types))},
        "text_tensors": len(rules),
        "carried_tensors": len(carried),
        "dtypes": sorted({index[r.hf].dtype for r in rules}),
    }
    if scan:
        bad = []
        floats = [i for i in index.values() if i.dtype in FLOAT_DTYPES]
        for info in tqdm(floats, desc="scanning", unit="tensor", disable=not progress):
            try:
                nan, inf = count_nonfinite(info)
            except OSError as e:
                raise CheckpointError(
                    f"{info.file}: cannot read tensor {info.name!r} ({e.strerror or e})"
                ) from None
            if nan or inf:
                counts = ", ".join(f"{k} {w}" for k, w in ((nan, "NaN"), (inf, "Inf")) if k)
                bad.append(f"tensor {info.name!r} in {info.file.name}: {counts}")
        if bad:
            more = f" (and {len(bad) - 3} more tensors)" if len(bad) > 3 else ""
            raise CheckpointError(f"{src}: weights that are not finite: " + "; ".join(bad[:3]) + more)
        summary["finite"] = f"all {len(floats)} float tensors"
    return summary


def load_hf(
    path: str | os.PathLike,
    dtype: str | jnp.dtype = "float32",
    *,
    shardings: ShardingFn | None = None,
    config_overrides: dict[str, Any] | None = None,
    progress: bool = False,
    base_quant: str = "none",
) -> tuple[QwenConfig, Qwen3_5ForCausalLM]:
    """Load a HF checkpoint of a known family (`jaxpi.config.FAMILIES`: Qwen3.5 CausalLM or
    ConditionalGeneration, Qwen3 CausalLM) into a jaxpi model of the family's class.

    `shardings(path, logical_axes)` may return the `jax.sharding.Sharding` of each parameter
    (its path in the model state, its logical axes with "layers" first for stacked groups);
    each array is then built directly on its devices. `config_overrides` sets runtime fields of
    `QwenConfig` (e.g. `remat`, `gdn_chunk_size`). `base_quant` "nf4" or "int8" stores every
    linear layer of the text layers quantized as bitsandbytes would (`jaxpi.convert.quantize`),
    from its values in `dtype`: the host holds the quantized arrays (~0.52 byte per parameter for
    nf4) and one HF tensor at a time.
    """
    path = Path(path)
    dtype = jnp.dtype(dtype)
    cfg = read_config(path)
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    index = read_index(path)
    rules, _ = check_checkpoint(cfg, index)
    abstract = abstract_model(cfg, dtype, base_quant)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    by_path = {tuple(p): var for p, var in flat}
    targets = quant_targets(cfg, rules, base_quant) if base_quant != "none" else []
    quantized = {t.path for t in targets}
    sources = {p: s for p, s in _sources_by_param(cfg, rules).items() if p not in quantized}
    quant_leaves = {p for p in by_path if p[:-1] in quantized}
    if set(sources) | quant_leaves != set(by_path):
        raise AssertionError(
            f"weight table and model disagree: {(set(sources) | quant_leaves) ^ set(by_path)}"
        )
    filled = _load_quantized(index, targets, by_path, dtype, shardings, progress) if targets else []
    items = [(p, var) for p, var in by_path.items() if p in sources]
    for p, var in tqdm(items, desc=f"loading {path.name}", disable=not progress, unit="param"):
        # One parameter at a time: its host buffer (all layers of a stacked group) plus one HF
        # tensor, written straight into the buffer (transposed and cast, no temporaries).
        host = _aligned_empty(var.get_value().shape, np.dtype(dtype))
        for rule, part, g in sources[p]:
            info = index[rule.hf]
            rows = rule.part_rows(part)  # a fused tensor's part is a row range: read only that
            a = read_array(info, rows)
            rule.part_into(a, part, host if g is None else host[g], row_offset=rows[0] if rows else 0)
            del a
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        filled.append((p, var.replace(_place(host, shardings(p, axes) if shardings else None))))
        del host
    model = nnx.merge(graphdef, nnx.from_flat_state(filled))
    return cfg, model


def _load_quantized(
    index: dict[str, TensorInfo],
    targets: list[QuantTarget],
    by_path: dict[tuple, nnx.Variable],
    dtype: jnp.dtype,
    shardings: ShardingFn | None,
    progress: bool,
) -> list[tuple[tuple, nnx.Variable]]:
    """Quantize each targeted HF tensor once (all its parts) and place the stored arrays."""
    hosts = {
        p: np.zeros(var.get_value().shape, var.get_value().dtype)
        for p, var in by_path.items()
        if p[:-1] in {t.path for t in targets}
    }
    by_rule: dict[str, list[QuantTarget]] = {}
    for t in targets:
        by_rule.setdefault(t.rule.hf, []).append(t)
    store = np.dtype(dtype)
    for name, parts in tqdm(by_rule.items(), desc="quantizing", disable=not progress, unit="tensor"):
        # the values as loaded in the base dtype (transformers casts before bitsandbytes quantizes)
        w = read_array(index[name]).astype(store).astype(np.float32)
        q = quantize_rows(parts[0].layout.kind, w)
        del w
        for t in parts:
            for arr_name, arr in part_arrays(q, t.layout).items():
                host = hosts[(*t.path, arr_name)]
                if t.group is None:
                    host[...] = arr
                else:
                    host[t.group] = arr
    out = []
    for p, host in hosts.items():
        var = by_path[p]
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        out.append((p, var.replace(_place(host, shardings(p, axes) if shardings else None))))
    return out


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """`np.empty`, 64-byte aligned: the CPU backend then adopts the buffer instead of copying it."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(n + align, np.uint8)
    off = -buf.ctypes.data % align
    return buf[off : off + n].view(dtype).reshape(shape)


def _place(host: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    if sharding is None:
        # `device_put`, not `jnp.asarray`: on CPU it aliases the aligned buffer (`host` is never
        # written again), where `jnp.asarray` would hold a second copy of the parameter.
        return jax.device_put(host)
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
    "bfloat16", "float16"). Without `source`, the family's CausalLM checkpoint (config.json by
    `QwenConfig.to_hf`) in the model's dtype.
    """
    cfg = model.cfg
    out = Path(out_dir)
    if dtype is not None and CODES.get(np.dtype(jnp.dtype(dtype))) not in FLOAT_CODES:
        raise ValueError(f"dtype must be one of 'float32', 'bfloat16', 'float16', not {dtype!r}")
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
        raw = functools.partial(read_raw, info)  # carried as raw bytes, whatever their dtype
        planned.append(PlannedTensor(name, info.dtype, info.shape, raw, size=info.end - info.begin))

    with atomic_dir(out, overwrite=overwrite) as tmp:
        write_shards(tmp, planned, max_shard_bytes, progress)
        (tmp / "config.json").write_text(json.dumps(_export_config(cfg, src, planned), indent=2) + "\n")
        if src is not None:
            copy_side_files(src, tmp)
    return out


def _link_roots(src: Path) -> list[Path]:
    """Where a side file's symlink may point: inside the checkpoint, or, for a HF hub cache
    snapshot (`models--X/snapshots/REV`), inside that repo's cache folder (its `blobs/`)."""
    real = src.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent)
    return roots


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy the checkpoint's tokenizer, generation and other non-weight, non-config files (with the
    umask's mode, not the source's). A symlink is followed only into the checkpoint or its HF
    cache repo: one that leads elsewhere (e.g. a `tokenizer.json` linked to /etc/shadow in a
    downloaded directory) is a CheckpointError, not a world-readable copy in the export."""
    roots = _link_roots(src)
    for f in sorted(src.iterdir()):
        if f.name in NOT_COPIED or f.name.endswith(WEIGHT_SUFFIXES) or not f.is_file():
            continue
        if f.is_symlink():
            target = f.resolve()
            if not any(target.is_relative_to(r) for r in roots):
                raise CheckpointError(
                    f"{f}: a symlink to {target}, outside the checkpoint; not copied into the export"
                )
        shutil.copyfile(f, dst / f.name)


def _producer(
    rule: Rule, params: dict[tuple, jax.Array], g: int | None, code: str
) -> Callable[[], np.ndarray]:
    def produce() -> np.ndarray:
        # One HF tensor: its layer's slice of each part (device-side slice, one transfer), written
        # transposed and cast straight into the output buffer that `write_file` streams out.
        out = np.empty(rule.hf_shape, DTYPES[code])
        parts = [np.asarray(params[tuple(p)][g] if g is not None else params[tuple(p)]) for p in rule.ours]
        rule.hf_into(parts, out)
        return out

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


def write_shards(tmp: Path, planned: list[PlannedTensor], max_bytes: int, progress: bool) -> None:
    """Write `planned` into `tmp` as `model.safetensors`, or as <= `max_bytes` shards with an index."""
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
    torch_dtype = (
        {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[sorted(codes)[0]]
        if len(codes) == 1
        else None
    )
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

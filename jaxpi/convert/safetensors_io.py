"""Streaming safetensors reader and writer, one tensor in memory at a time.

The format: 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the data.
We read with plain seeks (no mmap, so the resident set does not grow with the file) and write a
shard by planning its header first and then streaming each tensor's bytes into a temp file.

The reader holds a file to the rules of the reference implementation (the `safetensors` crate),
so that what passes here also loads in transformers and vLLM: a header of at most 100 MB of UTF-8
JSON, one object, no key twice; `__metadata__` a string -> string map; every tensor a known dtype,
a shape of non-negative integers and `data_offsets` of two integers whose span is exactly
dtype x shape; the tensors tile the data region from byte 0 to the end of the file, with no
overlap and no gap. An index's `weight_map` maps each tensor to a plain file name in the same
directory, and agrees with the shards' headers both ways. Every violation is a `CheckpointError`
naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
# Bits per element of every dtype the reference implementation knows (numpy reads only DTYPES;
# the others are carried as raw bytes).
DTYPE_BITS: dict[str, int] = {
    **{code: dt.itemsize * 8 for code, dt in DTYPES.items()},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F8_E8M0": 8,
    "U16": 16,
    "U32": 32,
    "U64": 64,
    "C64": 64,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # what the finite scan reads
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that is malformed or does not match the model: names the tensor (or file) and
    what was expected."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in `file`
    end: int


def read_index(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of a single-file or sharded (`*.index.json`) checkpoint directory, by name."""
    path = Path(path)
    index = path / INDEX_NAME
    weight_map = read_weight_map(index) if index.exists() else None
    if weight_map is not None:
        if not weight_map:
            raise CheckpointError(f"{index}: weight_map lists no tensors")
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, TensorInfo] = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{index}: lists {f.name}, which does not exist")
        for info in read_header(f):
            if info.name in out:
                raise CheckpointError(
                    f"tensor {info.name!r} is stored twice: in {out[info.name].file.name} and {f.name}"
                )
            out[info.name] = info
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in out:
                raise CheckpointError(f"{index}: maps tensor {name!r} to {fname}, which does not contain it")
            if out[name].file.name != fname:
                raise CheckpointError(
                    f"{index}: maps tensor {name!r} to {fname}, but it is stored in {out[name].file.name}"
                )
        unlisted = sorted(set(out) - set(weight_map))
        if unlisted:
            more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
            raise CheckpointError(
                f"{index}: does not list tensor {unlisted[0]!r}{more}, stored in {out[unlisted[0]].file.name}"
            )
    return out


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a shard index: tensor name -> a file name in the index's directory."""
    doc = read_json(index, "shard index")
    if not isinstance(doc, dict):
        raise CheckpointError(f"{index}: not a JSON object (a shard index has a 'weight_map' object)")
    weight_map = doc.get("weight_map")
    if weight_map is None:
        raise CheckpointError(f"{index}: has no 'weight_map' (an object of tensor -> file name)")
    if not isinstance(weight_map, dict):
        got = f"{_json_type(weight_map)} {_short(weight_map)}"
        raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor -> file name, not {got}")
    for name, fname in weight_map.items():
        if not isinstance(fname, str):
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, not a file name (a string)")
        # A shard lives next to its index: a path (../x, /etc/x) would read outside the checkpoint.
        if fname in ("", ".", "..") or Path(fname).name != fname or "\\" in fname:
            raise CheckpointError(
                f"{index}: tensor {name!r} maps to {fname!r}, which is not a file name in this directory"
            )
    return weight_map


def _json_type(v: object) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
    return "null" if v is None else kinds.get(type(v), type(v).__name__)


def _no_duplicates(where: str) -> Callable[[list[tuple[str, object]]], dict]:
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"{where}: key {k!r} appears twice")
            out[k] = v
        return out

    return hook


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _parse_json(raw: bytes, where: str, what: str) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: corrupt {what} (not UTF-8 text at byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(where), parse_constant=_reject_constant)
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{where}: corrupt {what} (JSON nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError included
        raise CheckpointError(f"{where}: corrupt {what} (not valid JSON: {e})") from None


def read_json(path: Path, what: str, limit: int = MAX_HEADER_BYTES) -> object:
    """A JSON file (an index, a config) parsed strictly; faults are CheckpointErrors naming `path`."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if len(raw) > limit:
        raise CheckpointError(f"{path}: the {what} is larger than {limit} bytes")
    return _parse_json(raw, str(path), what)


def _nonneg_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(file: Path) -> list[TensorInfo]:
    """The tensors of one safetensors file, with offsets checked against the file and the shapes
    (the rules in the module docstring); in header order."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{file}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(
                    f"{file}: header of {n} bytes does not fit in the file's {size} bytes "
                    f"(truncated, or not safetensors)"
                )
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{file}: header of {n} bytes is over the {MAX_HEADER_BYTES}-byte limit"
                )
            raw = fh.read(n)
    except OSError as e:  # a directory named *.safetensors, no permission, an I/O error
        raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    header = _parse_json(raw, str(file), "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{file}: __metadata__ must be an object of strings, not {_short(meta)}")
    base = 8 + n
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        infos.append(_tensor_info(file, name, entry, base, size))
    _check_tiling(file, infos, base, size)
    return infos


def _short(v: object, n: int = 80) -> str:
    text = json.dumps(v)
    return text if len(text) <= n else text[: n - 3] + "..."


def _tensor_info(file: Path, name: str, entry: object, base: int, size: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: corrupt header entry {_short(entry)} (not an object)")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str) or code not in DTYPE_BITS:
        raise CheckpointError(f"{where}: unknown dtype {_short(code)} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, not {_short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_nonneg_int(x) for x in offsets)):
        raise CheckpointError(
            f"{where}: data_offsets must be two non-negative integers, not {_short(offsets)}"
        )
    b, e = offsets
    if b > e:
        raise CheckpointError(f"{where}: has invalid data_offsets [{b}, {e}]")
    bits = math.prod(shape) * DTYPE_BITS[code]
    if bits % 8:
        raise CheckpointError(f"{where}: {code} {shape} is {bits} bits, not a whole number of bytes")
    if e - b != bits // 8:
        raise CheckpointError(
            f"{where} ({code} {shape}) needs {bits // 8} bytes, its data_offsets span {e - b}"
        )
    if base + e > size:
        raise CheckpointError(
            f"{where} ends at byte {base + e}, past the end of the file ({size} bytes): truncated?"
        )
    return TensorInfo(name, Path(file), code, tuple(shape), base + b, base + e)


def _check_tiling(file: Path, infos: list[TensorInfo], base: int, size: int) -> None:
    """The tensors cover [base, size) exactly: no byte shared by two, none owned by nobody."""
    at, prev = base, None
    for t in sorted(infos, key=lambda t: (t.begin, t.end)):
        if t.begin < at:
            raise CheckpointError(
                f"{file}: tensor {t.name!r} overlaps tensor {prev.name!r} (bytes {t.begin - base}..{at - base} "
                f"of the data are in both)"
            )
        if t.begin > at:
            raise CheckpointError(
                f"{file}: a gap of {t.begin - at} bytes before tensor {t.name!r} belongs to no tensor"
            )
        at, prev = t.end, t
    if at != size:
        raise CheckpointError(f"{file}: the last {size - at} bytes after the tensors belong to no tensor")


def read_raw(info: TensorInfo, start: int = 0, stop: int | None = None) -> bytes:
    """The stored bytes of a tensor (or of bytes [start, stop) of it)."""
    stop = info.end - info.begin if stop is None else stop
    with open(info.file, "rb") as fh:
        fh.seek(info.begin + start)
        data = fh.read(stop - start)
    if len(data) != stop - start:
        raise CheckpointError(
            f"{info.file}: tensor {info.name!r} is cut short (file truncated while reading?)"
        )
    return data


def read_array(info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A tensor as a read-only numpy array; `rows=(start, stop)` reads only that slice of axis 0."""
    if info.dtype not in DTYPES:
        raise CheckpointError(f"tensor {info.name!r} has unsupported dtype {info.dtype}")
    dt = DTYPES[info.dtype]
    if rows is None:
        return np.frombuffer(read_raw(info), dtype=dt).reshape(info.shape)
    start, stop = rows
    row_bytes = int(np.prod(info.shape[1:], dtype=np.int64)) * dt.itemsize
    data = read_raw(info, start * row_bytes, stop * row_bytes)
    return np.frombuffer(data, dtype=dt).reshape((stop - start, *info.shape[1:]))


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its header entry and a callback that produces its bytes when needed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], bytes | np.ndarray]  # bytes, or a C-contiguous array of `dtype`
    size: int | None = None  # byte size, for dtypes we only copy (e.g. F8_E8M0 carried as raw bytes)

    @property
    def nbytes(self) -> int:
        if self.size is not None:
            return self.size
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


def write_file(path: Path, tensors: Iterable[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file, streaming tensors in order (the caller renames it into place)."""
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as the reference writer does
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for t in tensors:
            data = t.produce()
            if isinstance(data, np.ndarray):
                if not data.flags.c_contiguous:
                    raise ValueError(f"tensor {t.name!r}: produced a non-contiguous array")
                data = data.reshape(-1).view(np.uint8)  # raw bytes, no copy
            n = memoryview(data).nbytes
            if n != t.nbytes:
                raise ValueError(f"tensor {t.name!r}: produced {n} bytes, expected {t.nbytes}")
            fh.write(data)
            del data
        fh.flush()
        os.fsync(fh.fileno())


def count_nonfinite(info: TensorInfo, chunk_bytes: int = 16 * 2**20) -> tuple[int, int]:
    """(NaN count, ±Inf count) of a float tensor, read `chunk_bytes` at a time; (0, 0) for other
    dtypes (integers, bool and the packed or raw formats hold no NaN a scan could find)."""
    if info.dtype not in FLOAT_DTYPES:
        return 0, 0
    dt = DTYPES[info.dtype]
    step = max(chunk_bytes // dt.itemsize, 1) * dt.itemsize
    total, nan, inf = info.end - info.begin, 0, 0
    with open(info.file, "rb") as fh:
        fh.seek(info.begin)
        for start in range(0, total, step):
            want = min(step, total - start)
            data = fh.read(want)
            if len(data) != want:
                raise CheckpointError(f"{info.file}: tensor {info.name!r} is cut short (file truncated?)")
            a = np.frombuffer(data, dt)
            nan += int(np.count_nonzero(np.isnan(a)))
            inf += int(np.count_nonzero(np.isinf(a)))
    return nan, inf

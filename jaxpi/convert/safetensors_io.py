"""Streaming safetensors reader and writer, one tensor in memory at a time.

The format: 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the data.
We read with plain seeks (no mmap, so the resident set does not grow with the file) and write a
shard by planning its header first and then streaming each tensor's bytes into a temp file.
"""

from __future__ import annotations

import json
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
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, TensorInfo] = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{index.name} lists {f.name}, which does not exist")
        for info in read_header(f):
            if info.name in out:
                raise CheckpointError(
                    f"tensor {info.name!r} is stored twice: in {out[info.name].file.name} and {f.name}"
                )
            out[info.name] = info
    if index.exists():
        for name, fname in weight_map.items():
            if name not in out:
                raise CheckpointError(
                    f"{index.name} maps tensor {name!r} to {fname}, which does not contain it"
                )
            if out[name].file.name != fname:
                raise CheckpointError(
                    f"{index.name} maps tensor {name!r} to {fname}, but it is stored in {out[name].file.name}"
                )
    return out


def read_header(file: Path) -> list[TensorInfo]:
    """The tensors of one safetensors file, with offsets checked against the file and the shapes."""
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
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    infos = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}: {meta!r}") from None
        if not 0 <= b <= e:
            raise CheckpointError(f"{file}: tensor {name!r} has invalid data_offsets [{b}, {e}]")
        if code in DTYPES:
            want = int(np.prod(shape, dtype=np.int64)) * DTYPES[code].itemsize
            if e - b != want:
                raise CheckpointError(
                    f"{file}: tensor {name!r} ({code} {list(shape)}) needs {want} bytes, its data_offsets "
                    f"span {e - b}"
                )
        if base + e > size:
            raise CheckpointError(
                f"{file}: tensor {name!r} ends at byte {base + e}, past the end of the file ({size} bytes): "
                f"truncated?"
            )
        infos.append(TensorInfo(name, Path(file), code, shape, base + b, base + e))
    return infos


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

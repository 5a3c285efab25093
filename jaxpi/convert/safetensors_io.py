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
                raise ValueError(f"tensor {info.name!r} is stored twice: in {out[info.name].file.name} and {f.name}")
            out[info.name] = info
    return out


def read_header(file: Path) -> list[TensorInfo]:
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{file}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: corrupt safetensors header ({e})") from None
    base = 8 + n
    size = os.path.getsize(file)
    infos = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        if base + e > size:
            raise ValueError(f"{file}: tensor {name!r} extends past the end of the file (truncated?)")
        infos.append(TensorInfo(name, Path(file), meta["dtype"], tuple(meta["shape"]), base + b, base + e))
    return infos


def read_raw(info: TensorInfo) -> bytes:
    with open(info.file, "rb") as fh:
        fh.seek(info.begin)
        return fh.read(info.end - info.begin)


def read_array(info: TensorInfo) -> np.ndarray:
    if info.dtype not in DTYPES:
        raise ValueError(f"tensor {info.name!r} has unsupported dtype {info.dtype}")
    return np.frombuffer(read_raw(info), dtype=DTYPES[info.dtype]).reshape(info.shape)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its header entry and a callback that produces its bytes when needed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], bytes]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


def write_file(path: Path, tensors: Iterable[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
    """Write one safetensors file, streaming tensors in order (the caller renames it into place)."""
    tensors = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as the reference writer does
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for t in tensors:
            data = t.produce()
            if len(data) != t.nbytes:
                raise ValueError(f"tensor {t.name!r}: produced {len(data)} bytes, expected {t.nbytes}")
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())

"""Hostile checkpoints against `jaxpi convert --check`: a clear error naming file and tensor, never a
traceback, never an OK for weights that are not finite or bytes that two tensors share.

The checkpoint is a real one (`save_hf` of a seeded tiny model: `config.json` + `model.safetensors`),
copied and corrupted per probe: tensor bytes, the safetensors header, the shard index, config.json.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from jaxpi.cli import main
from jaxpi.config import TINY

NORM0 = "model.layers.0.input_layernorm.weight"
NORM1 = "model.layers.1.input_layernorm.weight"
UP = "model.layers.2.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from jaxpi.convert.hf import save_hf
    from jaxpi.hf_fixtures import random_jax_model

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_hf(random_jax_model(TINY.replace(num_hidden_layers=4), seed=3), out)
    return out


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "bad"
    shutil.copytree(ckpt, d)
    return d


def _split(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(f: Path, header: dict | bytes, data: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _check(d: Path, capsys) -> tuple[int, str]:
    rc = main(["convert", "--from", str(d), "--check"])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_the_good_checkpoint_passes(ckpt, capsys):
    rc, out = _check(ckpt, capsys)
    assert rc == 0 and "checkpoint OK" in out, out
    assert "finite" in out  # the scan ran and said so


# ---- weights -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "word"), [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_non_finite_weights_are_named_by_tensor(ckpt, tmp_path, capsys, value, word):
    d = _copy(ckpt, tmp_path)
    f = d / "model.safetensors"
    header, data = _split(f)
    begin, end = header[UP]["data_offsets"]
    a = np.frombuffer(data[begin:end], np.float32).copy()
    a[[3, 77]] = value
    _join(f, header, data[:begin] + a.tobytes() + data[end:])
    rc, out = _check(d, capsys)
    assert rc == 2, out
    assert UP in out and word in out and "2 " in out, out
    assert "Traceback" not in out


# ---- the safetensors header ----------------------------------------------------------------------
def _overlap(h: dict, data: bytes) -> tuple[dict, bytes]:
    h[NORM1]["data_offsets"] = list(h[NORM0]["data_offsets"])  # two tensors, one set of bytes
    return h, data


def _offsets_strings(h: dict, data: bytes) -> tuple[dict, bytes]:
    b, e = h[NORM0]["data_offsets"]
    h[NORM0]["data_offsets"] = [str(b), str(e)]
    return h, data


def _offsets_three(h: dict, data: bytes) -> tuple[dict, bytes]:
    h[NORM0]["data_offsets"] = [*h[NORM0]["data_offsets"], 0]
    return h, data


def _dtype_list(h: dict, data: bytes) -> tuple[dict, bytes]:
    h[NORM0]["dtype"] = ["F32"]
    return h, data


def _dtype_unknown(h: dict, data: bytes) -> tuple[dict, bytes]:
    h[NORM0]["dtype"] = "F33"
    return h, data


def _shape_negative(h: dict, data: bytes) -> tuple[dict, bytes]:
    (n,) = h[NORM0]["shape"]
    h[NORM0]["shape"] = [-1, -n]  # product n: the byte span still matches
    return h, data


def _shape_string(h: dict, data: bytes) -> tuple[dict, bytes]:
    h[NORM0]["shape"] = str(h[NORM0]["shape"][0])
    return h, data


def _entry_string(h: dict, data: bytes) -> tuple[dict, bytes]:
    h[NORM0] = "F32"
    return h, data


def _metadata_list(h: dict, data: bytes) -> tuple[dict, bytes]:
    h["__metadata__"] = ["format", "pt"]
    return h, data


def _trailing_bytes(h: dict, data: bytes) -> tuple[dict, bytes]:
    return h, data + b"\0" * 16  # bytes no tensor owns: not what safetensors writes


def _gap(h: dict, data: bytes) -> tuple[dict, bytes]:
    # every tensor from NORM0's start on moves 8 bytes later: a hole no tensor owns
    b0 = h[NORM0]["data_offsets"][0]
    for k, v in h.items():
        if k != "__metadata__" and v["data_offsets"][0] >= b0:
            v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
    return h, data[:b0] + b"\0" * 8 + data[b0:]


def _duplicate_key(h: dict, data: bytes) -> tuple[bytes, bytes]:
    raw = json.dumps(h)
    entry = json.dumps({NORM0: h[NORM0]})[1:-1]
    return (raw[:-1] + ", " + entry + "}").encode(), data  # the same tensor named twice


def _length_past_the_end(h: dict, data: bytes) -> tuple[bytes, bytes]:
    return b"", b""  # replaced below: a header length of 2**40


HEADER_PROBES = {
    "overlapping_offsets": (_overlap, [NORM1, NORM0, "overlap"]),
    "offsets_strings": (_offsets_strings, [NORM0, "data_offsets"]),
    "offsets_three": (_offsets_three, [NORM0, "data_offsets"]),
    "dtype_list": (_dtype_list, [NORM0, "dtype"]),
    "dtype_unknown": (_dtype_unknown, [NORM0, "F33"]),
    "shape_negative": (_shape_negative, [NORM0, "shape"]),
    "shape_string": (_shape_string, [NORM0, "shape"]),
    "entry_string": (_entry_string, [NORM0]),
    "metadata_list": (_metadata_list, ["__metadata__"]),
    "trailing_bytes": (_trailing_bytes, ["16 bytes"]),
    "gap": (_gap, [NORM0, "gap"]),
    "duplicate_key": (_duplicate_key, [NORM0, "twice"]),
}


@pytest.mark.parametrize("probe", list(HEADER_PROBES))
def test_inconsistent_headers_are_errors_naming_file_and_tensor(ckpt, tmp_path, capsys, probe):
    edit, fragments = HEADER_PROBES[probe]
    d = _copy(ckpt, tmp_path)
    f = d / "model.safetensors"
    header, data = _split(f)
    _join(f, *edit(header, data))
    rc, out = _check(d, capsys)
    assert rc == 2, out
    for fragment in [str(f), *fragments]:
        assert fragment in out, (fragment, out)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (struct.pack("<Q", 2**40) + b"{}", "header of 1099511627776 bytes"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "header"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (b"\x01\x02", "shorter than 8 bytes"),
    ],
)
def test_a_header_that_is_not_one_is_named(ckpt, tmp_path, capsys, raw, fragment):
    d = _copy(ckpt, tmp_path)
    (d / "model.safetensors").write_bytes(raw)
    rc, out = _check(d, capsys)
    assert rc == 2 and fragment in out and str(d / "model.safetensors") in out, out


def test_a_directory_named_like_a_shard_is_an_error(ckpt, tmp_path, capsys):
    d = _copy(ckpt, tmp_path)
    (d / "model-extra.safetensors").mkdir()
    rc, out = _check(d, capsys)
    assert rc == 2 and "model-extra.safetensors" in out and "Traceback" not in out, out


# ---- the shard index -----------------------------------------------------------------------------
def _sharded(ckpt: Path, tmp_path: Path) -> tuple[Path, dict]:
    """The checkpoint as one shard plus an index that maps every tensor to it."""
    d = _copy(ckpt, tmp_path)
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    header, _ = _split(d / "model-00001-of-00001.safetensors")
    names = [k for k in header if k != "__metadata__"]
    index = {
        "metadata": {"total_size": 0},
        "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors"),
    }
    return d, index


INDEX_PROBES = {
    "not_json": ("{weight_map: 1", ["model.safetensors.index.json", "JSON"]),
    "a_list": ("[]", ["model.safetensors.index.json", "object"]),
    "weight_map_list": (lambda i: {**i, "weight_map": ["a"]}, ["weight_map"]),
    "weight_map_missing": (lambda i: {"metadata": {}}, ["weight_map"]),
    "file_an_int": (lambda i: {**i, "weight_map": {**i["weight_map"], NORM0: 1}}, [NORM0]),
    "file_outside": (
        lambda i: {**i, "weight_map": {**i["weight_map"], NORM0: "../model-00001-of-00001.safetensors"}},
        [NORM0, "../model-00001-of-00001.safetensors"],
    ),
    "file_missing": (
        lambda i: {**i, "weight_map": {**i["weight_map"], NORM0: "model-00002-of-00002.safetensors"}},
        ["model-00002-of-00002.safetensors"],
    ),
    "tensor_missing": (
        lambda i: {**i, "weight_map": {**i["weight_map"], "model.ghost.weight": i["weight_map"][NORM0]}},
        ["model.ghost.weight"],
    ),
    "tensor_unlisted": (
        lambda i: {**i, "weight_map": {k: v for k, v in i["weight_map"].items() if k != NORM0}},
        [NORM0],
    ),
}


@pytest.mark.parametrize("probe", list(INDEX_PROBES))
def test_a_malformed_index_is_an_error_naming_it(ckpt, tmp_path, capsys, probe):
    edit, fragments = INDEX_PROBES[probe]
    d, index = _sharded(ckpt, tmp_path)
    if probe == "file_outside":  # a shard of the same name one directory up
        shutil.copy(d / "model-00001-of-00001.safetensors", d.parent / "model-00001-of-00001.safetensors")
    text = edit if isinstance(edit, str) else json.dumps(edit(index))
    (d / "model.safetensors.index.json").write_text(text)
    rc, out = _check(d, capsys)
    assert rc == 2, out
    for fragment in fragments:
        assert fragment in out, (fragment, out)
    assert "Traceback" not in out


def test_the_sharded_form_of_the_good_checkpoint_passes(ckpt, tmp_path, capsys):
    d, index = _sharded(ckpt, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, out = _check(d, capsys)
    assert rc == 0, out


# ---- config.json ---------------------------------------------------------------------------------
CONFIG_PROBES = {
    "not_json": "{num_hidden_layers: 4",
    "a_list": "[1, 2]",
    "a_string": '"qwen3_5"',
    "binary": b"\xff\xfe\x00",
    "missing_fields": '{"model_type": "qwen3_5_text"}',
    "rope_parameters_list": lambda c: c.update(rope_parameters=[1]),
}


@pytest.mark.parametrize("probe", list(CONFIG_PROBES))
def test_a_malformed_config_is_an_error_naming_the_file(ckpt, tmp_path, capsys, probe):
    d = _copy(ckpt, tmp_path)
    edit = CONFIG_PROBES[probe]
    if callable(edit):
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        edit = json.dumps(cfg)
    (d / "config.json").write_bytes(edit if isinstance(edit, bytes) else edit.encode())
    rc, out = _check(d, capsys)
    assert rc == 2, out
    assert str(d / "config.json") in out, out

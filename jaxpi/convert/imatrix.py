"""The importance matrix from agent sessions (what `jaxpi imatrix` writes): per quantized matmul,
the per-input-channel sum of squared activations over every calibration token, in the GGUF
format llama.cpp's quantizer reads (`--imatrix`) and its own `llama-imatrix` tool writes.

Calibration text: complete sessions (admitted and failed attempts alike: no gate is applied),
each rendered by the chat template as the fine-tuned model saw it (`jaxpi.data.render`), run
from a fresh state: a session is its own sequence, never concatenated with the next (llama.cpp's
tool runs a text file in fixed chunks instead). A session longer than `ctx` tokens is cut into
windows of `ctx`, each from a fresh state. A task-disjoint share of the sessions is held out
(`split_by_task`: every session of a held-out task, none of it in the statistics) for the
fidelity table (`jaxpi.convert.gguf_report`).

The statistics are jaxpi's own model's (float32), read at each projection's input; names are
llama.cpp's weight names (`blk.N.attn_qkv.weight`, ...), the DeltaNet output projection's input
channels put in ggml's value-head order as the weight is (`jaxpi.convert.gguf`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.atomic import file_mode, scratch_dir
from jaxpi.config import FULL, LINEAR, QwenConfig
from jaxpi.convert.gguf import check_supported, gguf_name, gguf_package, v_head_order
from jaxpi.convert.hf import load_hf
from jaxpi.data.render import RenderConfig, load_tokenizer, render_session
from jaxpi.data.sessions import Session, read_sessions
from jaxpi.models.layers import tap_projections

# The projections of each layer type, by the HF module name `project` records, and their GGUF tensor.
_PROJECTIONS = {
    LINEAR: {
        "in_proj_qkv": "ATTN_QKV",
        "in_proj_b": "SSM_BETA",
        "in_proj_a": "SSM_ALPHA",
        "in_proj_z": "ATTN_GATE",
        "out_proj": "SSM_OUT",
    },
    FULL: {"q_proj": "ATTN_Q", "k_proj": "ATTN_K", "v_proj": "ATTN_V", "o_proj": "ATTN_OUT"},
}
_MLP = {"gate_proj": "FFN_GATE", "up_proj": "FFN_UP", "down_proj": "FFN_DOWN"}
MIN_TOKENS = 16  # llama.cpp's imatrix tool skips batches under 16 tokens; so do we
BUCKET = 64  # windows are padded to a multiple of this (masked), so few lengths compile


@dataclass(frozen=True)
class Sequence_:
    source: str
    task: str
    ids: np.ndarray  # int32 [n]


def task_key(session: Session) -> str:
    """The task a session attempted (its `task_id`, else its source file: a task of its own)."""
    return session.meta.task_id or session.meta.source.split(":")[0]


def split_by_task(
    sessions: Sequence[Session], heldout: float, *, seed: int = 0
) -> tuple[list[Session], list[Session]]:
    """(calibration, held out): a stable hash of each task picks whether all of its sessions are
    held out, for about `heldout` of the tasks; at least one task on each side when there are two."""
    if not 0.0 <= heldout < 1.0:
        raise ValueError(f"heldout must be in [0, 1), got {heldout}")
    tasks = sorted({task_key(s) for s in sessions})

    def score(t: str) -> float:
        digest = hashlib.sha256(f"{seed}:{t}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    ranked = sorted(tasks, key=score)
    n_out = round(heldout * len(tasks))
    if heldout > 0 and len(tasks) >= 2:
        n_out = min(max(n_out, 1), len(tasks) - 1)
    out = set(ranked[:n_out])
    return [s for s in sessions if task_key(s) not in out], [s for s in sessions if task_key(s) in out]


def session_sequences(sessions: Iterable[Session], tokenizer_dir: str | os.PathLike) -> list[Sequence_]:
    """Each session's token ids as the chat template renders it (one sequence per rendered
    example: a session with branches or a compaction gives several)."""
    cfg = RenderConfig(tokenizer_dir=tokenizer_dir)
    tok = load_tokenizer(str(tokenizer_dir))
    out = []
    for s in sessions:
        for ex in render_session(s, tok, cfg):
            out.append(Sequence_(s.meta.source, task_key(s), np.asarray(ex.input_ids, np.int32)))
    return out


def windows(ids: np.ndarray, ctx: int) -> list[np.ndarray]:
    """`ids` cut into windows of `ctx` tokens; a last window under MIN_TOKENS is dropped."""
    return [ids[i : i + ctx] for i in range(0, len(ids), ctx) if len(ids[i : i + ctx]) >= MIN_TOKENS]


def tensor_names(cfg: QwenConfig) -> dict[tuple[int, str], str]:
    """(layer, recorded projection name) -> the GGUF weight it feeds."""
    out = {}
    for i, t in enumerate(cfg.layer_types):
        for name, tensor in {**_PROJECTIONS[t], **_MLP}.items():
            out[(i, name)] = gguf_name(tensor, i)
    return out


class Collector:
    """Runs the model of an HF checkpoint (unscanned, float32) and sums its projections' squared
    inputs per channel."""

    def __init__(self, model_dir: str | os.PathLike):
        self.cfg, model = load_hf(
            model_dir, "float32", config_overrides={"scan_layers": False, "remat": "none"}
        )
        check_supported(self.cfg, str(model_dir))
        self.names = tensor_names(self.cfg)
        self.graphdef, self.state = nnx.split(model)
        self.recorded: list[tuple[int, str]] = []
        self._fn = jax.jit(self._stats)
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}
        self.chunks = 0

    def _stats(self, state: Any, ids: jax.Array, mask: jax.Array) -> list[jax.Array]:
        model = nnx.merge(self.graphdef, state)
        with tap_projections() as taps:
            model.hidden_states(ids)
        layer, seen, out, recorded = 0, set(), [], []
        for name, x in taps:
            if name in seen and name == "in_proj_qkv":  # q, k and v of one fused input: once
                continue
            seen.add(name)
            x2 = jnp.square(x.astype(jnp.float32)).reshape(*x.shape[:2], -1)
            out.append(jnp.einsum("bt,btc->c", mask, x2))
            recorded.append((layer, name))
            if name == "down_proj":  # the last projection of every layer
                layer, seen = layer + 1, set()
        expected = set(self.names)
        if set(recorded) != expected or len(recorded) != len(expected):
            raise AssertionError(
                f"projection taps {sorted(set(recorded) ^ expected)[:4]} disagree with the layers"
            )
        self.recorded = recorded
        return out

    def add(self, window: np.ndarray) -> None:
        n = len(window)
        padded = -(-n // BUCKET) * BUCKET
        ids = np.zeros((1, padded), np.int32)
        ids[0, :n] = window
        mask = np.zeros((1, padded), np.float32)
        mask[0, :n] = 1.0
        if window.min() < 0 or window.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids outside [0, {self.cfg.vocab_size})")
        sums = self._fn(self.state, jnp.asarray(ids), jnp.asarray(mask))
        dv = self.cfg.linear_value_head_dim
        perm = v_head_order(self.cfg, dv)
        for (layer, name), s in zip(self.recorded, sums, strict=True):
            s = np.asarray(s, np.float64)
            if name == "out_proj" and perm is not None:
                s = s[perm]
            key = self.names[(layer, name)]
            self.sums[key] = self.sums.get(key, 0.0) + s
            self.counts[key] = self.counts.get(key, 0) + n
        self.chunks += 1


def collect(
    model_dir: str | os.PathLike,
    seqs: Sequence[Sequence_] | Sequence[np.ndarray],
    *,
    ctx: int = 512,
    progress: Callable[[str], None] | None = None,
) -> Collector:
    """The statistics of every window of every sequence."""
    if ctx < MIN_TOKENS:
        raise ValueError(
            f"ctx must be at least {MIN_TOKENS} tokens (llama.cpp skips shorter batches), got {ctx}"
        )
    c = Collector(model_dir)
    items = [s.ids if isinstance(s, Sequence_) else np.asarray(s, np.int32) for s in seqs]
    wins = [w for ids in items for w in windows(ids, ctx)]
    if not wins:
        raise ValueError(f"no calibration window of at least {MIN_TOKENS} tokens")
    for k, w in enumerate(wins):
        c.add(w)
        if progress is not None and ((k + 1) % 10 == 0 or k + 1 == len(wins)):
            progress(f"  imatrix: {k + 1}/{len(wins)} windows")
    return c


def write_imatrix(path: str | os.PathLike, c: Collector, *, datasets: Sequence[str], ctx: int) -> None:
    """The statistics as llama.cpp's GGUF imatrix (`<weight>.in_sum2` [n_in], `<weight>.counts`)."""
    g = gguf_package()
    w = g.GGUFWriter(None, "imatrix")
    w.kv_data[0].pop(g.Keys.General.ARCHITECTURE, None)  # llama.cpp's imatrix files carry none
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", list(datasets))
    w.add_uint32("imatrix.chunk_count", c.chunks)
    w.add_uint32("imatrix.chunk_size", ctx)
    arrays = []
    for name in sorted(c.sums):
        arrays.append((f"{name}.in_sum2", np.asarray(c.sums[name], np.float32)[None, :]))
        arrays.append((f"{name}.counts", np.asarray([[c.counts[name]]], np.float32)))
    for name, a in arrays:
        w.add_tensor_info(name, a.shape, a.dtype, a.nbytes)
    w.write_header_to_file(path=Path(path))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, a in arrays:
        w.write_tensor_data(a)
    w.close()


def save_imatrix(path: str | os.PathLike, c: Collector, *, datasets: Sequence[str], ctx: int) -> Path:
    """`write_imatrix` atomically: into a hidden directory beside `path` (removed afterwards, or
    by the next write if this one is killed), then renamed into place with the umask's mode."""
    path = Path(path)
    with scratch_dir(path) as tmp:
        part = tmp / path.name
        write_imatrix(part, c, datasets=datasets, ctx=ctx)
        os.chmod(part, file_mode())
        os.replace(part, path)
    return path


def read_imatrix(path: str | os.PathLike) -> dict[str, tuple[np.ndarray, float]]:
    """weight name -> (in_sum2 [n_in] float64, count) of a GGUF imatrix file (ours or llama.cpp's)."""
    g = gguf_package()
    r = g.GGUFReader(str(path))
    sums, counts = {}, {}
    for t in r.tensors:
        if t.name.endswith(".in_sum2"):
            sums[t.name.removesuffix(".in_sum2")] = np.asarray(t.data, np.float64).reshape(-1)
        elif t.name.endswith(".counts"):
            counts[t.name.removesuffix(".counts")] = float(np.asarray(t.data).reshape(-1)[0])
    if set(sums) != set(counts):
        raise ValueError(
            f"{path}: sums and counts name different weights: {sorted(set(sums) ^ set(counts))[:3]}"
        )
    return {k: (sums[k], counts[k]) for k in sums}


def load_calibration(
    sessions_dir: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer_dir: str | os.PathLike,
    *,
    heldout: float,
    seed: int = 0,
) -> tuple[list[Sequence_], list[Sequence_], dict[str, Any]]:
    """Read every session (read errors are reported, not fatal), split by task, render both sides."""
    paths = [sessions_dir] if isinstance(sessions_dir, (str, os.PathLike)) else list(sessions_dir)
    sessions, rejected = read_sessions(paths)
    if not sessions:
        raise ValueError(f"no readable session under {', '.join(map(str, paths))} ({len(rejected)} rejected)")
    calib, held = split_by_task(sessions, heldout, seed=seed)
    info = {
        "sessions": len(sessions),
        "rejected": len(rejected),
        "verified": sum(s.meta.verified is True for s in sessions),
        "failed": sum(s.meta.verified is False for s in sessions),
        "calibration_tasks": sorted({task_key(s) for s in calib}),
        "heldout_tasks": sorted({task_key(s) for s in held}),
    }
    return session_sequences(calib, tokenizer_dir), session_sequences(held, tokenizer_dir), info

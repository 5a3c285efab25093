"""The SFT input pipeline: examples → shuffled, packed, fixed-length rows → this host's batch.

Built on `grain`: every stage is a grain dataset, so the iterator is exactly resumable from a
small JSON state (`get_state` / `set_state`, or `save_state` / `restore_state`).

    examples (input_ids, loss_mask)  ─ validate, truncate or drop overlong, skip empty
      → shuffle (seeded, a new order each epoch) → repeat(num_epochs)
      → pack into rows of seq_len (first fit / best fit), or one example per row ("none")
      → global batch of batch_size rows (a short last batch is padded with empty rows)
      → rows [p·b, (p+1)·b) for host p of P, b = batch_size / P

A packed row (seq_len T = 12, three examples a, b, c, then padding):

    input_ids    a0 a1 a2 a3 b0 b1 b2 c0 c1 c2  ·  ·     · = pad_id
    loss_mask     0  0  1  1  0  1  1  0  0  1  0  0     example's own mask; 0 on padding
    segment_ids   1  1  1  1  2  2  2  3  3  3  0  0     1, 2, 3… per example; 0 = padding
    positions     0  1  2  3  0  1  2  0  1  2  0  0     restart at 0 in each segment

The segment-id contract (what `Qwen3_5ForCausalLM` and `next_token_loss` rely on):
- each example is one contiguous run of one id; ids count 1, 2, 3… from the row's start, so
  adjacent segments always differ — the model restarts attention, the DeltaNet conv window and
  its recurrent state wherever the id changes;
- padding is id 0 and only ever follows the last segment of a row (rows that pad a short last
  batch are all padding); its loss_mask is 0;
- the loss never predicts a segment's first token from the previous segment (`next_token_loss`
  drops pairs whose ids differ), so a packed row's loss equals the examples' losses run alone.

Multi-host: every host runs the same global pipeline (packing is cheap next to a training step)
and keeps its slice of rows, so host streams are disjoint, their union is the single-host stream
batch by batch, every host yields the same number of batches (no host runs dry while the others
wait in a collective, which sharding the examples before packing cannot promise), and the
iterator state is the same on every host (a checkpoint can be restored with another host count
that divides the batch). The cost: each host reads every example. Host p's rows are the p-th
block of the global batch, the order `jax.make_array_from_process_local_data` expects for a
batch axis sharded over processes in order.

Checkpoints: `save_state(it)` returns a JSON string; the trainer stores it inside its orbax
checkpoint (e.g. `ocp.args.JsonSave(json.loads(blob))` beside the model state, or grain's own
`grain.checkpoint.CheckpointSave(it)`), and restores with `restore_state(it, blob)` on a fresh
iterator built from the same examples and config. The state carries a fingerprint of the config
fields that shape the stream; restoring into a different pipeline raises an error naming them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import grain
import numpy as np
from grain.experimental import BestFitPackIterDataset, FirstFitPackIterDataset, ThreadPrefetchIterDataset

Batch = dict[str, np.ndarray]
Examples = Sequence[Mapping[str, Any]] | grain.MapDataset
FIELDS = ("input_ids", "loss_mask", "segment_ids", "positions")
STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How examples become batches.

    seq_len: tokens per row (T). batch_size: rows per *global* batch (all hosts together).
    seed: drives the example shuffle and the order of packed rows. shuffle: off = source order.
    num_epochs: passes over the data; None repeats forever. Packing runs across epoch
      boundaries, so a row may hold the end of one epoch and the start of the next.
    overlong: an example longer than seq_len is cut to its first seq_len tokens ("truncate")
      or skipped ("drop"); either way it is counted (`example_stats`).
    packing: "first_fit" / "best_fit" (grain's packers over `pack_bins` open rows), or "none"
      (one example per row, padded).
    pack_bins: rows the packer fills at once (None = batch_size); more bins, less padding,
      more rows held in memory.
    drop_remainder: drop a short last batch (finite epochs) instead of padding it with empty rows.
    pad_id: token id written into padding (its loss_mask and segment id are 0 whatever it is).
    num_workers: 0 = in-process; N > 0 = grain worker processes (`mp_prefetch`), each packing a
      slice of the data: deterministic, but the stream depends on N.
    read_threads: threads reading examples (0 suits examples already in memory).
    prefetch: global batches prepared ahead in a background thread (0 = on demand); does not
      change the stream, so a state saved with one setting restores under another.
    """

    seq_len: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = 1
    overlong: Literal["truncate", "drop"] = "truncate"
    packing: Literal["first_fit", "best_fit", "none"] = "first_fit"
    pack_bins: int | None = None
    drop_remainder: bool = False
    pad_id: int = 0
    num_workers: int = 0
    read_threads: int = 0
    prefetch: int = 0

    def __post_init__(self) -> None:
        errors = []
        if self.seq_len < 2:
            errors.append(f"seq_len {self.seq_len} must be >= 2 (one token predicts the next)")
        if self.batch_size < 1:
            errors.append(f"batch_size {self.batch_size} must be >= 1")
        if not 0 <= self.seed < 2**32:
            errors.append(f"seed {self.seed} must be in [0, 2**32)")
        if self.num_epochs is not None and self.num_epochs < 1:
            errors.append(f"num_epochs {self.num_epochs} must be >= 1 or None (forever)")
        if self.overlong not in ("truncate", "drop"):
            errors.append(f"overlong {self.overlong!r} must be 'truncate' or 'drop'")
        if self.packing not in ("first_fit", "best_fit", "none"):
            errors.append(f"packing {self.packing!r} must be 'first_fit', 'best_fit' or 'none'")
        if self.pack_bins is not None and self.pack_bins < 1:
            errors.append(f"pack_bins {self.pack_bins} must be >= 1 or None")
        if self.pad_id < 0:
            errors.append(f"pad_id {self.pad_id} must be >= 0")
        if self.num_workers < 0:
            errors.append(f"num_workers {self.num_workers} must be >= 0")
        if self.read_threads < 0:
            errors.append(f"read_threads {self.read_threads} must be >= 0")
        if self.prefetch < 0:
            errors.append(f"prefetch {self.prefetch} must be >= 0")
        if errors:
            raise ValueError("invalid PipelineConfig: " + "; ".join(errors))

    def replace(self, **changes: Any) -> PipelineConfig:
        return dataclasses.replace(self, **changes)


# ---- examples ------------------------------------------------------------------------------------
def example_arrays(example: Mapping[str, Any], index: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, loss_mask) of one example as int32 vectors; a malformed one names its index."""
    if not isinstance(example, Mapping):
        raise TypeError(f"example {index}: expected a mapping, got {type(example).__name__}")
    missing = [k for k in ("input_ids", "loss_mask") if k not in example]
    if missing:
        raise KeyError(f"example {index}: missing {', '.join(missing)}")
    ids, mask = np.asarray(example["input_ids"]), np.asarray(example["loss_mask"])
    for name, a in (("input_ids", ids), ("loss_mask", mask)):
        if a.ndim != 1:
            raise ValueError(f"example {index}: {name} must be 1-D, got shape {a.shape}")
        if a.size and not np.issubdtype(a.dtype, np.integer) and not np.issubdtype(a.dtype, np.bool_):
            raise ValueError(f"example {index}: {name} must be integers, got {a.dtype}")
    if ids.shape != mask.shape:
        raise ValueError(
            f"example {index}: input_ids {ids.shape} and loss_mask {mask.shape} differ in length"
        )
    if ids.size and ids.min() < 0:
        raise ValueError(f"example {index}: input_ids has a negative id {int(ids.min())}")
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise ValueError(f"example {index}: loss_mask must be 0/1")
    return ids.astype(np.int32), mask.astype(np.int32)


class _Prepare(grain.transforms.MapWithIndex):
    """Validate an example, truncate it, or return None (dropped / empty) for grain to skip."""

    def __init__(self, cfg: PipelineConfig, n: int):
        self.cfg, self.n = cfg, n

    def map_with_index(self, index: int, example: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        # After repeat, index counts across epochs; the source index is index mod n.
        ids, mask = example_arrays(example, index % self.n)
        if ids.size == 0 or (ids.size > self.cfg.seq_len and self.cfg.overlong == "drop"):
            return None
        return {"input_ids": ids[: self.cfg.seq_len], "loss_mask": mask[: self.cfg.seq_len]}


@dataclasses.dataclass(frozen=True)
class ExampleStats:
    """What the pipeline does with the examples of one epoch (before packing).

    `supervised_tokens` counts loss_mask ones after position 0 of each kept example: the tokens
    `next_token_loss` actually predicts (an example's first token has nothing before it).
    """

    examples: int
    kept: int
    truncated: int
    dropped: int
    empty: int
    tokens: int
    supervised_tokens: int
    truncated_tokens: int


def example_stats(examples: Examples, cfg: PipelineConfig) -> ExampleStats:
    """Counts over one pass of `examples` (validating each): overlong ones truncated or dropped,
    empty ones skipped, and the tokens that reach the packer."""
    kept = truncated = dropped = empty = tokens = supervised = cut = 0
    for i in range(len(examples)):
        ids, mask = example_arrays(examples[i], i)
        n = ids.size
        if n == 0:
            empty += 1
            continue
        if n > cfg.seq_len:
            if cfg.overlong == "drop":
                dropped += 1
                continue
            truncated += 1
            cut += n - cfg.seq_len
            ids, mask = ids[: cfg.seq_len], mask[: cfg.seq_len]
        kept += 1
        tokens += ids.size
        supervised += int(mask[1:].sum())
    return ExampleStats(len(examples), kept, truncated, dropped, empty, tokens, supervised, cut)


# ---- rows and batches ----------------------------------------------------------------------------
def _pad_row(ex: dict[str, np.ndarray], seq_len: int, pad_id: int) -> Batch:
    """One example alone in a row (packing "none")."""
    n = ex["input_ids"].size
    row = empty_rows(1, seq_len, pad_id)
    row = {k: v[0] for k, v in row.items()}
    row["input_ids"][:n] = ex["input_ids"]
    row["loss_mask"][:n] = ex["loss_mask"]
    row["segment_ids"][:n] = 1
    row["positions"][:n] = np.arange(n, dtype=np.int32)
    return row


def _rename_packed(row: dict[str, np.ndarray]) -> Batch:
    # grain names packing metadata per feature; both features share one layout.
    return {
        "input_ids": row["input_ids"],
        "loss_mask": row["loss_mask"],
        "segment_ids": row["input_ids_segment_ids"],
        "positions": row["input_ids_positions"],
    }


def empty_rows(n: int, seq_len: int, pad_id: int = 0) -> Batch:
    """`n` all-padding rows: pad_id tokens, mask 0, segment 0, position 0."""
    rows = {k: np.zeros((n, seq_len), np.int32) for k in FIELDS}
    rows["input_ids"][:] = pad_id
    return rows


def _stream_seeds(seed: int) -> tuple[int, int]:
    # Decorrelated 32-bit seeds: grain shuffles epoch e with seed + e, so raw user seeds s and s+1
    # would share all but one epoch's order.
    shuffle_seed, pack_seed = np.random.SeedSequence(seed).generate_state(2)
    return int(shuffle_seed), int(pack_seed)


def fingerprint(cfg: PipelineConfig, num_examples: int) -> dict[str, Any]:
    """The config fields that shape the global stream (not the host split). The examples are
    represented by their count only: reading them all to hash their content would cost a pass."""
    keep = ("seq_len", "batch_size", "seed", "shuffle", "num_epochs", "overlong", "packing")
    fp = {k: getattr(cfg, k) for k in keep}
    fp |= {"pack_bins": cfg.pack_bins or cfg.batch_size, "drop_remainder": cfg.drop_remainder}
    fp |= {"pad_id": cfg.pad_id, "num_workers": cfg.num_workers, "num_examples": num_examples}
    return fp


def global_batches(examples: Examples, cfg: PipelineConfig) -> grain.IterDataset:
    """The global batch stream as a grain `IterDataset` of `{field: int32 [batch_size, T]}`;
    a short last batch comes out short (or dropped), not yet padded."""
    n = len(examples)
    if n == 0:
        raise ValueError("no examples")
    shuffle_seed, pack_seed = _stream_seeds(cfg.seed)
    ds = examples if isinstance(examples, grain.MapDataset) else grain.MapDataset.source(examples)
    # Validate before shuffling: the index an error names is then the caller's index.
    ds = ds.map_with_index(_Prepare(cfg, n))
    if cfg.shuffle:
        ds = ds.shuffle(seed=shuffle_seed)  # a fresh permutation per epoch (seed + epoch)
    ds = ds.repeat(cfg.num_epochs)
    # Examples usually sit in memory already; reader threads would only contend for the GIL.
    read = grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=max(cfg.read_threads, 1) * 16)
    rows = ds.to_iter_dataset(read)  # skips the Nones of dropped / empty examples
    if cfg.packing == "none":
        rows = rows.map(functools.partial(_pad_row, seq_len=cfg.seq_len, pad_id=cfg.pad_id))
    else:
        # The packer fills pack_bins rows, emits them all when an example fits none, and shuffles
        # their order (seeded); its state is the parent's position plus rows already emitted.
        packer = FirstFitPackIterDataset if cfg.packing == "first_fit" else BestFitPackIterDataset
        rows = packer(
            rows,
            length_struct={"input_ids": cfg.seq_len, "loss_mask": cfg.seq_len},
            padding_struct={"input_ids": cfg.pad_id, "loss_mask": 0},
            num_packing_bins=cfg.pack_bins or cfg.batch_size,
            seed=pack_seed,
            shuffle_bins=cfg.shuffle,
        ).map(_rename_packed)
    batches = rows.batch(cfg.batch_size, drop_remainder=cfg.drop_remainder)
    if cfg.num_workers:
        _absl_flags_ready()
        batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    if cfg.prefetch:
        batches = ThreadPrefetchIterDataset(batches, prefetch_buffer_size=cfg.prefetch)
    return batches


def _absl_flags_ready() -> None:
    # grain 0.2.18's worker processes read absl flags, which raise unless parsed; scripts that do
    # not start through absl.app have not parsed them (google/grain#1355). Defaults are what we want.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# ---- the host's iterator -------------------------------------------------------------------------
class PipelineIterator(grain.DatasetIterator):
    """This host's rows of each global batch; a grain `DatasetIterator`, so grain's orbax
    handler can checkpoint it too. State: `{"version", "pipeline": fingerprint, "grain": ...}`."""

    def __init__(self, parent: grain.DatasetIterator, cfg: PipelineConfig, fp: dict, index: int, count: int):
        super().__init__(parent)
        self.cfg, self.fingerprint = cfg, fp
        self.process_index, self.process_count = index, count
        self.host_batch_size = cfg.batch_size // count

    def __next__(self) -> Batch:
        batch = next(self._parent)
        short = self.cfg.batch_size - batch["input_ids"].shape[0]
        if short:  # keep shapes static for jit: pad with rows the loss ignores
            pad = empty_rows(short, self.cfg.seq_len, self.cfg.pad_id)
            batch = {k: np.concatenate([batch[k], pad[k]]) for k in FIELDS}
        # Every host holds the same global batch; each keeps its block of rows (a copy, so the
        # global batch is freed).
        rows = slice(
            self.process_index * self.host_batch_size, (self.process_index + 1) * self.host_batch_size
        )
        return {k: np.ascontiguousarray(batch[k][rows]) for k in FIELDS}

    def get_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "pipeline": dict(self.fingerprint),
            "grain": self._parent.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a jaxpi pipeline state (version {STATE_VERSION}): {str(state)[:200]}")
        # The grain state alone would restore silently into another config and yield a different
        # stream; compare what shapes the stream first.
        theirs = state["pipeline"]
        diff = {k: (theirs.get(k), v) for k, v in self.fingerprint.items() if theirs.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} != now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"pipeline state was saved by a different pipeline ({detail})")
        self._parent.set_state(state["grain"])

    def close(self) -> None:
        self._parent.close()


def _host(process_index: int | None, process_count: int | None, batch_size: int) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax  # only for the defaults: the pipeline itself is numpy

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} must be in [0, process_count {process_count})")
    if batch_size % process_count:
        raise ValueError(
            f"global batch_size {batch_size} is not divisible by process_count {process_count}: "
            "every host needs the same number of rows"
        )
    return process_index, process_count


def make_train_iterator(
    examples: Examples,
    cfg: PipelineConfig,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> PipelineIterator:
    """Training batches for this host: `{input_ids, loss_mask, segment_ids, positions}`, each
    int32 `[batch_size / process_count, seq_len]`. Host defaults come from `jax.process_*()`."""
    index, count = _host(process_index, process_count, cfg.batch_size)
    parent = global_batches(examples, cfg).__iter__()
    return PipelineIterator(parent, cfg, fingerprint(cfg, len(examples)), index, count)


def make_eval_iterator(
    examples: Examples,
    cfg: PipelineConfig,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> PipelineIterator:
    """One deterministic pass in source order (no shuffle), finite; the last batch is padded with
    all-padding rows (loss_mask 0), so a token-weighted loss covers every kept example once.
    `cfg.overlong` still applies (with "drop", overlong examples are not evaluated)."""
    cfg = cfg.replace(shuffle=False, num_epochs=1, drop_remainder=False)
    return make_train_iterator(examples, cfg, process_index=process_index, process_count=process_count)


def save_state(it: PipelineIterator) -> str:
    """The iterator's position as a JSON string (for the trainer's checkpoint)."""
    return json.dumps(it.get_state(), sort_keys=True)


def restore_state(it: PipelineIterator, blob: str | bytes) -> PipelineIterator:
    """Move a fresh iterator (same examples and config) to a saved position; returns it."""
    it.set_state(json.loads(blob))
    return it


# ---- packing statistics --------------------------------------------------------------------------
def batch_stats(batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per-batch counts for logging: rows, tokens (non-padding), padding fraction, segments and
    supervised tokens (the ones the loss predicts: mask 1 and not a segment's first token)."""
    seg, pos = np.asarray(batch["segment_ids"]), np.asarray(batch["positions"])
    real = seg != 0
    starts = real & (pos == 0)
    supervised = (np.asarray(batch["loss_mask"]) == 1) & real & ~starts
    rows, slots = seg.shape[0], seg.size
    return {
        "rows": float(rows),
        "tokens": float(real.sum()),
        "padding_fraction": float(1.0 - real.sum() / slots),
        "segments": float(starts.sum()),
        "supervised_tokens": float(supervised.sum()),
    }


@dataclasses.dataclass(frozen=True)
class PackingStats:
    """One epoch of the single-host stream, measured: `efficiency` = non-padding tokens / token
    slots fed to the model (padding rows of a short last batch included)."""

    batches: int
    rows: int
    tokens: int
    segments: int
    supervised_tokens: int
    seq_len: int

    @property
    def efficiency(self) -> float:
        return self.tokens / max(self.rows * self.seq_len, 1)

    @property
    def supervised_per_row(self) -> float:
        return self.supervised_tokens / max(self.rows, 1)

    @property
    def examples_per_row(self) -> float:
        return self.segments / max(self.rows, 1)


def packing_stats(examples: Examples, cfg: PipelineConfig) -> PackingStats:
    """Run one epoch of the real pipeline (one host, in-process) and count what it packs."""
    cfg = cfg.replace(num_epochs=1, num_workers=0)
    totals = dict.fromkeys(("rows", "tokens", "segments", "supervised_tokens"), 0)
    batches = 0
    for batch in make_train_iterator(examples, cfg, process_index=0, process_count=1):
        batches += 1
        for k, v in batch_stats(batch).items():
            if k in totals:
                totals[k] += int(v)
    return PackingStats(batches=batches, seq_len=cfg.seq_len, **totals)


def packing_efficiency(examples: Examples, cfg: PipelineConfig) -> float:
    """Fraction of non-padding tokens over one epoch (see `packing_stats`)."""
    return packing_stats(examples, cfg).efficiency

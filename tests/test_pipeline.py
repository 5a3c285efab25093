"""The SFT input pipeline: packing, shuffling, host split, resumption, overlong handling, and
agreement of the packed-row contract with the model and the loss."""

import json

import grain
import jax
import numpy as np
import pytest
from etils import epath

from jaxpi.data.pipeline import (
    PipelineConfig,
    batch_stats,
    example_stats,
    make_eval_iterator,
    make_train_iterator,
    packing_efficiency,
    packing_stats,
    restore_state,
    save_state,
)

T = 32


def make_examples(n, *, seed=0, lo=1, hi=T + 8, vocab=500):
    """Random examples; ids start at 1 so a real token is never the pad id 0."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(lo, hi))
        ids = rng.integers(1, vocab, k).astype(np.int64)
        out.append({"input_ids": ids, "loss_mask": rng.integers(0, 2, k), "source": f"s{i}"})
    return out


def key(ids, mask):
    return (np.asarray(ids, np.int32).tobytes(), np.asarray(mask, np.int32).tobytes())


def expected_keys(examples, seq_len, overlong="truncate"):
    keys = []
    for ex in examples:
        ids, mask = np.asarray(ex["input_ids"]), np.asarray(ex["loss_mask"])
        if ids.size == 0 or (ids.size > seq_len and overlong == "drop"):
            continue
        keys.append(key(ids[:seq_len], mask[:seq_len]))
    return keys


def segments(batch, pad_id=0):
    """Check one batch's layout and return the (ids, mask) keys of its segments, row by row."""
    ids, mask, seg, pos = (batch[k] for k in ("input_ids", "loss_mask", "segment_ids", "positions"))
    for a in (ids, mask, seg, pos):
        assert a.dtype == np.int32 and a.shape == ids.shape
    keys = []
    for r in range(ids.shape[0]):
        s = seg[r]
        n_real = int(np.count_nonzero(s))
        # Padding (id 0) only after the last segment, with mask 0, pad tokens and position 0.
        assert (s[:n_real] != 0).all() and (s[n_real:] == 0).all()
        assert (
            (mask[r, n_real:] == 0).all()
            and (ids[r, n_real:] == pad_id).all()
            and (pos[r, n_real:] == 0).all()
        )
        if n_real == 0:  # a row padding a short last batch
            continue
        # Runs of equal ids: ids 1, 2, 3… in order, so adjacent segments differ and each id is one run.
        edges = np.flatnonzero(np.diff(s[:n_real])) + 1
        starts, ends = np.r_[0, edges], np.r_[edges, n_real]
        assert list(s[starts]) == list(range(1, len(starts) + 1))
        for a, b in zip(starts, ends, strict=True):
            np.testing.assert_array_equal(pos[r, a:b], np.arange(b - a))
            keys.append(key(ids[r, a:b], mask[r, a:b]))
    return keys


def collect(it, n=None):
    out = []
    for batch in it:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


ONE = {"process_index": 0, "process_count": 1}


# ---- config ---------------------------------------------------------------------------------------
def test_config_is_validated():
    with pytest.raises(ValueError, match="seq_len") as e:
        PipelineConfig(seq_len=1, batch_size=0, overlong="wrap", packing="greedy", num_epochs=0)
    for field in ("batch_size", "overlong", "packing", "num_epochs"):
        assert field in str(e.value)
    with pytest.raises(ValueError, match="seed"):
        PipelineConfig(seq_len=8, batch_size=2, seed=-1)


def test_batch_size_must_divide_across_hosts():
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by process_count 4"):
        make_train_iterator(
            make_examples(4), PipelineConfig(seq_len=T, batch_size=6), process_index=0, process_count=4
        )
    with pytest.raises(ValueError, match="no examples"):
        make_train_iterator([], PipelineConfig(seq_len=T, batch_size=4), **ONE)
    with pytest.raises(ValueError, match="process_index"):
        make_train_iterator(
            make_examples(4), PipelineConfig(seq_len=T, batch_size=4), process_index=4, process_count=4
        )


def test_malformed_example_names_its_index():
    examples = make_examples(5)
    examples[3] = {"input_ids": np.arange(1, 6), "loss_mask": np.ones(4, np.int32)}
    with pytest.raises(ValueError, match=r"example 3: input_ids .* and loss_mask .* differ"):
        collect(make_train_iterator(examples, PipelineConfig(seq_len=T, batch_size=2, shuffle=False), **ONE))
    examples[3] = {"input_ids": np.arange(1, 6)}
    with pytest.raises(KeyError, match="example 3: missing loss_mask"):
        example_stats(examples, PipelineConfig(seq_len=T, batch_size=2))
    examples[3] = {"input_ids": np.arange(1, 6), "loss_mask": np.full(5, 2)}
    with pytest.raises(ValueError, match="example 3: loss_mask must be 0/1"):
        example_stats(examples, PipelineConfig(seq_len=T, batch_size=2))


# ---- packing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", ["first_fit", "best_fit", "none"])
def test_packing_is_lossless(packing):
    examples = make_examples(61, seed=1)
    examples.append({"input_ids": np.zeros(0, np.int32), "loss_mask": np.zeros(0, np.int32)})  # skipped
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=3, packing=packing, pad_id=0)
    batches = collect(make_train_iterator(examples, cfg, **ONE))
    got = [k for b in batches for k in segments(b)]
    assert sorted(got) == sorted(expected_keys(examples, T))
    if packing == "none":
        assert all((b["segment_ids"] <= 1).all() for b in batches)
    else:  # packing really packs: fewer rows than examples
        assert sum(b["input_ids"].shape[0] for b in batches) < len(got)
        assert max(int(b["segment_ids"].max()) for b in batches) >= 3


def test_pad_id_is_written_into_padding():
    cfg = PipelineConfig(seq_len=T, batch_size=3, pad_id=7, shuffle=False)
    examples = make_examples(10, seed=2, hi=T // 2)
    for ex in examples:  # keep 7 out of the real tokens so padding is recognisable
        ex["input_ids"] = np.where(ex["input_ids"] == 7, 8, ex["input_ids"])
    got = [k for b in collect(make_train_iterator(examples, cfg, **ONE)) for k in segments(b, pad_id=7)]
    assert sorted(got) == sorted(expected_keys(examples, T))


def test_short_last_batch_is_padded_or_dropped():
    examples = make_examples(10, seed=4, lo=T, hi=T + 1)  # exactly one example per row
    padded = collect(
        make_train_iterator(examples, PipelineConfig(seq_len=T, batch_size=4, shuffle=False), **ONE)
    )
    assert len(padded) == 3 and padded[-1]["input_ids"].shape == (4, T)
    assert (padded[-1]["segment_ids"][2:] == 0).all() and (padded[-1]["loss_mask"][2:] == 0).all()
    cfg = PipelineConfig(seq_len=T, batch_size=4, shuffle=False, drop_remainder=True)
    assert len(collect(make_train_iterator(examples, cfg, **ONE))) == 2


# ---- shuffling ------------------------------------------------------------------------------------
def first_tokens(batches):
    return [int(b["input_ids"][r, 0]) for b in batches for r in range(b["input_ids"].shape[0])]


def test_shuffle_is_seeded_and_reshuffles_each_epoch():
    # One example per row, rows of an epoch fill whole batches: row order = example order.
    n = 24
    examples = [{"input_ids": np.full(T, i + 1), "loss_mask": np.ones(T, np.int32)} for i in range(n)]
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=5, num_epochs=3, packing="none")
    run = first_tokens(collect(make_train_iterator(examples, cfg, **ONE)))
    assert run == first_tokens(collect(make_train_iterator(examples, cfg, **ONE)))  # seeded
    epochs = [run[i * n : (i + 1) * n] for i in range(3)]
    assert all(sorted(e) == list(range(1, n + 1)) for e in epochs)  # each epoch is a permutation
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # reshuffled per epoch
    assert epochs[0] != list(range(1, n + 1))
    other = first_tokens(collect(make_train_iterator(examples, cfg.replace(seed=6), **ONE)))
    assert other != run
    plain = first_tokens(collect(make_train_iterator(examples, cfg.replace(shuffle=False), **ONE)))
    assert plain == list(range(1, n + 1)) * 3
    # Packed streams follow the seed too.
    packed = PipelineConfig(seq_len=T, batch_size=4, seed=5)
    ex = make_examples(40, seed=6)
    a, b = (collect(make_train_iterator(ex, packed.replace(seed=s), **ONE)) for s in (5, 6))
    same(a, collect(make_train_iterator(ex, packed, **ONE)))
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=False))


# ---- hosts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [2, 4])
def test_hosts_split_the_global_batch(count):
    examples = make_examples(70, seed=7)
    cfg = PipelineConfig(seq_len=T, batch_size=8, seed=9)
    whole = collect(make_train_iterator(examples, cfg, **ONE))
    # Hosts may also pass a grain MapDataset (e.g. over an array-record source).
    source = grain.MapDataset.source(examples)
    hosts = [
        collect(make_train_iterator(source, cfg, process_index=p, process_count=count)) for p in range(count)
    ]
    assert all(len(h) == len(whole) for h in hosts)
    for i, batch in enumerate(whole):
        for k in batch:
            assert all(h[i][k].shape == (8 // count, T) for h in hosts)
            np.testing.assert_array_equal(np.concatenate([h[i][k] for h in hosts]), batch[k])
    seen = [{k for b in h for k in segments(b)} for h in hosts]
    for p in range(count):
        for q in range(p + 1, count):
            assert not seen[p] & seen[q]  # disjoint examples
    assert sorted(k for h in hosts for b in h for k in segments(b)) == sorted(expected_keys(examples, T))


# ---- resumption -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("packing", "taken", "prefetch"),
    # 7: across the epoch boundary; prefetch: batches made ahead in a thread are not counted as taken.
    [("first_fit", 3, 0), ("first_fit", 7, 0), ("best_fit", 5, 0), ("none", 6, 0), ("first_fit", 5, 3)],
)
def test_resume_from_json_state_continues_exactly(packing, taken, prefetch):
    examples = make_examples(45, seed=10)
    # pack_bins 6 with batch 4: resuming often lands mid-way through a packed group.
    cfg = PipelineConfig(
        seq_len=T, batch_size=4, seed=11, num_epochs=3, packing=packing, pack_bins=6, prefetch=prefetch
    )
    full = collect(make_train_iterator(examples, cfg.replace(prefetch=0), **ONE))
    per_epoch = len(collect(make_train_iterator(examples, cfg.replace(num_epochs=1), **ONE)))
    assert taken < len(full) - 4
    it = make_train_iterator(examples, cfg, **ONE)
    same(collect(it, taken), full[:taken])
    state = json.loads(json.dumps(it.get_state()))  # JSON round trip
    fresh = make_train_iterator(examples, cfg, **ONE)
    fresh.set_state(state)
    same(collect(fresh, 6), full[taken : taken + 6])
    # The helper pair, from the far side of an epoch boundary, to the end of the stream.
    it = make_train_iterator(examples, cfg, **ONE)
    collect(it, per_epoch + 1)
    blob = save_state(it)
    same(collect(restore_state(make_train_iterator(examples, cfg, **ONE), blob)), full[per_epoch + 1 :])


def test_resume_on_each_host_and_with_another_host_count():
    examples = make_examples(50, seed=12)
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=13, num_epochs=None)  # forever
    whole = collect(make_train_iterator(examples, cfg, **ONE), 30)
    it = make_train_iterator(examples, cfg, process_index=1, process_count=2)
    collect(it, 17)
    blob = save_state(it)
    # The state is host-independent: restore it on host 0 of 4.
    it4 = restore_state(make_train_iterator(examples, cfg, process_index=0, process_count=4), blob)
    for i, batch in enumerate(collect(it4, 5)):
        for k in batch:
            np.testing.assert_array_equal(batch[k], whole[17 + i][k][:1])


def test_host_defaults_come_from_jax():
    examples = make_examples(12, seed=21)
    cfg = PipelineConfig(seq_len=T, batch_size=2, seed=1)
    it = make_train_iterator(examples, cfg)
    assert (it.process_index, it.process_count) == (jax.process_index(), jax.process_count()) == (0, 1)
    same(collect(it), collect(make_train_iterator(examples, cfg, **ONE)))


def test_state_from_another_pipeline_is_refused():
    examples = make_examples(20, seed=14)
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=1)
    blob = save_state(make_train_iterator(examples, cfg, **ONE))
    with pytest.raises(ValueError, match="seed: saved 1 != now 2"):
        restore_state(make_train_iterator(examples, cfg.replace(seed=2), **ONE), blob)
    with pytest.raises(ValueError, match="num_examples"):
        restore_state(make_train_iterator(examples[:-1], cfg, **ONE), blob)
    with pytest.raises(ValueError, match="not a jaxpi pipeline state"):
        make_train_iterator(examples, cfg, **ONE).set_state({"next_index": 3})


def test_grain_orbax_checkpoint_handler_round_trip(tmp_path):
    examples = make_examples(30, seed=15)
    cfg = PipelineConfig(seq_len=T, batch_size=2, seed=4, num_epochs=2)
    full = collect(make_train_iterator(examples, cfg, **ONE))
    it = make_train_iterator(examples, cfg, **ONE)
    collect(it, 4)
    (tmp_path / "grain").mkdir()  # orbax creates it in a real checkpoint
    handler = grain.checkpoint.CheckpointHandler()
    handler.save(epath.Path(tmp_path / "grain"), item=it)
    restored = handler.restore(epath.Path(tmp_path / "grain"), item=make_train_iterator(examples, cfg, **ONE))
    same(collect(restored), full[4:])
    # Or as JSON inside the trainer's own orbax checkpoint.
    import orbax.checkpoint as ocp

    collect(it, 3)
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckpt:
        ckpt.save(tmp_path / "json", args=ocp.args.JsonSave(json.loads(save_state(it))))
        state = ckpt.restore(tmp_path / "json", args=ocp.args.JsonRestore())
    same(collect(restore_state(make_train_iterator(examples, cfg, **ONE), json.dumps(state))), full[7:])


def test_worker_processes_are_lossless_and_resumable():
    examples = make_examples(40, seed=16)
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=2, num_workers=2)
    it = make_train_iterator(examples, cfg, **ONE)
    head = collect(it, 3)
    blob = save_state(it)
    tail = collect(it)
    it.close()
    assert sorted(k for b in head + tail for k in segments(b)) == sorted(expected_keys(examples, T))
    fresh = restore_state(make_train_iterator(examples, cfg, **ONE), blob)
    same(collect(fresh), tail)
    fresh.close()


# ---- overlong examples and statistics -------------------------------------------------------------
@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_examples_are_counted(overlong):
    examples = make_examples(40, seed=17, hi=2 * T)
    lengths = np.array([len(ex["input_ids"]) for ex in examples])
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=1, overlong=overlong)
    stats = example_stats(examples, cfg)
    n_long = int((lengths > T).sum())
    assert n_long > 5
    assert stats.examples == 40 and stats.empty == 0
    assert (stats.truncated, stats.dropped) == ((n_long, 0) if overlong == "truncate" else (0, n_long))
    assert stats.kept == 40 - stats.dropped
    kept = expected_keys(examples, T, overlong)
    assert stats.tokens == sum(len(k[0]) // 4 for k in kept)
    assert stats.truncated_tokens == (int((lengths - T).clip(0).sum()) if overlong == "truncate" else 0)
    got = [k for b in collect(make_train_iterator(examples, cfg, **ONE)) for k in segments(b)]
    assert sorted(got) == sorted(kept)


def test_packing_statistics_match_the_stream():
    examples = make_examples(50, seed=18, hi=T // 2)
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=1, pack_bins=8)
    ex, pk = example_stats(examples, cfg), packing_stats(examples, cfg)
    assert pk.tokens == ex.tokens and pk.segments == ex.kept
    assert pk.supervised_tokens == ex.supervised_tokens  # first token of a segment is never predicted
    batches = collect(make_train_iterator(examples, cfg, **ONE))
    assert pk.batches == len(batches) and pk.rows == 4 * len(batches)
    assert pk.efficiency == pytest.approx(ex.tokens / (pk.rows * T))
    assert pk.supervised_per_row == pytest.approx(ex.supervised_tokens / pk.rows)
    assert packing_efficiency(examples, cfg) == pk.efficiency
    unpacked = packing_efficiency(examples, cfg.replace(packing="none"))
    assert 0 < unpacked < 0.5 < pk.efficiency <= 1  # short examples: packing pays
    assert batch_stats(batches[0])["rows"] == 4


def test_eval_iterator_is_one_padded_deterministic_pass():
    examples = make_examples(23, seed=19)
    cfg = PipelineConfig(seq_len=T, batch_size=4, seed=8, num_epochs=None, drop_remainder=True)
    packed = collect(make_eval_iterator(examples, cfg, **ONE))  # finite despite num_epochs=None
    assert sorted(k for b in packed for k in segments(b)) == sorted(expected_keys(examples, T))
    cfg = cfg.replace(packing="none")  # 23 rows: the last batch needs one padding row
    a = collect(make_eval_iterator(examples, cfg, **ONE))
    same(a, collect(make_eval_iterator(examples, cfg, **ONE)))
    keys = [k for b in a for k in segments(b)]
    assert keys == expected_keys(examples, T)  # every example once, in source order
    assert all(b["input_ids"].shape == (4, T) for b in a)
    last = a[-1]
    empty = last["segment_ids"].max(axis=1) == 0
    assert empty.any() and (last["loss_mask"][empty] == 0).all()
    hosts = [collect(make_eval_iterator(examples, cfg, process_index=p, process_count=2)) for p in range(2)]
    for i, batch in enumerate(a):
        np.testing.assert_array_equal(np.concatenate([h[i]["input_ids"] for h in hosts]), batch["input_ids"])


# ---- agreement with the model and the loss --------------------------------------------------------
def test_packed_rows_match_the_model_run_on_each_example_alone():
    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import random_jax_model
    from jaxpi.train.step import next_token_loss

    model = random_jax_model(TINY)
    seq = 48  # segments start inside and across the DeltaNet's 16-token chunks
    rng = np.random.default_rng(20)
    lengths = [13, 21, 9, 30, 5, 17, 26, 11]
    examples = [
        {
            "input_ids": rng.integers(1, TINY.vocab_size, n),
            "loss_mask": (rng.random(n) < 0.7).astype(np.int32),
        }
        for n in lengths
    ]
    cfg = PipelineConfig(seq_len=seq, batch_size=4, seed=21, pack_bins=4)
    batch = next(make_train_iterator(examples, cfg, **ONE))
    assert batch["segment_ids"].max() >= 2
    packed = jax.jit(lambda m, x, s, p: m(x, positions=p, segment_ids=s))(
        model, batch["input_ids"], batch["segment_ids"], batch["positions"]
    )
    # Each example alone in its own row (right-padded, no segment ids: causality keeps the
    # padding out of its logits), one program for all of them.
    found = []
    for r in range(4):
        s = batch["segment_ids"][r]
        for sid in range(1, int(s.max()) + 1):
            idx = np.flatnonzero(s == sid)
            found.append((r, idx[0], idx[-1] + 1))
    alone_ids = np.zeros((len(found), seq), np.int32)
    alone_mask = np.zeros((len(found), seq), np.int32)
    for j, (r, a, b) in enumerate(found):
        alone_ids[j, : b - a] = batch["input_ids"][r, a:b]
        alone_mask[j, : b - a] = batch["loss_mask"][r, a:b]
    alone = jax.jit(lambda m, x: m(x))(model, alone_ids)
    for j, (r, a, b) in enumerate(found):
        x, y = np.asarray(packed[r, a:b], np.float64), np.asarray(alone[j, : b - a], np.float64)
        assert np.linalg.norm(x - y) / np.linalg.norm(y) <= 1e-5, (r, a, b)

    # Per-example losses from the lone logits (log-softmax in float64), weighted by the tokens
    # each one predicts, against next_token_loss on the packed batch.
    z = np.asarray(alone, np.float64)[:, :-1]
    zmax = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
    nll = lse - np.take_along_axis(z, alone_ids[:, 1:, None], -1)[..., 0]
    w = alone_mask[:, 1:].astype(np.float64)
    assert w.sum() == batch_stats(batch)["supervised_tokens"]
    per_example = (nll * w).sum(1) / np.maximum(w.sum(1), 1)
    expected = float(np.dot(per_example, w.sum(1)) / w.sum())
    packed_loss = float(
        jax.jit(next_token_loss)(model, *(batch[k] for k in ("input_ids", "loss_mask", "segment_ids")))
    )
    assert packed_loss == pytest.approx(expected, rel=1e-5)

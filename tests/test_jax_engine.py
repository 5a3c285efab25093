"""The embedded JAX rollout engine on a tiny random Qwen3.5 with LoRA adapters (fp32, CPU).

One engine serves most tests, so its programs compile once: 9 layers (two scanned groups and an
unrolled tail, so both cache layouts are masked per row), adapters with non-zero B everywhere.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpi import TINY, load_hf
from jaxpi.bench.decode import common_prefix
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.rollout import Completion, JaxEngine, RolloutEngine, SamplingParams
from jaxpi.rollout.sampling import first_argmax, nucleus_logprobs, sample_tokens

CFG = TINY.replace(num_hidden_layers=9)
FWD = jax.jit(lambda m, x: m(x))
MAX_LEN = 96
# Engine vs trainer log-probs. Each is a float32 computation of the same float64 truth
# (tests/test_engine_fp64.py: in float64 the two agree to 3e-14), and each misses it by about the
# same amount: measured on that file's scenario, max |log-prob - float64| engine 1.16e-5, trainer
# 1.31e-5. Their gap here measured 8.6e-6 (mean 1.5e-6) over 128 tokens in one run and 1.3e-5 to
# 1.6e-5 in a full `make test` (XLA's CPU dot rounds a [1, 64]x[64, 4] LoRA row and the same row
# inside [49, 64]x[64, 4] an ulp apart; a DeltaNet output norm over heads of rms ~1e-4 scales it by
# up to 1/sqrt(eps) = 1000). A gap bar below either path's own error would test the CPU, so the bar
# is float32's error bar of tests/test_engine_fp64.py (4e-5, ~3x its measurements). Wrong weights
# or an off-by-one position differ by > 1e-2.
TOL = 4e-5
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def randomize_lora(model, seed, scale=0.05):
    state = nnx.state(model, LoRAParam)
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        if str(path[-1]).startswith("lora_b_"):
            var.set_value(scale * jax.random.normal(jax.random.key(seed * 1000 + i), var.get_value().shape))
    nnx.update(model, state)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = load_hf(make_checkpoint(tmp_path_factory.mktemp("ckpt"), CFG, seed=5))[1]
    add_lora(m, LoraConfig(rank=4, alpha=8.0))
    randomize_lora(m, seed=1)
    return m


@pytest.fixture(scope="module")
def engine(model):
    # Prefill chunks of 16 and 1 keep the compile count low; prompts of 5..37 tokens mix both.
    return JaxEngine(model, max_len=MAX_LEN, batch_size=4, prefill_chunks=(16, 1))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 37, 16, 21)]


def trainer_logprobs(model, context, tokens):
    """log_softmax of one uncached forward over context + tokens, at each sampled token.

    The row is right-padded to the cache length (one compile for every call); the model is causal,
    so the padding does not reach the positions read here.
    """
    seq = list(context) + list(tokens)
    ids = jnp.asarray([seq + [0] * (MAX_LEN - len(seq))], jnp.int32)
    logp = jax.nn.log_softmax(FWD(model, ids)[0, : len(seq)].astype(jnp.float32), axis=-1)
    return np.asarray([logp[len(context) - 1 + i, t] for i, t in enumerate(tokens)]), logp


def test_interface(engine):
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, CFG.vocab_size]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], GREEDY)


def test_sampled_logprobs_equal_the_trainers_recomputation(engine, model, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=3)
    out = engine.generate(prompts, params)
    for p, c in zip(prompts, out, strict=True):
        assert c.prompt_len == len(p) and c.finish_reason == "length" and len(c.token_ids) == 12
        ref, _ = trainer_logprobs(model, p, c.token_ids)
        np.testing.assert_allclose(c.logprobs, ref, atol=TOL, rtol=0)
        # The processed distribution (top-p 0.9) gives each kept token more mass than the raw one.
        assert np.all(np.asarray(c.sampling_logprobs) >= np.asarray(c.logprobs) - 1e-6)
    # Same seed, same tokens; another seed, other tokens.
    assert engine.generate(prompts, params) == out
    other = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=4))
    assert [c.token_ids for c in other] != [c.token_ids for c in out]


def test_greedy_is_the_argmax_and_batched_rows_equal_rows_alone(engine, model, prompts):
    batched = engine.generate(prompts, GREEDY)
    for p, c in zip(prompts, batched, strict=True):
        ref, logp = trainer_logprobs(model, p, c.token_ids)
        np.testing.assert_array_equal(c.token_ids, np.argmax(logp[len(p) - 1 : -1], axis=-1))
        np.testing.assert_allclose(c.logprobs, ref, atol=TOL, rtol=0)
        assert c.sampling_logprobs == [0.0] * len(c.token_ids)
        (alone,) = engine.generate([p], GREEDY)
        assert alone.token_ids == c.token_ids
        np.testing.assert_allclose(alone.logprobs, c.logprobs, atol=TOL, rtol=0)


def test_multi_turn_continuation_equals_a_fresh_prefill(engine, model, prompts):
    obs = [[7, 8, 9], list(range(100, 120)), [3], list(range(200, 233))]
    # Turn 1 is sampled, and row 0 ends early on a stop token while the others run on: its
    # cache must not take the tokens the other rows go on sampling.
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)
    probe = engine.generate(prompts, sampled)
    sampled = dataclasses.replace(sampled, stop_token_ids=(probe[0].token_ids[1],))
    sessions = engine.start(prompts)
    turn1 = engine.continue_(sessions, [[]] * 4, sampled)
    assert turn1[0].finish_reason == "stop" and len(turn1[0].token_ids) <= 2
    assert max(len(t.token_ids) for t in turn1) == 6
    turn2 = engine.continue_(sessions, obs, GREEDY)
    engine.close(sessions)
    fresh = engine.generate(
        [p + t.token_ids + o for p, t, o in zip(prompts, turn1, obs, strict=True)], GREEDY
    )
    for p, t1, o, t2, f in zip(prompts, turn1, obs, turn2, fresh, strict=True):
        assert t2.prompt_len == f.prompt_len == len(p) + len(t1.token_ids) + len(o)
        assert t2.token_ids == f.token_ids
        np.testing.assert_allclose(t2.logprobs, f.logprobs, atol=TOL, rtol=0)
        ref, _ = trainer_logprobs(model, p + t1.token_ids + o, t2.token_ids)
        np.testing.assert_allclose(t2.logprobs, ref, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="not live"):
        engine.continue_(sessions[:1], [[1]], GREEDY)


def test_stop_tokens_and_length(engine, prompts):
    (free,) = engine.generate(prompts[:1], GREEDY)
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)  # the stop token may also occur earlier
    (c,) = engine.generate(
        prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))
    )
    assert c.finish_reason == "stop"
    assert c.token_ids == free.token_ids[: first + 1]  # the stop token is included
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    # Rows end independently: a row that stops early leaves the others running.
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,)))
    assert out[0] == c
    # A session whose context reaches max_len ends its turn with "length".
    (s,) = engine.start([prompts[1]])
    (t,) = engine.continue_([s], [list(range(50))], SamplingParams(temperature=0.0, max_new_tokens=15))
    engine.close([s])
    assert t.finish_reason == "length" and t.prompt_len == 87 and len(t.token_ids) == 96 - 87
    with pytest.raises(ValueError, match="max_len"):
        engine.generate([list(range(97))], GREEDY)


def test_small_top_p_only_draws_the_argmax(engine, prompts):
    greedy = engine.generate(prompts, GREEDY)
    for seed in range(3):
        nucleus = engine.generate(
            prompts, SamplingParams(temperature=1.0, top_p=1e-4, max_new_tokens=10, seed=seed)
        )
        assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]
        for c, g in zip(nucleus, greedy, strict=True):
            np.testing.assert_allclose(c.logprobs, g.logprobs, atol=TOL, rtol=0)
            np.testing.assert_allclose(c.sampling_logprobs, 0.0, atol=1e-6)  # the only token kept


def test_draws_follow_the_softmax(model, prompts):
    # 20,000 draws of one step from the model's next-token distribution at temperature 1.
    p = prompts[1]
    logits = FWD(model, jnp.asarray([p + [0] * (MAX_LEN - len(p))], jnp.int32))[0, len(p) - 1]
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)), np.float64)
    n = 20_000
    keys = jax.random.split(jax.random.key(0), n)
    tokens, raw, proc = jax.jit(sample_tokens)(keys, jnp.broadcast_to(logits, (n, logits.shape[0])), 1.0, 1.0)
    np.testing.assert_allclose(raw, np.log(probs[np.asarray(tokens)]), atol=1e-5)
    np.testing.assert_allclose(proc, raw, atol=1e-5)
    counts = np.bincount(np.asarray(tokens), minlength=probs.size)
    # Pearson chi-square over the vocabulary (511 dof: mean 511, sd 32); a wrong distribution
    # (e.g. temperature 0.5 or a uniform draw) lands in the thousands.
    expected = n * probs
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 511 + 6 * 32, chi2
    uniform = np.full_like(probs, n / probs.size)
    assert float(np.sum((counts - uniform) ** 2 / uniform)) > 511 + 6 * 32


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: np.isfinite(np.asarray(nucleus_logprobs(logits, 1.0, p)))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(0.99) == [True, True, True, True]
    np.testing.assert_allclose(np.exp(nucleus_logprobs(logits, 1.0, 0.6))[0, :2], [0.625, 0.375], rtol=1e-6)


def test_top_p_one_keeps_the_tail_and_only_the_chosen_branch_sorts_or_draws():
    # One token holds all but ~4e-13 of the mass: float32's running sum is 1.0 after it, so a cut
    # by "mass before the token < top_p" alone would drop the whole tail at top_p = 1.
    logits = jnp.asarray([[30.0, 0.0, 0.0, 0.0, -5.0]])
    full = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(nucleus_logprobs(logits, 1.0, 1.0), full, rtol=1e-6)
    assert not np.isfinite(np.asarray(nucleus_logprobs(logits, 1.0, 0.9)))[0, 1:].any()
    keys = jax.random.split(jax.random.key(3), 4)
    rows = jnp.broadcast_to(jnp.asarray([[0.5, 0.2, 0.0, -1.0, 0.3]]), (4, 5))
    tokens, raw, proc = jax.jit(sample_tokens)(keys, rows, 0.7, 1.0)
    drawn = jax.vmap(jax.random.categorical)(keys, jax.nn.log_softmax(rows / 0.7))
    np.testing.assert_array_equal(tokens, drawn)
    np.testing.assert_allclose(proc, jax.nn.log_softmax(rows / 0.7)[jnp.arange(4), tokens], rtol=1e-6)
    np.testing.assert_allclose(raw, jax.nn.log_softmax(rows)[jnp.arange(4), tokens], rtol=1e-6)

    # The sort (the nucleus) and the draw sit inside branches on the scalars, never on the
    # greedy path: at 32k tokens the sort alone cost more than the model's step on the CPU.
    def outside_branches(jaxpr):  # primitives run whatever the scalars (nested calls, not cond branches)
        names = set()
        for e in jaxpr.eqns:
            names.add(e.primitive.name)
            if e.primitive.name != "cond":
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    names |= outside_branches(sub)
        return names

    top = outside_branches(jax.make_jaxpr(sample_tokens)(keys, rows, 0.0, 0.5).jaxpr)
    assert "cond" in top and not top & {"sort", "random_bits", "threefry2x32"}


def test_update_weights_changes_outputs_without_recompiling(engine, model, prompts):
    before = engine.generate(prompts, GREEDY)
    compiled = engine.compile_count()
    other = nnx.clone(model)
    randomize_lora(other, seed=2)
    engine.update_weights(nnx.state(other, LoRAParam))  # only the adapters, as a trainer pushes them
    after = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    for p, c in zip(prompts, after, strict=True):
        np.testing.assert_allclose(c.logprobs, trainer_logprobs(other, p, c.token_ids)[0], atol=TOL, rtol=0)
    engine.update_weights(model)  # a whole model works too
    assert engine.generate(prompts, GREEDY) == before
    assert engine.compile_count() == compiled
    wrong = nnx.state(other, LoRAParam)
    leaf = next(v for p, v in nnx.to_flat_state(wrong) if str(p[-1]).startswith("lora_b_"))
    leaf.set_value(jnp.zeros((1, 1)))
    with pytest.raises(ValueError, match="lora_b_"):
        engine.update_weights(wrong)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 virtual devices (tests/conftest.py)")
def test_update_weights_takes_adapters_split_over_a_mesh_or_on_the_host(engine, model, prompts):
    """Adapters as a sharded trainer holds them (split over fsdp on 8 devices, as
    sharding.strategies.FSDP places them) generate what the same adapters on one device do,
    without a new compile: the engine puts each array on its own device. As numpy arrays (what a
    fleet worker receives) they generate the same too."""
    from sharding.mesh import make_mesh
    from sharding.strategies import FSDP, param_shardings

    other = nnx.clone(model)
    randomize_lora(other, seed=3)
    adapters = nnx.state(other, LoRAParam)
    engine.update_weights(adapters)
    want = engine.generate(prompts, GREEDY)
    compiled = engine.compile_count()
    split = jax.device_put(adapters, param_shardings(adapters, FSDP, make_mesh("data=2,fsdp=4")))
    assert any("fsdp" in tuple(x.sharding.spec) for x in jax.tree.leaves(split))
    engine.update_weights(split)
    assert engine.generate(prompts, GREEDY) == want
    assert engine.compile_count() == compiled
    engine.update_weights(jax.tree.map(np.asarray, adapters))
    assert engine.generate(prompts, GREEDY) == want
    engine.update_weights(model)


def test_slots_are_bounded_and_reused(engine, prompts):
    sessions = engine.start(prompts)  # all 4 slots
    with pytest.raises(ValueError, match="slots"):
        engine.start(prompts[:1])
    engine.close(sessions)
    # More prompts than slots run in waves, with keys by prompt index (same as a single wave).
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=1)
    many = engine.generate(prompts + prompts[:2], params)
    assert many[:4] == engine.generate(prompts, params)
    assert all(isinstance(c, Completion) for c in many) and len(many) == 6


def test_a_bf16_engine_on_the_cpu_reads_its_weights_and_cache_as_stored():
    """On XLA:CPU a bf16 model's decode loop holds no float32 copy of a weight or of the
    embedding table, and its KV cache is float32 (a bf16 cache is converted whole for every write
    and read); the float32 cache holds the bf16 keys and values exactly: the same tokens."""
    from jaxpi.config import FULL, LINEAR
    from jaxpi.hf_fixtures import random_jax_model

    m = random_jax_model(TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL)), 4, "bfloat16")
    wide = JaxEngine(m, max_len=40, batch_size=3, prefill_chunks=(4, 1))
    narrow = JaxEngine(m, max_len=40, batch_size=3, prefill_chunks=(4, 1), dtype=jnp.bfloat16)
    k = wide._cache["tail"][1]["k"]
    assert k.dtype == jnp.float32 and k.shape == (3, 2, 40, 32)  # head-major [B, Hkv, S, d]
    hlo = wide.decode_hlo(GREEDY)
    # the matrices (the conv's 4 taps are upcast by the conv itself, a few hundred values)
    flat = nnx.to_flat_state(nnx.state(m, nnx.Param))
    weights = {
        v.get_value().shape for p, v in flat if v.get_value().ndim >= 2 and not str(p[-1]).startswith("conv")
    }
    copies = [s for s in weights if f"f32[{','.join(map(str, s))}]" in hlo]
    assert not copies, f"float32 copies of weights {copies}"
    assert "f32[3,2,40,32]" in narrow.decode_hlo(GREEDY).replace("bf16[3,2,40,32]", "")  # what it avoids
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    a, b = wide.generate(prompts, params), narrow.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def _bf16_model(seed: int = 4):
    from jaxpi.config import FULL, LINEAR
    from jaxpi.hf_fixtures import random_jax_model

    return random_jax_model(TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL)), seed, "bfloat16")


def test_a_bf16_engine_reads_packed_twins_of_its_weights(monkeypatch):
    """Where the CPU has AVX-512 BF16, a bf16 engine packs its projection weights and LM head once,
    when built (`jaxpi.models.packed`), and every product of its decode loop (1 to 256 rows) reads
    those twins: nothing is packed per call, the caller's model is left without twins, and a turn
    streamed 4 tokens per call gives one call's tokens exactly. Its greedy tokens follow an engine
    without twins (XLA's and the few-rows kernel's float32 sums: bf16 near-ties may part them
    late); with no room for a second copy of the weights it has none."""
    from jaxpi.kernels.cpu import rows
    from jaxpi.models.packed import PackedWeight

    m = _bf16_model()
    if not rows.packed_available():
        pytest.skip("no AVX-512 BF16: the packed kernel does not run here")
    long = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2, 7], [1], [8, 8, 8]]
    monkeypatch.setattr("jaxpi.rollout.jax_engine.available_memory", lambda: 0)
    plain = JaxEngine(m, max_len=48, batch_size=6, prefill_chunks=(4, 1))  # no room: no twins
    assert not plain.packed_twins and rows.PACKED_TARGET not in plain.decode_hlo(long)
    reference = plain.generate(prompts, long)
    monkeypatch.undo()
    for batch in (1, 6):
        engine = JaxEngine(m, max_len=48, batch_size=batch, prefill_chunks=(4, 1))
        assert engine.packed_twins
        hlo = engine.decode_hlo(long)
        assert rows.PACKED_TARGET in hlo and rows.PACK_TARGET not in hlo and rows.TARGET not in hlo
    assert not any(isinstance(v, PackedWeight) for _, v in nnx.to_flat_state(nnx.state(m)))
    # the embedding rows are copied alone: no copy of the whole table per call
    vocab, hidden = m.cfg.vocab_size, m.cfg.hidden_size
    assert rows.TAKE_TARGET in hlo and f"u16[{vocab},{hidden}]" not in hlo
    one_call = engine.generate(prompts, long)
    sessions = engine.start(prompts)  # the same turn streamed 4 tokens per call
    try:
        streamed = engine._turn(sessions, [[]] * len(prompts), long, range(len(prompts)), lambda *_: None, 4)
    finally:
        engine.close(sessions)
    assert [c.token_ids for c in streamed] == [c.token_ids for c in one_call]
    assert [c.logprobs for c in streamed] == [c.logprobs for c in one_call]
    for a, b in zip(one_call, reference, strict=True):
        n = common_prefix(a.token_ids, b.token_ids)
        assert n >= 4, (a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs[:n], b.logprobs[:n], atol=0.05)


def test_projections_of_one_input_share_a_joint_twin(monkeypatch):
    """A DeltaNet layer's q, k, v, z, b and a, an attention layer's q, k and v and the MLP's gate
    and up are packed side by side into one joint twin each (`jaxpi.models.packed.JOINT`): the
    decode step makes one native product per input where it made one per projection, and decodes
    bit for bit as the separate twins do (each column summed in the same order)."""
    import re

    from jaxpi.kernels.cpu import rows
    from jaxpi.models import packed

    if not rows.packed_available():
        pytest.skip("no AVX-512 BF16: the packed kernel does not run here")
    m = _bf16_model()  # one DeltaNet and one attention layer
    long = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2, 7], [1], [8, 8, 8]]

    def products(e: JaxEngine) -> int:
        return len(re.findall(rf'custom_call_target="{rows.PACKED_TARGET}"', e.decode_hlo(long)))

    for batch in (1, 6):
        joint = JaxEngine(m, max_len=32, batch_size=batch, prefill_chunks=(4, 1))
        slots = {p for p, v in nnx.to_flat_state(joint._state) if isinstance(v, packed.PackedWeight)}
        names = {"/".join(map(str, p)) for p in slots}
        assert sum(n.endswith(packed.JOINT_SLOT) for n in names) == 4  # 2 mixers, 2 MLPs
        assert not any(n.endswith(("packed_q_proj", "packed_gate_proj", "packed_z_proj")) for n in names)
        # deltanet: joint + out_proj; attention: joint + o_proj; each MLP: joint + down; the head
        assert products(joint) == 2 + 2 + 2 * 2 + 1
        with monkeypatch.context() as mp:
            mp.setattr(packed, "JOINT", ())
            separate = JaxEngine(m, max_len=32, batch_size=batch, prefill_chunks=(4, 1))
            assert products(separate) == (6 + 1) + (3 + 1) + 2 * 3 + 1
        p = prompts[:batch]
        a, b = joint.generate(p, long), separate.generate(p, long)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.logprobs for c in a] == [c.logprobs for c in b]


def test_without_twins_a_long_decode_of_many_rows_packs_per_call():
    """An engine without twins (here: the layers left stacked) packs its weights per decode call
    of >= PACK_MIN_STEPS steps at 5-256 rows, and not in a shorter call."""
    from jaxpi.kernels.cpu import rows
    from jaxpi.rollout.jax_engine import PACK_MIN_STEPS

    if not rows.packed_available():
        pytest.skip("no AVX-512 BF16: the packed kernel does not run here")
    engine = JaxEngine(_bf16_model(), max_len=48, batch_size=6, prefill_chunks=(4, 1), unstack=False)
    assert not engine.packed_twins
    assert rows.PACK_TARGET in engine.decode_hlo(
        SamplingParams(temperature=0.0, max_new_tokens=PACK_MIN_STEPS)
    )
    assert rows.PACK_TARGET not in engine.decode_hlo(
        SamplingParams(temperature=0.0, max_new_tokens=PACK_MIN_STEPS // 2)
    )


def test_packed_twins_follow_new_base_weights_and_not_adapters():
    """After `update_weights` with other base weights (a model, or its Params alone) the engine
    decodes as one built on them, bit for bit (its twins packed anew); adapters alone leave the
    twins as they were and decode as an engine built on the adapted model."""
    from jaxpi.kernels.cpu import rows
    from jaxpi.models import packed

    if not rows.packed_available():
        pytest.skip("no AVX-512 BF16: the packed kernel does not run here")
    a, b = _bf16_model(4), _bf16_model(5)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    engine = JaxEngine(a, max_len=32, batch_size=2, prefill_chunks=(4, 1))

    def twins(e: JaxEngine) -> list[np.ndarray]:
        flat = nnx.to_flat_state(e._state)
        return [np.asarray(v.get_value()) for _, v in flat if isinstance(v, packed.PackedWeight)]

    def same(x: list[Completion], y: list[Completion]) -> None:
        assert [c.token_ids for c in x] == [c.token_ids for c in y]
        assert [c.logprobs for c in x] == [c.logprobs for c in y]

    before = twins(engine)
    engine.update_weights(b)
    same(
        engine.generate(prompts, params),
        JaxEngine(b, max_len=32, batch_size=2, prefill_chunks=(4, 1)).generate(prompts, params),
    )
    engine.update_weights(nnx.state(a, nnx.Param))
    same(
        engine.generate(prompts, params),
        JaxEngine(a, max_len=32, batch_size=2, prefill_chunks=(4, 1)).generate(prompts, params),
    )
    assert all(np.array_equal(x, y) for x, y in zip(twins(engine), before, strict=True))
    lora_a, lora_b = _bf16_model(4), _bf16_model(4)
    for m in (lora_a, lora_b):
        add_lora(m, LoraConfig(rank=4, alpha=8.0))
    randomize_lora(lora_b, seed=3, scale=0.5)
    engine = JaxEngine(lora_a, max_len=32, batch_size=2, prefill_chunks=(4, 1))
    before = twins(engine)
    engine.update_weights(nnx.state(lora_b, LoRAParam))
    assert all(np.array_equal(x, y) for x, y in zip(twins(engine), before, strict=True))
    same(
        engine.generate(prompts, params),
        JaxEngine(lora_b, max_len=32, batch_size=2, prefill_chunks=(4, 1)).generate(prompts, params),
    )


def test_update_weights_of_another_dtype_or_shape_names_the_weight_not_a_twin():
    """Weights the engine cannot take are named as given, before any twin is packed from them: a
    float32 model for a bf16 engine names a weight's dtype (not "a different structure"), a wrong
    attention q_proj names q_proj (not the joint twin packed from it); the engine keeps decoding
    as before."""
    from jaxpi.config import FULL, LINEAR
    from jaxpi.hf_fixtures import random_jax_model
    from jaxpi.kernels.cpu import rows

    if not rows.packed_available():
        pytest.skip("no AVX-512 BF16: the packed kernel does not run here")
    cfg = TINY.replace(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    engine = JaxEngine(random_jax_model(cfg, 4, "bfloat16"), max_len=32, batch_size=2, prefill_chunks=(4, 1))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate([[3, 1, 4], [1, 5]], params)
    f32 = random_jax_model(cfg, 5, "float32")
    for weights in (f32, nnx.state(f32, nnx.Param)):
        with pytest.raises(ValueError, match=r"\['embed'\].* float32, expected .* bfloat16"):
            engine.update_weights(weights)
    wide = nnx.state(random_jax_model(cfg.replace(num_attention_heads=8), 5, "bfloat16"), nnx.Param)
    with pytest.raises(ValueError, match=r"q_proj'\]\.value is \(64, 8, "):
        engine.update_weights(
            nnx.State({"tail": {1: {"mixer": {"q_proj": wide["tail"][1]["mixer"]["q_proj"]}}}})
        )
    after = engine.generate([[3, 1, 4], [1, 5]], params)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 300), levels=st.integers(1, 4), seed=st.integers(0, 9))
def test_first_argmax_is_argmax_ties_included(rows, vocab, levels, seed):
    # few distinct values, so most rows hold their maximum several times: the first one wins
    x = np.random.default_rng(seed).integers(0, levels, (rows, vocab)).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(first_argmax)(x), np.argmax(x, axis=-1))

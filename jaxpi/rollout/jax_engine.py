"""The embedded rollout engine: batched sampling on the model's decode cache, in JAX.

The engine owns a fixed pool of `batch_size` cache rows ("slots", each `max_len` tokens); a
session holds one slot for its lifetime. Every compiled call runs on the whole pool with a per-row
`active` mask, and rows outside the mask are left exactly as they were (the model masks its own
cache writes: an attention layer writes back the T slots it would have written, a DeltaNet layer
keeps its state), so shapes never change with the number of live sessions, prompt lengths or turns:

    prefill(T)   feed T tokens to the active rows          one program per T in `prefill_chunks`
    decode(N)    sample ≤ N tokens per active row          one program per N (a power of two)
                 in a `lax.while_loop`: sample from the last logits, feed the token back, stop
                 the row at a stop token or its budget

Prompts are not padded. A pad token would still enter a Gated DeltaNet layer's recurrent state
(the cache has no way to skip it), so a prompt of n tokens is fed in chunks from
`prefill_chunks` (e.g. 256 + 32·k + 4·j + 1·i): each call takes the largest chunk that some row
still fills, and only the rows that fill it take part. Per-token log-probabilities come from the
logits that sampled the token (no second pass).

Decoding is one `lax.while_loop`, so no host round trip per token. A caller that wants tokens as
they are sampled (`on_tokens`, the server's streams) gets the same loop run `interval` steps per
call: the same program (the step count is an argument, not a shape), the same per-(row, position)
keys and the cache carried between calls, so the tokens are exactly those of one call. On the 2-core CPU, tiny model
(8 layers, 8 rows × 128 tokens) it ran at ~1,900 tokens/s, level with a Python loop over a jitted
single step (~2,100 tokens/s, no row masking): CPU dispatch is cheap, the per-token sync is not
on an accelerator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.host import available_memory
from jaxpi.kernels.cpu import rows
from jaxpi.kernels.dense import NATIVE_ROWS, packing
from jaxpi.models import packed as packed_twins
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
from jaxpi.models.unstack import unstack_layers, unstack_state
from jaxpi.rollout.engine import Completion, SamplingParams, Session
from jaxpi.rollout.sampling import sample_tokens

# Backends on which the engine unstacks the layer groups and keeps a 16-bit model's KV cache in
# float32 by default (see `JaxEngine`).
UNSTACK_ON = ("cpu",)
# Without packed twins (see `JaxEngine`), decode calls of at least this many steps may use the packed
# CPU kernel for products of 5-256 rows (`jaxpi.kernels.dense.packing`): packing every weight once per call (~26 ms for the bench's
# 181 M-parameter model, on top of a 64-step call of ~1.6 s at batch 16) pays back within a few
# steps; a streaming call of `interval` steps does not pack. The engine packs only where the
# machine has memory for a second copy of its bf16 weights (`available_memory`).
PACK_MIN_STEPS = 32


def select_rows(mask: jax.Array, new: dict, old: dict) -> dict:
    """Cache rows from `new` where `mask` [B] is set, else from `old`.

    The batch axis is the one after the stacked-group axis for scanned layers and the first axis
    elsewhere (the layout `Qwen3_5ForCausalLM.init_cache` builds).
    """

    def on_axis(axis: int):
        def pick(n: jax.Array, o: jax.Array) -> jax.Array:
            shape = [1] * n.ndim
            shape[axis] = -1
            return jnp.where(mask.reshape(shape), n, o)

        return pick

    with jax.named_scope("select_rows"):
        out = {"lengths": jnp.where(mask, new["lengths"], old["lengths"])}
        if "groups" in old:
            out["groups"] = jax.tree.map(on_axis(1), new["groups"], old["groups"])
        out["tail"] = jax.tree.map(on_axis(0), new["tail"], old["tail"])
    return out


@dataclasses.dataclass
class _Live:
    slot: int
    length: int  # tokens already in the slot's cache
    pending: list[int]  # tokens appended but not yet fed (the prompt, before the first turn)


def _detach(state: nnx.State) -> nnx.State:
    """The same arrays in new Variable objects: `nnx.split` hands out the model's own Variables,
    and the engine must neither see nor make in-place changes to the caller's model."""
    return jax.tree.map(lambda x: x, state)


def _placed_like(new: Any, current: Any) -> Any:
    """`new` as it is when it sits where `current` does, or on the host (a worker's numpy arrays,
    moved by each call as before); else moved there (gathered if it is split over a mesh),
    committed to those devices only if `current` is: jit compiles anew for a committed argument
    where it had an uncommitted one, so an uncommitted array is made, through a host copy."""
    sharding = getattr(current, "sharding", None)
    if (
        sharding is None
        or not isinstance(new, jax.Array)
        or new.sharding.is_equivalent_to(sharding, new.ndim)
    ):
        return new
    return jax.device_put(new, sharding) if current.committed else jnp.asarray(np.asarray(new))


def _bf16_bytes(state: nnx.State) -> int:
    """Bytes of the bf16 arrays of `state` (what packing copies)."""
    return sum(a.nbytes for a in jax.tree.leaves(state) if getattr(a, "dtype", None) == jnp.bfloat16)


def _is_twin(path: tuple) -> bool:
    """Whether a state path leads to a packed twin (`jaxpi.models.packed`)."""
    return any(str(getattr(k, "key", "")).startswith(packed_twins.PREFIX) for k in path)


def _changes_base(state: nnx.State) -> bool:
    """Whether a (partial) state may hold base weights: any `nnx.Param` or bare array (adapters
    alone, `LoRAParam`s, leave the packed twins as they are)."""
    return any(
        not isinstance(v, nnx.Variable) or isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(state)
    )


def _fits_twice(nbytes: int, available: int | None) -> bool:
    """Whether a second copy of `nbytes` takes at most half the available memory (None: unknown,
    taken as room)."""
    return available is None or 2 * nbytes <= available


def _bucket(n: int) -> int:
    """Decode buffer size for n new tokens: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


class JaxEngine:
    """A `RolloutEngine` on a jaxpi model (base weights plus any LoRA adapters), in-process.

    `max_len` bounds each session's context (prompt + turns + observations); a turn that would
    overflow it ends with finish_reason "length". `batch_size` is the number of sessions that can
    be live at once (and the batch every compiled call runs). `dtype` is the KV cache dtype
    (default: the model's; float32 for a 16-bit model on the CPU). `update_weights` swaps in new weights of the same shapes without
    recompiling (a model, or a state, in the caller's layout).

    `unstack` (default: on the CPU) runs the model with its scanned layer groups unstacked
    (`jaxpi.models.unstack`): the engine then holds its own copy of the groups' weights, and no
    call slices them out of the stacks (on XLA:CPU each slice is a copy of the weight: a copy of
    every weight per prefill call and per decode call). Off, the engine shares the caller's
    arrays and pays those copies.

    On a CPU with AVX-512 BF16 (unstacked), a bf16 engine packs its projection weights and its LM
    head once, when built and when `update_weights` brings new base weights, into twins
    (`jaxpi.models.packed`) that every product of 1-256 rows reads through the packed kernel:
    decode steps at any batch up to 256, prefill chunks, streamed turns (a second copy of the bf16
    weights, made only where the machine has the memory for it: `packed_twins` says whether).
    Without twins (`unstack=False`, or no room), a bf16 engine of more than 4 rows packs its weights
    per decode call of at least `PACK_MIN_STEPS` steps.
    """

    def __init__(
        self,
        model: Qwen3_5ForCausalLM,
        *,
        max_len: int,
        batch_size: int = 8,
        dtype: jnp.dtype | str | None = None,
        prefill_chunks: Sequence[int] = (256, 32, 4, 1),
        unstack: bool | None = None,
    ):
        chunks = tuple(sorted({int(c) for c in prefill_chunks}, reverse=True))
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not chunks or chunks[-1] != 1:  # sorted descending: the smallest must be 1
            raise ValueError(f"prefill_chunks must be positive and include 1, got {prefill_chunks}")
        self.max_len, self.batch_size, self.prefill_chunks = max_len, batch_size, chunks
        self.vocab_size = model.cfg.vocab_size
        # The layout callers' weights come in (update_weights), and whether the engine unstacks it.
        self._source_cfg = model.cfg
        self.unstacked = jax.default_backend() in UNSTACK_ON if unstack is None else bool(unstack)
        if self.unstacked:
            model = unstack_layers(model)
        # Where the CPU runs the packed kernel, the bf16 projection weights and the LM head are
        # packed once, here, into twins every product of 1-256 rows reads (`jaxpi.models.packed`):
        # a second copy of them, so only where the machine has room for it.
        bf16 = _bf16_bytes(nnx.state(model))
        self.packed_twins = bool(
            self.unstacked and bf16 and rows.packed_available() and _fits_twice(bf16, available_memory())
        )
        if self.packed_twins:
            model = nnx.merge(*nnx.split(model))  # the engine's own modules: the caller's stay as they are
            packed_twins.attach(model)
        self._graphdef, state = nnx.split(model)
        self._state = _detach(state)
        # Without twins, long decode calls may pack the bf16 weights for the kernel of 5-256 rows
        # per call (a second copy of them for the call, so only where there is room for it).
        self._pack = (
            not self.packed_twins
            and batch_size > NATIVE_ROWS
            and rows.packed_available()
            and _fits_twice(bf16, available_memory())
        )
        if dtype is None and jax.default_backend() in UNSTACK_ON and jnp.dtype(model.dtype).itemsize < 4:
            # XLA:CPU converts a 16-bit cache to float32 whole for each write (a scatter) and
            # each read (the attention's dots), every token: float32 holds the model's bf16 keys
            # and values exactly, at twice the bytes.
            dtype = jnp.float32
        self._cache = model.init_cache(batch_size, max_len, dtype)
        # Next-token logits and log-probs in at least float32 (bf16 upcast); a float64 model keeps
        # float64, so numerical checks of the engine against the trainer see no float32 floor.
        logit_dtype = jnp.promote_types(model.embed[...].dtype, jnp.float32)
        self._last = jnp.zeros((batch_size, self.vocab_size), logit_dtype)  # each slot's next-token logits
        self._slots: list[int | None] = [None] * batch_size
        self._live: dict[int, _Live] = {}
        self._next_id = 0
        graphdef = self._graphdef

        def forward(
            state: nnx.State, tokens: jax.Array, cache: dict, active: jax.Array
        ) -> tuple[jax.Array, dict]:
            # rows outside `active` keep their cache rows: the model masks its own cache writes
            return nnx.merge(graphdef, state)(tokens, cache=cache, active=active)

        def prefill(state, cache, last, tokens, active):
            logits, cache = forward(state, tokens, cache, active)  # [B, T, V]
            last = jnp.where(active[:, None], logits[:, -1].astype(logit_dtype), last)
            return cache, last

        def decode(state, cache, last, budget, row_keys, temperature, top_p, stop_ids, steps, *, n_cap, pack):
            with packing(pack):
                return _decode_loop(
                    state, cache, last, budget, row_keys, temperature, top_p, stop_ids, steps, n_cap
                )

        def _decode_loop(state, cache, last, budget, row_keys, temperature, top_p, stop_ids, steps, n_cap):
            b = budget.shape[0]
            carry = (
                jnp.int32(0),
                cache,
                last,
                budget <= 0,  # done
                jnp.zeros((b, n_cap), jnp.int32),  # tokens
                jnp.zeros((b, n_cap), logit_dtype),  # raw log-probs
                jnp.zeros((b, n_cap), logit_dtype),  # sampling log-probs
                jnp.zeros((b,), jnp.int32),  # tokens emitted
                jnp.zeros((b,), bool),  # ended on a stop token
            )

            def cond(c):
                return (c[0] < jnp.minimum(steps, n_cap)) & ~jnp.all(c[3])

            def body(c):
                i, cache, last, done, toks, raw, proc, n_out, stopped = c
                live = ~done
                # Key per (row, position in the session): independent of batch layout and turn.
                with jax.named_scope("sample"):
                    keys = jax.vmap(jax.random.fold_in)(row_keys, cache["lengths"])
                    tok, tok_raw, tok_proc = sample_tokens(keys, last, temperature, top_p)
                toks, raw, proc = (
                    toks.at[:, i].set(tok),
                    raw.at[:, i].set(tok_raw),
                    proc.at[:, i].set(tok_proc),
                )
                n_out = n_out + live
                hit = live & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
                # Every emitted token enters the cache, so the next turn continues after it.
                logits, cache = forward(state, tok[:, None], cache, live)
                with jax.named_scope("next_logits"):
                    last = jnp.where(live[:, None], logits[:, 0].astype(logit_dtype), last)
                done = done | hit | (n_out >= budget)
                return i + 1, cache, last, done, toks, raw, proc, n_out, stopped | hit

            out = jax.lax.while_loop(cond, body, carry)
            return out[1], out[2], out[4:]

        def reset(cache, last, mask):
            zeros = jax.tree.map(jnp.zeros_like, cache)
            return select_rows(mask, zeros, cache), jnp.where(mask[:, None], 0.0, last)

        # The pool (cache, last logits) is donated: each call replaces it in place.
        self._prefill = jax.jit(prefill, donate_argnums=(1, 2))
        self._decode = jax.jit(decode, static_argnames=("n_cap", "pack"), donate_argnums=(1, 2))
        self._reset = jax.jit(reset, donate_argnums=(0, 1))

    # ---- weights --------------------------------------------------------------------------------
    def update_weights(self, model_or_state: Qwen3_5ForCausalLM | nnx.State) -> None:
        """Use new weights from now on: a model of the same structure, or a (partial) state such
        as `nnx.state(model, LoRAParam)`. Shapes and dtypes must match, so nothing recompiles."""
        if isinstance(model_or_state, nnx.Module):
            model = unstack_layers(model_or_state) if self.unstacked else model_or_state
            self._check_like(nnx.state(model))  # before packing: errors name the weights given
            if self.packed_twins:
                model = nnx.merge(*nnx.split(model))
                packed_twins.attach(model)
            _, state = nnx.split(model)
        else:
            if self.unstacked:
                model_or_state = unstack_state(self._source_cfg, model_or_state)
            current = nnx.merge(self._graphdef, _detach(self._state))
            nnx.update(current, model_or_state)
            self._check_like(nnx.state(current))
            if self.packed_twins and _changes_base(model_or_state):
                packed_twins.attach(current)  # the base weights moved: their twins are packed anew
            _, state = nnx.split(current)
        state = _detach(state)
        self._check_like(state, twins=True)
        # Each array where the engine keeps its own: a trainer's may be split over a mesh (adapters
        # sharded like their weights), which would otherwise compile the programs anew for it.
        self._state = jax.tree.map(_placed_like, state, self._state)

    def _check_like(self, state: nnx.State, *, twins: bool = False) -> None:
        """Raises naming the first weight whose path, shape or dtype differs from the engine's;
        the packed twins (which follow their weights) are compared only with `twins`."""

        def leaves(s: nnx.State) -> list:
            flat = jax.tree_util.tree_flatten_with_path(_detach(s))[0]
            return [(p, x) for p, x in flat if twins or not _is_twin(p)]

        old, new = leaves(self._state), leaves(state)
        if [p for p, _ in old] != [p for p, _ in new]:
            missing = sorted(
                {jax.tree_util.keystr(p) for p, _ in old} ^ {jax.tree_util.keystr(p) for p, _ in new}
            )
            raise ValueError(
                "update_weights: the new weights have a different structure (adapters added or removed?): "
                f"{', '.join(missing[:4]) or 'the order of the weights'} differ"
            )
        for (path, a), (_, b) in zip(old, new, strict=True):
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                name = jax.tree_util.keystr(path)
                raise ValueError(
                    f"update_weights: {name} is {b.shape} {b.dtype}, expected {a.shape} {a.dtype}"
                )

    def compile_count(self) -> int:
        """Programs compiled so far (prefill chunk sizes, decode buffer sizes, reset)."""
        return sum(f._cache_size() for f in (self._prefill, self._decode, self._reset))

    # ---- sessions -------------------------------------------------------------------------------
    def start(self, prompts: Sequence[Sequence[int]]) -> list[Session]:
        prompts = [self._check_tokens(p, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_len={self.max_len}")
        free = [s for s, owner in enumerate(self._slots) if owner is None]
        if len(prompts) > len(free):
            raise ValueError(
                f"{len(prompts)} new sessions but only {len(free)} of {self.batch_size} slots are free; "
                "close finished sessions or build the engine with a larger batch_size"
            )
        mask = np.zeros(self.batch_size, bool)
        sessions = []
        for p, slot in zip(prompts, free, strict=False):
            sid, self._next_id = self._next_id, self._next_id + 1
            self._slots[slot] = sid
            self._live[sid] = _Live(slot=slot, length=0, pending=list(p))
            mask[slot] = True
            sessions.append(Session(sid))
        if sessions:
            self._cache, self._last = self._reset(self._cache, self._last, jnp.asarray(mask))
        return sessions

    def close(self, sessions: Sequence[Session]) -> None:
        for s in sessions:
            live = self._live.pop(s.id, None)
            if live is not None:
                self._slots[live.slot] = None

    def continue_(
        self,
        sessions: Sequence[Session],
        observations: Sequence[Sequence[int]],
        params: SamplingParams,
    ) -> list[Completion]:
        return self._turn(sessions, observations, params, row_ids=range(len(sessions)))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        while len(out) < len(prompts):
            free = self._slots.count(None)
            if free == 0:
                raise ValueError("no free slots: every slot holds a live session; close some first")
            wave = prompts[len(out) : len(out) + free]
            sessions = self.start(wave)
            try:
                rows = range(len(out), len(out) + len(wave))  # keys follow the prompt's index
                out += self._turn(sessions, [[]] * len(wave), params, row_ids=rows)
            finally:
                self.close(sessions)
        return out

    # ---- one turn -------------------------------------------------------------------------------
    def _turn(
        self,
        sessions: Sequence[Session],
        observations: Sequence[Sequence[int]],
        params: SamplingParams,
        row_ids: Sequence[int],
        on_tokens: Callable[[int, list[int], list[float]], bool | None] | None = None,
        interval: int = 1,
    ) -> list[Completion]:
        """One turn for each session. With `on_tokens`, the loop returns to the host every
        `interval` tokens and calls `on_tokens(i, new_ids, new_logprobs)` for each session i
        that sampled some; a False return ends that session's turn there."""
        if len(sessions) != len(observations):
            raise ValueError(f"{len(sessions)} sessions but {len(observations)} observations")
        if len({s.id for s in sessions}) != len(sessions):
            raise ValueError("a session appears twice in one call")
        lives, added = [], []
        for s, obs in zip(sessions, observations, strict=True):  # check all before changing any
            if s.id not in self._live:
                raise ValueError(f"session {s.id} is not live (closed, or from another engine)")
            live = self._live[s.id]
            obs = self._check_tokens(obs, f"observation for session {s.id}")
            total = live.length + len(live.pending) + len(obs)
            if total > self.max_len:
                raise ValueError(f"session {s.id}: {total} tokens of context exceed max_len={self.max_len}")
            lives.append(live)
            added.append(obs)
        for live, obs in zip(lives, added, strict=True):
            live.pending += obs
        self._feed(lives)
        budget = np.zeros(self.batch_size, np.int32)
        keys = np.zeros(self.batch_size, np.int32)
        for live, row in zip(lives, row_ids, strict=False):
            budget[live.slot] = min(params.max_new_tokens, self.max_len - live.length)
            keys[live.slot] = row
        n_cap = _bucket(min(params.max_new_tokens, self.max_len))
        steps = n_cap if on_tokens is None else max(1, min(int(interval), n_cap))
        sampling = self._sampling_args(params, keys)
        slots = [live.slot for live in lives]
        got: dict[int, tuple[list[int], list[float], list[float]]] = {s: ([], [], []) for s in slots}
        ended = np.zeros(self.batch_size, bool)  # stopped on a stop token
        while budget.any():
            self._cache, self._last, (toks, raw, proc, n_out, stopped) = self._decode(
                self._state,
                self._cache,
                self._last,
                jnp.asarray(budget),
                *sampling,
                jnp.int32(steps),
                n_cap=n_cap,
                pack=self._pack and steps >= PACK_MIN_STEPS,
            )
            toks, raw, proc, n_out, stopped = jax.device_get((toks, raw, proc, n_out, stopped))
            for i, slot in enumerate(slots):
                n = int(n_out[slot])
                if n == 0:
                    continue
                ids, lps, sps = got[slot]
                ids += toks[slot, :n].tolist()
                lps += raw[slot, :n].tolist()
                sps += proc[slot, :n].tolist()
                budget[slot] -= n
                ended[slot] |= bool(stopped[slot])
                if stopped[slot]:
                    budget[slot] = 0
                if on_tokens is not None and on_tokens(i, ids[-n:], lps[-n:]) is False:
                    budget[slot] = 0  # the caller gave up on this row (finish "length")
        out = []
        for live in lives:
            ids, lps, sps = got[live.slot]
            out.append(
                Completion(
                    token_ids=ids,
                    logprobs=lps,
                    sampling_logprobs=sps,
                    finish_reason="stop" if ended[live.slot] else "length",
                    prompt_len=live.length,
                )
            )
            live.length += len(ids)
        return out

    def _sampling_args(self, params: SamplingParams, keys: np.ndarray) -> tuple[jax.Array, ...]:
        """The decode program's sampling arguments: a key per row (the seed folded with `keys`),
        temperature, top_p, and the stop ids padded to a multiple of 8 (fewer programs)."""
        stops = np.full(-(-max(len(params.stop_token_ids), 1) // 8) * 8, -1, np.int32)
        stops[: len(params.stop_token_ids)] = params.stop_token_ids
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(params.seed), jnp.asarray(keys))
        return row_keys, jnp.float32(params.temperature), jnp.float32(params.top_p), jnp.asarray(stops)

    def decode_hlo(self, params: SamplingParams) -> str:
        """The optimized HLO of the decode program a turn with `params` runs (compiled again:
        for profiles, which match trace events to its instructions)."""
        n_cap = _bucket(min(params.max_new_tokens, self.max_len))
        budget = jnp.zeros(self.batch_size, jnp.int32)
        sampling = self._sampling_args(params, np.zeros(self.batch_size, np.int32))
        lowered = self._decode.lower(
            self._state,
            self._cache,
            self._last,
            budget,
            *sampling,
            jnp.int32(n_cap),
            n_cap=n_cap,
            pack=self._pack and n_cap >= PACK_MIN_STEPS,
        )
        return lowered.compile().as_text()

    def _feed(self, lives: list[_Live]) -> None:
        """Prefill every session's pending tokens into its slot, largest fitting chunk first."""
        remaining = np.zeros(self.batch_size, np.int64)
        for live in lives:
            remaining[live.slot] = len(live.pending)
        offset = np.zeros(self.batch_size, np.int64)
        by_slot = {live.slot: live for live in lives}
        while remaining.max() > 0:
            t = next(c for c in self.prefill_chunks if c <= remaining.max())
            active = remaining >= t
            tokens = np.zeros((self.batch_size, t), np.int32)
            for slot in np.flatnonzero(active):
                tokens[slot] = by_slot[slot].pending[offset[slot] : offset[slot] + t]
            self._cache, self._last = self._prefill(
                self._state, self._cache, self._last, jnp.asarray(tokens), jnp.asarray(active)
            )
            offset += np.where(active, t, 0)
            remaining -= np.where(active, t, 0)
        for live in lives:
            live.length += len(live.pending)
            live.pending = []

    def _check_tokens(self, tokens: Sequence[int], what: str) -> list[int]:
        ids = [int(t) for t in tokens]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids

"""The Qwen3.5 text model (`Qwen3_5ForCausalLM`) in Flax NNX.

The hybrid stack dispatches on data: `cfg.layer_types` (from HF's config) decides which layers are
Gated DeltaNet and which are gated attention. Layers are scanned in groups of one period of that
pattern (4 for Qwen3.5: three DeltaNet layers then one attention layer): up to two groups run
unrolled, with no loop; deeper stacks loop over one group per step, so the compiled program
holds at most two group bodies whatever the depth. Layers past the last whole group form an
unrolled tail.

    h      = embed[input_ids]                                  [B, T, D]
    h      = groups(h) → tail(h)                               (DecoderLayer each)
    logits = rmsnorm(h) · W_lm   (W_lm = embedᵀ when tied)     [B, T, V]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpi.axes import current_resolver
from jaxpi.config import QwenConfig
from jaxpi.kernels.attention import rope_tables
from jaxpi.kernels.cpu import rows
from jaxpi.kernels.dense import dense, packed_product
from jaxpi.kernels.norms import rms_norm
from jaxpi.models import packed as packed_twins
from jaxpi.models.layers import DecoderLayer, init_layer_cache, norm_init
from jaxpi.models.params import constrain, normal, param

REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the MLP's gate and up projections (named in jaxpi.models.layers.MLP), everything else recomputed
    "mlp": jax.checkpoint_policies.save_only_these_names("mlp_gate", "mlp_up"),
    # and each layer's output: in a remat'd group of layers the next layer's input is then kept
    # rather than rebuilt, which with "mlp" recomputes the down projection of every layer but the
    # group's last (3 of 4 per group in the 27B profile: 87 ms of its step; [B, T, D] per layer)
    "mlp_out": jax.checkpoint_policies.save_only_these_names("mlp_gate", "mlp_up", "layer_out"),
}

# Stacks of up to this many layer groups are unrolled. A loop copies each step's slice of the
# stacked weights (dynamic-slice) and stacks its residuals for the backward
# (dynamic-update-slice): on the CPU these copies took a fifth of an 8-layer step, which
# unrolled (2 groups, 8 Qwen3.5 layers) has static slices instead. Deeper stacks loop over ONE
# group per step: a loop body of two groups (461 loop-carried arrays at tiny) compiled 1.5x
# slower than a body of one (tiny preset, 16 layers: 31 s against 20 s of CPU) and its step ran
# 1.7x slower (mid preset, 16 layers, interleaved: 56 s against 33 s), so unrolling pays only
# where it removes the loop (docs/performance.md, compile time against depth).
UNROLL_GROUPS = 2


def scan_unroll(groups: int) -> int:
    """`unroll` of the layer-group scan: every step (no loop) up to `UNROLL_GROUPS`, else 1."""
    return UNROLL_GROUPS if groups <= UNROLL_GROUPS else 1


def layer_plan(cfg: QwenConfig) -> tuple[int, int]:
    """(period P, groups G): layers [0, P·G) are scanned in G groups of P, the rest unrolled.

    P is the shortest period of `layer_types` that repeats at least twice; with `scan_layers`
    off, or no repeating pattern, G = 0 and every layer is in the tail.
    """
    types, n = cfg.layer_types, cfg.num_hidden_layers
    if not cfg.scan_layers:
        return 0, 0
    for p in range(1, n // 2 + 1):
        g = n // p
        if all(types[i] == types[i % p] for i in range(g * p)):
            return p, g
    return 0, 0


def layer_location(cfg: QwenConfig, i: int) -> tuple[str, int, int]:
    """Where HF layer i lives: ("groups", position in the group, group index) or ("tail", j, -1)."""
    p, g = layer_plan(cfg)
    if i < p * g:
        return "groups", i % p, i // p
    return "tail", i - p * g, -1


class LayerGroup(nnx.Module):
    """One period of the layer pattern; instantiated under `nnx.vmap`, so each param is stacked."""

    def __init__(self, cfg: QwenConfig, types: tuple[str, ...], *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.blocks = nnx.List([DecoderLayer(cfg, t, dtype=dtype, rngs=rngs) for t in types])

    def __call__(
        self,
        h: jax.Array,
        caches: tuple | None,
        *,
        first_layer: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        **kw: Any,
    ) -> tuple[jax.Array, tuple | None]:
        """`first_layer` (the HF index of this group's first layer, traced under scan) is needed
        only with a `dropout_key`: each layer's key is the model key folded with its HF index."""
        new = []
        for j, block in enumerate(self.blocks):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, first_layer + j)
            h, c = block(h, cache=None if caches is None else caches[j], dropout_key=key, **kw)
            new.append(c)
        return h, (None if caches is None else tuple(new))


class Qwen3_5ForCausalLM(nnx.Module):
    def __init__(self, cfg: QwenConfig, *, dtype: jnp.dtype | str = jnp.float32, rngs: nnx.Rngs):
        dtype = jnp.dtype(dtype)
        self.cfg = cfg
        self.dtype = dtype
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed = param(rngs, (v, d), ("vocab", "embed"), normal(), dtype)
        p, g = layer_plan(cfg)
        if g:
            pattern = cfg.layer_types[:p]

            @nnx.split_rngs(splits=g)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_groups(r: nnx.Rngs) -> LayerGroup:
                return LayerGroup(cfg, pattern, dtype=dtype, rngs=r)

            self.groups = make_groups(rngs)
        else:
            self.groups = None
        self.tail = nnx.List([DecoderLayer(cfg, t, dtype=dtype, rngs=rngs) for t in cfg.layer_types[p * g :]])
        self.norm = param(rngs, (d,), ("embed",), norm_init(cfg), dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else param(rngs, (d, v), ("embed", "vocab"), normal(), dtype)
        )

    # ---- forward ------------------------------------------------------------------------------
    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: dict | None = None,
        *,
        dropout_key: jax.Array | None = None,
        active: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, dict]:
        """Logits `[B, T, V]` for `input_ids` `[B, T]`; with `cache`, returns `(logits, new_cache)`.

        `segment_ids` `[B, T]` packs several sequences per row: attention never crosses a segment
        boundary and the DeltaNet conv window and state restart at each one; positions then
        default to the offset within each segment. With a cache (prefill or decode), row b's new
        tokens take positions `cache["lengths"][b] + t`.

        `dropout_key` (a PRNG key; a trainer passes a fresh one per step) switches on LoRA dropout
        at the adapters' rate; None (the default, for evaluation and decoding) means no dropout.
        The same key gives the same masks, whether layers are scanned or not.

        `active` `[B]` bool (with a cache): only these rows take the tokens; the others' cache
        rows (and lengths) come back exactly as they were, their logits are meaningless.
        """
        hidden, new_cache = self.hidden_states(
            input_ids, positions, segment_ids, cache, dropout_key=dropout_key, active=active
        )
        logits = self.logits(hidden, inference=cache is not None)
        return logits if cache is None else (logits, new_cache)

    def logits(self, hidden: jax.Array, *, inference: bool = False) -> jax.Array:
        """`inference` (never differentiated): float32 accumulation, rounded once (`dense`)."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        # Logits in the activation dtype (as transformers); the loss upcasts to float32.
        with jax.named_scope("lm_head"):
            twin = getattr(self, packed_twins.LM_HEAD, None) if inference else None
            logits = None if twin is None else packed_product("btd,dv->btv", hidden, twin[...], w.shape)
            if logits is None:
                logits = (
                    dense("btd,dv->btv", hidden, w) if inference else jnp.einsum("btd,dv->btv", hidden, w)
                )
        return constrain(logits, ("batch", "seq", "vocab"))

    def hidden_states(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: dict | None = None,
        *,
        dropout_key: jax.Array | None = None,
        active: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """Final-normed hidden states `[B, T, D]` (the LM head is left to the caller's loss)."""
        cfg = self.cfg
        b, t = input_ids.shape
        lengths = None
        if active is not None and cache is None:
            raise ValueError("active selects rows of a decode cache: pass a cache with it")
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with a decode cache")
            lengths = cache["lengths"]
            if positions is None:
                positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        elif positions is None:
            positions = (
                segment_positions(segment_ids)
                if segment_ids is not None
                else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            )
        rope = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, self.embed.get_value().dtype)
        kw = {"rope": rope, "positions": positions, "segment_ids": segment_ids, "lengths": lengths}
        if active is not None:
            kw["active"] = active
        h = embed_rows(self.embed[...], input_ids, inference=cache is not None)
        if cfg.pad_token_id is not None:
            # nn.Embedding(padding_idx=pad): the pad row's lookups pass no gradient to the table
            # (the row stays as trained; a tied LM head still trains it through the logits)
            h = jnp.where((input_ids == cfg.pad_token_id)[..., None], jax.lax.stop_gradient(h), h)
        h = constrain(h, ("batch", "seq", "embed"))
        new_cache: dict[str, Any] | None = None
        if cache is not None:
            new_cache = {"lengths": lengths + (t if active is None else jnp.where(active, t, 0))}
        p, g = layer_plan(cfg)
        if self.groups is not None:
            h, group_cache = self._scan_groups(
                h, None if cache is None else cache["groups"], kw, dropout_key=dropout_key
            )
            if new_cache is not None:
                new_cache["groups"] = group_cache
        tail_cache = []
        for j, block in enumerate(self.tail):
            block_kw = kw
            if dropout_key is not None:  # the tail's layer j is HF layer P·G + j
                block_kw = {**kw, "dropout_key": jax.random.fold_in(dropout_key, p * g + j)}
            h, c = self._run_block(block, h, None if cache is None else cache["tail"][j], block_kw)
            tail_cache.append(c)
        if new_cache is not None:
            new_cache["tail"] = tuple(tail_cache)
        return rms_norm(
            h, self.norm[...], cfg.rms_norm_eps, impl=cfg.norm_impl, offset=cfg.norm_offset
        ), new_cache

    def _run_block(self, block: DecoderLayer, h: jax.Array, cache: dict | None, kw: dict) -> tuple:
        # Functional (split/merge) rather than nnx.remat: the block's variables may come from an
        # outer trace (frozen weights closed over by a LoRA gradient), which nnx.remat would try to
        # write back into.
        graphdef, state = nnx.split(block)

        def run(state, h, cache):
            return nnx.merge(graphdef, state)(h, cache=cache, **kw)

        if self.cfg.remat != "none":
            run = jax.checkpoint(run, policy=REMAT[self.cfg.remat])
        return run(state, h, cache)

    def _scan_groups(
        self, h: jax.Array, caches: tuple | None, kw: dict, *, dropout_key: jax.Array | None = None
    ) -> tuple[jax.Array, tuple | None]:
        graphdef, state = nnx.split(self.groups)
        p, g = layer_plan(self.cfg)
        # With dropout, each scan step also takes its group's first HF layer index.
        firsts = None if dropout_key is None else jnp.arange(g, dtype=jnp.int32) * p

        def body(x, xs):
            st, c, first = xs
            group_kw = kw if first is None else {**kw, "first_layer": first, "dropout_key": dropout_key}
            return nnx.merge(graphdef, st)(x, c, **group_kw)

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT[self.cfg.remat])
        with jax.named_scope("layer_groups"):
            h, new = jax.lax.scan(body, h, (state, caches, firsts), unroll=scan_unroll(g))
        return h, new

    # ---- decode cache ---------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype | None = None) -> dict:
        """An empty cache for `max_len` tokens per row: KV for attention layers, conv window and
        recurrent state (float32) for DeltaNet layers, and each row's length so far."""
        cfg, dtype = self.cfg, jnp.dtype(dtype or self.dtype)
        p, g = layer_plan(cfg)
        cache: dict[str, Any] = {"lengths": jnp.zeros((batch,), jnp.int32)}
        if g:
            cache["groups"] = tuple(
                jax.tree.map(
                    lambda a: jnp.broadcast_to(a, (g, *a.shape)),
                    init_layer_cache(cfg, t, batch, max_len, dtype),
                )
                for t in cfg.layer_types[:p]
            )
        cache["tail"] = tuple(
            init_layer_cache(cfg, t, batch, max_len, dtype) for t in cfg.layer_types[p * g :]
        )
        return cache


def embed_rows(table: jax.Array, ids: jax.Array, *, inference: bool = False) -> jax.Array:
    """`table[ids]`. In inference a 16-bit table is gathered as uint16 bits: XLA:CPU gathers bf16
    rows from a float32 copy of the whole table, and in the decode loop that copy (twice the
    table's bytes) was hoisted out and written again by every call. On the CPU without a mesh the
    native kernel copies the rows alone (`rows.take_rows16`): the bitcast of the bits was still a
    copy of the whole table per call."""
    if not inference or table.dtype.itemsize != 2:
        return jnp.take(table, ids, axis=0)
    if current_resolver() is None and rows.take_available():
        return rows.take_rows16(table, ids)
    bits = jnp.take(jax.lax.bitcast_convert_type(table, jnp.uint16), ids, axis=0)
    return jax.lax.bitcast_convert_type(bits, table.dtype)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Offset of each token within its segment: `[0, 1, 2, 0, 1, ...]` for `[a, a, a, b, b, ...]`."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def concat_cache_rows(caches: list[dict]) -> dict:
    """Join decode caches of separate requests along the batch axis (the axis after the
    stacked-group axis for scanned layers, the first axis elsewhere)."""
    out = {"lengths": jnp.concatenate([c["lengths"] for c in caches])}
    if "groups" in caches[0]:
        out["groups"] = jax.tree.map(lambda *a: jnp.concatenate(a, axis=1), *[c["groups"] for c in caches])
    out["tail"] = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *[c["tail"] for c in caches])
    return out

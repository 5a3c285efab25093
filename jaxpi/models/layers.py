"""Qwen3.5 and Qwen3 blocks in Flax NNX: (gated) attention, Gated DeltaNet, SwiGLU MLP, decoder layer.

Each parameter is declared once (shape, logical axes, initializer); the math lives in the kernels.
Projections are stored input-major (`[D, heads, head_dim]`), so the HF `[out, in]` matrices are
transposed and reshaped by `jaxpi.convert`, never here.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpi.axes import current_resolver
from jaxpi.config import FULL, QwenConfig, parse_attn_kernel, parse_gdn_kernel
from jaxpi.kernels.attention import apply_partial_rope, attention, causal_attention
from jaxpi.kernels.conv import causal_conv1d
from jaxpi.kernels.dense import dense, packed_product
from jaxpi.kernels.dtypes import upcast
from jaxpi.kernels.gated_delta import chunk_gated_delta_rule, gated_delta_step, recurrent_gated_delta_rule
from jaxpi.kernels.norms import gated_rms_norm, rms_norm
from jaxpi.models import packed as packed_twins
from jaxpi.models.adapters import adapter_for
from jaxpi.models.params import Init, constant, constrain, log_uniform, normal, param
from jaxpi.models.quantized import QuantizedWeight, base_einsum

# Logical axes of the activations the norms see (the Pallas norms' shard_map reads them under a mesh).
RESID_AXES = ("batch", "seq", "embed")
Q_AXES = ("batch", "seq", "q_heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
GDN_V_AXES = ("batch", "seq", "gdn_v_heads", "head_dim")
# Prefill chunks of up to this many tokens (the engine's 32, 4 and 1) run the gated delta rule
# token by token (decode caches only; training always takes the chunked form).
RECURRENT_PREFILL_MAX = 32

Cache = dict[str, jax.Array]

# While `tap_projections()` is open: (HF module name, input) of every projection, in call order
# (the importance-matrix statistics of `jaxpi.convert.imatrix` are computed from these inputs).
_TAPS: list[tuple[str, jax.Array]] | None = None


@contextlib.contextmanager
def tap_projections() -> Iterator[list[tuple[str, jax.Array]]]:
    """Record each projection's input while the block is open (trace-time: use it inside the
    traced function, unscanned and without remat, so the inputs are the function's own values)."""
    global _TAPS
    previous, _TAPS = _TAPS, []
    try:
        yield _TAPS
    finally:
        _TAPS = previous


def project(
    mod: nnx.Module,
    proj: str,
    x: jax.Array,
    eq: str,
    *,
    hf: str | None = None,
    n_in: int = 1,
    dropout_key: jax.Array | None = None,
    inference: bool = False,
    base: jax.Array | None = None,
) -> jax.Array:
    """`einsum(eq, x, W)` for the stored projection `proj` (W a dense `Param`, or a quantized base
    weight dequantized on the fly: `jaxpi.models.quantized`), plus the LoRA update `s·(drop(x)·A)·B`
    when the module carries an adapter for `proj` (`jaxpi.models.adapters`, filled by
    `jaxpi.lora`); `hf` names the HF module whose A it shares (in_proj_qkv). `drop` is inverted dropout at the adapter's rate, applied only given a key.

    The product stays in the activation dtype (TPU/GPU accumulate bf16 products in float32 inside
    the matmul): asking for a float32 result would make the backward cotangent float32 and promote
    every bf16 weight to a float32 copy in the gradient matmuls. `inference` (a forward on a decode
    cache, never differentiated) asks for it and rounds once (`jaxpi.kernels.dense`): the same
    arithmetic, and XLA:CPU's bf16 kernel instead of float32 copies of the weights. `base`, where
    given, is `x · W` already made (the columns of a joint product, `jaxpi.models.packed.Joint`).
    """
    w = getattr(mod, proj)
    twin = getattr(mod, packed_twins.name(proj), None) if inference and base is None else None  # the engine's
    y = base if twin is None else packed_product(eq, x, twin[...], w.shape, n_in=n_in)
    if y is None and inference and not isinstance(w, QuantizedWeight):
        y = dense(eq, x, w[...], n_in=n_in)
    elif y is None:
        y = base_einsum(mod, proj, eq, x)  # a dense Param or a quantized base weight
    name = hf or proj
    if _TAPS is not None:
        _TAPS.append((name, x))
    adapter = adapter_for(mod, proj, name)
    if adapter is not None and not adapter.merged:
        # Adapter math in float32 whatever the base dtype: A and B are float32 master weights.
        xf = upcast(x)
        rate = adapter.dropout
        if dropout_key is not None and rate > 0.0:
            # One mask per HF module (keyed by its name), so in_proj_qkv's three parts see the same
            # dropped input, as peft's single Linear does.
            key = jax.random.fold_in(dropout_key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
            keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
            xf = jnp.where(keep, xf / (1.0 - rate), 0.0)
        delta = lora_delta(xf, for_use(adapter.a, adapter.a_axes), for_use(adapter.b, adapter.b_axes), n_in)
        if adapter.mask is not None:  # a stacked adapter whose layer (this scan step) is not selected
            delta = delta * adapter.mask
        y = (y + adapter.scale * delta).astype(x.dtype)
    return y


def for_use(factor: jax.Array, axes: tuple[str | None, ...] | None) -> jax.Array:
    """A LoRA factor laid out for its product as the activation table says (`constrain`): under
    ZeRO-3 gathered whole, as the weights are for their use, whatever dimension it is stored split
    on; under tensor parallelism split by heads or MLP columns like its weight. Its gradient comes
    back through the same layout and is reduced onto the stored split.

    Without it, XLA:CPU (jax 0.10.2) partitioned a factor stored split on `head_dim` (B of
    in_proj_z) wrongly inside the gradient-accumulation scan: most LoRA gradients of the step
    20-70 % off on 8 devices (docs/sharding.md; tests/test_sharding.py holds the case).
    """
    return factor if axes is None else constrain(factor, axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, n_in: int) -> jax.Array:
    """`(x·A)·B` contracting the last `n_in` axes of x with A's leading ones: x `[*lead, *in]`,
    A `[*in, r]`, B `[r, *out]` → `[*lead, *out]`.

    Its own backward because autodiff's weight gradients contract the tokens of both operands
    (`dB = Σ_t xa_t ⊗ dy_t`), and XLA's CPU dot then re-lays out the big `dy` `[*lead, *out]` with
    the tokens minor: a transposed copy of every adapted projection's output cotangent. Here the
    small rank-r side is transposed instead, so the big operands are read in place.
    """
    return jnp.tensordot(jnp.tensordot(x, a, axes=n_in), b, axes=1)


def _lora_delta_fwd(x: jax.Array, a: jax.Array, b: jax.Array, n_in: int) -> tuple[jax.Array, tuple]:
    xa = jnp.tensordot(x, a, axes=n_in)  # [*lead, r]
    return jnp.tensordot(xa, b, axes=1), (x, a, b, xa)


def _lora_delta_bwd(n_in: int, res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    x, a, b, xa = res
    lead = xa.ndim - 1
    n_out = b.ndim - 1
    out_axes = tuple(range(lead, lead + n_out))
    dxa = jnp.tensordot(dy, b, axes=(out_axes, tuple(range(1, b.ndim))))  # [*lead, r]
    # [r, *lead] copies of the two rank-r arrays; the barrier keeps XLA from folding the
    # transposes back into the dots (which would bring back the big transposed copies).
    xa_t, dxa_t = jax.lax.optimization_barrier((jnp.moveaxis(xa, -1, 0), jnp.moveaxis(dxa, -1, 0)))
    toks = tuple(range(1, lead + 1))
    db = jnp.tensordot(xa_t, dy, axes=(toks, tuple(range(lead)))).astype(b.dtype)  # [r, *out]
    da_t = jnp.tensordot(dxa_t, x, axes=(toks, tuple(range(lead))))  # [r, *in]
    da = jnp.moveaxis(da_t, 0, -1).astype(a.dtype)  # [*in, r]
    dx = jnp.tensordot(dxa, a, axes=(-1, -1)).astype(x.dtype)  # [*lead, *in]
    return dx, da, db


lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


class MLP(nnx.Module):
    """SwiGLU: `down(silu(x·Wg) ⊙ (x·Wu))`."""

    def __init__(self, cfg: QwenConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = param(rngs, (d, f), ("embed", "mlp"), normal(), dtype)
        self.up_proj = param(rngs, (d, f), ("embed", "mlp"), normal(), dtype)
        self.down_proj = param(rngs, (f, d), ("mlp", "embed"), normal(), dtype)

    def __call__(
        self, x: jax.Array, *, dropout_key: jax.Array | None = None, inference: bool = False
    ) -> jax.Array:
        kw = {"dropout_key": dropout_key, "inference": inference}
        joint = packed_twins.Joint(self, x, inference=inference)
        # Named for the "mlp" remat policy, which keeps these two (the widest projections) and
        # recomputes the rest; identities under every other policy.
        gate = project(self, "gate_proj", x, "btd,df->btf", base=joint.base("gate_proj"), **kw)
        up = project(self, "up_proj", x, "btd,df->btf", base=joint.base("up_proj"), **kw)
        gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return project(self, "down_proj", hidden, "btf,fd->btd", **kw)


def norm_init(cfg: QwenConfig) -> Init:
    """An RMSNorm weight's identity: 0 for zero-centred norms (`1 + w`), 1 for plain ones (`w`)."""
    return constant(1.0 - cfg.norm_offset)


class GatedAttention(nnx.Module):
    """Full attention with q/k RMSNorm, RoPE and (`cfg.attn_output_gate`) a per-head output gate.

    [q | gate] = x·Wq            q, gate: [B, T, Hq, d]   (HF interleaves them per head)
    q, k       = rope(norm(q)), rope(norm(x·Wk))          (rope on the first rotary_dim dims)
    o          = attn(q, k, x·Wv) ⊙ sigmoid(gate)         (no gate: o = attn(q, k, x·Wv))
    y          = o·Wo

    Qwen3.5: gated, partial rotary, zero-centred norms; Qwen3: no gate, rotary over the whole
    head, plain norms.
    """

    def __init__(self, cfg: QwenConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        q_dim = 2 * hd if cfg.attn_output_gate else hd
        self.q_proj = param(rngs, (d, hq, q_dim), ("embed", "q_heads", "head_dim"), normal(), dtype)
        self.k_proj = param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"), normal(), dtype)
        self.v_proj = param(rngs, (d, hkv, hd), ("embed", "kv_heads", "head_dim"), normal(), dtype)
        self.o_proj = param(rngs, (hq, hd, d), ("q_heads", "head_dim", "embed"), normal(), dtype)
        self.q_norm = param(rngs, (hd,), ("head_dim",), norm_init(cfg), dtype)
        self.k_norm = param(rngs, (hd,), ("head_dim",), norm_init(cfg), dtype)

    def __call__(
        self,
        x: jax.Array,
        *,
        rope: tuple[jax.Array, jax.Array],
        positions: jax.Array,
        segment_ids: jax.Array | None,
        cache: Cache | None,
        lengths: jax.Array | None,
        active: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        cfg, hd = self.cfg, self.cfg.head_dim
        kw = {"dropout_key": dropout_key, "inference": cache is not None}
        with jax.named_scope("qkv"):
            joint = packed_twins.Joint(self, x, inference=cache is not None)
            # [B, T, Hq, 2d] (gated) or [.., d]
            qg = project(self, "q_proj", x, "btd,dhk->bthk", base=joint.base("q_proj"), **kw)
            q, gate = qg[..., :hd], qg[..., hd:]
            k = project(self, "k_proj", x, "btd,dhk->bthk", base=joint.base("k_proj"), **kw)
            v = project(self, "v_proj", x, "btd,dhk->bthk", base=joint.base("v_proj"), **kw)
            norm = {"impl": cfg.norm_impl, "offset": cfg.norm_offset}
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps, axes=Q_AXES, **norm)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps, axes=KV_AXES, **norm)
            q, k = apply_partial_rope(q, *rope), apply_partial_rope(k, *rope)
            q = constrain(q, Q_AXES)
            k = constrain(k, KV_AXES)
            v = constrain(v, KV_AXES)
        if cache is None:
            # Positions increase within each segment here, so the blocked causal core (by index)
            # equals the positional mask of `attention` without computing the masked half.
            if cfg.attn_impl == "pallas":
                # imported here, as the other Pallas kernels: only traced when asked for
                from jaxpi.kernels.pallas.attention import AttentionOptions, pallas_causal_attention

                opts = AttentionOptions(**parse_attn_kernel(cfg.attn_kernel))
                o = pallas_causal_attention(q, k, v, segments=segment_ids, options=opts)
            else:
                o = causal_attention(q, k, v, segments=segment_ids)
            new_cache = None
        else:
            t = x.shape[1]
            with jax.named_scope("cache_update"):
                # The cache is head-major, [B, Hkv, S, d]. Row b writes its T new entries at slots
                # lengths[b] .. lengths[b] + T - 1; a row outside `active` writes back what those
                # slots held (T slots, not its whole cache).
                ck = write_slots(cache["k"], jnp.swapaxes(k, 1, 2), lengths, active)
                cv = write_slots(cache["v"], jnp.swapaxes(v, 1, 2), lengths, active)
            s = ck.shape[2]
            slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (x.shape[0], s))
            q_slots = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
            # A float32 cache of a bf16 model (the engine's on the CPU) holds the bf16 values
            # exactly: the products and the one rounding of the probabilities are the same.
            o = attention(
                q,
                ck,
                cv,
                q_positions=q_slots,
                kv_positions=slots,
                kv_valid=slots < (lengths[:, None] + t),
                heads_first=True,
                probs_dtype=q.dtype,
            ).astype(q.dtype)
            new_cache = {"k": ck, "v": cv}
        if cfg.attn_output_gate:
            o = o * jax.nn.sigmoid(gate)
        return project(self, "o_proj", o, "bthk,hkd->btd", n_in=2, **kw), new_cache


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet token mixer (linear attention with a delta-rule state).

        q, k, v   = silu(causal_conv1d(x·[Wq | Wk | Wv]))       q, k: [B,T,Hk,dk]; v: [B,T,Hv,dv]
        beta      = sigmoid(x·Wb)                                [B, T, Hv]
        g         = -exp(A_log) · softplus(x·Wa + dt_bias)       log-decay, ≤ 0
        o, S      = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)
        y         = (w · rmsnorm(o) · silu(x·Wz))·Wout

    The conv weights and q/k/v projections are stored per part (not as HF's fused `in_proj_qkv`)
    so that tensor parallelism can split each along its own heads.
    """

    def __init__(self, cfg: QwenConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.cfg = cfg
        self.q_proj = param(rngs, (d, nk, dk), ("embed", "gdn_k_heads", "head_dim"), normal(), dtype)
        self.k_proj = param(rngs, (d, nk, dk), ("embed", "gdn_k_heads", "head_dim"), normal(), dtype)
        self.v_proj = param(rngs, (d, nv, dv), ("embed", "gdn_v_heads", "head_dim"), normal(), dtype)
        self.z_proj = param(rngs, (d, nv, dv), ("embed", "gdn_v_heads", "head_dim"), normal(), dtype)
        self.b_proj = param(rngs, (d, nv), ("embed", "gdn_v_heads"), normal(), dtype)
        self.a_proj = param(rngs, (d, nv), ("embed", "gdn_v_heads"), normal(), dtype)
        self.conv_q = param(rngs, (kw, nk, dk), ("conv", "gdn_k_heads", "head_dim"), normal(0.2), dtype)
        self.conv_k = param(rngs, (kw, nk, dk), ("conv", "gdn_k_heads", "head_dim"), normal(0.2), dtype)
        self.conv_v = param(rngs, (kw, nv, dv), ("conv", "gdn_v_heads", "head_dim"), normal(0.2), dtype)
        self.dt_bias = param(rngs, (nv,), ("gdn_v_heads",), constant(1.0), dtype)
        self.A_log = param(rngs, (nv,), ("gdn_v_heads",), log_uniform(0.01, 16.0), dtype)
        self.norm = param(rngs, (dv,), ("head_dim",), constant(1.0), dtype)
        self.out_proj = param(rngs, (nv, dv, d), ("gdn_v_heads", "head_dim", "embed"), normal(), dtype)

    def __call__(
        self,
        x: jax.Array,
        *,
        segment_ids: jax.Array | None,
        cache: Cache | None,
        active: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
        **_: Any,
    ) -> tuple[jax.Array, Cache | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        kd, vd = nk * dk, nv * dv
        kw_proj = {"dropout_key": dropout_key, "inference": cache is not None}
        joint = packed_twins.Joint(self, x, inference=cache is not None)  # q, k, v, z, b, a at once
        with jax.named_scope("conv"):
            # The depthwise conv is per channel, so q, k and v are convolved apart: each stays split
            # by its own heads under tensor parallelism (a concatenation would be resharded). The
            # decode cache keeps HF's channel order [q | k | v] of in_proj_qkv. On a cache without a
            # mesh (the engine) the three are one conv over the concatenated channels: a third of
            # the small ops of a decode step's conv, each channel's sum the same.
            parts = [("q_proj", "conv_q", nk, dk), ("k_proj", "conv_k", nk, dk), ("v_proj", "conv_v", nv, dv)]
            bounds = np.cumsum([0, kd, kd, vd])
            ys = [
                project(self, proj, x, "btd,dhk->bthk", hf="in_proj_qkv", base=joint.base(proj), **kw_proj)
                for proj, *_ in parts
            ]
            ws = [
                getattr(self, conv)[...].reshape(kw, heads * dim) for _, conv, heads, dim in parts
            ]  # [K, C]
            if cache is not None and current_resolver() is None:
                y, new_conv = causal_conv1d(
                    jnp.concatenate([y.reshape(b, t, -1) for y in ys], axis=-1),
                    jnp.concatenate(ws, axis=-1),
                    segment_ids=segment_ids,
                    state=cache["conv"],
                )
                outs = [
                    y[..., bounds[j] : bounds[j + 1]].reshape(b, t, heads, dim)
                    for j, (_, _, heads, dim) in enumerate(parts)
                ]
            else:
                outs, states = [], []
                for j, (y, w, (_, _, heads, dim)) in enumerate(zip(ys, ws, parts, strict=True)):
                    st = None if cache is None else cache["conv"][..., bounds[j] : bounds[j + 1]]
                    y, st = causal_conv1d(y.reshape(b, t, heads * dim), w, segment_ids=segment_ids, state=st)
                    outs.append(y.reshape(b, t, heads, dim))
                    states.append(st)
                new_conv = jnp.concatenate(states, axis=-1)
            q = constrain(outs[0], ("batch", "seq", "gdn_k_heads", "head_dim"))
            k = constrain(outs[1], ("batch", "seq", "gdn_k_heads", "head_dim"))
            v = constrain(outs[2], GDN_V_AXES)
        with jax.named_scope("gates"):
            b_base, a_base = joint.base("b_proj"), joint.base("a_proj")
            beta = jax.nn.sigmoid(
                upcast(project(self, "b_proj", x, "btd,dh->bth", hf="in_proj_b", base=b_base, **kw_proj))
            )
            a = upcast(project(self, "a_proj", x, "btd,dh->bth", hf="in_proj_a", base=a_base, **kw_proj))
            g = -jnp.exp(upcast(self.A_log[...])) * jax.nn.softplus(a + upcast(self.dt_bias[...]))
        state = None if cache is None else cache["state"]
        with jax.named_scope("delta_rule"):
            if cache is not None and t == 1:
                o, new_state = gated_delta_step(
                    q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, active=active
                )
                o = o[:, None]
            elif cache is not None and t <= RECURRENT_PREFILL_MAX:
                # A short prefill chunk token by token: the chunked rule would pad it to a whole
                # chunk (64 tokens) of matmuls; t steps cost t passes of two over the state.
                o, new_state = recurrent_gated_delta_rule(
                    q, k, v, g, beta, initial_state=state, segment_ids=segment_ids
                )
            else:
                o, new_state = chunk_gated_delta_rule(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    chunk_size=cfg.gdn_chunk_size,
                    impl=cfg.gdn_impl,
                    kernel=parse_gdn_kernel(cfg.gdn_kernel),
                    initial_state=state,
                    segment_ids=segment_ids,
                )
        with jax.named_scope("out"):
            z = project(
                self, "z_proj", x, "btd,dhk->bthk", hf="in_proj_z", base=joint.base("z_proj"), **kw_proj
            )
            o = gated_rms_norm(
                o.astype(x.dtype), z, self.norm[...], cfg.rms_norm_eps, impl=cfg.norm_impl, axes=GDN_V_AXES
            )
            y = project(self, "out_proj", o, "bthk,hkd->btd", n_in=2, **kw_proj)
        new_cache = None
        if cache is not None:
            new_cache = {"conv": new_conv.astype(cache["conv"].dtype), "state": new_state}
            # rows outside `active` keep theirs; the one-token step keeps their state itself
            masked = ("conv",) if t == 1 else ("conv", "state")
            if active is not None:
                new_cache |= {
                    k: jnp.where(active.reshape(-1, *[1] * (new_cache[k].ndim - 1)), new_cache[k], cache[k])
                    for k in masked
                }
        return y, new_cache


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: `h += mixer(norm(h)); h += mlp(norm(h))`."""

    def __init__(self, cfg: QwenConfig, layer_type: str, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = cfg
        self.layer_type = layer_type
        self.input_norm = param(rngs, (d,), ("embed",), norm_init(cfg), dtype)
        mixer = GatedAttention if layer_type == FULL else GatedDeltaNet
        self.mixer = mixer(cfg, dtype=dtype, rngs=rngs)
        self.post_norm = param(rngs, (d,), ("embed",), norm_init(cfg), dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(
        self, h: jax.Array, *, dropout_key: jax.Array | None = None, **kw: Any
    ) -> tuple[jax.Array, Cache | None]:
        """`dropout_key` (this layer's) drives LoRA dropout; mixer and MLP modules have distinct
        names, so one key gives each module its own mask."""
        eps, act = self.cfg.rms_norm_eps, RESID_AXES
        norm = {"impl": self.cfg.norm_impl, "offset": self.cfg.norm_offset, "axes": RESID_AXES}
        with jax.named_scope("mixer"):
            normed = rms_norm(h, self.input_norm[...], eps, **norm)
            y, cache = self.mixer(normed, dropout_key=dropout_key, **kw)
            h = constrain(h + y, act)
        with jax.named_scope("mlp"):
            normed = rms_norm(h, self.post_norm[...], eps, **norm)
            inference = kw.get("cache") is not None  # a forward on a decode cache
            h = constrain(h + self.mlp(normed, dropout_key=dropout_key, inference=inference), act)
        # named for the "mlp_out" remat policy: the next layer of a remat'd group starts from it
        # instead of recomputing this layer's down projection; an identity otherwise
        return checkpoint_name(h, "layer_out"), cache


def write_slots(cache: jax.Array, new: jax.Array, lengths: jax.Array, active: jax.Array | None) -> jax.Array:
    """`cache` `[B, H, S, d]` with row b's `new` `[B, H, T, d]` at slots lengths[b] + [0, T), rows
    outside `active` (if given) rewritten with what they held (T slots, not the whole row)."""
    t = new.shape[2]
    new = new.astype(cache.dtype)
    if active is not None:
        read = jax.vmap(lambda c, i: jax.lax.dynamic_slice(c, (0, i, 0), (c.shape[0], t, c.shape[2])))
        new = jnp.where(active[:, None, None, None], new, read(cache, lengths))
    return jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (0, i, 0)))(cache, new, lengths)


def init_layer_cache(cfg: QwenConfig, layer_type: str, batch: int, max_len: int, dtype: jnp.dtype) -> Cache:
    """Zeros for one layer: KV `[B, Hkv, S, d]` (attention; heads before slots, so a row's head reads
    its slots contiguously and decode attention needs no transposed copy of the cache) or conv
    window + state (DeltaNet)."""
    if layer_type == FULL:
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    channels = 2 * cfg.linear_key_dim + cfg.linear_value_dim
    return {
        "conv": jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, channels), dtype),
        "state": jnp.zeros(
            (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
            jnp.float32,
        ),
    }

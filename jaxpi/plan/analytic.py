"""The planner's analytic model: per-device bytes of parameters, optimizer state and the
step's temporaries under each remat policy, and the collectives a strategy implies, from shapes and
shardings alone (the compiled figures are checked against these)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.config import FULL, LINEAR, QwenConfig
from jaxpi.kernels.attention import ATTN_BLOCK
from jaxpi.models.qwen3_5 import UNROLL_GROUPS, layer_plan
from jaxpi.plan.request import PlanRequest
from sharding.hlo import Collectives
from sharding.strategies import Strategy, spec_for


def nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def local_bytes(tree: Any, shardings: Any) -> int:
    """Bytes of one device's shards of `tree` laid out as `shardings`."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        local = s.shard_shape(tuple(x.shape))
        total += int(np.prod(local)) * jnp.dtype(x.dtype).itemsize
    return total


def degree(logical: tuple[str, ...], strategy: Strategy, sizes: dict[str, int]) -> int:
    """How many ways the activation axes `logical` are split (e.g. the data-parallel degree)."""
    axes: set[str] = set()
    for name in logical:
        value = strategy.activations.get(name)
        axes |= {value} if isinstance(value, str) else set(value or ())
    return math.prod(sizes.get(a, 1) for a in axes)


def _local(strategy: Strategy, sizes: dict[str, int], axes: tuple[str, ...], shape: tuple[int, ...]) -> int:
    """Elements of one device's shard of an activation with these logical axes."""
    spec = spec_for(axes, shape, strategy.activations, sizes)
    n = 1
    for dim, entry in zip(shape, spec, strict=False):
        parts = (entry,) if isinstance(entry, str) else (entry or ())
        n *= dim // math.prod(sizes.get(a, 1) for a in parts)
    return n * math.prod(shape[len(spec) :])


def _axes_of(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _group_param_bytes(state: nnx.State, shardings: nnx.State) -> tuple[int, int]:
    """(full, local) bytes of ONE layer group's parameters (the stacked `groups` subtree / G)."""
    if "groups" not in state:
        return 0, 0
    g = jax.tree.leaves(state["groups"])[0].shape[0]
    full = nbytes(state["groups"]) // g
    local = local_bytes(state["groups"], shardings["groups"]) // g
    return full, local


def _dequantized_bytes(setup: Setup) -> int:
    """A quantized base's weights of one remat unit rebuilt in the compute dtype, per device: each
    projection is dequantized right before its matmul from its codes as gathered for the use
    (whole over the batch axes, split over the others), and its backward rebuilds it again. The
    larger of one scanned group's and one tail layer's; 0 for a dense base."""
    req, sizes = setup.req, setup.sizes
    act = jnp.dtype(req.dtype).itemsize
    batch_axes = {a for a in _axes_of(setup.strategy.activations.get("batch")) if sizes.get(a, 1) > 1}
    groups = layer_plan(setup.cfg)[1]
    shard = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(setup.p_shard)}
    units: dict[object, int] = {}
    for path, var in nnx.to_flat_state(setup.state):
        path = tuple(path)
        if path[-1] != "codes":
            continue
        x, s = var.get_value(), shard[path]
        used = {a for entry in s.spec for a in _axes_of(entry)}
        per_code = 2 if jnp.dtype(x.dtype) == jnp.uint8 else 1  # nf4: two weights per byte
        weights = int(np.prod(s.shard_shape(tuple(x.shape)))) * math.prod(sizes[a] for a in used & batch_axes)
        stacked = path[0] == "groups"
        unit = "groups" if stacked else path[:2]  # ("tail", j): one tail layer
        units[unit] = units.get(unit, 0) + weights * per_code * act // (groups if stacked else 1)
    return max(units.values(), default=0)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What both analytic estimates read: the request, its model and strategy, the mesh sizes and
    the abstract parameter state with its shardings."""

    cfg: QwenConfig
    req: PlanRequest
    strategy: Strategy
    sizes: dict[str, int]
    state: Any
    p_shard: Any


@dataclasses.dataclass(frozen=True)
class _LayerBytes:
    """Bytes per device of one layer's forward intermediates, by what the remat policies keep.

    `total` is what autodiff keeps for the layer's backward without remat; `proj` the outputs of
    its weight projections (dot_generals without batch dimensions, the subset `dots_no_batch`
    saves), of which `mlp_gate_up` are the MLP's gate and up outputs (the "mlp" policy's names);
    `batched` the outputs of its batched dot_generals (attention scores and block outputs, the
    delta rule's chunk products and states), which `dots` saves on top of `proj`.
    """

    total: int
    proj: int
    mlp_gate_up: int
    batched: int
    out: int  # the layer's output [B, T, D] (the "mlp_out" policy's third name)

    def kept(self, remat: str) -> int:
        """Bytes the policy saves in the forward for this layer's backward (the rest is recomputed)."""
        return {
            "none": self.total,
            "full": 0,
            "mlp": self.mlp_gate_up,
            "mlp_out": self.mlp_gate_up + self.out,
            "dots_no_batch": self.proj,
            "dots": self.proj + self.batched,
        }[remat]


def _attention_block_elems(t: int, block: int) -> int:
    """Score elements per (batch row, head) of `causal_attention`: block i holds [hi - lo, hi].

    Σ over blocks of (hi - lo) · hi ≈ T · (T + c) / 2: the blocks skip the masked upper triangle,
    but autodiff keeps every block's probabilities for the backward, so it is about half the
    dense [T, T], not one block's worth (a flash kernel would keep only [T] statistics).
    """
    c = min(block, t)
    return sum((min(lo + c, t) - lo) * min(lo + c, t) for lo in range(0, t, c))


def _layer_bytes(setup: Setup, b: int) -> dict[str, _LayerBytes]:
    """`_LayerBytes` of each layer type, MLP included, for `b` rows of `seq_len` tokens."""
    cfg, req = setup.cfg, setup.req
    t, d, f, act = req.seq_len, cfg.hidden_size, cfg.intermediate_size, jnp.dtype(req.dtype).itemsize
    loc = lambda axes, shape: _local(setup.strategy, setup.sizes, axes, shape)  # noqa: E731
    resid = loc(("batch", "seq", "embed"), (b, t, d))
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )

    # MLP: gate and up [B, T, F] (the projections "mlp" keeps), silu(gate)·up, down [B, T, D];
    # its input (the post-norm residual) and that input normalised.
    gate_up = 2 * loc(("batch", "seq", "mlp"), (b, t, f)) * act
    mlp_proj = gate_up + resid * act
    mlp_total = gate_up + loc(("batch", "seq", "mlp"), (b, t, f)) * act + 2 * resid * act

    # Gated attention: q|gate [B, T, Hq, 2d], k and v [B, T, Hkv, d], o_proj [B, T, D] projected;
    # q, k normed and rotated; per score element of each query block the float32 softmax output
    # and the probabilities in the activation dtype; block outputs [B, T, Hq, d] and their gated
    # copy; the layer input and its norm (Qwen3's attention has no gate: q alone, no gated copy).
    q = loc(("batch", "seq", "q_heads", "head_dim"), (b, t, hq, hd))
    kv = loc(("batch", "seq", "kv_heads", "head_dim"), (b, t, hkv, hd))
    qg = (2 if cfg.attn_output_gate else 1) * q
    attn_proj = (qg + 2 * kv + resid) * act
    if cfg.attn_impl == "pallas":
        # Flash attention keeps no scores: the kernel saves the softmax's log-sum-exp [B, Hq, T]
        # in float32, and its inputs include k and v repeated to the query heads (GQA).
        core = loc(("batch", "q_heads", "seq"), (b, hq, t)) * 4 + (2 * q * act if hkv < hq else 0)
        attn_batched = 0  # a kernel call, not a dot: `dots` saves none of it
    else:
        scores = loc(("batch", "q_heads", None), (b, hq, _attention_block_elems(t, ATTN_BLOCK)))
        core = scores * (4 + act)
        # `dots` saves the float32 scores of every block (a batched dot) and the block outputs.
        attn_batched = scores * 4 + q * act
    attn_total = attn_proj + (qg + kv + 2 * resid) * act + core

    # Gated DeltaNet: q, k [B, T, Hk, dk], v, z [B, T, Hv, dv], a, b [B, T, Hv] and out_proj
    # projected; the conv outputs and normalised q, k; the chunked delta rule's float32 products
    # (k·kᵀ, its inverse, q·kᵀ: [B, Hv, T, C] each; u, w, delta, out: [B, Hv, T, dk|dv]) and the
    # per-chunk states [B, Hv, T/C + 1, dk·dv]; the core output and its gated norm.
    qk = loc(("batch", "seq", "gdn_k_heads", "head_dim"), (b, t, 2 * hk, dk))
    vz = loc(("batch", "seq", "gdn_v_heads", "head_dim"), (b, t, 2 * hv, dv))
    ab = loc(("batch", "seq", "gdn_v_heads"), (b, t, 2 * hv))
    chunk = cfg.gdn_chunk_size
    per_chunk = loc(("batch", "gdn_v_heads", "seq", None), (b, hv, t, 3 * chunk + dk + 3 * dv))
    states = loc(("batch", "gdn_v_heads", None, None), (b, hv, t // chunk + 1, dk * dv))
    gdn_batched = (per_chunk + states) * 4
    gdn_proj = (qk + vz + ab + resid) * act
    gdn_total = gdn_proj + (qk + vz + 2 * resid) * act + gdn_batched

    return {
        FULL: _LayerBytes(attn_total + mlp_total, attn_proj + mlp_proj, gate_up, attn_batched, resid * act),
        LINEAR: _LayerBytes(gdn_total + mlp_total, gdn_proj + mlp_proj, gate_up, gdn_batched, resid * act),
    }


def _logits_bytes(setup: Setup, b: int) -> int:
    """The LM head's live logits: float32 logits and their gradient for `loss_chunk` positions at
    a time (all T when 0), plus the activation-dtype logits they are upcast from."""
    cfg, req = setup.cfg, setup.req
    t = req.seq_len if not 0 < req.loss_chunk < req.seq_len else req.loss_chunk
    elems = _local(setup.strategy, setup.sizes, ("batch", "seq", "vocab"), (b, t, cfg.vocab_size))
    act = jnp.dtype(req.dtype).itemsize
    return elems * (2 * 4 + (act if act < 4 else 0))


def temp_terms(setup: Setup, train_local: int) -> dict[str, int]:
    """The terms of the temporary bytes per device of one step, under the request's remat policy
    and loss chunk. Live throughout the backward:

      saved           what the forward saves across the whole stack for the backward;
      trainable_grads the gradients of the trainable weights;

    and, one after the other (the peak takes the larger):

      loss_phase      the LM head's float32 logits and their gradient (`loss_chunk` positions
                      of them when set), plus the last unit's backward when that runs beside it;
      layer_phase     one remat unit's backward: its recomputed intermediates, one layer's
                      gradients (taken as the size of its intermediates) and the unit's weights
                      gathered (when the strategy shards them).

    A remat unit is a scanned layer group (jax.checkpoint wraps the group body) or one tail
    layer. What each policy saves across the stack, per layer (`_LayerBytes`):
      none          every intermediate of every layer; nothing recomputed;
      full          the residual stream at each unit boundary only;
      mlp           the boundaries + every layer's MLP gate and up outputs [B, T, F];
      mlp_out       those + every layer's output [B, T, D];
      dots_no_batch the boundaries + every weight projection's output;
      dots          those + every batched dot: float32 attention scores of every query block
                    and the delta rule's chunk products. The dots policies are the roughest:
                    which dot_generals XLA keeps, and which elementwise results it fuses into
                    them, is decided by the compiler.
    Attention is blocked (`causal_attention`): per layer about T·(T + c)/2 score elements per head
    live for the backward, in float32 plus the activation dtype; with `attn_impl="pallas"` (flash)
    only a float32 log-sum-exp per query and head, and k, v repeated to the query heads. Every
    `gdn_impl` is counted as the plain chunk scan (the split and Pallas scans also save the states
    entering the chunks; how their other residuals differ is not modelled).
    """
    req, strategy, sizes = setup.req, setup.strategy, setup.sizes
    cfg = setup.cfg
    b = req.batch_per_device * degree(("batch",), strategy, sizes)
    act = jnp.dtype(req.dtype).itemsize
    resid = _local(strategy, sizes, ("batch", "seq", "embed"), (b, req.seq_len, cfg.hidden_size)) * act
    layers = _layer_bytes(setup, b)
    p, g = layer_plan(cfg)
    units = ([cfg.layer_types[:p]] if g else []) + [(ty,) for ty in cfg.layer_types[p * g :]]
    n_units = g + len(cfg.layer_types) - p * g
    saved = sum(layers[ty].kept(req.remat) for ty in cfg.layer_types)
    if req.remat != "none":
        saved += resid * n_units  # each unit's input, what the recomputation starts from
    full, local = _group_param_bytes(setup.state, setup.p_shard)
    gathered = 2 * (full - local) + _dequantized_bytes(setup)
    grads = max(layers[ty].total for ty in set(cfg.layer_types))

    def backward(unit: tuple[str, ...]) -> int:
        """One unit's backward: its recomputed intermediates, one layer's gradients, its weights."""
        return sum(layers[ty].total - layers[ty].kept(req.remat) for ty in unit) + grads + gathered

    # Outside the layer loop (a tail layer, or a stack of at most UNROLL_GROUPS groups, unrolled)
    # the last unit's recomputation and backward may run beside the loss's backward: XLA schedules
    # them together (tiny, 4 tail layers: chunking the loss lowers the compiled temp by 0.6 of the
    # logits term). Inside the loop they come after it (27B: chunking leaves the temp unchanged).
    in_loop = p * g == len(cfg.layer_types) and g > UNROLL_GROUPS
    logits = _logits_bytes(setup, b)
    return {
        "saved": saved,
        "trainable_grads": train_local,
        "loss_phase": logits + (0 if in_loop else backward(units[-1])),
        "layer_phase": max(backward(u) for u in units),
    }


def activation_estimate(setup: Setup, train_local: int) -> int:
    """Temporary bytes per device: the saved stack and the trainable gradients, plus the larger of
    the backward's two phases (see `temp_terms`)."""
    t = temp_terms(setup, train_local)
    return int(t["saved"] + t["trainable_grads"] + max(t["loss_phase"], t["layer_phase"]))


def collectives_estimate(setup: Setup, train: Any, train_shard: Any) -> Collectives:
    """What the strategy implies per step (result bytes per device, as `count_collectives`).

    - weights split over a batch axis (FSDP) are all-gathered once in the forward and once more
      for the backward (the remat recomputation reuses the backward's gather);
    - gradients of such weights are reduce-scattered; of weights replicated over the batch axes
      (DP, or TP shards) all-reduced over the data-parallel devices;
    - tensor parallelism all-reduces the residual-stream contribution of every mixer and MLP:
      forward, remat recompute and backward (for the input gradient).
    """
    cfg, req, strategy, sizes, state, p_shard = (
        setup.cfg,
        setup.req,
        setup.strategy,
        setup.sizes,
        setup.state,
        setup.p_shard,
    )
    out = Collectives()
    groups, n_layers = layer_plan(cfg)[1], len(cfg.layer_types)
    batch_axes = {a for a in _axes_of(strategy.activations.get("batch")) if sizes.get(a, 1) > 1}

    def fsdp_factor(x: Any, s: Any) -> int:
        """How many ways the weight is split over axes that also split the batch (gathered)."""
        used = {a for entry in s.spec for a in _axes_of(entry)}
        return math.prod(sizes[a] for a in used & batch_axes)

    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(p_shard), strict=True):
        k = fsdp_factor(x, s)
        if k > 1:
            local = int(np.prod(s.shard_shape(tuple(x.shape)))) * jnp.dtype(x.dtype).itemsize
            # A stacked [G, ...] weight is gathered one group slice per loop iteration: G collectives.
            stacked = groups if groups and x.ndim and x.shape[0] == groups else 1
            out.count["all-gather"] += 2 * stacked
            out.bytes["all-gather"] += 2 * local * k
    dp = degree(("batch",), strategy, sizes)
    if dp > 1:
        for x, s in zip(jax.tree.leaves(train), jax.tree.leaves(train_shard), strict=True):
            local = int(np.prod(s.shard_shape(tuple(x.shape)))) * jnp.dtype(x.dtype).itemsize
            if fsdp_factor(x, s) > 1:  # reduced and scattered back onto the weight's shards
                out.count["reduce-scatter"] += 1
                out.bytes["reduce-scatter"] += local
            else:  # replicated over the batch axes: every replica needs the sum
                out.count["all-reduce"] += 1
                out.bytes["all-reduce"] += local
    tp = sizes.get("tensor", 1) if strategy.params.get("mlp") else 1
    if tp > 1:
        b = req.batch_per_device * dp
        resid = _local(strategy, sizes, ("batch", "seq", "embed"), (b, req.seq_len, cfg.hidden_size))
        out.count["all-reduce"] += 3 * 2 * n_layers
        out.bytes["all-reduce"] += 3 * 2 * n_layers * resid * jnp.dtype(req.dtype).itemsize
    return out

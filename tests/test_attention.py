"""Our Flax layers against transformers' torch modules (fp32, CPU), forward and every gradient:
`GatedAttention` vs `Qwen3_5Attention` (eager, partial RoPE from `Qwen3_5TextRotaryEmbedding`),
`GatedDeltaNet` vs `Qwen3_5GatedDeltaNet`, `MLP` vs `Qwen3_5MLP`; plus packed-segment masking.

HF weights (random, norms included) are copied into our modules with the weight table's transforms
written out here independently (`[out, in]` → `.T.reshape(...)`), and our gradients are mapped back
to HF's layout the same way; a last test checks those transforms against `jaxpi.convert.table`.

Measured (CPU, fp32, relative L2):
  attention (GQA 3:1 and 2:1): forward ≤ 2.3e-7, input and weight grads ≤ 4.3e-7;
  DeltaNet: forward ≤ 6.2e-7, grads ≤ 3.2e-6 (worst: A_log, dt_bias; T = 37, Hv = 3·Hk);
  MLP: forward 8e-8, grads ≤ 1.1e-7.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5GatedDeltaNet,
    Qwen3_5MLP,
    Qwen3_5TextRotaryEmbedding,
)

from jaxpi.config import FULL, LINEAR, TINY
from jaxpi.convert.table import _layer_rules
from jaxpi.hf_fixtures import hf_text_config
from jaxpi.kernels import attention as attention_kernel
from jaxpi.kernels.attention import attention, causal_attention, rope_tables
from jaxpi.models.layers import MLP, GatedAttention, GatedDeltaNet

jax.config.update("jax_enable_x64", False)

FWD_TOL = 1e-5
GRAD_TOL = 1e-4
GQA_3_1 = TINY.replace(num_attention_heads=6, num_key_value_heads=2)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = (np.asarray(t.detach() if isinstance(t, torch.Tensor) else t, np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded noise in every parameter, at scales that keep activations O(1) (norms included)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
            elif name == "dt_bias":
                p.copy_(noise * 0.5 + 1.0)
            elif name == "norm.weight":  # the DeltaNet's gated norm: plain weight around 1
                p.copy_(1.0 + 0.3 * noise)
            elif "norm" in name or name.startswith("conv1d"):  # zero-centred norms (around 0), conv taps
                p.copy_(0.3 * noise)
            else:  # nn.Linear [out, in]
                p.copy_(noise / p.shape[1] ** 0.5)


def torch_input(seed: int, shape) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def hf_weights(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def hf_grads(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy().copy() for n, p in module.named_parameters()}


# ---- HF ⇄ ours transforms, per layer (written out, independent of jaxpi.convert) ----------------


def attention_to_ours(w: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        "q_proj": w["q_proj.weight"].T.reshape(d, hq, 2 * hd),  # per head: [q | gate]
        "k_proj": w["k_proj.weight"].T.reshape(d, hkv, hd),
        "v_proj": w["v_proj.weight"].T.reshape(d, hkv, hd),
        "o_proj": w["o_proj.weight"].T.reshape(hq, hd, d),
        "q_norm": w["q_norm.weight"],
        "k_norm": w["k_norm.weight"],
    }


def attention_to_hf(g: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    d = cfg.hidden_size
    return {
        "q_proj.weight": g["q_proj"].reshape(d, -1).T,
        "k_proj.weight": g["k_proj"].reshape(d, -1).T,
        "v_proj.weight": g["v_proj"].reshape(d, -1).T,
        "o_proj.weight": g["o_proj"].reshape(-1, d).T,
        "q_norm.weight": g["q_norm"],
        "k_norm.weight": g["k_norm"],
    }


def deltanet_to_ours(w: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    d, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kw = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    kd = nk * dk
    qkv, conv = w["in_proj_qkv.weight"], w["conv1d.weight"][:, 0, :]  # [C, D], [C, K]
    return {
        "q_proj": qkv[:kd].T.reshape(d, nk, dk),
        "k_proj": qkv[kd : 2 * kd].T.reshape(d, nk, dk),
        "v_proj": qkv[2 * kd :].T.reshape(d, nv, dv),
        "z_proj": w["in_proj_z.weight"].T.reshape(d, nv, dv),
        "b_proj": w["in_proj_b.weight"].T,
        "a_proj": w["in_proj_a.weight"].T,
        "conv_q": conv[:kd].T.reshape(kw, nk, dk),
        "conv_k": conv[kd : 2 * kd].T.reshape(kw, nk, dk),
        "conv_v": conv[2 * kd :].T.reshape(kw, nv, dv),
        "dt_bias": w["dt_bias"],
        "A_log": w["A_log"],
        "norm": w["norm.weight"],
        "out_proj": w["out_proj.weight"].T.reshape(nv, dv, d),
    }


def deltanet_to_hf(g: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    d, kw = cfg.hidden_size, cfg.linear_conv_kernel_dim
    return {
        "in_proj_qkv.weight": np.concatenate([g[p].reshape(d, -1).T for p in ("q_proj", "k_proj", "v_proj")]),
        "in_proj_z.weight": g["z_proj"].reshape(d, -1).T,
        "in_proj_b.weight": g["b_proj"].T,
        "in_proj_a.weight": g["a_proj"].T,
        "conv1d.weight": np.concatenate([g[p].reshape(kw, -1).T for p in ("conv_q", "conv_k", "conv_v")])[
            :, None
        ],
        "dt_bias": g["dt_bias"],
        "A_log": g["A_log"],
        "norm.weight": g["norm"],
        "out_proj.weight": g["out_proj"].reshape(-1, d).T,
    }


def mlp_to_ours(w: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    return {p: w[f"{p}.weight"].T for p in ("gate_proj", "up_proj", "down_proj")}


def mlp_to_hf(g: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    return {f"{p}.weight": g[p].T for p in ("gate_proj", "up_proj", "down_proj")}


# ---- running our layers ---------------------------------------------------------------------------


def load_into(layer: nnx.Module, params: dict[str, np.ndarray]) -> None:
    names = {p[0] for p, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert names == set(params), names ^ set(params)
    for name, value in params.items():
        var = getattr(layer, name)
        assert var[...].shape == value.shape, (name, var[...].shape, value.shape)
        var.set_value(jnp.asarray(value))


def value_and_grads(layer: nnx.Module, x: np.ndarray, cot: np.ndarray, **kw):
    """Our layer's output and the gradients of Σ(out · cot) w.r.t. x and every parameter (by name)."""
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params)(x, **kw)
        return jnp.sum(y * cot), y

    (_, y), (g_params, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, jnp.asarray(x)
    )
    grads = {p[0]: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(g_params)}
    return np.asarray(y), np.asarray(dx), grads


def causal_mask(batch: int, t: int) -> torch.Tensor:
    """HF eager's additive mask [B, 1, T, T]."""
    m = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    return m[None, None].expand(batch, 1, t, t)


def hf_attention(cfg, seed: int, x: np.ndarray, cot: np.ndarray):
    hf_cfg = hf_text_config(cfg)
    attn = Qwen3_5Attention(hf_cfg, layer_idx=cfg.layer_types.index(FULL)).eval()
    randomize(attn, seed)
    b, t, _ = x.shape
    xt = torch.tensor(x, requires_grad=True)
    position_ids = torch.arange(t)[None].expand(b, t)
    cos, sin = Qwen3_5TextRotaryEmbedding(hf_cfg)(xt, position_ids)
    assert cos.shape == (b, t, cfg.rotary_dim)  # partial rotary: 8 of 32 dims
    y, _ = attn(xt, position_embeddings=(cos, sin), attention_mask=causal_mask(b, t))
    (y * torch.from_numpy(cot)).sum().backward()
    return attn, y.detach().numpy(), xt.grad.numpy(), (cos.numpy(), sin.numpy())


def our_attention(cfg, weights: dict[str, np.ndarray]) -> GatedAttention:
    layer = GatedAttention(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    load_into(layer, attention_to_ours(weights, cfg))
    return layer


def attention_kwargs(cfg, positions: np.ndarray, segment_ids: np.ndarray | None = None) -> dict:
    positions = jnp.asarray(positions, jnp.int32)
    return {
        "rope": rope_tables(positions, cfg.rotary_dim, cfg.rope_theta),
        "positions": positions,
        "segment_ids": None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32),
        "cache": None,
        "lengths": None,
    }


def assert_grads_close(ours_hf_layout: dict[str, np.ndarray], hf: dict[str, np.ndarray]) -> dict[str, float]:
    assert set(ours_hf_layout) == set(hf)
    errs = {n: rel_err(ours_hf_layout[n], hf[n]) for n in hf}
    bad = {n: e for n, e in errs.items() if not e <= GRAD_TOL}
    assert not bad, f"gradients above {GRAD_TOL}: {bad}"
    return errs


# ---- gated attention -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, block", [(GQA_3_1, 8), (TINY, None)], ids=["gqa3:1-blocks-of-8", "gqa2:1-one-block"]
)
def test_gated_attention_matches_hf(cfg, block, monkeypatch):
    if block:  # several query blocks of the causal core (the last one partial)
        monkeypatch.setattr(attention_kernel, "ATTN_BLOCK", block)
    b, t = 2, 23
    x, cot = torch_input(0, (b, t, cfg.hidden_size))
    attn, y_t, dx_t, (cos_t, sin_t) = hf_attention(cfg, 1, x, cot)

    positions = np.broadcast_to(np.arange(t), (b, t))
    kw = attention_kwargs(cfg, positions)
    cos, sin = kw["rope"]
    assert rel_err(cos, cos_t) <= 1e-6 and rel_err(sin, sin_t) <= 1e-6

    layer = our_attention(cfg, hf_weights(attn))
    y, dx, grads = value_and_grads(layer, x, cot, **kw)
    assert rel_err(y, y_t) <= FWD_TOL
    assert rel_err(dx, dx_t) <= GRAD_TOL
    assert_grads_close(attention_to_hf(grads, cfg), hf_grads(attn))


def test_gated_attention_packed_segments_equal_separate_runs(monkeypatch):
    """A row packing two sequences (positions restarting at the boundary) gives each one's output alone,
    and no gradient flows across the boundary (query blocks of 8: the boundary inside a block)."""
    monkeypatch.setattr(attention_kernel, "ATTN_BLOCK", 8)
    cfg = GQA_3_1
    lengths = (13, 10)
    t = sum(lengths)
    x, cot = torch_input(2, (1, t, cfg.hidden_size))
    hf_cfg = hf_text_config(cfg)
    attn = Qwen3_5Attention(hf_cfg, layer_idx=3)
    randomize(attn, 3)
    layer = our_attention(cfg, hf_weights(attn))

    segment_ids = np.repeat(np.array([[0, 1]]), lengths, axis=1)
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    packed, dx_packed, _ = value_and_grads(layer, x, cot, **attention_kwargs(cfg, positions, segment_ids))

    start = 0
    for n in lengths:
        xs, cs = x[:, start : start + n], cot[:, start : start + n]
        alone, dx_alone, _ = value_and_grads(layer, xs, cs, **attention_kwargs(cfg, np.arange(n)[None]))
        assert rel_err(packed[:, start : start + n], alone) <= 1e-6
        assert rel_err(dx_packed[:, start : start + n], dx_alone) <= 1e-6
        start += n

    # without segment ids the second sequence would see the first (the test is not vacuous)
    unmasked, _, _ = value_and_grads(layer, x, cot, **attention_kwargs(cfg, np.arange(t)[None]))
    assert rel_err(unmasked[:, lengths[0] :], packed[:, lengths[0] :]) > 1e-2


@pytest.mark.parametrize("block", [8])
def test_blocked_causal_attention_equals_the_dense_core(block):
    """`causal_attention` (query blocks over a key prefix) against `attention` (the full masked
    [T, T] scores) with GQA 3:1 and three packed segments: outputs and q, k, v gradients."""
    b, t, hkv, g, d = 2, 37, 2, 3, 16
    ks = jax.random.split(jax.random.key(block), 4)
    q, k, v = (jax.random.normal(kk, (b, t, h, d)) for kk, h in zip(ks[:3], (hkv * g, hkv, hkv), strict=True))
    cot = jax.random.normal(ks[3], (b, t, hkv * g, d))
    segments = jnp.asarray(np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), [11, 17, 9], axis=1), jnp.int32)
    positions = jnp.asarray(
        [
            np.concatenate([np.arange(11), np.arange(17), np.arange(9)]),
            np.concatenate([np.arange(28), np.arange(9)]),
        ],
        jnp.int32,
    )

    flat = jnp.broadcast_to(jnp.arange(t), (b, t))  # no segments: one causal sequence per row

    @jax.jit
    def out_and_grads(q, k, v, seg, pos):
        kw = {"q_positions": pos, "kv_positions": pos, "q_segments": seg, "kv_segments": seg}
        y_ref, vjp_ref = jax.vjp(lambda q, k, v: attention(q, k, v, **kw), q, k, v)
        y_new, vjp_new = jax.vjp(
            lambda q, k, v: causal_attention(q, k, v, segments=seg, block=block), q, k, v
        )
        return (y_new, *vjp_new(cot)), (y_ref, *vjp_ref(cot))

    for seg, pos in ((segments, positions), (None, flat)):
        for got, want in zip(*out_and_grads(q, k, v, seg, pos), strict=True):  # output, dq, dk, dv
            assert rel_err(got, want) <= 1e-6

    # the query blocks' gradients are concatenated, not padded to full length and summed: the
    # backward pads only the key and value prefixes of the blocks before the last (5 blocks of 8)
    grads = lambda q, k, v: jax.grad(  # noqa: E731
        lambda q, k, v: jnp.sum(causal_attention(q, k, v, block=block) * cot), argnums=(0, 1, 2)
    )(q, k, v)
    eqns = jax.make_jaxpr(grads)(q, k, v).jaxpr.eqns
    assert sum(e.primitive.name == "pad" for e in eqns) == 2 * (-(-t // block) - 1)


# ---- Gated DeltaNet --------------------------------------------------------------------------------


def hf_deltanet(cfg, seed: int, x: np.ndarray, cot: np.ndarray):
    net = Qwen3_5GatedDeltaNet(hf_text_config(cfg), layer_idx=0).eval()
    randomize(net, seed)
    xt = torch.tensor(x, requires_grad=True)
    y = net(xt)
    (y * torch.from_numpy(cot)).sum().backward()
    return net, y.detach().numpy(), xt.grad.numpy()


def our_deltanet(cfg, weights: dict[str, np.ndarray]) -> GatedDeltaNet:
    layer = GatedDeltaNet(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    load_into(layer, deltanet_to_ours(weights, cfg))
    return layer


@pytest.mark.parametrize(
    "cfg, t",
    [(TINY, 37), (TINY.replace(linear_num_value_heads=2), 16)],
    ids=["hv=3hk-T37", "hv=hk-T16"],
)
def test_gated_deltanet_matches_hf(cfg, t: int):
    x, cot = torch_input(4, (2, t, cfg.hidden_size))
    net, y_t, dx_t = hf_deltanet(cfg, 5, x, cot)
    layer = our_deltanet(cfg, hf_weights(net))
    y, dx, grads = value_and_grads(layer, x, cot, segment_ids=None, cache=None)
    assert rel_err(y, y_t) <= FWD_TOL
    assert rel_err(dx, dx_t) <= GRAD_TOL
    assert_grads_close(deltanet_to_hf(grads, cfg), hf_grads(net))


def test_gated_deltanet_packed_segments_equal_separate_runs():
    cfg = TINY
    lengths = (19, 12)
    x, cot = torch_input(6, (1, sum(lengths), cfg.hidden_size))
    net = Qwen3_5GatedDeltaNet(hf_text_config(cfg), layer_idx=0)
    randomize(net, 7)
    layer = our_deltanet(cfg, hf_weights(net))
    segment_ids = np.repeat(np.array([[0, 1]], np.int32), lengths, axis=1)
    packed, dx_packed, _ = value_and_grads(layer, x, cot, segment_ids=jnp.asarray(segment_ids), cache=None)
    start = 0
    for n in lengths:
        xs, cs = x[:, start : start + n], cot[:, start : start + n]
        alone, dx_alone, _ = value_and_grads(layer, xs, cs, segment_ids=None, cache=None)
        assert rel_err(packed[:, start : start + n], alone) <= 1e-5
        assert rel_err(dx_packed[:, start : start + n], dx_alone) <= 1e-5
        start += n


# ---- MLP ---------------------------------------------------------------------------------------------


def test_mlp_matches_hf():
    cfg = TINY
    x, cot = torch_input(8, (2, 11, cfg.hidden_size))
    mlp = Qwen3_5MLP(hf_text_config(cfg), intermediate_size=cfg.intermediate_size)
    randomize(mlp, 9)
    xt = torch.tensor(x, requires_grad=True)
    y_t = mlp(xt)
    (y_t * torch.from_numpy(cot)).sum().backward()

    layer = MLP(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    load_into(layer, mlp_to_ours(hf_weights(mlp), cfg))
    graphdef, params = nnx.split(layer, nnx.Param)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * cot), y

    (_, y), (g, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, jnp.asarray(x))
    grads = {p[0]: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(g)}
    assert rel_err(y, y_t) <= FWD_TOL
    assert rel_err(dx, xt.grad) <= GRAD_TOL
    assert_grads_close(mlp_to_hf(grads, cfg), hf_grads(mlp))


# ---- the transforms above are the weight table's ------------------------------------------------------


@pytest.mark.parametrize(
    "layer_type, module_cls, prefix, to_ours",
    [
        (FULL, Qwen3_5Attention, "self_attn.", attention_to_ours),
        (LINEAR, Qwen3_5GatedDeltaNet, "linear_attn.", deltanet_to_ours),
    ],
)
def test_transforms_agree_with_weight_table(layer_type, module_cls, prefix, to_ours):
    cfg = GQA_3_1
    module = module_cls(hf_text_config(cfg), layer_idx=cfg.layer_types.index(layer_type))
    randomize(module, 10)
    weights = hf_weights(module)
    ours = to_ours(weights, cfg)
    seen = set()
    for rule in _layer_rules(cfg, 0, layer_type, ""):
        if not rule.hf.startswith(prefix):
            continue
        hf_name = rule.hf[len(prefix) :]
        parts = rule.to_ours(weights[hf_name])
        for path, part in zip(rule.ours, parts, strict=True):
            assert path[-2] == "mixer"
            np.testing.assert_array_equal(part, ours[path[-1]], err_msg=rule.hf)
            seen.add(path[-1])
        np.testing.assert_array_equal(rule.to_hf(parts), weights[hf_name], err_msg=rule.hf)
    assert seen == set(ours)

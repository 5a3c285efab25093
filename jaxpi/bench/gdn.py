"""The chunked gated delta rule alone: jaxpi's kernel against transformers' torch function.

Same inputs for both (numpy, seeded): q, k [B, T, H, Dk], v [B, T, H, Dv] in the bench dtype,
g = −softplus(N(0, 1)) and β = sigmoid(N(0, 1)) in float32, the in-kernel L2 norm of q and k on,
one key head per value head (so neither side repeats heads). Forward is timed without keeping
anything for a backward pass (torch under `no_grad`); forward + backward differentiates
Σ output with respect to all five inputs.

`impl` picks jaxpi's kernel: "jax" (plain JAX) or "pallas" (the chunk recurrence as Pallas kernels).
With "pallas" the plain-JAX path is timed too, in the same run on the same inputs, so the report
holds the kernel's speed-up over it. On CPU Pallas runs in its interpreter: those times check that
the path runs and say nothing about the kernel's speed (the report marks them `interpreted`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.bench.config import BenchConfig
from jaxpi.bench.flops import deltanet_core_flops
from jaxpi.bench.timing import figure, rate, ratio, timed
from jaxpi.kernels.gated_delta import IMPLS, chunk_gated_delta_rule


def gdn_inputs(bench: BenchConfig) -> dict[str, np.ndarray]:
    m = bench.model
    b, t, h = bench.batch, bench.seq, m.linear_num_value_heads
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    rng = np.random.default_rng(bench.seed)
    normal = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    return {
        "q": normal(b, t, h, dk),
        "k": normal(b, t, h, dk),
        "v": normal(b, t, h, dv),
        "g": -np.logaddexp(0.0, normal(b, t, h)),  # −softplus
        "beta": 1.0 / (1.0 + np.exp(-normal(b, t, h))),
    }


def jax_gdn(
    bench: BenchConfig, x: dict[str, np.ndarray], impl: str = "jax"
) -> tuple[dict[str, Any], np.ndarray]:
    c, dt = bench.model.gdn_chunk_size, jnp.dtype(bench.dtype)
    args = [jnp.asarray(x[n], dt) for n in ("q", "k", "v")] + [jnp.asarray(x[n]) for n in ("g", "beta")]

    def out(*a: jax.Array) -> jax.Array:
        return chunk_gated_delta_rule(*a, chunk_size=c, impl=impl)[0]

    fwd = jax.jit(out)
    fwd_bwd = jax.jit(jax.grad(lambda *a: jnp.sum(out(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4)))
    t_f, first_f = timed(lambda: fwd(*args), warmup=bench.warmup, repeats=bench.repeats)
    t_b, first_b = timed(lambda: fwd_bwd(*args), warmup=bench.warmup, repeats=bench.repeats)
    res = {"fwd_s": figure(t_f), "fwd_bwd_s": figure(t_b), "first_call_s": [first_f, first_b]}
    return res, np.asarray(fwd(*args), np.float32)


def torch_gdn(bench: BenchConfig, x: dict[str, np.ndarray]) -> tuple[dict[str, Any], np.ndarray]:
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as tf

    torch.set_num_threads(bench.threads)
    c, dt = bench.model.gdn_chunk_size, getattr(torch, bench.dtype)
    args = [torch.from_numpy(x[n]).to(dt) for n in ("q", "k", "v")] + [
        torch.from_numpy(x[n]) for n in ("g", "beta")
    ]

    def fwd() -> Any:
        with torch.no_grad():
            return tf(*args, chunk_size=c, use_qk_l2norm_in_kernel=True)[0]

    leaves = [a.clone().requires_grad_(True) for a in args]

    def fwd_bwd() -> Any:
        for a in leaves:
            a.grad = None
        tf(*leaves, chunk_size=c, use_qk_l2norm_in_kernel=True)[0].float().sum().backward()
        return leaves[0].grad

    t_f, _ = timed(fwd, warmup=bench.warmup, repeats=bench.repeats)
    t_b, _ = timed(fwd_bwd, warmup=bench.warmup, repeats=bench.repeats)
    return {"fwd_s": figure(t_f), "fwd_bwd_s": figure(t_b)}, fwd().float().numpy()


def _with_rates(res: dict[str, Any], out: np.ndarray, flops: float) -> tuple[dict[str, Any], np.ndarray]:
    """Model FLOP/s from the times (the backward counted as twice the forward)."""
    res["fwd_flop_per_s"] = rate(flops, res["fwd_s"]["values"])
    res["fwd_bwd_flop_per_s"] = rate(3 * flops, res["fwd_bwd_s"]["values"])
    return res, out


def gdn_bench(bench: BenchConfig, *, vs_torch: bool = True, impl: str = "jax") -> dict[str, Any]:
    """Both kernels' times, FLOP/s, the torch/jaxpi time ratios and the outputs' largest difference.

    impl other than "jax" ("jax_assoc", "pallas"): "jaxpi" holds that path's figures and
    "plain_jax" the plain sequential path's, with `speedup_{impl}_*` = plain-JAX time / that
    path's time (> 1: it is faster) and `max_abs_diff_{impl}_vs_plain`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    m = bench.model
    x = gdn_inputs(bench)
    flops = deltanet_core_flops(
        bench.tokens,
        m.linear_num_value_heads,
        m.linear_key_head_dim,
        m.linear_value_head_dim,
        m.gdn_chunk_size,
    )
    jres, jout = _with_rates(*jax_gdn(bench, x, impl), flops)
    res: dict[str, Any] = {
        "impl": impl,
        # Pallas off GPU/TPU runs in its interpreter: a correctness path, not a speed
        "interpreted": impl == "pallas" and jax.default_backend() == "cpu",
        "shape": {
            "batch": bench.batch,
            "seq": bench.seq,
            "heads": m.linear_num_value_heads,
            "dk": m.linear_key_head_dim,
            "dv": m.linear_value_head_dim,
            "chunk": m.gdn_chunk_size,
        },
        "flops_fwd": flops,
        "jaxpi": jres,
    }
    if impl != "jax":
        pres, pout = _with_rates(*jax_gdn(bench, x, "jax"), flops)
        res["plain_jax"] = pres
        res[f"speedup_{impl}_fwd"] = ratio(pres["fwd_s"], jres["fwd_s"])
        res[f"speedup_{impl}_fwd_bwd"] = ratio(pres["fwd_bwd_s"], jres["fwd_bwd_s"])
        res[f"max_abs_diff_{impl}_vs_plain"] = float(np.max(np.abs(jout - pout)))
    if vs_torch:
        tres, tout = torch_gdn(bench, x)
        res["torch"] = tres
        # torch time over jaxpi time: > 1 means jaxpi is faster
        res["speedup_fwd"] = ratio(tres["fwd_s"], jres["fwd_s"])
        res["speedup_fwd_bwd"] = ratio(tres["fwd_bwd_s"], jres["fwd_bwd_s"])
        res["max_abs_diff"] = float(np.max(np.abs(jout - tout)))
    return res

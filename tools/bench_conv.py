"""The Gated DeltaNet's short conv (`jaxpi.kernels.conv.causal_conv1d`: the K taps stacked to
[B, T, K, C] and contracted by einsum) against a candidate, the K shifted products summed
elementwise in float32, forward and forward + backward, on this machine's default JAX device.
Medians of `--repeats` calls after one warm-up. (The candidate matched transformers' conv but
moved rounding enough to break two strict checks of the model: docs/performance.md.)

    python tools/bench_conv.py --seq 2048 --channels 1024 --dtype float32 --grad x
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.kernels.conv import _segment_runs, causal_conv1d


def shifted_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """The candidate: silu(Σ_k tap_k · weight_k) in float32, taps masked across segments."""
    length, taps_n = x.shape[1], weight.shape[0]
    window = jnp.concatenate([jnp.zeros((x.shape[0], taps_n - 1, x.shape[2]), x.dtype), x], axis=1)
    runs = None if segment_ids is None else _segment_runs(segment_ids, taps_n - 1)
    w32 = weight.astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32)
    for i in range(taps_n):
        tap = window[:, i : i + length].astype(jnp.float32)
        if runs is not None:
            tap = jnp.where((runs[:, i : i + length] == runs[:, -length:])[..., None], tap, 0)
        y = y + tap * w32[i]
    return jax.nn.silu(y).astype(x.dtype)


def median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--channels", type=int, default=1024)
    p.add_argument("--taps", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--grad", choices=["x", "weight", "both"], default="x", help="x: LoRA (conv frozen)")
    p.add_argument("--segments", type=int, default=1, help="packed sequences per row")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2, help="old/new alternations")
    args = p.parse_args()
    dtype = jnp.dtype(args.dtype)
    x = jax.random.normal(jax.random.key(0), (1, args.seq, args.channels)).astype(dtype)
    w = jax.random.normal(jax.random.key(1), (args.taps, args.channels)).astype(dtype)
    seg = None
    if args.segments > 1:
        seg = jnp.asarray(
            np.repeat(np.arange(args.segments), -(-args.seq // args.segments))[None, : args.seq]
        )
    argnums = {"x": 0, "weight": 1, "both": (0, 1)}[args.grad]
    impls = {
        "stacked_einsum": lambda x, w: causal_conv1d(x, w, segment_ids=seg)[0],
        "shifted_products": lambda x, w: shifted_conv(x, w, seg),
    }
    out: dict[str, dict[str, list[float]]] = {name: {"fwd_ms": [], "fwd_bwd_ms": []} for name in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            loss = lambda x, w, fn=fn: jnp.sum(fn(x, w).astype(jnp.float32) ** 2)  # noqa: E731
            out[name]["fwd_ms"].append(median_ms(jax.jit(fn), x, w, repeats=args.repeats))
            grad = jax.jit(jax.grad(loss, argnums=argnums))
            out[name]["fwd_bwd_ms"].append(median_ms(grad, x, w, repeats=args.repeats))
    a, b = (np.asarray(jax.jit(fn)(x, w), np.float32) for fn in impls.values())
    report = {"args": vars(args), "device": str(jax.devices()[0]), "results": out}
    report["max_rel_diff"] = float(np.abs(a - b).max() / np.abs(a).max())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""The 27B-shaped LoRA SFT step on one accelerator: MFU against the measured matmul peak, memory.

Random weights with the real Qwen3.5-27B shapes (64 layers, 48 DeltaNet + 16 attention), LoRA on
every linear layer, one sequence of `--seq` tokens, AdamW on the adapter. Stages run in order and
each one's result is written to `--out` as soon as it is known, so a stage that fails (out of
memory, say) still leaves the earlier figures:

    env        jax / flax versions and the device
    matmul     bf16 matmul peak, the MFU denominator, the larger of: [n, n] @ [n, n] on the wall
               clock, 20 chained products per timed call (median of 10 calls after ≥ 2 s of
               warm-up); single products timed by their kernels' device time under the profiler
               (median of 10), for the squares and the step's MLP shape [seq, hidden] @ [hidden,
               intermediate]. Each step also reports its MFU against the chained figure alone.
    step       compile time, step time (median of the timed steps), tokens/s, model FLOP/s, MFU,
               peak device memory
    gdn        chunked gated delta rule, 27B layer shapes, fwd and fwd+bwd, each `--gdn-variants`
               entry, and transformers' torch function on the same device (when torch sees the
               GPU; not with `--no-torch`); last when torch runs, because torch's memory lies
               outside JAX's pool and a step after it can fail to load its kernels, else first
    torch_matmul  the same chained products in torch (cuBLAS), a cross-check (not with --no-torch)
    profile    (`--profile`) one traced step after the first step stage's timed steps: device
               time by model part (`jaxpi.bench.profile`) and by kind of op, the traced events
               and the optimized HLO beside `--out`. With CUDA graphs on (XLA's default on GPU)
               a kernel names only its graph ("command_buffer_N"), not its HLO op, so the parts
               stay unknown: profile with XLA_FLAGS=--xla_gpu_enable_command_buffer= (that run's
               step time is then without graphs: 3.946 s on the H200, against 3.853 s with
               graphs in an earlier run)

Model FLOPs per step (what MFU counts, `jaxpi.bench.flops`; remat recomputation is not counted):
    4·P·T             frozen matmul weights P (projections + LM head): forward + input gradient
    6·P_lora·T        adapter weights: forward + input gradient + weight gradient
    3·2·T²·Hq·Dh      per attention layer (causal half of QKᵀ and PV; backward = 2× forward)
    3·2·T·H·(C(3Dk+2Dv) + 3DkDv)   per DeltaNet layer, counted at C = 64 whatever `--gdn-chunk`
                                    the step uses (the (I+A)⁻¹ and the log-depth scan's
                                    composed maps not counted)

    jaxpi bench gpu --out results.json [--seq 8192] [--steps 5] [--tiny] [--impl jax pallas]
                    [--loss-chunk 1024] [--gdn-chunk 64] [--gdn-kernel block_v=16,num_stages=2]
                    [--attn-impl pallas] [--attn-kernel block_q=32,block_k=32]
                    [--profile] [--no-torch]
                    [--gdn-variants jax jax_assoc jax_assoc@128 jax_unroll8]

`--impl` lists the kernel paths of the step to measure, each a `gdn_impl`: "jax" (plain JAX,
sequential chunk scan), "jax_assoc" (plain JAX, the chunks composed in log depth), "jax_split"
(plain JAX, a state-only recurrence and chunk-parallel products), "pallas" (the Pallas chunk-scan
kernels) and/or "pallas_split" (the split scan with its recurrence in Pallas); `norm_impl` =
"pallas" for the Pallas paths, else "jax" (or `--norm-impl`, for the Pallas gated delta rule with
the plain norms, say). The step stage runs once per path (`step_seq8192`, `step_seq8192_jax_assoc`,
...). The gdn stage times each `--gdn-variants` entry (default: the `--impl` paths) on the same
inputs: "impl@chunk" for another chunk size, "jax_unrollN" (the sequential scan unrolled N times),
"jax_splitN" (the split scan, its recurrence unrolled N times), "pallas/PRECISION/BLOCK_V/WARPS/STAGES"
and "pallas_split/PRECISION/BLOCK_V/WARPS/STAGES" (Pallas kernel options), and records
each one's largest output difference from plain "jax" at chunk 64 run op by op (not jitted: on
the H200 the jitted plain path itself differs from it by 2.1e-3 of max|o| with bf16 inputs and
TF32 dots).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpi.config import GDN_IMPLS, REMAT_POLICIES

# The flags live apart from the stages (`jaxpi.bench.gpu`) so that building `jaxpi bench`'s
# parser imports no jax.
HELP = "the 27B-shaped LoRA step on one accelerator: MFU, memory, the gated delta rule's variants"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of `jaxpi bench gpu` (run by `jaxpi.bench.gpu.run`)."""
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seq", type=int, nargs="+", default=[8192])
    ap.add_argument("--fallback-seq", type=int, default=None, help="run this length if the first fails")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--remat", choices=list(REMAT_POLICIES), default="full", help="the step's remat policy")
    ap.add_argument("--matmul-n", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke run of this benchmark)")
    ap.add_argument("--skip", nargs="*", default=[], help="stages to skip: matmul gdn step torch")
    ap.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        help="LM head positions per chunk in the loss (0: all at once; the whole fp32 logits are 8 GiB at 8192)",
    )
    ap.add_argument(
        "--impl",
        nargs="+",
        default=["jax"],
        choices=list(GDN_IMPLS),
        help="the step's gdn_impl, one step stage per entry",
    )
    ap.add_argument("--gdn-chunk", type=int, default=64, help="the step's gdn_chunk_size")
    ap.add_argument(
        "--attn-impl",
        choices=["jax", "pallas"],
        default="jax",
        help="the step's attn_impl: the blocked plain-JAX causal attention or flash attention (Pallas/Triton)",
    )
    ap.add_argument(
        "--attn-kernel",
        default="",
        help='the flash attention\'s attn_kernel with --attn-impl pallas, e.g. "block_q=32,block_k=32,block_backward=16"',
    )
    ap.add_argument(
        "--gdn-kernel",
        default="",
        help="the Pallas step paths' gdn_kernel, e.g. \"block_v=16,num_stages=2\" (default: the kernels' defaults)",
    )
    ap.add_argument(
        "--norm-impl",
        choices=["jax", "pallas"],
        default=None,
        help="the step's norm_impl (default: pallas for --impl pallas / pallas_split, else jax)",
    )
    ap.add_argument(
        "--gdn-variants",
        nargs="+",
        default=None,
        help='gdn stage entries: "impl", "impl@chunk", "jax_unrollN", "jax_splitN", "pallas/PREC/BV/WARPS/STAGES",'
        ' "pallas_split/PREC/BV/WARPS/STAGES"'
        " (default: the --impl paths)",
    )
    ap.add_argument("--no-torch", action="store_true", help="no transformers comparison in the gdn stage")
    ap.add_argument("--profile", action="store_true", help="trace one step of the first step stage")

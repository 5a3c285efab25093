"""Model FLOPs of one LoRA SFT step on the Qwen3.5 hybrid stack: the numerator of MFU.

Counted are the matrix multiplications a step must do, at 2 FLOPs per multiply-add; elementwise
work (norms, gates, softmax, the conv1d, the optimizer) and any recomputation (remat) are not.
With T = batch · seq tokens:

    frozen weights   4 · P · T          P = matmul weights of every projection and the LM head
                                        (not the embedding, a lookup): forward 2PT + input
                                        gradient 2PT; frozen weights get no weight gradient
    LoRA adapters    6 · P_lora · T     P_lora = Σ r · (n_in + n_out) over adapted projections:
                                        forward, input gradient and weight gradient
    attention        6 · B · seq² · Hq · Dh   per full-attention layer: the causal half of QKᵀ and
                                        of P·V (2·seq²·Hq·Dh forward), backward twice the forward
    DeltaNet         6 · T · Hv · (C · (3·Dk + 2·Dv) + 3·Dk·Dv)   per DeltaNet layer, chunk C:
                                        per chunk, K·Kᵀ, Q·Kᵀ and T·(βK) (C²·Dk each), T·(βV) and
                                        P·Δ (C²·Dv each), W·S, Q·S and Kᵀ·Δ (C·Dk·Dv each);
                                        backward twice the forward; the (I + A)⁻¹ is not counted

Per layer, P is (d = hidden, I = intermediate, heads Hq/Hkv of Dh, DeltaNet Hk/Hv of Dk/Dv):

    attention  d·Hq·2Dh (q and its gate) + 2·d·Hkv·Dh (k, v) + Hq·Dh·d (o)
    DeltaNet   2·d·Hk·Dk (q, k) + 2·d·Hv·Dv (v, z) + 2·d·Hv (b, a) + Hv·Dv·d (out)
    MLP        3·d·I
    LM head    d·V (once)

This is the formula of `jaxpi bench gpu` and docs/performance.md, computed from the config
alone (no model is built), so it can be checked against a hand count and against XLA's own
cost analysis (tests/test_bench.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxpi.config import FULL, LINEAR, QwenConfig
from jaxpi.convert.table import LINEAR_NAMES as ALL_LINEAR
from jaxpi.convert.table import linear_modules, linear_part_shapes


def projection_shapes(cfg: QwenConfig, layer_type: str) -> dict[str, tuple[int, int]]:
    """(n_in, n_out) of each HF-named linear module of one layer (mixer and MLP), from the HF
    table's stored parts (a fused module's parts add up their outputs; q_proj's include the gate)."""
    shapes = linear_part_shapes(cfg, layer_type)
    out = {}
    for m in linear_modules(layer_type):
        parts = shapes[m.hf]
        out[m.hf] = (math.prod(parts[0][: m.n_in]), sum(math.prod(s[m.n_in :]) for s in parts))
    return out


def matmul_params(cfg: QwenConfig) -> int:
    """P: frozen matmul weights of all projections plus the LM head (tied or not, it is a matmul)."""
    layers = sum(n * m for t in cfg.layer_types for n, m in projection_shapes(cfg, t).values())
    return layers + cfg.hidden_size * cfg.vocab_size


def lora_params(cfg: QwenConfig, rank: int, targets: Sequence[str] = ALL_LINEAR) -> int:
    """P_lora: adapter weights r·(n_in + n_out) of every targeted module in every layer."""
    chosen = set(targets)
    return sum(
        rank * (n + m)
        for t in cfg.layer_types
        for name, (n, m) in projection_shapes(cfg, t).items()
        if name in chosen
    )


def attention_core_flops(seq: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of the causal attention core of one layer, one row: QKᵀ and P·V, causal half."""
    return 2.0 * seq * seq * heads * head_dim


def deltanet_core_flops(tokens: int, heads: int, dk: int, dv: int, chunk: int) -> float:
    """Forward FLOPs of the chunked gated delta rule over `tokens` tokens (all rows), one layer."""
    return 2.0 * tokens * heads * (chunk * (3 * dk + 2 * dv) + 3 * dk * dv)


def train_step_flops(
    cfg: QwenConfig, *, seq: int, batch: int, lora_rank: int, targets: Sequence[str] = ALL_LINEAR
) -> dict[str, Any]:
    """Model FLOPs of one LoRA step (forward + backward), by part; "total" is the MFU numerator."""
    t = seq * batch
    n_attn = cfg.layer_types.count(FULL)
    n_gdn = cfg.layer_types.count(LINEAR)
    p = matmul_params(cfg)
    p_lora = lora_params(cfg, lora_rank, targets)
    parts = {
        "projections": 4.0 * (p - cfg.hidden_size * cfg.vocab_size) * t,
        "lm_head": 4.0 * cfg.hidden_size * cfg.vocab_size * t,
        "lora": 6.0 * p_lora * t,
        "attention": 3.0 * n_attn * batch * attention_core_flops(seq, cfg.num_attention_heads, cfg.head_dim),
        "deltanet": 3.0
        * n_gdn
        * deltanet_core_flops(
            t,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.gdn_chunk_size,
        ),
    }
    return {
        "total": sum(parts.values()),
        "parts": parts,
        "per_token": sum(parts.values()) / t,
        "matmul_params": p,
        "lora_params": p_lora,
        "tokens": t,
    }

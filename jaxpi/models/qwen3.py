"""The Qwen3 dense text model (`Qwen3ForCausalLM`) in Flax NNX.

Qwen3 is the Qwen3.5 stack without its hybrid parts, so it is the same module tree read from a
config whose data says so (`jaxpi.config._qwen3_from_hf`): every layer full attention (one
group period, so the layers are scanned one per step), no attention output gate, rotary over the
whole head, plain RMSNorms. Per layer, with `norm(x) = x̂ · w` (x̂ = x / rms(x)):

    q, k, v = norm_q(x·Wq), norm_k(x·Wk), x·Wv       q: [B, T, Hq, d]; k, v: [B, T, Hkv, d]
    q, k    = rope(q), rope(k)                        (all d dims, theta from the config)
    h       = h + attn(q, k, v)·Wo                    (grouped-query, causal)
    h       = h + down(silu(norm(h)·Wg) ⊙ (norm(h)·Wu))

    logits  = norm(h) · W_lm   (W_lm = embedᵀ when tied, as the small Qwen3 sizes are)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxpi.config import FULL, QwenConfig
from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM


class Qwen3ForCausalLM(Qwen3_5ForCausalLM):
    """`Qwen3_5ForCausalLM`'s modules on a dense config (checked here, so a Qwen3.5 config is
    never built as this class by mistake)."""

    def __init__(self, cfg: QwenConfig, *, dtype: jnp.dtype | str = jnp.float32, rngs: nnx.Rngs):
        wrong = []
        if set(cfg.layer_types) != {FULL}:
            wrong.append(f"layer types {sorted(set(cfg.layer_types))} (Qwen3 has full attention only)")
        if cfg.attn_output_gate:
            wrong.append("an attention output gate")
        if cfg.norm_offset != 0.0:
            wrong.append(f"norm_offset {cfg.norm_offset} (Qwen3's norms are plain, offset 0)")
        if wrong:
            raise ValueError("not a Qwen3 dense config: " + "; ".join(wrong))
        super().__init__(cfg, dtype=dtype, rngs=rngs)

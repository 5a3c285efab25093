"""Pallas kernels (GPU Triton, TPU Mosaic; interpreted on CPU). `gdn`: the gated delta rule's chunk
recurrence; `norms`: the fused RMSNorm and gated RMSNorm; `sharded`: both run per shard in
`jax.shard_map` when the model is traced under a mesh."""

from jaxpi.kernels.pallas.gdn import (
    KernelOptions,
    pallas_chunk_gated_delta_rule,
    pallas_chunk_scan,
    pallas_recurrence,
)
from jaxpi.kernels.pallas.norms import NormOptions, pallas_gated_rms_norm, pallas_rms_norm

__all__ = [
    "KernelOptions",
    "NormOptions",
    "pallas_chunk_gated_delta_rule",
    "pallas_chunk_scan",
    "pallas_gated_rms_norm",
    "pallas_recurrence",
    "pallas_rms_norm",
]

"""Pallas kernels (GPU Triton, TPU Mosaic; interpreted on CPU). `gdn`: the gated delta rule's chunk recurrence."""

from jaxpi.kernels.pallas.gdn import KernelOptions, pallas_chunk_gated_delta_rule, pallas_chunk_scan

__all__ = ["KernelOptions", "pallas_chunk_gated_delta_rule", "pallas_chunk_scan"]

"""Numerical kernels: fused norms, the chunked gated delta rule, the causal conv, the attention core."""

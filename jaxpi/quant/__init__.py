"""Quantized frozen bases for QLoRA: bitsandbytes' formats, reproduced on the host, dequantized in JAX.

    nf4   4-bit NormalFloat, blocks of 64, double-quantized block scales (peft's QLoRA base)
    int8  row-wise absmax int8 (bitsandbytes' LLM.int8 weight format)

Modules: `codebooks` (the NF4 and dynamic 8-bit tables), `nf4` and `int8` (the quantizers and
their reference dequantization, numpy, bit for bit with bitsandbytes 0.50.2 on the CPU),
`stored` (a quantized HF tensor as a jaxpi projection's arrays, and `dequantize` in JAX). This
module itself imports nothing heavy: configs validate `base_quant` with it.
"""

from __future__ import annotations

BASE_QUANTS = ("none", "nf4", "int8")


def check_base_quant(value: str, field: str = "base_quant") -> str:
    """`value` if it is one of `BASE_QUANTS`, else a ValueError naming `field`."""
    if value not in BASE_QUANTS:
        raise ValueError(f"{field} must be one of {', '.join(BASE_QUANTS)}, got {value!r}")
    return value

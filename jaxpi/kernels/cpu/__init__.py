"""Native CPU kernels, built from C++ on first use and called as XLA FFI custom calls.

`rows.py` holds them: the product of a few rows with a bf16 weight, which XLA:CPU's own kernels
read at about half the memory bandwidth, and, on AVX-512 BF16, the product of 5-256 rows with a
weight packed per strip of 32 columns (docs/performance.md, "Decode at the bandwidth limit").
Each kernel has a plain-JAX equivalent its callers fall back to where the kernel cannot be built
or run.
"""

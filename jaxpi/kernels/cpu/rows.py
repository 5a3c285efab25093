"""`rows_bf16(x, w)`: float32 `x · w` for x `[M ≤ 8, K]` and w `[K, N]` in bf16, as the XLA FFI custom
call of `rows_bf16.cc` (AVX-512), the library built on first use; `packed_bf16(x, pack(w))`: the
same for more rows (M ≤ 256) on AVX-512 BF16 dot products, with w packed per strip of 32 columns.

The library is compiled with the system's C++ compiler into `$JAXPI_KERNEL_CACHE` (default
`$XDG_CACHE_HOME/jaxpi/kernels`, else `~/.cache/jaxpi/kernels`), named by a digest of the source,
the flags, the compiler and jaxlib, and renamed into place when complete, so processes share one
build. The library is compiled for the baseline x86-64 (its AVX-512 functions carry target
attributes), so the build does not depend on the host and one cache serves hosts with and without
the instructions: the library itself says whether this CPU runs its kernel.

`delta_step` is one decode token of the gated delta rule (AVX-512, float32), for
`jaxpi.kernels.gated_delta.gated_delta_step`; `take_rows16` the embedding lookup of a 2-byte table
(plain C++), for `jaxpi.models.qwen3_5.embed_rows`.

`available()` is False, and callers use XLA's own product, when the kernels are switched off
(`JAXPI_CPU_KERNELS=off`), the backend is not the CPU, the CPU lacks AVX-512, or the build fails
(then with one warning naming the reason); `dense` also skips it under a mesh, where XLA's
partitioner would have to split a custom call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

SOURCE = Path(__file__).with_name("rows_bf16.cc")
TARGET = "jaxpi_rows_bf16"
PACKED_TARGET = "jaxpi_packed_bf16"
PACK_TARGET = "jaxpi_pack_bf16"
DELTA_TARGET = "jaxpi_delta_step"
TAKE_TARGET = "jaxpi_take_rows16"
MAX_PACKED_ROWS = 256  # packed_bf16's limit (kMaxPackedRows)
STRIP = 32  # columns per packed strip
MAX_ROWS = 8  # the kernel's limit (kMaxRows)
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")  # no -m flags: see the module docstring
SWITCH = "JAXPI_CPU_KERNELS"  # "off" / "0" / "false": never build or use the native kernels
CACHE = "JAXPI_KERNEL_CACHE"


def cache_dir() -> Path:
    if os.environ.get(CACHE):
        return Path(os.environ[CACHE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxpi" / "kernels"


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def build() -> Path:
    """The compiled library's path, compiling it first if this source, these flags, this compiler
    and this jaxlib have no build yet."""
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            [SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), jaxlib.__version__.encode()]
        )
    ).hexdigest()[:16]
    out = cache_dir() / f"rows_bf16-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        os.replace(tmp, out)  # atomic: another process sees no library or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded library, or None where the kernels cannot run (built and loaded once per process)."""
    if os.environ.get(SWITCH, "").lower() in ("0", "off", "false"):
        return None
    if jax.default_backend() != "cpu":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        return ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(
            f"jaxpi: the native CPU kernel did not build ({detail[-400:]}); using XLA's", stacklevel=3
        )
        return None


def _register(probe: str, targets: dict[str, str]) -> bool:
    """Registers the library's handlers (`{target: symbol}`) where its `probe()` says this CPU runs
    them; whether it did."""
    lib = _library()
    if lib is None or not getattr(lib, probe)():
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


@functools.cache
def available() -> bool:
    """Whether `rows_bf16` can run here (AVX-512; registered once per process)."""
    return _register("jaxpi_rows_bf16_supported", {TARGET: "JaxpiRowsBf16"})


@functools.cache
def delta_available() -> bool:
    """Whether `delta_step` can run here (AVX-512; registered once per process)."""
    return _register("jaxpi_rows_bf16_supported", {DELTA_TARGET: "JaxpiDeltaStep"})


@functools.cache
def take_available() -> bool:
    """Whether `take_rows16` can run here (any x86-64; registered once per process)."""
    return _register("jaxpi_take_rows16_supported", {TAKE_TARGET: "JaxpiTakeRows16"})


@functools.cache
def packed_available() -> bool:
    """Whether `pack` and `packed_bf16` can run here (AVX-512 BF16; registered once per process)."""
    return _register(
        "jaxpi_packed_bf16_supported", {PACKED_TARGET: "JaxpiPackedBf16", PACK_TARGET: "JaxpiPackBf16"}
    )


def pack(w: jax.Array) -> jax.Array:
    """w `[K, N]` (bf16) as `packed_bf16` reads it: `[ceil(N / 32), ceil(K / 2), 64]`, element
    `[s, p, 2c + j] = w[2p + j, 32s + c]` (zeros past K and N), by the native kernel at the
    memory's speed (XLA's transpose of 2-byte pairs took 1.7-4x longer). Inside the engine's decode
    loop the weight is loop-invariant and XLA packs it once per call, before the loop. Raises where
    `packed_available()` is False."""
    if w.ndim != 2 or w.dtype != jnp.bfloat16:
        raise ValueError(f"pack takes a bf16 [K, N] weight, got {w.dtype} {w.shape}")
    if not packed_available():
        raise RuntimeError("pack does not run here (it needs AVX-512 BF16 on the CPU backend)")
    k, n = w.shape
    out = jax.ShapeDtypeStruct((-(-n // STRIP), -(-k // 2), 2 * STRIP), jnp.bfloat16)
    return jax.ffi.ffi_call(PACK_TARGET, out, vmap_method="sequential")(w)


def packed_bf16(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """`x · w` in float32 for x `[M, K]` (1 ≤ M ≤ `MAX_PACKED_ROWS`) and `packed = pack(w)` of a
    `[K, n]` bf16 weight, on AVX-512 BF16 dot products (inputs and sums below 2^-126 flushed to
    zero). Raises where `packed_available()` is False."""
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_PACKED_ROWS or packed.ndim != 3:
        raise ValueError(f"packed_bf16 takes x [M <= {MAX_PACKED_ROWS}, K] and a packed w, got {x.shape}")
    if packed.shape[1:] != (-(-x.shape[1] // 2), 2 * STRIP) or not 0 < n <= packed.shape[0] * STRIP:
        raise ValueError(f"packed_bf16: w packed {packed.shape} is not a [{x.shape[1]}, {n}] weight's")
    if x.dtype != jnp.bfloat16 or packed.dtype != jnp.bfloat16:
        raise ValueError(f"packed_bf16 takes bf16 operands, got {x.dtype} and {packed.dtype}")
    if not packed_available():
        raise RuntimeError("packed_bf16 does not run here (it needs AVX-512 BF16 on the CPU backend)")
    out = jax.ShapeDtypeStruct((x.shape[0], packed.shape[0] * STRIP), jnp.float32)
    y = jax.ffi.ffi_call(PACKED_TARGET, out, vmap_method="sequential")(x, packed)
    return y[:, :n]


def rows_bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x · w` in float32: x `[M, K]` (1 ≤ M ≤ `MAX_ROWS`), w `[K, N]`, both bf16. Raises where
    `available()` is False."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"rows_bf16 takes x [M <= {MAX_ROWS}, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"rows_bf16 takes bf16 operands, got {x.dtype} and {w.dtype}")
    if not available():
        raise RuntimeError("rows_bf16 does not run here (it needs AVX-512 on the CPU backend)")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w)


def delta_step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One decode token of the gated delta rule on float32, per row and value head: state
    `[B, H, K, V]`, q and k `[B, H, K]` (normalized, repeated to the value heads), v `[B, H, V]`,
    g and beta `[B, H]`; returns (out `[B, H, V]`, the new state), the state updated in place where
    XLA lets the output alias it. Raises where `delta_available()` is False."""
    b, h, kd, vd = state.shape
    want = {"q": (b, h, kd), "k": (b, h, kd), "v": (b, h, vd), "g": (b, h), "beta": (b, h)}
    for name, x in zip(want, (q, k, v, g, beta), strict=True):
        if x.shape != want[name] or x.dtype != jnp.float32:
            raise ValueError(f"delta_step: {name} is {x.dtype} {x.shape}, expected float32 {want[name]}")
    if state.dtype != jnp.float32:
        raise ValueError(f"delta_step: the state is {state.dtype}, expected float32")
    if not delta_available():
        raise RuntimeError("delta_step does not run here (it needs AVX-512 on the CPU backend)")
    out = (jax.ShapeDtypeStruct((b, h, vd), jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32))
    call = jax.ffi.ffi_call(DELTA_TARGET, out, vmap_method="sequential", input_output_aliases={0: 1})
    return tuple(call(state, q, k, v, g, beta))


def take_rows16(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`jnp.take(table, ids, axis=0)` for a `[V, D]` table of a 2-byte dtype, the rows' bits copied
    by the native kernel (an index in [-V, 0) counts from the end; one outside [-V, V) gives a row
    of NaN bits, 0xFFFF). Raises where `take_available()` is False."""
    if table.ndim != 2 or jnp.dtype(table.dtype).itemsize != 2:
        raise ValueError(
            f"take_rows16 takes a [V, D] table of a 2-byte dtype, got {table.dtype} {table.shape}"
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"take_rows16 takes integer ids, got {ids.dtype}")
    if not take_available():
        raise RuntimeError("take_rows16 does not run here (the native CPU kernels are off or did not build)")
    v = table.shape[0]
    if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):  # in range, or V (no row)
        ids = jnp.where(ids < v, ids, v).astype(jnp.int32)
    elif jnp.dtype(ids.dtype).itemsize > 4:  # int64: in range, counted from the end, or V
        ids = jnp.where((ids >= -v) & (ids < v), ids, v).astype(jnp.int32)
    out = jax.ShapeDtypeStruct((*ids.shape, table.shape[1]), table.dtype)
    return jax.ffi.ffi_call(TAKE_TARGET, out, vmap_method="sequential")(table, ids.astype(jnp.int32))

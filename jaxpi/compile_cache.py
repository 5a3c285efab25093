"""JAX's persistent compilation cache for the `jaxpi` commands that compile the model.

A resumed run (after a crash, a preemption or a SIGKILL) compiles the same programs as the run it
continues; with the cache it loads them instead. On the CPU toy GRPO run of tests/test_grpo_run.py
a resume took 18.3 s against 39.2 s without (docs/performance.md "The compilation cache").

Where, in order:
  JAX_COMPILATION_CACHE_DIR   JAX's own variable: set, JAX's handling wins and jaxpi leaves it be.
  JAXPI_COMPILE_CACHE         a directory, or "off" (also "0", "false", "none") to compile afresh.
  default                     $XDG_CACHE_HOME/jaxpi/xla, else ~/.cache/jaxpi/xla.

Entries are keyed by the program, the backend, jaxlib and the XLA flags, so a changed model or
flag compiles anew. Programs that compile in under JAX's `jax_persistent_cache_min_compile_time_secs`
(1 s unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise) are not stored. The directory
is capped at `MAX_BYTES`, least recently used entries evicted first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ENV = "JAXPI_COMPILE_CACHE"
OFF = frozenset({"off", "0", "false", "none", "no"})
MAX_BYTES = 8 * 1024**3


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxpi" / "xla"


def resolve() -> Path | None:
    """The directory jaxpi would give JAX, or None (off, or JAX's own variable decides)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    return Path(value).expanduser() if value else default_dir()


def enable() -> Path | None:
    """Point JAX's persistent cache at `resolve()`; call before the first compile. Returns the
    directory, or None when jaxpi set nothing. A directory that cannot be created turns the cache
    off with a warning rather than failing the command."""
    path = resolve()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"jaxpi: compilation cache off ({path}: {e.strerror}); set {ENV}=DIR or off", file=sys.stderr)
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_compilation_cache_max_size < 0:  # JAX's default: unbounded
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """No persistent-cache reads or writes inside (timing compiles: `jaxpi bench compile`), whatever
    JAX_COMPILATION_CACHE_DIR or `enable()` set."""
    import jax

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)

"""The persistent compilation cache of the `jaxpi` commands (jaxpi/compile_cache.py): where it goes,
that a second process loads what the first compiled, and that timing code bypasses it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpi import compile_cache
from jaxpi.testing.xla import child_env

ROOT = Path(__file__).resolve().parents[1]

# A process that enables the cache as the CLI does, compiles one program, and reports JAX's own
# cache-hit and cache-miss events.
PROBE = """
import json, sys
import jax, jax.numpy as jnp
from jaxpi import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
path = compile_cache.enable()
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
if sys.argv[1] == "disabled":
    with compile_cache.disabled():
        f(jnp.ones((64, 64)))
else:
    f(jnp.ones((64, 64)))
print(json.dumps({"path": str(path), "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def probe(env: dict, mode: str = "plain") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def clean_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAXPI_"))}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the probe compiles in milliseconds
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    return child_env(env)


def test_where_the_cache_goes(monkeypatch, tmp_path):
    for var in ("JAX_COMPILATION_CACHE_DIR", compile_cache.ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve() == tmp_path / "xdg" / "jaxpi" / "xla"
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.resolve() == tmp_path / "mine"
    for off in ("off", "0", "false", "None"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.resolve() is None
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))  # JAX's own wins
    assert compile_cache.resolve() is None


def test_second_process_loads_what_the_first_compiled(clean_env, tmp_path):
    first = probe(clean_env)
    assert first["path"] == str(tmp_path / "xdg" / "jaxpi" / "xla")
    assert first["hits"] == 0 and first["misses"] >= 1  # the matmul, and jnp.ones' own program
    assert any(Path(first["path"]).iterdir()), "nothing was written"
    second = probe(clean_env)
    assert (second["hits"], second["misses"]) == (first["misses"], 0)
    # Off: compiled afresh, nothing read.
    off = probe({**clean_env, compile_cache.ENV: "off"})
    assert off["path"] == "None" and off["hits"] == 0


def test_disabled_neither_reads_nor_writes(clean_env, tmp_path):
    env = {**clean_env, compile_cache.ENV: str(tmp_path / "c")}
    got = probe(env, "disabled")
    assert (got["hits"], got["misses"]) == (0, 0) and not any((tmp_path / "c").iterdir())
    probe(env)  # now stored ...
    got = probe(env, "disabled")  # ... and still not read
    assert got["hits"] == 0


def test_an_unwritable_directory_turns_the_cache_off(clean_env, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "plain"],
        env={**clean_env, compile_cache.ENV: str(blocker / "sub")},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["path"] == "None"
    assert "compilation cache off" in proc.stderr


def test_bench_compile_bypasses_a_cache_jax_was_given(clean_env, tmp_path):
    """`jaxpi bench compile` times compiles: with JAX's own cache variable set (which jaxpi leaves to
    JAX), its step compiles inside `disabled()`, so nothing is written (and, by the test above,
    nothing read)."""
    cache = tmp_path / "jax-cache"
    env = {**clean_env, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}
    argv = ["bench", "compile", "--preset", "tiny", "--layers", "1", "--seq", "16", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", *argv, "--warmup", "1", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["results"]["compile"]["layers"]["1"]["compile_s"]["median"] > 0
    assert not list(cache.glob("*")), list(cache.glob("*"))  # (without disabled(): jit__lambda-...-cache)
    probe(env)  # the same environment does cache an ordinary compile
    assert list(cache.glob("*-cache"))

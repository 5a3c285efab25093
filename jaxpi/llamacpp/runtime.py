"""The cached llama.cpp build at work: its quantizer and imatrix tool as subprocesses, and GGUF
logits and teacher-forced perplexity through `llama-cpp-python`'s bindings to the same library.

`find()` raises `LlamaCppMissingError` (naming `jaxpi gguf setup`) when there is no finished build.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.llamacpp.setup import TOOLS, default_dir, is_ready

# llama-quantize's type names (`llama-quantize --help`), those a Qwen3.5 GGUF is published in.
QUANT_TYPES = (
    "BF16", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1",
    "IQ4_NL", "IQ4_XS", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K", "Q2_K_S",
    "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ1_0", "TQ2_0",
)  # fmt: skip
# The seed's 17 variants span ~9-29 GB on the 27B (Q8_0 down to 2-bit IQ); it names no list, so
# `all` is the usual set over that range: every K-quant mix and IQ format from 8 to 2 bits.
ALL_QUANTS = (
    "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_NL", "IQ4_XS",
    "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_XXS", "Q2_K", "IQ2_M", "IQ2_XXS",
)  # fmt: skip
# llama-quantize refuses these without an importance matrix.
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K_S"})


class LlamaCppMissingError(FileNotFoundError):
    """No finished llama.cpp build where one was looked for."""


class LlamaCppError(ValueError):
    """llama.cpp refused its input (a tool exited non-zero, a file did not load); the message
    carries the end of its output. A ValueError, so `jaxpi` reports it as bad input (exit 2)."""


def parse_quants(spec: str | Sequence[str]) -> list[str]:
    """`"Q8_0,Q4_K_M"` or `"all"` -> the list of llama-quantize types, validated, in order."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise ValueError("--quant lists no types (e.g. --quant Q8_0,Q4_K_M, or --quant all)")
    out: list[str] = []
    for item in items:
        names = ALL_QUANTS if item.lower() == "all" else (item.upper(),)
        for name in names:
            if name not in QUANT_TYPES:
                raise ValueError(
                    f"unknown GGUF quant type {item!r}; expected 'all' or some of {', '.join(QUANT_TYPES)}"
                )
            if name not in out:
                out.append(name)
    return out


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def tool(self, name: str) -> Path:
        if name not in TOOLS:
            raise ValueError(f"{name} is not one of the built tools {TOOLS}")
        return self.bin / name

    def run(self, name: str, args: Sequence[str], *, timeout: float | None = None) -> str:
        """Run a tool; its output (stdout and stderr) on success, LlamaCppError on failure."""
        cmd = [str(self.tool(name)), *map(str, args)]
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise LlamaCppError(f"{name} ran past {timeout} s: {' '.join(cmd)}") from None
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-20:])
            raise LlamaCppError(f"{name} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        return proc.stdout

    def quantize(
        self, src: Path, dst: Path, quant: str, *, imatrix: Path | None = None, threads: int = 0
    ) -> str:
        """`llama-quantize [--imatrix F] SRC DST TYPE`; returns its log."""
        if quant in NEEDS_IMATRIX and imatrix is None:
            raise ValueError(
                f"{quant} needs an importance matrix (llama.cpp refuses it without one): pass --imatrix"
            )
        args = ["--imatrix", str(imatrix)] if imatrix is not None else []
        return self.run("llama-quantize", [*args, src, dst, quant, str(threads or os.cpu_count() or 1)])

    def imatrix(self, model: Path, text: Path, out: Path, *, ctx: int, threads: int = 0) -> str:
        """llama.cpp's own imatrix tool over the text file `text`, in chunks of `ctx` tokens."""
        args = [
            "-m",
            model,
            "-f",
            text,
            "-o",
            out,
            "-c",
            str(ctx),
            "-b",
            str(ctx),
            "-ub",
            str(ctx),
            "--no-ppl",
            "--parse-special",
            "--no-escape",
        ]
        return self.run("llama-imatrix", [*args, "-t", str(threads or os.cpu_count() or 1)])

    def bindings(self) -> Any:
        """The `llama_cpp` module of `llama-cpp-python`, loading this build's libllama."""
        os.environ["LLAMA_CPP_LIB_PATH"] = str(self.bin)
        path = str(self.root / "python")
        if path not in sys.path:
            sys.path.insert(0, path)
        module = importlib.import_module("llama_cpp")
        lib = Path(module.llama_cpp._lib._name).resolve()
        if lib.parent != self.bin.resolve():
            raise LlamaCppError(f"llama_cpp loaded {lib}, not the build at {self.bin}")
        return module


def find(root: str | os.PathLike | None = None) -> LlamaCpp:
    """The finished build at `root` (default: `$JAXPI_LLAMACPP_DIR` or the cache)."""
    root = Path(root) if root is not None else default_dir()
    if not is_ready(root):
        raise LlamaCppMissingError(
            f"llama.cpp is not built at {root}: run `jaxpi gguf setup` (builds it once from the "
            f"llama-cpp-python sdist on PyPI, ~3 min on 2 cores) or set JAXPI_LLAMACPP_DIR"
        )
    return LlamaCpp(root)


class GGUFModel:
    """A GGUF file loaded in llama.cpp (with a LoRA adapter applied if given), for the logits of
    sequences of up to `n_ctx` tokens, each evaluated from a fresh state (no BOS added: tokens
    are used as given). `kv_f32`: a float32 KV cache (llama.cpp defaults to float16, which alone
    moves a tiny model's logits by ~1e-4 relative). Use as a context manager."""

    def __init__(
        self, lc: LlamaCpp, model: str | os.PathLike, *, n_ctx: int = 512, lora: str | os.PathLike | None = None,
        lora_scale: float = 1.0, threads: int = 0, kv_f32: bool = True,
    ):  # fmt: skip
        llama_cpp = lc.bindings()
        if not Path(model).is_file():
            raise FileNotFoundError(f"{model}: no such GGUF file")
        n_ctx = max(int(n_ctx), 8)
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(model), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                lora_path=None if lora is None else str(lora), lora_scale=lora_scale, verbose=False,
                n_threads=threads or os.cpu_count() or 1,
                **({"type_k": 0, "type_v": 0} if kv_f32 else {}),  # GGML_TYPE_F32
            )  # fmt: skip
        except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
            raise LlamaCppError(
                f"llama.cpp cannot load {model}{'' if lora is None else f' with {lora}'}: {e}"
            ) from None
        self.path, self.n_ctx, self.vocab = Path(model), n_ctx, self.llm.n_vocab()

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """`[T, vocab]` float32 logits of `tokens` at every position, from a fresh state."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx:
            raise ValueError(f"{n} tokens: evaluate 1 to {self.n_ctx} at a time")
        if max(tokens) >= self.vocab or min(tokens) < 0:
            raise ValueError(f"token ids outside [0, {self.vocab}) for {self.path}")
        self.llm.reset()  # n_tokens = 0: eval() drops every cached position (and recurrent state)
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[:n, : self.vocab], dtype=np.float32)

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_worker(
    lc: LlamaCpp,
    model: str | os.PathLike,
    seqs: Sequence[Sequence[int]],
    mode: str,
    *,
    lora: str | os.PathLike | None,
    lora_scale: float,
    kv_f32: bool,
) -> dict[str, np.ndarray]:
    """Run `jaxpi.llamacpp.worker` on `seqs`: llama.cpp in a child process, whose abort is an error here."""
    seqs = [np.asarray(s, np.int32) for s in seqs]
    if not seqs or min(len(s) for s in seqs) == 0:
        raise ValueError("no tokens to evaluate")
    with tempfile.TemporaryDirectory(prefix="jaxpi-llamacpp-") as tmp:
        req, res = Path(tmp) / "request.npz", Path(tmp) / "result.npz"
        np.savez(
            req, model=str(model), lora="" if lora is None else str(lora), lora_scale=lora_scale, kv_f32=kv_f32,
            mode=mode, tokens=np.concatenate(seqs), lengths=np.asarray([len(s) for s in seqs], np.int64),
        )  # fmt: skip
        env = {**os.environ, "JAXPI_LLAMACPP_DIR": str(lc.root)}
        proc = subprocess.run(
            [sys.executable, "-m", "jaxpi.llamacpp.worker", str(req), str(res)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            if proc.returncode < 0:
                name = signal.Signals(-proc.returncode).name
                asserts = [ln for ln in lines if "GGML_ASSERT" in ln or "error" in ln.lower()][:3]
                raise LlamaCppError(
                    f"llama.cpp aborted ({name}) evaluating {model}" + ("" if lora is None else f" with {lora}")
                    + (": " + " | ".join(asserts) if asserts else "")
                )  # fmt: skip
            raise LlamaCppError(
                lines[-1] if lines else f"the llama.cpp worker exited {proc.returncode} on {model}"
            )
        with np.load(res, allow_pickle=False) as out:
            return {k: out[k] for k in out.files}


def gguf_logits(
    lc: LlamaCpp,
    model: str | os.PathLike,
    tokens: Sequence[int],
    *,
    lora: str | os.PathLike | None = None,
    lora_scale: float = 1.0,
    kv_f32: bool = True,
) -> np.ndarray:
    """llama.cpp's logits `[T, vocab]` (float32) of one sequence, from a fresh state, computed in a
    child process (see `jaxpi.llamacpp.worker`)."""
    out = _in_worker(lc, model, [tokens], "logits", lora=lora, lora_scale=lora_scale, kv_f32=kv_f32)
    return out["logits_0"]


def gguf_nll(
    lc: LlamaCpp,
    model: str | os.PathLike,
    seqs: Sequence[Sequence[int]],
    *,
    lora: str | os.PathLike | None = None,
    lora_scale: float = 1.0,
) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens) of every sequence's tokens after its first, each
    from a fresh state, in llama.cpp (a child process; only the sums come back, not the logits)."""
    out = _in_worker(lc, model, seqs, "nll", lora=lora, lora_scale=lora_scale, kv_f32=True)
    return float(out["nll"].sum()), int(out["count"].sum())


def nll_per_token(logits: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """Teacher-forced negative log-likelihood of tokens[1:] under logits[:-1] (float64)."""
    z = logits[:-1].astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -logp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]

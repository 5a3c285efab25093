"""`export_gguf`: a HF Qwen3.5 checkpoint out as GGUF files for llama.cpp (what `jaxpi export
--format gguf` runs): the base GGUF written by jaxpi (`jaxpi.convert.gguf`), each requested
variant made from it by llama.cpp's own quantizer (with an importance matrix when one is given
or computed from sessions, `jaxpi.convert.imatrix`), and with `report` the fidelity table:
teacher-forced perplexity of every file on held-out sessions, evaluated by llama.cpp itself.

Layout of the output directory (written atomically: nothing appears at `out` until every file is
complete):

    <name>-BF16.gguf            the base (kept when BF16 is among the variants; else only used)
    <name>-Q8_0.gguf ...        one per variant
    imatrix.gguf                the importance matrix used (computed or copied)
    gguf_report.json / .md / fidelity.png   with `report`
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.atomic import atomic_dir
from jaxpi.convert.gguf import FILE_TYPES, gguf_package, write_base_gguf
from jaxpi.convert.hf import load_hf
from jaxpi.convert.imatrix import MIN_TOKENS, Sequence_, collect, load_calibration, write_imatrix
from jaxpi.llamacpp.runtime import NEEDS_IMATRIX, LlamaCpp, find, gguf_nll, nll_per_token, parse_quants
from jaxpi.stats.plots import plot_fidelity

_FALLBACK = re.compile(r"(\d+) of (\d+) tensor\(s\) required fallback quantization")


def _log(progress: bool) -> Callable[[str], None]:
    return (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds."""
    r = gguf_package().GGUFReader(str(path))
    out: dict[str, int] = {}
    for t in r.tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items()))


def perplexity(
    lc: LlamaCpp, model: Path, seqs: Sequence[np.ndarray], *, lora: Path | None = None
) -> dict[str, float]:
    """Teacher-forced perplexity of `model` in llama.cpp over `seqs` (each from a fresh state):
    exp of the mean negative log-likelihood of every token after the first of each sequence."""
    seqs = [s for s in seqs if len(s) >= 2]
    if not seqs:
        raise ValueError("no held-out sequence of two or more tokens to score")
    total, n = gguf_nll(lc, model, [s.tolist() for s in seqs], lora=lora)
    return {"ppl": float(np.exp(total / n)), "nll": total / n, "tokens": n}


def _windows(seqs: Sequence[Sequence_], ctx: int) -> list[np.ndarray]:
    return [
        s.ids[i : i + ctx] for s in seqs for i in range(0, len(s.ids), ctx) if len(s.ids[i : i + ctx]) >= 2
    ]


def export_gguf(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    quants: str | Sequence[str] = ("Q8_0", "Q4_K_M"),
    dtype: str = "BF16",
    imatrix: str | os.PathLike | None = None,
    sessions: str | os.PathLike | None = None,
    heldout: float = 0.2,
    ctx: int = 512,
    report: bool = False,
    compare_imatrix: bool = True,
    name: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    llamacpp: LlamaCpp | None = None,
) -> dict[str, Any]:
    """Write the GGUF export of `src` to the directory `out`; return a summary (and the report)."""
    src, out = Path(src), Path(out)
    log = _log(progress)
    variants = parse_quants(quants)
    if dtype not in FILE_TYPES:
        raise ValueError(f"the base GGUF's dtype must be one of {list(FILE_TYPES)}, not {dtype!r}")
    if ctx < MIN_TOKENS:
        raise ValueError(
            f"--ctx must be at least {MIN_TOKENS} tokens (llama.cpp skips shorter batches), got {ctx}"
        )
    if report and sessions is None:
        raise ValueError("--report needs --sessions (the held-out sessions are scored)")
    if imatrix is not None and not Path(imatrix).is_file():
        raise FileNotFoundError(f"{imatrix}: no such importance-matrix file")
    lc = llamacpp or find()  # before any work: a missing llama.cpp is a clear error up front
    name = name or src.name
    t0 = time.monotonic()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        base = tmp / f"{name}-{dtype}.gguf"
        log(f"writing the {dtype} base GGUF {base.name}")
        base_info = write_base_gguf(src, base, dtype=dtype, name=name, progress=log)
        calib = held = None
        split: dict[str, Any] = {}
        if sessions is not None:
            calib, held, split = load_calibration(sessions, src, heldout=heldout if report else 0.0)
        imx = None
        if imatrix is not None:
            imx = tmp / "imatrix.gguf"
            shutil.copyfile(imatrix, imx)
        elif calib:
            log(f"importance matrix over {len(calib)} sequences of {len(split['calibration_tasks'])} tasks")
            stats = collect(src, calib, ctx=ctx, progress=log)
            imx = tmp / "imatrix.gguf"
            write_imatrix(imx, stats, datasets=[str(sessions)], ctx=ctx)
        files: dict[str, dict[str, Any]] = {}
        for q in variants:
            if q == dtype:
                files[q] = {"file": base.name, "bytes": base.stat().st_size, "imatrix": False}
                continue
            dst = tmp / f"{name}-{q}.gguf"
            log(f"llama-quantize {q}{' (imatrix)' if imx else ''}")
            text = lc.quantize(base, dst, q, imatrix=imx)
            m = _FALLBACK.search(text)
            files[q] = {
                "file": dst.name,
                "bytes": dst.stat().st_size,
                "imatrix": imx is not None,
                "fallback_tensors": int(m.group(1)) if m else 0,
                "tensor_types": tensor_types(dst),
            }
        table = None
        if report:
            table = _fidelity(
                lc, src, tmp, base, dtype, variants, files, imx, _windows(held, ctx), compare_imatrix, log
            )
            table["split"] = split
            (tmp / "gguf_report.json").write_text(json.dumps(table, indent=2) + "\n")
            (tmp / "gguf_report.md").write_text(_markdown(table))
            plot_fidelity(table, tmp / "fidelity.png")
        if dtype not in variants:
            base.unlink()
    summary = {
        "source": str(src),
        "output": str(out),
        "format": "gguf",
        "base": {**base_info, "file": base.name, "kept": dtype in variants},
        "variants": files,
        "imatrix": None if imx is None else "imatrix.gguf",
        "split": split or None,
        "seconds": round(time.monotonic() - t0, 1),
    }
    if table is not None:
        summary["report"] = {
            "rows": table["rows"],
            "files": ["gguf_report.json", "gguf_report.md", "fidelity.png"],
        }
    return summary


def _fidelity(
    lc: LlamaCpp,
    src: Path,
    tmp: Path,
    base: Path,
    dtype: str,
    variants: list[str],
    files: dict[str, Any],
    imx: Path | None,
    seqs: list[np.ndarray],
    compare_imatrix: bool,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Perplexity of the base and of every variant (and, with an imatrix, of each variant made
    without it) on the held-out windows, by llama.cpp; jaxpi's own float32 perplexity beside it."""
    if not seqs:
        raise ValueError(
            "the held-out split has no sequence to score: use more sessions or a larger --heldout"
        )
    log(f"perplexity on {len(seqs)} held-out windows")
    ref = perplexity(lc, base, seqs)
    rows = [{"format": dtype, "imatrix": False, "bytes": base.stat().st_size, **ref, "delta_pct": 0.0}]
    for q in variants:
        if q == dtype:
            continue
        r = perplexity(lc, tmp / files[q]["file"], seqs)
        rows.append({"format": q, "imatrix": files[q]["imatrix"], "bytes": files[q]["bytes"], **r,
                     "delta_pct": 100.0 * (r["ppl"] / ref["ppl"] - 1.0)})  # fmt: skip
        if imx is not None and compare_imatrix and q not in NEEDS_IMATRIX:
            plain = tmp / f".{q}-no-imatrix.gguf"
            try:
                lc.quantize(base, plain, q)
                r = perplexity(lc, plain, seqs)
                rows.append({"format": q, "imatrix": False, "bytes": plain.stat().st_size, **r,
                             "delta_pct": 100.0 * (r["ppl"] / ref["ppl"] - 1.0), "kept": False})  # fmt: skip
            finally:
                plain.unlink(missing_ok=True)
    ours = _jaxpi_perplexity(src, seqs)
    return {"reference": dtype, "jaxpi_float32_ppl": ours, "heldout_windows": len(seqs), "rows": rows}


def _jaxpi_perplexity(src: Path, seqs: list[np.ndarray]) -> float:
    _, model = load_hf(src, "float32")
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))
    total, n = 0.0, 0
    for ids in seqs:
        padded = np.zeros((1, -(-len(ids) // 64) * 64), np.int32)  # causal: the padding after is unseen
        padded[0, : len(ids)] = ids
        logits = np.asarray(forward(state, jnp.asarray(padded))[0, : len(ids)], np.float32)
        nll = nll_per_token(logits, ids.tolist())
        total += float(nll.sum())
        n += len(nll)
    return float(np.exp(total / n))


def _markdown(table: dict[str, Any]) -> str:
    lines = [
        f"Teacher-forced perplexity on {table['heldout_windows']} held-out windows "
        f"(tasks: {', '.join(table['split'].get('heldout_tasks', [])) or '-'}), evaluated by llama.cpp; "
        f"jaxpi's float32 model: {table['jaxpi_float32_ppl']:.4f}.",
        "",
        "| format | imatrix | size | perplexity | Δ vs " + table["reference"] + " |",
        "|---|---|---:|---:|---:|",
    ]
    for r in table["rows"]:
        size = f"{r['bytes'] / 1e6:.2f} MB"
        lines.append(
            f"| {r['format']} | {'yes' if r['imatrix'] else 'no'} | {size} | {r['ppl']:.4f} | {r['delta_pct']:+.2f}% |"
        )
    return "\n".join(lines) + "\n"

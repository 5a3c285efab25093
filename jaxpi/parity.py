"""Parity harness: jaxpi against `transformers`' Qwen3.5 on the same weights and tokens.

Both frameworks run the checkpoint in the same dtype (float32 or bfloat16) on the same random
tokens, and `transformers` runs it once more in true float64 (`jaxpi.torch_reference`), the
arbiter. For the logits and every parameter's gradient the report gives

    ours  = ‖g_jaxpi − g_64‖ / ‖g_64‖        torch = ‖g_torch − g_64‖ / ‖g_64‖        ours / torch

(our gradients mapped back to HF's layout through the weight table), and a tensor passes when
jaxpi is about as close to the truth as the reference's own run of that dtype: ours ≤ ratio ·
torch, or ours below a relative floor, or the error negligible against the whole model's
gradient (a tensor whose true gradient is ~0, e.g. decay gates erased by strong decays, is
judged by absolute size). A NaN, or a zero gradient where the truth is not negligible, always
fails. So a badly conditioned model does not fail (torch is off by as much) and a kernel that
keeps the loss but changes a gradient does (the seed report's fused-norm bug class).

Without the memory for float64, `reference="fp32"` compares jaxpi directly with torch's own run
against the fixed bars of `FP32_BARS`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpi.convert.hf import load_hf, text_prefix
from jaxpi.convert.safetensors_io import read_index
from jaxpi.convert.table import stack_index, text_rules
from jaxpi.host import available_memory
from jaxpi.kernels.dtypes import upcast
from jaxpi.kernels.inject import inject_bug

REFERENCES = ("auto", "fp64", "fp32")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Bars:
    """A tensor passes when ours ≤ ratio · torch, or ours ≤ rel_floor, or ‖Δ‖ ≤ abs_floor · ‖∇‖."""

    ratio: float
    rel_floor: float
    abs_floor: float


# Against float64 (docs/parity.md, "The verdict and its thresholds"; measured on drawn clean
# checkpoints of tests/test_parity_fuzz.py's strategy, 2026-12-01). float32: over 1,531 tensors
# of 40 checkpoints ours/torch has median 0.82 and 99th percentile 1.97, and among 59 further
# deep random-weight checkpoints at 2-32 tokens the worst was 4.7 (6.1 with gdn_chunk_size 32):
# both frameworks 1e-5..1e-4 off there, amplified rounding. Every tensor an injected bug
# corrupts is off by > 1e-3 (tests/test_inject.py). bfloat16 (641 tensors, 24 checkpoints): the
# ratio's 99th percentile 3.2, the worst above the floors ~4; a bf16 gradient is rounded to 8
# bits at the end, so only gross errors show.
FP64_BARS = {
    "float32": Bars(ratio=8.0, rel_floor=1e-6, abs_floor=1e-7),
    "bfloat16": Bars(ratio=8.0, rel_floor=2e-3, abs_floor=1e-6),
}
# Without a float64 run: jaxpi against torch's own run of the same dtype (the earlier harness).
FP32_BARS = {
    "float32": {"logits_rel": 1e-4, "grad_rel": 1e-3},
    "bfloat16": {"logits_rel": 1e-1, "grad_rel": 1.0},
}


@dataclasses.dataclass
class TensorError:
    """One tensor's verdict. `ours`/`torch`: relative L2 error against the reference; `share`:
    ‖ours − reference‖ / ‖whole-model reference gradient‖ (None for logits and fp32 mode)."""

    name: str
    ours: float
    torch: float | None
    share: float | None
    passed: bool
    why: str

    @property
    def ratio(self) -> float | None:
        if self.torch is None:
            return None
        return self.ours / self.torch if self.torch > 0 else (0.0 if self.ours == 0 else math.inf)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rel_err": self.ours,
            "torch_rel_err": self.torch,
            "ratio": self.ratio,
            "share": self.share,
            "passed": self.passed,
            "why": self.why,
        }


@dataclasses.dataclass
class ParityReport:
    hf_dir: str
    dtype: str
    reference: str  # "fp64" or "fp32" (what the errors are measured against)
    batch: int
    seq_len: int
    segments: int
    inject: str | None
    logits: TensorError
    logits_max_abs: float
    loss_jax: float
    loss_torch: float
    loss_reference: float
    grads: list[TensorError]  # worst first
    thresholds: dict[str, float]
    note: str
    seconds: float
    # QLoRA (`jaxpi.parity_qlora`): the base format and how jaxpi's quantized base compares with
    # bitsandbytes' (tensors whose codes / scales / offsets are identical); None for a dense base
    base_quant: str = "none"
    quant: dict[str, Any] | None = None

    @property
    def logits_rel(self) -> float:
        return self.logits.ours

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss_jax - self.loss_reference) / abs(self.loss_reference)

    @property
    def failing_grads(self) -> list[TensorError]:
        return [e for e in self.grads if not e.passed]

    @property
    def passed(self) -> bool:
        return self.logits.passed and not self.failing_grads

    def to_json(self) -> dict[str, Any]:
        return {
            "hf_dir": self.hf_dir,
            "dtype": self.dtype,
            "reference": self.reference,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "segments": self.segments,
            "inject": self.inject,
            "logits_rel": self.logits.ours,
            "logits_torch_rel": self.logits.torch,
            "logits_max_abs": self.logits_max_abs,
            "loss_jax": self.loss_jax,
            "loss_torch": self.loss_torch,
            "loss_reference": self.loss_reference,
            "loss_rel_diff": self.loss_rel_diff,
            "grads": [e.to_json() for e in self.grads],
            "failing": [e.name for e in self.failing_grads],
            "passed": self.passed,
            "thresholds": self.thresholds,
            "note": self.note,
            "seconds": self.seconds,
            "base_quant": self.base_quant,
            "quant": self.quant,
        }

    def table(self, top: int = 15) -> str:
        fp64 = self.reference == "fp64"
        head = (
            f"parity  {self.hf_dir}  dtype={self.dtype}  reference={self.reference}  batch={self.batch}"
            f"  seq_len={self.seq_len}"
            + (f"  segments={self.segments}" if self.segments > 1 else "")
            + (f"  inject={self.inject}" if self.inject else "")
            + (f"  base={self.base_quant} (LoRA gradients)" if self.base_quant != "none" else "")
        )
        lines = [head] + ([f"  note: {self.note}"] if self.note else [])
        if self.quant:
            q = self.quant
            lines.append(
                f"  {self.base_quant} base: {q['tensors']} tensors; identical to bitsandbytes': codes "
                f"{q['codes']}, scales {q['scales']}"
                + (f", offsets {q['offsets']}" if "offsets" in q else "")
                + (f" (the others within {q['offset_ulps']} ulp)" if q.get("offset_ulps") else "")
            )
        t = self.thresholds
        if fp64:
            lines.append(
                f"  against transformers in float64: ours/torch ≤ {t['ratio']:g}, or ours ≤ {t['rel_floor']:.0e},"
                f" or |Δ| ≤ {t['abs_floor']:.0e} of the whole gradient"
            )
        lg = self.logits
        lines.append(
            f"  logits   max|Δ| {self.logits_max_abs:.3e}   ours {lg.ours:.3e}"
            + (f"   torch {lg.torch:.3e}" if lg.torch is not None else f"   (≤ {t['logits_rel']:.0e})")
        )
        lines.append(
            f"  loss     jax {self.loss_jax:.7f}   torch {self.loss_torch:.7f}"
            + (f"   float64 {self.loss_reference:.7f}" if fp64 else "")
        )
        lines.append(
            f"  gradients: {len(self.grads)} parameters, {len(self.failing_grads)} failing (worst first)"
        )
        if fp64:
            lines.append("           ours       torch      ratio   share")
        for e in self.grads[:top]:
            flag = "ok  " if e.passed else "FAIL"
            if fp64:
                ratio = e.ratio if e.ratio is not None else math.nan
                lines.append(f"    {flag} {e.ours:.3e}  {e.torch:.3e}  {ratio:7.2f}  {e.share:.1e}  {e.name}")
            else:
                lines.append(f"    {flag} {e.ours:.3e}  {e.name}")
        if len(self.grads) > top:
            lines.append(f"    ... {len(self.grads) - top} more")
        lines.append(f"  {'PASS' if self.passed else 'FAIL'} in {self.seconds:.1f}s")
        return "\n".join(lines)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / denom) if denom > 0 else float(np.linalg.norm(a - b))


def judge_all(
    dtype: str,
    ours: dict[str, np.ndarray],
    logits_j: np.ndarray,
    torch_run: tuple[np.ndarray, float, dict[str, np.ndarray]],
    arbiter: tuple[np.ndarray, float, dict[str, np.ndarray]] | None,
) -> dict[str, Any]:
    """The report's judged fields (`logits`, `logits_max_abs`, `loss_reference`, `grads`, worst
    first, `thresholds`) from jaxpi's gradients `ours` and logits, torch's run at `dtype`
    (logits, loss, grads by HF name) and, for the fp64 reference, the float64 run that arbitrates;
    without it each of ours is judged against torch's at `dtype` by `FP32_BARS`."""
    logits_t, loss_t, grads_t = torch_run
    if arbiter is not None:
        logits_r, loss_r, grads_r = arbiter
        bars = FP64_BARS[dtype]
        whole = math.sqrt(sum(float(np.sum(np.square(grads_r[n]))) for n in ours))
        errors = [judge(n, g, grads_r[n], grads_t[n], whole, bars) for n, g in ours.items()]
        e_ours, e_torch = _rel(logits_j, logits_r), _rel(logits_t, logits_r)
        ok = e_ours <= bars.ratio * e_torch or e_ours <= bars.rel_floor
        logits = TensorError("logits", e_ours, e_torch, None, bool(ok and np.isfinite(e_ours)), "")
        thresholds = dataclasses.asdict(bars)
        errors.sort(key=lambda e: (e.passed, -(e.ratio or 0.0)))
    else:
        logits_r, loss_r, bar = logits_t, loss_t, FP32_BARS[dtype]
        errors = []
        for n, g in ours.items():
            e = _rel(g, grads_t[n])
            errors.append(TensorError(n, e, None, None, bool(e <= bar["grad_rel"]), ""))
        e = _rel(logits_j, logits_t)
        logits = TensorError("logits", e, None, None, bool(e <= bar["logits_rel"]), "")
        thresholds = dict(bar)
        errors.sort(key=lambda e: (e.passed, -e.ours))
    return {
        "logits": logits,
        "logits_max_abs": float(np.abs(logits_j - logits_r).max()),
        "loss_reference": loss_r,
        "grads": errors,
        "thresholds": thresholds,
    }


def judge(
    name: str, ours: np.ndarray, ref: np.ndarray, torch: np.ndarray, whole: float, bars: Bars
) -> TensorError:
    """The verdict on one tensor against the float64 reference (see the module docstring)."""
    diff = float(np.linalg.norm(np.asarray(ours, np.float64) - ref))
    ref_norm = float(np.linalg.norm(ref))
    e_ours, e_torch = _rel(ours, ref), _rel(torch, ref)
    share = diff / whole if whole > 0 else diff
    negligible = ref_norm <= bars.abs_floor * whole
    if not np.all(np.isfinite(ours)):
        return TensorError(name, e_ours, e_torch, share, False, "not finite")
    if not np.any(ours) and not negligible:
        return TensorError(name, e_ours, e_torch, share, False, "zero gradient")
    if e_ours <= bars.rel_floor:
        return TensorError(name, e_ours, e_torch, share, True, "below the floor")
    if share <= bars.abs_floor:
        return TensorError(name, e_ours, e_torch, share, True, "negligible")
    if e_ours <= bars.ratio * e_torch:
        return TensorError(name, e_ours, e_torch, share, True, "as close as torch")
    return TensorError(name, e_ours, e_torch, share, False, f"{e_ours / max(e_torch, 1e-300):.3g}× torch's")


def random_segments(rng: np.random.Generator, batch: int, seq_len: int, segments: int) -> np.ndarray | None:
    """[B, T] segment ids: each row cut at `segments − 1` random distinct places (None for 1)."""
    if segments <= 1:
        return None
    if segments >= seq_len:
        raise ValueError(f"segments ({segments}) must be below seq_len ({seq_len}): one needs two tokens")
    ids = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), segments - 1, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(seq_len), side="right")
    return ids


def jax_reference(
    model: Any, ids: np.ndarray, segment_ids: np.ndarray | None = None, *, trainable: Any = nnx.Param
) -> tuple[np.ndarray, float, dict[tuple, np.ndarray]]:
    """Logits, loss and gradients (by our parameter path, as float64 numpy) from jaxpi. With
    segment_ids the loss is the mean over the next-token pairs inside each segment. `trainable`
    picks the variables differentiated (a QLoRA comparison passes the adapters' type)."""
    graphdef, state = nnx.split(model)
    params, rest = nnx.split_state(state, trainable, ...)
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)

    @jax.jit
    def run(params, rest, ids, seg):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest)(ids, segment_ids=seg)
            logp = jax.nn.log_softmax(upcast(logits[:, :-1]), axis=-1)
            nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
            if seg is None:
                return jnp.mean(nll), logits
            inside = (seg[:, 1:] == seg[:, :-1]).astype(nll.dtype)
            return jnp.sum(nll * inside) / jnp.sum(inside), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, logits, grads

    loss, logits, grads = run(params, rest, jnp.asarray(ids, jnp.int32), seg)
    flat = {tuple(p): np.asarray(v.get_value(), np.float64) for p, v in nnx.to_flat_state(grads)}
    return np.asarray(logits, np.float64), float(loss), flat


def torch_reference(
    hf_dir: Path, ids: np.ndarray, dtype: str
) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """Logits, loss and per-parameter gradients from `transformers` (kept for callers of the
    earlier harness; see `jaxpi.torch_reference.reference_grads`)."""
    from jaxpi.torch_reference import reference_grads

    return reference_grads(hf_dir, ids, dtype)


def float64_bytes(hf_dir: Path, batch: int, seq_len: int) -> int:
    """A generous estimate of the float64 reference's peak memory: weights, gradients and
    autograd's saved activations (~60 hidden-sized and 4 logit-sized float64 vectors per token
    and layer, and the DeltaNet's chunked intermediates)."""
    from jaxpi.config import QwenConfig

    cfg = QwenConfig.from_hf(hf_dir)
    params = sum(int(np.prod(i.shape)) for i in read_index(hf_dir).values())
    tokens = batch * seq_len
    per_token = cfg.num_hidden_layers * (
        60 * cfg.hidden_size + 8 * cfg.intermediate_size + 6 * cfg.linear_value_dim + 64 * 64
    )
    return 8 * (3 * params + tokens * (per_token + 4 * cfg.vocab_size))


def choose_reference(reference: str, hf_dir: Path, batch: int, seq_len: int) -> tuple[str, str]:
    """("fp64" | "fp32", a note for the report): "auto" takes fp64 where it fits in ~70% of the
    available memory."""
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, not {reference!r}")
    if reference != "auto":
        return reference, ""
    need, have = float64_bytes(hf_dir, batch, seq_len), available_memory()
    if have is None or need <= 0.7 * have:
        return "fp64", ""
    return "fp32", (
        f"the float64 reference needs ~{need / 2**30:.1f} GiB and {have / 2**30:.1f} GiB are available: "
        "compared with torch's own run instead (--reference fp64 to force it)"
    )


def run_parity(
    hf_dir: str | Path,
    *,
    seq_len: int = 64,
    batch: int = 2,
    dtype: str = "float32",
    seed: int = 0,
    inject: str | None = None,
    reference: str = "auto",
    segments: int = 1,
) -> ParityReport:
    """Run both frameworks on `batch` random sequences of `seq_len` tokens and compare.

    segments > 1 packs each row with that many sequences of random lengths: jaxpi runs the
    packed rows (segment ids), transformers each sequence on its own.
    """
    from jaxpi.torch_reference import reference_grads

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if seq_len < 2 or batch < 1:
        raise ValueError(
            f"seq_len ({seq_len}) must be >= 2 and batch ({batch}) >= 1: the loss predicts next tokens"
        )
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    reference, note = choose_reference(reference, hf_dir, batch, seq_len)
    cfg, model = load_hf(hf_dir, dtype=dtype)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq_len))
    segment_ids = random_segments(rng, batch, seq_len, segments)
    # fp32 parity means fp32 matmuls: accelerators would otherwise use bf16/TF32 passes.
    precision = "highest" if dtype == "float32" else "default"
    with inject_bug(inject), jax.default_matmul_precision(precision):
        logits_j, loss_j, grads_j = jax_reference(model, ids, segment_ids)
    del model
    logits_t, loss_t, grads_t = reference_grads(hf_dir, ids, dtype, segment_ids)
    ours: dict[str, np.ndarray] = {}
    for rule in text_rules(cfg, text_prefix(read_index(hf_dir))):
        g = stack_index(cfg, rule)
        parts = [grads_j[tuple(p)][g] if g is not None else grads_j[tuple(p)] for p in rule.ours]
        if rule.hf not in grads_t:
            raise KeyError(f"transformers has no gradient for {rule.hf!r}")
        ours[rule.hf] = rule.to_hf(parts)

    arbiter = reference_grads(hf_dir, ids, "float64", segment_ids) if reference == "fp64" else None
    judged = judge_all(dtype, ours, logits_j, (logits_t, loss_t, grads_t), arbiter)
    return ParityReport(
        hf_dir=str(hf_dir),
        dtype=dtype,
        reference=reference,
        batch=batch,
        seq_len=seq_len,
        segments=max(segments, 1),
        inject=inject,
        loss_jax=loss_j,
        loss_torch=loss_t,
        **judged,
        note=note,
        seconds=time.perf_counter() - start,
    )

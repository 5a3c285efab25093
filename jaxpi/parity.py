"""Parity harness: jaxpi against `transformers`' Qwen3.5 on the same weights and tokens.

Compares logits, the next-token loss and, for every parameter, the gradient, as the relative L2
error ‖g_jax − g_torch‖ / ‖g_torch‖ in HF's own layout (our gradients are mapped back through the
weight table). A kernel that keeps the loss but changes gradients fails here and is named.
"""

from __future__ import annotations

import dataclasses
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
from jaxpi.kernels.norms import inject_bug

# fp32: logits and every gradient must agree to float32 noise. bf16: about twice the worst error
# measured between jax-bf16 and torch-bf16 on random tiny checkpoints (docs/parity.md), which is
# as far as torch-bf16 itself is from torch-fp32; only gross errors show at bf16, so subtle
# backward bugs are the fp32 run's job.
THRESHOLDS = {
    "float32": {"logits_rel": 1e-4, "grad_rel": 1e-3},
    "bfloat16": {"logits_rel": 1e-1, "grad_rel": 1.0},
}


@dataclasses.dataclass
class ParityReport:
    hf_dir: str
    dtype: str
    batch: int
    seq_len: int
    inject: str | None
    logits_max_abs: float
    logits_rel: float
    loss_jax: float
    loss_torch: float
    loss_rel_diff: float
    grads: list[tuple[str, float]]  # (HF name, relative L2 error), worst first
    thresholds: dict[str, float]
    seconds: float

    @property
    def failing_grads(self) -> list[tuple[str, float]]:
        return [(n, e) for n, e in self.grads if not e <= self.thresholds["grad_rel"]]

    @property
    def passed(self) -> bool:
        return self.logits_rel <= self.thresholds["logits_rel"] and not self.failing_grads

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["grads"] = [{"name": n, "rel_err": e} for n, e in self.grads]
        out["failing"] = [n for n, _ in self.failing_grads]
        out["passed"] = self.passed
        return out

    def table(self, top: int = 15) -> str:
        t = self.thresholds
        lines = [
            f"parity  {self.hf_dir}  dtype={self.dtype}  batch={self.batch}  seq_len={self.seq_len}"
            + (f"  inject={self.inject}" if self.inject else ""),
            f"  logits   max|Δ| {self.logits_max_abs:.3e}   rel {self.logits_rel:.3e}   (≤ {t['logits_rel']:.0e})",
            f"  loss     jax {self.loss_jax:.7f}   torch {self.loss_torch:.7f}   rel Δ {self.loss_rel_diff:.3e}",
            f"  gradients: {len(self.grads)} parameters, {len(self.failing_grads)} above {t['grad_rel']:.0e}"
            f" (relative L2, worst first)",
        ]
        for name, err in self.grads[:top]:
            flag = "FAIL" if not err <= t["grad_rel"] else "ok  "
            lines.append(f"    {flag} {err:.3e}  {name}")
        if len(self.grads) > top:
            lines.append(f"    ... {len(self.grads) - top} more")
        lines.append(f"  {'PASS' if self.passed else 'FAIL'} in {self.seconds:.1f}s")
        return "\n".join(lines)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / denom) if denom > 0 else float(np.linalg.norm(a - b))


def torch_reference(
    hf_dir: Path, ids: np.ndarray, dtype: str
) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """Logits, loss and per-parameter gradients from `transformers` (eager attention, CPU)."""
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    # The fallback-kernel notices and load bars would drown the report.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    kind = AutoConfig.from_pretrained(hf_dir).model_type
    cls = Qwen3_5ForConditionalGeneration if kind == "qwen3_5" else Qwen3_5ForCausalLM
    model = cls.from_pretrained(hf_dir, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    x = torch.tensor(ids, dtype=torch.long)
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.float().numpy() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float().numpy(), loss.item(), grads


def jax_reference(model: Any, ids: np.ndarray) -> tuple[np.ndarray, float, dict[tuple, np.ndarray]]:
    """Logits, loss and gradients (by our parameter path) from jaxpi."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def run(params, ids):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(ids)
            logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)
            return jnp.mean(nll), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, logits, grads

    loss, logits, grads = run(params, jnp.asarray(ids, jnp.int32))
    flat = {tuple(p): np.asarray(v.get_value(), np.float32) for p, v in nnx.to_flat_state(grads)}
    return np.asarray(logits, np.float32), float(loss), flat


def run_parity(
    hf_dir: str | Path,
    *,
    seq_len: int = 64,
    batch: int = 2,
    dtype: str = "float32",
    seed: int = 0,
    inject: str | None = None,
) -> ParityReport:
    """Run both frameworks on `batch` random sequences of `seq_len` tokens and compare."""
    if dtype not in THRESHOLDS:
        raise ValueError(f"dtype must be one of {sorted(THRESHOLDS)}, not {dtype!r}")
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    cfg, model = load_hf(hf_dir, dtype=dtype)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len))
    # fp32 parity means fp32 matmuls: accelerators would otherwise use bf16/TF32 passes.
    precision = "highest" if dtype == "float32" else "default"
    with inject_bug(inject), jax.default_matmul_precision(precision):
        logits_j, loss_j, grads_j = jax_reference(model, ids)
    logits_t, loss_t, grads_t = torch_reference(hf_dir, ids, dtype)

    errors = []
    for rule in text_rules(cfg, text_prefix(read_index(hf_dir))):
        g = stack_index(cfg, rule)
        parts = [grads_j[tuple(p)][g] if g is not None else grads_j[tuple(p)] for p in rule.ours]
        ours = rule.to_hf(parts)
        if rule.hf not in grads_t:
            raise KeyError(f"transformers has no gradient for {rule.hf!r}")
        errors.append((rule.hf, _rel(ours, grads_t[rule.hf])))
    errors.sort(key=lambda e: -e[1] if np.isfinite(e[1]) else -np.inf)
    return ParityReport(
        hf_dir=str(hf_dir),
        dtype=dtype,
        batch=batch,
        seq_len=seq_len,
        inject=inject,
        logits_max_abs=float(np.abs(logits_j - logits_t).max()),
        logits_rel=_rel(logits_j, logits_t),
        loss_jax=loss_j,
        loss_torch=loss_t,
        loss_rel_diff=abs(loss_j - loss_t) / abs(loss_t),
        grads=errors,
        thresholds=THRESHOLDS[dtype],
        seconds=time.perf_counter() - start,
    )

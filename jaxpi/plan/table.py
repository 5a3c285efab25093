"""`jaxpi plan`'s table: one column per plan, memory per device and collectives per step."""

from __future__ import annotations

from jaxpi.plan.request import PlanResult
from sharding.hlo import KINDS

GiB = 1024**3


def _gib(x: int | None) -> str:
    """Bytes for a table cell: GiB with two decimals, or MiB/KiB when that would read 0.00."""
    if x is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if x >= 0.01 * scale or unit == "KiB":
            return f"{x / scale:.2f} {unit}"
    return f"{x} B"


def format_table(results: list[PlanResult]) -> str:
    """One column per plan: memory per device (compiled vs analytic) and collectives per step."""
    head = ["", *[f"{r.request.strategy} [{r.request.mesh}]" for r in results]]
    rows: list[list[str]] = []

    def row(name: str, values: list[str]) -> None:
        rows.append([name, *values])

    row("devices / global batch", [f"{r.devices} / {r.global_batch}" for r in results])
    row("params /dev", [_gib(r.analytic["params"]) for r in results])
    row("trainable /dev", [_gib(r.analytic["trainable"]) for r in results])
    row("optimizer /dev", [_gib(r.analytic["optimizer"]) for r in results])
    row(
        "arguments /dev (compiled | analytic)",
        [f"{_gib((r.compiled or {}).get('argument'))} | {_gib(r.analytic['argument'])}" for r in results],
    )
    row(
        "temp /dev (compiled | analytic)",
        [f"{_gib((r.compiled or {}).get('temp'))} | {_gib(r.analytic['temp'])}" for r in results],
    )
    row(
        "peak /dev",
        [f"{_gib(r.peak_bytes)} ({'compiled' if r.compiled else 'analytic'})" for r in results],
    )
    row("fits device memory", ["-" if r.fits is None else ("yes" if r.fits else "NO") for r in results])
    for k in KINDS:
        row(
            f"{k} n, bytes/dev (compiled | analytic)",
            [
                (f"{r.collectives[k]['count']}, {_gib(r.collectives[k]['bytes'])}" if r.collectives else "-")
                + f" | {r.collectives_analytic[k]['count']}, {_gib(r.collectives_analytic[k]['bytes'])}"
                for r in results
            ],
        )
    row("compile s", [f"{r.compile_seconds:.0f}" if r.compiled else "- (--no-compile)" for r in results])
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    r0 = results[0].request
    lines.insert(
        0,
        f"{r0.model}  seq {r0.seq_len}  batch/device {r0.batch_per_device}  dtype {r0.dtype}  remat {r0.remat}"
        + (f"  loss_chunk {r0.loss_chunk}" if r0.loss_chunk else "")
        + (f"  attn_impl {r0.attn_impl}" if r0.attn_impl != "jax" else "")
        + (f"  gdn_impl {r0.gdn_impl}" if r0.gdn_impl != "jax" else "")
        + (f"  LoRA rank {r0.lora_rank}" if r0.lora_rank else "  full fine-tuning")
        + (f"  base {r0.base_quant}" if r0.base_quant != "none" else ""),
    )
    notes = sorted({f for r in results for f in r.fallbacks})
    if notes:
        lines.append(
            "not divisible, kept replicated: " + "; ".join(notes[:6]) + (" ..." if len(notes) > 6 else "")
        )
    return "\n".join(lines)

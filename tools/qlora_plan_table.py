"""docs/sharding.md's QLoRA table ("what fits where"): the 27B QLoRA step planned by `jaxpi plan` on
one GPU and on small TPU slices, per remat policy and sequence length.

    python tools/qlora_plan_table.py --out /tmp/qlora_plan.json [--no-compile] [--only gpu|tpu]

Each cell is one `jaxpi plan --json` process (the planner needs its own XLA device count): LoRA
rank 64 on all linear layers, nf4 base, bf16 compute, loss_chunk 1024, one sequence per device.
Results are appended to --out as they come (a rerun skips the cells already there), then printed
as Markdown: compiled peak where the step compiled, analytic otherwise (marked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GiB = 1024**3
GPUS = (24, 48, 80, 141)  # GiB per device: RTX 4090 / L40S-A6000 / A100-H100 80 GB / H200
GPU_GRID = [(seq, remat) for seq in (2048, 4096, 8192, 16384) for remat in ("full", "mlp", "mlp_out")]
# (name, mesh, GiB per chip): v5p-8 is 4 chips of 95 GiB; v6e-4 / v6e-8 are 4 / 8 chips of 32 GiB
TPUS = [("v5p-8", "fsdp=4", 95), ("v6e-4", "fsdp=4", 32), ("v6e-8", "fsdp=8", 32)]
TPU_GRID = [(seq, remat) for seq in (8192, 16384) for remat in ("full", "mlp")]
COMMON = ["--model", "qwen3_5_27b", "--lora-rank", "64", "--base-quant", "nf4", "--loss-chunk", "1024"]


def plan(mesh: str, seq: int, remat: str, compile_: bool) -> dict:
    cmd = [sys.executable, "-m", "jaxpi.cli", "plan", *COMMON, "--mesh", mesh, "--seq-len", str(seq)]
    cmd += ["--remat", remat, "--json"] + ([] if compile_ else ["--no-compile"])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1: does not fit the (absent) device memory: never here
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout)
    out["wall_seconds"] = time.perf_counter() - start
    return out


def cell(r: dict) -> str:
    return f"{r['peak_bytes'] / GiB:.1f}" + ("" if r["compiled"] else "*")


def table(results: dict[str, dict]) -> str:
    lines = [
        "| seq | remat | arguments | temp compiled / analytic | peak | "
        + " | ".join(f"{g} GiB" for g in GPUS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(GPUS),
    ]
    for seq, remat in GPU_GRID:
        r = results.get(f"gpu/{seq}/{remat}")
        if r is None:
            continue
        comp = r["compiled"] or {}
        temp = f"{comp['temp'] / GiB:.2f} / " if comp else "– / "
        fits = ["yes" if r["peak_bytes"] <= g * GiB else "no" for g in GPUS]
        args = (comp or r["analytic"])["argument"]
        lines.append(
            f"| {seq} | {remat} | {args / GiB:.2f} GiB | {temp}{r['analytic']['temp'] / GiB:.2f} GiB | "
            f"{cell(r)} GiB | " + " | ".join(fits) + " |"
        )
    lines += [
        "",
        "| slice (chips × GiB) | seq | remat | params /chip | temp compiled / analytic | peak /chip | fits |",
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for name, _, gib in TPUS:
        for seq, remat in TPU_GRID:
            r = results.get(f"{name}/{seq}/{remat}")
            if r is None:
                continue
            comp = r["compiled"] or {}
            temp = f"{comp['temp'] / GiB:.2f} / " if comp else "– / "
            lines.append(
                f"| {name} ({r['devices']} × {gib}) | {seq} | {remat} | {r['analytic']['params'] / GiB:.2f} GiB | "
                f"{temp}{r['analytic']['temp'] / GiB:.2f} GiB | {cell(r)} GiB | "
                f"{'yes' if r['peak_bytes'] <= gib * GiB else 'no'} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-compile", action="store_true", help="analytic figures only (seconds per cell)")
    ap.add_argument("--only", choices=["gpu", "tpu"], default=None)
    args = ap.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    cells = [] if args.only == "tpu" else [(f"gpu/{s}/{r}", "fsdp=1", s, r) for s, r in GPU_GRID]
    if args.only != "gpu":
        cells += [(f"{n}/{s}/{r}", mesh, s, r) for n, mesh, _ in TPUS for s, r in TPU_GRID]
    for key, mesh, seq, remat in cells:
        if key in results and (results[key]["compiled"] or args.no_compile):
            continue
        results[key] = plan(mesh, seq, remat, not args.no_compile)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"{key}: peak {cell(results[key])} GiB ({results[key]['wall_seconds']:.0f} s)", file=sys.stderr)
    print(table(results))


if __name__ == "__main__":
    main()

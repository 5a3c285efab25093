"""Measure the host-memory peaks of `load_hf` and `save_hf` on a ~2 GB random fp32 checkpoint.

    python tools/measure_load_memory.py                 # writes, measures, deletes /tmp/jaxpi-memcheck
    python tools/measure_load_memory.py --dir D --keep  # reuse / keep the checkpoint in D

The checkpoint is written directly with our streaming safetensors writer (no transformers, no
torch, one tensor in memory at a time). Each measurement then runs in a fresh subprocess (CPU JAX):

- load: RSS after imports and JAX backend start-up (the baseline), `load_hf`, then the peak RSS
  (`getrusage(RUSAGE_SELF).ru_maxrss`). On CPU the loaded model itself lives in host memory, so
  the loader's own overhead is peak − baseline − model bytes; the claim under test is that this
  is about one tensor (the largest parameter / HF tensor), not the model.
- save: `load_hf`, then free heap is handed back (`malloc_trim`) and the peak-RSS counter reset
  (`/proc/self/clear_refs`), then `save_hf` (with `source`, one shard per ≤ 5 GiB):
  overhead = peak − RSS before the save.

Prints one JSON object per measurement and a summary table (MiB = 2**20 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20

# ≈ 2.0 GB of fp32: embed and lm_head 65536×1024 (256 MiB each, the largest tensors), 16 hybrid
# layers (4 scanned groups of 3 DeltaNet + 1 attention layer, MLP 1024→5632).
MEASURE_CFG = dict(
    vocab_size=65_536,
    hidden_size=1_024,
    intermediate_size=5_632,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    tie_word_embeddings=False,
)


def _rss_kib() -> int:
    """Current resident set (VmRSS), KiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _malloc_trim() -> None:
    """Return free heap pages to the OS (glibc); a no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    """Reset the peak-RSS counter (Linux ≥ 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def write_checkpoint(out: Path) -> None:
    """The random fp32 checkpoint, one tensor generated at a time."""
    import numpy as np

    from jaxpi.config import QwenConfig
    from jaxpi.convert.safetensors_io import PlannedTensor, write_file
    from jaxpi.convert.table import text_rules

    cfg = QwenConfig(**MEASURE_CFG)
    rng = np.random.default_rng(0)

    def produce(shape: tuple[int, ...]) -> bytes:
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= 0.02
        return a.tobytes()

    rules = text_rules(cfg, "model.")
    planned = [PlannedTensor(r.hf, "F32", r.hf_shape, lambda s=r.hf_shape: produce(s)) for r in rules]
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "model.safetensors.tmp", planned)
    os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**cfg.to_hf(), "dtype": "float32"}, indent=2) + "\n")


def _model_stats(model) -> dict:
    from flax import nnx

    flat = [(p, v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    path, big = max(flat, key=lambda pv: pv[1].nbytes)
    spath, sbig = max(((p, a) for p, a in flat if p[0] == "groups"), key=lambda pv: pv[1].nbytes)
    return {
        "model_bytes": sum(int(a.nbytes) for _, a in flat),
        "n_params": len(flat),
        "largest_param": "/".join(map(str, path)),
        "largest_param_shape": list(big.shape),
        "largest_param_bytes": int(big.nbytes),
        "largest_stacked_param": "/".join(map(str, spath)),
        "largest_stacked_param_shape": list(sbig.shape),
        "largest_stacked_param_bytes": int(sbig.nbytes),
    }


def child(mode: str, ckpt: Path, dtype: str, out: Path | None) -> dict:
    """Runs in a fresh interpreter: one measurement, returned as a dict."""
    rss_imports = _rss_kib()
    import jax
    import jax.numpy as jnp

    from jaxpi import load_hf, save_hf
    from jaxpi.convert.safetensors_io import read_index

    jnp.zeros(8).block_until_ready()  # start the CPU backend before the baseline
    rss_imported = _rss_kib()
    index = read_index(ckpt)
    big = max(index.values(), key=lambda i: i.end - i.begin)
    res: dict = {
        "mode": mode,
        "dtype": dtype,
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "checkpoint_bytes": sum(i.end - i.begin for i in index.values()),
        "largest_hf_tensor": big.name,
        "largest_hf_tensor_bytes": big.end - big.begin,
        "rss_python_start": rss_imports * 1024,
        "rss_after_imports": rss_imported * 1024,
    }
    t = time.perf_counter()
    _, model = load_hf(ckpt, dtype=dtype)
    jax.block_until_ready(jax.tree.leaves(model))
    res["load_seconds"] = round(time.perf_counter() - t, 1)
    res.update(_model_stats(model))
    res["rss_after_load"] = _rss_kib() * 1024
    if mode == "load":
        res["peak_rss"] = _peak_kib() * 1024
        res["overhead"] = res["peak_rss"] - res["rss_after_imports"] - res["model_bytes"]
        # ... of which still resident after the load (jax/flax bookkeeping, allocator slack):
        res["retained"] = res["rss_after_load"] - res["rss_after_imports"] - res["model_bytes"]
        return res
    _malloc_trim()  # give freed heap back, so that the save cannot hide in the load's leftovers
    if not _reset_peak():
        raise RuntimeError("cannot reset the peak-RSS counter (/proc/self/clear_refs)")
    before = _rss_kib() * 1024
    t = time.perf_counter()
    save_hf(model, out, source=ckpt, overwrite=True)
    res["save_seconds"] = round(time.perf_counter() - t, 1)
    res["rss_before_save"] = before
    res["peak_rss"] = _peak_kib() * 1024
    res["overhead"] = res["peak_rss"] - before
    return res


def _run_child(mode: str, ckpt: Path, dtype: str, out: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--dir", str(ckpt), "--dtype", dtype]
    if out is not None:
        cmd += ["--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{mode} measurement failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/jaxpi-memcheck"), help="checkpoint directory")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the export")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", choices=["load", "save"], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.dtype, args.out)))
        return

    ckpt, export = args.dir / "ckpt", args.dir / "export"
    made = False
    try:
        if not (ckpt / "model.safetensors").exists():
            t = time.perf_counter()
            write_checkpoint(ckpt)
            made = True
            print(f"wrote {ckpt} in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        results = [
            _run_child("load", ckpt, "float32", None),
            _run_child("load", ckpt, "bfloat16", None),
            _run_child("save", ckpt, "float32", export),
        ]
    finally:
        if not args.keep:
            shutil.rmtree(export, ignore_errors=True)
            if made:
                shutil.rmtree(ckpt, ignore_errors=True)
                if args.dir.exists() and not any(args.dir.iterdir()):
                    args.dir.rmdir()
    for r in results:
        print(json.dumps(r))
    print(
        f"\n{'measurement':<16}{'baseline':>10}{'model':>10}{'peak':>10}{'overhead':>10}"
        f"{'largest param':>15}{'largest HF':>12}  (MiB)"
    )
    for r in results:
        base = r["rss_after_imports"] if r["mode"] == "load" else r["rss_before_save"]
        cols = [base, r["model_bytes"], r["peak_rss"], r["overhead"]]
        print(
            f"{r['mode'] + ' ' + r['dtype']:<16}"
            + "".join(f"{c / MIB:>10.0f}" for c in cols)
            + f"{r['largest_param_bytes'] / MIB:>15.0f}{r['largest_hf_tensor_bytes'] / MIB:>12.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

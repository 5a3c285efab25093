"""A/B of the decode engine between two source trees, in one process, calls alternating.

    git worktree add /tmp/old COMMIT   # or: git archive COMMIT | tar -x -C /tmp/old
    python tools/ab_decode.py /tmp/old . --preset mid --dtype bfloat16 --batches 1,16 --repeats 4

Each tree's `jaxpi` is imported in turn (the first one's modules dropped from `sys.modules` before
the second is imported; engines keep references to their own), its engine built on its own bench
model (the same seeded weights), and the timed `generate` calls alternate A, B, B, A, ... with a
copy-bandwidth probe before each pair, so both see about the same load of a shared machine. One
JSON line per batch: tokens/s of each, the per-pair ratios B/A and their median, whether the two
trees' greedy tokens agree row by row, and the load average.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

MODULES = ("jaxpi.bench.config", "jaxpi.bench.decode", "jaxpi.rollout.engine", "jaxpi.rollout.jax_engine")


def load(root: str, tag: str) -> dict:
    """The modules of the `jaxpi` under `root`."""
    for name in [m for m in sys.modules if m == "jaxpi" or m.startswith("jaxpi.")]:
        del sys.modules[name]
    sys.path.insert(0, root)
    try:
        mods = {n: importlib.import_module(n) for n in MODULES}
    finally:
        sys.path.remove(root)
    rows = sys.modules.get("jaxpi.kernels.cpu.rows")
    if rows is not None:  # one FFI target name per tree: a name registers one library only
        rows.TARGET = f"{rows.TARGET}_{tag}"
    return mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="source tree A (holds jaxpi/)")
    ap.add_argument("b", help="source tree B")
    ap.add_argument("--preset", default="mid")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=0, help="engine cache length (0: just enough)")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    import jax
    import numpy as np

    trees = {}
    for tag, root in (("A", args.a), ("B", args.b)):
        mods = load(os.path.abspath(root), tag)
        bench = mods["jaxpi.bench.config"].make_config(args.preset, dtype=args.dtype)
        trees[tag] = (mods, mods["jaxpi.bench.decode"].random_model(bench))
    from jaxpi.bench.bandwidth import bandwidth_probe  # the tree imported last

    probe = bandwidth_probe()
    max_len = args.max_len or args.prompt_len + args.new_tokens + 1
    for b in (int(x) for x in args.batches.split(",")):
        prompts = np.random.default_rng(b).integers(0, 1 << 15, (b, args.prompt_len))
        engines, outs = {}, {}
        for tag, (mods, model) in trees.items():
            params = mods["jaxpi.rollout.engine"].SamplingParams(
                temperature=0.0, max_new_tokens=args.new_tokens
            )
            engine = mods["jaxpi.rollout.jax_engine"].JaxEngine(model, max_len=max_len, batch_size=b)
            rows = (prompts % model.cfg.vocab_size).tolist()
            outs[tag] = engine.generate(rows, params)  # compiles
            engines[tag] = (engine, params, rows)
        times: dict[str, list[float]] = {"A": [], "B": []}
        bandwidth = []
        for r in range(args.repeats):
            bandwidth.append(probe())
            for tag in ("A", "B") if r % 2 == 0 else ("B", "A"):
                engine, params, rows = engines[tag]
                t0 = time.perf_counter()
                engine.generate(rows, params)
                times[tag].append(time.perf_counter() - t0)
        same = [x.token_ids == y.token_ids for x, y in zip(outs["A"], outs["B"], strict=True)]
        pairs = [a / c for a, c in zip(times["A"], times["B"], strict=True)]
        print(
            json.dumps(
                {
                    "batch": b,
                    "tokens_per_s": {
                        t: statistics.median(b * args.new_tokens / x for x in v) for t, v in times.items()
                    },
                    "b_over_a_pairs": pairs,
                    "b_over_a_median": statistics.median(pairs),
                    "copy_bandwidth_gb_s": statistics.median(bandwidth) / 1e9,
                    "greedy_rows_identical": f"{sum(same)}/{len(same)}",
                    "load_average": os.getloadavg(),
                }
            ),
            flush=True,
        )
        del engines
        jax.clear_caches()


if __name__ == "__main__":
    main()

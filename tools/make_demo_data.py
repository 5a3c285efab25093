"""Regenerate the committed demo data: `python tools/make_demo_data.py [--out ASSETS_DIR]`.

Writes ASSETS_DIR/demo/ (Pi session files, an OpenAI-style file, manifest.json) and
ASSETS_DIR/tiny_tokenizer/ (byte-level BPE, 512 ids, our Qwen3.5-style chat template).
The logic lives in `jaxpi.testing.demo_data` and `jaxpi.data.tiny_tokenizer`; the output is deterministic (seed 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpi.testing.demo_data import ASSETS, write_demo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ASSETS, help=f"assets directory (default {ASSETS})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for name, path in write_demo(args.out, seed=args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()

"""docs/parity.md's measured table: jaxpi-fp32 and torch-fp32 gradient errors per tensor family,
against transformers in float64 as it loads (its float32 upcasts kept: the old arbiter) and in
true float64 (`jaxpi.torch_reference`), at several lengths, with ordinary and strong decays.

    python tools/parity_table.py --lengths 77 1024 4096 --out /tmp/parity_table.json

The checkpoint: 6 layers (L L F L L F), 2 key / 6 value DeltaNet heads, key dim 16 ≠ value dim
24, GQA 3:1, pad_token_id 0, transformers' init with norms, A_log and dt_bias moved by 0.1·N(0,1)
("strong": A_log ~ U(1, 3), dt_bias ~ U(1, 4)). Token ids exclude the pad id (its row is judged
separately by the harness).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxpi.convert.hf import load_hf, text_prefix
from jaxpi.convert.safetensors_io import read_index
from jaxpi.convert.table import stack_index, text_rules
from jaxpi.hf_fixtures import make_hf_checkpoint
from jaxpi.parity import _rel, jax_reference
from jaxpi.torch_reference import reference_grads

TEXT = {
    "vocab_size": 256,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "pad_token_id": 0,
}
FAMILIES = [
    ("A_log", r"\.A_log$"),
    ("dt_bias", r"\.dt_bias$"),
    ("in_proj_a", r"in_proj_a\.weight$"),
    ("in_proj_b", r"in_proj_b\.weight$"),
    ("in_proj_qkv", r"in_proj_qkv\.weight$"),
    ("conv1d", r"conv1d\.weight$"),
    ("DeltaNet out (z, norm, out_proj)", r"linear_attn\.(in_proj_z|norm|out_proj)\.weight$"),
    ("attention", r"self_attn\."),
    ("MLP", r"\.mlp\."),
    ("block norms", r"(input_layernorm|post_attention_layernorm)\.weight$|^model\.norm\.weight$"),
    ("embed, lm_head", r"embed_tokens|lm_head"),
]


def measure(hf_dir: Path, seq_len: int) -> dict:
    cfg, model = load_hf(hf_dir, dtype="float32")
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, seq_len))
    t0 = time.perf_counter()
    with jax.default_matmul_precision("highest"):
        _, _, grads = jax_reference(model, ids)
    ours = {}
    for rule in text_rules(cfg, text_prefix(read_index(hf_dir))):
        g = stack_index(cfg, rule)
        ours[rule.hf] = rule.to_hf(
            [grads[tuple(p)][g] if g is not None else grads[tuple(p)] for p in rule.ours]
        )
    _, _, t32 = reference_grads(hf_dir, ids, "float32")
    _, _, t64 = reference_grads(hf_dir, ids, "float64")
    _, _, old = _plain_float64(hf_dir, ids)
    rows = {}
    for family, pattern in FAMILIES:
        names = [n for n in ours if re.search(pattern, n)]
        rows[family] = {
            "jax_vs_fp64": max(_rel(ours[n], t64[n]) for n in names),
            "torch_vs_fp64": max(_rel(t32[n], t64[n]) for n in names),
            "jax_vs_old": max(_rel(ours[n], old[n]) for n in names),
            "torch_vs_old": max(_rel(t32[n], old[n]) for n in names),
        }
    return {"seq_len": seq_len, "families": rows, "seconds": time.perf_counter() - t0}


def _plain_float64(hf_dir: Path, ids: np.ndarray):
    """transformers' model loaded with dtype=float64 and nothing changed (float32 inside)."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, attn_implementation="eager")
    x = torch.tensor(ids)
    logits = model(input_ids=x, use_cache=False).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
    return None, None, {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[77, 1024, 4096])
    ap.add_argument("--out", default="parity_table.json")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for strong in (False, True):
            hf_dir = make_hf_checkpoint(Path(tmp) / f"ck{int(strong)}", TEXT, strong_decay=strong, seed=0)
            for t in args.lengths:
                r = {"strong_decay": strong, **measure(hf_dir, t)}
                results.append(r)
                print(json.dumps(r), flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

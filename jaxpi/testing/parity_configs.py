"""Random Qwen3.5 checkpoints within `transformers`' constraints, for the fuzzed parity test.

`parity_cases()` is a hypothesis strategy of `ParityCase`s: a text config as `config.json` would
hold it (head counts and ratios, key ≠ value head dims, odd hidden sizes, conv kernels 2–6,
partial rotary factors, any layer pattern or none, tied or untied, a pad id or none), how the
weights are set (transformers' own init with norms and gates perturbed, or every weight random,
optionally with strong decays), and the input (length, packing, seed). `case.commands(dir)` is
what a user pastes to reproduce one.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from jaxpi.hf_fixtures import make_hf_checkpoint


@dataclasses.dataclass(frozen=True)
class ParityCase:
    text_config: dict[str, Any]
    kind: str  # "causal" | "conditional"
    tie: bool
    weights: str  # "init" (transformers' init, perturbed) | "random" (every weight random)
    strong_decay: bool
    seed: int
    seq_len: int
    segments: int

    def build(self, out: str | Path) -> Path:
        return make_hf_checkpoint(
            out,
            self.text_config,
            kind=self.kind,
            tie=self.tie,
            weights=self.weights,
            strong_decay=self.strong_decay,
            seed=self.seed,
        )

    def commands(self, out: str = "/tmp/parity-case") -> str:
        """The shell commands that rebuild this checkpoint and run the harness on it."""
        flags = f"--kind {self.kind} --weights {self.weights} --seed {self.seed}"
        flags += " --tied" * self.tie + " --strong-decay" * self.strong_decay
        cfg = shlex.quote(json.dumps(self.text_config, sort_keys=True))
        return (
            f"jaxpi tiny-checkpoint {out} --hf-config {cfg} {flags}\n"
            f"jaxpi parity --hf-dir {out} --seq-len {self.seq_len} --batch 2 --segments {self.segments}"
        )


@st.composite
def text_configs(draw: st.DrawFn) -> dict[str, Any]:
    kv = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([8, 12, 16, 24]))
    factor = draw(st.sampled_from([0.25, 0.5, 1.0]).filter(lambda f: int(head_dim * f) % 2 == 0))
    nk = draw(st.integers(1, 3))
    layers = draw(st.integers(1, 5))
    cfg: dict[str, Any] = {
        "vocab_size": draw(st.integers(32, 320)),
        "hidden_size": draw(st.integers(8, 64)),
        "intermediate_size": draw(st.integers(8, 96)),
        "num_hidden_layers": layers,
        "num_attention_heads": kv * draw(st.integers(1, 3)),
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nk * draw(st.integers(1, 3)),
        "linear_key_head_dim": draw(st.sampled_from([4, 8, 12, 16])),
        "linear_value_head_dim": draw(st.sampled_from([4, 8, 12, 24])),
        "linear_conv_kernel_dim": draw(st.integers(2, 6)),
        "rms_norm_eps": draw(st.sampled_from([1e-6, 1e-5])),
        "max_position_embeddings": 4096,
    }
    rope: dict[str, Any] = {"rope_type": "default", "partial_rotary_factor": factor}
    rope["rope_theta"] = draw(st.sampled_from([10_000.0, 1_000_000.0, 10_000_000.0]))
    if draw(st.booleans()):
        rope.update(mrope_interleaved=True, mrope_section=[2, 1, 1])
    cfg["rope_parameters"] = rope
    pattern = draw(st.sampled_from(["random", "linear", "full", "absent"]))
    if pattern == "random":
        cfg["layer_types"] = draw(
            st.lists(
                st.sampled_from(["linear_attention", "full_attention"]), min_size=layers, max_size=layers
            )
        )
    elif pattern in ("linear", "full"):
        cfg["layer_types"] = [f"{pattern}_attention"] * layers
    elif draw(st.booleans()):
        cfg["full_attention_interval"] = draw(st.integers(1, 3))
    pad = draw(st.one_of(st.none(), st.integers(0, cfg["vocab_size"] - 1)))
    if pad is not None:
        cfg["pad_token_id"] = pad
    return cfg


@st.composite
def parity_cases(draw: st.DrawFn, max_len: int = 80) -> ParityCase:
    cfg = draw(text_configs())
    # lengths around the chunk (64) and below the conv window are drawn more often
    seq_len = draw(
        st.one_of(
            st.integers(2, max(2, cfg["linear_conv_kernel_dim"])),
            st.sampled_from([63, 64, 65]).filter(lambda t: t <= max_len),
            st.integers(2, max_len),
        )
    )
    return ParityCase(
        text_config=cfg,
        kind=draw(st.sampled_from(["causal", "conditional"])),
        tie=draw(st.booleans()),
        weights=draw(st.sampled_from(["init", "random"])),
        strong_decay=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        seq_len=seq_len,
        segments=draw(st.integers(1, min(3, seq_len - 1))),
    )

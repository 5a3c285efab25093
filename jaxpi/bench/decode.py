"""Decoding throughput of the embedded engine (`jaxpi.rollout.JaxEngine`) at several batch sizes.

Random weights of the bench model, a short random prompt per row, greedy sampling of a fixed
number of new tokens (no stop tokens, so every row runs to its budget). One timed call is one
`generate`: the prompt's prefill plus the decode loop; with prompts of a few tokens the figure
is the decode rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpi.bench.config import BenchConfig
from jaxpi.bench.timing import figure, timed


def random_model(bench: BenchConfig) -> Any:
    """The bench model with seeded noise in every weight (no initialisers run)."""
    from jaxpi.hf_fixtures import random_jax_model

    return random_jax_model(bench.model, bench.seed, bench.dtype)


def decode_bench(
    bench: BenchConfig, *, batches: Sequence[int] = (1, 16), new_tokens: int = 64, prompt_len: int = 8
) -> dict[str, Any]:
    """Tokens/s (generated tokens over `generate` time) per batch size."""
    from jaxpi.rollout.engine import SamplingParams
    from jaxpi.rollout.jax_engine import JaxEngine

    if new_tokens < 1 or prompt_len < 1 or not batches or min(batches) < 1:
        raise ValueError("decode needs new_tokens >= 1, prompt_len >= 1 and batch sizes >= 1")
    model = random_model(bench)
    rng = np.random.default_rng(bench.seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    out: dict[str, Any] = {"new_tokens": new_tokens, "prompt_len": prompt_len, "batches": {}}
    for b in batches:
        engine = JaxEngine(model, max_len=prompt_len + new_tokens + 1, batch_size=b)
        prompts = rng.integers(0, bench.model.vocab_size, (b, prompt_len)).tolist()
        made: list[int] = []

        def call(engine: JaxEngine = engine, prompts: list = prompts, made: list = made) -> int:
            done = engine.generate(prompts, params)
            made.append(sum(len(c.token_ids) for c in done))
            return made[-1]

        times, first_s = timed(call, warmup=bench.warmup, repeats=bench.repeats)
        generated = made[-1]
        out["batches"][str(b)] = {
            "generated_tokens": generated,
            "call_s": figure(times),
            "tokens_per_s": figure([generated / t for t in times]),
            "first_call_s": first_s,
        }
        del engine
        jax.clear_caches()
    return out

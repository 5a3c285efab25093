"""The toy study's bases, `model.base: toy-random` and `model.base: toy-copy` (registered in
pyproject.toml's `jaxpi.bases` entry points, built into the run directory by `jaxpi.train.base`).

What a tiny model learns. LoRA alone on the toy base (`make_toy_base`, "toy-random") learns the
template, the phrase cycle and the per-level stop decisions but leaves the copied tokens at chance
(4-12 nats each after 150-300 steps; TINY width, rank 16 or 64, 1 or 2 attention layers), and the
plain tiny-random base cannot get past loss ~3.6 at all (its frozen head). `make_copy_base`
("toy-copy", `model.base=toy-copy`) first trains *every* weight of the toy base on sessions of one
length range at every level (`pretrain_copy`). On the keyed tasks that learned the number copy
(observation -> answer) but not the key copy (instruction -> call: the key's first letter right
2-8% of the time after 25-150 steps, chance ~4%), so sampled sessions called a wrong key and
guessed (pass rate 0.05 / 0.09 / 0.02 with values 0-9). Hence the unkeyed tasks, which keep only
the copy the model can learn (`jaxpi.experiments.toy.sessions`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxpi.atomic import atomic_dir
from jaxpi.config import TINY
from jaxpi.convert.hf import load_hf, save_hf
from jaxpi.convert.tiny import make_checkpoint
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.experiments.toy.sessions import DEFAULT_REASONING, END_OF_TURN, ToySFTConfig, toy_sessions
from jaxpi.train.base import BaseRequest
from jaxpi.train.step import init_opt_state, make_train_step


def make_toy_base(
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = 4,
    attention_every: int = 4,
    hidden: int | None = None,
    head_scale: float = 6.0,
    qk_gain: float = 2.5,
    decay: tuple[float, float] = (0.002, 0.05),
) -> Path:
    """A tiny random Qwen3.5 base (bundled tokenizer) whose LM head can express a confident token.

    `jaxpi.convert.tiny` draws every weight with std 0.05. The final RMSNorm fixes the hidden
    state's norm at ~sqrt(hidden) = 8, so a head row of norm 0.05 * 8 = 0.4 caps any logit near 3:
    over 512 ids no token can pass p ~ 0.05 (a loss floor ~3.5 that LoRA cannot move, since the head
    is frozen). Scaling the head by `head_scale` lifts the cap to ~20. `hidden` widens the model
    (TINY's head layout scaled to match). Written atomically (`jaxpi.atomic.atomic_dir`).
    """
    out = Path(out_dir)
    if layers < 1 or attention_every < 1:
        raise ValueError(f"need layers >= 1 and attention_every >= 1, got {layers}, {attention_every}")
    # Layer i is full attention when (i + 1) % attention_every == 0 (Qwen3.5 itself: every 4th).
    types = tuple(
        "full_attention" if (i + 1) % attention_every == 0 else "linear_attention" for i in range(layers)
    )
    cfg = TINY.replace(num_hidden_layers=layers, layer_types=types)
    if hidden is not None:
        cfg = cfg.replace(hidden_size=hidden, intermediate_size=2 * hidden)
    with atomic_dir(out, overwrite=True) as tmp:
        make_checkpoint(tmp, cfg, seed=seed, tokenizer=True)
        _sharpen(tmp / "model.safetensors", seed, head_scale, qk_gain, decay)
    return out


def _sharpen(weights: Path, seed: int, head_scale: float, qk_gain: float, decay: tuple[float, float]) -> None:
    """Rewrite a random checkpoint's head, attention gains and DeltaNet decay in place."""
    tensors = load_file(weights)
    if "lm_head.weight" not in tensors:
        raise KeyError(f"{weights} has no lm_head.weight to scale")
    tensors["lm_head.weight"] = (tensors["lm_head.weight"] * np.float32(head_scale)).astype(
        tensors["lm_head.weight"].dtype
    )
    # Attention logits are q̂·k̂/sqrt(d) with q, k RMS-normalised to the (1 + w) gain: at gain ~1 the
    # largest logit is ~sqrt(d) = 5.7, too flat to pick one position out of ~400 (a copy needs
    # that). The zero-centred weight w becomes qk_gain · (1 + w) - 1.
    for name in [n for n in tensors if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]:
        w = tensors[name]
        tensors[name] = (np.float32(qk_gain) * (1.0 + w) - 1.0).astype(w.dtype)
    # DeltaNet decay per token is exp(-exp(A_log) · softplus(a + dt_bias)); the fixtures' A_log
    # (exp in 0.5-4.5) forgets within a few tokens, so no layer could carry the key from the
    # instruction to the tool call. exp(A_log) drawn log-uniform in `decay` keeps ~10-300 tokens.
    rng = np.random.default_rng([seed, 2])
    for name in [n for n in tensors if n.endswith("linear_attn.A_log")]:
        a = tensors[name]
        tensors[name] = rng.uniform(np.log(decay[0]), np.log(decay[1]), a.shape).astype(a.dtype)
    save_file(tensors, str(weights), metadata={"format": "pt"})


# ---- a base that can copy -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CopyPretrainConfig:
    """Full-parameter training of the toy base on scripted sessions of one length range for every
    level: it learns the copy (key into the call, number into the answer) but no per-level lengths,
    which the LoRA SFT then adds. The defaults learn the copy in ~2-4 min on 2 CPU cores."""

    steps: int = 120
    batch: int = 8
    lr: float = 3e-3
    warmup: int = 20
    examples: int = 1024
    max_value: int = 10
    reasoning: tuple[int, int] = (12, 80)  # attempt reasoning tokens, the same at every level
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasoning", tuple(int(x) for x in self.reasoning))
        errors = []
        if self.steps < 1 or self.batch < 1 or self.examples < self.batch:
            errors.append(
                f"need steps >= 1, batch >= 1, examples >= batch; got {self.steps}, {self.batch}, {self.examples}"
            )
        if not self.lr > 0 or not 0 <= self.warmup < max(self.steps, 1):
            errors.append(f"need lr > 0 and 0 <= warmup < steps; got {self.lr}, {self.warmup}")
        if self.max_value < 1:
            errors.append(f"max_value must be >= 1, got {self.max_value}")
        if len(self.reasoning) != 2 or not 1 <= self.reasoning[0] <= self.reasoning[1]:
            errors.append(f"reasoning must be (lo, hi) with 1 <= lo <= hi, got {self.reasoning}")
        if errors:
            raise ValueError("; ".join(errors))


def _pad_rows(examples: Sequence[Mapping[str, Any]], multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """`[N, L]` ids and masks, right-padded with 0 to the longest row rounded up to `multiple`
    (the DeltaNet chunk size)."""
    n = max(len(e["input_ids"]) for e in examples)
    length = -(-n // multiple) * multiple
    ids = np.zeros((len(examples), length), np.int32)
    mask = np.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = e["input_ids"]
        mask[i, : len(e["loss_mask"])] = e["loss_mask"]
    return ids, mask


def answer_positions(examples: Sequence[Mapping[str, Any]], end_id: int) -> np.ndarray:
    """Index of the answer's last token in each session (the supervised token before the final
    end-of-turn), i.e. the number copied from the observation."""
    out = []
    for e in examples:
        ids, mask = np.asarray(e["input_ids"]), np.asarray(e["loss_mask"])
        ends = np.flatnonzero((ids == end_id) & (mask == 1))
        if not len(ends):
            raise ValueError(f"session {e.get('session_id')} has no supervised end of turn")
        out.append(int(ends[-1]) - 1)
    return np.asarray(out)


def _copy_sessions(cfg: CopyPretrainConfig, base_dir: Path, tok: Any) -> list[dict[str, Any]]:
    """`cfg.examples` training sessions and 64 held out, one reasoning range at every level."""
    levels = tuple(DEFAULT_REASONING)
    return toy_sessions(
        cfg.examples + 64,
        cfg.seed + 7,  # not the SFT's task draw (train.seed), so the two sets differ
        tok,
        cfg=ToySFTConfig(
            levels=levels, reasoning=dict.fromkeys(levels, cfg.reasoning), max_value=cfg.max_value
        ),
        render_cfg=RenderConfig(str(base_dir)),
    )


def pretrain_copy(
    base_dir: str | Path,
    out_dir: str | Path,
    cfg: CopyPretrainConfig | None = None,
    *,
    say: Callable[[str], Any] | None = None,
) -> Path:
    """Train every weight of the checkpoint in `base_dir` on uniform-length toy sessions; write
    the result as a HF checkpoint to `out_dir` (atomically) with `pretrain.json` (losses, the
    held-out answer-token accuracy). `say(str)` gets a line every 20 steps."""
    cfg = cfg or CopyPretrainConfig()
    base_dir, out = Path(base_dir), Path(out_dir)
    tok = load_tokenizer(str(base_dir))
    sessions = _copy_sessions(cfg, base_dir, tok)
    train_ids, train_mask = _pad_rows(sessions[: cfg.examples])
    val = sessions[cfg.examples :]
    val_ids, val_mask = _pad_rows(val)
    answer = answer_positions(val, tok.convert_tokens_to_ids(END_OF_TURN))

    _, model = load_hf(base_dir, "float32")
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps, cfg.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    step = jax.jit(make_train_step(graphdef, optimizer, trainable=nnx.Param), donate_argnums=(0, 1))
    opt_state = init_opt_state(optimizer, params, trainable=nnx.Param)

    @jax.jit
    def evaluate(params: Any, ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = nnx.merge(graphdef, params)(ids)[:, :-1].astype(jnp.float32)  # [B, L-1, V]
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0]
        w = mask[:, 1:].astype(jnp.float32)
        return jnp.sum(nll * w) / jnp.sum(w), jnp.argmax(logits, -1) == ids[:, 1:]

    rng = np.random.default_rng([cfg.seed, 3])
    losses, t0 = [], time.time()
    for s in range(1, cfg.steps + 1):
        rows = rng.integers(0, cfg.examples, cfg.batch)
        batch = {"input_ids": jnp.asarray(train_ids[rows]), "loss_mask": jnp.asarray(train_mask[rows])}
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"copy pre-training loss is {losses[-1]} at step {s}")
        if say and (s % 20 == 0 or s == cfg.steps):
            say(
                f"toy base pre-training  step {s}/{cfg.steps}  loss {losses[-1]:.3f}  {time.time() - t0:.0f}s"
            )
    val_loss, hit = evaluate(params, jnp.asarray(val_ids), jnp.asarray(val_mask))
    # hit[b, t] says token t+1 was the argmax after t: the answer token sits at answer[b]
    answer_acc = float(np.mean(np.asarray(hit)[np.arange(len(val)), answer - 1]))

    with atomic_dir(out, overwrite=True) as tmp:
        save_hf(nnx.merge(graphdef, params), tmp, source=base_dir, overwrite=True)
        report = {
            "config": dataclasses.asdict(cfg),
            "losses": losses,
            "val_loss": float(val_loss),
            "val_answer_accuracy": answer_acc,
            "seconds": round(time.time() - t0, 1),
        }
        (tmp / "pretrain.json").write_text(json.dumps(report, indent=2))  # inside the atomic directory
    return out


def make_copy_base(
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = 4,
    cfg: CopyPretrainConfig | None = None,
    say: Callable[[str], Any] | None = None,
) -> Path:
    """`make_toy_base` followed by `pretrain_copy`: the "toy-copy" base of the toy SFT."""
    out = Path(out_dir)
    random_dir = out.with_name(out.name + f".random-{os.getpid()}")
    make_toy_base(random_dir, seed=seed, layers=layers)
    try:
        return pretrain_copy(
            random_dir, out, dataclasses.replace(cfg or CopyPretrainConfig(), seed=seed), say=say
        )
    finally:
        shutil.rmtree(random_dir, ignore_errors=True)


# ---- the `jaxpi.bases` entry points --------------------------------------------------------------
def toy_random_base(out_dir: Path, request: BaseRequest) -> Path:
    """`model.base: toy-random`: `make_toy_base` with the run's seed."""
    return make_toy_base(out_dir, seed=request.seed, layers=request.layers)


def toy_copy_base(out_dir: Path, request: BaseRequest) -> Path:
    """`model.base: toy-copy`: `make_copy_base` with the run's seed, pre-trained on values
    0 .. `max_value`-1 (SFT's data.toy_max_value, GRPO's env.max_value)."""
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    max_value = int(request.options.get("max_value", CopyPretrainConfig.max_value))
    return make_copy_base(
        out_dir,
        seed=request.seed,
        layers=request.layers,
        cfg=CopyPretrainConfig(max_value=max_value),
        say=say,
    )

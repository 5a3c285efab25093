"""SFT sessions for the LookupEnv in which low effort reasons longer than medium, and their measurement.

The seed report saw this after SFT: the low-effort level reasoned longer than medium, a cost-ordering
violation that effort-ordered GRPO then fixed. `toy_sessions` builds a supervised set with the same
fault on purpose, so a tiny model trained on it starts GRPO where the report's model did. On the
unkeyed tasks (`ToySFTConfig.keys_per_task=0`, the default; `get()` takes no argument):

    turn 1   <think> PHRASES </think> <tool_call> get() </tool_call>                (mask 1)
    obs      <tool_response> 7 </tool_response> ... <think>                        (mask 0)
    turn 2   <think> got it. </think> 7                                            (mask 1)

PHRASES is a fixed cycle of short phrases ("need the value.", "call get.", ...); how many of them
a session has is drawn per level so that the attempt's reasoning tokens fall in that level's range
(default low 17-68, medium 31-40, xhigh 68-90). With the tiny tokenizer 1..9 phrases give 17, 23,
31, 40, 50, 58, 68, 81, 90 tokens, so low draws 1-7 phrases (mean 41 tokens), medium 3-4 (35.5)
and xhigh 7-9 (80): low is longer than medium on average, and its spread reaches below medium,
where effort-ordered GRPO can move it (the reward is flat below the reference, so a low level
whose every length sat above medium's would stop at medium's length). Medium never stops before
phrase 3, so a KL pull to the SFT policy holds it there while the shared adapter learns to
shorten low. Keyed tasks
(`keys_per_task >= 1`) name the key in every phrase ("key (ka).") and in the call.

The rows are not rendered by hand: a scripted engine replays the intended turns through the real
agent loop (`run_attempts`), so the ids, observation deltas and masks are exactly those of a
rollout that sampled the same text, and every session is scored by the environment's verifier.

`evaluate_toy` samples a model through `JaxEngine` + `run_attempts` and reports, per level, the
pass rate and reasoning tokens, with the ordering ratios T_L/T_M and T_M/T_H.

What a tiny model learns. LoRA alone on the toy base (`make_toy_base`, "toy-random") learns the
template, the phrase cycle and the per-level stop decisions but leaves the copied tokens at chance
(4-12 nats each after 150-300 steps; TINY width, rank 16 or 64, 1 or 2 attention layers), and the
plain tiny-random base cannot get past loss ~3.6 at all (its frozen head). `make_copy_base`
("toy-copy", `model.base=toy-copy`) first trains *every* weight of the toy base on sessions of one
length range at every level (`pretrain_copy`). On the keyed tasks that learned the number copy
(observation -> answer) but not the key copy (instruction -> call: the key's first letter right
2-8% of the time after 25-150 steps, chance ~4%), so sampled sessions called a wrong key and
guessed (pass rate 0.05 / 0.09 / 0.02 with values 0-9). Hence the unkeyed tasks, which keep only
the copy the model can learn.

Measured on the unkeyed tasks, values 0-9 (2 CPU cores shared with other jobs;
`jaxpi sft --config configs/sft/toy.yaml output.dir=runs/sft-toy`, then
`python -m jaxpi.envs.toy_sft eval runs/sft-toy --tasks 16 --attempts 4`: temperature 1, 128 new
tokens a turn, 3 turns, context 512):

    toy-copy pre-training   120 steps of 8 rows, 160 s: loss 0.027, held-out answer token right
                            on 64/64 sessions (pretrain.json)
    LoRA SFT, ranges low 34-52, medium 12-28, xhigh 52-80 (4-5, 1-2, 6-7 phrases):
                            150 steps of 4 rows, ~3 min: loss 0.010, val 0.011
    level    attempts  pass  malformed  reasoning mean ± std (min-max)
    low          64    0.91    0.03        44.4 ±  9.5 (4-55)
    medium       64    0.98    0.02        18.5 ±  2.9 (10-23)
    xhigh        64    0.97    0.02        65.8 ±  7.6 (24-87)
    T_L/T_M = 2.40, T_M/T_H = 0.28     (64 s)

With the default ranges (low 1-7 phrases, medium 3-4, xhigh 7-9; configs/sft/toy.yaml, 300 steps,
in `jaxpi demo --full`), the held-out evaluation before GRPO (24 tasks x 2 attempts a level):
pass 0.98 / 1.00 / 1.00, reasoning 40.0 / 33.9 / 75.2 tokens (low / medium / xhigh), T_L/T_M 1.18
[1.04, 1.34], T_M/T_H 0.45; admitted 98 / 100 / 96%. Low's mean sits nearer medium than the
ranges' (41 vs 35.5 per the data) because its spread is wide; one collection of 16 low attempts
can come out shorter than medium.

A guess passes 1 time in 10, so these pass rates are the copy, and the ordering violation is the
one the data put there.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from jaxpi.data.render import RenderConfig
from jaxpi.envs.agent_loop import Trajectory, run_attempts
from jaxpi.envs.base import Task
from jaxpi.envs.toy import LookupEnv, make_tasks
from jaxpi.rollout.engine import Completion, SamplingParams, Session

# Distinct phrases in a fixed order: which phrase comes next tells the model how far it has gone.
# The key sits in parentheses, where the tiny tokenizer splits it exactly as in the tool call
# ("\nka\n"); after a space some first letters merge with it (" n", " l"), a different token.
PHRASES = (
    "key ({k}).",
    "find ({k}).",
    "look up ({k}).",
    "call get ({k}).",
    "need ({k}).",
    "read ({k}).",
    "ask for ({k}).",
    "use ({k}).",
)
# The unkeyed tasks' cycle (`keys_per_task=0`): nothing to copy from the instruction.
PLAIN_PHRASES = (
    "need the value.",
    "call get.",
    "read the reply.",
    "copy the number.",
    "check it once.",
    "then answer.",
    "no key here.",
    "one call is enough.",
)
SECOND_THOUGHT = "got it."  # turn 2's reasoning, the same in every session
DEFAULT_REASONING: Mapping[str, tuple[int, int]] = MappingProxyType(
    {"low": (17, 68), "medium": (31, 40), "xhigh": (68, 90)}
)
END_OF_TURN = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class ToySFTConfig:
    """Which levels, how long each reasons (attempt reasoning tokens, inclusive), the task shape."""

    levels: tuple[str, ...] = ("low", "medium", "xhigh")
    reasoning: Mapping[str, tuple[int, int]] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_REASONING)
    )
    keys_per_task: int = 0  # 0: unkeyed tasks, `get()` (the toy result's); >= 1: `get(key)`
    max_value: int = 10

    def __post_init__(self) -> None:
        reasoning = {str(k): (int(v[0]), int(v[1])) for k, v in dict(self.reasoning).items()}
        object.__setattr__(self, "reasoning", MappingProxyType(reasoning))
        object.__setattr__(self, "levels", tuple(self.levels))
        errors = []
        if not self.levels:
            errors.append("levels must name at least one effort level")
        for level in self.levels:
            if level not in reasoning:
                errors.append(f"level {level!r} has no reasoning range (have {sorted(reasoning)})")
        for level, (lo, hi) in reasoning.items():
            if not 1 <= lo <= hi:
                errors.append(f"reasoning range of {level!r} must satisfy 1 <= lo <= hi, got ({lo}, {hi})")
        if self.keys_per_task < 0 or self.max_value < 1:
            errors.append(
                f"keys_per_task must be >= 0 and max_value >= 1, got {self.keys_per_task}, {self.max_value}"
            )
        if errors:
            raise ValueError("; ".join(errors))


def tool_call(key: str | None) -> str:
    """The qwen3-coder XML the chat template teaches for `get(key=...)` (`get()` for key None)."""
    if key is None:
        return "<tool_call>\n<function=get>\n</function>\n</tool_call>"
    return f"<tool_call>\n<function=get>\n<parameter=key>\n{key}\n</parameter>\n</function>\n</tool_call>"


def filler(key: str | None, n: int) -> str:
    """The first n phrases of the cycle, naming `key` (the plain cycle for key None)."""
    if key is None:
        return " ".join(PLAIN_PHRASES[i % len(PLAIN_PHRASES)] for i in range(n))
    return " ".join(PHRASES[i % len(PHRASES)].format(k=key) for i in range(n))


def script(key: str | None, value: int, phrases: int) -> tuple[str, str]:
    """The two assistant turns, as sampled text (the generation prompt already opened `<think>`)."""
    first = f"{filler(key, phrases)}\n</think>\n\n{tool_call(key)}{END_OF_TURN}"
    second = f"{SECOND_THOUGHT}\n</think>\n\n{value}{END_OF_TURN}"
    return first, second


def reasoning_tokens(tokenizer: Any, key: str | None, phrases: int) -> int:
    """Reasoning tokens of a scripted attempt (both turns), counted as the agent loop counts them:
    the text before `</think>`, its trailing newline included."""

    def n(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return n(f"{filler(key, phrases)}\n") + n(f"{SECOND_THOUGHT}\n")


def pick_phrases(tokenizer: Any, key: str | None, span: tuple[int, int], rng: np.random.Generator) -> int:
    """A phrase count, uniform over those whose attempt reasoning falls in `span`."""
    lo, hi = span
    fits = []
    for k in range(1, 64):
        t = reasoning_tokens(tokenizer, key, k)
        if t > hi:
            break
        if t >= lo:
            fits.append(k)
    if not fits:
        raise ValueError(
            f"no phrase count gives key {key!r} reasoning in [{lo}, {hi}] tokens; widen the range"
        )
    return int(fits[int(rng.integers(len(fits)))])


class _Replay:
    """A `RolloutEngine` that emits pre-written turns (tokenised whole), one script per session."""

    def __init__(self, tokenizer: Any, scripts: Sequence[Sequence[str]]):
        self.tok, self.scripts = tokenizer, [list(s) for s in scripts]
        self.held: list[list[int]] = []

    def generate(self, prompts: Any, params: SamplingParams) -> list[Completion]:
        raise NotImplementedError("the agent loop uses sessions")

    def start(self, prompts: Sequence[Sequence[int]]) -> list[Session]:
        self.held += [list(p) for p in prompts]
        return [Session(len(self.held) - len(prompts) + i) for i in range(len(prompts))]

    def continue_(
        self, sessions: Sequence[Session], observations: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        out = []
        for s, obs in zip(sessions, observations, strict=True):
            self.held[s.id] += list(obs)
            ids = list(self.tok(self.scripts[s.id].pop(0), add_special_tokens=False)["input_ids"])
            if len(ids) > params.max_new_tokens:
                raise ValueError(
                    f"scripted turn of {len(ids)} tokens exceeds the turn budget {params.max_new_tokens}"
                )
            out.append(Completion(ids, [0.0] * len(ids), [0.0] * len(ids), "stop", len(self.held[s.id])))
            self.held[s.id] += ids
        return out

    def close(self, sessions: Sequence[Session]) -> None:
        pass


def toy_trajectories(
    n: int,
    seed: int,
    tokenizer: Any,
    *,
    cfg: ToySFTConfig | None = None,
    render_cfg: RenderConfig | None = None,
) -> list[Trajectory]:
    """n scripted sessions (tasks from `make_tasks(n, seed)`, levels in turn), through the agent loop.

    A pure function of (n, seed, cfg, tokenizer). Raises if any session fails its verifier or does
    not end with an answer: every row must be one the SFT gate would admit.
    """
    cfg = cfg or ToySFTConfig()
    render_cfg = render_cfg or RenderConfig(tokenizer.name_or_path)
    rng = np.random.default_rng([seed, 1])  # the task draws use `seed` itself
    tasks = make_tasks(n, seed, keys_per_task=cfg.keys_per_task, max_value=cfg.max_value)
    jobs, scripts = [], []
    for i, task in enumerate(tasks):
        level = cfg.levels[i % len(cfg.levels)]
        target = str(task.payload["target"])
        value = int(task.payload["table"][target])
        key = target if task.payload.get("keyed", True) else None
        jobs.append((task, level))
        scripts.append(script(key, value, pick_phrases(tokenizer, key, cfg.reasoning[level], rng)))
    trajs = run_attempts(
        _Replay(tokenizer, scripts),
        tokenizer,
        jobs,
        SamplingParams(temperature=0.0, max_new_tokens=4096),
        env=LookupEnv(),
        render_cfg=render_cfg,
        max_turns=2,
        max_tokens=8192,
    )
    for t in trajs:
        if t.finish_reason != "answer" or not t.success:
            raise RuntimeError(
                f"scripted session {t.task_id} at {t.level} ended {t.finish_reason!r} "
                f"(success={t.success}, reason={t.reason}); the script does not fit the template"
            )
    return trajs


def toy_sessions(
    n: int,
    seed: int,
    tokenizer: Any,
    *,
    cfg: ToySFTConfig | None = None,
    render_cfg: RenderConfig | None = None,
) -> list[dict[str, Any]]:
    """SFT examples `{"input_ids", "loss_mask", "session_id", "level", "reasoning_tokens"}`
    (int32 arrays; mask 1 exactly on the scripted assistant turns), one per session."""
    out = []
    for t in toy_trajectories(n, seed, tokenizer, cfg=cfg, render_cfg=render_cfg):
        out.append(
            {
                "input_ids": np.asarray(t.token_ids, np.int32),
                "loss_mask": np.asarray(t.mask, np.int32),
                "session_id": t.task_id,
                "level": t.level,
                "reasoning_tokens": t.reasoning_tokens,
            }
        )
    return out


# ---- measurement ---------------------------------------------------------------------------------
def _mean(xs: Sequence[float]) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def summarize(trajs: Sequence[Trajectory], levels: Sequence[str]) -> dict[str, Any]:
    """Per level: attempts, pass rate, malformed share, reasoning tokens (mean, std, min, max, of
    successes), output tokens, finish reasons; the share of (task, level) groups with both a
    success and a failure (the ones GRPO learns from); ordering ratios of mean reasoning tokens."""
    out: dict[str, Any] = {"levels": {}}
    for level in levels:
        ts = [t for t in trajs if t.level == level]
        r = [t.reasoning_tokens for t in ts]
        groups: dict[str, list[bool]] = {}
        for t in ts:
            groups.setdefault(t.task_id, []).append(t.success)
        reasons: dict[str, int] = {}
        for t in ts:
            reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
        out["levels"][level] = {
            "attempts": len(ts),
            "pass_rate": _mean([float(t.success) for t in ts]),
            "malformed": _mean([float(t.malformed) for t in ts]),
            "reasoning_mean": _mean(r),
            "reasoning_std": float(np.std(r)) if r else None,
            "reasoning_min": min(r) if r else None,
            "reasoning_max": max(r) if r else None,
            "reasoning_success_mean": _mean([t.reasoning_tokens for t in ts if t.success]),
            "output_mean": _mean([t.output_tokens for t in ts]),
            "mixed_groups": _mean([float(any(g) and not all(g)) for g in groups.values()]),
            "finish": reasons,
        }
    lv = out["levels"]

    def ratio(a: str, b: str) -> float | None:
        if a in lv and b in lv and lv[a]["reasoning_mean"] and lv[b]["reasoning_mean"]:
            return lv[a]["reasoning_mean"] / lv[b]["reasoning_mean"]
        return None

    out["T_L/T_M"], out["T_M/T_H"] = ratio("low", "medium"), ratio("medium", "xhigh")
    return out


def evaluate_toy(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    levels: Sequence[str],
    attempts: int,
    seed: int,
    *,
    render_cfg: RenderConfig | None = None,
    temperature: float = 1.0,
    max_new_tokens: int = 128,
    max_turns: int = 3,
    max_context: int = 512,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Sample `attempts` sessions per (task, level) with the embedded engine; `summarize` them.

    `max_new_tokens` caps each turn, `max_turns` the turns of an attempt, `max_context` the
    session (the engine's `max_len`). The result also holds the settings it ran with.
    """
    from jaxpi.rollout.jax_engine import JaxEngine

    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    render_cfg = render_cfg or RenderConfig(tokenizer.name_or_path)
    jobs = [(t, lv) for t in tasks for lv in levels for _ in range(attempts)]
    engine = JaxEngine(model, max_len=max_context, batch_size=min(batch_size, len(jobs)))
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    trajs: list[Trajectory] = []
    # The engine holds batch_size sessions at once: run the jobs in slices of that size.
    for s in range(0, len(jobs), engine.batch_size):
        trajs += run_attempts(
            engine,
            tokenizer,
            jobs[s : s + engine.batch_size],
            dataclasses.replace(params, seed=seed + s),
            env=LookupEnv(),
            render_cfg=render_cfg,
            max_turns=max_turns,
            max_tokens=max_turns * max_new_tokens,
            seed=seed + s,
        )
    out = summarize(trajs, levels)
    out["settings"] = {
        "tasks": len(tasks),
        "attempts": attempts,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "max_turns": max_turns,
        "max_context": max_context,
    }
    return out


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

    `jaxpi.hf_fixtures` draws every weight with std 0.05. The final RMSNorm fixes the hidden state's
    norm at ~sqrt(hidden) = 8, so a head row of norm 0.05 * 8 = 0.4 caps any logit near 3: over
    512 ids no token can pass p ~ 0.05 (a loss floor ~3.5 that LoRA cannot move, since the head is
    frozen). Scaling the head by `head_scale` lifts the cap to ~20. `hidden` widens the model
    (TINY's head layout scaled to match). Written to a temporary directory and renamed into place.
    """
    from safetensors.numpy import load_file, save_file

    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import make_checkpoint

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
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    make_checkpoint(tmp, cfg, seed=seed, tokenizer=True)
    weights = tmp / "model.safetensors"
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
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


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


def pretrain_copy(
    base_dir: str | Path,
    out_dir: str | Path,
    cfg: CopyPretrainConfig | None = None,
    *,
    say: Any = None,
) -> Path:
    """Train every weight of the checkpoint in `base_dir` on uniform-length toy sessions; write
    the result as a HF checkpoint to `out_dir` (temp + rename) with `pretrain.json` (losses, the
    held-out answer-token accuracy). `say(str)` gets a line every 20 steps."""
    import json
    import time

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxpi.convert.hf import load_hf, save_hf
    from jaxpi.data.render import load_tokenizer
    from jaxpi.train.step import init_opt_state, make_train_step

    cfg = cfg or CopyPretrainConfig()
    base_dir, out = Path(base_dir), Path(out_dir)
    tok = load_tokenizer(str(base_dir))
    levels = tuple(DEFAULT_REASONING)
    sessions = toy_sessions(
        cfg.examples + 64,
        cfg.seed + 7,  # not the SFT's task draw (train.seed), so the two sets differ
        tok,
        cfg=ToySFTConfig(
            levels=levels, reasoning=dict.fromkeys(levels, cfg.reasoning), max_value=cfg.max_value
        ),
        render_cfg=RenderConfig(str(base_dir)),
    )
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

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(nnx.merge(graphdef, params), tmp, source=base_dir, overwrite=True)
    report = {
        "config": dataclasses.asdict(cfg),
        "losses": losses,
        "val_loss": float(val_loss),
        "val_answer_accuracy": answer_acc,
        "seconds": round(time.time() - t0, 1),
    }
    (tmp / "pretrain.json").write_text(json.dumps(report, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def make_copy_base(
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int = 4,
    cfg: CopyPretrainConfig | None = None,
    say: Any = None,
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


def toy_random_base(out_dir: Path, request: Any) -> Path:
    """`model.base: toy-random` (a `jaxpi.bases` entry point): `make_toy_base` with the run's seed."""
    return make_toy_base(out_dir, seed=request.seed, layers=request.layers)


def toy_copy_base(out_dir: Path, request: Any) -> Path:
    """`model.base: toy-copy` (a `jaxpi.bases` entry point): `make_copy_base` with the run's seed,
    pre-trained on values 0 .. `max_value`-1 (SFT's data.toy_max_value, GRPO's env.max_value)."""
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    max_value = int(request.options.get("max_value", CopyPretrainConfig.max_value))
    return make_copy_base(
        out_dir,
        seed=request.seed,
        layers=request.layers,
        cfg=CopyPretrainConfig(max_value=max_value),
        say=say,
    )


def load_run(run_dir: str | Any) -> tuple[Any, Any, RenderConfig]:
    """(model with the run's adapter, tokenizer, render config) of an SFT run's latest checkpoint."""
    from flax import nnx

    from jaxpi.convert.hf import load_hf
    from jaxpi.data.render import load_tokenizer
    from jaxpi.lora import add_lora
    from jaxpi.train.checkpoint import load_adapter

    state, lora_cfg, meta = load_adapter(run_dir)
    _, model = load_hf(meta["base"], meta.get("dtype", "float32"))
    add_lora(model, lora_cfg)
    nnx.update(model, state)
    tok_dir = meta.get("tokenizer") or meta["base"]
    return model, load_tokenizer(tok_dir), RenderConfig(tok_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxpi.envs.toy_sft base OUT_DIR` writes the toy base; `... eval RUN_DIR` samples
    the run's latest checkpoint on fresh tasks and prints `evaluate_toy`'s result as JSON."""
    import argparse
    import json
    import time

    p = argparse.ArgumentParser(prog="python -m jaxpi.envs.toy_sft", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="write the tiny random base with a scaled LM head")
    b.add_argument("out_dir")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--attention-every", type=int, default=4)
    b.add_argument("--hidden", type=int, default=None)
    b.add_argument("--head-scale", type=float, default=6.0)
    b.add_argument("--qk-gain", type=float, default=2.5)
    e = sub.add_parser("eval", help="pass rate and reasoning tokens per level of an SFT run")
    e.add_argument("run_dir")
    e.add_argument("--tasks", type=int, default=16)
    e.add_argument("--attempts", type=int, default=4)
    e.add_argument("--seed", type=int, default=1000, help="task and sampling seed (SFT tasks use train.seed)")
    e.add_argument("--levels", default="low,medium,xhigh")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--max-context", type=int, default=512)
    e.add_argument("--keys-per-task", type=int, default=0, help="0: unkeyed tasks (get())")
    e.add_argument("--max-value", type=int, default=10)
    args = p.parse_args(argv)
    if args.cmd == "base":
        out = make_toy_base(
            args.out_dir,
            seed=args.seed,
            layers=args.layers,
            attention_every=args.attention_every,
            hidden=args.hidden,
            head_scale=args.head_scale,
            qk_gain=args.qk_gain,
        )
        print(out)
        return 0
    t0 = time.time()
    model, tok, render_cfg = load_run(args.run_dir)
    result = evaluate_toy(
        model,
        tok,
        make_tasks(args.tasks, seed=args.seed, keys_per_task=args.keys_per_task, max_value=args.max_value),
        args.levels.split(","),
        args.attempts,
        seed=args.seed,
        render_cfg=render_cfg,
        max_new_tokens=args.max_new_tokens,
        max_context=args.max_context,
    )
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

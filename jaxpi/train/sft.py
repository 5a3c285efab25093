"""LoRA SFT: `jaxpi sft --config configs/sft/tiny.yaml [key.sub=value ...] [--json]`.

    base HF checkpoint (frozen, model.dtype) + LoRA adapters (float32)
      ← AdamW (warmup + cosine, weight decay, global-norm clipping), optimizer state float32
      ← packed batches of admitted sessions (loss on assistant tokens), k microbatches per step

The loop is the I/O edge around the pure pieces (`jaxpi.train.step`, `jaxpi.train.schedule`):
it loads the base, attaches adapters, resumes from `<output.dir>/checkpoints` when there is a
checkpoint (same adapter, optimizer state, data position and RNG: the continuation is the run that
was never stopped), logs every step (`metrics.jsonl`, TensorBoard, a progress bar), evaluates the
held-out sessions, checkpoints every `train.checkpoint_every` steps and at the end, and stops at the
first non-finite loss or gradient norm without checkpointing that step. docs/sft.md has every field.

RNG: one seed. The tiny random base is written with it, adapters are initialised from
`fold_in(key(seed), 1)`, the data order from the seed, and step s's dropout key is
`fold_in(fold_in(key(seed), 2), s)`: a function of the step, so a resumed run draws the same keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxpi.configfile import load_config, to_dict
from jaxpi.data.gates import GateConfig
from jaxpi.lora import LoraConfig
from jaxpi.train.base import ModelConfig, prepare_base
from jaxpi.train.schedule import OptimConfig

DEMO_SESSIONS = str(Path(__file__).resolve().parents[1] / "assets" / "demo" / "sessions")
TINY_TOKENIZER = str(Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer")


# ---- config --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "sessions" (Pi sessions, rendered) | "synthetic" (random-token test data) | "toy_lookup"
    source: str = "sessions"
    sessions: tuple[str, ...] = (DEMO_SESSIONS,)  # files or directories of sessions
    tokenizer: str = ""  # tokenizer directory; "" = the base checkpoint's own
    seq_len: int = 2048
    batch_size: int = 8  # rows per microbatch (global, all hosts); a step sees grad_accum of them
    packing: str = "first_fit"  # first_fit | best_fit | none
    overlong: str = "truncate"  # truncate | drop
    shuffle: bool = True
    val_fraction: float = 0.1  # share of sessions held out for validation loss
    synthetic_examples: int = 64  # source "synthetic" only
    # source "toy_lookup" only (jaxpi.envs.toy_sft): scripted LookupEnv sessions, levels in turn,
    # toy_reasoning = (lo, hi) reasoning tokens per level of toy_levels, flattened; () = defaults
    toy_examples: int = 384
    toy_levels: tuple[str, ...] = ("low", "medium", "xhigh")
    toy_reasoning: tuple[int, ...] = ()
    toy_max_value: int = 100  # the tasks' values are 0 .. toy_max_value-1 (ToySFTConfig.max_value)
    gate: GateConfig = dataclasses.field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        errors = []
        if self.source not in ("sessions", "synthetic", "toy_lookup"):
            errors.append(f"data.source must be 'sessions', 'synthetic' or 'toy_lookup', got {self.source!r}")
        if self.source == "sessions" and not self.sessions:
            errors.append("data.sessions must name at least one file or directory")
        if self.seq_len < 2:
            errors.append(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            errors.append(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.packing not in ("first_fit", "best_fit", "none"):
            errors.append(f"data.packing must be first_fit, best_fit or none, got {self.packing!r}")
        if self.overlong not in ("truncate", "drop"):
            errors.append(f"data.overlong must be truncate or drop, got {self.overlong!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            errors.append(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.synthetic_examples < 2:
            errors.append(f"data.synthetic_examples must be >= 2, got {self.synthetic_examples}")
        if self.toy_examples < 2:
            errors.append(f"data.toy_examples must be >= 2, got {self.toy_examples}")
        if not self.toy_levels:
            errors.append("data.toy_levels must name at least one effort level")
        if self.toy_reasoning and len(self.toy_reasoning) != 2 * len(self.toy_levels):
            errors.append(
                f"data.toy_reasoning must hold (lo, hi) for each of the {len(self.toy_levels)} toy_levels "
                f"({2 * len(self.toy_levels)} numbers), got {len(self.toy_reasoning)}"
            )
        if errors:
            raise ValueError("; ".join(errors))

    def toy_config(self) -> Any:
        """The `jaxpi.envs.toy_sft.ToySFTConfig` of source "toy_lookup" (validates the ranges)."""
        from jaxpi.envs.toy_sft import ToySFTConfig

        if not self.toy_reasoning:
            return ToySFTConfig(levels=self.toy_levels, max_value=self.toy_max_value)
        r = self.toy_reasoning
        spans = {lv: (r[2 * i], r[2 * i + 1]) for i, lv in enumerate(self.toy_levels)}
        return ToySFTConfig(levels=self.toy_levels, reasoning=spans, max_value=self.toy_max_value)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer updates
    grad_accum: int = 1  # microbatches per update
    seed: int = 0
    eval_every: int = 0  # validation loss every N steps (and at the end); 0 = only at the end
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    eval_hook: str = ""  # "module:function", called as fn(checkpoint_dir, step) after each checkpoint
    # Test hook: poison the loss with NaN at this step (0 = off), to exercise the non-finite stop.
    nan_at_step: int = 0

    def __post_init__(self) -> None:
        errors = []
        if self.steps < 1:
            errors.append(f"train.steps must be >= 1, got {self.steps}")
        if self.grad_accum < 1:
            errors.append(f"train.grad_accum must be >= 1, got {self.grad_accum}")
        if not 0 <= self.seed < 2**32:
            errors.append(f"train.seed must be in [0, 2**32), got {self.seed}")
        if self.eval_every < 0:
            errors.append(f"train.eval_every must be >= 0, got {self.eval_every}")
        if self.checkpoint_every < 1:
            errors.append(f"train.checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            errors.append(f"train.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.eval_hook and ":" not in self.eval_hook:
            errors.append(f"train.eval_hook must be 'module:function', got {self.eval_hook!r}")
        if self.nan_at_step < 0:
            errors.append(f"train.nan_at_step must be >= 0 (0 = off), got {self.nan_at_step}")
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    strategy: str = ""  # dp | fsdp | tp | fsdp_tp; "" with no mesh = one device
    mesh: str = ""  # e.g. "fsdp=8" or "data=2,fsdp=4"; "" = one device

    def __post_init__(self) -> None:
        if self.strategy and not self.mesh:
            raise ValueError("sharding.strategy needs sharding.mesh (e.g. fsdp=8)")


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str = "runs/sft"
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        if self.train.nan_at_step > self.train.steps:
            raise ValueError(
                f"train.nan_at_step {self.train.nan_at_step} is past train.steps {self.train.steps}"
            )


# Sections that must not change when a run resumes (they define what the checkpoint means).
_FIXED_ON_RESUME = ("model", "data", "lora", "optim", "train.seed", "train.grad_accum")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step is NaN or infinite."""


# ---- data ----------------------------------------------------------------------------------------
def session_key(example: Any, index: int) -> str:
    """The session an example came from (examples of one session stay on one side of the split).

    File sources count by file name (and line), not by directory, so the split does not change when
    the data is moved or read from another checkout."""
    for name in ("session_id", "session", "source", "path"):
        value = example.get(name) if isinstance(example, dict) else getattr(example, name, None)
        if value:
            return Path(str(value)).name if name in ("source", "path") else str(value)
    return f"example-{index}"


def split_by_session(examples: Sequence[Any], val_fraction: float) -> tuple[list[Any], list[Any]]:
    """(train, val): the sessions whose SHA-256 ranks lowest are held out, ⌈fraction · sessions⌉ of
    them (at least one when the fraction is positive and there are two sessions or more). Depends
    only on the set of sessions, so every restart draws the same split."""
    keys = [session_key(e, i) for i, e in enumerate(examples)]
    sessions = sorted(set(keys), key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    n_val = 0 if val_fraction == 0 or len(sessions) < 2 else max(1, math.ceil(val_fraction * len(sessions)))
    held = set(sessions[: min(n_val, len(sessions) - 1)])
    train = [e for e, k in zip(examples, keys, strict=True) if k not in held]
    val = [e for e, k in zip(examples, keys, strict=True) if k in held]
    return train, val


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    """Random-length token chains that follow a fixed random successor map over a 64-token subset
    (learnable in a few dozen steps), the first quarter of each masked as a prompt. Two examples
    per "session"."""
    import numpy as np

    rng = np.random.default_rng(seed)
    alphabet = rng.choice(vocab, size=min(64, vocab), replace=False)
    successor = dict(zip(alphabet.tolist(), rng.permutation(alphabet).tolist(), strict=True))
    out = []
    for i in range(n):
        length = int(rng.integers(max(4, seq_len // 4), seq_len + 1))
        ids = [int(rng.choice(alphabet))]
        for _ in range(length - 1):
            ids.append(successor[ids[-1]])
        mask = np.ones(length, np.int32)
        mask[: length // 4] = 0
        out.append(
            {"input_ids": np.asarray(ids, np.int32), "loss_mask": mask, "session_id": f"synthetic/{i // 2}"}
        )
    return out


def build_data(cfg: SFTConfig, base_dir: Path, vocab: int) -> tuple[list[Any], dict[str, Any]]:
    """Admitted examples and the data report (gate counts), from sessions or synthetic."""
    d = cfg.data
    if d.source == "synthetic":
        examples = synthetic_examples(d.synthetic_examples, d.seq_len, vocab, cfg.train.seed)
        return examples, {"source": "synthetic", "examples": len(examples)}
    from jaxpi.data.examples import build_examples
    from jaxpi.data.render import RenderConfig, load_tokenizer

    if d.source == "toy_lookup":
        from jaxpi.envs.toy_sft import toy_sessions

        tok_dir = d.tokenizer or str(base_dir)
        toy = d.toy_config()
        examples = toy_sessions(
            d.toy_examples, cfg.train.seed, load_tokenizer(tok_dir), cfg=toy, render_cfg=RenderConfig(tok_dir)
        )
        spans = {lv: list(toy.reasoning[lv]) for lv in toy.levels}
        return examples, {"source": "toy_lookup", "examples": len(examples), "reasoning": spans}

    render_cfg = RenderConfig(tokenizer_dir=d.tokenizer or str(base_dir))
    examples, report = build_examples(list(d.sessions), render_cfg, d.gate)
    return list(examples), {"source": "sessions", "paths": list(d.sessions), "report": _jsonable(report)}


def _jsonable(obj: Any) -> Any:
    # Field by field, not dataclasses.asdict: asdict rebuilds a Counter from (key, count) pairs.
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "to_json"):
        return _jsonable(obj.to_json())
    return str(obj)


# ---- the run -------------------------------------------------------------------------------------
def _load_hook(spec: str) -> Callable[[str, int], Any]:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"train.eval_hook {spec!r} cannot be loaded: {e}") from e


_MISSING = object()


def _check_resume(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys of `_FIXED_ON_RESUME` whose values differ between two config dicts.

    A field the saved config lacks (a run saved before the field existed) counts as its default:
    it differs only when the current run sets it to something else.
    """
    diffs = []
    defaults = to_dict(SFTConfig())

    def walk(a: Any, b: Any, default: Any, key: str) -> None:
        if a is _MISSING:
            a = default
        if isinstance(a, dict) and isinstance(b, dict):
            d = default if isinstance(default, dict) else {}
            for k in sorted(set(a) | set(b)):
                walk(a.get(k, _MISSING), b.get(k), d.get(k), f"{key}.{k}")
        elif a != b:
            diffs.append(key)

    for key in _FIXED_ON_RESUME:
        section, _, field = key.partition(".")
        a, b, d = (c.get(section, {}) for c in (saved, current, defaults))
        if field:
            a, b, d = a.get(field, _MISSING), b.get(field), d.get(field)
        walk(a, b, d, key)
    return diffs


FIELDS = ("input_ids", "loss_mask", "segment_ids", "positions")  # what the model and loss read


@dataclasses.dataclass
class SFTData:
    """The admitted examples split by session, the pipeline settings, the data report."""

    train: list[Any]
    val: list[Any]
    pipeline: Any  # jaxpi.data.pipeline.PipelineConfig
    report: dict[str, Any]


def prepare_data(cfg: SFTConfig, base_dir: Path, vocab: int) -> SFTData:
    """Examples (sessions or synthetic), the session split, packing statistics of one epoch."""
    from jaxpi.data.pipeline import PipelineConfig, example_stats, packing_stats

    examples, report = build_data(cfg, base_dir, vocab)
    train, val = split_by_session(examples, cfg.data.val_fraction)
    if not train:
        raise ValueError("no training examples were admitted (see the data report)")
    pipe = PipelineConfig(
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        seed=cfg.train.seed,
        shuffle=cfg.data.shuffle,
        num_epochs=None,  # the run is measured in steps; epochs wrap
        overlong=cfg.data.overlong,
        packing=cfg.data.packing,
    )
    pack = packing_stats(train, pipe)
    report.update(
        train_examples=len(train),
        val_examples=len(val),
        sessions={
            "train": len({session_key(e, i) for i, e in enumerate(train)}),
            "val": len({session_key(e, i) for i, e in enumerate(val)}),
        },
        examples=dataclasses.asdict(example_stats(train, pipe)),
        packing={**dataclasses.asdict(pack), "efficiency": pack.efficiency},
        epoch_steps=pack.batches / cfg.train.grad_accum,
    )
    return SFTData(train, val, pipe, report)


@dataclasses.dataclass
class Trainer:
    """Model state and the compiled functions over it, placed on one device or a mesh.

    `step(params, opt_state, batch[, key])` is the jitted train step (a key only with LoRA
    dropout); `evaluate(params, batch) -> (Σ nll, Σ weights)`; `feed(batch, train)` puts a host
    batch where the step (or, with train=False, `evaluate`) wants it.
    """

    graphdef: Any
    params: Any
    opt_state: Any
    step: Callable[..., Any]
    evaluate: Callable[..., Any]
    feed: Callable[[dict[str, Any], bool], dict[str, Any]]
    with_key: bool


def build_trainer(cfg: SFTConfig, base_dir: Path, model_cfg: Any, key: Any) -> Trainer:
    """Load the frozen base (onto its shardings with a mesh), attach adapters from `key`, build
    the optimizer state and jit the step and the evaluation."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpi.convert.hf import load_hf
    from jaxpi.lora import LoRAParam, add_lora
    from jaxpi.train.schedule import make_optimizer
    from jaxpi.train.step import (
        init_opt_state,
        jit_train_step,
        make_train_step,
        next_token_loss,
        target_weights,
    )

    dtype = jnp.dtype(cfg.model.dtype)
    mesh = strategy = loader = None
    if cfg.sharding.mesh:
        from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM
        from sharding.mesh import make_mesh
        from sharding.strategies import get_strategy, loader_shardings

        mesh = make_mesh(cfg.sharding.mesh)
        strategy = get_strategy(cfg.sharding.strategy or "fsdp")
        build = lambda: Qwen3_5ForCausalLM(model_cfg, dtype=dtype, rngs=nnx.Rngs(0))  # noqa: E731
        loader = loader_shardings(nnx.state(nnx.eval_shape(build), nnx.Param), strategy, mesh)
    _, model = load_hf(base_dir, dtype, shardings=loader, config_overrides=cfg.model.overrides())
    add_lora(model, cfg.lora, key=key)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    with_key = cfg.lora.dropout > 0

    def loss_fn(model: Any, poison: Any = None, **batch: Any) -> Any:
        loss = next_token_loss(model, **batch)
        # Test hook (train.nan_at_step): the poison array is 0 except at that step, where it is NaN.
        return loss if poison is None else loss + jnp.sum(poison)

    step_fn = make_train_step(
        graphdef, optimizer, loss_fn=loss_fn, trainable=LoRAParam, accum_steps=cfg.train.grad_accum
    )

    def eval_fn(params: Any, batch: Any) -> tuple[Any, Any]:
        n = jnp.sum(target_weights(**batch))
        return next_token_loss(nnx.merge(graphdef, params), **batch) * n, n

    if mesh is None:
        # Committed to the device, as restored arrays are: otherwise a resumed run compiles the
        # step twice (restored adapters, then the step's own outputs) and misses the compilation
        # cache a fresh run filled.
        device = jax.devices()[0]
        params = jax.device_put(params, device)
        opt_state = jax.device_put(init_opt_state(optimizer, params, trainable=LoRAParam), device)
        return Trainer(
            graphdef,
            params,
            opt_state,
            jax.jit(step_fn, donate_argnums=(0, 1)),
            jax.jit(eval_fn),
            lambda batch, train: {k: jnp.asarray(v) for k, v in batch.items()},
            with_key,
        )

    from sharding.strategies import (
        batch_sharding,
        opt_state_shardings,
        param_shardings,
        with_activation_constraints,
    )

    p_shard = param_shardings(params, strategy, mesh)
    params = jax.device_put(params, p_shard)
    adapters = nnx.state(params, LoRAParam)
    o_shard = opt_state_shardings(
        jax.eval_shape(optimizer.init, adapters), adapters, nnx.state(p_shard, LoRAParam), mesh
    )
    init = jax.jit(lambda p: init_opt_state(optimizer, p, trainable=LoRAParam), out_shardings=o_shard)
    rows = cfg.data.batch_size * cfg.train.grad_accum
    b_shard = batch_sharding(strategy, mesh, (rows, cfg.data.seq_len))
    e_shard = batch_sharding(strategy, mesh, (cfg.data.batch_size, cfg.data.seq_len))

    def feed(batch: dict[str, Any], train: bool) -> dict[str, Any]:
        # Each host holds its rows of the global batch (jaxpi.data.pipeline splits by host).
        sharding = b_shard if train else e_shard
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}

    return Trainer(
        graphdef,
        params,
        init(params),
        jit_train_step(step_fn, p_shard, o_shard, b_shard, mesh, strategy, with_key=with_key),
        jax.jit(with_activation_constraints(eval_fn, strategy, mesh), in_shardings=(p_shard, e_shard)),
        feed,
        with_key,
    )


def run_sft(cfg: SFTConfig, *, progress: bool = True, out: Any = None) -> dict[str, Any]:
    """Train (or resume) the run in `cfg.output.dir`; returns the summary `--json` prints.

    Raises `NonFiniteError` at the first NaN/inf loss or gradient norm (the last good checkpoint
    is kept, that step is not saved).
    """
    import jax
    import numpy as np
    from flax import nnx

    from jaxpi.config import QwenConfig
    from jaxpi.data.pipeline import batch_stats, make_eval_iterator, make_train_iterator
    from jaxpi.lora import LoRAParam
    from jaxpi.train.checkpoint import CheckpointStore
    from jaxpi.train.metrics import MetricsLog
    from jaxpi.train.schedule import lr_schedule
    from jaxpi.train.step import interleave_microbatches

    out = out or sys.stdout
    run_dir = Path(cfg.output.dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(run_dir, keep=cfg.train.keep_checkpoints)
    start = store.latest_step() or 0  # 0: a fresh run; else resume after this step
    config_dict = to_dict(cfg)
    if start:
        saved = store.manager.restore(start, args=_json_args("meta"))["meta"]["config"]
        diffs = _check_resume(saved, config_dict)
        if diffs:
            raise ValueError(
                f"{run_dir} holds a run with a different {', '.join(diffs)}; "
                "resume with the same settings or choose another output.dir"
            )
    _write_atomic(run_dir / "config.json", json.dumps(config_dict, indent=2))

    base_dir = prepare_base(
        cfg.model, run_dir, seed=cfg.train.seed, options={"max_value": cfg.data.toy_max_value}
    )
    model_cfg = QwenConfig.from_hf(base_dir).replace(**cfg.model.overrides())
    data = prepare_data(cfg, base_dir, model_cfg.vocab_size)
    _write_atomic(run_dir / "data_report.json", json.dumps(data.report, indent=2))
    print(_report_text(data.report, cfg), file=out, flush=True)

    root = jax.random.key(cfg.train.seed)
    tr = build_trainer(cfg, base_dir, model_cfg, jax.random.fold_in(root, 1))
    dropout_root = jax.random.fold_in(root, 2)
    train_it = make_train_iterator(data.train, data.pipeline)
    if start:
        restored = store.restore(start, nnx.state(tr.params, LoRAParam), tr.opt_state)
        tr.params = nnx.merge_state(tr.params, restored.adapter)
        tr.opt_state = restored.opt_state
        train_it.set_state(restored.trainer["data"])
        saved_key = np.asarray(restored.trainer["dropout_root"], np.uint32)
        if not np.array_equal(saved_key, np.asarray(jax.random.key_data(dropout_root))):
            raise ValueError("the checkpoint's RNG does not match train.seed")
        print(f"resumed from {store.step_dir(start)} (step {start})", file=out, flush=True)

    meta = {
        "base": str(base_dir),
        "model_config": model_cfg.to_hf(),
        "lora": to_dict(cfg.lora),
        "dtype": cfg.model.dtype,
        "tokenizer": cfg.data.tokenizer or str(base_dir),
        "config": config_dict,
    }
    hook = _load_hook(cfg.train.eval_hook) if cfg.train.eval_hook else None
    schedule = lr_schedule(cfg.optim, cfg.train.steps)

    def validate() -> float | None:
        """Token-weighted loss over one pass of the held-out sessions."""
        if not data.val:
            return None
        total = count = 0.0
        for batch in make_eval_iterator(data.val, data.pipeline):
            s, n = tr.evaluate(tr.params, tr.feed({k: batch[k] for k in FIELDS}, False))
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)

    def save(step: int) -> None:
        # The iterator state is taken after step's batches were drawn: a resume continues with the
        # batch that step + 1 would have seen.
        trainer = {
            "step": step,
            "seed": cfg.train.seed,
            "dropout_root": np.asarray(jax.random.key_data(dropout_root)).tolist(),
            "data": train_it.get_state(),
        }
        adapter = nnx.state(tr.params, LoRAParam)
        path = store.save(step, adapter, tr.opt_state, trainer, {**meta, "step": step})
        if hook is not None:
            hook(str(path), step)

    log = MetricsLog(
        run_dir,
        start_step=start,
        total_steps=cfg.train.steps,
        progress=progress,
        tensorboard=cfg.output.tensorboard,
    )
    last: dict[str, Any] = {}
    val_loss = None
    tokens_total = time_total = 0.0
    t0 = time.time()
    try:
        for s in range(start + 1, cfg.train.steps + 1):
            t_step = time.time()
            batch = interleave_microbatches([next(train_it) for _ in range(cfg.train.grad_accum)])
            stats = batch_stats(batch)
            feed = {k: batch[k] for k in FIELDS}
            if cfg.train.nan_at_step:
                bad = s == cfg.train.nan_at_step
                feed["poison"] = np.full(feed["input_ids"].shape, np.nan if bad else 0.0, np.float32)
            # Step s's dropout key depends on s alone: a resumed run draws the same ones.
            keys = (jax.random.fold_in(dropout_root, s),) if tr.with_key else ()
            tr.params, tr.opt_state, metrics = tr.step(tr.params, tr.opt_state, tr.feed(feed, True), *keys)
            # Reading the metrics waits for the step; that is the price of stopping at the first
            # non-finite step before anything after it is saved.
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteError(_non_finite_message(s, loss, grad_norm, store))
            dt = time.time() - t_step
            tokens_total, time_total = tokens_total + stats["tokens"], time_total + dt
            record = {
                "step": s,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": float(schedule(s - 1)),  # the rate of this step's update (optax counts from 0)
                "tokens": int(stats["tokens"]),
                "supervised_tokens": int(stats["supervised_tokens"]),
                "tokens_per_s": stats["tokens"] / max(dt, 1e-9),
                "time": time.time() - t0,
            }
            if (cfg.train.eval_every and s % cfg.train.eval_every == 0) or s == cfg.train.steps:
                val_loss = validate()
                if val_loss is not None:
                    record["val_loss"] = val_loss
            log.write(record)
            last = record
            if s % cfg.train.checkpoint_every == 0 or s == cfg.train.steps:
                save(s)
    finally:
        log.close()
        store.close()
    final = store.latest_step()
    return {
        "run_dir": str(run_dir),
        "steps": cfg.train.steps,
        "resumed_from": start,
        "final_loss": last.get("loss"),
        "val_loss": val_loss,
        "checkpoint": str(store.step_dir(final)) if final else None,
        "tokens_per_s": tokens_total / time_total if time_total else None,
    }


def _non_finite_message(step: int, loss: float, grad_norm: float, store: Any) -> str:
    good = store.latest_step()
    kept = (
        f"the last good checkpoint is step {good} ({store.step_dir(good)})"
        if good
        else "no checkpoint was written"
    )
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    return (
        f"non-finite {what} at step {step} (loss={loss}, grad_norm={grad_norm}); "
        f"stopping without a checkpoint for this step; {kept}"
    )


def _json_args(name: str) -> Any:
    import orbax.checkpoint as ocp

    return ocp.args.Composite(**{name: ocp.args.JsonRestore()})


def _write_atomic(path: Path, text: str) -> None:
    from jaxpi.atomic import write_text  # cleans the temporary file a killed run left

    write_text(path, text)


def _report_text(report: dict[str, Any], cfg: SFTConfig) -> str:
    lines = [
        f"data: {report['source']}, {report['train_examples']} train / {report['val_examples']} val examples "
        f"({report['sessions']['train']} / {report['sessions']['val']} sessions)"
    ]
    gate = report.get("report")
    if isinstance(gate, dict):
        lines.append(
            "gates: " + ", ".join(f"{k}={v}" for k, v in gate.items() if not isinstance(v, (list, dict)))
        )
        if gate.get("reasons"):
            lines.append("excluded: " + ", ".join(f"{k}={v}" for k, v in gate["reasons"].items()))
    ex, pk = report["examples"], report["packing"]
    lines.append(
        f"tokens: {ex['tokens']} ({ex['supervised_tokens']} supervised), {ex['truncated']} truncated, "
        f"{ex['dropped']} dropped; packing {pk['efficiency']:.1%} of {cfg.data.seq_len}-token rows, "
        f"{report['epoch_steps']:.1f} steps per epoch"
    )
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------
def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi sft` on the CLI's subparsers."""
    p = sub.add_parser(
        "sft",
        help="LoRA SFT on Pi sessions (YAML config + key.sub=value overrides; resumes in output.dir)",
        description="Train a LoRA adapter on admitted Pi sessions. Rerunning the same command resumes from "
        "the latest checkpoint in output.dir. See docs/sft.md for every config field.",
    )
    p.add_argument("--config", required=True, help="YAML file, e.g. configs/sft/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override any config field")
    p.add_argument("--json", action="store_true", help="no progress bar; print a JSON summary at the end")
    p.set_defaults(fn=cmd_sft)
    return p


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = load_config(SFTConfig, args.config, args.overrides)
    try:
        summary = run_sft(cfg, progress=not args.json, out=sys.stderr if args.json else sys.stdout)
    except NonFiniteError as e:
        print(f"jaxpi sft: {e}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(summary, indent=2))
    elif summary["final_loss"] is None:  # resumed at the last step: nothing left to train
        print(f"done already: {summary['steps']} steps, checkpoint {summary['checkpoint']}")
    else:
        print(
            f"done: {summary['steps']} steps, loss {summary['final_loss']:.4f}"
            + (f", val loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else "")
            + f", checkpoint {summary['checkpoint']}"
        )
    return 0

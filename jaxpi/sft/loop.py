"""The LoRA SFT loop: `run_sft(cfg)`, what `jaxpi sft` runs.

    base HF checkpoint (frozen, model.dtype; or nf4/int8 with lora.base_quant) + LoRA adapters (float32)
      ← AdamW (warmup + cosine, weight decay, global-norm clipping), optimizer state float32
      ← packed batches of admitted sessions (loss on assistant tokens), k microbatches per step

The loop is the I/O edge around the pure pieces (`jaxpi.train.step`, `jaxpi.train.schedule`):
it loads the base, attaches adapters, resumes from `<output.dir>/checkpoints` when there is a
checkpoint (same adapter, optimizer state, data position and RNG: the continuation is the run that
was never stopped), logs every step (`metrics.jsonl`, `output.loggers`; a progress bar, or without a
terminal a line every `train.log_every` steps), evaluates the held-out sessions, checkpoints every
`train.checkpoint_every` steps and at the end, and stops at the first non-finite loss or gradient
norm without checkpointing that step. docs/sft.md has every field.

RNG: one seed. A named base is written with it, adapters are initialised from
`fold_in(key(seed), 1)`, the data order from the seed, and step s's dropout key is
`fold_in(fold_in(key(seed), 2), s)`: a function of the step, so a resumed run draws the same keys.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxpi.atomic import write_text
from jaxpi.config import QwenConfig
from jaxpi.configfile import to_dict
from jaxpi.convert.hf import load_hf
from jaxpi.convert.quantize import abstract_model
from jaxpi.data.pipeline import FIELDS, batch_stats, make_eval_iterator, make_train_iterator
from jaxpi.lora import LoRAParam, add_lora
from jaxpi.models.quantized import QuantParam
from jaxpi.sft.config import SFTConfig, resume_diffs
from jaxpi.sft.data import SFTData, prepare_data, report_text
from jaxpi.train.base import prepare_base
from jaxpi.train.checkpoint import CheckpointStore
from jaxpi.train.loggers import require_loggers
from jaxpi.train.metrics import MetricsLog
from jaxpi.train.rundir import NewPaths, new_paths
from jaxpi.train.schedule import lr_schedule, make_optimizer
from jaxpi.train.step import (
    init_opt_state,
    interleave_microbatches,
    jit_train_step,
    make_train_step,
    next_token_loss,
    target_weights,
)
from sharding.mesh import make_mesh
from sharding.strategies import (
    batch_sharding,
    get_strategy,
    loader_shardings,
    opt_state_shardings,
    param_shardings,
    with_activation_constraints,
)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step is NaN or infinite."""


# ---- the trainer ---------------------------------------------------------------------------------
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


def build_trainer(cfg: SFTConfig, base_dir: Path, model_cfg: QwenConfig, key: jax.Array) -> Trainer:
    """Load the frozen base (onto its shardings with a mesh), attach adapters from `key`, build
    the optimizer state and jit the step and the evaluation."""
    dtype = jnp.dtype(cfg.model.dtype)
    mesh = strategy = loader = None
    quant = cfg.lora.base_quant  # "none", or a quantized frozen base (QLoRA)
    if cfg.sharding.mesh:
        mesh = make_mesh(cfg.sharding.mesh)
        strategy = get_strategy(cfg.sharding.strategy or "fsdp")
        loader = loader_shardings(nnx.state(abstract_model(model_cfg, dtype, quant)), strategy, mesh)
    _, model = load_hf(
        base_dir, dtype, shardings=loader, config_overrides=cfg.model.overrides(), base_quant=quant
    )
    add_lora(model, cfg.lora, key=key)
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    with_key = cfg.lora.dropout > 0
    step_fn = make_train_step(graphdef, optimizer, trainable=LoRAParam, accum_steps=cfg.train.grad_accum)

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


# ---- the run's steps -----------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """What the steps of one run share: its directory and checkpoints, the step it resumes after
    (0: a fresh run), the data, the trainer and its data iterator, the dropout key root."""

    cfg: SFTConfig
    dir: Path
    store: CheckpointStore
    start: int
    config: dict[str, Any]
    data: SFTData | None = None
    trainer: Trainer | None = None
    batches: Any = None  # jaxpi.data.pipeline's resumable train iterator
    dropout_root: Any = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # saved with every checkpoint
    hook: Callable[[str, int], Any] | None = None


def open_run(cfg: SFTConfig) -> Run:
    """The run directory and its checkpoints; a resume must keep the settings that define what the
    checkpoint means. Writes `config.json`."""
    run_dir = Path(cfg.output.dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(run_dir, keep=cfg.train.keep_checkpoints)
    start = store.latest_step() or 0
    config = to_dict(cfg)
    if start:
        meta = ocp.args.Composite(meta=ocp.args.JsonRestore())
        diffs = resume_diffs(store.manager.restore(start, args=meta)["meta"]["config"], config)
        if diffs:
            store.close()
            raise ValueError(
                f"{run_dir} holds a run with a different {', '.join(diffs)}; "
                "resume with the same settings or choose another output.dir"
            )
    write_text(run_dir / "config.json", json.dumps(config, indent=2))
    return Run(cfg, run_dir, store, start, config)


def load_data(run: Run, base_dir: Path, model_cfg: QwenConfig, out: Any) -> None:
    """The examples and their split; writes `data_report.json` and prints its summary."""
    run.data = prepare_data(run.cfg, base_dir, model_cfg.vocab_size)
    write_text(run.dir / "data_report.json", json.dumps(run.data.report, indent=2))
    print(report_text(run.data.report, run.cfg.data.seq_len), file=out, flush=True)


def start_trainer(run: Run, base_dir: Path, model_cfg: QwenConfig) -> None:
    """The trainer, the train iterator, the dropout keys, the metadata every checkpoint holds."""
    cfg = run.cfg
    root = jax.random.key(cfg.train.seed)
    run.trainer = build_trainer(cfg, base_dir, model_cfg, jax.random.fold_in(root, 1))
    run.dropout_root = jax.random.fold_in(root, 2)
    run.batches = make_train_iterator(run.data.train, run.data.pipeline)
    run.meta = {
        "base": str(base_dir),
        "model_config": model_cfg.to_hf(),
        "lora": to_dict(cfg.lora),
        "dtype": cfg.model.dtype,
        "tokenizer": cfg.data.tokenizer or str(base_dir),
        "config": run.config,
        # bytes of the quantized frozen base the step trained on (0: a dense base)
        "quantized_base_bytes": _quantized_bytes(run.trainer.params),
    }
    run.hook = _load_hook(cfg.train.eval_hook) if cfg.train.eval_hook else None


def _quantized_bytes(params: Any) -> int:
    values = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(params, QuantParam))]
    return int(sum(x.size * x.dtype.itemsize for x in values))


def resume(run: Run, out: Any) -> None:
    """Adapter, optimizer state, data position of the latest checkpoint; its RNG must be ours."""
    tr = run.trainer
    restored = run.store.restore(run.start, nnx.state(tr.params, LoRAParam), tr.opt_state)
    tr.params = nnx.merge_state(tr.params, restored.adapter)
    tr.opt_state = restored.opt_state
    run.batches.set_state(restored.trainer["data"])
    saved_key = np.asarray(restored.trainer["dropout_root"], np.uint32)
    if not np.array_equal(saved_key, np.asarray(jax.random.key_data(run.dropout_root))):
        raise ValueError("the checkpoint's RNG does not match train.seed")
    print(f"resumed from {run.store.step_dir(run.start)} (step {run.start})", file=out, flush=True)


def next_batch(run: Run) -> dict[str, Any]:
    """The next `train.grad_accum` microbatches, interleaved into one batch."""
    return interleave_microbatches([next(run.batches) for _ in range(run.cfg.train.grad_accum)])


def update(run: Run, s: int, batch: dict[str, Any]) -> tuple[float, float]:
    """One optimizer step; (loss, gradient norm), or `NonFiniteError` when either is not finite."""
    tr = run.trainer
    # Step s's dropout key depends on s alone: a resumed run draws the same ones.
    keys = (jax.random.fold_in(run.dropout_root, s),) if tr.with_key else ()
    feed = tr.feed({k: batch[k] for k in FIELDS}, True)
    tr.params, tr.opt_state, metrics = tr.step(tr.params, tr.opt_state, feed, *keys)
    # Reading the metrics waits for the step; that is the price of stopping at the first
    # non-finite step before anything after it is saved.
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(_non_finite_message(s, loss, grad_norm, run.store))
    return loss, grad_norm


def validate(run: Run) -> float | None:
    """Token-weighted loss over one pass of the held-out sessions."""
    if not run.data.val:
        return None
    tr, total, count = run.trainer, 0.0, 0.0
    for batch in make_eval_iterator(run.data.val, run.data.pipeline):
        s, n = tr.evaluate(tr.params, tr.feed({k: batch[k] for k in FIELDS}, False))
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)


def save(run: Run, step: int) -> None:
    """Checkpoint the adapter, the optimizer state and the data position; then the eval hook."""
    # The iterator state is taken after step's batches were drawn: a resume continues with the
    # batch that step + 1 would have seen.
    trainer = {
        "step": step,
        "seed": run.cfg.train.seed,
        "dropout_root": np.asarray(jax.random.key_data(run.dropout_root)).tolist(),
        "data": run.batches.get_state(),
    }
    adapter = nnx.state(run.trainer.params, LoRAParam)
    path = run.store.save(step, adapter, run.trainer.opt_state, trainer, {**run.meta, "step": step})
    if run.hook is not None:
        run.hook(str(path), step)


def run_sft(cfg: SFTConfig, *, progress: bool = True, out: Any = None) -> dict[str, Any]:
    """Train (or resume) the run in `cfg.output.dir`; returns the summary `--json` prints.

    Raises `NonFiniteError` at the first NaN/inf loss or gradient norm (the last good checkpoint
    is kept, that step is not saved).
    """
    out = out or sys.stdout
    require_loggers(cfg.output.loggers)  # a missing library fails before the base is loaded
    # A run that fails before its first step leaves output.dir as it found it (jaxpi.train.rundir).
    with new_paths(cfg.output.dir) as made:
        run = open_run(cfg)
        try:
            last, val_loss, tokens, seconds = _train(run, made, progress, out)
        finally:
            run.store.close()
    return summary(run, last, val_loss, tokens / seconds if seconds else None)


def _train(run: Run, made: NewPaths, progress: bool, out: Any) -> tuple[dict[str, Any], Any, float, float]:
    """Set up the base, data and trainer of an open run, then train it; `made.keep()` after the
    first step. Returns (the last step's record, the last val loss, tokens, seconds)."""
    cfg = run.cfg
    options = {"max_value": cfg.data.toy_max_value}  # what a named toy base is pre-trained on
    base_dir = prepare_base(cfg.model, run.dir, seed=cfg.train.seed, options=options)
    model_cfg = QwenConfig.from_hf(base_dir).replace(**cfg.model.overrides())
    load_data(run, base_dir, model_cfg, out)
    start_trainer(run, base_dir, model_cfg)
    if run.start:
        resume(run, out)

    t = cfg.train
    schedule = lr_schedule(cfg.optim, t.steps)
    log = MetricsLog(
        run.dir,
        start_step=run.start,
        total_steps=t.steps,
        progress=progress,
        loggers=cfg.output.loggers,
        log_every=t.log_every,
        out=out,
        config=run.config,
    )
    last: dict[str, Any] = {}
    val_loss = None
    tokens = seconds = 0.0
    t0 = time.time()
    try:
        for s in range(run.start + 1, t.steps + 1):
            t_step = time.time()
            batch = next_batch(run)
            stats = batch_stats(batch)
            loss, grad_norm = update(run, s, batch)
            dt = time.time() - t_step
            tokens, seconds = tokens + stats["tokens"], seconds + dt
            # the rate of this step's update: optax counts from 0
            last = step_record(s, loss, grad_norm, float(schedule(s - 1)), stats, dt, time.time() - t0)
            if (t.eval_every and s % t.eval_every == 0) or s == t.steps:
                val_loss = validate(run)
                if val_loss is not None:
                    last["val_loss"] = val_loss
            log.write(last)
            made.keep()
            if s % t.checkpoint_every == 0 or s == t.steps:
                save(run, s)
    finally:
        log.close()
    return last, val_loss, tokens, seconds


def step_record(
    step: int, loss: float, grad_norm: float, lr: float, stats: dict[str, float], dt: float, elapsed: float
) -> dict[str, Any]:
    """One line of `metrics.jsonl`."""
    return {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": int(stats["tokens"]),
        "supervised_tokens": int(stats["supervised_tokens"]),
        "tokens_per_s": stats["tokens"] / max(dt, 1e-9),
        "time": elapsed,
    }


def summary(
    run: Run, last: dict[str, Any], val_loss: float | None, tokens_per_s: float | None
) -> dict[str, Any]:
    """What `jaxpi sft --json` prints: the run, its last loss, its final checkpoint."""
    final = run.store.latest_step()
    return {
        "run_dir": str(run.dir),
        "steps": run.cfg.train.steps,
        "resumed_from": run.start,
        "final_loss": last.get("loss"),
        "val_loss": val_loss,
        "checkpoint": str(run.store.step_dir(final)) if final else None,
        "tokens_per_s": tokens_per_s,
    }


# ---- helpers -------------------------------------------------------------------------------------
def _load_hook(spec: str) -> Callable[[str, int], Any]:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"train.eval_hook {spec!r} cannot be loaded: {e}") from e


def _non_finite_message(step: int, loss: float, grad_norm: float, store: CheckpointStore) -> str:
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

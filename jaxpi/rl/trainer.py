"""The collection loop of effort-ordered GRPO (seed report, Algorithm 1), as `jaxpi grpo` runs it.

One iteration, with `s` the number of policy updates made so far:

    collect    tasks_s = draw(collect.tasks, seed, s); every task at every level, collect.group each,
               sampled by the rollout engine with the current adapter, scored once by the verifier
    score      rewards and advantages from this collection alone (`jaxpi.rl.reward`)
    batch      the collection as padded rows (`jaxpi.rl.batch`); logp_old = the trainer's
               log-probabilities of the sampled tokens (before the update)
    update     one optimizer step on the GRPO loss over every admitted trajectory (`jaxpi.rl.loss`);
               the new adapter into the engine (same shapes: nothing recompiles)
    evaluate   (after every train.eval_every updates, and the last) held-out tasks × levels ×
               eval_group, sampled, scored and recorded, not trained on; also before the first update
    log        one metrics record at step s + 1 (the evaluation's numbers under eval/ in it)
    checkpoint every train.checkpoint_every updates: adapter + optimizer state (orbax)

Everything random is a function of (train.seed, s): the task draw, the sampling keys, the
environment seeds. So a run killed at any point and restarted from its last checkpoint repeats
the collections after it token for token and ends in the same adapter (on CPU; GPUs need
deterministic XLA ops; what a resume may change: `jaxpi.rl.resume`). Outputs in `output.dir`:

    run.json        levels, reward, name (what `jaxpi report` needs to read the run)
    config.json     the whole config
    attempts.jsonl  one record per attempt (split train|eval, step, task, level, outcome, tokens,
                    reward, advantage); records of steps after the checkpoint are dropped on resume
    metrics.jsonl   one record per update, at the step it ends (1 .. train.collections): loss,
                    gradient norm, engine/trainer log-prob gap, importance weights, per-level
                    pass rate / reasoning tokens / admitted share, ordering ratios
                    (`jaxpi.rl.metrics`), and the evaluation after that update under eval/; the
                    evaluation before the first update is the record of step 0. The same keys
                    go to the loggers of output.loggers (TensorBoard under tb/, W&B, MLflow)
    checkpoints/N   orbax steps, exportable with `jaxpi export` like SFT checkpoints

With `collect.engine=vllm` the attempts are sampled by a vLLM server, the adapter pushed and probed
before every collection, a collection the server fails redone whole and, past
`collect.collection_retries`, the run stopped (`CollectionFailedError`, exit code 4) with its last
checkpoint intact (`jaxpi.rl.sampling`). Every attempt record carries the `policy_version`
(updates made) that sampled it; attempts more than `collect.max_staleness` versions old are not
admitted. Which non-admitted attempts `reward.malformed="fail"` scores: `jaxpi.rl.collect`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpi.atomic import write_text
from jaxpi.configfile import to_dict
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.envs.agent_loop import Trajectory
from jaxpi.rl.batch import bucket_length, trajectory_batch
from jaxpi.rl.collect import Collector, attempt_records, collection_attempts, collection_seed, draw_tasks
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.envs import env_entry
from jaxpi.rl.metrics import engine_gap_metrics, level_metrics, levels_line
from jaxpi.rl.policy import Policy, Programs, load_policy, make_programs
from jaxpi.rl.progress import CollectionProgress
from jaxpi.rl.resume import check_resume, truncate_attempts
from jaxpi.rl.reward import CollectionScore, score_collection
from jaxpi.rl.sampling import Sampler, open_engine
from jaxpi.train.checkpoint import CheckpointStore, read_meta
from jaxpi.train.loggers import require_loggers
from jaxpi.train.metrics import MetricsLog, read_jsonl
from jaxpi.train.rundir import new_paths
from jaxpi.train.schedule import lr_schedule


@dataclasses.dataclass
class Run:
    """What the steps of one run share; `start_run` builds it, `run_grpo` drives it."""

    cfg: GRPOConfig
    run_dir: Path
    out: Any
    start: int  # updates made before this process (the checkpoint resumed from)
    pol: Policy
    programs: Programs
    opt_state: Any
    ref_train: Any  # the starting policy: the KL reference when loss.kl_coef > 0
    pool: list[Any]
    held: list[Any]
    store: CheckpointStore
    sampler: Sampler
    # the adapter the next training collection is sampled by under train.async (the policy one
    # update older than `pol.train`; at a run's start, its first policy)
    sampler_adapter: Any
    attempts_file: IO[str]
    log: MetricsLog
    schedule: Any
    meta: dict[str, Any]

    def close(self) -> None:
        self.attempts_file.close()
        self.log.close()
        self.store.close()
        self.sampler.close()


def run_grpo(cfg: GRPOConfig, *, progress: bool = True, out: Any = None) -> dict[str, Any]:
    """Train (or resume) the run in `cfg.output.dir`; returns the summary `--json` prints. A run
    that fails before its first update leaves output.dir as it found it (jaxpi.train.rundir)."""
    require_loggers(cfg.output.loggers)  # a missing library fails before the policy is loaded
    summary: dict[str, Any] = {}
    with new_paths(cfg.output.dir) as made:
        run = start_run(cfg, progress=progress, out=out or sys.stdout)
        t_run = time.time()
        try:
            if run.start == 0:
                summary = evaluate(run, 0)
                if summary:
                    run.log.write({"step": 0, **summary, "time": time.time() - t_run})
            if cfg.train.async_:
                for s, collected in pipelined_collections(run):
                    summary = one_update(run, s, t_run, collected)
                    made.keep()
            else:
                for s in range(run.start, cfg.train.collections):
                    summary = one_update(run, s, t_run)
                    made.keep()
        finally:
            run.close()
    if not summary and run.log.path.exists():  # resumed after the last update: its record
        summary = (read_jsonl(run.log.path) or [{}])[-1]
    final = run.store.latest_step()
    return {
        "run_dir": str(run.run_dir),
        "collections": cfg.train.collections,
        "resumed_from": run.start,
        "checkpoint": str(run.store.step_dir(final)) if final else None,
        "last": {k: v for k, v in summary.items() if isinstance(v, (int, float))},
    }


def collection_tasks(run: Run, s: int) -> tuple[list[Any], int]:
    """The tasks and the seed of training collection `s` (functions of train.seed and s)."""
    cfg = run.cfg
    tasks = [run.pool[i] for i in draw_tasks(len(run.pool), cfg.collect.tasks, cfg.train.seed, s)]
    return tasks, collection_seed(cfg.train.seed, s, "train")


def pipelined_collections(run: Run) -> Any:
    """Asynchronous GRPO on the fleet (`train.async`): yields (s, collection s) for every update
    left, collection s + 1 handed to the fleet before update s is made, so the two overlap.

    The schedule is fixed, not a race: collection s is sampled by the policy after s - 1 updates
    (the first collection of a run by the first policy), whatever the timing, so every trained
    attempt is one version stale (the capped importance weight corrects for the gap) and a run
    resumed from the checkpoint after k updates samples collection k again with the adapter that
    checkpoint keeps for it (`sampler`), as the run it resumes did.
    """
    cfg, sampler = run.cfg, run.sampler
    if run.start >= cfg.train.collections:
        return
    sampler.collector.set_policy(max(run.start - 1, 0), run.sampler_adapter)
    handle = sampler.submit(*_submission(run, run.start))
    for s in range(run.start, cfg.train.collections):
        t0 = time.time()
        tasks, _ = collection_tasks(run, s)
        watch = collection_progress(
            run, f"collection {s + 1}/{cfg.train.collections}", len(tasks), cfg.collect.group
        )
        trajs, versions = sampler.wait(handle, s, watch)
        t_collect = time.time() - t0
        if s + 1 < cfg.train.collections:
            sampler.collector.set_policy(s, run.pol.train)  # the policy after s updates
            handle = sampler.submit(*_submission(run, s + 1))
        yield s, (trajs, versions, t_collect)


def _submission(run: Run, s: int) -> tuple[list[Any], int, int]:
    tasks, seed = collection_tasks(run, s)
    return tasks, run.cfg.collect.group, seed


def one_update(
    run: Run, s: int, t_run: float, collected: tuple[Any, Any, float] | None = None
) -> dict[str, Any]:
    """Collection `s` and the update made from it: collect → score → batch → update → evaluate
    (when due after s + 1 updates) → log → checkpoint. Returns the metrics record of step s + 1.
    `collected`: the collection already made (trajectories, versions, seconds), asynchronous GRPO."""
    cfg = run.cfg
    if collected is None:
        t0 = time.time()
        tasks, seed = collection_tasks(run, s)
        watch = collection_progress(
            run, f"collection {s + 1}/{cfg.train.collections}", len(tasks), cfg.collect.group
        )
        trajs, versions = run.sampler.collect("train", s, tasks, cfg.collect.group, seed, watch)
        t_collect = time.time() - t0
    else:
        trajs, versions, t_collect = collected
    score = score_and_record(run, "train", s, trajs, versions)
    t1 = time.time()
    batch = make_batch(run, trajs, score)
    gap = engine_gap_metrics(batch["logp_old"], batch["logp_engine"], batch["loss_mask"], cfg.loss.is_cap)
    # Asynchronous GRPO samples collection s + 1 with the policy before this update: the
    # checkpoint after it keeps that adapter for a resume.
    run.sampler_adapter = run.pol.train
    loss, grad_norm = update(run, batch, s)
    t_update = time.time() - t1
    # Engine failures and probes of this update's collection (an evaluation's go in the next record).
    pending = run.sampler.take_pending()
    k = cfg.train.eval_every
    eval_metrics = evaluate(run, s + 1) if s + 1 == cfg.train.collections or (k and (s + 1) % k == 0) else {}
    sampled = sum(t.output_tokens for t in trajs)
    rec = {
        "step": s + 1,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(run.schedule(s)),
        "attempts": len(trajs),
        "admitted": sum(t.admitted for t in trajs),
        "scored": int(score.scored.sum()),
        "sampled_tokens": sampled,
        "row_length": batch["input_ids"].shape[1],
        "collect_s": t_collect,
        "update_s": t_update,
        "tokens_per_s": sampled / max(t_collect, 1e-9),
        "time": time.time() - t_run,
        **staleness_metrics(versions, s),
        **gap,
        **level_metrics("", trajs, score, cfg.reward.levels),
        **eval_metrics,
        **pending,
    }
    log_update(run, rec, t_collect, t_update)
    checkpoint(run, s + 1)
    return rec


def staleness_metrics(versions: list[int], current: int) -> dict[str, float]:
    """How many updates old the policy behind each attempt of the collection trained at update
    `current` was: a histogram (`staleness/<k>`) and the largest."""
    ages = [current - int(v) for v in versions]
    out = {f"staleness/{k}": float(ages.count(k)) for k in sorted(set(ages))}
    return {**out, "staleness/max": float(max(ages, default=0))}


def evaluate(run: Run, step: int) -> dict[str, float]:
    """The held-out collection after `step` updates: recorded, scored, not trained on."""
    cfg = run.cfg
    if not run.held or not cfg.train.eval_group:
        return {}
    seed = collection_seed(cfg.train.seed, step, "eval")
    watch = collection_progress(run, f"eval after {step} updates", len(run.held), cfg.train.eval_group)
    trajs, versions = run.sampler.collect("eval", step, run.held, cfg.train.eval_group, seed, watch)
    score = score_and_record(run, "eval", step, trajs, versions)
    m = level_metrics("eval/", trajs, score, cfg.reward.levels)
    run.log.message(f"eval   after {step:4d} updates: {levels_line(m, cfg.reward.levels, 'eval/')}")
    return m


def collection_progress(run: Run, label: str, tasks: int, group: int) -> CollectionProgress:
    """The progress of a collection of `tasks` tasks x levels x `group`, to the console."""
    scheduled = tasks * len(run.cfg.reward.levels) * group
    return CollectionProgress(label, scheduled, run.log.status, run.cfg.train.collection_log_s)


def score_and_record(
    run: Run, split: str, step: int, trajs: list[Trajectory], versions: list[int]
) -> CollectionScore:
    """Rewards and advantages of one collection, its attempts appended to attempts.jsonl."""
    attempts = collection_attempts(trajs, versions, step, run.cfg.collect.max_staleness)
    score = score_collection(attempts, run.cfg.reward)
    for rec in attempt_records(split, step, trajs, score, versions):
        run.attempts_file.write(json.dumps(rec) + "\n")
    run.attempts_file.flush()
    return score


def make_batch(run: Run, trajs: list[Trajectory], score: CollectionScore) -> dict[str, np.ndarray]:
    """The collection as padded rows (`jaxpi.rl.batch`) with the trainer's log-probabilities of
    them before the update (and the reference policy's, for the KL term)."""
    c = run.cfg.collect
    length = bucket_length(max(len(t.token_ids) for t in trajs), c.row_bucket, c.max_context)
    # Rows trained on: the admitted attempts, plus malformed ones scored as failures.
    batch = trajectory_batch(
        trajs, score.advantages, length=length, rows=run.cfg.rows, supervised=score.scored
    )
    batch["logp_old"] = logprobs(run, run.pol.train, batch["input_ids"])
    if run.cfg.loss.kl_coef > 0:
        batch["logp_ref"] = logprobs(run, run.ref_train, batch["input_ids"])
    return batch


def logprobs(run: Run, train: Any, ids: np.ndarray) -> np.ndarray:
    """[N, L] log-probabilities of `ids` under `train`, in the update's microbatches (the trainer
    never holds more activations than an update does)."""
    k = run.cfg.train.grad_accum
    parts = [np.asarray(run.programs.logp(train, run.pol.rest, jnp.asarray(ids[j::k]))) for j in range(k)]
    full = np.zeros(ids.shape, np.float32)
    for j in range(k):
        full[j::k] = parts[j]
    return full


def update(run: Run, batch: dict[str, np.ndarray], s: int) -> tuple[float, float]:
    """One optimizer step on the batch, the new adapters into the engine; (loss, gradient norm)."""
    device_batch = {n: jnp.asarray(v) for n, v in batch.items()}
    run.pol.train, run.opt_state, m = run.programs.update(
        run.pol.train, run.pol.rest, run.opt_state, device_batch
    )
    loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        raise FloatingPointError(
            f"non-finite GRPO loss/gradient norm at update {s + 1} ({loss}, {grad_norm}); "
            f"the last checkpoint is step {run.store.latest_step()}"
        )
    run.sampler.updated(s + 1)
    return loss, grad_norm


def log_update(run: Run, rec: dict[str, Any], t_collect: float, t_update: float) -> None:
    """The record to metrics.jsonl and the loggers; the console line every train.log_every updates."""
    detail = (
        f"{levels_line(rec, run.cfg.reward.levels, '')} | {t_collect:.1f}s collect, {t_update:.1f}s update"
    )
    run.log.write(rec, detail)


def checkpoint(run: Run, step: int) -> None:
    """Adapter + optimizer state after `step` updates, every train.checkpoint_every and at the end."""
    cfg = run.cfg
    if step % cfg.train.checkpoint_every == 0 or step == cfg.train.collections:
        trainer_state = {"step": step, "seed": cfg.train.seed}
        sampler = run.sampler_adapter if cfg.train.async_ else None
        run.store.save(step, run.pol.train, run.opt_state, trainer_state, {**run.meta, "step": step}, sampler)


# ---- start-up ------------------------------------------------------------------------------------
def start_run(cfg: GRPOConfig, *, progress: bool, out: Any) -> Run:
    """The run directory (checked against a checkpoint's config when resuming), the policy and its
    programs (restored from the latest checkpoint), the environment, the engine and collector."""
    run_dir = Path(cfg.output.dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(run_dir, keep=cfg.train.keep_checkpoints)
    start = store.latest_step() or 0
    config_dict = to_dict(cfg)
    try:
        if start:
            check_resume(run_dir, read_meta(store.step_dir(start))["config"], config_dict)
        return _open(cfg, run_dir, store, start, config_dict, progress, out)
    except BaseException:
        store.close()  # an open manager outlives the error otherwise (and its directory, removed)
        raise


def _open(
    cfg: GRPOConfig,
    run_dir: Path,
    store: CheckpointStore,
    start: int,
    config_dict: dict[str, Any],
    progress: bool,
    out: Any,
) -> Run:
    """`start_run` past the checkpoint store: everything that may fail once the store is open."""
    write_text(run_dir / "config.json", json.dumps(config_dict, indent=2))
    run_info = {
        "name": cfg.output.name or run_dir.name,
        "levels": list(cfg.reward.levels),
        "reward": to_dict(cfg.reward),
        "env": cfg.env.name,
    }
    write_text(run_dir / "run.json", json.dumps(run_info, indent=2))

    pol = load_policy(cfg, run_dir, jax.random.fold_in(jax.random.key(cfg.train.seed), 1))
    tok = load_tokenizer(pol.tokenizer_dir)
    render_cfg = RenderConfig(tokenizer_dir=str(pol.tokenizer_dir))
    missing = [lv for lv in cfg.reward.levels if lv not in render_cfg.efforts]
    if missing:
        raise ValueError(
            f"reward.levels {missing} have no effort style (known: {sorted(render_cfg.efforts)})"
        )
    entry = env_entry(cfg.env.name)
    env, pool, held = entry.make(cfg)

    programs = make_programs(cfg, pol.graphdef)
    opt_state = jax.jit(programs.optimizer.init)(pol.train)
    # Committed to the device, as restored arrays are: a fresh and a resumed run then trace the
    # same programs, and the resumed one loads them from the compilation cache (an uncommitted or
    # numpy argument lowers without a sharding, a committed one with it).
    pol.train, opt_state = jax.device_put((pol.train, opt_state), jax.devices()[0])
    ref_train = pol.train
    sampler_adapter = pol.train
    if start:
        restored = store.restore(start, pol.train, opt_state)
        pol.train, opt_state = restored.adapter, restored.opt_state
        if cfg.train.async_ and restored.sampler is None:
            raise ValueError(
                f"{store.step_dir(start)} keeps no sampler adapter: it was not written by a train.async run"
            )
        sampler_adapter = restored.sampler if restored.sampler is not None else pol.train
        if restored.trainer.get("seed") != cfg.train.seed:
            raise ValueError("the checkpoint's train.seed does not match the config")
        print(f"resumed from {store.step_dir(start)} (after update {start})", file=out, flush=True)

    if cfg.collect.backend == "ray":
        # The fleet's workers sample with engines of their own: the trainer builds none.
        engine, backend = None, None
        collector = entry.fleet(
            cfg, pol, tok, env, render_cfg, start, lambda m: print(m, file=out, flush=True)
        )
    else:
        engine, backend = open_engine(cfg, pol, run_dir, out)
        try:
            collector = (entry.collector or Collector)(cfg, engine, tok, env, render_cfg)
        except BaseException:
            if backend is not None:  # a vLLM server started for this run
                backend.close()
            raise
    sampler = Sampler(cfg, pol, programs.logp, engine, backend, collector, run_dir, store, out)
    attempts_path = run_dir / "attempts.jsonl"
    truncate_attempts(attempts_path, start)
    meta = {
        "base": str(pol.base_dir),
        "model_config": pol.model_cfg.to_hf(),
        "lora": to_dict(pol.lora),
        "dtype": cfg.model.dtype,
        "tokenizer": str(pol.tokenizer_dir),
        "config": config_dict,
        "kind": "grpo",
    }
    log = MetricsLog(
        run_dir,
        start_step=start,
        total_steps=cfg.train.collections,
        progress=progress,
        loggers=cfg.output.loggers,
        log_every=cfg.train.log_every,
        out=out,
        name=cfg.output.name,
        config=config_dict,
    )
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        out=out,
        start=start,
        pol=pol,
        programs=programs,
        opt_state=opt_state,
        ref_train=ref_train,
        pool=pool,
        held=held,
        store=store,
        sampler=sampler,
        sampler_adapter=sampler_adapter,
        attempts_file=attempts_path.open("a"),
        log=log,
        schedule=lr_schedule(cfg.optim, cfg.train.collections),
        meta=meta,
    )

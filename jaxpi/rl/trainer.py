"""`jaxpi grpo`: the collection loop of effort-ordered GRPO (seed report, Algorithm 1).

One iteration, with `s` the number of policy updates made so far:

    evaluate   (s = 0, every train.eval_every, and at the end) held-out tasks × levels × eval_group
    collect    tasks_s = draw(collect.tasks, seed, s); every task at every level, collect.group each,
               sampled by the rollout engine with the current adapter, scored once by the verifier
    score      rewards and advantages from this collection alone (`jaxpi.rl.reward`)
    update     logp_old = the trainer's log-probabilities of the sampled tokens (before the update);
               one optimizer step on the GRPO loss over every admitted trajectory (`jaxpi.rl.loss`)
    push       the new adapter into the engine (same shapes: nothing recompiles)
    save       every train.checkpoint_every updates: adapter + optimizer state (orbax)

Everything random is a function of (train.seed, s): the task draw, the sampling keys, the
environment seeds. So a run killed at any point and restarted from its last checkpoint repeats
the collections after it token for token and ends in the same adapter (on CPU; GPUs need
deterministic XLA ops). Outputs in `output.dir`:

    run.json        levels, reward, name (what `jaxpi report` needs to read the run)
    config.json     the whole config
    attempts.jsonl  one record per attempt (split train|eval, step, task, level, outcome, tokens,
                    reward, advantage); records of steps after the checkpoint are dropped on resume
    metrics.jsonl   one record per update: loss, gradient norm, engine/trainer log-prob gap,
                    importance weights, per-level pass rate / reasoning tokens / admitted share,
                    ordering ratios (also to TensorBoard under tb/)
    checkpoints/N   orbax steps, exportable with `jaxpi export` like SFT checkpoints

With `collect.engine=vllm` the attempts are sampled by a vLLM server (`jaxpi.vllm`): after every
update the adapter is exported to `vllm_adapters/policy-v{N}`, loaded into the server and probed
(vLLM's log-probs of a fixed sequence must match the trainer's for the same adapter) before the
next collection. A collection the server fails (down, killed, timing out, replying nonsense) is
discarded whole, before any update, its lost attempts logged to `failures.jsonl` with the reason
and counted in the next metrics record; it is redone up to `collect.collection_retries` times, then
the run stops (`CollectionFailedError`, exit code 4) with its last checkpoint intact. Every attempt
record carries the `policy_version` (updates made) that sampled it; attempts more than
`collect.max_staleness` versions old are not admitted.

Which non-admitted attempts `reward.malformed="fail"` scores as failures (`collection_attempts`):
only those the agent loop ended as "malformed" (a turn whose tool call, answer or thinking block
did not parse: the model's own output broke the format) and that are not stale. Attempts cut by
the budgets ("length", "max_turns", "max_tokens") are admitted failures already, under both
settings. Left out under both: stale attempts (sampled by a policy the ratio no longer fits),
collections lost to engine failures (discarded whole, never scored), and attempts the Pi runner
did not admit (timeout, sandbox limit, upstream / verifier / Pi errors, split samples), whose
end the model did not decide.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.configfile import load_config, to_dict
from jaxpi.rl.config import CollectConfig, GRPOConfig

# collect.* fields that only say how to reach the rollout server: a resumed run may change them
# (a restarted server has another address).
RESUME_FREE = (
    "vllm_url",
    "vllm_concurrency",
    "request_timeout_s",
    "request_retries",
    "collection_retries",
    "retry_wait_s",
    "probe_tol",
)
# Sections that define what a checkpoint means: a resumed run must not change them.
FIXED_ON_RESUME = (
    "model",
    "lora",
    "env",
    *(f"collect.{f.name}" for f in dataclasses.fields(CollectConfig) if f.name not in RESUME_FREE),
    "reward",
    "loss",
    "optim",
    "train.collections",
    "train.seed",
    "train.grad_accum",
    "train.eval_every",
    "train.eval_group",
)
SPLITS = ("train", "eval")


class CollectionFailedError(RuntimeError):
    """The rollout engine failed a collection more often than `collect.collection_retries` allows."""


# ---- pure helpers --------------------------------------------------------------------------------
def collection_seed(seed: int, step: int, split: str) -> int:
    """A 31-bit seed for (run seed, update count, split): sampling keys, environment seeds."""
    return int(np.random.SeedSequence([seed, step, SPLITS.index(split)]).generate_state(1)[0] >> 1)


def draw_tasks(n_pool: int, n: int, seed: int, step: int) -> list[int]:
    """Indices of the tasks of collection `step`: n distinct tasks of the pool, a function of (seed, step)."""
    rng = np.random.default_rng([seed, step, 7])
    return sorted(rng.choice(n_pool, size=n, replace=False).tolist())


def changed_keys(saved: dict[str, Any], current: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """Dotted keys (sections or `section.field`) whose values differ between two config dicts."""
    diffs = []
    for key in keys:
        section, _, field = key.partition(".")
        a, b = saved.get(section, {}), current.get(section, {})
        if (a.get(field) if field else a) != (b.get(field) if field else b):
            diffs.append(key)
    return diffs


def with_later_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved config with the fields added since filled in by their defaults (the
    engine settings collect.*, reward.malformed, ...): a field is added with a default that keeps
    the old behaviour, so the older run behaved as that default does and may resume under it."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for section, fields in to_dict(GRPOConfig()).items():
        for key, value in fields.items():
            out.setdefault(section, {}).setdefault(key, value)
    return out


def attempt_records(
    split: str,
    step: int,
    trajectories: Sequence[Any],
    score: Any,
    policy_versions: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The attempts.jsonl lines of one collection (`jaxpi report` reads them); `policy_versions`
    (default: `step` for every attempt) is the number of updates behind the policy that sampled each."""
    out = []
    versions = [step] * len(trajectories) if policy_versions is None else list(policy_versions)
    for t, r, a, v, s in zip(
        trajectories, score.rewards, score.advantages, versions, score.scored, strict=True
    ):
        out.append(
            {
                "split": split,
                "step": step,
                "collection": step,
                "task_id": t.task_id,
                "level": t.level,
                "attempt_id": t.attempt_id,
                "admitted": t.admitted,
                "success": t.success,
                "reasoning_tokens": t.reasoning_tokens,
                "output_tokens": t.output_tokens,
                "turns": t.turns,
                "finish_reason": t.finish_reason,
                "reason": t.reason,
                "reward": float(r),
                "advantage": float(a),
                "policy_version": int(v),
                "scored": bool(s),
            }
        )
    return out


def collection_attempts(
    trajectories: Sequence[Any], versions: Sequence[int], current: int, max_staleness: int
) -> list[Any]:
    """The reward module's records of one collection: `malformed` set on the non-admitted attempts
    the agent loop ended as "malformed" that are not stale (the module docstring says why only
    those); `reward.malformed` then decides whether they count as failures."""
    from jaxpi.rl.reward import Attempt
    from jaxpi.vllm.sync import stale

    out: list[Attempt] = []
    for t, old in zip(trajectories, stale(versions, current, max_staleness), strict=True):
        a = t.to_attempt()
        if not a.admitted and t.finish_reason == "malformed" and not old:
            a = dataclasses.replace(a, malformed=True)
        out.append(a)
    return out


def level_metrics(
    prefix: str, trajectories: Sequence[Any], score: Any, levels: Sequence[str]
) -> dict[str, float]:
    """Per-level scalars of one collection: the reward module's summary plus the admitted share
    and reasoning tokens per turn, under `prefix` ("" for training, "eval/" for evaluation)."""
    out = {f"{prefix}{k}": v for k, v in score.metrics().items()}
    for level in levels:
        mine = [t for t in trajectories if t.level == level]
        kept = [t for t in mine if t.admitted]
        if mine:
            out[f"{prefix}level/{level}/admitted_share"] = len(kept) / len(mine)
        if kept:
            out[f"{prefix}level/{level}/reasoning_per_turn"] = float(
                np.mean([t.reasoning_tokens / max(t.turns, 1) for t in kept])
            )
    return out


def engine_gap_metrics(
    logp_old: np.ndarray, logp_engine: np.ndarray, mask: np.ndarray, cap: float | None
) -> dict[str, float]:
    """Trainer-vs-engine log-prob gap and the importance weights the loss will use, on the
    supervised tokens (the loss's own view of them, before the update)."""
    on = mask[:, 1:] > 0
    if not on.any():
        return {}
    diff = (logp_old[:, 1:] - logp_engine[:, 1:])[on]
    w = np.exp(diff)
    out = {
        "logp_diff_mean": float(np.mean(np.abs(diff))),
        "logp_diff_max": float(np.max(np.abs(diff))),
        "is_weight_mean": float(np.mean(np.minimum(w, cap) if cap else w)),
        "is_weight_max": float(np.max(np.minimum(w, cap) if cap else w)),
    }
    if cap:
        out["is_capped_frac"] = float(np.mean(w > cap))
    return out


# ---- I/O -----------------------------------------------------------------------------------------
def _write_atomic(path: Path, text: str) -> None:
    from jaxpi.atomic import write_text  # cleans the temporary file a killed run left

    write_text(path, text)


def truncate_attempts(path: Path, keep_below: int) -> int:
    """Keep the records of steps < keep_below (a resumed run redoes the rest); drop a torn last
    line. Returns the number kept."""
    if not path.exists():
        return 0
    kept = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a kill mid-write tears only the last line
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
        if rec["step"] < keep_below:
            kept.append(line)
    _write_atomic(path, "".join(x + "\n" for x in kept))
    return len(kept)


# ---- the run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Policy:
    """The trainable adapters, the frozen rest, and what a run needs around them."""

    graphdef: Any
    train: Any  # nnx.State of LoRAParam
    rest: Any  # frozen base weights (shared with the engine, never copied)
    lora: Any  # LoraConfig
    base_dir: Path
    tokenizer_dir: Path
    model_cfg: Any  # QwenConfig


def load_policy(cfg: GRPOConfig, run_dir: Path, key: Any) -> Policy:
    """Base + adapters: from `model.adapter` (an SFT checkpoint) or fresh ones on `model.base`."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxpi.convert.hf import load_hf
    from jaxpi.lora import LoRAParam, add_lora
    from jaxpi.train.base import prepare_base
    from jaxpi.train.checkpoint import load_adapter
    from jaxpi.train.step import split_trainable

    adapter = None
    base_options = {"max_value": cfg.env.max_value}  # the toy bases' values (jaxpi.bases entry points)
    if cfg.model.adapter and (Path(cfg.model.adapter) / "adapter_config.json").exists():
        # A peft adapter (e.g. trained with peft/TRL) on `model.base`: its own rank and targets.
        from jaxpi.config import QwenConfig
        from jaxpi.convert.peft import load_peft

        base_dir = prepare_base(cfg.model, run_dir, seed=cfg.train.seed, options=base_options)
        lora_cfg, adapter = load_peft(QwenConfig.from_hf(base_dir), cfg.model.adapter)
        tokenizer_dir = base_dir
    elif cfg.model.adapter:
        adapter, lora_cfg, meta = load_adapter(cfg.model.adapter)
        base_dir = Path(meta["base"])
        tokenizer_dir = Path(meta.get("tokenizer") or base_dir)
    else:
        base_dir = prepare_base(cfg.model, run_dir, seed=cfg.train.seed, options=base_options)
        lora_cfg, tokenizer_dir = cfg.lora, base_dir
    model_cfg, model = load_hf(base_dir, jnp.dtype(cfg.model.dtype), config_overrides=cfg.model.overrides())
    add_lora(model, lora_cfg, key=key)
    if adapter is not None:
        nnx.update(model, adapter)
    graphdef, params = nnx.split(model)
    train, rest = split_trainable(params, LoRAParam)
    return Policy(graphdef, train, rest, lora_cfg, base_dir, tokenizer_dir, model_cfg)


def admit_fresh(
    trajectories: Sequence[Any], versions: Sequence[int], current: int, max_staleness: int
) -> list[Any]:
    """Attempts sampled by a policy more than `max_staleness` updates older than `current` become
    not admitted (marked malformed, with the reason): GRPO's ratio assumes a recent sampler."""
    from jaxpi.vllm.sync import stale

    out = []
    for t, v, old in zip(trajectories, versions, stale(versions, current, max_staleness), strict=True):
        if old and t.admitted:
            reason = f"stale: sampled by policy v{v}, {current - v} updates old (collect.max_staleness={max_staleness})"
            t = dataclasses.replace(t, malformed=True, reason=reason)
        out.append(t)
    return out


@dataclasses.dataclass(frozen=True)
class EnvEntry:
    """How the trainer gets an environment: `make(cfg) -> (env, task pool, held-out tasks)`, and
    optionally its own collector class (same constructor and `run` as `Collector`)."""

    make: Any
    collector: Any = None


_ENVS: dict[str, EnvEntry] = {}
# Environments living in other packages register themselves when this module is imported.
_ENV_MODULES = {"pi": "jaxpi.runner.grpo"}


def register_env(name: str, make: Any, collector: Any = None) -> None:
    """Make `env.name: <name>` available to `jaxpi grpo` (the Pi runner calls this for "pi")."""
    _ENVS[name] = EnvEntry(make, collector)


def env_entry(name: str) -> EnvEntry:
    if name not in _ENVS and name in _ENV_MODULES:
        import importlib

        try:
            importlib.import_module(_ENV_MODULES[name])
        except ImportError as e:
            raise ValueError(f"env.name {name!r} needs {_ENV_MODULES[name]} ({e})") from None
    if name not in _ENVS:
        raise ValueError(f"unknown env.name {name!r}; registered: {sorted(_ENVS)}")
    return _ENVS[name]


def _make_lookup(cfg: GRPOConfig) -> tuple[Any, list[Any], list[Any]]:
    from jaxpi.envs.toy import LookupEnv, make_tasks

    e = cfg.env
    kw = {"keys_per_task": e.keys_per_task, "max_value": e.max_value}
    pool = make_tasks(e.train_tasks, e.seed, **kw)
    held = make_tasks(e.eval_tasks, e.seed + 1_000_003, **kw)
    return LookupEnv(), pool, held


register_env("lookup", _make_lookup)


def make_env(cfg: GRPOConfig) -> tuple[Any, list[Any], list[Any]]:
    """(environment, training task pool, held-out tasks)."""
    return env_entry(cfg.env.name).make(cfg)


class Collector:
    """Runs (task, level) attempts on the engine in waves of at most `engine_batch` sessions."""

    def __init__(self, cfg: GRPOConfig, engine: Any, tokenizer: Any, env: Any, render_cfg: Any) -> None:
        self.cfg, self.engine, self.tok, self.env, self.render_cfg = cfg, engine, tokenizer, env, render_cfg
        self.versions: list[int | None] = []  # policy version of each attempt of the last `run`

    def run(self, tasks: Sequence[Any], group: int, seed: int) -> list[Any]:
        from jaxpi.envs.agent_loop import run_attempts
        from jaxpi.rollout.engine import SamplingParams

        c = self.cfg.collect
        pairs = [(t, level) for t in tasks for level in self.cfg.reward.levels for _ in range(group)]
        wave = min(len(pairs), c.engine_batch or self.engine.batch_size)
        out: list[Any] = []
        self.versions = []
        for start in range(0, len(pairs), wave):
            # Seeds follow the attempt's index in the collection, not the wave layout's.
            params = SamplingParams(
                temperature=c.temperature,
                top_p=c.top_p,
                max_new_tokens=c.max_new_tokens,
                seed=seed + 104_729 * start,
            )
            out += run_attempts(
                self.engine,
                self.tok,
                pairs[start : start + wave],
                params,
                env=self.env,
                render_cfg=self.render_cfg,
                max_turns=c.max_turns,
                max_tokens=c.max_tokens,
                max_context=c.max_context,
                seed=seed + start,
            )
            # None: the engine does not track versions (JaxEngine holds the current policy by construction).
            self.versions += [getattr(self.engine, "policy_version", None)] * (len(out) - len(self.versions))
        return out


def run_grpo(cfg: GRPOConfig, *, progress: bool = True, out: Any = None) -> dict[str, Any]:
    """Train (or resume) the run in `cfg.output.dir`; returns the summary `--json` prints."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpi.data.render import RenderConfig, load_tokenizer
    from jaxpi.lora import LoRAParam
    from jaxpi.rl.batch import bucket_length, trajectory_batch
    from jaxpi.rl.loss import make_grpo_loss_fn, sequence_logprobs, trajectory_weights
    from jaxpi.rl.reward import score_collection
    from jaxpi.rollout.jax_engine import JaxEngine
    from jaxpi.train.checkpoint import CheckpointStore
    from jaxpi.train.metrics import MetricsLog
    from jaxpi.train.schedule import lr_schedule, make_optimizer
    from jaxpi.train.step import make_train_step, split_trainable

    out = out or sys.stdout
    run_dir = Path(cfg.output.dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore(run_dir, keep=cfg.train.keep_checkpoints)
    start = store.latest_step() or 0
    config_dict = to_dict(cfg)
    if start:
        from jaxpi.train.checkpoint import read_meta

        saved = with_later_defaults(read_meta(store.step_dir(start))["config"])
        diffs = changed_keys(saved, config_dict, FIXED_ON_RESUME)
        if diffs:
            raise ValueError(
                f"{run_dir} holds a run with a different {', '.join(diffs)}; "
                "resume with the same settings or choose another output.dir"
            )
    _write_atomic(run_dir / "config.json", json.dumps(config_dict, indent=2))
    name = cfg.output.name or run_dir.name
    run_info = {
        "name": name,
        "levels": list(cfg.reward.levels),
        "reward": to_dict(cfg.reward),
        "env": cfg.env.name,
    }
    _write_atomic(run_dir / "run.json", json.dumps(run_info, indent=2))

    root = jax.random.key(cfg.train.seed)
    pol = load_policy(cfg, run_dir, jax.random.fold_in(root, 1))
    tok = load_tokenizer(pol.tokenizer_dir)
    render_cfg = RenderConfig(tokenizer_dir=str(pol.tokenizer_dir))
    missing = [lv for lv in cfg.reward.levels if lv not in render_cfg.efforts]
    if missing:
        raise ValueError(
            f"reward.levels {missing} have no effort style (known: {sorted(render_cfg.efforts)})"
        )
    entry = env_entry(cfg.env.name)
    env, pool, held = entry.make(cfg)

    optimizer = make_optimizer(cfg.optim, cfg.train.collections)
    graphdef = pol.graphdef
    step_fn = make_train_step(
        graphdef,
        optimizer,
        loss_fn=make_grpo_loss_fn(cfg.loss),
        trainable=LoRAParam,
        accum_steps=cfg.train.grad_accum,
        weight_fn=trajectory_weights,
    )

    def update(train: Any, rest: Any, opt_state: Any, batch: dict[str, Any]) -> tuple[Any, Any, Any]:
        # Only the adapters and their optimizer state come back: the frozen weights stay the very
        # arrays the engine reads (no copy of the base per update).
        params, opt_state, metrics = step_fn(nnx.merge_state(train, rest), opt_state, batch)
        return split_trainable(params, LoRAParam)[0], opt_state, metrics

    update = jax.jit(update, donate_argnums=(2,))
    logp_fn = jax.jit(lambda train, rest, ids: sequence_logprobs(nnx.merge(graphdef, train, rest), ids))
    opt_state = jax.jit(optimizer.init)(pol.train)
    # Committed to the device, as restored arrays are: a fresh and a resumed run then trace the
    # same programs, and the resumed one loads them from the compilation cache (an uncommitted or
    # numpy argument lowers without a sharding, a committed one with it).
    pol.train, opt_state = jax.device_put((pol.train, opt_state), jax.devices()[0])
    ref_train = pol.train  # the starting policy: the KL reference when loss.kl_coef > 0

    if start:
        restored = store.restore(start, pol.train, opt_state)
        pol.train, opt_state = restored.adapter, restored.opt_state
        if restored.trainer.get("seed") != cfg.train.seed:
            raise ValueError("the checkpoint's train.seed does not match the config")
        print(f"resumed from {store.step_dir(start)} (after update {start})", file=out, flush=True)

    backend = None
    if cfg.collect.engine == "vllm":
        backend = _start_vllm(cfg, pol, run_dir, out)
        engine = backend.engine
    else:
        engine = JaxEngine(
            nnx.merge(graphdef, pol.train, pol.rest),
            max_len=cfg.collect.max_context,
            batch_size=cfg.collect.engine_batch or cfg.rows,
        )
    collector = (entry.collector or Collector)(cfg, engine, tok, env, render_cfg)
    attempts_path = run_dir / "attempts.jsonl"
    truncate_attempts(attempts_path, start)
    attempts_file = attempts_path.open("a")
    meta = {
        "base": str(pol.base_dir),
        "model_config": pol.model_cfg.to_hf(),
        "lora": to_dict(pol.lora),
        "dtype": cfg.model.dtype,
        "tokenizer": str(pol.tokenizer_dir),
        "config": config_dict,
        "kind": "grpo",
    }
    schedule = lr_schedule(cfg.optim, cfg.train.collections)
    log = MetricsLog(
        run_dir,
        start_step=start,
        total_steps=cfg.train.collections,
        progress=progress,
        tensorboard=cfg.output.tensorboard,
    )
    rows, k = cfg.rows, cfg.train.grad_accum
    levels = cfg.reward.levels

    def record(split: str, step: int, trajs: list[Any], score: Any, versions: list[int]) -> None:
        for rec in attempt_records(split, step, trajs, score, versions):
            attempts_file.write(json.dumps(rec) + "\n")
        attempts_file.flush()

    failures_path = run_dir / "failures.jsonl"
    pending: dict[str, float] = {}  # engine failures and probe results, for the next metrics record
    probe_state: dict[str, Any] = {}

    def push(version: int) -> None:
        """Export + load + probe the current adapter as `version` (vLLM only; once per version)."""
        if backend is None or probe_state.get("version") == version:
            return
        if "base" not in probe_state:
            ids = np.asarray([backend.probe_ids()], np.int32)
            zero = jax.tree.map(jnp.zeros_like, pol.train)
            probe_state["ids"] = ids
            probe_state["base"] = np.asarray(logp_fn(zero, pol.rest, jnp.asarray(ids)))[0, 1:]
        expected = np.asarray(logp_fn(pol.train, pol.rest, jnp.asarray(probe_state["ids"])))[0, 1:]
        res = backend.push(nnx.merge(graphdef, pol.train, pol.rest), version, expected, probe_state["base"])
        pending.update(res.metrics())
        with (run_dir / "probes.jsonl").open("a") as f:
            f.write(json.dumps({**dataclasses.asdict(res), "time": time.time()}) + "\n")
        probe_state["version"] = version

    def collect(
        split: str, step: int, tasks: list[Any], group: int, seed: int
    ) -> tuple[list[Any], list[int]]:
        """One collection, redone whole after an engine failure (nothing of a failed try is kept)."""
        from jaxpi.vllm.rollouts import RECOVERABLE

        tries = cfg.collect.collection_retries + 1
        for attempt in range(tries):
            try:
                push(step)
                trajs = collector.run(tasks, group, seed)
                versions = [step if v is None else v for v in collector.versions] or [step] * len(trajs)
                return admit_fresh(trajs, versions, step, cfg.collect.max_staleness), versions
            except RECOVERABLE as e:
                kind = getattr(e, "kind", "server")
                lost = len(tasks) * len(levels) * group
                with failures_path.open("a") as f:
                    f.write(
                        json.dumps(
                            {
                                "split": split,
                                "step": step,
                                "try": attempt + 1,
                                "kind": kind,
                                "lost_attempts": lost,
                                "error": str(e)[:2000],
                                "time": time.time(),
                            }
                        )
                        + "\n"
                    )
                pending[f"engine/failures/{kind}"] = pending.get(f"engine/failures/{kind}", 0) + 1
                pending["engine/lost_attempts"] = pending.get("engine/lost_attempts", 0) + lost
                print(
                    f"{split} collection at update {step}: engine failure ({e}); {lost} attempts not admitted "
                    f"(try {attempt + 1}/{tries})",
                    file=out,
                    flush=True,
                )
                if attempt + 1 == tries:
                    raise CollectionFailedError(
                        f"the {split} collection after update {step} failed {tries} times (last: {e}); no update "
                        f"was made from it. The last checkpoint is step {store.latest_step() or 0} in {run_dir}; "
                        "bring the rollout server back and rerun the same command to resume. Failures are "
                        f"logged in {failures_path}"
                    ) from e
                probe_state.pop("version", None)
                try:
                    backend.recover() if backend is not None else None
                except RECOVERABLE as e2:
                    print(f"recovery failed: {e2}", file=out, flush=True)
        raise AssertionError("unreachable")

    def evaluate(step: int) -> dict[str, float]:
        if not held or not cfg.train.eval_group:
            return {}
        trajs, versions = collect(
            "eval", step, held, cfg.train.eval_group, collection_seed(cfg.train.seed, step, "eval")
        )
        attempts = collection_attempts(trajs, versions, step, cfg.collect.max_staleness)
        score = score_collection(attempts, cfg.reward)
        record("eval", step, trajs, score, versions)
        m = level_metrics("eval/", trajs, score, levels)
        print(f"eval   after {step:4d} updates: {_levels_line(m, levels, 'eval/')}", file=out, flush=True)
        return m

    def logprobs(train: Any, ids: np.ndarray) -> np.ndarray:
        # In the step's microbatches: the trainer never holds more activations than an update does.
        parts = [np.asarray(logp_fn(train, pol.rest, jnp.asarray(ids[j::k]))) for j in range(k)]
        full = np.zeros(ids.shape, np.float32)
        for j in range(k):
            full[j::k] = parts[j]
        return full

    summary: dict[str, Any] = {}
    t_run = time.time()
    try:
        for s in range(start, cfg.train.collections):
            eval_metrics = (
                evaluate(s) if s == 0 or (cfg.train.eval_every and s % cfg.train.eval_every == 0) else {}
            )
            t0 = time.time()
            tasks = [pool[i] for i in draw_tasks(len(pool), cfg.collect.tasks, cfg.train.seed, s)]
            trajs, versions = collect(
                "train", s, tasks, cfg.collect.group, collection_seed(cfg.train.seed, s, "train")
            )
            t_collect = time.time() - t0
            attempts = collection_attempts(trajs, versions, s, cfg.collect.max_staleness)
            score = score_collection(attempts, cfg.reward)
            record("train", s, trajs, score, versions)

            t1 = time.time()
            length = bucket_length(
                max(len(t.token_ids) for t in trajs), cfg.collect.row_bucket, cfg.collect.max_context
            )
            # Rows trained on: the admitted attempts, plus malformed ones scored as failures.
            batch = trajectory_batch(
                trajs, score.advantages, length=length, rows=rows, supervised=score.scored
            )
            batch["logp_old"] = logprobs(pol.train, batch["input_ids"])
            if cfg.loss.kl_coef > 0:
                batch["logp_ref"] = logprobs(ref_train, batch["input_ids"])
            gap = engine_gap_metrics(
                batch["logp_old"], batch["logp_engine"], batch["loss_mask"], cfg.loss.is_cap
            )
            pol.train, opt_state, m = update(
                pol.train, pol.rest, opt_state, {n: jnp.asarray(v) for n, v in batch.items()}
            )
            loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
            if not (np.isfinite(loss) and np.isfinite(grad_norm)):
                raise FloatingPointError(
                    f"non-finite GRPO loss/gradient norm at update {s + 1} ({loss}, {grad_norm}); "
                    f"the last checkpoint is step {store.latest_step()}"
                )
            if backend is None:
                engine.update_weights(pol.train)
            # (vLLM: the new adapter is pushed and probed before the next collection, inside its retries.)
            t_update = time.time() - t1

            sampled = sum(t.output_tokens for t in trajs)
            rec = {
                "step": s + 1,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": float(schedule(s)),
                "attempts": len(trajs),
                "admitted": sum(t.admitted for t in trajs),
                "scored": int(score.scored.sum()),
                "sampled_tokens": sampled,
                "row_length": length,
                "collect_s": t_collect,
                "update_s": t_update,
                "tokens_per_s": sampled / max(t_collect, 1e-9),
                "time": time.time() - t_run,
                **gap,
                **level_metrics("", trajs, score, levels),
                **eval_metrics,
                **pending,
            }
            pending.clear()
            log.write(rec)
            print(
                f"update {s + 1:4d}/{cfg.train.collections}: {_levels_line(rec, levels, '')} | grad norm {grad_norm:.3f} "
                f"| {t_collect:.1f}s collect, {t_update:.1f}s update",
                file=out,
                flush=True,
            )
            summary = rec
            if (s + 1) % cfg.train.checkpoint_every == 0 or s + 1 == cfg.train.collections:
                trainer_state = {"step": s + 1, "seed": cfg.train.seed}
                store.save(s + 1, pol.train, opt_state, trainer_state, {**meta, "step": s + 1})
        # Always (re)done: a resume truncates the records of its own step, this one included.
        summary = {**summary, **evaluate(cfg.train.collections)}
    finally:
        attempts_file.close()
        log.close()
        store.close()
        if hasattr(collector, "close"):  # collectors with servers of their own (env.name=pi)
            collector.close()
        if backend is not None:
            backend.close()
    final = store.latest_step()
    return {
        "run_dir": str(run_dir),
        "collections": cfg.train.collections,
        "resumed_from": start,
        "checkpoint": str(store.step_dir(final)) if final else None,
        "last": {k: v for k, v in summary.items() if isinstance(v, (int, float))},
    }


def _start_vllm(cfg: GRPOConfig, pol: Policy, run_dir: Path, out: Any) -> Any:
    """The vLLM backend for this run: a server on the base checkpoint unless `collect.vllm_url`."""
    from jaxpi.vllm.rollouts import VLLMBackend, VLLMSettings

    c = cfg.collect
    settings = VLLMSettings(
        url=c.vllm_url,
        max_len=c.max_context,
        batch_size=c.engine_batch or cfg.rows,
        concurrency=c.vllm_concurrency,
        timeout_s=c.request_timeout_s,
        retries=c.request_retries,
        wait_s=c.retry_wait_s,
        probe_tol=c.probe_tol,
        keep_versions=c.max_staleness + 1,
    )
    backend = VLLMBackend(
        settings,
        pol.base_dir,
        pol.lora,
        pol.model_cfg.vocab_size,
        run_dir / "vllm_adapters",
        log=lambda msg: print(msg, file=out, flush=True),
    )
    try:
        backend.start()
    except BaseException:
        backend.close()
        raise
    return backend


def _levels_line(m: dict[str, Any], levels: Sequence[str], prefix: str) -> str:
    parts = []
    for level in levels:
        p, t = (
            m.get(f"{prefix}level/{level}/pass_rate"),
            m.get(f"{prefix}level/{level}/mean_reasoning_tokens"),
        )
        parts.append(f"{level} {'-' if p is None else f'{p:.2f}'}/{'-' if t is None else f'{t:.0f}'}t")
    ratios = [
        f"T_{a[0].upper()}/T_{b[0].upper()} {m[f'{prefix}ordering/{a}/{b}']:.2f}"
        for a, b in itertools.pairwise(levels)
        if f"{prefix}ordering/{a}/{b}" in m
    ]
    return "pass/reasoning " + ", ".join(parts) + (" | " + ", ".join(ratios) if ratios else "")


# ---- command line --------------------------------------------------------------------------------
def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi grpo` on the CLI's subparsers."""
    p = sub.add_parser(
        "grpo",
        help="effort-ordered GRPO (or the binary baseline) on an environment; resumes in output.dir",
        description="Collect attempts at every effort level, score them with the effort-ordered (or binary) "
        "reward, one LoRA update per collection. Rerunning the same command resumes from the latest "
        "checkpoint in output.dir. `jaxpi report RUN_DIR` draws the run.",
    )
    p.add_argument("--config", required=True, help="YAML file, e.g. configs/grpo/tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override any config field")
    p.add_argument("--json", action="store_true", help="no progress bar; print a JSON summary at the end")
    p.set_defaults(fn=cmd_grpo)
    return p


def cmd_grpo(args: argparse.Namespace) -> int:
    cfg = load_config(GRPOConfig, args.config, args.overrides)
    try:
        summary = run_grpo(cfg, progress=not args.json, out=sys.stderr if args.json else sys.stdout)
    except FloatingPointError as e:
        print(f"jaxpi grpo: {e}", file=sys.stderr)
        return 3
    except CollectionFailedError as e:
        print(f"jaxpi grpo: stopped: {e}", file=sys.stderr)
        return 4
    except RuntimeError as e:
        from jaxpi.vllm.server import ServerError
        from jaxpi.vllm.sync import AdapterProbeError

        if not isinstance(e, (AdapterProbeError, ServerError)):
            raise
        # The served policy is not the trainer's, or no server: collecting now would train on garbage.
        print(f"jaxpi grpo: stopped: {e}", file=sys.stderr)
        return 5
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"done: {summary['collections']} updates, checkpoint {summary['checkpoint']}")
    return 0

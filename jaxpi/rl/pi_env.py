"""`env.name: pi`: GRPO collections from real Pi sessions, `PiCollector.run(tasks, group, seed) ->
list[Trajectory]`, and the task pool they run (`make_pi_env`), registered in `jaxpi.rl.envs`.

    jaxpi grpo --config configs/grpo/tiny.yaml env.name=pi env.tasks_dir=tasks/basic ...

The trainer's own `Collector` (`jaxpi.rl.collect`) runs the agent loop in-process; this one runs
every task × level × group attempt as a sandboxed Pi session (`jaxpi.runner.attempt`) against the
trainer's policy:

    Pi (sandbox) ──► gateway (records token ids + logprobs per attempt) ──► jaxpi serve on the
                                                                             trainer's JaxEngine

The server is built on the very engine the trainer updates (`engine.update_weights` after each
update), so every collection samples the current policy without copying weights. Each attempt's
gateway records become a token-exact sample (`jaxpi.gateway.build_samples`); the verifier's
outcome and the runner's admission are attached (`jaxpi.gateway.to_trajectory`).

Non-merging calls. The gateway merges an attempt's calls into one sample while each call's
prompt extends the previous prompt + completion token for token, and starts a new sample where it
does not (history rewritten by the client or the template). GRPO scores one row per attempt, so
an attempt that came out as more than one sample is kept as an attempt — its success counts in
its group's statistics — but is not admitted for training (reason "split: ..."): training on one
of its pieces would credit tokens the outcome does not belong to alone. `split_stats` of the last
collection is kept in `last_stats` for the run's metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxpi.envs.agent_loop import Trajectory
from jaxpi.gateway import build_samples, gateway_in_front, split_stats, think_ids, to_trajectory
from jaxpi.rl.config import GRPOConfig
from jaxpi.runner.attempt import RunnerConfig, run_attempts
from jaxpi.runner.record import AttemptRecord
from jaxpi.serve import serve_engine
from jaxpi.tasks.task import Task, load_tasks


def load_task_pool(
    tasks_dir: str | Path, eval_dir: str | Path | None = None
) -> tuple[list[Task], list[Task]]:
    """(training tasks, held-out tasks) from task directories (`jaxpi.tasks` format)."""
    pool = load_tasks(tasks_dir)
    if not pool:
        raise ValueError(f"{tasks_dir}: no tasks (directories with a task.toml)")
    held = load_tasks(eval_dir) if eval_dir else []
    return pool, held


def attempt_trajectory(rec: AttemptRecord, calls: Sequence[dict], think: tuple[int, int]) -> Trajectory:
    """One attempt as GRPO's `Trajectory`: the gateway's merged sample, the runner's verdict."""
    ok_calls = [c for c in calls if not c.get("error")]
    samples = build_samples(ok_calls, *think, attempt=rec.attempt_id).samples if ok_calls else ()
    finish = rec.finish if rec.finish in ("answer", "length", "max_turns", "max_tokens") else "answer"
    reason = rec.reason if not rec.admitted else (None if rec.finish == "answer" else rec.finish)
    malformed = not rec.admitted
    # What Pi ran, every tool together; unknown when no session file came back.
    tool_calls = sum(rec.tool_calls.values()) if rec.session_path is not None else None
    if rec.admitted and len(samples) != 1:
        malformed, reason = True, f"split: the gateway merged the attempt's calls into {len(samples)} samples"
    if not samples:
        # Nothing sampled (the first call failed): an empty row that carries the verdict only.
        return Trajectory(
            task_id=rec.task_id,
            level=rec.level,
            token_ids=[],
            mask=[],
            logprobs=[],
            prompt_len=0,
            reasoning_tokens=rec.reasoning_tokens,
            output_tokens=rec.output_tokens,
            turns=rec.turns,
            finish_reason=finish,  # type: ignore[arg-type]
            success=rec.success,
            malformed=True,
            reason=reason or "no recorded model call",
            attempt_id=rec.attempt_id,
            tool_calls=tool_calls,
        )
    # With a split the last sample is carried (for inspection), not trained on (malformed).
    return to_trajectory(
        samples[-1],
        rec.task_id,
        rec.level,
        success=rec.success,
        finish_reason=finish,  # type: ignore[arg-type]
        malformed=malformed,
        reason=reason,
        attempt_id=rec.attempt_id,
        tool_calls=tool_calls,
    )


@dataclasses.dataclass(frozen=True)
class PiEnv:
    """What `env.name: pi` needs beyond the GRPO config: where attempts write, the runner's knobs."""

    out_dir: str = ""  # attempt outputs (sessions, events, verifier); "" = a temp dir
    runner: RunnerConfig = dataclasses.field(default_factory=RunnerConfig)


class PiCollector:
    """The trainer's `Collector` interface over sandboxed Pi attempts (see the module docstring).

    `cfg` is the GRPO config: `reward.levels` are the effort levels, `collect.temperature/top_p`
    Pi's sampling, `collect.max_new_tokens` each call's cap, `collect.max_context` the served
    context, `collect.max_turns/max_tokens` the attempt limits. `env` is the `PiEnv` from `make_pi_env`.
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        engine: Any,
        tokenizer: Any,
        env: PiEnv,
        render_cfg: Any,
        *,
        host: str = "127.0.0.1",
    ) -> None:
        self.cfg, self.engine, self.env = cfg, engine, env
        self.think = think_ids(tokenizer)
        self.versions: list[int | None] = []
        self.last_stats: dict[str, float] = {}
        self.records: list[AttemptRecord] = []
        c = cfg.collect
        # jaxpi serve's HTTP front on the trainer's own engine. Concurrent attempts' calls are
        # gathered into one engine call (20 ms is short next to a turn).
        self._server = serve_engine(
            engine,
            render_cfg.tokenizer_dir,
            served="policy",
            max_len=c.max_context,
            max_new_tokens=c.max_new_tokens,
            batch_wait_ms=20.0,
        )
        self._gw_cm = gateway_in_front(self._server.url, host=host)
        self._url, self._trace, self._key, _ = self._gw_cm.__enter__()
        self._out = Path(env.out_dir or tempfile.mkdtemp(prefix="jaxpi-pi-collect-"))
        self._counter = itertools.count()

    def runner_config(self, seed: int) -> RunnerConfig:
        c = self.cfg.collect
        return dataclasses.replace(
            self.env.runner,
            model_id="policy",
            context_window=c.max_context,
            max_tokens_per_call=c.max_new_tokens,
            max_turns=c.max_turns,
            max_tokens=c.max_tokens,
            wall_seconds=c.wall_seconds or self.env.runner.wall_seconds,
            temperature=c.temperature,
            top_p=c.top_p,
            seed=seed,
        )

    def jobs(self, tasks: Sequence[Task], group: int) -> tuple[int, list[tuple[Task, str, str]]]:
        """(collection number, its (task, level, attempt id) jobs): every task at every level,
        `group` attempts each. Ids are unique across collections: the gateway keys records by them."""
        n = next(self._counter)
        pairs = [(t, lv) for t in tasks for lv in self.cfg.reward.levels for _ in range(group)]
        return n, [(t, level, f"c{n:05d}-{i:04d}-{t.id}-{level}") for i, (t, level) in enumerate(pairs)]

    def run(
        self, tasks: Sequence[Task], group: int, seed: int, progress: Callable[[bool, int], Any] | None = None
    ) -> list[Trajectory]:
        n, jobs = self.jobs(tasks, group)
        recs = run_attempts(
            jobs,
            self._url,
            self._out / f"collection-{n:05d}",
            cfg=self.runner_config(seed),
            trace=self._trace,
            key=self._key,  # each attempt's calls reach the gateway under a token of its own
            progress=None if progress is None else lambda rec: progress(rec.success, rec.output_tokens),
        )
        return self.trajectories(recs)

    def trajectories(self, recs: Sequence[AttemptRecord]) -> list[Trajectory]:
        """GRPO's trajectories of a collection's attempt records; the gateway's split statistics
        into `last_stats`."""
        self.records = list(recs)
        out, merged = [], []
        for rec in recs:
            calls = [c for c in rec.calls if not c.get("error")]
            merged.append(build_samples(calls, *self.think, attempt=rec.attempt_id))
            out.append(attempt_trajectory(rec, rec.calls, self.think))
        # into the run's metrics (jaxpi.rl.sampling.Sampler.collect), under gateway/
        self.last_stats = {f"gateway/{k}": float(v) for k, v in split_stats(merged).items()}
        # None: the engine does not track versions (the trainer's JaxEngine is the current policy).
        self.versions = [getattr(self.engine, "policy_version", None)] * len(out)
        return out

    def close(self) -> None:
        self._gw_cm.__exit__(None, None, None)
        self._server.close()


def make_pi_env(cfg: GRPOConfig) -> tuple[PiEnv, list[Task], list[Task]]:
    """The trainer's env factory for `env.name: pi`: (PiEnv, task pool, held-out tasks) from
    `env.tasks_dir` (and `env.eval_tasks_dir`, optional)."""
    e = cfg.env
    if not e.tasks_dir:
        raise ValueError("env.name=pi needs env.tasks_dir (a directory of tasks, e.g. tasks/basic)")
    pool, held = load_task_pool(e.tasks_dir, e.eval_tasks_dir or None)
    out_dir = str(Path(cfg.output.dir) / "pi_attempts")
    return PiEnv(out_dir=out_dir, runner=RunnerConfig(jobs=e.jobs)), pool, held

"""`env.name=pi` on a Ray fleet: every Pi attempt is one Ray task, a sandboxed Pi session on
whichever node has room, against the run's gateway (the trainer's own engine behind it).

    trainer host                                        any node of the cluster
    JaxEngine ◄── jaxpi serve ◄── gateway  ◄─────────  Ray task: Pi in bubblewrap (run_attempt),
    (the policy)                  (records calls,        the task's verifier; returns the attempt
                                   one token per         record and its files (session, events,
                                   attempt)              verifier output)

What travels: the task directory (packed once per collection, unpacked on the worker), the
runner's settings, the gateway's URL and the attempt's token; back comes the record and the small
files, written under the run's `pi_attempts/` as the in-process collector writes them, so nothing
needs a shared file system. Each node needs Pi (`jaxpi pi setup`, the same `JAXPI_PI_PREFIX`) and
bubblewrap, and must reach the gateway at `collect.gateway_host`.

A task asks Ray for `collect.ray_worker_cpus` CPUs and the memory the sandbox may use (the task's
limit plus Pi's own, `RunnerConfig.pi_memory_mb`), so a node runs as many attempts at once as its
resources hold; at most `collect.ray_workers` attempts are in flight. An attempt whose worker died
(killed, its node gone) is run again under a new attempt id and token (the calls the lost one made
stay filed under its own id, never mixed in), up to `collect.worker_retries` times; then it is
recorded as not admitted (`worker_lost`). The gateway's trace of the attempt that finished is the
only one its trajectory is built from, so nothing of a lost session reaches the loss.

Asynchronous GRPO: a collection is sampled by one policy version. A new adapter given while a
collection is in flight waits (`set_policy`) until it has ended, so every turn of every attempt of a
collection is the same version, recorded per attempt.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from jaxpi.atomic import write_text
from jaxpi.envs.agent_loop import Trajectory
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.fleet.cluster import ClusterInfo, FleetError, connect, ray_module
from jaxpi.rl.fleet.collector import task_error_text
from jaxpi.rl.pi_env import PiCollector, PiEnv
from jaxpi.rollout.jax_engine import JaxEngine
from jaxpi.runner.attempt import RunnerConfig, run_attempt
from jaxpi.runner.install import find_pi
from jaxpi.runner.record import AttemptRecord
from jaxpi.tasks.task import Task, load_task

# What an attempt's directory holds, carried back from the worker.
FILES = ("session.jsonl", "session.jsonl.meta.json", "events.jsonl", "pi_stderr.txt", "verifier.txt")


def pack_task(task: Task) -> bytes:
    """A task directory as a gzip'd tar, in memory (small: instruction, tests, solution, files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(str(task.path), arcname="task")
    return buf.getvalue()


def remote_attempt(
    packed: bytes,
    level: str,
    url: str,
    attempt_id: str,
    token: str,
    runner: RunnerConfig,
    seed: int | None,
) -> dict[str, Any]:
    """One Pi attempt on a worker: the record (JSON) and the files it wrote (bytes)."""
    with tempfile.TemporaryDirectory(prefix="jaxpi-fleet-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")  # no links out, no absolute paths, no devices
        task = load_task(Path(tmp) / "task")
        out = Path(tmp) / "out"
        rec = run_attempt(
            task,
            level,
            url,
            attempt_id,
            out_dir=out,
            cfg=runner,
            key=lambda _: token,
            pi=find_pi(),
            seed=seed,
        )
        files = {name: (out / name).read_bytes() for name in FILES if (out / name).is_file()}
    return {"record": rec.to_json(), "files": files}


@dataclasses.dataclass
class _Job:
    index: int
    task: Task
    level: str
    attempt_id: str  # the id of its latest try
    seed: int | None
    tries: int = 1
    submitted: float = 0.0


class FleetPiCollector(PiCollector):
    """`PiCollector` with its attempts run as Ray tasks (see the module docstring)."""

    def __init__(
        self,
        cfg: GRPOConfig,
        engine: Any,
        tokenizer: Any,
        env: PiEnv,
        render_cfg: Any,
        version: int,
        log: Callable[[str], Any] | None = None,
    ) -> None:
        self.ray = ray_module()
        super().__init__(cfg, engine, tokenizer, env, render_cfg, host=cfg.collect.gateway_host)
        self.log = log or (lambda _msg: None)
        self.version, self._pending_adapter = version, None
        self._in_flight = False
        self._cluster_cm = connect(cfg.collect.ray_address)
        try:
            self.cluster: ClusterInfo = self._cluster_cm.__enter__()
            self._task = self.ray.remote(remote_attempt)
        except BaseException:
            super().close()
            raise

    # ---- the policy: one version per collection -------------------------------------------------
    def set_policy(self, version: int, adapter: Any) -> None:
        """The engine serves `adapter` as `version` from the next collection on (at once when none
        is in flight)."""
        if self._in_flight:
            self._pending_adapter = (version, adapter)
        else:
            self._apply(version, adapter)

    def _apply(self, version: int, adapter: Any) -> None:
        with self._server.service.batcher.engine_lock:  # no batch runs while the weights change
            self.engine.update_weights(adapter)
        self.engine.policy_version = self.version = version

    # ---- collections ----------------------------------------------------------------------------
    def submit(self, tasks: Sequence[Task], group: int, seed: int) -> dict[str, Any]:
        n, jobs = self.jobs(tasks, group)
        runner = self.runner_config(seed)
        packed = {t.id: self.ray.put(pack_task(t)) for t in {id(t): t for t, _, _ in jobs}.values()}
        queue = [
            _Job(i, t, level, aid, None if runner.seed is None else runner.seed + 1000 * i)
            for i, (t, level, aid) in enumerate(jobs)
        ]
        self._in_flight = True
        return {"n": n, "runner": runner, "packed": packed, "queue": queue, "flights": {}, "done": {},
                "retries": 0, "peak": 0, "submitted": time.time(), "version": self.version, "busy": 0.0}  # fmt: skip

    def _launch(self, h: dict[str, Any], job: _Job) -> None:
        r: RunnerConfig = h["runner"]
        memory = (job.task.limits.memory_mb + r.pi_memory_mb) * 2**20
        opts = {"num_cpus": self.cfg.collect.ray_worker_cpus, "memory": memory, "max_retries": 0}
        job.submitted = time.time()
        ref = self._task.options(**opts).remote(
            h["packed"][job.task.id],
            job.level,
            self._url,
            job.attempt_id,
            self._key(job.attempt_id),
            r,
            job.seed,
        )
        h["flights"][ref] = job
        h["peak"] = max(h["peak"], len(h["flights"]))

    def wait(
        self, h: dict[str, Any], progress: Callable[[bool, int], Any] | None = None
    ) -> tuple[list[Trajectory], list[int]]:
        cap, retries = self.cfg.collect.ray_workers, self.cfg.collect.worker_retries
        out_dir = self._out / f"collection-{h['n']:05d}"
        try:
            while h["queue"] or h["flights"]:
                while h["queue"] and len(h["flights"]) < cap:
                    self._launch(h, h["queue"].pop(0))
                ready, _ = self.ray.wait(list(h["flights"]), num_returns=1, timeout=1.0)
                for ref in ready:
                    job = h["flights"].pop(ref)
                    try:
                        got = self.ray.get(ref)
                    except self.ray.exceptions.RayTaskError as e:
                        # the attempt's own code raised (a task it cannot unpack, no Pi on the
                        # node): not a lost worker, and the same again elsewhere
                        raise FleetError(f"a Pi attempt failed on its worker: {task_error_text(e)}") from e
                    except self.ray.exceptions.RayError as e:  # the worker process or node is gone
                        self._trace(job.attempt_id)  # close the lost try's token; its calls stay its own
                        if job.tries > retries:
                            h["done"][job.index] = self._lost(job, e)
                        else:
                            h["retries"] += 1
                            self.log(
                                f"fleet: Pi attempt {job.attempt_id} lost its worker ({type(e).__name__}); again"
                            )
                            job.tries += 1
                            job.attempt_id = f"{job.attempt_id.split('.r')[0]}.r{job.tries - 1}"
                            h["queue"].insert(0, job)
                        continue
                    rec = self._receive(got, job, out_dir)
                    h["busy"] += rec.wall_seconds
                    h["done"][job.index] = rec
                    if progress is not None:
                        progress(rec.success, rec.output_tokens)
        finally:
            self._in_flight = False
            if self._pending_adapter is not None:
                self._apply(*self._pending_adapter)
                self._pending_adapter = None
        recs = [h["done"][i] for i in range(len(h["done"]))]
        trajs = self.trajectories(recs)
        wall = time.time() - h["submitted"]
        self.last_stats.update(
            {
                "fleet/attempts": float(len(recs)),
                "fleet/wall_s": wall,
                "fleet/attempts_per_min": 60.0 * len(recs) / max(wall, 1e-9),
                "fleet/sampled_tokens_per_s": sum(r.output_tokens for r in recs) / max(wall, 1e-9),
                "fleet/busy_s": h["busy"],
                "fleet/in_flight_max": float(h["peak"]),
                "fleet/retries": float(h["retries"]),
                "fleet/lost_attempts": float(sum(r.reason == "worker_lost" for r in recs)),
            }
        )
        versions = [h["version"]] * len(trajs)
        self.versions = list(versions)
        return trajs, versions

    def _receive(self, got: dict[str, Any], job: _Job, out_dir: Path) -> AttemptRecord:
        """The worker's record with the gateway's calls of the attempt, its files written here."""
        d = out_dir / job.attempt_id
        d.mkdir(parents=True, exist_ok=True)
        for name, data in got["files"].items():
            (d / name).write_bytes(data)
        fields = {
            k: v for k, v in got["record"].items() if k in {f.name for f in dataclasses.fields(AttemptRecord)}
        }
        fields["session_path"] = str(d / "session.jsonl") if "session.jsonl" in got["files"] else None
        fields["events_path"] = str(d / "events.jsonl")
        rec = AttemptRecord(**{**fields, "calls": tuple(self._trace(job.attempt_id) or ())})
        write_text(d / "record.json", json.dumps(rec.to_json(with_calls=True), indent=2))
        return rec

    def _lost(self, job: _Job, e: Exception) -> AttemptRecord:
        why = f"its worker died {job.tries} times (collect.worker_retries={self.cfg.collect.worker_retries}; last: {type(e).__name__})"
        return AttemptRecord(
            attempt_id=job.attempt_id,
            task_id=job.task.id,
            level=job.level,
            admitted=False,
            success=False,
            reason="worker_lost",
            finish=None,
            turns=0,
            output_tokens=0,
            reasoning_tokens=0,
            wall_seconds=0.0,
            detail=why,
        )

    def run(
        self, tasks: Sequence[Task], group: int, seed: int, progress: Callable[[bool, int], Any] | None = None
    ) -> list[Trajectory]:
        trajs, _ = self.wait(self.submit(tasks, group, seed), progress)
        return trajs

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._cluster_cm.__exit__(None, None, None)


def make_fleet_pi_collector(
    cfg: GRPOConfig,
    pol: Any,
    tokenizer: Any,
    env: PiEnv,
    render_cfg: Any,
    version: int,
    log: Callable[[str], Any] | None = None,
) -> FleetPiCollector:
    """The fleet for `env.name=pi`: the trainer's own engine (on `pol`, as `version`) served to Pi
    attempts that run as Ray tasks."""
    engine = JaxEngine(
        nnx.merge(pol.graphdef, pol.train, pol.rest),
        max_len=cfg.collect.max_context,
        batch_size=cfg.collect.engine_batch or cfg.rows,
    )
    engine.policy_version = version
    return FleetPiCollector(cfg, engine, tokenizer, env, render_cfg, version, log)

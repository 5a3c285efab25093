"""`FleetCollector`: GRPO collections of the in-process environments on a Ray fleet of rollout
workers (`collect.backend=ray`).

A collection is cut into the waves the in-process collector would run (`collection_waves`: the
same attempts, keys and environment seeds per wave), and the waves are spread over
`collect.ray_workers` worker processes (`RolloutWorker`, one engine each). Every wave names the
adapter version it is sampled with; the adapter of each version goes to Ray's object store once.
So with the same seeds a Ray collection is, token for token, the in-process one, and a wave runs
wherever a worker is free.

Faults. A wave is all or nothing: its trajectories come back only when every attempt of it has
ended (a worker dying mid-wave leaves nothing of it behind). A wave whose worker died (its process
killed, its node gone) is given to another live worker and redone from the start, with the same
keys (so the redo is the same attempts), up to `collect.worker_retries` times; past that its
attempts are recorded as not admitted ("worker_lost: ..."), never trained on. A dead worker is
replaced by a new one, used once it has started; while none is alive the collection waits up to
`collect.fleet_wait_s` for one, then fails (the run stops with its last checkpoint intact, as for a
failed vLLM collection).

Asynchronous GRPO (`train.async`): `submit` hands a collection to the fleet and returns at once;
the trainer updates on the previous collection meanwhile and takes this one with `wait`.

Observed per collection (`last_stats`, into metrics.jsonl under `fleet/`): waves, attempts, wall
seconds, attempts per minute, sampled tokens per second, the workers' busy seconds, the mean and
largest queue wait of a wave, waves in flight at once, retries, lost attempts, live workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxpi.envs.agent_loop import Trajectory
from jaxpi.rl.collect import Wave, collection_waves
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.fleet.cluster import ClusterInfo, FleetError, connect, ray_module
from jaxpi.rl.fleet.worker import RolloutWorker, WaveResult, WorkerSpec


@dataclasses.dataclass
class _Flight:
    """One wave on its way: which worker has it, since when, how often it was given out."""

    index: int
    wave: Wave
    version: int
    worker: int
    submitted: float
    tries: int = 1


@dataclasses.dataclass
class Handle:
    """A submitted collection: its waves in flight and the results so far."""

    waves: list[Wave]
    version: int
    submitted: float
    flights: dict[Any, _Flight] = dataclasses.field(default_factory=dict)  # object ref -> flight
    results: dict[int, WaveResult] = dataclasses.field(default_factory=dict)
    lost: dict[int, str] = dataclasses.field(default_factory=dict)  # wave index -> why
    retries: int = 0
    peak_in_flight: int = 0


class FleetCollector:
    """The trainer's `Collector` interface on a Ray fleet (see the module docstring).

    `spec` says how workers build their engines; `version`/`adapter` the policy they start with.
    """

    def __init__(
        self,
        cfg: GRPOConfig,
        spec: WorkerSpec,
        version: int,
        adapter: Any,
        log: Callable[[str], Any] | None = None,
    ) -> None:
        self.cfg, self.spec, self.log = cfg, spec, log or (lambda _msg: None)
        self.ray = ray_module()
        self._cluster_cm = connect(cfg.collect.ray_address, cpus=None)
        self.cluster: ClusterInfo = self._cluster_cm.__enter__()
        try:
            self._actor = self.ray.remote(RolloutWorker).options(num_cpus=cfg.collect.ray_worker_cpus)
            self.workers: list[Any] = []
            self.alive: list[bool] = []
            self.starting: dict[Any, int] = {}  # info() ref of a worker not yet known alive -> index
            self._start_failures = 0
            for _ in range(cfg.collect.ray_workers):
                self._spawn()
            self._wait_for_workers()
            self.versions: list[int | None] = []
            self.last_stats: dict[str, float] = {}
            self._adapters: dict[int, Any] = {}
            self.version = -1
            self.set_policy(version, adapter)
        except BaseException:
            self._cluster_cm.__exit__(None, None, None)
            raise

    # ---- workers ------------------------------------------------------------------------------
    def _spawn(self, index: int | None = None) -> None:
        w = self._actor.remote(self.spec)
        if index is None:
            self.workers.append(w)
            self.alive.append(False)
            index = len(self.workers) - 1
        else:
            self.workers[index], self.alive[index] = w, False
        self.starting[w.info.remote()] = index

    def _poll_starting(self, timeout: float = 0.0) -> None:
        """Mark the workers whose start-up finished as alive (a failed start-up: replaced)."""
        if not self.starting:
            return
        ready, _ = self.ray.wait(list(self.starting), num_returns=len(self.starting), timeout=timeout)
        for ref in ready:
            index = self.starting.pop(ref)
            try:
                self.ray.get(ref)
                self.alive[index] = True
                self._start_failures = 0
            except self.ray.exceptions.RayError as e:
                self._start_failures += 1
                if self._start_failures > self.cfg.collect.worker_retries:
                    # Not a lost process but a worker that cannot start (a base it cannot read, a
                    # broken install): say why instead of starting it forever.
                    raise FleetError(f"rollout workers fail to start: {task_error_text(e)}") from e
                self.log(f"fleet: worker {index} failed to start ({type(e).__name__}); starting another")
                self._spawn(index)

    def _wait_for_workers(self) -> None:
        """Block until at least one worker is alive (all of them, at start-up, if they come)."""
        deadline = time.monotonic() + self.cfg.collect.fleet_wait_s
        while not any(self.alive):
            if time.monotonic() > deadline:
                raise FleetError(
                    f"no rollout worker started within collect.fleet_wait_s={self.cfg.collect.fleet_wait_s} s "
                    f"on the cluster ({self.cluster.cpus:g} CPUs, {self.cluster.nodes} nodes; each worker "
                    f"takes collect.ray_worker_cpus={self.cfg.collect.ray_worker_cpus})"
                )
            self._poll_starting(timeout=1.0)
        self._poll_starting(timeout=self.cfg.collect.fleet_wait_s if not all(self.alive) else 0.0)

    def _next_worker(self, busy: dict[int, int]) -> int:
        """The live worker with the fewest waves queued on it."""
        live = [i for i, a in enumerate(self.alive) if a]
        return min(live, key=lambda i: (busy.get(i, 0), i))

    # ---- the policy ---------------------------------------------------------------------------
    def set_policy(self, version: int, adapter: Any) -> None:
        """Waves submitted from now on are sampled by `adapter` as `version` (earlier ones keep
        theirs). Adapters of versions no wave in flight uses are dropped from the object store."""
        if version != self.version:
            self._adapters[version] = self.ray.put(jax.device_get(adapter))
            self.version = version

    def _forget_unused(self, keep: set[int]) -> None:
        for v in [v for v in self._adapters if v not in keep | {self.version}]:
            del self._adapters[v]

    # ---- collections --------------------------------------------------------------------------
    def submit(self, tasks: Sequence[Any], group: int, seed: int) -> Handle:
        """Hand one collection to the fleet (sampled by the current version); returns at once."""
        self._poll_starting()
        waves = collection_waves(self.cfg, tasks, group, seed, self.spec.batch_size)
        handle = Handle(waves, self.version, time.time())
        busy: dict[int, int] = {}
        for i, wave in enumerate(waves):
            self._send(handle, _Flight(i, wave, self.version, -1, time.time()), busy)
        return handle

    def _send(self, handle: Handle, flight: _Flight, busy: dict[int, int]) -> None:
        if not any(self.alive):
            self._wait_for_workers()
        w = self._next_worker(busy)
        busy[w] = busy.get(w, 0) + 1
        flight.worker = w
        ref = self.workers[w].run.remote(flight.wave, flight.version, [self._adapters[flight.version]])
        handle.flights[ref] = flight
        handle.peak_in_flight = max(handle.peak_in_flight, min(len(handle.flights), sum(self.alive)))

    def wait(
        self, handle: Handle, progress: Callable[[bool, int], Any] | None = None
    ) -> tuple[list[Trajectory], list[int]]:
        """The trajectories of a submitted collection, in the in-process order, with the version
        that sampled each; `progress(success, tokens)` as each wave's attempts come back."""
        retries = self.cfg.collect.worker_retries
        while handle.flights:
            ready, _ = self.ray.wait(list(handle.flights), num_returns=1, timeout=1.0)
            self._poll_starting()
            for ref in ready:
                flight = handle.flights.pop(ref)
                try:
                    res: WaveResult = self.ray.get(ref)
                except self.ray.exceptions.RayTaskError as e:
                    # The wave's own code raised (a bug, bad input): the same again elsewhere.
                    raise FleetError(f"a rollout worker failed on a wave: {task_error_text(e)}") from e
                except self.ray.exceptions.RayError as e:  # the process or its node is gone
                    self._worker_lost(flight.worker, e)
                    if flight.tries > retries:
                        handle.lost[flight.index] = (
                            f"worker_lost: the wave's worker died {flight.tries} times "
                            f"(collect.worker_retries={retries}; last: {type(e).__name__})"
                        )
                        continue
                    handle.retries += 1
                    flight.tries += 1
                    flight.submitted = time.time()
                    self._send(handle, flight, {})
                    continue
                handle.results[flight.index] = res
                if progress is not None:
                    for t in res.trajectories:
                        progress(t.success, t.output_tokens)
        trajs, versions = self._assemble(handle, progress)
        self._forget_unused(set())
        return trajs, versions

    def _worker_lost(self, index: int, e: Exception) -> None:
        if self.alive[index]:
            self.alive[index] = False
            self.log(f"fleet: worker {index} lost ({type(e).__name__}); its wave goes to another worker")
            self._spawn(index)

    def _assemble(
        self, handle: Handle, progress: Callable[[bool, int], Any] | None
    ) -> tuple[list[Trajectory], list[int]]:
        trajs: list[Trajectory] = []
        versions: list[int] = []
        for i, wave in enumerate(handle.waves):
            if i in handle.results:
                res = handle.results[i]
                trajs += res.trajectories
                versions += [res.version] * len(res.trajectories)
                continue
            why = handle.lost[i]
            for k, (task, level) in enumerate(wave.pairs):
                trajs.append(_lost(task, level, why, wave.start + k))
                versions.append(handle.version)
                if progress is not None:
                    progress(False, 0)
        wall = time.time() - handle.submitted
        done = list(handle.results.values())
        waits = [r.started - handle.submitted for r in done]
        self.last_stats = {
            "fleet/waves": float(len(handle.waves)),
            "fleet/attempts": float(len(trajs)),
            "fleet/wall_s": wall,
            "fleet/attempts_per_min": 60.0 * len(trajs) / max(wall, 1e-9),
            "fleet/sampled_tokens_per_s": sum(t.output_tokens for t in trajs) / max(wall, 1e-9),
            "fleet/busy_s": sum(r.seconds for r in done),
            "fleet/queue_wait_s_mean": sum(waits) / len(waits) if waits else 0.0,
            "fleet/queue_wait_s_max": max(waits, default=0.0),
            "fleet/in_flight_max": float(handle.peak_in_flight),
            "fleet/retries": float(handle.retries),
            "fleet/lost_attempts": float(sum(len(handle.waves[i].pairs) for i in handle.lost)),
            "fleet/workers_alive": float(sum(self.alive)),
        }
        self.versions = list(versions)
        return trajs, versions

    def run(
        self, tasks: Sequence[Any], group: int, seed: int, progress: Callable[[bool, int], Any] | None = None
    ) -> list[Trajectory]:
        """The synchronous `Collector.run`: submit, then wait."""
        trajs, _ = self.wait(self.submit(tasks, group, seed), progress)
        return trajs

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (tests kill one to check the faults)."""
        infos = self.ray.get([w.info.remote() for w, a in zip(self.workers, self.alive, strict=True) if a])
        return [i["pid"] for i in infos]

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(Exception):  # a worker already gone
                self.ray.kill(w)
        self._cluster_cm.__exit__(None, None, None)


def task_error_text(e: Exception) -> str:
    """The error a Ray task raised, in one line (not Ray's traceback around it)."""
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"


def _lost(task: Any, level: str, why: str, index: int) -> Trajectory:
    """The record of an attempt whose wave was lost: nothing sampled, not admitted."""
    task_id = getattr(task, "task_id", None) or getattr(task, "id", "?")
    return Trajectory(
        task_id=task_id,
        level=level,
        token_ids=[],
        mask=[],
        logprobs=[],
        prompt_len=0,
        reasoning_tokens=0,
        output_tokens=0,
        turns=0,
        # not "malformed": the model did nothing wrong, so reward.malformed=fail never scores it
        finish_reason="answer",
        success=False,
        malformed=True,
        reason=why,
        attempt_id=f"{task_id}/{level}/lost-{index}",
    )


def make_fleet_collector(
    cfg: GRPOConfig,
    pol: Any,
    tokenizer: Any,
    env: Any,
    render_cfg: Any,
    version: int,
    log: Callable[[str], Any] | None = None,
) -> FleetCollector:
    """The fleet for an environment the agent loop runs in-process (`env.name=lookup`): workers
    with engines on the run's base, starting from `pol.train` as policy `version`."""
    spec = WorkerSpec(
        cfg=cfg,
        base_dir=str(pol.base_dir),
        tokenizer_dir=str(pol.tokenizer_dir),
        lora=pol.lora,
        batch_size=cfg.collect.engine_batch or cfg.rows,
        env=env,
        render_cfg=render_cfg,
    )
    return FleetCollector(cfg, spec, version, pol.train, log)

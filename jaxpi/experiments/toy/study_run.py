"""The runs of a `jaxpi study`: for every seed k, its SFT start and one GRPO run per arm, each the
real `jaxpi` command in a subprocess (log in `logs/`), `--jobs` of them at a time (a GRPO run waits
for its seed's SFT).

    seed-k/sft              `jaxpi sft --config configs/sft/toy.yaml train.seed=k`: its own toy
                            SFT start (the toy-copy base is pre-trained with seed k too)
    seed-k/effort-ordered   `jaxpi grpo --config configs/grpo/toy.yaml train.seed=k
                            model.adapter=seed-k/sft reward.kind=effort_ordered`
    seed-k/binary           the same with reward.kind=binary: same start, same seed

A finished run gets `done.json` (with the seconds of every process that worked on it); a rerun of
the study skips those and reruns the others, and the trainers resume an interrupted run from its
last orbax checkpoint. Children are killed with the study (PR_SET_PDEATHSIG), so none is left
writing into a run directory that a rerun then opens again.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxpi import atomic
from jaxpi.experiments.toy.study_config import ARMS, GRPO_CONFIG, SFT_CONFIG, StudySpec


@dataclasses.dataclass
class Job:
    name: str  # "seed-0/sft", "seed-0/effort-ordered"
    run_dir: Path
    argv: list[str]
    needs: tuple[str, ...] = ()
    reuse: bool = False  # another study's run: must be done, never started here

    @property
    def done(self) -> bool:
        return (self.run_dir / "done.json").exists()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxpi.cli", *args, "--json"]


def plan(root: Path, spec: StudySpec) -> list[Job]:
    """The study's runs, each seed's SFT first, in the order they are started."""
    jobs = []
    for k in spec.seeds:
        sft_dir = (Path(spec.starts) if spec.starts else root) / f"seed-{k}" / "sft"
        sft_name = f"seed-{k}/sft"
        args = [*spec.sft_overrides, f"train.seed={k}", f"output.dir={sft_dir}"]
        jobs.append(
            Job(sft_name, sft_dir, _cli("sft", "--config", str(SFT_CONFIG), *args), (), bool(spec.starts))
        )
        for arm in spec.arms:
            run_dir = root / f"seed-{k}" / ARMS[arm]
            args = [
                *spec.grpo_overrides,
                f"model.adapter={sft_dir}",
                f"reward.kind={arm}",
                f"train.seed={k}",
                f"output.dir={run_dir}",
                f"output.name={ARMS[arm]} seed {k}",
            ]
            jobs.append(
                Job(
                    f"seed-{k}/{ARMS[arm]}",
                    run_dir,
                    _cli("grpo", "--config", str(GRPO_CONFIG), *args),
                    (sft_name,),
                )
            )
    return jobs


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# A running job's time so far, rewritten every ELAPSED_EVERY_S in the study's logs/ (not in the run
# directory, which belongs to the run): a run killed and resumed counts the time of every process
# that worked on it, less at most that interval per interruption.
ELAPSED_EVERY_S = 5.0


def _elapsed_path(logs: Path, name: str) -> Path:
    return logs / (name.replace("/", "-") + ".seconds")


def _prior_seconds(logs: Path, name: str) -> float:
    try:
        value = float(json.loads(_elapsed_path(logs, name).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return value if math.isfinite(value) and value >= 0 else 0.0


def run_jobs(
    jobs: Sequence[Job],
    logs: Path,
    *,
    parallel: int = 2,
    env: Mapping[str, str] | None = None,
    say: Callable[[str], Any] = print,
    poll_s: float = 0.5,
) -> dict[str, str]:
    """Run the jobs that are not done, `parallel` at a time, each after the jobs it needs.
    Returns each job's state: "done" (finished before), "ran", "failed (rc N, log)" or
    "not run (needs ...)". SIGTERM and Ctrl-C stop the children before the study exits."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    logs.mkdir(parents=True, exist_ok=True)
    state = {j.name: "done" for j in jobs if j.done}
    for j in jobs:
        if j.reuse and not j.done:
            raise FileNotFoundError(f"{j.run_dir}: not a finished run (no done.json) of the starts study")
    pending = [j for j in jobs if j.name not in state]
    running: dict[str, tuple[Job, subprocess.Popen, float, Any]] = {}
    prior: dict[str, float] = {}  # seconds earlier processes spent on a job
    noted: dict[str, float] = {}  # when a job's elapsed time was last written
    t_study = time.time()

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while pending or running:
            for j in list(pending):
                failed = [n for n in j.needs if state.get(n, "").startswith(("failed", "not run"))]
                if failed:
                    state[j.name] = f"not run (needs {', '.join(failed)})"
                    pending.remove(j)
                    continue
                if len(running) >= parallel or any(state.get(n) not in ("done", "ran") for n in j.needs):
                    continue
                log_path = logs / (j.name.replace("/", "-") + ".log")
                log = log_path.open("a")
                log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(j.argv)}\n")
                log.flush()
                resumed = (j.run_dir / "checkpoints").is_dir()
                say(f"start {j.name}{' (resuming)' if resumed else ''}  log {log_path}")
                proc = subprocess.Popen(
                    j.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(env) if env is not None else None,
                    preexec_fn=_die_with_parent,
                )
                running[j.name] = (j, proc, time.time(), log)
                prior[j.name] = _prior_seconds(logs, j.name) if resumed else 0.0
                noted[j.name] = time.time()
                pending.remove(j)
            time.sleep(poll_s if running else 0)
            for name, (j, proc, t0, log) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    if time.time() - noted[name] >= ELAPSED_EVERY_S:
                        noted[name] = time.time()
                        spent = {"seconds": round(prior[name] + time.time() - t0, 1)}
                        atomic.write_text(_elapsed_path(logs, name), json.dumps(spent) + "\n")
                    continue
                log.close()
                del running[name]
                seconds = time.time() - t0
                if rc == 0:
                    record = {
                        "command": j.argv,
                        "seconds": round(prior[name] + seconds, 1),  # every process's, if resumed
                        "seconds_last_process": round(seconds, 1),
                        "finished": time.time(),
                    }
                    atomic.write_text(j.run_dir / "done.json", json.dumps(record, indent=2) + "\n")
                    _elapsed_path(logs, name).unlink(missing_ok=True)
                    state[name] = "ran"
                    earlier = (
                        f", {prior[name] + seconds:.0f} s with the earlier processes" if prior[name] else ""
                    )
                    say(
                        f"done  {name} in {seconds:.0f} s{earlier} ({time.time() - t_study:.0f} s into the study)"
                    )
                else:
                    state[name] = f"failed (rc {rc}, log {log.name})"
                    say(f"FAILED {name}: exit {rc}; see {log.name}")
    finally:
        for _j, proc, _t0, _log in running.values():
            proc.terminate()
        for _j, proc, _t0, log in running.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        signal.signal(signal.SIGTERM, previous)
    return state

"""`jaxpi study`: the toy-scale effort-ordering result over K seeds, with statistics across seeds.

One run of each arm cannot tell a method from a seed. A study runs, for every seed k:

    seed-k/sft              `jaxpi sft --config configs/sft/toy.yaml train.seed=k`: its own toy
                            SFT start (the toy-copy base is pre-trained with seed k too)
    seed-k/effort-ordered   `jaxpi grpo --config configs/grpo/toy.yaml train.seed=k
                            model.adapter=seed-k/sft reward.kind=effort_ordered`
    seed-k/binary           the same with reward.kind=binary: same start, same seed

Each run is the real command in a subprocess (log in `logs/`), `--jobs` of them at a time (a
GRPO run waits for its seed's SFT). A finished run gets `done.json`; a rerun of the study skips
those and reruns the others, and the trainers resume an interrupted run from its last orbax
checkpoint. The settings that define the runs (the resolved SFT and GRPO configs, minus the seed
and the paths) are kept in `study.json`; a rerun with other settings is refused, more seeds may
be added. Children are killed with the study (PR_SET_PDEATHSIG), so none is left writing into a
run directory that a rerun then opens again.

Then `report/`: per seed, the start's and each arm's end T_L/T_M, T_M/T_X (held-out evaluation,
95% task bootstrap) and per-level pass rates over admitted and over scheduled attempts (95%
Wilson); across seeds the mean of each with a 95% t-interval over seeds (the seeds are the
independent replicates; n - 1 degrees of freedom), the paired differences effort-ordered −
binary and end − start (same start, same seed) with their t-intervals, the issue's criteria
checked, `ordering.png` (T_L/T_M of the training collections against update, every seed thin,
the mean thick, the held-out start and end as points with their across-seed intervals) and
`study.json` with all of it. The start is the step-0 evaluation, which both arms run on the same
policy with the same seed; the study checks that the two are identical.

`--short` is the two-update machinery version (toy-random base, values 0-1, as `make demo`): it
shows that the pipeline runs, not the result.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpi.rl.report import Estimate, markdown_table
from jaxpi.rl.toy_result import CONFIGS, SHORT

SFT_CONFIG = CONFIGS / "sft" / "toy.yaml"
GRPO_CONFIG = CONFIGS / "grpo" / "toy.yaml"
ARMS: dict[str, str] = {"effort_ordered": "effort-ordered", "binary": "binary"}  # reward.kind → dir
# Set by the study per run: an override of one of these would make the seeds or arms collide.
STUDY_KEYS = ("train.seed", "output.dir", "model.adapter", "reward.kind", "output.name")
# Not part of what a run means: may differ between a study and its rerun.
FREE_KEYS = {"output": None, "train": ("seed", "checkpoint_every", "keep_checkpoints", "eval_every")}
CRITERIA_SHARE = 0.8  # effort-ordered below 1.0 in at least this share of seeds (4 of 5)

# t_{0.975} for 1..30 degrees of freedom (scipy.stats.t.ppf, six decimals).
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157,
    2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922,
    2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831,
    2.048407, 2.045230, 2.042272,
)  # fmt: skip


# ---- statistics across seeds ---------------------------------------------------------------------
def t_quantile(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a table to 30, then the
    Cornish-Fisher expansion around the normal, within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> Estimate | None:
    """Mean with its 95% t-interval over independent replicates (seeds); NaN bounds for one value,
    None for none. Values that are None (undefined in that seed) are left out."""
    xs = np.asarray([v for v in values if v is not None and math.isfinite(v)], np.float64)
    if xs.size == 0:
        return None
    mean = float(xs.mean())
    if xs.size == 1:
        return Estimate(mean, math.nan, math.nan)
    half = t_quantile(xs.size - 1) * float(xs.std(ddof=1)) / math.sqrt(xs.size)
    return Estimate(mean, mean - half, mean + half)


# ---- the study's settings ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StudySpec:
    seeds: tuple[int, ...]
    arms: tuple[str, ...] = tuple(ARMS)
    short: bool = False
    sft: tuple[str, ...] = ()  # overrides of configs/sft/toy.yaml
    grpo: tuple[str, ...] = ()  # overrides of configs/grpo/toy.yaml
    starts: str | None = None  # another study whose seed-k/sft runs are the starts (not rerun)

    def __post_init__(self) -> None:
        errors = []
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            errors.append(f"seeds must be distinct and >= 0, got {list(self.seeds)}")
        unknown = [a for a in self.arms if a not in ARMS]
        if not self.arms or unknown or len(set(self.arms)) != len(self.arms):
            errors.append(f"arms must be distinct names of {list(ARMS)}, got {list(self.arms)}")
        for o in (*self.sft, *self.grpo):
            key = o.partition("=")[0].strip()
            if key in STUDY_KEYS:
                errors.append(f"{key} is set by the study per run; not an override ({o!r})")
        if self.starts and self.sft:
            errors.append("with starts the SFT runs are another study's: give no SFT overrides")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def sft_overrides(self) -> list[str]:
        return [*(SHORT[0] if self.short else ()), "output.tensorboard=false", *self.sft]

    @property
    def grpo_overrides(self) -> list[str]:
        return [*(SHORT[1] if self.short else ()), "output.tensorboard=false", *self.grpo]


def _strip(d: dict[str, Any], free: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for section, fields in d.items():
        if section in free and free[section] is None:
            continue
        if isinstance(fields, dict):
            out[section] = {k: v for k, v in fields.items() if k not in (free.get(section) or ())}
        else:
            out[section] = fields
    return out


def resolved_settings(spec: StudySpec) -> dict[str, Any]:
    """The SFT and GRPO configs every run of the study shares (seed, paths and arm left out),
    validated here so that a bad override fails before anything starts."""
    from jaxpi.configfile import load_config, to_dict
    from jaxpi.rl.config import GRPOConfig
    from jaxpi.train.sft import SFTConfig

    sft = to_dict(load_config(SFTConfig, SFT_CONFIG, spec.sft_overrides))
    grpo = to_dict(load_config(GRPOConfig, GRPO_CONFIG, spec.grpo_overrides))
    grpo["model"].pop("adapter", None)
    grpo["reward"].pop("kind", None)
    settings = {"sft": _strip(sft, FREE_KEYS), "grpo": _strip(grpo, FREE_KEYS)}
    return _portable(settings, str(CONFIGS.parent))


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ. A key only one side has is a field added (or removed)
    since: it kept the old behaviour at its default, as the trainers' resume assumes."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) & set(b)) for d in _diff(a[k], b[k], f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _portable(obj: Any, root: str) -> Any:
    """Paths inside the checkout (defaults such as the demo sessions) as `<repo>/...`, so that a
    study reads the same from another checkout of the same code."""
    if isinstance(obj, dict):
        return {k: _portable(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v, root) for v in obj]
    return "<repo>" + obj[len(root) :] if isinstance(obj, str) and obj.startswith(root) else obj


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare(root: Path, spec: StudySpec) -> dict[str, Any]:
    """Write (or check against) `root/study.json`: the settings a rerun must share."""
    settings = resolved_settings(spec)
    if spec.starts:
        other = json.loads((Path(spec.starts) / "study.json").read_text())
        if other["short"] != spec.short:
            raise ValueError(f"{spec.starts} is a {'short' if other['short'] else 'full'} study")
        settings["sft"] = other["settings"]["sft"]
    path = root / "study.json"
    record = {"short": spec.short, "starts": spec.starts, "settings": settings}
    if path.exists():
        saved = json.loads(path.read_text())
        diffs = [d.removeprefix("settings.") for d in _diff({k: saved.get(k) for k in record}, record)]
        if diffs:
            raise ValueError(
                f"{root} holds a study with different settings ({', '.join(diffs[:8])}); "
                "rerun it with the same ones or choose another --out"
            )
    root.mkdir(parents=True, exist_ok=True)
    # The overrides as given, so that `--report-only` needs none of them again.
    record["overrides"] = {"sft": list(spec.sft), "grpo": list(spec.grpo)}
    _write_atomic(path, json.dumps(record, indent=2) + "\n")
    return record


def saved_spec(root: Path, seeds: Sequence[int]) -> StudySpec:
    """The spec of the study in `root` (study.json), for `seeds`, with the arms it has runs of."""
    path = root / "study.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no study here (run `jaxpi study --out {root}` first)")
    saved = json.loads(path.read_text())
    over = saved.get("overrides") or {"sft": [], "grpo": []}
    arms = tuple(a for a, d in ARMS.items() if any(root.glob(f"seed-*/{d}/done.json"))) or tuple(ARMS)
    return StudySpec(
        tuple(seeds), arms, saved["short"], tuple(over["sft"]), tuple(over["grpo"]), saved["starts"]
    )


# ---- the runs ------------------------------------------------------------------------------------
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
                        _write_atomic(_elapsed_path(logs, name), json.dumps(spent) + "\n")
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
                    _write_atomic(j.run_dir / "done.json", json.dumps(record, indent=2) + "\n")
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


# ---- reading the runs ----------------------------------------------------------------------------
PAIRS = ("low/medium", "medium/xhigh")


def _est(e: Estimate | None) -> dict[str, float] | None:
    return None if e is None else {"value": e.value, "lo": e.lo, "hi": e.hi}


def _point(summary: Any) -> dict[str, Any]:
    """The numbers of one held-out evaluation that the study compares."""
    out: dict[str, Any] = {"step": summary.step, "ordering": {}, "pass": {}, "sched": {}, "T": {}}
    for pair in PAIRS:
        out["ordering"][pair] = _est(summary.ordering.get(pair))
    for level, s in summary.stats.items():
        out["pass"][level] = _est(s.pass_rate)
        out["sched"][level] = _est(s.pass_rate_scheduled)
        out["T"][level] = None if s.reasoning_tokens is None else s.reasoning_tokens.value
        out.setdefault("n", {})[level] = {"admitted": s.admitted, "scheduled": s.scheduled}
    return out


# What an arm's reward makes of an attempt: the policy's samples are the same in both arms, these not.
_SCORING = ("reward", "advantage")


def _eval_records(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The evaluation's attempts at `step` as the policy sampled them (the arm's scores left out)."""
    recs = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines() if x.strip()]
    return [
        {k: v for k, v in r.items() if k not in _SCORING}
        for r in recs
        if r["split"] == "eval" and r["step"] == step
    ]


def _train_series(run: Any) -> list[tuple[int, float | None]]:
    """T_L/T_M of every training collection: (updates before it, ratio)."""
    from jaxpi.rl.report import step_series

    return [(s.step, _value(s.ordering.get("low/medium"))) for s in step_series(run, "train", n_boot=1)]


def _value(e: Estimate | None) -> float | None:
    return None if e is None else e.value


def read_seed(root: Path, k: int, arms: Sequence[str], sft_root: Path | None = None) -> dict[str, Any] | None:
    """One seed's start and per-arm ends (None when no arm of it has finished)."""
    from jaxpi.rl.report import load_run, summarize

    out: dict[str, Any] = {"seed": k, "arms": {}}
    starts = []
    for arm in arms:
        run_dir = root / f"seed-{k}" / ARMS[arm]
        if not (run_dir / "done.json").exists():
            continue
        run = load_run(run_dir)
        first, last = summarize(run, "eval", "first"), summarize(run, "eval", "last")
        starts.append((arm, run_dir, first))
        done = json.loads((run_dir / "done.json").read_text())
        out["arms"][arm] = {
            "dir": str(run_dir),
            "end": _point(last),
            "series": _train_series(run),
            "seconds": done["seconds"],
        }
    if not starts:
        return None
    _, dir0, first = starts[0]
    out["start"] = _point(first)
    # Both arms evaluate the same policy with the same seed before their first update.
    ref = _eval_records(dir0, first.step)
    out["start_identical"] = all(_eval_records(d, s.step) == ref for _, d, s in starts[1:])
    sft_done = (sft_root or root) / f"seed-{k}" / "sft" / "done.json"
    if sft_done.exists():
        out["sft_seconds"] = json.loads(sft_done.read_text())["seconds"]
    return out


# ---- across seeds --------------------------------------------------------------------------------
def _get(point: dict[str, Any] | None, what: str, key: str) -> float | None:
    if point is None:
        return None
    v = point[what].get(key)
    return v["value"] if isinstance(v, dict) else v


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def pass_rate_drops(seed: dict[str, Any], arm: str) -> list[str]:
    """Levels whose end pass rate (admitted or scheduled) is below the start's 95% Wilson interval."""
    start, end = seed["start"], seed["arms"][arm]["end"]
    out = []
    for what in ("pass", "sched"):
        for level, s in start[what].items():
            e = end[what].get(level)
            if s is not None and (e is None or e["value"] < s["lo"]):
                out.append(f"{what} {level}")
    return out


def aggregate(seeds: Sequence[dict[str, Any]], arms: Sequence[str], levels: Sequence[str]) -> dict[str, Any]:
    """Means over seeds with 95% t-intervals, the paired differences, and the criteria."""
    rows: dict[str, Any] = {}

    def add(name: str, values: Sequence[float | None]) -> None:
        rows[name] = {"mean": _est(t_interval(values)), "n": sum(v is not None for v in values)}

    for pair in PAIRS:
        add(f"start {pair}", [_get(s["start"], "ordering", pair) for s in seeds])
    for what in ("pass", "sched"):
        for level in levels:
            add(f"start {what} {level}", [_get(s["start"], what, level) for s in seeds])
    for level in levels:
        add(f"start T {level}", [_get(s["start"], "T", level) for s in seeds])
    for arm in arms:
        ends = [s["arms"].get(arm, {}).get("end") for s in seeds]
        for pair in PAIRS:
            add(f"{arm} {pair}", [_get(e, "ordering", pair) for e in ends])
            add(
                f"{arm} - start {pair}",
                [
                    _sub(_get(e, "ordering", pair), _get(s["start"], "ordering", pair))
                    for s, e in zip(seeds, ends, strict=True)
                ],
            )
        for what in ("pass", "sched"):
            for level in levels:
                add(f"{arm} {what} {level}", [_get(e, what, level) for e in ends])
        for level in levels:
            add(f"{arm} T {level}", [_get(e, "T", level) for e in ends])
    if set(ARMS) <= set(arms):
        for pair in PAIRS:
            diffs = []
            for s in seeds:
                a, b = (s["arms"].get(arm, {}).get("end") for arm in ("effort_ordered", "binary"))
                diffs.append(_sub(_get(a, "ordering", pair), _get(b, "ordering", pair)))
            add(f"effort_ordered - binary {pair}", diffs)
    return {"rows": rows, "criteria": criteria(seeds, arms, rows)}


def criteria(
    seeds: Sequence[dict[str, Any]], arms: Sequence[str], rows: dict[str, Any]
) -> list[dict[str, Any]]:
    """The issue's bar for "it holds", each with its measured value and whether it is met."""
    out = []
    if "effort_ordered" not in arms:
        return out
    eo = [s for s in seeds if "effort_ordered" in s["arms"]]
    ends = [_get(s["arms"]["effort_ordered"]["end"], "ordering", "low/medium") for s in eo]
    below = sum(v is not None and v < 1.0 for v in ends)
    need = math.ceil(CRITERIA_SHARE * len(eo))
    out.append(
        {
            "name": f"effort-ordered ends with T_L/T_M < 1.0 in at least {need} of {len(eo)} seeds",
            "value": f"{below} of {len(eo)}",
            "met": bool(eo) and below >= need,
        }
    )
    mean = rows["effort_ordered low/medium"]["mean"]
    hi = None if mean is None else mean["hi"]
    out.append(
        {
            "name": "upper 95% bound of effort-ordered's mean T_L/T_M below 1.0",
            "value": "–" if hi is None or not math.isfinite(hi) else f"{hi:.2f}",
            "met": hi is not None and math.isfinite(hi) and hi < 1.0,
        }
    )
    if "binary" in arms:
        b, s = rows["binary low/medium"]["mean"], rows["start low/medium"]["mean"]
        out.append(
            {
                "name": "binary's mean T_L/T_M not below the start's mean",
                "value": "–" if b is None or s is None else f"{b['value']:.2f} vs {s['value']:.2f}",
                "met": b is not None and s is not None and b["value"] >= s["value"],
            }
        )
    drops = {s["seed"]: pass_rate_drops(s, "effort_ordered") for s in eo}
    bad = {k: v for k, v in drops.items() if v}
    out.append(
        {
            "name": "no effort-ordered level's pass rate (admitted, scheduled) below the start's 95% Wilson interval, in any seed",
            "value": "none" if not bad else "; ".join(f"seed {k}: {', '.join(v)}" for k, v in bad.items()),
            "met": bool(eo) and not bad,
        }
    )
    return out


# ---- tables and the picture ----------------------------------------------------------------------
def _r(e: dict[str, float] | None, interval: bool = True) -> str:
    if e is None:
        return "–"
    text = f"{e['value']:.2f}"
    if interval and math.isfinite(e["lo"]) and math.isfinite(e["hi"]):
        text += f" [{e['lo']:.2f}, {e['hi']:.2f}]"
    return text


def _pcts(point: dict[str, Any] | None, what: str, levels: Sequence[str]) -> str:
    if point is None:
        return "–"
    vals = [point[what].get(level) for level in levels]
    return " / ".join("–" if v is None else f"{100 * v['value']:.0f}" for v in vals)


_md = markdown_table


def tables(
    seeds: Sequence[dict[str, Any]], agg: dict[str, Any], arms: Sequence[str], levels: Sequence[str]
) -> str:
    """Per-seed tables (ratios, pass rates) and the across-seed summary, in Markdown."""
    ini = "/".join(lv[0].upper() for lv in levels)
    header = ["seed", "start T_L/T_M"] + [f"{ARMS[a]} T_L/T_M" for a in arms]
    if set(ARMS) <= set(arms):
        header.append("EO − binary")
    header += ["start T_M/T_X"] + [f"{ARMS[a]} T_M/T_X" for a in arms]
    body = []
    for s in seeds:
        ends = [s["arms"].get(a, {}).get("end") for a in arms]
        row = [str(s["seed"]), _r(s["start"]["ordering"]["low/medium"])]
        row += ["–" if e is None else _r(e["ordering"]["low/medium"]) for e in ends]
        if set(ARMS) <= set(arms):
            a, b = (s["arms"].get(x, {}).get("end") for x in ("effort_ordered", "binary"))
            d = _sub(_get(a, "ordering", "low/medium"), _get(b, "ordering", "low/medium"))
            row.append("–" if d is None else f"{d:+.2f}")
        row += [_r(s["start"]["ordering"]["medium/xhigh"])]
        row += ["–" if e is None else _r(e["ordering"]["medium/xhigh"]) for e in ends]
        body.append(row)
    per_seed = _md(header, body)

    header = ["seed", f"start pass {ini}", f"start sched {ini}"]
    for a in arms:
        header += [f"{ARMS[a]} pass", f"{ARMS[a]} sched"]
    header += [f"{ARMS[a]} T {ini}" for a in arms]
    body = []
    for s in seeds:
        row = [str(s["seed"]), _pcts(s["start"], "pass", levels), _pcts(s["start"], "sched", levels)]
        for a in arms:
            e = s["arms"].get(a, {}).get("end")
            row += [_pcts(e, "pass", levels), _pcts(e, "sched", levels)]
        for a in arms:
            e = s["arms"].get(a, {}).get("end")
            row.append(
                "–"
                if e is None
                else " / ".join(
                    f"{_get(e, 'T', lv):.0f}" if _get(e, "T", lv) is not None else "–" for lv in levels
                )
            )
        body.append(row)
    rates = _md(header, body)

    rows = agg["rows"]
    names = [("start", "start")] + [(a, ARMS[a]) for a in arms]
    header = ["across seeds (mean [95% t])", "n", "T_L/T_M", "T_M/T_X"]
    header += [f"pass {lv[0].upper()}" for lv in levels] + [f"sched {lv[0].upper()}" for lv in levels]
    body = []
    for key, label in names:
        n = rows[f"{key} low/medium"]["n"]
        row = [label, str(n)] + [_r(rows[f"{key} {p}"]["mean"]) for p in PAIRS]
        for what in ("pass", "sched"):
            for lv in levels:
                e = rows[f"{key} {what} {lv}"]["mean"]
                row.append(
                    "–"
                    if e is None
                    else f"{100 * e['value']:.0f}"
                    # A mean of proportions lies in [0, 1]; so does its interval, shown clipped.
                    + (
                        f" [{100 * max(e['lo'], 0.0):.0f}, {100 * min(e['hi'], 1.0):.0f}]"
                        if math.isfinite(e["lo"])
                        else ""
                    )
                )
        body.append(row)
    diffs = [(f"{a} - start", f"{ARMS[a]} − start") for a in arms]
    if set(ARMS) <= set(arms):
        diffs.append(("effort_ordered - binary", "effort-ordered − binary"))
    for key, label in diffs:
        row = [f"{label} (paired)", str(rows[f"{key} low/medium"]["n"])]
        row += [_r(rows[f"{key} {p}"]["mean"]) for p in PAIRS] + [""] * (2 * len(levels))
        body.append(row)
    summary = _md(header, body)

    crit = "\n".join(f"- [{'x' if c['met'] else ' '}] {c['name']}: {c['value']}" for c in agg["criteria"])
    notes = (
        "Held-out evaluation before the first update (start) and after the last. Per seed: ratios "
        "[95% bootstrap over tasks]; pass rates over admitted / scheduled attempts, in % per level "
        f"({ini}). Across seeds: the mean over seeds [95% t-interval, n − 1 degrees of freedom; "
        "pass rates clipped to 0-100]; "
        "paired rows are the mean of per-seed differences (same start, same seed)."
    )
    return "\n\n".join(x for x in (per_seed, rates, summary, notes, crit) if x)


def plot_study(
    seeds: Sequence[dict[str, Any]], arms: Sequence[str], path: Path, rows: dict[str, Any]
) -> Path:
    """T_L/T_M against update: one panel per arm, the training collections of every seed thin,
    their mean over seeds thick, the held-out start and end as points with their t-intervals."""
    from jaxpi.rl.report import _atomic_savefig, _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(arms), figsize=(6 * len(arms), 4.2), sharey=True, squeeze=False)
    colours = {"effort_ordered": "tab:blue", "binary": "tab:orange"}
    for ax, arm in zip(axes[0], arms, strict=True):
        c = colours[arm]
        curves = {}
        for s in seeds:
            series = s["arms"].get(arm, {}).get("series")
            if not series:
                continue
            x = [p[0] for p in series if p[1] is not None]
            y = [p[1] for p in series if p[1] is not None]
            ax.plot(x, y, "-", color=c, lw=0.8, alpha=0.45)
            curves[s["seed"]] = dict(series)
        steps = sorted({x for cur in curves.values() for x in cur})
        if steps:
            # A collection where no seed has a ratio (a level with no admitted success) is a gap.
            at = [[cur[x] for cur in curves.values() if cur.get(x) is not None] for x in steps]
            mean = [float(np.mean(v)) if v else math.nan for v in at]
            ax.plot(
                steps, mean, "-", color=c, lw=2.8, label=f"training collections, mean of {len(curves)} seeds"
            )
            for key, x, marker in (("start", 0, "s"), (arm, steps[-1] + 1, "D")):
                e = rows[f"{key} low/medium"]["mean"]
                if e is None:
                    continue
                err = [[e["value"] - e["lo"]], [e["hi"] - e["value"]]] if math.isfinite(e["lo"]) else None
                ax.errorbar(
                    x,
                    e["value"],
                    yerr=err,
                    fmt=marker,
                    color="k" if key == "start" else c,
                    ms=7,
                    capsize=4,
                    label=("held-out start" if key == "start" else "held-out end") + " [95% t over seeds]",
                )
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_title(f"{ARMS[arm]} GRPO ({len(curves)} seeds)")
        ax.set_xlabel("policy updates")
        ax.grid(alpha=0.3)
        if curves:
            ax.legend(fontsize="small", loc="upper right")
    axes[0, 0].set_ylabel("T_L/T_M (above 1: low reasons longer)")
    try:
        return _atomic_savefig(fig, path)
    finally:
        plt.close(fig)


# ---- how noisy is one evaluation ---------------------------------------------------------------------
def eval_noise(
    adapter: str | Path,
    spec: StudySpec,
    samplings: Sequence[int],
    say: Callable[[str], Any] = print,
    reference: Mapping[int, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The GRPO run's step-0 evaluation of one policy (`adapter`, an SFT run) sampled with several
    seeds: the trainer's own policy loading, engine, collector and eval seeds
    (`collection_seed(seed, 0, "eval")`), so sampling i is exactly the start evaluation a
    `jaxpi grpo` run with train.seed=i makes. Returns each sampling's T_L/T_M, T_M/T_X and pass
    rates and their spread over samplings."""
    import tempfile

    import jax
    from flax import nnx

    from jaxpi.configfile import load_config
    from jaxpi.data.render import RenderConfig, load_tokenizer
    from jaxpi.rl.config import GRPOConfig
    from jaxpi.rl.report import level_stats, ordering_ratios
    from jaxpi.rl.reward import score_collection
    from jaxpi.rl.trainer import (
        Collector,
        attempt_records,
        collection_attempts,
        collection_seed,
        load_policy,
        make_env,
    )
    from jaxpi.rollout.jax_engine import JaxEngine

    reference = reference or {}
    cfg = load_config(GRPOConfig, GRPO_CONFIG, [*spec.grpo_overrides, f"model.adapter={adapter}"])
    levels = cfg.reward.levels
    with tempfile.TemporaryDirectory() as tmp:
        pol = load_policy(cfg, Path(tmp), jax.random.fold_in(jax.random.key(0), 1))
    tok = load_tokenizer(pol.tokenizer_dir)
    render_cfg = RenderConfig(tokenizer_dir=str(pol.tokenizer_dir))
    _, _, held = make_env(cfg)
    engine = JaxEngine(
        nnx.merge(pol.graphdef, pol.train, pol.rest),
        max_len=cfg.collect.max_context,
        batch_size=cfg.collect.engine_batch or cfg.rows,
    )
    collector = Collector(cfg, engine, tok, make_env(cfg)[0], render_cfg)
    rows = []
    for seed in samplings:
        t0 = time.time()
        trajs = collector.run(held, cfg.train.eval_group, collection_seed(seed, 0, "eval"))
        attempts = collection_attempts(trajs, [0] * len(trajs), 0, cfg.collect.max_staleness)
        recs = attempt_records("eval", 0, trajs, score_collection(attempts, cfg.reward))
        ratios = ordering_ratios(recs, levels)
        stats = level_stats(recs, levels)
        row = {
            "seed": seed,
            "ordering": {k: _value(v) for k, v in ratios.items()},
            "T": {lv: _value(st.reasoning_tokens) for lv, st in stats.items()},
            "pass": {lv: _value(st.pass_rate) for lv, st in stats.items()},
            "sched": {lv: _value(st.pass_rate_scheduled) for lv, st in stats.items()},
            "seconds": round(time.time() - t0, 1),
        }
        if seed in reference:  # the start evaluation a study run with this seed made
            row["matches_run"] = json.loads(json.dumps(recs)) == reference[seed]
        rows.append(row)
        say(
            f"sampling seed {seed}: T_L/T_M {row['ordering']['low/medium']:.3f}, "
            f"T_M/T_X {row['ordering']['medium/xhigh']:.3f} ({row['seconds']:.0f} s)"
        )
    spread = {}
    for pair in PAIRS:
        xs = np.asarray([r["ordering"][pair] for r in rows], np.float64)
        spread[pair] = {
            "mean": float(xs.mean()),
            "sd": float(xs.std(ddof=1)) if xs.size > 1 else math.nan,
            "min": float(xs.min()),
            "max": float(xs.max()),
        }
    return {
        "adapter": str(adapter),
        "tasks": len(held),
        "attempts_per_level": len(held) * cfg.train.eval_group,
        "samplings": rows,
        "spread": spread,
    }


# ---- the whole study -----------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """What ran it: CPU model, cores, whether the CPU has AVX-512, XLA_FLAGS, jax version."""
    import platform

    model, flags = platform.processor() or "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    import jax

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
    }


def report(root: Path, spec: StudySpec, state: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read every finished run of the study and write `report/` (tables, picture, study.json)."""
    levels = ("low", "medium", "xhigh")
    starts = Path(spec.starts) if spec.starts else None
    seeds = [s for k in spec.seeds if (s := read_seed(root, k, spec.arms, starts)) is not None]
    out = {
        "out": str(root),
        "spec": dataclasses.asdict(spec),
        "machine": machine(),
        "state": dict(state or {}),
    }
    if not seeds:
        out.update(seeds=[], table="no finished GRPO run yet", images=[])
        return out
    agg = aggregate(seeds, spec.arms, levels)
    table = tables(seeds, agg, spec.arms, levels)
    not_identical = [s["seed"] for s in seeds if not s["start_identical"]]
    if not_identical:
        table += f"\n\nWARNING: the arms' start evaluations differ in seeds {not_identical} (same policy, same seed)"
    image = plot_study(seeds, spec.arms, root / "report" / "ordering.png", agg["rows"])
    run_seconds = sum(a["seconds"] for s in seeds for a in s["arms"].values()) + sum(
        s.get("sft_seconds", 0) for s in seeds
    )
    out.update(seeds=seeds, summary=agg, table=table, images=[str(image)], run_seconds=round(run_seconds, 1))
    text = json.dumps(_finite(out), indent=2) + "\n"
    _write_atomic(root / "report" / "study.json", text)
    _write_atomic(root / "report" / "table.md", table + "\n")
    return out


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def run_study(
    root: str | Path,
    spec: StudySpec,
    *,
    parallel: int = 2,
    env: Mapping[str, str] | None = None,
    say: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run (or resume) the study under `root`, then report it."""
    root = Path(root).absolute()
    prepare(root, spec)
    t0 = time.time()
    state = run_jobs(plan(root, spec), root / "logs", parallel=parallel, env=env, say=say)
    result = report(root, spec, state)
    result["wall_seconds"] = round(time.time() - t0, 1)
    return result


# ---- command line --------------------------------------------------------------------------------
def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi study` on the CLI's subparsers."""
    p = sub.add_parser(
        "study",
        help="the toy effort-ordering result over K seeds of effort-ordered and binary GRPO, with "
        "intervals across seeds; resumable",
        description="For every seed k: a toy SFT start (configs/sft/toy.yaml, train.seed=k), then "
        "effort-ordered and binary GRPO from it (configs/grpo/toy.yaml, train.seed=k), each a `jaxpi` "
        "subprocess, --jobs at a time. Rerunning the command skips finished runs and resumes interrupted "
        "ones from their checkpoints. Writes OUT/report/ (table.md, ordering.png, study.json): per seed "
        "the start's and the ends' T_L/T_M, T_M/T_X and pass rates; across seeds the means with 95% "
        "t-intervals and the paired difference effort-ordered - binary.",
    )
    p.add_argument("--out", required=True, help="the study's directory (rerun with the same one to resume)")
    p.add_argument("--seeds", type=int, default=5, help="seeds first-seed .. first-seed+K-1 (default 5)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--arms", default="effort_ordered,binary", help="reward kinds to run (comma list)")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="runs at a time (default: 2 where there are 2 cores; docs/grpo.md measures 1 against 2)",
    )
    p.add_argument("--short", action="store_true", help="the two-update machinery version (toy-random base)")
    p.add_argument(
        "--sft", action="append", default=[], metavar="KEY=VALUE", help="SFT config override (repeatable)"
    )
    p.add_argument(
        "--grpo", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override (repeatable)"
    )
    p.add_argument(
        "--starts",
        default=None,
        metavar="STUDY_DIR",
        help="reuse another study's finished SFT runs as the starts",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="start nothing; report the finished runs of the study in --out (its own settings)",
    )
    p.add_argument(
        "--eval-noise",
        type=int,
        default=0,
        metavar="N",
        help="start nothing: sample the first seed's start evaluation (as `jaxpi grpo` makes it) with N "
        "sampling seeds and print how T_L/T_M varies between samplings of one policy",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the tables")
    p.set_defaults(fn=cmd_study)
    return p


def cmd_study(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.first_seed < 0:
        raise ValueError(f"--seeds must be >= 1 and --first-seed >= 0, got {args.seeds}, {args.first_seed}")
    spec = StudySpec(
        seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)),
        arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        short=args.short,
        sft=tuple(args.sft),
        grpo=tuple(args.grpo),
        starts=str(Path(args.starts).absolute()) if args.starts else None,
    )
    say = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if args.json
        else (lambda line: print(line, flush=True))
    )
    if args.eval_noise:
        k = spec.seeds[0]
        adapter = Path(spec.starts or args.out).absolute() / f"seed-{k}" / "sft"
        if not (adapter / "done.json").exists():
            raise FileNotFoundError(f"{adapter}: no finished SFT run to evaluate")
        # Sampling k first: the start evaluation of the study's own seed-k runs, where they exist.
        ref = {}
        for arm in spec.arms:
            path = Path(args.out).absolute() / f"seed-{k}" / ARMS[arm] / "attempts.jsonl"
            if path.exists():
                ref[k] = _eval_records(path.parent, 0)
                break
        seeds = [k, *range(1000, 1000 + args.eval_noise - 1)]
        result = eval_noise(adapter, spec, seeds, say=say, reference=ref)
        sp = result["spread"]
        print(
            json.dumps(_finite(result), indent=2)
            if args.json
            else "\n".join(
                f"{pair}: mean {v['mean']:.3f}, sd {v['sd']:.3f}, range {v['min']:.3f}-{v['max']:.3f} over "
                f"{len(result['samplings'])} samplings of {result['attempts_per_level']} attempts per level"
                for pair, v in sp.items()
            )
        )
        return 0
    if args.report_only:
        root = Path(args.out).absolute()
        result = report(root, saved_spec(root, spec.seeds))
    else:
        try:
            result = run_study(args.out, spec, parallel=args.jobs, say=say)
        except KeyboardInterrupt:
            print(f"jaxpi study: stopped; rerun the same command to resume {args.out}", file=sys.stderr)
            return 130
    failed = {k: v for k, v in result["state"].items() if not v.startswith(("done", "ran"))}
    if args.json:
        print(json.dumps(_finite(result), indent=2))
    else:
        print(result["table"])
        if result.get("images"):
            print("\n" + "\n".join(f"wrote {p}" for p in result["images"]))
            print(f"wrote {Path(args.out) / 'report' / 'study.json'}, table.md")
        if "wall_seconds" in result:
            print(
                f"study wall time {result['wall_seconds']:.0f} s; the runs' own time summed {result.get('run_seconds', 0):.0f} s"
            )
        for name, why in failed.items():
            print(f"{name}: {why}", file=sys.stderr)
    return 1 if failed else 0

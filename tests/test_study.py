"""`jaxpi study` on a 2-seed, 2-update toy study (the short version on the toy-random base, at the
size of test_grpo_run.py): the runs, the per-seed numbers against attempts.jsonl, the statistics
across seeds, the picture, a rerun that skips everything, a rerun with other settings refused,
and a study killed mid-run whose resumed run repeats the uninterrupted one exactly (same machine,
config and seed: identical metrics). The statistics, the criteria and the tables also on fixed
numbers."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from jaxpi.experiments.toy import study_config, study_run, study_stats, study_tables
from jaxpi.stats.intervals import t_interval, t_quantile
from jaxpi.testing.xla import child_env

SFT = [
    "data.toy_reasoning=[17,40,17,40,17,40]",
    "data.toy_examples=48",
    "data.seq_len=384",
    "train.steps=20",
    "train.eval_every=0",
    "train.checkpoint_every=20",
]
GRPO = [
    "collect.tasks=2",
    "collect.group=2",
    "collect.max_new_tokens=64",
    "collect.max_context=384",
    "collect.row_bucket=384",
    "train.checkpoint_every=1",
    "env.eval_tasks=2",
    "train.eval_group=2",
]
TIMING = {"collect_s", "update_s", "tokens_per_s", "time"}


def command(out: Path, *extra: str, sft: list[str] = SFT, grpo: list[str] = GRPO) -> list[str]:
    args = [sys.executable, "-m", "jaxpi.cli", "study", "--short", "--out", str(out), *extra]
    args += [f"--sft={o}" for o in sft] + [f"--grpo={o}" for o in grpo]
    return [*args, "--json"]


def environ() -> dict[str, str]:
    env = child_env(fast_compile=False)  # one device and XLA's defaults, as a user's CPU run
    env["JAX_PLATFORMS"] = "cpu"
    return env


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """The study in three commands. First the binary arm of both seeds, one run at a time, so that
    every program is compiled once and later runs load it from the compilation cache. Then both
    arms, two runs at a time, SIGKILLed once seed 0's effort-ordered run has saved its first
    checkpoint (the runs at work must die with it); then the same command again to the end."""
    out = tmp_path_factory.mktemp("study") / "s"
    first = subprocess.run(
        command(out, "--seeds", "2", "--arms", "binary", "--jobs", "1"),
        env=environ(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert first.returncode == 0, first.stderr[-4000:]
    argv = command(out, "--seeds", "2", "--jobs", "2")
    proc = subprocess.Popen(argv, env=environ(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = out / "seed-0" / "effort-ordered"
    deadline, children, most = time.time() + 900, set(), 0
    while time.time() < deadline and proc.poll() is None and not (run / "checkpoints" / "1").is_dir():
        now = set(_children(proc.pid))
        children, most = children | now, max(most, len(now))
        time.sleep(0.05)
    assert proc.poll() is None, "the study ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = {
        "children": children,
        "most_at_once": most,
        "alive": [c for c in children if _wait_gone(c)],
        "done_before": not (run / "done.json").exists(),
    }
    resumed = subprocess.run(argv, env=environ(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return out, json.loads(resumed.stdout), resumed.stderr, killed


def _wait_gone(pid: int, timeout: float = 30) -> bool:
    """True if the process is still there after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    return Path(f"/proc/{pid}").exists()


def ratio_by_hand(run_dir: Path, step: int, lo: str, hi: str) -> float:
    recs = [r for r in lines(run_dir / "attempts.jsonl") if r["split"] == "eval" and r["step"] == step]
    mean = lambda lv: np.mean([r["reasoning_tokens"] for r in recs if r["level"] == lv and r["admitted"]])  # noqa: E731
    return float(mean(lo) / mean(hi))


def test_study_runs_every_seed_and_arm_and_reports_them(done):
    out, result, _, _ = done
    assert sorted(result["state"]) == sorted(
        f"seed-{k}/{r}" for k in (0, 1) for r in ("sft", "effort-ordered", "binary")
    )
    assert all((out / name / "done.json").exists() for name in result["state"])
    seeds = result["seeds"]
    assert [s["seed"] for s in seeds] == [0, 1]
    for s in seeds:
        k = s["seed"]
        # Two processes evaluated the same policy with the same seed before their first update.
        assert s["start_identical"]
        for arm, name in study_config.ARMS.items():
            run = out / f"seed-{k}" / name
            cfg = json.loads((run / "config.json").read_text())
            assert cfg["train"]["seed"] == k and cfg["reward"]["kind"] == arm
            assert cfg["model"]["adapter"] == str(out / f"seed-{k}" / "sft")
            assert cfg["train"]["collections"] == 2
            end = s["arms"][arm]["end"]
            assert end["step"] == 2
            assert end["ordering"]["low/medium"]["value"] == pytest.approx(
                ratio_by_hand(run, 2, "low", "medium")
            )
            assert [x for x, _ in s["arms"][arm]["series"]] == [0, 1]
        assert s["start"]["ordering"]["medium/xhigh"]["value"] == pytest.approx(
            ratio_by_hand(out / f"seed-{k}" / "binary", 0, "medium", "xhigh")
        )
    # Each seed is its own start: the two SFT runs differ.
    a, b = (json.loads((out / f"seed-{k}" / "sft" / "config.json").read_text()) for k in (0, 1))
    assert (a["train"]["seed"], b["train"]["seed"]) == (0, 1)

    rows = result["summary"]["rows"]
    eo = [s["arms"]["effort_ordered"]["end"]["ordering"]["low/medium"]["value"] for s in seeds]
    bi = [s["arms"]["binary"]["end"]["ordering"]["low/medium"]["value"] for s in seeds]
    want = t_interval(eo)
    assert rows["effort_ordered low/medium"]["mean"] == pytest.approx(
        {"value": want.value, "lo": want.lo, "hi": want.hi}
    )
    d = [x - y for x, y in zip(eo, bi, strict=True)]
    got = rows["effort_ordered - binary low/medium"]["mean"]
    assert got["value"] == pytest.approx(np.mean(d))
    assert got["hi"] - got["value"] == pytest.approx(12.706205 * np.std(d, ddof=1) / math.sqrt(2))
    assert [c["name"][:14] for c in result["summary"]["criteria"]] == [
        "effort-ordered",
        "upper 95% boun",
        "binary's mean ",
        "no effort-orde",
    ]
    png = out / "report" / "ordering.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["images"] == [str(png)]
    table = (out / "report" / "table.md").read_text()
    assert "| 0    |" in table and "| 1    |" in table and "effort-ordered − binary (paired)" in table
    assert json.loads((out / "report" / "study.json").read_text())["machine"]["cores"] == os.cpu_count()


def test_rerun_skips_finished_runs_and_refuses_other_settings(done):
    out, result, _, _ = done
    proc = subprocess.run(
        command(out, "--seeds", "2"), env=environ(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(proc.stdout)
    assert "start seed-" not in proc.stderr and set(again["state"].values()) == {"done"}
    assert again["seeds"] == result["seeds"] and again["table"] == result["table"]

    proc = subprocess.run(
        command(out, "--seeds", "2", grpo=[*GRPO, "reward.phi_scale=0.5"]),
        env=environ(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "different settings (grpo.reward.phi_scale)" in proc.stderr
    proc = subprocess.run(
        command(out, grpo=[*GRPO, "train.seed=3"]), env=environ(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "train.seed is set by the study" in proc.stderr


def test_killed_study_left_no_run_behind_and_resumed_it(done):
    out, result, stderr, killed = done
    assert killed["most_at_once"] >= 2, "the study ran fewer than two runs at a time"
    assert not killed["alive"], "a run outlived the killed study"
    assert killed["done_before"], "seed 0's effort-ordered run finished before the kill"
    # The rerun resumed that run from its checkpoint and ran everything left.
    assert "start seed-0/effort-ordered (resuming)" in stderr
    assert "resumed from" in (out / "logs" / "seed-0-effort-ordered.log").read_text()
    assert "start seed-0/sft" not in stderr
    assert set(result["state"].values()) <= {"done", "ran"} and "ran" in result["state"].values()


def test_starts_reuse_another_studys_sft_runs_and_never_start_them(done, tmp_path):
    """`--starts`: the SFT jobs are the other study's finished runs (reused, never started), each
    GRPO run reads its seed's adapter from there; a start that is not finished stops the study
    before any process starts. (The run itself: the slow test below.)"""
    first = done[0]
    spec = study_config.StudySpec(seeds=(0, 1), arms=("binary",), short=True, starts=str(first))
    jobs = study_run.plan(tmp_path / "again", spec)
    assert [(j.name, j.reuse, j.done) for j in jobs] == [
        ("seed-0/sft", True, True),
        ("seed-0/binary", False, False),
        ("seed-1/sft", True, True),
        ("seed-1/binary", False, False),
    ]
    assert jobs[1].run_dir == tmp_path / "again" / "seed-0" / "binary"
    assert f"model.adapter={first / 'seed-0' / 'sft'}" in jobs[1].argv
    unfinished = tmp_path / "unfinished"
    (unfinished / "seed-0" / "sft").mkdir(parents=True)
    spec = study_config.StudySpec(seeds=(0,), arms=("binary",), short=True, starts=str(unfinished))
    started = []
    with pytest.raises(FileNotFoundError, match="not a finished run"):
        study_run.run_jobs(study_run.plan(tmp_path / "b", spec), tmp_path / "b" / "logs", say=started.append)
    assert started == [] and not (tmp_path / "b" / "seed-0").exists()


@pytest.mark.slow
def test_same_seed_same_metrics(done, tmp_path):
    """Seed 0's effort-ordered run again, in another study on the same start: its metrics and
    attempts are the first study's (killed and resumed there) bit for bit, timings aside. (A
    killed and resumed GRPO run repeating the uninterrupted one is also test_grpo_run.py's.)"""
    first = done[0]
    out = tmp_path / "again"
    argv = command(out, "--seeds", "1", "--arms", "effort_ordered", "--starts", str(first), sft=[])
    proc = subprocess.run(argv, env=environ(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, ref = out / "seed-0" / "effort-ordered", first / "seed-0" / "effort-ordered"
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIMING} for m in ms]  # noqa: E731
    assert strip(lines(run / "metrics.jsonl")) == strip(lines(ref / "metrics.jsonl"))
    assert lines(run / "attempts.jsonl") == lines(ref / "attempts.jsonl")
    assert not (out / "seed-0" / "sft").exists()  # the starts study's SFT is read, never run again


def test_t_quantile_and_interval():
    scipy_t = pytest.importorskip("scipy.stats").t
    for df in (1, 2, 4, 9, 30, 31, 60, 200):
        assert t_quantile(df) == pytest.approx(scipy_t.ppf(0.975, df), abs=2e-4), df
    e = t_interval([1.0, 2.0, 3.0, None, 6.0])
    half = scipy_t.ppf(0.975, 3) * np.std([1, 2, 3, 6], ddof=1) / 2
    assert (
        e.value == 3.0
        and e.lo == pytest.approx(3 - half, abs=1e-5)
        and e.hi == pytest.approx(3 + half, abs=1e-5)
    )
    one = t_interval([0.8])
    assert one.value == 0.8 and math.isnan(one.lo) and t_interval([None]) is None
    with pytest.raises(ValueError, match="df"):
        t_quantile(0)


def _point(lm: float, passes: dict[str, tuple[float, float]]) -> dict:
    est = lambda v, lo=None: {"value": v, "lo": v if lo is None else lo, "hi": v}  # noqa: E731
    return {
        "step": 0,
        "ordering": {"low/medium": est(lm), "medium/xhigh": est(0.5)},
        "pass": {lv: est(*p) for lv, p in passes.items()},
        "sched": {lv: est(*p) for lv, p in passes.items()},
        "T": {"low": 40 * lm, "medium": 40.0, "xhigh": 80.0},
    }


def _seeds(eo_ends: list[float], bin_ends: list[float], start: float = 1.2, xhigh_end: float = 0.95):
    ok = {"low": (0.98, 0.9), "medium": (1.0, 0.92), "xhigh": (0.98, 0.9)}
    out = []
    for k, (e, b) in enumerate(zip(eo_ends, bin_ends, strict=True)):
        end = {**ok, "xhigh": (xhigh_end if k == 0 else 0.97, None)}
        out.append(
            {
                "seed": k,
                "start": _point(start, ok),
                "arms": {"effort_ordered": {"end": _point(e, end)}, "binary": {"end": _point(b, ok)}},
            }
        )
    return out


def test_start_check_compares_samples_not_the_arms_scores(tmp_path):
    """The arms score one policy's start samples with their own rewards: a reward or advantage
    that differs is no difference in the policy's samples; a token count that differs is."""
    rec = {"split": "eval", "step": 0, "level": "low", "reasoning_tokens": 58, "success": True}
    runs = {}
    for name, extra in {
        "eo": {"reward": 0.54, "advantage": 0.1},
        "bin": {"reward": 1.0, "advantage": 0.0},
        "other": {"reward": 1.0, "advantage": 0.0, "reasoning_tokens": 59},
    }.items():
        runs[name] = tmp_path / name
        runs[name].mkdir()
        train = {**rec, "split": "train", "reasoning_tokens": 7}
        text = "\n".join(json.dumps(r) for r in ({**rec, **extra}, train))
        (runs[name] / "attempts.jsonl").write_text(text + "\n")
    assert study_stats.eval_records(runs["eo"], 0) == study_stats.eval_records(runs["bin"], 0)
    assert study_stats.eval_records(runs["eo"], 0) != study_stats.eval_records(runs["other"], 0)
    assert len(study_stats.eval_records(runs["eo"], 0)) == 1


def test_a_resumed_run_counts_the_time_of_every_process(tmp_path, monkeypatch):
    """done.json's seconds: the earlier processes' time (written to logs/ while they ran) plus the
    last one's; a run started afresh ignores a stale record; the record goes once the run is done."""
    monkeypatch.setattr(study_run, "ELAPSED_EVERY_S", 0.05)
    logs = tmp_path / "logs"
    logs.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(0.4)"]
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    (resumed / "checkpoints").mkdir(parents=True)  # what a killed run leaves behind
    fresh.mkdir()  # (the runs make their own directories; these commands do not)
    for name in ("resumed", "fresh"):
        (logs / f"{name}.seconds").write_text(json.dumps({"seconds": 100.0}) + "\n")
    jobs = [study_run.Job("resumed", resumed, sleep), study_run.Job("fresh", fresh, sleep)]
    said: list[str] = []
    state = study_run.run_jobs(jobs, logs, parallel=2, say=said.append, poll_s=0.01)
    assert state == {"resumed": "ran", "fresh": "ran"}
    for run, earlier in ((resumed, 100.0), (fresh, 0.0)):
        done = json.loads((run / "done.json").read_text())
        assert 0.4 <= done["seconds_last_process"] < 30
        assert done["seconds"] == pytest.approx(earlier + done["seconds_last_process"], abs=0.11)
    assert not list(logs.glob("*.seconds"))
    assert any("with the earlier processes" in s for s in said if s.startswith("done  resumed"))


def test_a_running_job_writes_its_time_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(study_run, "ELAPSED_EVERY_S", 0.05)
    logs, run = tmp_path / "logs", tmp_path / "run"
    job = study_run.Job("seed-0/x", run, [sys.executable, "-c", "import time; time.sleep(60)"])
    seen: list[float] = []

    def watch(line: str) -> None:  # called when the job starts: poll its record from a thread
        import threading

        def poll() -> None:
            path = logs / "seed-0-x.seconds"
            deadline = time.time() + 20
            while time.time() < deadline and not seen:
                if path.exists():
                    seen.append(json.loads(path.read_text())["seconds"])
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)  # stop the study: its child goes with it

        threading.Thread(target=poll, daemon=True).start()

    with pytest.raises(KeyboardInterrupt):
        study_run.run_jobs([job], logs, parallel=1, say=watch, poll_s=0.01)
    assert seen and 0 < seen[0] < 20
    assert not (run / "done.json").exists()


def test_picture_leaves_a_gap_where_no_seed_has_a_ratio(tmp_path):
    """A collection in which no seed has T_L/T_M (no admitted success at a level: a broken policy)
    is a gap in the mean curve, not a numpy warning."""
    seeds = [{"seed": 0, "arms": {"effort_ordered": {"series": [(0, 1.2), (1, None), (2, 0.9)]}}}]
    rows = {"start low/medium": {"mean": None}, "effort_ordered low/medium": {"mean": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        image = study_tables.plot_study(seeds, ["effort_ordered"], tmp_path / "ordering.png", rows)
    assert Path(image).stat().st_size > 0


def test_criteria_met_and_each_one_failing():
    levels = ("low", "medium", "xhigh")
    arms = tuple(study_config.ARMS)
    crit = lambda seeds: [c["met"] for c in study_stats.aggregate(seeds, arms, levels)["criteria"]]  # noqa: E731
    assert crit(_seeds([0.8, 0.82, 0.85, 0.8, 1.01], [1.3, 1.2, 1.25, 1.2, 1.3])) == [True] * 4
    # Only 3 of 5 below 1.0 (and the mean's upper bound above it).
    assert crit(_seeds([0.8, 0.85, 1.02, 0.9, 1.05], [1.3] * 5))[:2] == [False, False]
    # 4 of 5 below, but one far above: the mean's upper bound is not below 1.0.
    assert crit(_seeds([0.9, 0.95, 0.97, 0.96, 1.6], [1.3] * 5))[:2] == [True, False]
    # Binary also fixed it: its mean is below the start's.
    assert crit(_seeds([0.8] * 5, [1.1, 1.0, 1.2, 1.15, 1.1]))[2] is False
    # Seed 0's xhigh pass rate fell below the start's interval (0.9).
    seeds = _seeds([0.8] * 5, [1.3] * 5, xhigh_end=0.85)
    c = study_stats.aggregate(seeds, arms, levels)["criteria"][3]
    assert c["met"] is False and c["value"] == "seed 0: pass xhigh, sched xhigh"
    rows = study_stats.aggregate(seeds, arms, levels)["rows"]
    assert rows["effort_ordered - binary low/medium"]["mean"]["value"] == pytest.approx(-0.5)
    assert rows["effort_ordered - start low/medium"]["mean"]["value"] == pytest.approx(-0.4)


def test_tables_bytes_on_fixed_numbers():
    """The study's tables byte for byte on fixed per-seed numbers: the per-seed ratios and pass
    rates, the across-seed means with their t-intervals, the paired rows, the notes, the criteria."""
    levels = ("low", "medium", "xhigh")
    arms = tuple(study_config.ARMS)
    seeds = _seeds([0.8, 0.95, 1.1], [1.3, 1.2, 1.25], xhigh_end=0.85)
    agg = study_stats.aggregate(seeds, arms, levels)
    assert study_tables.tables(seeds, agg, arms, levels).splitlines() == [
        "| seed |     start T_L/T_M | effort-ordered T_L/T_M |    binary T_L/T_M | EO − binary |     start T_M/T_X | effort-ordered T_M/T_X |    binary T_M/T_X |",
        "|:-----|------------------:|-----------------------:|------------------:|------------:|------------------:|-----------------------:|------------------:|",
        "| 0    | 1.20 [1.20, 1.20] |      0.80 [0.80, 0.80] | 1.30 [1.30, 1.30] |       -0.50 | 0.50 [0.50, 0.50] |      0.50 [0.50, 0.50] | 0.50 [0.50, 0.50] |",
        "| 1    | 1.20 [1.20, 1.20] |      0.95 [0.95, 0.95] | 1.20 [1.20, 1.20] |       -0.25 | 0.50 [0.50, 0.50] |      0.50 [0.50, 0.50] | 0.50 [0.50, 0.50] |",
        "| 2    | 1.20 [1.20, 1.20] |      1.10 [1.10, 1.10] | 1.25 [1.25, 1.25] |       -0.15 | 0.50 [0.50, 0.50] |      0.50 [0.50, 0.50] | 0.50 [0.50, 0.50] |",
        "",
        "| seed | start pass L/M/X | start sched L/M/X | effort-ordered pass | effort-ordered sched |   binary pass |  binary sched | effort-ordered T L/M/X | binary T L/M/X |",
        "|:-----|-----------------:|------------------:|--------------------:|---------------------:|--------------:|--------------:|-----------------------:|---------------:|",
        "| 0    |    98 / 100 / 98 |     98 / 100 / 98 |       98 / 100 / 85 |        98 / 100 / 85 | 98 / 100 / 98 | 98 / 100 / 98 |           32 / 40 / 80 |   52 / 40 / 80 |",
        "| 1    |    98 / 100 / 98 |     98 / 100 / 98 |       98 / 100 / 97 |        98 / 100 / 97 | 98 / 100 / 98 | 98 / 100 / 98 |           38 / 40 / 80 |   48 / 40 / 80 |",
        "| 2    |    98 / 100 / 98 |     98 / 100 / 98 |       98 / 100 / 97 |        98 / 100 / 97 | 98 / 100 / 98 | 98 / 100 / 98 |           44 / 40 / 80 |   50 / 40 / 80 |",
        "",
        "| across seeds (mean [95% t])      | n |             T_L/T_M |           T_M/T_X |      pass L |         pass M |       pass X |     sched L |        sched M |      sched X |",
        "|:---------------------------------|--:|--------------------:|------------------:|------------:|---------------:|-------------:|------------:|---------------:|-------------:|",
        "| start                            | 3 |   1.20 [1.20, 1.20] | 0.50 [0.50, 0.50] | 98 [98, 98] | 100 [100, 100] |  98 [98, 98] | 98 [98, 98] | 100 [100, 100] |  98 [98, 98] |",
        "| effort-ordered                   | 3 |   0.95 [0.58, 1.32] | 0.50 [0.50, 0.50] | 98 [98, 98] | 100 [100, 100] | 93 [76, 100] | 98 [98, 98] | 100 [100, 100] | 93 [76, 100] |",
        "| binary                           | 3 |   1.25 [1.13, 1.37] | 0.50 [0.50, 0.50] | 98 [98, 98] | 100 [100, 100] |  98 [98, 98] | 98 [98, 98] | 100 [100, 100] |  98 [98, 98] |",
        "| effort-ordered − start (paired)  | 3 | -0.25 [-0.62, 0.12] | 0.00 [0.00, 0.00] |             |                |              |             |                |              |",
        "| binary − start (paired)          | 3 |  0.05 [-0.07, 0.17] | 0.00 [0.00, 0.00] |             |                |              |             |                |              |",
        "| effort-ordered − binary (paired) | 3 | -0.30 [-0.75, 0.15] | 0.00 [0.00, 0.00] |             |                |              |             |                |              |",
        "",
        "Held-out evaluation before the first update (start) and after the last. Per seed: ratios [95% bootstrap over tasks]; pass rates over admitted / scheduled attempts, in % per level (L/M/X). Across seeds: the mean over seeds [95% t-interval, n − 1 degrees of freedom; pass rates clipped to 0-100]; paired rows are the mean of per-seed differences (same start, same seed).",
        "",
        "- [ ] effort-ordered ends with T_L/T_M < 1.0 in at least 3 of 3 seeds: 2 of 3",
        "- [ ] upper 95% bound of effort-ordered's mean T_L/T_M below 1.0: 1.32",
        "- [x] binary's mean T_L/T_M not below the start's mean: 1.25 vs 1.20",
        "- [ ] no effort-ordered level's pass rate (admitted, scheduled) below the start's 95% Wilson interval, in any seed: seed 0: pass xhigh, sched xhigh",
    ]


def test_spec_validation():
    with pytest.raises(ValueError, match="distinct"):
        study_config.StudySpec(seeds=(0, 0))
    with pytest.raises(ValueError, match="arms"):
        study_config.StudySpec(seeds=(0,), arms=("ppo",))
    with pytest.raises(ValueError, match=r"output\.dir is set by the study"):
        study_config.StudySpec(seeds=(0,), grpo=("output.dir=x",))
    with pytest.raises(ValueError, match="no SFT overrides"):
        study_config.StudySpec(seeds=(0,), sft=("train.steps=3",), starts="/x")


def _report(start: float, eo: tuple[float, float, float], binary: tuple[float, float, float]) -> dict:
    ratio = lambda v, lo, hi: {"ordering": {"low/medium": {"value": v, "lo": lo, "hi": hi}}}  # noqa: E731
    return {
        "runs": [
            {
                "reward_kind": "effort_ordered",
                "first": ratio(start, start - 0.1, start + 0.1),
                "last": ratio(*eo),
            },
            {
                "reward_kind": "binary",
                "first": ratio(start, start - 0.1, start + 0.1),
                "last": ratio(*binary),
            },
        ]
    }


def test_demo_says_what_its_table_shows_and_what_not():
    from jaxpi.experiments.toy.result import what_it_shows

    # Today's `make demo`: effort-ordered at a violation next to binary's larger one, overlapping.
    short = what_it_shows(_report(1.2, (1.13, 0.85, 1.45), (1.47, 1.1, 1.9)), full=False)
    assert "What it does not show: the effort-ordering result" in short
    assert "effort-ordered 1.13 [0.85, 1.45], binary 1.47 [1.10, 1.90]" in short
    assert "overlap: this evaluation cannot tell the arms apart" in short and "jaxpi study --seeds 5" in short
    full = what_it_shows(_report(1.2, (0.76, 0.64, 0.89), (1.31, 1.12, 1.49)), full=True)
    assert (
        "do not overlap, but that is one seed of each arm" in full
        and "cannot tell a method from a seed" in full
    )


def test_eval_noise_needs_a_finished_start(tmp_path, capsys):
    """`--eval-noise` samples a finished SFT start (minutes, not run here): without one it is bad
    input; its module's imports of the trainer's pieces resolve."""
    from jaxpi.cli import main
    from jaxpi.experiments.toy import study_noise

    assert callable(study_noise.eval_noise)
    assert main(["study", "--out", str(tmp_path), "--eval-noise", "2"]) == 2
    assert "no finished SFT run to evaluate" in capsys.readouterr().err

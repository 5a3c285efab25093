"""`jaxpi grpo` end to end on the toy environment, as a user runs it: a short toy SFT
(configs/sft/toy.yaml on the "toy-random" base, without the copy pre-training, 30 steps on short
unkeyed sessions with values 0-1 and 1-4 phrases of reasoning at every level: the policy answers
in the right format, and within a group the lengths differ, so the effort-ordered reward of low
and medium attempts varies), then GRPO runs in subprocesses — uninterrupted, SIGKILLed and resumed (must repeat the uninterrupted run
exactly), resumed with a changed reward (refused) — and `jaxpi report` on the result. These check
the machinery, not learning (the toy-scale result is `make demo-full`). The uninterrupted run's
stderr is a file, as under nohup or SLURM: it logs plain lines (every other update, and its
collections' progress), and its evaluations reach metrics.jsonl and TensorBoard at the steps they
describe (0 and the last) under the same eval/ keys.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpi.configfile import load_config
from jaxpi.sft import SFTConfig, run_sft
from jaxpi.testing.run_logs import tensorboard_scalars
from jaxpi.testing.xla import child_env
from jaxpi.train.checkpoint import load_adapter
from jaxpi.train.loggers import scalars

ROOT = Path(__file__).resolve().parents[1]
COLLECTIONS = 2
SFT_STEPS = 30
# Short sessions (17-40 reasoning tokens, 1-4 phrases, at every level; ~330 tokens in all) keep
# sampling and updates cheap; the spread gives groups different rewards.
REASONING = "[17,40,17,40,17,40]"
# A collection: 2 tasks x 3 levels x 2 attempts; rows padded to one length (one update program).
SMALL = [
    "env.keys_per_task=0",
    "env.max_value=2",
    "collect.tasks=2",
    "collect.group=2",
    "collect.max_new_tokens=64",
    "collect.max_context=384",
    "collect.row_bucket=384",
    f"train.collections={COLLECTIONS}",
    "train.checkpoint_every=1",
    "train.eval_every=0",
    "train.eval_group=1",
    "env.eval_tasks=2",
    "output.loggers=[tensorboard]",
    "train.log_every=1",
    "train.collection_log_s=0",  # a progress line at every finished attempt
    # Two waves per training collection (6 sessions each): the Ray fleet's two workers take one each.
    "collect.engine_batch=6",
]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft-toy")
    cfg = load_config(
        SFTConfig,
        ROOT / "configs" / "sft" / "toy.yaml",
        [
            f"output.dir={out}",
            "model.base=toy-random",
            "data.toy_max_value=2",
            f"data.toy_reasoning={REASONING}",
            "data.toy_examples=96",
            "data.seq_len=384",
            f"train.steps={SFT_STEPS}",
            "train.eval_every=0",
            f"train.checkpoint_every={SFT_STEPS}",
            "output.loggers=[]",
        ],
    )
    run_sft(cfg, progress=False, out=sys.stderr)
    return out


def command(sft_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxpi.cli",
        "grpo",
        "--config",
        str(ROOT / "configs" / "grpo" / "tiny.yaml"),
        f"model.adapter={sft_dir}",
        f"output.dir={out}",
        *SMALL,
        *extra,
        "--json",
    ]


def environ(cache: Path | None = None) -> dict[str, str]:
    env = child_env(fast_compile=False)  # one device and XLA's defaults, as a user's CPU run
    env["JAX_PLATFORMS"] = "cpu"
    if cache is not None:  # every program stored, so that a resume compiling anything shows
        env["JAXPI_COMPILE_CACHE"] = str(cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def compiled_programs(cache: Path) -> set[str]:
    return {p.name for p in cache.glob("*-cache")}


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def lines_if(path: Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def kill_after(proc: subprocess.Popen, run_dir: Path, update: int, timeout: float = 900) -> None:
    """SIGKILL `proc` once the checkpoint after `update` updates is complete (orbax renames its
    temporary to `checkpoints/<update>` when every item is written; the metrics record comes
    before it, so a record alone does not mean there is a checkpoint to resume from)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "checkpoints" / str(update)).is_dir():
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.1)
    proc.wait()


@pytest.fixture(scope="module")
def runs(sft_dir, tmp_path_factory):
    """The uninterrupted run and the run to be killed; the killed one starts once the first has
    finished its first update (every program compiled and in the test run's compilation cache,
    tests/conftest.py), the two then run side by side, and it is SIGKILLed after its first update
    (its resume then repeats the second)."""
    root = tmp_path_factory.mktemp("grpo")
    cache = root / "jax-cache"
    straight_out, killed_out = root / "straight", root / "killed"
    log = (root / "straight.stderr").open("w")
    p_straight = subprocess.Popen(
        command(sft_dir, straight_out), env=environ(cache), stdout=subprocess.PIPE, stderr=log, text=True
    )
    deadline = time.time() + 900
    while (
        p_straight.poll() is None
        and time.time() < deadline
        and len(lines_if(straight_out / "metrics.jsonl")) < 2
    ):
        time.sleep(0.2)  # the step-0 evaluation and the first update
    p_killed = subprocess.Popen(
        command(sft_dir, killed_out), env=environ(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    kill_after(p_killed, killed_out, 1)
    stdout, _ = p_straight.communicate(timeout=900)
    log.close()
    assert p_straight.returncode == 0, (root / "straight.stderr").read_text()[-3000:]
    return {
        "straight": (straight_out, json.loads(stdout)),
        "stderr": (root / "straight.stderr").read_text(),
        "killed": (killed_out, p_killed.returncode),
        "cache": cache,
    }


@pytest.fixture(scope="module")
def straight(runs):
    return runs["straight"]


def test_uninterrupted_run(straight, sft_dir):
    out, summary = straight
    assert summary["collections"] == COLLECTIONS and summary["checkpoint"].endswith(
        f"checkpoints/{COLLECTIONS}"
    )
    records = lines(out / "metrics.jsonl")
    assert [m["step"] for m in records] == list(range(COLLECTIONS + 1))
    metrics = records[1:]  # the updates'
    attempts = lines(out / "attempts.jsonl")
    train = [a for a in attempts if a["split"] == "train"]
    evals = [a for a in attempts if a["split"] == "eval"]
    assert len(train) == COLLECTIONS * 2 * 3 * 2
    assert sorted({a["step"] for a in evals}) == [0, COLLECTIONS] and len(evals) == 2 * 2 * 3
    assert json.loads((out / "run.json").read_text())["levels"] == ["low", "medium", "xhigh"]
    for m in metrics:
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
        # The trainer scores exactly the tokens the engine sampled: a misaligned row (an off-by-one
        # position, observation tokens supervised, the wrong adapter) differs by whole nats.
        assert m["logp_diff_max"] < 1e-3, m
        assert m["is_weight_max"] <= 2.0
        # Successes over scheduled attempts = the admitted pass rate × the admitted share.
        for level in ("low", "medium", "xhigh"):
            rate, share = m.get(f"level/{level}/pass_rate"), m[f"level/{level}/admitted_share"]
            assert m[f"level/{level}/pass_rate_scheduled"] == pytest.approx((rate or 0.0) * share)
        assert m["scored"] == m["admitted"]  # reward.malformed=exclude: only admitted rows train
    # Advantages are mean-centred in each (step, task, level) group; non-admitted attempts get none.
    groups: dict = {}
    for a in train:
        groups.setdefault((a["step"], a["task_id"], a["level"]), []).append(a)
    for g in groups.values():
        kept = [a for a in g if a["admitted"]]
        assert all(a["advantage"] == 0.0 and not a["scored"] for a in g if not a["admitted"])
        if kept:
            assert abs(sum(a["advantage"] for a in kept)) < 1e-9
    signal_groups = sum(m["reward/groups_with_signal"] for m in metrics)
    assert signal_groups > 0, "no group held both outcomes: the update had nothing to learn from"
    # Groups with signal moved the adapter away from the SFT start.
    start, _, _ = load_adapter(sft_dir)
    end, _, meta = load_adapter(out)
    assert meta["kind"] == "grpo" and meta["step"] == COLLECTIONS
    moved = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end), strict=True)
    ]
    assert max(moved) > 1e-4


def test_evaluations_are_logged_at_their_steps_under_one_name(straight):
    """Step 0 is the evaluation before any update; the last update's record holds the evaluation
    after it; TensorBoard holds every record's numbers under the metrics.jsonl keys."""
    out, summary = straight
    records = lines(out / "metrics.jsonl")
    evals = [sorted(k for k in r if k.startswith("eval/")) for r in records]
    # Numbers a collection leaves undefined (no success at a level: no mean success length) are
    # left out, so the two sets may differ by those; the defined-always ones are in both.
    always = {"eval/reward/groups"} | {
        f"eval/level/{lv}/{f}"
        for lv in ("low", "medium", "xhigh")
        for f in ("count", "admitted_share", "pass_rate_scheduled")
    }
    assert always <= set(evals[0]) and always <= set(evals[-1]) and not any(evals[1:-1])
    assert set(records[0]) == {"step", "time", *evals[0]}
    assert "eval/level/low/pass_rate_scheduled" in evals[0]
    assert summary["last"] == {k: v for k, v in records[-1].items() if isinstance(v, (int, float))}
    # The eval/ numbers are those of the attempts recorded at that step.
    attempts = lines(out / "attempts.jsonl")
    for r in (records[0], records[-1]):
        low = [a for a in attempts if a["split"] == "eval" and a["step"] == r["step"] and a["level"] == "low"]
        assert r["eval/level/low/pass_rate_scheduled"] == pytest.approx(
            sum(a["success"] for a in low) / len(low)
        )
    want = {(r["step"], k): v for r in records for k, v in scalars(r).items()}
    assert tensorboard_scalars(out / "tb") == pytest.approx(want)
    assert not any(k.startswith("train/") for _, k in want)


def test_plain_lines_without_a_terminal(runs):
    """stderr is a file: a line every train.log_every=1 update (SFT's test: every 4 and the last), and progress
    lines inside every collection (collection_log_s=0: one per finished attempt, then the end,
    whose count of passed attempts is that of attempts.jsonl)."""
    err = runs["stderr"]
    steps = [x for x in err.splitlines() if x.startswith("step ")]
    assert [x.split(" |")[0] for x in steps] == [
        f"step {k}/{COLLECTIONS}" for k in range(1, COLLECTIONS + 1)
    ], err[-3000:]
    for x in steps:
        assert " | loss " in x and " | lr " in x and " | grad norm " in x and " tok/s | " in x
        assert " elapsed, ETA " in x and "pass/reasoning low " in x
    attempts = lines(runs["straight"][0] / "attempts.jsonl")
    collections = [
        *((f"eval after {k} updates", "eval", k) for k in (0, COLLECTIONS)),
        *((f"collection {k + 1}/{COLLECTIONS}", "train", k) for k in range(COLLECTIONS)),
    ]
    for label, split, step in collections:
        mine = [a for a in attempts if a["split"] == split and a["step"] == step]
        said = [x[len(label) + 2 :] for x in err.splitlines() if x.startswith(f"{label}: ")]
        n = len(mine)
        assert [int(x.split("/")[0]) for x in said] == list(range(1, n + 1)), (label, said)
        assert said[-1].startswith(f"{n}/{n} attempts, {sum(a['success'] for a in mine)} passed ("), said[-1]
    assert "\r" not in err


def test_resume_after_sigkill_is_exact(runs, sft_dir):
    out_straight, _ = runs["straight"]
    out, returncode = runs["killed"]
    assert returncode == -signal.SIGKILL, "the run finished before it could be killed"
    programs = compiled_programs(runs["cache"])
    assert programs, "`jaxpi grpo` stored no compiled program"
    resumed = subprocess.run(
        command(sft_dir, out), env=environ(runs["cache"]), capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["resumed_from"] == 1
    # Restored state lowers like fresh state: the resume loaded every program from the cache.
    assert compiled_programs(runs["cache"]) == programs
    a, b = lines(out_straight / "metrics.jsonl"), lines(out / "metrics.jsonl")
    assert [(m["step"], m.get("loss"), m.get("grad_norm")) for m in a] == [
        (m["step"], m.get("loss"), m.get("grad_norm")) for m in b
    ]
    assert [sorted(m) for m in a] == [sorted(m) for m in b]
    assert lines(out_straight / "attempts.jsonl") == lines(out / "attempts.jsonl")
    for x, y in zip(
        jax.tree.leaves(load_adapter(out_straight)[0]), jax.tree.leaves(load_adapter(out)[0]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_refuses_a_changed_reward(straight, sft_dir):
    out, _ = straight
    proc = subprocess.run(
        command(sft_dir, out, "reward.kind=binary"),
        env=environ(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "different reward" in proc.stderr


def test_report_draws_the_run(straight, tmp_path):
    out, _ = straight
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "report", str(out), "--out", str(tmp_path / "rep")],
        env=environ(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| start" in proc.stdout and "sched L" in proc.stdout
    for name in ("frontier.png", "ordering.png", "pass_rate.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the same runs on a Ray fleet -------------------------------------------------------------------
# A cluster of this machine as a user starts one (`ray start --head`, 2 CPUs: two rollout worker
# processes of one CPU each). Token authentication off for its processes and the runs alike, so a
# token Ray left in ~/.ray by another cluster cannot get in the way.
TIMING = ("time", "collect_s", "update_s", "tokens_per_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_pids(port: int) -> list[int]:
    """Processes of the cluster whose GCS listens on `port`, and of no other cluster: those given
    its GCS address or port, and those of its session directory (log monitors, agents)."""
    procs = {int(d.name): _cmdline(d) for d in Path("/proc").iterdir() if d.name.isdigit()}
    mine = re.compile(rf"--gcs[-_]address=\S*:{port}\b|--gcs_server_port={port}\b")
    sessions = {
        m.group(0)
        for a in procs.values()
        if mine.search(a)
        for m in re.finditer(r"/tmp/ray/session_[\w-]+", a)
    }
    return [p for p, a in procs.items() if mine.search(a) or any(s in a for s in sessions)]


@pytest.fixture(scope="module")
def ray_cluster(runs):
    pytest.importorskip("ray")
    port = _free_port()
    env = {**environ(runs["cache"]), "RAY_AUTH_MODE": "disabled"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    start = [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2"]
    start += ["--include-dashboard=false", "--disable-usage-stats"]
    proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        # Only this cluster's processes (`ray stop` would end every cluster of the machine).
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _cluster_pids(port):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(1.0)


def rollout_workers() -> list[int]:
    """Process ids of the fleet's rollout workers (Ray names its actor processes ray::<class>)."""
    return [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and _cmdline(d).startswith("ray::RolloutWorker")
    ]


def _cmdline(d: Path) -> str:
    try:
        return (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def fleet_runs(sft_dir, ray_cluster, tmp_path_factory):
    """On the fleet: the synchronous run with a rollout worker SIGKILLed as the first training
    collection starts; the asynchronous run, uninterrupted; the asynchronous run killed after its
    first update (its resume comes in the test)."""
    addr, env = ray_cluster
    root = tmp_path_factory.mktemp("fleet")
    fleet = ("collect.backend=ray", f"collect.ray_address={addr}")
    # The asynchronous runs are compared with each other only: no evaluation collections, and one
    # rollout worker each (the fleet's waves and a lost worker are the synchronous run's checks).
    asyn = (
        *fleet,
        "train.async=true",
        "collect.max_staleness=1",
        "train.eval_group=0",
        "collect.ray_workers=1",
    )
    log = (root / "sync.stderr").open("w")
    p = subprocess.Popen(
        command(sft_dir, root / "sync", *fleet), env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )
    killed: list[int] = []
    deadline = time.time() + 900
    while p.poll() is None and time.time() < deadline and not killed:
        # The step-0 evaluation's last progress line: the first training collection's two waves
        # go out to the two workers now.
        if "eval after 0 updates: 6/6 attempts" in (root / "sync.stderr").read_text():
            victims = rollout_workers()
            if victims:
                os.kill(victims[0], signal.SIGKILL)
                killed.append(victims[0])
        time.sleep(0.05)
    _stdout, _ = p.communicate(timeout=900)
    log.close()
    assert p.returncode == 0, (root / "sync.stderr").read_text()[-3000:]
    # The two asynchronous runs side by side, each on a worker of its own.
    straight_log = (root / "async.stderr").open("w")
    p_straight = subprocess.Popen(
        command(sft_dir, root / "async", *asyn), env=env, stdout=subprocess.DEVNULL, stderr=straight_log
    )
    p_killed = subprocess.Popen(
        command(sft_dir, root / "async-killed", *asyn),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kill_after(p_killed, root / "async-killed", 1)
    p_straight.wait(timeout=900)
    straight_log.close()
    assert p_straight.returncode == 0, (root / "async.stderr").read_text()[-3000:]
    return {
        "sync": root / "sync",
        "sync_stderr": (root / "sync.stderr").read_text(),
        "killed_worker": killed,
        "async": root / "async",
        "async_killed": (root / "async-killed", p_killed.returncode),
        "command": lambda out: command(sft_dir, out, *asyn),
        "env": env,
    }


def _without(records: list[dict]) -> list[dict]:
    """Metrics records without the clock's numbers (timings, the fleet's, an evaluation's fleet's)."""
    return [
        {k: v for k, v in r.items() if k not in TIMING and not k.startswith(("fleet/", "eval/fleet/"))}
        for r in records
    ]


def test_fleet_run_equals_the_local_one_though_a_worker_died(fleet_runs, straight):
    """The same seeds give the same run on two Ray workers as in one process, token for token, with
    one worker SIGKILLed mid-run: its wave was redone elsewhere with the same keys, no attempt was
    lost, none was trained on twice or in part."""
    local, _ = straight
    fleet = fleet_runs["sync"]
    assert fleet_runs["killed_worker"], "no rollout worker was running to be killed"
    assert lines(fleet / "attempts.jsonl") == lines(local / "attempts.jsonl")
    a, b = lines(local / "metrics.jsonl"), lines(fleet / "metrics.jsonl")
    assert _without(a) == _without(b)
    for x, y in zip(
        jax.tree.leaves(load_adapter(local)[0]), jax.tree.leaves(load_adapter(fleet)[0]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Every update's record holds its training collection's fleet numbers (the evaluations' are
    # under eval/fleet/); the first went out to both workers, one of which died in it.
    updates = b[1:]
    assert all(r["fleet/waves"] == 2 and r["fleet/attempts"] == 12 for r in updates)
    assert updates[0]["fleet/in_flight_max"] == 2 and updates[0]["eval/fleet/waves"] == 1  # eval 0
    assert sum(r["fleet/retries"] for r in updates) >= 1, fleet_runs["sync_stderr"][-3000:]
    assert all(r["fleet/lost_attempts"] == 0 for r in updates)
    assert all(r["fleet/attempts_per_min"] > 0 and r["fleet/busy_s"] > 0 for r in updates)
    assert "fleet: worker" in fleet_runs["sync_stderr"] and "lost" in fleet_runs["sync_stderr"]


def test_async_run_trains_on_one_version_stale_attempts(fleet_runs, sft_dir):
    out = fleet_runs["async"]
    train = [a for a in lines(out / "attempts.jsonl") if a["split"] == "train"]
    # Collection s is sampled by the policy after s - 1 updates (the first by the first policy).
    assert {(a["step"], a["policy_version"]) for a in train} == {(0, 0), (1, 0)}
    records = lines(out / "metrics.jsonl")  # no evaluation: no step-0 record
    assert [r["step"] for r in records] == [1, 2] and not any(
        k.startswith("eval/") for r in records for k in r
    )
    assert [r["staleness/max"] for r in records] == [0.0, 1.0]
    assert records[1]["staleness/1"] == 12 and records[1]["admitted"] == sum(
        a["admitted"] for a in train if a["step"] == 1
    )
    # The second update trains on what the first policy sampled: the trainer's log-probs (after one
    # update) part from the engine's, and the capped importance weight takes the gap.
    assert records[0]["logp_diff_max"] < 1e-3 < records[1]["logp_diff_max"]
    assert all(np.isfinite(r["loss"]) and r["is_weight_max"] <= 2.0 for r in records)
    assert (out / "checkpoints" / "2" / "sampler").is_dir()
    start, end = load_adapter(sft_dir)[0], load_adapter(out)[0]
    moved = [
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(start), jax.tree.leaves(end), strict=True)
    ]
    assert max(moved) > 1e-4


def test_async_resume_after_sigkill_is_exact(fleet_runs):
    """Killed after its first update and resumed (the fleet joined again), the asynchronous run
    samples its second collection with the adapter the checkpoint kept for it, as the run it
    resumes did: the same attempts, metrics and adapter as the uninterrupted one."""
    out, returncode = fleet_runs["async_killed"]
    assert returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = subprocess.run(
        fleet_runs["command"](out), env=fleet_runs["env"], capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["resumed_from"] == 1
    straight = fleet_runs["async"]
    assert lines(straight / "attempts.jsonl") == lines(out / "attempts.jsonl")
    assert _without(lines(straight / "metrics.jsonl")) == _without(lines(out / "metrics.jsonl"))
    for x, y in zip(
        jax.tree.leaves(load_adapter(straight)[0]), jax.tree.leaves(load_adapter(out)[0]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_workers_that_cannot_start_stop_the_collection_naming_why(ray_cluster, tmp_path, monkeypatch):
    """A worker that cannot build its engine (here: a base that is not there) is not a lost
    process to replace forever: after collect.worker_retries failed starts the fleet says why."""
    from jaxpi.data import TINY_TOKENIZER
    from jaxpi.rl.config import GRPOConfig
    from jaxpi.rl.fleet.cluster import FleetError
    from jaxpi.rl.fleet.collector import FleetCollector
    from jaxpi.rl.fleet.worker import WorkerSpec

    addr, env = ray_cluster
    monkeypatch.setenv("RAY_AUTH_MODE", env["RAY_AUTH_MODE"])
    overrides = [*SMALL, "collect.backend=ray", f"collect.ray_address={addr}", "collect.worker_retries=1"]
    cfg = load_config(
        GRPOConfig, ROOT / "configs" / "grpo" / "tiny.yaml", [*overrides, f"output.dir={tmp_path}"]
    )
    missing = tmp_path / "no-such-base"
    spec = WorkerSpec(cfg, str(missing), str(TINY_TOKENIZER), cfg.lora, 6, env=None, render_cfg=None)
    with pytest.raises(FleetError, match=r"rollout workers fail to start: .*no-such-base"):
        FleetCollector(cfg, spec, 0, {})


def test_bench_fleet_reports_attempts_per_minute(ray_cluster, tmp_path):
    """`jaxpi bench fleet` runs on a cluster and reports sane fields (the figures are docs', not a test's)."""
    addr, env = ray_cluster
    out = tmp_path / "fleet.json"
    argv = [sys.executable, "-m", "jaxpi.cli", "bench", "fleet", "--workers", "1", "--collections", "1"]
    argv += ["--ray-address", addr, "--out", str(out), "--json"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report == json.loads(out.read_text())
    (row,) = report["results"]
    assert row["workers"] == 1 and row["attempts_per_collection"] == 48 and row["waves_per_collection"] == 8
    assert row["attempts_per_min"] > 0 and row["sampled_tokens_per_s"] > 0 and 0 < row["busy_share"] <= 1.0
    assert report["env"]["cores"] >= 1 and len(report["env"]["load_avg"]) == 3

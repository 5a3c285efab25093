"""Where a run's numbers go (`jaxpi.train.metrics`, `.loggers`, `.progress`, `jaxpi.rl.progress`):
the plain lines without a terminal and their cadence, a GRPO collection's bounded progress lines,
the logger names a config may hold, and the same records read back from metrics.jsonl,
TensorBoard, offline W&B and a file-store MLflow. The end-to-end runs (tests/test_sft.py,
tests/test_grpo_run.py) check the same through `jaxpi sft` / `jaxpi grpo`."""

import io
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpi.cli import main
from jaxpi.configfile import ConfigError, from_dict
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.progress import CollectionProgress
from jaxpi.sft.config import SFTConfig
from jaxpi.testing.run_logs import mlflow_metrics, tensorboard_scalars, wandb_offline_history
from jaxpi.train.loggers import MissingLoggerError, require_loggers, scalars
from jaxpi.train.metrics import MetricsLog, read_jsonl
from jaxpi.train.progress import Progress

LINE = re.compile(
    r"step (\d+)/(\d+) \| loss [\d.]+ \| lr [\d.e+-]+ \| grad norm [\d.]+ \| \d+ tok/s \| "
    r"\d+:\d\d:\d\d elapsed(, ETA \d+:\d\d:\d\d)?"
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def record(step: int, **extra) -> dict:
    return {"step": step, "loss": 1.0 / step, "lr": 3e-4, "grad_norm": 0.5, "tokens_per_s": 1000.0, **extra}


@settings(max_examples=40, derandomize=True, deadline=None)
@given(total=st.integers(1, 40), start=st.integers(0, 39), every=st.integers(0, 12))
def test_plain_lines_every_log_every_steps_and_at_the_last(total, start, every):
    start = min(start, total - 1)
    out, clock = io.StringIO(), Clock()
    p = Progress(total=total, start=start, progress=True, every=every, out=out, clock=clock)
    assert p.bar is None  # pytest's stderr is not a terminal
    for s in range(start + 1, total + 1):
        clock.t += 2.0
        p.step(record(s))
    lines = out.getvalue().splitlines()
    want = [s for s in range(start + 1, total + 1) if every and (s % every == 0 or s == total)]
    assert [int(LINE.fullmatch(x).group(1)) for x in lines] == want, lines
    assert all(f"/{total} |" in x for x in lines)
    if want:  # 2 s a step: the last line's elapsed time and an ETA of 0
        assert lines[-1].endswith(
            f"{(total - start) * 2 // 60}:{(total - start) * 2 % 60:02d} elapsed, ETA 0:00:00"
        )


def test_detail_rides_on_the_line():
    out = io.StringIO()
    p = Progress(total=4, start=0, progress=False, every=2, out=out)
    for s in range(1, 5):
        p.step(record(s), "pass/reasoning low 0.50/12t")
    lines = out.getvalue().splitlines()
    assert [x.split(" |")[0] for x in lines] == ["step 2/4", "step 4/4"]
    assert all(x.endswith(" | pass/reasoning low 0.50/12t") for x in lines)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 20.0), min_size=1, max_size=30),
    successes=st.lists(st.booleans(), min_size=30, max_size=30),
    every=st.sampled_from([0.0, 5.0, 30.0]),
)
def test_collection_progress_is_bounded_and_always_ends(gaps, successes, every):
    clock, lines = Clock(), []
    watch = CollectionProgress("collection 1/2", len(gaps), lines.append, every, clock=clock)
    times = []
    for gap, ok in zip(gaps, successes, strict=False):
        clock.t += gap
        watch.done(ok, 10)
        times.append(clock.t)
    watch.end()
    n = len(gaps)
    wins = sum(successes[:n])
    assert lines[-1].startswith(f"collection 1/2: {n}/{n} attempts, {wins} passed ({wins / n:.2f}), ")
    done = [int(re.match(r"collection 1/2: (\d+)/", x).group(1)) for x in lines[:-1]]
    assert done == sorted(set(done)) and all(d < n for d in done)
    # No two lines closer than `every` seconds (the final one aside); with 0, one per attempt.
    at = [times[d - 1] for d in done]
    assert all(b - a >= every for a, b in zip([0.0, *at], at, strict=False))
    if every == 0:
        assert done == list(range(1, n))


def test_logger_names_are_checked_with_a_suggestion():
    for cls in (SFTConfig, GRPOConfig):
        with pytest.raises(
            ConfigError, match=r"output.loggers: unknown logger 'wandbb' \(did you mean 'wandb'\?\)"
        ):
            from_dict(cls, {"output": {"loggers": ["tensorboard", "wandbb"]}})
        with pytest.raises(ConfigError, match="names 'mlflow' more than once"):
            from_dict(cls, {"output": {"loggers": ["mlflow", "mlflow"]}})
        assert from_dict(cls, {"output": {"loggers": []}}).output.loggers == ()


def test_cli_bad_logger_exits_2(capsys):
    assert main(["sft", "--config", "tiny", "output.loggers=[tensorbaord]"]) == 2
    assert "did you mean 'tensorboard'?" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_library_names_its_extra_before_any_work(name, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` fails, as when it is not installed
    with pytest.raises(MissingLoggerError, match=rf"pip install 'jaxpi\[{name}\]'"):
        require_loggers(["tensorboard", name])
    out = tmp_path / "run"
    assert main(["sft", "--config", "tiny", f"output.loggers=[{name}]", f"output.dir={out}"]) == 2
    assert f"{name} is not installed: pip install 'jaxpi[{name}]'" in capsys.readouterr().err
    assert not out.exists()


RECORDS = [
    {"step": 0, "eval/level/low/pass_rate": 0.25, "eval/ordering/low/medium": 0.5, "time": 1.0},
    record(1, **{"level/low/pass_rate": 0.5, "nan_left_out": float("nan"), "note": "text"}),
    record(2, **{"level/low/pass_rate": 0.75, "eval/level/low/pass_rate": 0.5, "val_loss": 1.5}),
]


def test_jsonl_and_tensorboard_hold_the_same_keys_at_the_same_steps(tmp_path):
    log = MetricsLog(
        tmp_path, start_step=0, total_steps=2, progress=False, loggers=["tensorboard"], out=io.StringIO()
    )
    for r in RECORDS:
        log.write(r)
    log.close()
    jsonl = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in jsonl] == [0, 1, 2]
    want = {(r["step"], k): v for r in jsonl for k, v in scalars(r).items()}
    assert tensorboard_scalars(tmp_path / "tb") == pytest.approx(want)
    assert (0, "eval/level/low/pass_rate") in want and not any(k.startswith("train/") for _, k in want)


def test_a_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path):
    """A killed fresh run's step-0 record is dropped; a resume after step 1 keeps steps <= 1."""
    for start, records, kept in ((0, RECORDS[:1], [0]), (0, RECORDS, [0, 1, 2]), (1, RECORDS[2:], [0, 1, 2])):
        log = MetricsLog(tmp_path, start_step=start, total_steps=2, progress=False, out=io.StringIO())
        for r in records:
            log.write(r)
        log.close()
        assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == kept
    assert sorted({s for s, _ in tensorboard_scalars(tmp_path / "tb")}) == [0, 1, 2]


def test_offline_wandb_and_mlflow_get_the_records_jsonl_gets(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "WANDB_DIR"):
        monkeypatch.setenv(name, "")  # restored after the test (the MLflow logger sets one)
        monkeypatch.delenv(name)
    log = MetricsLog(
        tmp_path,
        start_step=0,
        total_steps=2,
        progress=False,
        loggers=["wandb", "mlflow"],
        out=io.StringIO(),
        config={"train": {"steps": 2}},
    )
    for r in RECORDS:
        log.write(r)
    log.close()
    want = {(r["step"], k): v for r in read_jsonl(tmp_path / "metrics.jsonl") for k, v in scalars(r).items()}
    assert wandb_offline_history(tmp_path) == pytest.approx(want)
    assert mlflow_metrics(tmp_path / "mlruns") == pytest.approx(want)

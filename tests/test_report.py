"""`jaxpi report`: per-level statistics, ordering ratios, the table, and the pictures of a GRPO run,
on run directories written by hand with known answers."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpi.cli import main
from jaxpi.rl import Attempt, RewardConfig, score_collection
from jaxpi.rl.report import comparison_table
from jaxpi.rl.runs import load_run, step_series, summarize
from jaxpi.stats.intervals import Z95, wilson_interval
from jaxpi.stats.levels import RunAttempt, level_stats, ordering_ratios

LEVELS = ("low", "medium", "xhigh")


def att(task, level, tokens, success=True, admitted=True, step=0, split="eval", turns=2, output=None, i=0):
    """One attempts.jsonl record, as the GRPO loop writes it."""
    return {
        "split": split,
        "step": step,
        "collection": step,
        "task_id": task,
        "level": level,
        "attempt_id": f"{task}-{level}-{step}-{i}",
        "admitted": admitted,
        "success": success,
        "reasoning_tokens": tokens,
        "output_tokens": tokens + 50 if output is None else output,
        "turns": turns,
        "finish_reason": "stop",
        "reward": float(success),
        "advantage": 0.0,
    }


def write_run(root: Path, records, name=None, levels=LEVELS, tail: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    meta = {"levels": list(levels), "reward": {"kind": "effort_ordered"}, "extra": 1}
    if name:
        meta["name"] = name
    (root / "run.json").write_text(json.dumps(meta))
    (root / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return root


def records(a):
    return [
        RunAttempt(**{k: v for k, v in r.items() if k not in ("finish_reason", "reward", "advantage")})
        for r in a
    ]


def synthetic(seed, n_tasks, steps=(0, 2, 4), shrink_low=0.0, group=2):
    """A plausible run: per-task difficulty, low reasoning longer than medium at step 0 (a violation),
    shrinking by `shrink_low` per step; eval at `steps`, train at every step."""
    rng = np.random.default_rng(seed)
    base = {"low": 900.0, "medium": 700.0, "xhigh": 2400.0}
    p = {"low": 0.45, "medium": 0.55, "xhigh": 0.7}
    out = []
    for split, at in (("eval", steps), ("train", range(max(steps) + 1))):
        for step in at:
            for t in range(n_tasks):
                hard = rng.lognormal(0.0, 0.4)
                for level in LEVELS:
                    scale = base[level] * (1 - shrink_low * step if level == "low" else 1.0)
                    for i in range(group):
                        tokens = int(scale * hard * rng.lognormal(0.0, 0.2))
                        ok = bool(rng.random() < p[level] + 0.03 * step)
                        out.append(att(f"{split}{t}", level, tokens, ok, step=step, split=split, i=i))
    return out


# ------------------------------------------------------------------------------------ statistics


@pytest.mark.parametrize("k,n", [(0, 10), (10, 10), (5, 10), (3, 7), (1, 50)])
def test_wilson_interval_bounds_solve_the_score_equation(k, n):
    lo, hi = wilson_interval(k, n)
    p_hat = k / n
    assert 0.0 <= lo <= p_hat <= hi <= 1.0
    # The Wilson bounds are the p where the score test sits exactly at z: (p̂ − p)² n = z² p (1 − p).
    for p in (lo, hi):
        assert (p_hat - p) ** 2 * n == pytest.approx(Z95**2 * p * (1 - p), abs=1e-12)
    if k == 0:
        assert lo == 0.0 and hi == pytest.approx(Z95**2 / (n + Z95**2))
    if k == n:
        assert hi == 1.0 and lo == pytest.approx(n / (n + Z95**2))


def test_wilson_interval_known_values_and_bad_input():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    for k, n in [(0, 0), (3, 2), (-1, 4)]:
        with pytest.raises(ValueError):
            wilson_interval(k, n)


def test_ratios_exact_and_non_admitted_attempts_left_out():
    a = [
        att("t1", "low", 400, True),
        att("t1", "low", 200, False),
        att("t1", "low", 99_999, True, admitted=False),  # must not move any mean
        att("t1", "medium", 100, True),
        att("t1", "medium", 300, True),
        att("t2", "low", 300, False),
        att("t2", "medium", 200, False),
        att("t2", "xhigh", 800, True),
        att("t2", "xhigh", 800, False, admitted=False),
    ]
    ratios = ordering_ratios(records(a), LEVELS)
    # T_low = (400+200+300)/3 = 300, T_medium = (100+300+200)/3 = 200, T_xhigh = 800.
    assert ratios["low/medium"].value == pytest.approx(1.5)
    assert ratios["medium/xhigh"].value == pytest.approx(0.25)
    assert ordering_ratios(a, LEVELS) == ratios  # attempts.jsonl-shaped dicts are accepted too
    stats = level_stats(records(a), LEVELS)
    low = stats["low"]
    assert (low.scheduled, low.admitted, low.successes) == (4, 3, 1)
    assert low.admitted_share == pytest.approx(3 / 4)
    assert low.pass_rate.value == pytest.approx(1 / 3)  # the non-admitted success is not counted
    assert (low.pass_rate.lo, low.pass_rate.hi) == pytest.approx(wilson_interval(1, 3))
    assert low.reasoning_tokens.value == pytest.approx(300)
    assert low.reasoning_tokens_per_turn == pytest.approx(900 / 6)
    assert low.output_tokens == pytest.approx(350) and low.turns == pytest.approx(2)
    assert stats["xhigh"].admitted_share == 0.5 and stats["xhigh"].pass_rate.value == 1.0
    # The same numbers as the reward module's per-collection summary.
    cfg = RewardConfig(levels=LEVELS)
    ref = score_collection(
        [
            Attempt(r["task_id"], r["level"], r["success"], r["reasoning_tokens"], admitted=r["admitted"])
            for r in a
        ],
        cfg,
    )
    for key, value in ref.ordering.items():
        assert ratios[key].value == pytest.approx(value)


def test_ratio_undefined_without_admitted_attempts():
    a = [att("t1", "low", 100), att("t1", "medium", 50, admitted=False), att("t1", "xhigh", 80)]
    ratios = ordering_ratios(records(a), LEVELS)
    assert ratios == {"low/medium": None, "medium/xhigh": None}
    stats = level_stats(records(a), LEVELS)
    assert stats["medium"].pass_rate is None and stats["medium"].reasoning_tokens is None
    assert stats["medium"].admitted_share == 0.0
    with pytest.raises(ValueError, match="huge"):
        level_stats(records([att("t1", "huge", 1)]), LEVELS)


def test_bootstrap_contains_estimate_shrinks_with_tasks_and_resamples_tasks_not_attempts():
    def tasks(n):  # n tasks drawn from one fixed set of 8 profiles: the same spread, n times the evidence
        out = []
        for t in range(n):
            k = t % 8
            tokens = {
                "low": 200 + 100 * k + 37 * (k % 3),
                "medium": 150 + 60 * k + 50 * (k * 5 % 8),
                "xhigh": 2000 + 40 * (k * 3 % 8),
            }
            out += [
                att(f"t{t}", e, tokens[e] + 10 * i, success=k % 2 == 0, i=i) for e in LEVELS for i in range(2)
            ]
        return records(out)

    few, many = tasks(8), tasks(128)
    widths = []
    for sample in (few, many):
        stats, ratios = level_stats(sample, LEVELS), ordering_ratios(sample, LEVELS)
        for e in [*(s.reasoning_tokens for s in stats.values()), *ratios.values()]:
            assert e.lo < e.value < e.hi
        widths.append(stats["low"].reasoning_tokens.hi - stats["low"].reasoning_tokens.lo)
        widths.append(ratios["low/medium"].hi - ratios["low/medium"].lo)
    assert widths[2] < widths[0] / 3 and widths[3] < widths[1] / 3  # 1/sqrt(16) = 1/4 expected
    # Fixed seed: the same interval twice.
    assert (
        level_stats(few, LEVELS)["low"].reasoning_tokens == level_stats(few, LEVELS)["low"].reasoning_tokens
    )
    # Copies of a task's attempts are not new evidence: the cluster bootstrap's interval stays put.
    copies = [RunAttempt(**{**vars(a), "attempt_id": f"{a.attempt_id}-{c}"}) for a in few for c in range(4)]
    assert level_stats(copies, LEVELS)["low"].reasoning_tokens == pytest.approx(
        level_stats(few, LEVELS)["low"].reasoning_tokens
    )


# ----------------------------------------------------------------------------------------- loading


def test_truncated_last_line_skipped_malformed_line_named(tmp_path):
    good = [att("t1", "low", 10), att("t1", "medium", 20)]
    run = write_run(tmp_path / "cut", good, tail='{"split": "eval", "step": 0, "task')
    with pytest.warns(UserWarning, match=r"attempts\.jsonl:3: skipped a truncated last line"):
        loaded = load_run(run)
    assert len(loaded.attempts) == 2 and loaded.skipped_last_line
    assert loaded.name == "cut" and loaded.levels == LEVELS

    bad = write_run(tmp_path / "bad", good)
    lines = (bad / "attempts.jsonl").read_text().splitlines()
    (bad / "attempts.jsonl").write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"attempts\.jsonl:2: not valid JSON"):
        load_run(bad)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"level": "max"}, r"attempts\.jsonl:2: level 'max' is not one of run.json levels"),
        ({"reasoning_tokens": "12"}, r"attempts\.jsonl:2: field 'reasoning_tokens' must be int"),
        ({"success": 1}, r"attempts\.jsonl:2: field 'success' must be bool"),
        ({"split": "test"}, r"attempts\.jsonl:2: split must be one of"),
        ({"task_id": None}, r"attempts\.jsonl:2: field 'task_id' must be str"),
    ],
)
def test_bad_records_named_by_file_and_line(tmp_path, change, message):
    run = write_run(
        tmp_path / "r", [att("t1", "low", 10), {**att("t1", "medium", 5), **change}, att("t2", "low", 1)]
    )
    with pytest.raises(ValueError, match=message):
        load_run(run)


def test_missing_files_and_bad_run_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run\.json"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"levels": ["low", "low"]}))
    with pytest.raises(ValueError, match="levels"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"levels": ["low"]}))
    with pytest.raises(FileNotFoundError, match=r"attempts\.jsonl"):
        load_run(tmp_path)
    rec = att("t1", "low", 1)
    del rec["step"]
    write_run(tmp_path / "x", [rec])
    with pytest.raises(ValueError, match=r"attempts\.jsonl:1: missing field 'step'"):
        load_run(tmp_path / "x")


# -------------------------------------------------------------------------------- summaries, table


def test_summarize_steps_split_fallback_and_table(tmp_path):
    a = [
        *(
            att(f"t{t}", e, tok, ok, step=0)
            for t in range(4)
            for e, tok, ok in [("low", 300, t < 1), ("medium", 200, t < 2), ("xhigh", 800, t < 3)]
        ),
        *(
            att(f"t{t}", e, tok, True, step=5)
            for t in range(4)
            for e, tok in [
                (
                    "low",
                    100,
                ),
                ("medium", 200),
                ("xhigh", 400),
            ]
        ),
        att("t0", "low", 5000, step=3, split="train"),
    ]
    run = load_run(write_run(tmp_path / "grpo", a, name="effort-ordered GRPO"))
    first, last = summarize(run, "eval", "first"), summarize(run, "eval", "last")
    assert (first.step, last.step, first.split, first.note, first.tasks) == (0, 5, "eval", None, 4)
    assert first.stats["low"].pass_rate.value == 0.25 and first.stats["xhigh"].pass_rate.value == 0.75
    assert first.ordering["low/medium"].value == pytest.approx(1.5)
    assert last.ordering["low/medium"].value == pytest.approx(0.5)
    assert summarize(run, "eval", 5).step == 5
    with pytest.raises(ValueError, match=r"steps \[0, 5\]"):
        summarize(run, "eval", 3)
    train = summarize(run, "train", "last")
    assert (train.split, train.step, train.stats["low"].reasoning_tokens.value) == ("train", 3, 5000)

    table = comparison_table([("start (SFT)", first), ("effort-ordered GRPO", last)])
    lines = table.splitlines()
    rows = lines[:4]
    assert len({len(r) for r in rows}) == 1 and len({r.count("|") for r in rows}) == 1  # columns line up
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [
        "",
        "step",
        "tasks",
        "pass L",
        "pass M",
        "pass X",
        "sched L",
        "sched M",
        "sched X",
        "T L",
        "T M",
        "T X",
        "T_L/T_M",
        "T_M/T_X",
    ]
    start = [c.strip() for c in lines[2].strip("|").split("|")]
    lo, hi = wilson_interval(1, 4)
    assert start[:4] == ["start (SFT)", "0", "4", f"25.0% [{100 * lo:.0f}, {100 * hi:.0f}]"]
    assert start[6] == start[3]  # every attempt admitted: the scheduled pass rate is the same
    assert start[9:12] == ["300", "200", "800"]
    assert start[12].startswith("**1.50 [") and start[13].startswith("0.25 [")  # bold = violation
    end = [c.strip() for c in lines[3].strip("|").split("|")]
    assert end[0] == "effort-ordered GRPO" and end[3].startswith("100.0% [")
    assert end[12].startswith("0.50 [") and end[13].startswith("0.50 [")
    assert "L = low, M = medium, X = xhigh" in table

    # A run with no eval attempts falls back to train and says so.
    only_train = load_run(
        write_run(tmp_path / "binary", [att("t0", "low", 10, split="train", step=s) for s in (0, 1)])
    )
    s = summarize(only_train, "eval", "last")
    assert s.split == "train" and s.step == 1 and "no eval attempts" in s.note
    assert "(train)" in comparison_table([("binary", s)]) and "no eval attempts" in comparison_table(
        [("b", s)]
    )


def test_table_bytes_on_fixed_numbers(tmp_path):
    """The table byte for byte, on attempts whose every resample gives the same means (one token
    count per level): the layout, the Wilson intervals, the bold violation, the dashes, a pooled
    train range and its note."""
    a = []
    for t in range(3):
        a.append(att(f"t{t}", "low", 1500, t < 2))
        a.append(att(f"t{t}", "medium", 1200, True))
        a.append(att(f"t{t}", "xhigh", 3000, t < 1, admitted=t < 2))
    run = load_run(write_run(tmp_path / "g", a, name="g"))
    train = [att("t0", e, 40, True, split="train", step=s) for s in (0, 1) for e in ("low", "medium")]
    pooled = step_series(load_run(write_run(tmp_path / "t", train, name="binary")), "eval", window=2)[0]
    table = comparison_table([("start", summarize(run, "eval", "last")), ("binary GRPO", pooled)])
    assert table.splitlines() == [
        "|             |        step | tasks |           pass L |           pass M |        pass X |          sched L |          sched M |       sched X |   T L |   T M |   T X |               T_L/T_M |           T_M/T_X |",
        "|:------------|------------:|------:|-----------------:|-----------------:|--------------:|-----------------:|-----------------:|--------------:|------:|------:|------:|----------------------:|------------------:|",
        "| start       |           0 |     3 |   66.7% [21, 94] | 100.0% [44, 100] | 50.0% [9, 91] |   66.7% [21, 94] | 100.0% [44, 100] | 33.3% [6, 79] | 1,500 | 1,200 | 3,000 | **1.25 [1.25, 1.25]** | 0.40 [0.40, 0.40] |",
        "| binary GRPO | 0–1 (train) |     1 | 100.0% [34, 100] | 100.0% [34, 100] |             – | 100.0% [34, 100] | 100.0% [34, 100] |             – |    40 |    40 |     – |     1.00 [1.00, 1.00] |                 – |",
        "",
        "L = low, M = medium, X = xhigh. pass: pass rate over admitted attempts [95% Wilson]. sched: admitted successes over scheduled attempts, non-admitted (malformed) ones counted as failures [95% Wilson]. T: mean reasoning tokens per admitted attempt. Ratios: T_lower/T_upper [95% bootstrap over tasks]; bold above 1.00 = ordering violation.",
        "binary: no eval attempts; train attempts used",
    ]


def test_scheduled_pass_rate_counts_non_admitted_attempts_as_failures(tmp_path, capsys):
    a = [
        *(att(f"t{t}", "xhigh", 500, True, i=0) for t in range(6)),
        att("t0", "xhigh", 500, False, i=1),
        *(att(f"t{t}", "xhigh", 90, False, admitted=False, i=2) for t in range(3)),  # broke the format
        att("t0", "low", 100, True),
        att("t1", "low", 100, True),
        att("t2", "low", 100, True, admitted=False),  # a stale success: not a verified admitted one
    ]
    run = write_run(
        tmp_path / "r", [{**r, "finish_reason": "malformed"} if not r["admitted"] else r for r in a]
    )
    s = summarize(load_run(run), "eval", "last")
    hi, low, med = s.stats["xhigh"], s.stats["low"], s.stats["medium"]
    assert (hi.scheduled, hi.admitted, hi.successes) == (10, 7, 6)
    assert hi.pass_rate.value == pytest.approx(6 / 7)
    assert hi.pass_rate_scheduled == pytest.approx((0.6, *wilson_interval(6, 10)))
    assert low.pass_rate.value == 1.0 and low.pass_rate_scheduled == pytest.approx(
        (2 / 3, *wilson_interval(2, 3))
    )
    assert med.pass_rate_scheduled is None  # nothing scheduled
    row = [c.strip() for c in comparison_table([("r", s)]).splitlines()[2].strip("|").split("|")]
    assert row[3:9] == [
        "100.0% [34, 100]",
        "–",
        f"85.7% [{100 * wilson_interval(6, 7)[0]:.0f}, {100 * wilson_interval(6, 7)[1]:.0f}]",
        f"66.7% [{100 * wilson_interval(2, 3)[0]:.0f}, {100 * wilson_interval(2, 3)[1]:.0f}]",
        "–",
        f"60.0% [{100 * wilson_interval(6, 10)[0]:.0f}, {100 * wilson_interval(6, 10)[1]:.0f}]",
    ]
    assert main(["report", str(run), "--json", "--out", str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out)
    xhigh = printed["runs"][0]["last"]["stats"]["xhigh"]
    assert xhigh["pass_rate_scheduled"] == pytest.approx(
        {"value": 0.6, "lo": wilson_interval(6, 10)[0], "hi": wilson_interval(6, 10)[1]}
    )
    assert xhigh["pass_rate"]["value"] == pytest.approx(6 / 7)
    assert printed["runs"][0]["last"]["stats"]["medium"]["pass_rate_scheduled"] is None


def test_step_series_pools_windows(tmp_path):
    run = load_run(write_run(tmp_path / "r", synthetic(3, 4, steps=(0, 4), shrink_low=0.1)))
    per_step = step_series(run, "train", n_boot=200)
    assert [s.step for s in per_step] == [0, 1, 2, 3, 4]
    pooled = step_series(run, "train", window=2, n_boot=200)
    assert [(s.first_step, s.step) for s in pooled] == [(0, 1), (2, 3), (4, 4)]
    assert pooled[0].stats["low"].admitted == 2 * per_step[0].stats["low"].admitted
    assert [s.step for s in step_series(run, "eval", n_boot=200)] == [0, 4]


# ---------------------------------------------------------------------------------------------- CLI


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_writes_pictures_and_compares_runs(tmp_path, capsys):
    start_binary = synthetic(5, 12, steps=(0, 2, 4), shrink_low=0.0)
    ordered = synthetic(5, 12, steps=(0, 2, 4), shrink_low=0.15)
    a = write_run(tmp_path / "binary", start_binary, name="binary GRPO")
    b = write_run(
        tmp_path / "ordered", ordered, tail='{"split": "eval"'
    )  # killed mid-write; name from the dir
    out = tmp_path / "pictures"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "truncated last line" in captured.err
    lines = captured.out.splitlines()
    names = [line.split("|")[1].strip() for line in lines[2:5]]
    assert names == ["start", "binary GRPO", "ordered"]
    for name in ("frontier.png", "ordering.png", "pass_rate.png"):
        w, h = png_size(out / name)
        assert 300 <= w <= 4000 and 200 <= h <= 3000, (name, w, h)
        assert (out / name).stat().st_size > 10_000
        assert f"wrote {out / name}" in captured.out
    assert not list(out.glob(".*tmp"))  # no temp files left behind
    report = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["binary GRPO", "ordered"]
    assert report["runs"][1]["skipped_truncated_line"] is True
    last = report["runs"][1]["last"]
    assert last["step"] == 4 and last["split"] == "eval"
    # Low's reasoning was cut by 60% by step 4 in the ordered run: its ratio moved below 1.
    first_ratio = report["runs"][1]["first"]["ordering"]["low/medium"]["value"]
    assert first_ratio > 1.0 and last["ordering"]["low/medium"]["value"] < first_ratio * 0.6
    assert report["table"] in captured.out

    assert main(["report", str(b), "--json", "--split", "train"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["runs"][0]["last"]["split"] == "train" and printed["runs"][0]["last"]["step"] == 4
    assert (b / "report" / "frontier.png").exists() and (b / "report" / "report.json").exists()


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--help"])
    assert e.value.code == 0 and "RUN_DIR" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "run.json" in capsys.readouterr().err


def test_import_does_not_load_matplotlib():
    code = "import sys, jaxpi.rl.report, jaxpi.cli.report, jaxpi.stats.plots; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})

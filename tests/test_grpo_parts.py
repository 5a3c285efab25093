"""The GRPO loop's pure parts: row layout, task draws and seeds, resume bookkeeping, gap metrics,
and the run config's validation."""

import dataclasses
import json

import numpy as np
import pytest

from jaxpi.configfile import load_config, to_dict
from jaxpi.envs.agent_loop import Trajectory
from jaxpi.rl.batch import bucket_length, trajectory_batch
from jaxpi.rl.collect import attempt_records, collection_attempts, collection_seed, draw_tasks
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.metrics import engine_gap_metrics
from jaxpi.rl.resume import FIXED_ON_RESUME, changed_keys, truncate_attempts, with_later_defaults
from jaxpi.rl.reward import RewardConfig, score_collection
from jaxpi.stats.levels import level_stats


def traj(
    ids, mask, logp, *, malformed=False, name="t", task="t", success=False, finish=None, tool_calls=None
):
    return Trajectory(
        task_id=task,
        level="low",
        token_ids=ids,
        mask=mask,
        logprobs=logp,
        prompt_len=mask.index(1) if 1 in mask else len(mask),
        reasoning_tokens=0,
        output_tokens=sum(mask),
        turns=1,
        finish_reason=finish or ("malformed" if malformed else "answer"),
        success=success,
        malformed=malformed,
        attempt_id=name,
        tool_calls=tool_calls,
    )


def test_bucket_length():
    assert bucket_length(1, 128, 512) == 128
    assert bucket_length(128, 128, 512) == 128
    assert bucket_length(129, 128, 512) == 256
    assert bucket_length(500, 128, 500) == 500  # capped at the context
    with pytest.raises(ValueError, match="does not fit"):
        bucket_length(513, 128, 512)


def test_trajectory_batch_layout():
    a = traj([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -1.5, -0.5], name="a")
    b = traj([9, 10, 11], [0, 1, 1], [0.0, -2.0, -3.0], malformed=True, name="b")
    out = trajectory_batch([a, b], [0.5, -0.25], length=6, rows=3)
    np.testing.assert_array_equal(out["input_ids"], [[5, 6, 7, 8, 0, 0], [9, 10, 11, 0, 0, 0], [0] * 6])
    # The malformed attempt keeps its tokens (for the record) but has no supervised token and no advantage.
    np.testing.assert_array_equal(out["loss_mask"], [[0, 0, 1, 1, 0, 0], [0] * 6, [0] * 6])
    np.testing.assert_allclose(out["logp_engine"][0], [0, 0, -1.5, -0.5, 0, 0])
    np.testing.assert_allclose(out["advantages"], [0.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="rows hold 3"):
        trajectory_batch([a], [0.0], length=3)
    with pytest.raises(ValueError, match="differ in length"):
        trajectory_batch([traj([1, 2], [0, 1], [0.0])], [0.0], length=4)
    with pytest.raises(ValueError, match="do not fit 1 rows"):
        trajectory_batch([a, a], [0.0, 0.0], length=8, rows=1)


def test_malformed_attempts_supervised_only_when_scored_as_failures():
    ok = traj([5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -1.5, -0.5], name="ok", success=True)
    cut = traj([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.5], name="cut", finish="max_tokens")  # budget spent
    broken = traj([5, 9, 10, 11], [0, 1, 1, 1], [0.0, -2.0, -3.0, -1.0], malformed=True, name="broken")
    old = traj([5, 9, 10], [0, 1, 1], [0.0, -2.0, -3.0], malformed=True, name="old")  # stale and broken
    trajs = [ok, cut, broken, old]
    attempts = collection_attempts(trajs, [3, 3, 3, 1], current=3, max_staleness=1)
    # Only the fresh attempt the loop ended as malformed qualifies; the budget-cut one is admitted.
    assert [(a.admitted, a.malformed) for a in attempts] == [
        (True, False),
        (True, False),
        (False, True),
        (False, False),
    ]
    masks = {}
    for setting in ("exclude", "fail"):
        score = score_collection(attempts, RewardConfig(malformed=setting))
        out = trajectory_batch(trajs, score.advantages, length=5, supervised=score.scored)
        masks[setting] = out["loss_mask"]
        np.testing.assert_array_equal(out["loss_mask"][:2], [[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
        assert not out["loss_mask"][3].any() and out["advantages"][3] == 0.0  # stale: never trained on
        if setting == "fail":
            # The broken attempt's sampled tokens are supervised, with a failure's advantage.
            np.testing.assert_array_equal(out["loss_mask"][2], [0, 1, 1, 1, 0])
            np.testing.assert_allclose(out["advantages"][:3], [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)
        else:
            assert not out["loss_mask"][2].any() and out["advantages"][2] == 0.0
            np.testing.assert_allclose(out["advantages"][:3], [0.5, -0.5, 0.0], rtol=1e-6)
        recs = attempt_records("train", 3, trajs, score, [3, 3, 3, 1])
        assert [r["scored"] for r in recs] == [True, True, setting == "fail", False]
    # Without `supervised` the rows follow admission, as under "exclude".
    np.testing.assert_array_equal(trajectory_batch(trajs, [0.0] * 4, length=5)["loss_mask"], masks["exclude"])
    with pytest.raises(ValueError, match="3 supervised flags for 4"):
        trajectory_batch(trajs, [0.0] * 4, length=5, supervised=[True] * 3)


def test_tool_calls_reach_the_reward_the_records_and_the_level_stats():
    trajs = [
        traj([5, 6], [0, 1], [0.0, -1.0], name="lean", success=True, tool_calls=1),
        traj([5, 6], [0, 1], [0.0, -1.0], name="heavy", success=True, tool_calls=4),
        traj([5, 6], [0, 1], [0.0, -1.0], name="lost", tool_calls=0),
    ]
    attempts = collection_attempts(trajs, [0, 0, 0], current=0, max_staleness=1)
    assert [a.tool_calls for a in attempts] == [1, 4, 0]
    score = score_collection(attempts, RewardConfig(kind="binary", levels=("low",), tool_bonus=0.1))
    # The lean success saved 3 of the heavy one's 4 calls; the failure made fewer still and gets nothing.
    np.testing.assert_allclose(score.rewards, [1.075, 1.0, 0.0], rtol=0, atol=1e-15)
    assert score.levels["low"].mean_tool_calls == pytest.approx(5 / 3)
    lines = json.loads(json.dumps(attempt_records("train", 0, trajs, score)))
    assert [r["tool_calls"] for r in lines] == [1, 4, 0]
    assert level_stats(lines, ["low"])["low"].tool_calls == pytest.approx(5 / 3)
    # attempts.jsonl written before the count existed: the mean is unknown, not zero.
    older = [{k: v for k, v in r.items() if k != "tool_calls"} for r in lines]
    assert level_stats(older, ["low"])["low"].tool_calls is None


def test_pi_attempt_carries_its_tool_calls():
    from jaxpi.rl.pi_env import attempt_trajectory
    from jaxpi.runner.record import AttemptRecord

    rec = AttemptRecord(
        "a", "t", "low", False, False, "upstream_error", None, 2, 0, 0, 1.0,
        session_path="session.jsonl", tool_calls={"bash": 2, "read": 1},
    )  # fmt: skip
    assert attempt_trajectory(rec, [], (1, 2)).tool_calls == 3
    # No session came back: what Pi ran is unknown.
    gone = dataclasses.replace(rec, session_path=None, tool_calls={})
    assert attempt_trajectory(gone, [], (1, 2)).tool_calls is None


def test_draws_and_seeds_are_functions_of_seed_and_step():
    a = draw_tasks(100, 8, seed=0, step=3)
    assert a == draw_tasks(100, 8, seed=0, step=3) and len(set(a)) == 8 and all(0 <= i < 100 for i in a)
    assert a != draw_tasks(100, 8, seed=0, step=4) and a != draw_tasks(100, 8, seed=1, step=3)
    seeds = {collection_seed(s, k, split) for s in (0, 1) for k in range(5) for split in ("train", "eval")}
    assert len(seeds) == 20 and all(0 <= x < 2**31 for x in seeds)


def test_truncate_attempts_keeps_earlier_steps_and_drops_a_torn_line(tmp_path):
    p = tmp_path / "attempts.jsonl"
    recs = [{"step": s, "i": i} for s in range(4) for i in range(2)]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "i"')
    assert truncate_attempts(p, 2) == 4
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [0, 0, 1, 1]
    p.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"attempts.jsonl:2"):
        truncate_attempts(p, 5)
    assert truncate_attempts(tmp_path / "none.jsonl", 3) == 0
    # The evaluation after update 2 ran before checkpoint 2: a resume from it keeps that evaluation
    # (and redoes collection 2); a run without a checkpoint keeps nothing, the step-0 evaluation too.
    recs = [{"split": split, "step": s} for s in range(4) for split in ("eval", "train")]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert truncate_attempts(p, 2) == 5
    assert [(r["split"], r["step"]) for r in map(json.loads, p.read_text().splitlines())] == [
        ("eval", 0), ("train", 0), ("eval", 1), ("train", 1), ("eval", 2),
    ]  # fmt: skip
    assert truncate_attempts(p, 0) == 0


def test_changed_keys():
    saved = {"reward": {"kind": "binary"}, "train": {"seed": 0, "checkpoint_every": 5, "collections": 9}}
    same = {"reward": {"kind": "binary"}, "train": {"seed": 0, "checkpoint_every": 2, "collections": 9}}
    assert changed_keys(saved, same, FIXED_ON_RESUME) == []
    other = {
        "reward": {"kind": "effort_ordered"},
        "train": {"seed": 1, "checkpoint_every": 5, "collections": 9},
    }
    assert changed_keys(saved, other, FIXED_ON_RESUME) == ["reward", "train.seed"]
    # A run saved before a field existed (reward.malformed, ...) resumes under its default only.
    cfg = load_config(GRPOConfig, "configs/grpo/tiny.yaml")
    old = to_dict(cfg)
    del old["reward"]["malformed"], old["model"]["norm_impl"], old["collect"]["max_staleness"]
    assert changed_keys(with_later_defaults(old), to_dict(cfg), FIXED_ON_RESUME) == []
    fail = to_dict(load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["reward.malformed=fail"]))
    assert changed_keys(with_later_defaults(old), fail, FIXED_ON_RESUME) == ["reward"]


def test_engine_gap_metrics_against_the_formula():
    old = np.array([[0.0, -1.0, -2.0, -0.5]])
    eng = np.array([[0.0, -1.5, -1.0, -9.0]])
    mask = np.array([[0, 1, 1, 0]])
    m = engine_gap_metrics(old, eng, mask, cap=2.0)
    w = np.minimum(np.exp([0.5, -1.0]), 2.0)
    assert m["logp_diff_mean"] == pytest.approx(0.75) and m["logp_diff_max"] == pytest.approx(1.0)
    assert m["is_weight_mean"] == pytest.approx(w.mean()) and m["is_capped_frac"] == 0.0
    m = engine_gap_metrics(old, eng, mask, cap=1.2)
    assert m["is_weight_max"] == pytest.approx(1.2) and m["is_capped_frac"] == pytest.approx(0.5)
    assert engine_gap_metrics(old, eng, np.zeros_like(mask), cap=2.0) == {}


def test_config_validation():
    cfg = load_config(GRPOConfig, "configs/grpo/tiny.yaml")
    assert cfg.rows == cfg.collect.tasks * 3 * cfg.collect.group
    with pytest.raises(ValueError, match="does not divide"):
        load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["train.grad_accum=5"])
    with pytest.raises(ValueError, match=r"env\.name"):
        load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["env.name=nope"])
    with pytest.raises(ValueError, match=r"collect\.group"):
        load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["collect.group=0"])
    with pytest.raises(ValueError, match=r"reward\.kind"):
        load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["reward.kind=other"])
    with pytest.raises(ValueError, match=r"reward\.malformed must be one of \['exclude', 'fail'\]"):
        load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["reward.malformed=ignore"])
    assert cfg.reward.malformed == "exclude"
    with pytest.raises(ValueError, match=r"env\.tasks_dir"):
        load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["env.name=pi"])
    pi = load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["env.name=pi", "env.tasks_dir=tasks/basic"])
    assert pi.env.tasks_dir == "tasks/basic" and pi.env.jobs >= 1

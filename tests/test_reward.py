"""Effort-ordered reward and advantages on hand-built collections, every number worked out by hand;
the tool-efficiency bonus by hand and by its properties over drawn collections."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.configfile import load_config
from jaxpi.rl import (
    KINDS,
    PHI,
    Attempt,
    RewardConfig,
    advantages,
    applicable_reference,
    phi,
    references,
    rewards,
    score_collection,
    tool_bonuses,
)
from jaxpi.rl.reward import MALFORMED, TOOL_BONUS_MAX, scored

# A small floor keeps the hand arithmetic readable; n_min = 2 as by default.
CFG = RewardConfig(n_min=2, b_min=10.0, phi="exp", phi_scale=1.0)
E1 = math.exp(-1.0)
E15 = math.exp(-1.5)


def att(task: str, level: str, ok: bool, tokens: int, **kw) -> Attempt:
    return Attempt(task_id=task, level=level, success=ok, reasoning_tokens=tokens, **kw)


# Task "t": every level has a reference; low is held to medium's (leaner than xhigh's).
MAIN = [
    att("t", "xhigh", True, 100),  # 0  S(t,H) = {100, 300}: median 200 (mean of the middle two)
    att("t", "xhigh", True, 300),  # 1
    att("t", "xhigh", False, 50),  # 2
    att("t", "medium", True, 80),  # 3  S(t,M) = {80, 120, 500}: median 120
    att("t", "medium", True, 120),  # 4
    att("t", "medium", True, 500),  # 5  held to B_H = 200: z = 1.5
    att("t", "medium", False, 10),  # 6
    att("t", "low", True, 120),  # 7  held to min(120, 200) = 120: exactly at the reference
    att("t", "low", True, 240),  # 8  z = 1
    att("t", "low", True, 60),  # 9
    att("t", "low", False, 30),  # 10
]
MAIN_R = [1, 1, 0, 1, 1, 0.5 + 0.5 * E15, 0, 1, 0.5 + 0.5 * E1, 1, 0]


def test_references_median_per_task_and_level():
    assert references(MAIN, CFG) == {("t", "xhigh"): 200.0, ("t", "medium"): 120.0, ("t", "low"): 120.0}


def test_applicable_reference_is_the_leanest_above():
    refs = references(MAIN, CFG)
    assert applicable_reference("t", "xhigh", refs, CFG) is None  # xhigh receives none
    assert applicable_reference("t", "medium", refs, CFG) == 200.0  # xhigh only
    assert applicable_reference("t", "low", refs, CFG) == 120.0  # min(medium 120, xhigh 200)
    # xhigh leaner than medium: low follows xhigh.
    assert applicable_reference("w", "low", {("w", "medium"): 500.0, ("w", "xhigh"): 150.0}, CFG) == 150.0
    # Only medium defined: low follows medium; medium gets none.
    assert applicable_reference("w", "low", {("w", "medium"): 500.0}, CFG) == 500.0
    assert applicable_reference("w", "medium", {("w", "medium"): 500.0}, CFG) is None
    # Another task's references never apply.
    assert applicable_reference("other", "low", refs, CFG) is None


def test_rewards_main_collection():
    np.testing.assert_allclose(rewards(MAIN, CFG), MAIN_R, rtol=0, atol=1e-12)
    r = rewards(MAIN, CFG)
    assert r[7] == 1.0  # at the reference: full reward, exactly
    assert r[9] == 1.0  # under it: no bonus beyond 1
    assert 0.5 < r[8] < 1.0 and 0.5 < r[5] < 1.0  # over it: penalised, but above any failure


def test_advantages_mean_centred_per_group_without_std():
    r = np.array(MAIN_R, dtype=float)
    a = advantages(MAIN, r, CFG)
    m_mean = (1 + 1 + (0.5 + 0.5 * E15) + 0) / 4
    l_mean = (1 + (0.5 + 0.5 * E1) + 1 + 0) / 4
    expected = [
        1 / 3, 1 / 3, -2 / 3,
        1 - m_mean, 1 - m_mean, 0.5 + 0.5 * E15 - m_mean, -m_mean,
        1 - l_mean, 0.5 + 0.5 * E1 - l_mean, 1 - l_mean, -l_mean,
    ]  # fmt: skip
    np.testing.assert_allclose(a, expected, rtol=0, atol=1e-12)
    for idx in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10]):
        assert abs(a[idx].sum()) < 1e-12
    # Not std-scaled: the spread of the xhigh group is its reward spread, not 1.
    assert np.std(a[[0, 1, 2]]) == pytest.approx(np.std([1, 1, 0]))


def test_no_reference_falls_back_to_correctness():
    attempts = [
        att("u", "xhigh", True, 900),  # one success < n_min: no B(u,H)
        att("u", "xhigh", False, 40),
        att("u", "medium", True, 5000),  # nothing above defined: R = 1 however long
        att("u", "medium", False, 20),
        att("u", "low", True, 10_000),
        att("u", "low", True, 3),
    ]
    # Only low has two successes; its own reference (median of 10 000 and 3) applies to nobody.
    assert references(attempts, CFG) == {("u", "low"): 5001.5}
    np.testing.assert_array_equal(rewards(attempts, CFG), [1, 0, 1, 0, 1, 1])
    # The low group's rewards are all 1: no signal.
    np.testing.assert_array_equal(advantages(attempts, rewards(attempts, CFG), CFG)[4:], [0, 0])


def test_b_min_floor():
    attempts = [
        att("v", "xhigh", True, 3),  # median 4 < b_min = 10: B(v,H) = 10
        att("v", "xhigh", True, 5),
        att("v", "medium", True, 15),  # z = 15/10 − 1 = 0.5
        att("v", "medium", True, 8),  # under the floor: R = 1
    ]
    assert references(attempts, CFG)[("v", "xhigh")] == 10.0
    np.testing.assert_allclose(rewards(attempts, CFG), [1, 1, 0.5 + 0.5 * math.exp(-0.5), 1], atol=1e-12)


def test_xhigh_leaner_reference_applies_to_low():
    attempts = [
        att("w", "xhigh", True, 100),
        att("w", "xhigh", True, 200),  # B_H = 150
        att("w", "medium", True, 400),
        att("w", "medium", True, 600),  # B_M = 500; medium itself held to 150: z = 5/3 and 3
        att("w", "low", True, 300),  # held to min(500, 150) = 150: z = 1
    ]
    r = rewards(attempts, CFG)
    np.testing.assert_allclose(
        r, [1, 1, 0.5 + 0.5 * math.exp(-5 / 3), 0.5 + 0.5 * math.exp(-3), 0.5 + 0.5 * E1], atol=1e-12
    )
    # A single-attempt group: its mean is itself, so no signal.
    assert advantages(attempts, r, CFG)[4] == 0.0


def test_failures_score_zero_however_short():
    attempts = [att("t", "low", False, 0), att("t", "xhigh", False, 1)]
    np.testing.assert_array_equal(rewards(attempts, CFG), [0, 0])


def test_uniform_groups_get_exactly_zero_advantage():
    attempts = [att("t", "low", True, 10)] * 3 + [att("t", "xhigh", False, 10)] * 2
    # 0.1 · 3 / 3 is not 0.1 in floating point; a uniform group must still give exact zeros.
    a = advantages(attempts, [0.1, 0.1, 0.1, 0.0, 0.0], CFG)
    assert np.all(a == 0.0)
    assert np.all(advantages(attempts, rewards(attempts, CFG), CFG) == 0.0)


def test_binary_baseline_with_and_without_std():
    attempts = [
        att("t", "low", True, 99_999),  # length ignored
        att("t", "low", False, 10),
        att("t", "low", False, 10),
        att("t", "low", False, 10),
        att("t", "xhigh", True, 10),
        att("t", "xhigh", True, 10),
    ]
    plain = RewardConfig(kind="binary")
    r = rewards(attempts, plain)
    np.testing.assert_array_equal(r, [1, 0, 0, 0, 1, 1])
    np.testing.assert_allclose(advantages(attempts, r, plain), [0.75, -0.25, -0.25, -0.25, 0, 0], atol=1e-12)
    # std of {1, 0, 0, 0} is sqrt(3/16): 0.75 / sqrt(3/16) = sqrt(3), −0.25 / sqrt(3/16) = −1/sqrt(3).
    scaled = RewardConfig(kind="binary", std_scale=True, std_eps=1e-9)
    s3 = math.sqrt(3)
    np.testing.assert_allclose(
        advantages(attempts, r, scaled), [s3, -1 / s3, -1 / s3, -1 / s3, 0, 0], rtol=1e-7
    )


def test_non_admitted_attempts_are_outside_every_group():
    attempts = [
        att("t", "xhigh", True, 100, admitted=False),
        att("t", "xhigh", True, 300, admitted=False),
        att("t", "xhigh", True, 200),  # one admitted success: no B(t,H)
        att("t", "medium", True, 5000),
        att("t", "medium", False, 10),
    ]
    assert references(attempts, CFG) == {}
    r = rewards(attempts, CFG)
    np.testing.assert_array_equal(r, [0, 0, 1, 1, 0])
    np.testing.assert_allclose(advantages(attempts, r, CFG), [0, 0, 0, 0.5, -0.5], atol=1e-12)
    score = score_collection(attempts, CFG)
    assert score.levels["xhigh"].scheduled == 3 and score.levels["xhigh"].count == 1


def test_order_of_attempts_does_not_matter():
    perm = np.random.default_rng(0).permutation(len(MAIN))
    shuffled = [MAIN[i] for i in perm]
    r = rewards(shuffled, CFG)
    np.testing.assert_allclose(r, np.array(MAIN_R)[perm], atol=1e-12)
    np.testing.assert_allclose(advantages(shuffled, r, CFG), advantages(MAIN, MAIN_R, CFG)[perm], atol=1e-12)


@pytest.mark.parametrize("kind", sorted(PHI))
def test_phi_forms(kind):
    z = np.linspace(0.0, 20.0, 201)
    for s in (0.5, 1.0, 3.0):
        v = phi(z, kind, s)
        assert v[0] == 1.0
        assert np.all(np.diff(v) < 0)  # strictly decreasing
        assert np.all(v > 0)
        assert phi(1e9, kind, s) < 1e-6  # → 0
    # Rewards of successes stay in [1/2, 1].
    assert 0.5 <= 0.5 + 0.5 * float(phi(1e9, kind)) <= 1.0
    with pytest.raises(ValueError, match="z >= 0"):
        phi(-0.1, kind)


def test_phi_values_at_the_scale():
    assert float(phi(2.0, "exp", 2.0)) == pytest.approx(math.exp(-1))
    assert float(phi(2.0, "rational", 2.0)) == pytest.approx(0.5)
    cfg = RewardConfig(n_min=2, b_min=10.0, phi="rational", phi_scale=2.0)
    # Task "t" low attempt 8: z = 1 → φ = 1 / (1 + 1/2) = 2/3 → R = 1/2 + 1/3.
    assert rewards(MAIN, cfg)[8] == pytest.approx(0.5 + 1 / 3)
    with pytest.raises(ValueError, match="unknown phi"):
        phi(0.0, "linear")


def test_score_collection_summary_and_ordering():
    attempts = [
        *MAIN[:7],
        *(dataclasses.replace(a, output_tokens=a.reasoning_tokens + 10, turns=2) for a in MAIN[7:]),
    ]
    score = score_collection(attempts, CFG)
    np.testing.assert_allclose(score.rewards, MAIN_R, atol=1e-12)
    np.testing.assert_allclose(score.advantages, advantages(MAIN, MAIN_R, CFG), atol=1e-12)
    assert score.references == references(MAIN, CFG)
    low, med, hi = score.levels["low"], score.levels["medium"], score.levels["xhigh"]
    assert (low.count, med.count, hi.count) == (4, 4, 3)
    assert (low.pass_rate, med.pass_rate, hi.pass_rate) == (0.75, 0.75, pytest.approx(2 / 3))
    # Mean reasoning tokens per admitted attempt, failures included.
    assert low.mean_reasoning_tokens == (120 + 240 + 60 + 30) / 4 == 112.5
    assert med.mean_reasoning_tokens == (80 + 120 + 500 + 10) / 4 == 177.5
    assert hi.mean_reasoning_tokens == pytest.approx(450 / 3)
    assert low.mean_success_reasoning_tokens == 140.0 and hi.mean_success_reasoning_tokens == 200.0
    assert low.mean_output_tokens == 122.5 and low.mean_turns == 2.0
    assert med.mean_output_tokens is None  # not carried by these attempts
    assert score.ordering == {
        "low/medium": pytest.approx(112.5 / 177.5),
        "medium/xhigh": pytest.approx(177.5 / 150),
    }
    assert score.groups == 3 and score.groups_with_signal == 3
    m = score.metrics()
    assert m["ordering/medium/xhigh"] == pytest.approx(177.5 / 150)  # > 1: a violation
    assert m["level/low/pass_rate"] == 0.75 and "level/medium/mean_output_tokens" not in m


def test_ordering_undefined_without_attempts():
    score = score_collection([att("t", "low", True, 5)], CFG)
    assert score.ordering == {"low/medium": None, "medium/xhigh": None}
    assert score.levels["medium"].pass_rate is None and score.levels["medium"].count == 0


def test_level_outside_config_names_the_attempt():
    attempts = [att("t", "low", True, 5), att("t2", "high", True, 5, attempt_id="a7")]
    for fn in (references, rewards, score_collection):
        with pytest.raises(ValueError, match=r"attempt 1 \(task 't2', id 'a7'\): level 'high'"):
            fn(attempts, CFG)
    with pytest.raises(ValueError, match="level 'high'"):
        applicable_reference("t", "high", {}, CFG)
    # The same attempts are fine with Pi's six levels configured.
    six = RewardConfig(levels=("off", "minimal", "low", "medium", "high", "xhigh"))
    assert rewards(attempts, six).tolist() == [1.0, 1.0]


def test_bad_attempt_fields_and_reward_shapes():
    with pytest.raises(ValueError, match=r"attempt 0 .*reasoning_tokens must be >= 0"):
        rewards([att("t", "low", True, -1)], CFG)
    with pytest.raises(ValueError, match="success must be a bool"):
        rewards([att("t", "low", "yes", 1)], CFG)
    with pytest.raises(ValueError, match=r"rewards has shape \(2,\), expected \(1,\)"):
        advantages([att("t", "low", True, 1)], [1.0, 0.0], CFG)
    with pytest.raises(ValueError, match="finite"):
        advantages([att("t", "low", True, 1)], [float("nan")], CFG)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "ppo"}, "reward.kind must be one of"),
        ({"levels": ()}, "at least one effort level"),
        ({"levels": ("low", "low")}, "must not repeat"),
        ({"levels": ("low", "")}, "non-empty strings"),
        ({"n_min": 0}, "n_min must be an integer >= 1"),
        ({"n_min": 1.5}, "n_min must be an integer >= 1"),
        ({"b_min": 0.0}, "b_min must be a finite number > 0"),
        ({"b_min": float("inf")}, "b_min must be a finite number > 0"),
        ({"phi": "linear"}, "reward.phi must be one of"),
        ({"phi_scale": -1.0}, "phi_scale must be a finite number > 0"),
        ({"std_scale": True}, "std_scale is only for kind='binary'"),
        ({"kind": "binary", "std_eps": 0.0}, "std_eps must be > 0"),
        ({"malformed": "drop"}, r"reward.malformed must be one of \['exclude', 'fail'\]"),
    ],
)
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**fields)


def test_config_levels_list_becomes_tuple():
    cfg = RewardConfig(levels=["low", "xhigh"])
    assert cfg.levels == ("low", "xhigh")
    hash(cfg)  # frozen and hashable


def test_numpy_scalars_from_a_loop_are_accepted():
    attempts = [att("t", "low", np.bool_(True), np.int64(7)), att("t", "low", np.bool_(False), np.int32(3))]
    np.testing.assert_array_equal(rewards(attempts, CFG), [1, 0])


def test_config_from_yaml_style_overrides():
    cfg = load_config(RewardConfig, None, ["levels=[low,xhigh]", "phi=rational", "b_min=100", "n_min=3"])
    assert cfg == RewardConfig(levels=("low", "xhigh"), phi="rational", b_min=100.0, n_min=3)


# ---- malformed attempts: left out ("exclude", the default) or scored as failures ("fail") -------

FAIL = RewardConfig(n_min=2, b_min=10.0, phi="exp", phi_scale=1.0, malformed="fail")
E025 = math.exp(-0.25)
MAL = [
    att("t", "xhigh", True, 100),  # 0  S(t,H) = {100, 300}: B_H = 200 under both settings
    att("t", "xhigh", True, 300),  # 1
    att("t", "xhigh", False, 40, admitted=False, malformed=True),  # 2  broke the format
    att("t", "medium", True, 150),  # 3  held to B_H = 200: under it, R = 1
    att("t", "medium", True, 250),  # 4  z = 0.25
    att("t", "medium", False, 20),  # 5
    att("t", "medium", False, 5, admitted=False, malformed=True),  # 6
    att("t", "low", True, 400),  # 7  held to min(B_M = 200, B_H = 200): z = 1
    att("t", "low", False, 7, admitted=False, malformed=True),  # 8
    att("t", "low", True, 50, admitted=False),  # 9  left out for another reason (stale): never scored
]


def test_malformed_exclude_is_the_rule_for_non_admitted_attempts():
    score = score_collection(MAL, CFG)
    unmarked = score_collection([dataclasses.replace(a, malformed=False) for a in MAL], CFG)
    # The flag changes nothing under "exclude", bit for bit.
    for field in ("rewards", "advantages", "scored"):
        np.testing.assert_array_equal(getattr(score, field), getattr(unmarked, field))
    assert score.levels == unmarked.levels and score.references == unmarked.references
    r_m = 0.5 + 0.5 * E025
    np.testing.assert_allclose(score.rewards, [1, 1, 0, 1, r_m, 0, 0, 0.5 + 0.5 * E1, 0, 0], atol=1e-12)
    m_mean = (1 + r_m + 0) / 3
    # xhigh's admitted attempts all succeeded: no signal; low's lone admitted attempt: none either.
    np.testing.assert_allclose(
        score.advantages, [0, 0, 0, 1 - m_mean, r_m - m_mean, -m_mean, 0, 0, 0, 0], atol=1e-12
    )
    assert score.scored.tolist() == [a.admitted for a in MAL]
    assert (score.groups, score.groups_with_signal) == (3, 1)


def test_malformed_fail_counts_them_as_failures_in_their_group():
    score = score_collection(MAL, FAIL)
    assert score.scored.tolist() == [True] * 9 + [False]
    # References use successes only: unchanged, and so are the rewards.
    assert score.references == references(MAL, CFG) == {("t", "xhigh"): 200.0, ("t", "medium"): 200.0}
    np.testing.assert_array_equal(score.rewards, score_collection(MAL, CFG).rewards)
    r_m, r_l = 0.5 + 0.5 * E025, 0.5 + 0.5 * E1
    m_mean = (1 + r_m + 0 + 0) / 4
    expected = [
        1 / 3, 1 / 3, -2 / 3,  # a group whose admitted attempts all succeeded now has signal
        1 - m_mean, r_m - m_mean, -m_mean, -m_mean,  # the malformed one takes a failure's advantage
        r_l / 2, -r_l / 2,  # the malformed attempt enters low's mean
        0,  # stale: outside, as before
    ]  # fmt: skip
    np.testing.assert_allclose(score.advantages, expected, atol=1e-12)
    assert (score.groups, score.groups_with_signal) == (3, 3)
    hi, med, low = score.levels["xhigh"], score.levels["medium"], score.levels["low"]
    # Admitted pass rates as before; the scheduled one counts every non-admitted attempt as a failure.
    assert (hi.pass_rate, med.pass_rate, low.pass_rate) == (1.0, pytest.approx(2 / 3), 1.0)
    assert (hi.pass_rate_scheduled, med.pass_rate_scheduled, low.pass_rate_scheduled) == (
        pytest.approx(2 / 3),
        0.5,
        pytest.approx(1 / 3),  # the stale success is not a verified admitted one
    )
    assert (
        hi.mean_reward == pytest.approx(2 / 3) and score_collection(MAL, CFG).levels["xhigh"].mean_reward == 1
    )
    m = score.metrics()
    assert m["level/medium/pass_rate_scheduled"] == 0.5 and m["level/xhigh/pass_rate"] == 1.0
    # The binary baseline takes the same groups.
    binary = RewardConfig(kind="binary", malformed="fail")
    np.testing.assert_allclose(score_collection(MAL, binary).advantages[:3], [1 / 3, 1 / 3, -2 / 3])


def test_malformed_attempts_are_checked():
    for bad in (
        att("t", "low", False, 3, malformed=True),  # admitted
        att("t", "low", True, 3, admitted=False, malformed=True),  # a success
    ):
        with pytest.raises(ValueError, match=r"attempt 0 \(task 't'\): a malformed attempt must be neither"):
            score_collection([bad], FAIL)


# ---- the tool-efficiency bonus, equation (6) ------------------------------------------------------

LEVELS = CFG.levels


def tools(task: str, level: str, ok: bool, calls: int | None, tokens: int = 50, **kw) -> Attempt:
    return att(task, level, ok, tokens, tool_calls=calls, **kw)


def test_tool_bonus_by_hand():
    w = 0.1
    group = [
        tools("t", "low", True, 2),  # 0  M = 4: w·(1 − 2/4) = 0.05
        tools("t", "low", True, 4),  # 1  the heaviest success: 0
        tools("t", "low", True, None),  # 2  not counted: no bonus, and not in C
        tools("t", "low", False, 1),  # 3  a failure with fewer calls: 0
        tools("t", "low", True, 0, admitted=False),  # 4  not admitted: 0
        tools("t", "medium", True, 9),  # 5  the group's only success: 0
        tools("u", "low", True, 0),  # 6  every success of u/low made no call: 0
        tools("u", "low", True, 0),  # 7
        tools("v", "low", True, 0),  # 8  M = 3: the full w
        tools("v", "low", True, 3),  # 9
    ]
    binary = RewardConfig(kind="binary", tool_bonus=w)
    np.testing.assert_array_equal(tool_bonuses(group, binary), [0.05, 0, 0, 0, 0, 0, 0, 0, w, 0])
    np.testing.assert_allclose(
        rewards(group, binary), [1.05, 1, 1, 0, 0, 1, 1, 1, 1 + w, 1], rtol=0, atol=1e-15
    )
    # Effort-ordered: the bonus adds to equation (4), here to medium's R = 1/2 + 1/2·e^(−1).
    eo = [tools("t", "xhigh", True, 1, 100), tools("t", "xhigh", True, 1, 100)]
    eo += [tools("t", "medium", True, 2, 200), tools("t", "medium", True, 8, 100)]
    cfg = dataclasses.replace(CFG, tool_bonus=w)
    np.testing.assert_allclose(rewards(eo, cfg), [1, 1, 0.5 + 0.5 * E1 + w * 0.75, 1], rtol=0, atol=1e-15)


@pytest.mark.parametrize("weight", [-0.1, 0.51, 1.0, float("nan"), float("inf"), True, "0.1"])
def test_tool_bonus_weight_is_validated(weight):
    with pytest.raises(ValueError, match=r"reward\.tool_bonus must be a number in \[0, 0\.5\]"):
        RewardConfig(tool_bonus=weight)


def test_tool_bonus_weight_bounds_and_yaml():
    assert RewardConfig().tool_bonus == 0.0  # off by default
    RewardConfig(tool_bonus=0.5)
    RewardConfig(tool_bonus=0)
    assert load_config(RewardConfig, None, ["tool_bonus=0.1"]).tool_bonus == 0.1


def test_tool_calls_are_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"attempt 0 \(task 't'\): tool_calls must be None or an int"):
            rewards([tools("t", "low", True, bad)], CFG)
    np.testing.assert_array_equal(rewards([tools("t", "low", True, np.int64(3))], CFG), [1.0])


def test_level_summary_means_tool_calls_where_counted():
    counted = [
        tools("t", "low", True, 2),
        tools("t", "low", False, 5),
        tools("t", "low", True, 9, admitted=False),
    ]
    s = score_collection(counted, CFG)
    assert s.levels["low"].mean_tool_calls == 3.5  # over admitted attempts, successes and failures
    assert s.metrics()["level/low/mean_tool_calls"] == 3.5
    partly = score_collection([*counted, tools("t", "low", True, None)], CFG)
    assert partly.levels["low"].mean_tool_calls is None  # one admitted attempt without a count
    assert "level/low/mean_tool_calls" not in partly.metrics()


@st.composite
def collections(draw):
    """A collection over 2 tasks × the levels: each attempt admitted (a success or not), malformed,
    or left out for another reason; a tool-call count or none."""
    out = []
    for _ in range(draw(st.integers(1, 24))):
        fate = draw(st.sampled_from(["admitted", "admitted", "admitted", "malformed", "out"]))
        ok = fate == "admitted" and draw(st.booleans())
        out.append(
            Attempt(
                task_id=draw(st.sampled_from(["a", "b"])),
                level=draw(st.sampled_from(LEVELS)),
                success=ok,
                reasoning_tokens=draw(st.integers(0, 600)),
                admitted=fate == "admitted",
                malformed=fate == "malformed",
                tool_calls=draw(st.none() | st.integers(0, 12)),
            )
        )
    return out


CONFIGS = st.builds(
    lambda kind, w, malformed: RewardConfig(
        kind=kind, levels=LEVELS, n_min=2, b_min=10.0, tool_bonus=w, malformed=malformed
    ),
    st.sampled_from(KINDS),
    st.sampled_from([0.1, TOOL_BONUS_MAX]) | st.floats(0.0, TOOL_BONUS_MAX),  # the validated range
    st.sampled_from(MALFORMED),
)


def groups_of(attempts, cfg):
    in_group = scored(attempts, cfg)
    out = {}
    for i, a in enumerate(attempts):
        if in_group[i]:
            out.setdefault((a.task_id, a.level), []).append(i)
    return out.values()


@fixed_seed(6)
@settings(max_examples=300, deadline=None)
@given(attempts=collections(), cfg=CONFIGS)
def test_tool_bonus_never_rewards_a_failure_and_is_bounded(attempts, cfg):
    b = tool_bonuses(attempts, cfg)
    for a, x in zip(attempts, b, strict=True):
        if not (a.admitted and a.success) or a.tool_calls is None:
            assert x == 0.0, a
        assert 0.0 <= x <= cfg.tool_bonus


@fixed_seed(7)
@settings(max_examples=300, deadline=None)
@given(attempts=collections(), cfg=CONFIGS)
def test_a_success_outranks_every_failure_in_its_group(attempts, cfg):
    r = rewards(attempts, cfg)
    for idx in groups_of(attempts, cfg):
        wins = [r[i] for i in idx if attempts[i].success]
        losses = [r[i] for i in idx if not attempts[i].success]
        if wins and losses:
            assert min(wins) > max(losses)


@fixed_seed(8)
@settings(max_examples=300, deadline=None)
@given(attempts=collections(), cfg=CONFIGS)
def test_fewer_tool_calls_never_score_lower_in_a_group(attempts, cfg):
    b, r = tool_bonuses(attempts, cfg), rewards(attempts, cfg)
    base = rewards(attempts, dataclasses.replace(cfg, tool_bonus=0.0))
    for idx in groups_of(attempts, cfg):
        counted = [i for i in idx if attempts[i].success and attempts[i].tool_calls is not None]
        for i, j in itertools.permutations(counted, 2):
            if attempts[i].tool_calls < attempts[j].tool_calls:
                assert b[i] >= b[j]
                # Whatever (4) gives them, the bonus only moves the leaner success up relative to the other.
                assert r[i] - r[j] >= base[i] - base[j] - 1e-12
                if cfg.kind == "binary":
                    assert r[i] >= r[j]


@fixed_seed(9)
@settings(max_examples=200, deadline=None)
@given(attempts=collections(), cfg=CONFIGS)
def test_weight_zero_or_no_counts_leave_every_reward_bit_identical(attempts, cfg):
    uncounted = [dataclasses.replace(a, tool_calls=None) for a in attempts]
    # The default weight (no tool_bonus given), as every existing config has it.
    off = RewardConfig(kind=cfg.kind, levels=LEVELS, n_min=2, b_min=10.0, malformed=cfg.malformed)
    before = score_collection(uncounted, off)  # the rewards as they were before tool counts existed
    for atts, c in ((attempts, off), (uncounted, cfg)):
        now = score_collection(atts, c)
        assert now.rewards.tobytes() == before.rewards.tobytes()
        assert now.advantages.tobytes() == before.advantages.tobytes()


@fixed_seed(10)
@settings(max_examples=200, deadline=None)
@given(attempts=collections(), cfg=CONFIGS)
def test_advantages_stay_mean_centred_per_group_with_the_bonus(attempts, cfg):
    score = score_collection(attempts, cfg)
    for idx in groups_of(attempts, cfg):
        assert abs(score.advantages[idx].sum()) < 1e-9
        spread = score.rewards[idx].max() - score.rewards[idx].min()
        assert np.all(np.abs(score.advantages[idx]) <= spread + 1e-12)

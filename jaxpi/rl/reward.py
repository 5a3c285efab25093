"""Effort-ordered GRPO reward and group-relative advantages, as pure functions over one collection.

A collection runs every task `x` at every effort level `e` (low < medium < xhigh by default), a
group of attempts per level. Only admitted attempts (complete, well-formed, verifier-scored) form
the group `G(x,e)`. For attempt `i`: `v_i ∈ {0,1}` its verifier outcome, `T_i` its reasoning tokens
summed over all turns. Equations as numbered in the seed report ("Reward and advantage"):

    (1) S(x,e) = { T_j : j ∈ G(x,e), v_j = 1 }
    (2) B(x,e) = max(b_min, median S(x,e))            defined only when |S(x,e)| ≥ n_min
    (3) B_i    = min { B(x,e') : e' ∈ U(e_i), B(x,e') defined }
               U(e) = the levels above e (U(low) = {medium, xhigh}, U(medium) = {xhigh}, U(xhigh) = ∅)
    (4) R_i    = 0                                    v_i = 0
               = 1                                    v_i = 1, no B_i (empty set in (3))
               = 1/2 + 1/2 · φ(z_i),  z_i = max(0, T_i / B_i − 1)   otherwise
    (5) A_i    = R_i − mean_{j ∈ G(x,e_i)} R_j        (no std normalisation)

φ is smooth and decreasing with φ(0) = 1 and φ(∞) = 0, so a success always scores in [1/2, 1], a
success at or under its reference scores exactly 1, and a failure scores 0. A group whose rewards
are all equal carries no signal: its advantages are exactly 0.

The `binary` kind is the plain GRPO baseline: R_i = v_i, the same (task, level) groups, and
optionally A_i = (R_i − mean) / (std + eps).

The tool-efficiency bonus (`RewardConfig.tool_bonus` = w, default 0: off), after the TwIL-8B-pi
card (seed 003: weight 0.1) and TRL's async GRPO Harbor example, which adds w·clip(1 − n/15, 0, 1)
to a correct rollout's reward (n its tool calls, 15 a fixed budget). Here the budget is the group's
own: the most tool calls any success of the same (task, level) made. With `c_i` the tool calls
attempt i ran (None: not counted),

    (6) C(x,e) = { c_j : j ∈ G(x,e), v_j = 1, c_j known },   M(x,e) = max C(x,e)
        b_i    = w · (1 − c_i / M(x,e))      v_i = 1, c_i known, M(x,e) > 0
               = 0                           otherwise (a failure, a non-admitted attempt, no count,
                                             or no success of the group made any call)
        R_i   ← R_i + b_i                    R_i from (4) or the binary R_i = v_i; then (5)

so b_i is w times the share of the heaviest success's calls that attempt i saved: 0 for the
heaviest (and for a group's only success, or successes that all made as many calls), up to w for a
success that made none while another made some. 0 ≤ b_i ≤ w, and w is validated to [0, 1/2]:
every success scores at least 1/2 > 0 = any failure, and the bonus never spreads successes apart
by more than correctness separates the worst success from a failure (1/2). A failure's bonus is
exactly 0, so the bonus never rewards failing with fewer calls. At w = 0 nothing is added: every
reward is bit for bit what (4) or the binary rule gives.

Choices where the report is silent (each is a config field or documented where it acts):
- φ forms (`RewardConfig.phi`, scale `s = phi_scale`): "exp" φ(z) = exp(−z/s), "rational"
  φ(z) = 1 / (1 + z/s). Defaults: exp with s = 1 (twice the reference scores 1/2 + 1/(2e) ≈ 0.68).
- n_min = 2 and b_min = 256 tokens by default; b_min must be > 0 so that (4) never divides by 0.
- The median of an even number of lengths is the mean of the middle two (`numpy.median`).
- Attempts with `admitted=False` are outside every group: they define no reference, enter no
  mean, and get R = 0 and A = 0 (they are not trained on). Their level is still checked.
- Except, with `RewardConfig.malformed = "fail"`, the non-admitted attempts marked `malformed`
  (the model broke the format: a tool call or answer that does not parse, a thinking block that
  never closes). Left out, format breakage costs nothing: a group's mean is taken over the
  attempts that kept the format, so the objective never pushes back on breaking it. Under "fail"
  such an attempt joins its group as a failure (v = 0, R = 0): it enters the group's mean, takes
  A = −mean (negative whenever the group has a success) and is trained on like any attempt. It
  never defines a reference, since references use successes only. Attempts left out for other
  reasons (a stale sampler, an engine or sandbox failure) carry `malformed=False` and stay
  outside under both settings: nothing the model did decided their fate. "exclude" (the default)
  is the rule above, bit for bit.
- `pass_rate_scheduled` = admitted successes / scheduled attempts at a level: every attempt that
  did not end as an admitted, verified success counts as a failure there. Beside the admitted
  pass rate it shows how much of the schedule format breakage (or anything else) cost.
- The binary baseline's std is the population std (ddof = 0) of the group's rewards.
- Ordering ratios T_lower / T_upper use the mean reasoning tokens per admitted attempt at each
  level, successes and failures alike (the report's "reasoning tokens per attempt by effort
  level"); with the default levels these are T_L/T_M and T_M/T_H. Above 1.0 is a violation.
  The per-level summary also carries the mean over successes alone, what the references see.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from jaxpi.envs.base import Attempt

KINDS: tuple[str, ...] = ("effort_ordered", "binary")
MALFORMED: tuple[str, ...] = ("exclude", "fail")  # what a group does with malformed attempts
TOOL_BONUS_MAX = 0.5  # the largest tool_bonus weight: the least a success scores in (4)


def _phi_exp(z: np.ndarray, s: float) -> np.ndarray:
    return np.exp(-z / s)


def _phi_rational(z: np.ndarray, s: float) -> np.ndarray:
    return 1.0 / (1.0 + z / s)


# name → φ(z, scale); every entry must satisfy φ(0) = 1, decreasing, φ(∞) = 0 (tests check each).
PHI: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "exp": _phi_exp,
    "rational": _phi_rational,
}


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    kind: str = "effort_ordered"  # "effort_ordered" | "binary" (plain GRPO baseline)
    levels: tuple[str, ...] = ("low", "medium", "xhigh")  # lowest effort first
    n_min: int = 2  # successes a (task, level) needs to define a reference
    b_min: float = 256.0  # floor on a reference, in reasoning tokens
    phi: str = "exp"  # shaping function, a key of PHI
    phi_scale: float = 1.0  # s in φ(z / s)
    std_scale: bool = False  # binary only: divide advantages by the group's std + std_eps
    std_eps: float = 1e-6
    # Non-admitted attempts marked malformed (the model broke the format): "exclude" leaves them
    # out of their group (no reward, no gradient); "fail" scores them there as failures (R = 0),
    # so breaking the format costs what failing does. Stale or infrastructure-cut attempts are
    # never marked, and stay out under both (module docstring).
    malformed: str = "exclude"
    # Weight w of the tool-efficiency bonus (equation (6) of jaxpi.rl.reward): a success's bonus for
    # fewer tool calls than its group's heaviest success, in [0, 0.5]; 0 = off (the TwIL-8B-pi card
    # used 0.1). Attempts without a tool-call count get none.
    tool_bonus: float = 0.0

    def __post_init__(self) -> None:
        # YAML and the command line hand over lists; the frozen config keeps a hashable tuple.
        object.__setattr__(self, "levels", tuple(self.levels))
        errors = []
        if self.kind not in KINDS:
            errors.append(f"reward.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if not self.levels:
            errors.append("reward.levels must name at least one effort level")
        elif not all(isinstance(e, str) and e for e in self.levels):
            errors.append(f"reward.levels must be non-empty strings, got {list(self.levels)}")
        elif len(set(self.levels)) != len(self.levels):
            errors.append(f"reward.levels must not repeat a level, got {list(self.levels)}")
        if isinstance(self.n_min, bool) or not isinstance(self.n_min, int) or self.n_min < 1:
            errors.append(f"reward.n_min must be an integer >= 1, got {self.n_min!r}")
        if not (isinstance(self.b_min, int | float) and math.isfinite(self.b_min) and self.b_min > 0):
            errors.append(f"reward.b_min must be a finite number > 0, got {self.b_min!r}")
        if self.phi not in PHI:
            errors.append(f"reward.phi must be one of {list(PHI)}, got {self.phi!r}")
        if not (
            isinstance(self.phi_scale, int | float) and math.isfinite(self.phi_scale) and self.phi_scale > 0
        ):
            errors.append(f"reward.phi_scale must be a finite number > 0, got {self.phi_scale!r}")
        if self.std_scale and self.kind != "binary":
            # The report's reason: std scaling would blow small efficiency penalties up to full size.
            errors.append(
                "reward.std_scale is only for kind='binary'; effort_ordered advantages are mean-centred only"
            )
        if not self.std_eps > 0:
            errors.append(f"reward.std_eps must be > 0, got {self.std_eps!r}")
        if self.malformed not in MALFORMED:
            errors.append(f"reward.malformed must be one of {list(MALFORMED)}, got {self.malformed!r}")
        w = self.tool_bonus
        if isinstance(w, bool) or not (
            isinstance(w, int | float) and math.isfinite(w) and 0 <= w <= TOOL_BONUS_MAX
        ):
            # Above 1/2 the bonus could separate two successes by more than the worst success (1/2)
            # stands above a failure: efficiency would outweigh correctness.
            errors.append(f"reward.tool_bonus must be a number in [0, {TOOL_BONUS_MAX}], got {w!r}")
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class LevelSummary:
    """Per-level numbers of one collection. Means are over admitted attempts (None when there are
    none, or when some admitted attempt does not carry the optional count), except `mean_reward`:
    over the attempts in the level's groups (with malformed="fail", the malformed ones too)."""

    scheduled: int  # attempts at this level, admitted or not
    count: int  # admitted attempts
    pass_rate: float | None
    pass_rate_scheduled: float | None  # admitted successes / scheduled attempts
    mean_reasoning_tokens: float | None  # per admitted attempt: what the ordering ratios use
    mean_success_reasoning_tokens: float | None  # over admitted successes only
    mean_output_tokens: float | None
    mean_turns: float | None
    mean_reward: float | None
    mean_tool_calls: float | None = None  # per admitted attempt, when every one carries a count


@dataclasses.dataclass(frozen=True)
class CollectionScore:
    rewards: np.ndarray  # [n] float64, aligned with the attempts
    advantages: np.ndarray  # [n] float64
    scored: np.ndarray  # [n] bool: in its (task, level) group, so trained on (`scored()`)
    references: dict[tuple[str, str], float]  # (task, level) → B(x,e), defined ones only
    levels: dict[str, LevelSummary]  # in cfg.levels order
    ordering: dict[str, float | None]  # "low/medium" → T_low / T_medium, adjacent levels
    groups: int  # (task, level) groups with at least one scored attempt
    groups_with_signal: int  # of those, groups whose rewards are not all equal

    def metrics(self) -> dict[str, float]:
        """Flat scalar metrics for a metrics log (undefined numbers are left out)."""
        out: dict[str, float] = {
            "reward/groups": float(self.groups),
            "reward/groups_with_signal": float(self.groups_with_signal),
            "reward/references": float(len(self.references)),
        }
        for name, s in self.levels.items():
            for field in dataclasses.fields(s):
                value = getattr(s, field.name)
                if value is not None:
                    out[f"level/{name}/{field.name}"] = float(value)
        for pair, ratio in self.ordering.items():
            if ratio is not None:
                out[f"ordering/{pair}"] = ratio
        return out


def phi(z: ArrayLike, kind: str = "exp", scale: float = 1.0) -> np.ndarray:
    """The shaping function φ of (4) at relative excesses `z ≥ 0`."""
    if kind not in PHI:
        raise ValueError(f"unknown phi {kind!r}; known: {list(PHI)}")
    z = np.asarray(z, dtype=np.float64)
    if np.any(~(z >= 0)):  # also catches NaN
        raise ValueError(f"phi is defined for z >= 0, got {z[~(z >= 0)].tolist()}")
    return PHI[kind](z, float(scale))


def _where(i: int, a: Attempt) -> str:
    who = f"attempt {i} (task {a.task_id!r}"
    return who + (f", id {a.attempt_id!r})" if a.attempt_id is not None else ")")


def _check(attempts: Sequence[Attempt], cfg: RewardConfig) -> None:
    """Every attempt names a configured level, a boolean outcome and a count ≥ 0."""
    for i, a in enumerate(attempts):
        if a.level not in cfg.levels:
            raise ValueError(
                f"{_where(i, a)}: level {a.level!r} is not one of reward.levels {list(cfg.levels)}"
            )
        if a.success not in (True, False):
            raise ValueError(f"{_where(i, a)}: success must be a bool, got {a.success!r}")
        if isinstance(a.reasoning_tokens, bool) or not isinstance(a.reasoning_tokens, int | np.integer):
            raise ValueError(f"{_where(i, a)}: reasoning_tokens must be an int, got {a.reasoning_tokens!r}")
        if a.reasoning_tokens < 0:
            raise ValueError(f"{_where(i, a)}: reasoning_tokens must be >= 0, got {a.reasoning_tokens}")
        if a.tool_calls is not None and (
            isinstance(a.tool_calls, bool)
            or not isinstance(a.tool_calls, int | np.integer)
            or a.tool_calls < 0
        ):
            raise ValueError(f"{_where(i, a)}: tool_calls must be None or an int >= 0, got {a.tool_calls!r}")
        if a.malformed and (a.admitted or a.success):
            # The verifier never ran on a broken session: a malformed success or admission is a writer bug.
            raise ValueError(f"{_where(i, a)}: a malformed attempt must be neither admitted nor a success")


def scored(attempts: Sequence[Attempt], cfg: RewardConfig) -> np.ndarray:
    """[n] bool: the attempts that are in their (task, level) group `G(x,e)`, and so are trained on:
    the admitted ones, and with `cfg.malformed == "fail"` the malformed ones as failures."""
    _check(attempts, cfg)
    fail = cfg.malformed == "fail"
    return np.array([a.admitted or (fail and a.malformed) for a in attempts], dtype=bool)


def _groups(attempts: Sequence[Attempt], cfg: RewardConfig) -> dict[tuple[str, str], list[int]]:
    """(task, level) → indices of its scored attempts, in first-seen order."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, keep in enumerate(scored(attempts, cfg)):
        if keep:
            groups[(attempts[i].task_id, attempts[i].level)].append(i)
    return dict(groups)


def references(attempts: Sequence[Attempt], cfg: RewardConfig) -> dict[tuple[str, str], float]:
    """Equations (1)–(2): B(x,e) for every (task, level) with at least n_min admitted successes
    (a malformed attempt is never a success, so `cfg.malformed` does not move a reference)."""
    _check(attempts, cfg)
    successes: dict[tuple[str, str], list[int]] = defaultdict(list)  # S(x,e)
    for a in attempts:
        if a.admitted and a.success:
            successes[(a.task_id, a.level)].append(int(a.reasoning_tokens))
    return {
        key: max(float(cfg.b_min), float(np.median(lengths)))
        for key, lengths in successes.items()
        if len(lengths) >= cfg.n_min
    }


def applicable_reference(
    task_id: str, level: str, refs: dict[tuple[str, str], float], cfg: RewardConfig
) -> float | None:
    """Equation (3): the leanest defined reference among the levels above `level`, or None."""
    if level not in cfg.levels:
        raise ValueError(f"task {task_id!r}: level {level!r} is not one of reward.levels {list(cfg.levels)}")
    above = cfg.levels[cfg.levels.index(level) + 1 :]  # U(e)
    defined = [refs[(task_id, e)] for e in above if (task_id, e) in refs]
    return min(defined) if defined else None


def tool_bonuses(attempts: Sequence[Attempt], cfg: RewardConfig) -> np.ndarray:
    """Equation (6): each attempt's tool-efficiency bonus b_i, [n] float64 in [0, cfg.tool_bonus];
    0 for failures, non-admitted attempts, attempts without a count, and everything when the
    weight is 0."""
    _check(attempts, cfg)
    out = np.zeros(len(attempts), dtype=np.float64)
    if not cfg.tool_bonus:
        return out
    counted: dict[tuple[str, str], list[int]] = defaultdict(list)  # C(x,e), as attempt indices
    for i, a in enumerate(attempts):
        if a.admitted and a.success and a.tool_calls is not None:
            counted[(a.task_id, a.level)].append(i)
    for idx in counted.values():
        c = np.array([attempts[i].tool_calls for i in idx], dtype=np.float64)
        heaviest = c.max()  # M(x,e)
        if heaviest > 0:
            out[idx] = cfg.tool_bonus * (1.0 - c / heaviest)
    return out


def rewards(attempts: Sequence[Attempt], cfg: RewardConfig) -> np.ndarray:
    """Equation (4) (or R = v for the binary baseline) plus the tool bonus (6): [n] float64, 0 for
    non-admitted attempts (the malformed ones scored as failures included)."""
    _check(attempts, cfg)
    out = np.zeros(len(attempts), dtype=np.float64)
    refs = references(attempts, cfg) if cfg.kind == "effort_ordered" else {}
    for i, a in enumerate(attempts):
        if not a.admitted or not a.success:
            continue  # correctness first: a failure earns nothing however short
        if cfg.kind == "binary":
            out[i] = 1.0
            continue
        ref = applicable_reference(a.task_id, a.level, refs, cfg)
        if ref is None:
            out[i] = 1.0  # xhigh, or no level above has enough successes
            continue
        z = max(0.0, a.reasoning_tokens / ref - 1.0)
        out[i] = 0.5 + 0.5 * float(phi(z, cfg.phi, cfg.phi_scale))
    if cfg.tool_bonus:  # skipped at 0, so the default rewards stay bit for bit those of (4)
        out += tool_bonuses(attempts, cfg)
    return out


def advantages(attempts: Sequence[Attempt], rewards: ArrayLike, cfg: RewardConfig) -> np.ndarray:
    """Equation (5): rewards centred on their (task, level) group's mean; [n] float64.

    Groups whose rewards are all equal get exactly 0 (not a rounding residue). The binary baseline
    with `std_scale` divides by the group's population std + std_eps. Attempts outside every
    group (`scored` false) get 0.
    """
    _check(attempts, cfg)
    r = np.asarray(rewards, dtype=np.float64)
    if r.shape != (len(attempts),):
        raise ValueError(f"rewards has shape {r.shape}, expected ({len(attempts)},), one per attempt")
    if not np.all(np.isfinite(r)):
        raise ValueError(
            f"rewards must be finite, got non-finite values at {np.flatnonzero(~np.isfinite(r)).tolist()}"
        )
    out = np.zeros_like(r)
    for idx in _groups(attempts, cfg).values():
        g = r[idx]
        if np.all(g == g[0]):
            continue  # a uniform group carries no signal
        a = g - g.mean()
        if cfg.std_scale:
            a = a / (g.std() + cfg.std_eps)
        out[idx] = a
    return out


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _level_summary(
    attempts: Sequence[Attempt], r: np.ndarray, in_group: np.ndarray, level: str
) -> LevelSummary:
    at_level = [i for i, a in enumerate(attempts) if a.level == level]
    admitted = [i for i in at_level if attempts[i].admitted]
    wins = sum(bool(attempts[i].success) for i in admitted)
    outputs = [attempts[i].output_tokens for i in admitted]
    turns = [attempts[i].turns for i in admitted]
    tools = [attempts[i].tool_calls for i in admitted]
    return LevelSummary(
        scheduled=len(at_level),
        count=len(admitted),
        pass_rate=_mean([float(attempts[i].success) for i in admitted]),
        pass_rate_scheduled=wins / len(at_level) if at_level else None,
        mean_reasoning_tokens=_mean([float(attempts[i].reasoning_tokens) for i in admitted]),
        mean_success_reasoning_tokens=_mean(
            [float(attempts[i].reasoning_tokens) for i in admitted if attempts[i].success]
        ),
        mean_output_tokens=None if None in outputs else _mean(outputs),
        mean_turns=None if None in turns else _mean(turns),
        mean_reward=_mean([float(r[i]) for i in at_level if in_group[i]]),
        mean_tool_calls=None if None in tools else _mean(tools),
    )


def score_collection(attempts: Sequence[Attempt], cfg: RewardConfig) -> CollectionScore:
    """References, rewards, advantages and the per-level report of one collection."""
    r = rewards(attempts, cfg)
    adv = advantages(attempts, r, cfg)
    in_group = scored(attempts, cfg)
    groups = _groups(attempts, cfg)
    levels = {e: _level_summary(attempts, r, in_group, e) for e in cfg.levels}
    ordering: dict[str, float | None] = {}
    for lower, upper in zip(cfg.levels, cfg.levels[1:], strict=False):
        t_lo, t_up = levels[lower].mean_reasoning_tokens, levels[upper].mean_reasoning_tokens
        ordering[f"{lower}/{upper}"] = None if t_lo is None or not t_up else t_lo / t_up
    return CollectionScore(
        rewards=r,
        advantages=adv,
        scored=in_group,
        references=references(attempts, cfg),
        levels=levels,
        ordering=ordering,
        groups=len(groups),
        groups_with_signal=sum(bool(np.any(r[idx] != r[idx[0]])) for idx in groups.values()),
    )

"""Per effort level: pass rates, mean reasoning tokens and the ordering ratios of a set of
attempts, with 95% intervals.

An attempt is one attempts.jsonl record (`RunAttempt`: `split`, `step`, `task_id`, `level`,
`admitted`, `success`, `reasoning_tokens`, ...), as the GRPO loop writes them and the agent
evaluation converts its records to. Per level:
- admitted share = admitted / scheduled attempts. Everything else is over admitted attempts only,
  except the scheduled pass rate.
- pass rate with its 95% Wilson score interval (exact at 0/n and n/n, unlike the normal one).
- scheduled pass rate = admitted successes / scheduled attempts, Wilson interval as well: a
  malformed or otherwise non-admitted attempt counts as a failure.
- T = mean reasoning tokens per admitted attempt, successes and failures alike (what
  `jaxpi.rl.reward` uses for the ordering ratios), with a 95% cluster-bootstrap interval: task ids
  are resampled with all their attempts, because attempts of one task share its difficulty and are
  not independent draws. One resample serves every level, so a ratio T_lower / T_upper is
  bootstrapped on paired tasks. Percentile intervals, fixed seed: reruns print the same numbers.
- reasoning tokens per turn = Σ reasoning / Σ turns, so that T ≈ (per turn) × (mean turns).
- mean output tokens, turns and tool calls per admitted attempt, each only where every admitted
  attempt of the level carries the count (records written before a count existed give None).
- ordering ratios T_lower / T_upper for adjacent levels (T_L/T_M, T_M/T_X); above 1.0 a lower
  level reasons longer than the one above it, an ordering violation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpi.stats.intervals import Estimate, estimate_json, percentile_interval, wilson_interval

SPLITS: tuple[str, ...] = ("eval", "train")
N_BOOT = 2000
SEED = 0


@dataclasses.dataclass(frozen=True)
class RunAttempt:
    """One line of attempts.jsonl: the fields the statistics read (others are kept out)."""

    split: str
    step: int
    task_id: str
    level: str
    admitted: bool
    success: bool
    reasoning_tokens: int
    output_tokens: int | None = None
    turns: int | None = None
    collection: int | None = None
    attempt_id: str | None = None
    tool_calls: int | None = None  # tool calls the attempt ran (None: not counted)


@dataclasses.dataclass(frozen=True)
class LevelStats:
    """One effort level's numbers; None where there is nothing to average."""

    level: str
    scheduled: int  # attempts at this level, admitted or not
    admitted: int
    admitted_share: float | None
    tasks: int  # distinct tasks with an admitted attempt
    successes: int
    pass_rate: Estimate | None  # Wilson, over admitted attempts
    pass_rate_scheduled: Estimate | None  # Wilson, admitted successes over scheduled attempts
    reasoning_tokens: Estimate | None  # mean per admitted attempt, cluster bootstrap
    reasoning_tokens_per_turn: float | None
    output_tokens: float | None
    turns: float | None
    tool_calls: float | None = None  # mean per admitted attempt


@dataclasses.dataclass(frozen=True)
class Summary:
    run: str
    split: str  # the split the numbers come from
    step: int  # the (last) step summarised
    first_step: int  # == step unless several steps were pooled
    levels: tuple[str, ...]
    stats: dict[str, LevelStats]
    ordering: dict[str, Estimate | None]  # "low/medium" → T_low / T_medium
    tasks: int
    note: str | None = None  # e.g. the eval → train fallback

    def to_json(self) -> dict[str, Any]:
        stats = {}
        for name, s in self.stats.items():
            d = dataclasses.asdict(s)
            d["pass_rate"], d["reasoning_tokens"] = (
                estimate_json(s.pass_rate),
                estimate_json(s.reasoning_tokens),
            )
            d["pass_rate_scheduled"] = estimate_json(s.pass_rate_scheduled)
            stats[name] = d
        return {
            "run": self.run,
            "split": self.split,
            "step": self.step,
            "first_step": self.first_step,
            "levels": list(self.levels),
            "tasks": self.tasks,
            "note": self.note,
            "stats": stats,
            "ordering": {k: estimate_json(v) for k, v in self.ordering.items()},
        }


# ------------------------------------------------------------------------------------ the records

_REQUIRED: dict[str, tuple[type, ...]] = {
    "split": (str,),
    "step": (int,),
    "task_id": (str,),
    "level": (str,),
    "admitted": (bool,),
    "success": (bool,),
    "reasoning_tokens": (int,),
}
_OPTIONAL: dict[str, tuple[type, ...]] = {
    "output_tokens": (int,),
    "turns": (int,),
    "collection": (int,),
    "attempt_id": (str,),
    "tool_calls": (int,),
}


def _field(obj: dict, key: str, types: tuple[type, ...], where: str, required: bool) -> Any:
    if key not in obj or (not required and obj[key] is None):
        if required:
            raise ValueError(f"{where}: missing field {key!r}")
        return None
    value = obj[key]
    # bool is an int in Python; a count of True tokens is a writer bug worth naming.
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        names = "/".join(t.__name__ for t in types)
        raise ValueError(f"{where}: field {key!r} must be {names}, got {value!r}")
    if types == (int,) and value < 0 and key != "collection":
        raise ValueError(f"{where}: field {key!r} must be >= 0, got {value}")
    return value


def parse_attempt(obj: Any, levels: Sequence[str], where: str) -> RunAttempt:
    """One attempts.jsonl object, checked; errors start with `where` (e.g. `file:line`)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kw = {k: _field(obj, k, t, where, True) for k, t in _REQUIRED.items()}
    kw.update({k: _field(obj, k, t, where, False) for k, t in _OPTIONAL.items()})
    if kw["split"] not in SPLITS:
        raise ValueError(f"{where}: split must be one of {list(SPLITS)}, got {kw['split']!r}")
    if kw["level"] not in levels:
        raise ValueError(f"{where}: level {kw['level']!r} is not one of run.json levels {list(levels)}")
    return RunAttempt(**kw)


AttemptLike = RunAttempt | dict[str, Any]


def _as_attempts(attempts: Sequence[AttemptLike], levels: Sequence[str]) -> list[RunAttempt]:
    """Records as read by `jaxpi.rl.runs.load_run`, or attempts.jsonl-shaped dicts (checked the
    same way)."""
    if not levels:
        raise ValueError("levels must name at least one effort level")
    out = [
        a if isinstance(a, RunAttempt) else parse_attempt(a, levels, f"attempt {i}")
        for i, a in enumerate(attempts)
    ]
    unknown = sorted({a.level for a in out} - set(levels))
    if unknown:
        raise ValueError(f"attempts name levels {unknown} that are not in {list(levels)}")
    return out


# ----------------------------------------------------------------------------- the task bootstrap


def _task_table(attempts: Sequence[RunAttempt], levels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per task × level: Σ reasoning tokens and the count of admitted attempts; [tasks, levels] each."""
    tasks = sorted({a.task_id for a in attempts})
    row = {t: i for i, t in enumerate(tasks)}
    col = {e: j for j, e in enumerate(levels)}
    # Per-task totals, not per-attempt rows: a resample is then one weight per task, and the mean of
    # every level in every resample is one einsum (Σ_t w_t·sum_t / Σ_t w_t·count_t).
    sums = np.zeros((len(tasks), len(levels)))
    counts = np.zeros((len(tasks), len(levels)))
    for a in attempts:
        if a.admitted:
            sums[row[a.task_id], col[a.level]] += a.reasoning_tokens
            counts[row[a.task_id], col[a.level]] += 1
    return sums, counts


def _bootstrap_means(sums: np.ndarray, counts: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Cluster bootstrap over tasks: [n_boot, levels] means (NaN where a resample has no attempt)."""
    n_tasks = sums.shape[0]
    rng = np.random.default_rng(seed)
    # w[b, t] = how often task t is drawn in resample b (n_tasks draws with replacement).
    w = rng.multinomial(n_tasks, np.full(n_tasks, 1.0 / n_tasks), size=n_boot).astype(np.float64)
    s = np.einsum("bt,tl->bl", w, sums)
    c = np.einsum("bt,tl->bl", w, counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(c > 0, s / np.where(c > 0, c, 1.0), np.nan)


# ------------------------------------------------------------------------------------ the numbers


def level_stats(
    attempts: Sequence[AttemptLike], levels: Sequence[str], *, n_boot: int = N_BOOT, seed: int = SEED
) -> dict[str, LevelStats]:
    """Per-level numbers of a set of attempts (normally one step of one split), in `levels` order."""
    attempts = _as_attempts(attempts, levels)
    sums, counts = _task_table(attempts, levels)
    boot = _bootstrap_means(sums, counts, n_boot, seed) if sums.shape[0] else None
    out = {}
    for j, level in enumerate(levels):
        at_level = [a for a in attempts if a.level == level]
        adm = [a for a in at_level if a.admitted]
        k = sum(a.success for a in adm)
        pass_rate = reasoning = per_turn = output = turns = tools = None
        # A non-admitted success (a stale sampler, a split Pi sample) is not a verified one here either.
        scheduled = Estimate(k / len(at_level), *wilson_interval(k, len(at_level))) if at_level else None
        if adm:
            pass_rate = Estimate(k / len(adm), *wilson_interval(k, len(adm)))
            mean_t = float(sums[:, j].sum() / counts[:, j].sum())
            reasoning = percentile_interval(boot[:, j], mean_t)
            if all(a.turns is not None for a in adm):
                turns = float(np.mean([a.turns for a in adm]))
                total_turns = sum(a.turns for a in adm)
                per_turn = float(sum(a.reasoning_tokens for a in adm) / total_turns) if total_turns else None
            if all(a.output_tokens is not None for a in adm):
                output = float(np.mean([a.output_tokens for a in adm]))
            if all(a.tool_calls is not None for a in adm):
                tools = float(np.mean([a.tool_calls for a in adm]))
        out[level] = LevelStats(
            level=level,
            scheduled=len(at_level),
            admitted=len(adm),
            admitted_share=len(adm) / len(at_level) if at_level else None,
            tasks=len({a.task_id for a in adm}),
            successes=k,
            pass_rate=pass_rate,
            pass_rate_scheduled=scheduled,
            reasoning_tokens=reasoning,
            reasoning_tokens_per_turn=per_turn,
            output_tokens=output,
            turns=turns,
            tool_calls=tools,
        )
    return out


def ordering_ratios(
    attempts: Sequence[AttemptLike], levels: Sequence[str], *, n_boot: int = N_BOOT, seed: int = SEED
) -> dict[str, Estimate | None]:
    """T_lower / T_upper for each adjacent pair ("low/medium", ...) with a 95% interval from the
    same paired task bootstrap; None when either level has no admitted attempt or T_upper is 0.
    Resamples whose upper level has no attempt or T = 0 are left out of the interval."""
    attempts = _as_attempts(attempts, levels)
    sums, counts = _task_table(attempts, levels)
    boot = _bootstrap_means(sums, counts, n_boot, seed) if sums.shape[0] else None
    out: dict[str, Estimate | None] = {}
    for j in range(len(levels) - 1):
        key = f"{levels[j]}/{levels[j + 1]}"
        c_lo, c_up = counts[:, j].sum(), counts[:, j + 1].sum()
        if not c_lo or not c_up or not sums[:, j + 1].sum():
            out[key] = None
            continue
        ratio = float((sums[:, j].sum() / c_lo) / (sums[:, j + 1].sum() / c_up))
        with np.errstate(invalid="ignore", divide="ignore"):
            r = boot[:, j] / np.where(boot[:, j + 1] > 0, boot[:, j + 1], np.nan)
        out[key] = percentile_interval(r, ratio)
    return out


def initials(levels: Sequence[str]) -> list[str]:
    """L, M, X for low, medium, xhigh; full names if the initials would collide."""
    short = [e[0].upper() for e in levels]
    return short if len(set(short)) == len(short) else list(levels)

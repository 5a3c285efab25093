"""Reading a GRPO run: per-level statistics with intervals, ordering ratios, a comparison table and
three pictures (`jaxpi report RUN_DIR...`).

The GRPO loop writes a run directory; this module only reads it:
- `run.json`: `{"levels": [...lowest effort first], "reward": {"kind": ...}, "name": ...}`.
- `attempts.jsonl`: one object per attempt (`split`, `step`, `task_id`, `level`, `admitted`,
  `success`, `reasoning_tokens`, `output_tokens`, `turns`, ...). `step` counts the policy updates
  applied before the attempt was collected, so eval at step 0 is the starting policy.

Numbers, per effort level at one step (or a window of steps):
- admitted share = admitted / scheduled attempts. Everything else is over admitted attempts only,
  except the scheduled pass rate.
- pass rate with its 95% Wilson score interval (exact at 0/n and n/n, unlike the normal one).
- scheduled pass rate = admitted successes / scheduled attempts, Wilson interval as well: a
  malformed or otherwise non-admitted attempt counts as a failure. The admitted pass rate alone
  hides format breakage (a level that breaks the format more often keeps its admitted pass rate);
  the gap between the two is what non-admission cost.
- T = mean reasoning tokens per admitted attempt, successes and failures alike (what
  `jaxpi.rl.reward` uses for the ordering ratios), with a 95% cluster-bootstrap interval: task ids
  are resampled with all their attempts, because attempts of one task share its difficulty and are
  not independent draws. One resample serves every level, so a ratio T_lower / T_upper is
  bootstrapped on paired tasks. Percentile intervals, fixed seed: reruns print the same numbers.
- reasoning tokens per turn = Σ reasoning / Σ turns, so that T ≈ (per turn) × (mean turns).
- ordering ratios T_lower / T_upper for adjacent levels (T_L/T_M, T_M/T_X); above 1.0 a lower
  level reasons longer than the one above it, an ordering violation.

The pictures, written into `RUN_DIR/report/` (or `--out`), one colour per run:
- `frontier.png`: pass rate against T, one point per level with both 95% intervals as error bars
  and arrows L→M→X in effort order, at the first step (faded) and the last (solid). A run whose
  arrows point up and to the right is ordered; an arrow pointing left is a violation. With several
  runs, the first run's start is drawn once as the common start.
- `ordering.png`: each adjacent ratio across training steps with its band and a dashed line at
  1.0; a band wholly above the line is a violation beyond noise.
- `pass_rate.png`: per run, pass rate per level (Wilson bands) and T per level (bootstrap bands)
  across steps.
- `report.json`: the first and last summaries of every run and the table text.

Eval attempts (held-out tasks) are the default; a run without any falls back to its train
attempts, and the summary says so. Train steps are one fresh collection each, so their points
are noisy; `window` pools consecutive steps as the seed report pools collections into ranges.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

SPLITS: tuple[str, ...] = ("eval", "train")
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
N_BOOT = 2000
SEED = 0


class Estimate(NamedTuple):
    """A point estimate with its 95% interval. Wilson intervals always contain the value; a
    percentile bootstrap interval does except for pathologically skewed resamples."""

    value: float
    lo: float
    hi: float


@dataclasses.dataclass(frozen=True)
class RunAttempt:
    """One line of attempts.jsonl: the fields this report reads (others are kept out)."""

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


@dataclasses.dataclass(frozen=True)
class Run:
    path: Path
    name: str
    levels: tuple[str, ...]  # lowest effort first
    reward_kind: str | None
    attempts: tuple[RunAttempt, ...]
    skipped_last_line: bool = False  # the writer was killed mid-line


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
        def est(e: Estimate | None) -> dict[str, float] | None:
            return None if e is None else {"value": e.value, "lo": e.lo, "hi": e.hi}

        stats = {}
        for name, s in self.stats.items():
            d = dataclasses.asdict(s)
            d["pass_rate"], d["reasoning_tokens"] = est(s.pass_rate), est(s.reasoning_tokens)
            d["pass_rate_scheduled"] = est(s.pass_rate_scheduled)
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
            "ordering": {k: est(v) for k, v in self.ordering.items()},
        }


# ----------------------------------------------------------------------------------------- loading

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


def _parse_attempt(obj: Any, levels: Sequence[str], where: str) -> RunAttempt:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kw = {k: _field(obj, k, t, where, True) for k, t in _REQUIRED.items()}
    kw.update({k: _field(obj, k, t, where, False) for k, t in _OPTIONAL.items()})
    if kw["split"] not in SPLITS:
        raise ValueError(f"{where}: split must be one of {list(SPLITS)}, got {kw['split']!r}")
    if kw["level"] not in levels:
        raise ValueError(f"{where}: level {kw['level']!r} is not one of run.json levels {list(levels)}")
    return RunAttempt(**kw)


def read_attempts(path: str | os.PathLike, levels: Sequence[str]) -> tuple[list[RunAttempt], bool]:
    """Parse attempts.jsonl; returns (attempts, whether a truncated last line was skipped).

    Only the last non-blank line may be unreadable (a writer killed mid-line): it is skipped with a
    warning. Any other bad line raises a ValueError naming `file:line`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no attempts file (the GRPO loop writes attempts.jsonl)")
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out, skipped = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                warnings.warn(f"{where}: skipped a truncated last line ({e.msg})", stacklevel=2)
                skipped = True
                continue
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        out.append(_parse_attempt(obj, levels, where))
    return out, skipped


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read a GRPO run directory (run.json + attempts.jsonl); errors name the file (and line)."""
    root = Path(run_dir)
    meta_path = root / "run.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path}: no run.json; is {root} a GRPO run directory?")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}:{e.lineno}: not valid JSON ({e.msg})") from None
    levels = meta.get("levels") if isinstance(meta, dict) else None
    if (
        not isinstance(levels, list)
        or not levels
        or not all(isinstance(e, str) and e for e in levels)
        or len(set(levels)) != len(levels)
    ):
        raise ValueError(f"{meta_path}: 'levels' must be a non-empty list of distinct names, got {levels!r}")
    reward = meta.get("reward")
    kind = reward.get("kind") if isinstance(reward, dict) else None
    name = meta.get("name") or root.resolve().name
    attempts, skipped = read_attempts(root / "attempts.jsonl", levels)
    return Run(root, str(name), tuple(levels), kind, tuple(attempts), skipped)


# ------------------------------------------------------------------------------------- statistics


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion:
    (p + z²/2n ± z·sqrt(p(1−p)/n + z²/4n²)) / (1 + z²/n), p = successes / n."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes}/{n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At 0/n (n/n) the lower (upper) bound is exactly 0 (1); set it so rounding cannot leave p̂ outside.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


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


def _percentile_interval(samples: np.ndarray, value: float) -> Estimate:
    ok = samples[np.isfinite(samples)]
    if ok.size == 0:
        return Estimate(value, value, value)
    lo, hi = np.percentile(ok, [2.5, 97.5])
    return Estimate(float(value), float(lo), float(hi))


AttemptLike = RunAttempt | dict[str, Any]


def _as_attempts(attempts: Sequence[AttemptLike], levels: Sequence[str]) -> list[RunAttempt]:
    """Records as read by `load_run`, or attempts.jsonl-shaped dicts (checked the same way)."""
    if not levels:
        raise ValueError("levels must name at least one effort level")
    out = [
        a if isinstance(a, RunAttempt) else _parse_attempt(a, levels, f"attempt {i}")
        for i, a in enumerate(attempts)
    ]
    unknown = sorted({a.level for a in out} - set(levels))
    if unknown:
        raise ValueError(f"attempts name levels {unknown} that are not in {list(levels)}")
    return out


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
        pass_rate = reasoning = per_turn = output = turns = None
        # A non-admitted success (a stale sampler, a split Pi sample) is not a verified one here either.
        scheduled = Estimate(k / len(at_level), *wilson_interval(k, len(at_level))) if at_level else None
        if adm:
            pass_rate = Estimate(k / len(adm), *wilson_interval(k, len(adm)))
            mean_t = float(sums[:, j].sum() / counts[:, j].sum())
            reasoning = _percentile_interval(boot[:, j], mean_t)
            if all(a.turns is not None for a in adm):
                turns = float(np.mean([a.turns for a in adm]))
                total_turns = sum(a.turns for a in adm)
                per_turn = float(sum(a.reasoning_tokens for a in adm) / total_turns) if total_turns else None
            if all(a.output_tokens is not None for a in adm):
                output = float(np.mean([a.output_tokens for a in adm]))
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
        out[key] = _percentile_interval(r, ratio)
    return out


def _select(run: Run, split: str) -> tuple[list[RunAttempt], str, str | None]:
    """The attempts of `split`, falling back from eval to train when the run has no eval attempts."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    chosen = [a for a in run.attempts if a.split == split]
    if chosen or split == "train":
        return chosen, split, None
    train = [a for a in run.attempts if a.split == "train"]
    return train, "train", f"{run.name}: no eval attempts; train attempts used"


def steps(run: Run, split: str = "eval") -> list[int]:
    """The steps with attempts in `split` (after the eval → train fallback), ascending."""
    chosen, _, _ = _select(run, split)
    return sorted({a.step for a in chosen})


def _summary(
    run: Run, attempts: list[RunAttempt], split: str, first: int, last: int, note: str | None, n_boot: int
) -> Summary:
    return Summary(
        run=run.name,
        split=split,
        step=last,
        first_step=first,
        levels=run.levels,
        stats=level_stats(attempts, run.levels, n_boot=n_boot),
        ordering=ordering_ratios(attempts, run.levels, n_boot=n_boot),
        tasks=len({a.task_id for a in attempts}),
        note=note,
    )


def summarize(run: Run, split: str = "eval", step: str | int = "first", *, n_boot: int = N_BOOT) -> Summary:
    """The per-level numbers and ordering ratios of one step ("first", "last" or a step number)."""
    chosen, used, note = _select(run, split)
    available = sorted({a.step for a in chosen})
    if not available:
        raise ValueError(f"{run.path}: no {used} attempts to summarise")
    if step == "first":
        at = available[0]
    elif step == "last":
        at = available[-1]
    elif isinstance(step, int) and not isinstance(step, bool) and step in available:
        at = step
    else:
        raise ValueError(f"{run.path}: step must be 'first', 'last' or one of the {used} steps {available}")
    return _summary(run, [a for a in chosen if a.step == at], used, at, at, note, n_boot)


def step_series(run: Run, split: str = "eval", window: int = 1, *, n_boot: int = 1000) -> list[Summary]:
    """One summary per step (or per `window` consecutive steps pooled), in step order.

    Fewer resamples than a single summary: a run has many steps, and the bands only need the 2.5%
    and 97.5% quantiles to the pixel, not to the third digit."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    chosen, used, note = _select(run, split)
    bins: dict[int, list[RunAttempt]] = {}
    for a in chosen:
        bins.setdefault(a.step // window, []).append(a)
    out = []
    for b in sorted(bins):
        group = bins[b]
        step_set = sorted({a.step for a in group})
        out.append(_summary(run, group, used, step_set[0], step_set[-1], note, n_boot))
    return out


# ------------------------------------------------------------------------------------------ table


def _initials(levels: Sequence[str]) -> list[str]:
    """L, M, X for low, medium, xhigh; full names if the initials would collide."""
    short = [e[0].upper() for e in levels]
    return short if len(set(short)) == len(short) else list(levels)


def _pct(e: Estimate | None) -> str:
    return "–" if e is None else f"{100 * e.value:.1f}% [{100 * e.lo:.0f}, {100 * e.hi:.0f}]"


def _tokens(e: Estimate | None) -> str:
    return "–" if e is None else f"{e.value:,.0f}"


def _ratio(e: Estimate | None) -> str:
    if e is None:
        return "–"
    text = f"{e.value:.2f} [{e.lo:.2f}, {e.hi:.2f}]"
    return f"**{text}**" if e.value > 1.0 else text  # bold: an ordering violation


def comparison_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """A Markdown table, one row per named summary: per-level pass rate over admitted and over
    scheduled attempts (95% Wilson), mean reasoning tokens per attempt, and the adjacent ordering
    ratios (95% task bootstrap)."""
    if not rows:
        raise ValueError("comparison_table needs at least one row")
    levels = rows[0][1].levels
    for name, s in rows:
        if s.levels != levels:
            raise ValueError(f"row {name!r} has levels {list(s.levels)}, the first row {list(levels)}")
    ini = _initials(levels)
    pairs = [f"{levels[j]}/{levels[j + 1]}" for j in range(len(levels) - 1)]
    header = (
        ["", "step", "tasks"]
        + [f"pass {e}" for e in ini]
        + [f"sched {e}" for e in ini]
        + [f"T {e}" for e in ini]
        + [f"T_{ini[j]}/T_{ini[j + 1]}" for j in range(len(pairs))]
    )
    body = []
    for name, s in rows:
        step = str(s.step) if s.first_step == s.step else f"{s.first_step}–{s.step}"
        body.append(
            [name, step + ("" if s.split == "eval" else " (train)"), str(s.tasks)]
            + [_pct(s.stats[e].pass_rate) for e in levels]
            + [_pct(s.stats[e].pass_rate_scheduled) for e in levels]
            + [_tokens(s.stats[e].reasoning_tokens) for e in levels]
            + [_ratio(s.ordering[p]) for p in pairs]
        )
    legend = ", ".join(f"{a} = {e}" for a, e in zip(ini, levels, strict=True) if a != e)
    foot = (
        (f"{legend}. " if legend else "")
        + "pass: pass rate over admitted attempts [95% Wilson]. sched: admitted successes over scheduled "
        "attempts, non-admitted (malformed) ones counted as failures [95% Wilson]. T: mean reasoning "
        "tokens per admitted attempt. Ratios: T_lower/T_upper [95% bootstrap over tasks]; bold above 1.00 = ordering violation."
    )
    notes = sorted({s.note for _, s in rows if s.note})
    return "\n".join([markdown_table(header, body), "", foot, *notes])


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table: the first column left-aligned (names), the others right-aligned (figures),
    padded so the columns line up in plain text too."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(":" + "-" * (w + 1) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in body)])


# -------------------------------------------------------------------------------------- pictures


def _atomic_savefig(fig: Any, path: Path) -> Path:
    """Write the figure next to its destination, then rename: a reader never sees half a PNG."""
    from jaxpi.atomic import atomic_file

    with atomic_file(path, "wb") as f:  # the umask's permissions, not mkstemp's 0600
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
    return path


def _atomic_write_text(text: str, path: Path) -> Path:
    from jaxpi.atomic import write_text

    return write_text(path, text)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _colours(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _frontier_layer(ax: Any, s: Summary, colour: Any, alpha: float, label: str | None) -> None:
    """One summary on the pass-rate / reasoning-tokens plane: points, both intervals, arrows."""
    ini = _initials(s.levels)
    pts = []
    for e, tag in zip(s.levels, ini, strict=True):
        st = s.stats[e]
        if st.pass_rate is None or st.reasoning_tokens is None:
            continue
        x, y = st.reasoning_tokens, st.pass_rate
        ax.errorbar(
            x.value,
            y.value,
            xerr=[[x.value - x.lo], [x.hi - x.value]],
            yerr=[[y.value - y.lo], [y.hi - y.value]],
            fmt="o",
            color=colour,
            alpha=alpha,
            capsize=3,
            label=label if not pts else None,
        )
        ax.annotate(
            tag, (x.value, y.value), textcoords="offset points", xytext=(6, 6), color=colour, alpha=alpha
        )
        pts.append((x.value, y.value))
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        ax.annotate(
            "",
            xy=(x1, y1),
            xytext=(x0, y0),
            arrowprops={
                "arrowstyle": "->",
                "color": colour,
                "alpha": alpha,
                "lw": 1.5,
                "shrinkA": 6,
                "shrinkB": 6,
            },
        )


def plot_frontier(runs: Sequence[tuple[Summary, Summary]], path: str | os.PathLike) -> Path:
    """Pass rate vs mean reasoning tokens per attempt: per run its (first, last) summaries."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    colours = _colours(len(runs))
    for i, ((first, last), colour) in enumerate(zip(runs, colours, strict=True)):
        if i == 0 and first.step != last.step:
            # With several runs the first run's start is the common start, drawn once in grey.
            start_colour = "0.45" if len(runs) > 1 else colour
            _frontier_layer(ax, first, start_colour, 0.4, f"start (step {first.step})")
        _frontier_layer(ax, last, colour, 1.0, f"{last.run} (step {last.step})")
    ax.set_xlabel("mean reasoning tokens per attempt")
    ax.set_ylabel("pass rate")
    ax.set_ylim(-0.02, 1.08)  # room for the level labels above a 100% point
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    split = runs[0][1].split
    ax.set_title(f"Pass rate vs reasoning by effort level ({split}, 95% intervals)")
    try:
        return _atomic_savefig(fig, Path(path))
    finally:
        plt.close(fig)


def plot_ordering(series: Sequence[Sequence[Summary]], path: str | os.PathLike) -> Path:
    """Each adjacent ordering ratio across steps, one line + band per run, dashed 1.0."""
    plt = _pyplot()
    levels = series[0][0].levels
    pairs = [f"{levels[j]}/{levels[j + 1]}" for j in range(len(levels) - 1)]
    ini = _initials(levels)
    fig, axes = plt.subplots(1, max(1, len(pairs)), figsize=(5.5 * max(1, len(pairs)), 4), squeeze=False)
    colours = _colours(len(series))
    for j, pair in enumerate(pairs):
        ax = axes[0, j]
        for run_series, colour in zip(series, colours, strict=True):
            pts = [(s.step, s.ordering[pair]) for s in run_series if s.ordering.get(pair) is not None]
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1].value for p in pts], "o-", color=colour, label=run_series[0].run, ms=3)
            ax.fill_between(x, [p[1].lo for p in pts], [p[1].hi for p in pts], color=colour, alpha=0.2)
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_title(f"T_{ini[j]}/T_{ini[j + 1]} ({pair}); above 1 = violation", fontsize="medium")
        ax.set_xlabel("step (policy updates)")
        ax.grid(alpha=0.3)
    if not pairs:
        axes[0, 0].text(
            0.5, 0.5, "one effort level: no ordering ratios", ha="center", transform=axes[0, 0].transAxes
        )
    axes[0, 0].set_ylabel("reasoning tokens, lower / upper level")
    if pairs:
        axes[0, 0].legend(fontsize="small")
    try:
        return _atomic_savefig(fig, Path(path))
    finally:
        plt.close(fig)


def plot_pass_rate(series: Sequence[Sequence[Summary]], path: str | os.PathLike) -> Path:
    """Per run (columns): pass rate per level (top; dashed, without a band: over scheduled
    attempts, drawn where it differs) and T per level (bottom) across steps."""
    plt = _pyplot()
    n = len(series)
    fig, axes = plt.subplots(2, n, figsize=(5.5 * n, 7), squeeze=False, sharex="col")
    for col, run_series in enumerate(series):
        levels = run_series[0].levels
        colours = _colours(len(levels))
        for level, colour in zip(levels, colours, strict=True):
            for row, field in enumerate(("pass_rate", "reasoning_tokens")):
                pts = [(s.step, getattr(s.stats[level], field)) for s in run_series]
                pts = [(x, e) for x, e in pts if e is not None]
                if not pts:
                    continue
                x = [p[0] for p in pts]
                ax = axes[row, col]
                ax.plot(x, [p[1].value for p in pts], "o-", color=colour, label=level, ms=3)
                ax.fill_between(x, [p[1].lo for p in pts], [p[1].hi for p in pts], color=colour, alpha=0.2)
            sched = [(s.step, s.stats[level].pass_rate_scheduled) for s in run_series]
            sched = [(x, e.value) for x, e in sched if e is not None]
            if any(s.stats[level].admitted < s.stats[level].scheduled for s in run_series) and sched:
                axes[0, col].plot(*zip(*sched, strict=True), "--", color=colour, lw=1)
        axes[0, col].set_title(f"{run_series[0].run} ({run_series[0].split})")
        axes[0, col].set_ylim(-0.02, 1.02)
        axes[1, col].set_xlabel("step (policy updates)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
        axes[0, col].legend(fontsize="small")
    axes[0, 0].set_ylabel("pass rate (95% Wilson); dashed: of scheduled")
    axes[1, 0].set_ylabel("reasoning tokens / attempt (95% bootstrap)")
    try:
        return _atomic_savefig(fig, Path(path))
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------- report


def build_report(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike | None = None,
    split: str = "eval",
    window: int = 1,
) -> dict[str, Any]:
    """Load the runs, write the three pictures and report.json into `out` (default: the first
    run's `report/`), and return report.json's content."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    levels = runs[0].levels
    for r in runs[1:]:
        if r.levels != levels:
            raise ValueError(f"{r.path}: levels {list(r.levels)} differ from {runs[0].path}'s {list(levels)}")
    out_dir = Path(out) if out is not None else runs[0].path / "report"
    ends = [(summarize(r, split, "first"), summarize(r, split, "last")) for r in runs]
    rows = [("start", ends[0][0])] + [(last.run, last) for _, last in ends]
    table = comparison_table(rows)
    series = [step_series(r, split, window) for r in runs]
    images = [
        plot_frontier(ends, out_dir / "frontier.png"),
        plot_ordering(series, out_dir / "ordering.png"),
        plot_pass_rate(series, out_dir / "pass_rate.png"),
    ]
    report = {
        "runs": [
            {
                "name": r.name,
                "dir": str(r.path),
                "reward_kind": r.reward_kind,
                "skipped_truncated_line": r.skipped_last_line,
                "first": first.to_json(),
                "last": last.to_json(),
            }
            for r, (first, last) in zip(runs, ends, strict=True)
        ],
        "table": table,
        "images": [str(p) for p in images],
    }
    _atomic_write_text(json.dumps(_finite(report), indent=2) + "\n", out_dir / "report.json")
    return report


def _finite(obj: Any) -> Any:
    """JSON has no NaN/inf: undefined numbers become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi report` on the CLI's subparsers."""
    p = sub.add_parser(
        "report",
        help="pictures and a table of GRPO runs: pass rate vs reasoning per effort level, ordering ratios",
        description="Read GRPO run directories (run.json + attempts.jsonl) and write frontier.png, "
        "ordering.png, pass_rate.png and report.json. Prints a Markdown table: the first run's first step "
        "as 'start', then each run's last step. Intervals are 95%: Wilson for pass rates, a bootstrap "
        "over tasks for reasoning tokens and their ratios.",
    )
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="GRPO run directories; the first is the start"
    )
    p.add_argument("--out", default=None, help="output directory (default: FIRST_RUN_DIR/report)")
    p.add_argument(
        "--split",
        choices=list(SPLITS),
        default="eval",
        help="held-out eval attempts (default; falls back to train when a run has none) or train",
    )
    p.add_argument("--window", type=int, default=1, help="pool this many consecutive steps per point")
    p.add_argument("--json", action="store_true", help="print report.json's content instead of the table")
    p.set_defaults(fn=cmd_report)
    return p


def cmd_report(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = build_report(args.run_dirs, args.out, args.split, args.window)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(_finite(report), indent=2))
    else:
        print(report["table"])
        print()
        print("\n".join(f"wrote {p}" for p in _paths(report)))
    return 0


def _paths(report: dict[str, Any]) -> Iterable[str]:
    yield from report["images"]
    yield str(Path(report["images"][0]).parent / "report.json")

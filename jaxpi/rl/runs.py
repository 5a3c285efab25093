"""Reading a GRPO run directory, and its summaries per step.

The GRPO loop writes a run directory; this module only reads it:
- `run.json`: `{"levels": [...lowest effort first], "reward": {"kind": ...}, "name": ...}`.
- `attempts.jsonl`: one object per attempt (`split`, `step`, `task_id`, `level`, `admitted`,
  `success`, `reasoning_tokens`, `output_tokens`, `turns`, ...). `step` counts the policy updates
  applied before the attempt was collected, so eval at step 0 is the starting policy.

Eval attempts (held-out tasks) are the default; a run without any falls back to its train
attempts, and the summary says so. Train steps are one fresh collection each, so their points
are noisy; `window` pools consecutive steps as the seed report pools collections into ranges.
The numbers themselves are `jaxpi.stats.levels`'.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from jaxpi.stats.levels import (
    N_BOOT,
    SPLITS,
    RunAttempt,
    Summary,
    level_stats,
    ordering_ratios,
    parse_attempt,
)


@dataclasses.dataclass(frozen=True)
class Run:
    path: Path
    name: str
    levels: tuple[str, ...]  # lowest effort first
    reward_kind: str | None
    attempts: tuple[RunAttempt, ...]
    skipped_last_line: bool = False  # the writer was killed mid-line


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
        out.append(parse_attempt(obj, levels, where))
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

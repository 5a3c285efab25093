"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step), the loggers of
`output.loggers` (TensorBoard, W&B, MLflow: `jaxpi.train.loggers`), and the console (a progress bar
on a terminal, plain lines elsewhere: `jaxpi.train.progress`).

On resume the log is cut back to the checkpoint's step first (`truncate_jsonl`), so the file always
reads as one uninterrupted run; TensorBoard is told the same with `purge_step`. A run without a
checkpoint starts over: a killed fresh run's records (a GRPO run's step-0 evaluation) are dropped.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxpi.atomic import write_text
from jaxpi.train.loggers import JsonlLogger, Logger, open_loggers
from jaxpi.train.progress import Progress


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Keep the records of steps ≤ `last_step` (and drop a torn last line); returns how many were
    kept. Rewritten atomically (`jaxpi.atomic`: a killed rewrite leaves the old file whole)."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if record.get("step", math.inf) <= last_step:
            kept.append(line)
    write_text(path, "".join(f"{line}\n" for line in kept))
    return len(kept)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics file."""
    out = []
    for line in Path(path).read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


class MetricsLog:
    """Appends step records to `<dir>/metrics.jsonl` and hands them to the loggers of `loggers`
    (`output.loggers`); on the console a bar, or with stderr not a terminal (or `progress` off) a
    plain line every `log_every` steps (`train.log_every`) to `out`."""

    def __init__(
        self,
        run_dir: Path,
        *,
        start_step: int,
        total_steps: int,
        progress: bool,
        loggers: Sequence[str] = ("tensorboard",),
        log_every: int = 1,
        out: Any = None,
        name: str = "",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        truncate_jsonl(self.path, start_step if start_step else -1)
        self.loggers: list[Logger] = [JsonlLogger(self.path)]
        try:
            self.loggers += open_loggers(
                loggers, run_dir, start_step=start_step, name=name or run_dir.name, config=config or {}
            )
        except BaseException:
            self.loggers[0].close()
            raise
        self.console = Progress(
            total=total_steps, start=start_step, progress=progress, every=log_every, out=out
        )

    def write(self, record: dict[str, Any], detail: str = "") -> None:
        """Record `record` (its "step" is the step it describes); a record with a loss is a step
        done for the console, with `detail` on its line."""
        for logger in self.loggers:
            logger.log(record)
        if "loss" in record:
            self.console.step(record, detail)

    def status(self, text: str) -> None:
        self.console.status(text)

    def message(self, text: str) -> None:
        self.console.message(text)

    def close(self) -> None:
        self.console.close()
        for logger in self.loggers:
            logger.close()

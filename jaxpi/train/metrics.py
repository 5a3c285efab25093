"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step), TensorBoard, a progress bar.

On resume the log is cut back to the checkpoint's step first (`truncate_jsonl`), so the file always
reads as one uninterrupted run; TensorBoard is told the same with `purge_step`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jaxpi.atomic import write_text


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
    """Appends step records to `<dir>/metrics.jsonl` (flushed per line), mirrors the numbers to
    TensorBoard under `<dir>/tb`, and drives a tqdm bar (off when `progress` is false or stderr is
    not a terminal)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        start_step: int,
        total_steps: int,
        progress: bool,
        tensorboard: bool = True,
    ) -> None:
        self.path = run_dir / "metrics.jsonl"
        truncate_jsonl(self.path, start_step)
        self.file = self.path.open("a")
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step: events of steps after the checkpoint (a killed run's tail) are dropped.
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not (progress and sys.stderr.isatty()),
        )

    def write(self, record: dict[str, Any]) -> None:
        # One flushed line per step: a kill loses at most a torn last line, which truncate_jsonl drops.
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = int(record["step"])
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(
                        f"train/{key}" if not key.startswith("val_") else f"val/{key}", value, step
                    )
        postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record.get('tokens_per_s', 0):.0f}"}
        if "val_loss" in record:
            postfix["val"] = f"{record['val_loss']:.4f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)

    def message(self, text: str) -> None:
        self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()

"""What a run prints while it trains: a tqdm bar on a terminal, plain lines everywhere else.

Under nohup, SLURM, Kubernetes or CI stderr is a file or a pipe, where a bar is noise or nothing;
there (and with `--json`) every `train.log_every`-th step, and the last, prints one line:

    step 40/100 | loss 1.2345 | lr 3.00e-04 | grad norm 0.512 | 5120 tok/s | 0:01:05 elapsed, ETA 0:01:37

`status` is for news inside a step (a GRPO collection's progress): the bar's postfix on a
terminal, a line elsewhere.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from tqdm.auto import tqdm


def clock_text(seconds: float) -> str:
    """H:MM:SS."""
    s = max(round(seconds), 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def step_line(record: Mapping[str, Any], total: int, elapsed: float, eta: float | None) -> str:
    """The plain line of one step record (the fields it has, in a fixed order)."""
    parts = [f"step {record['step']}/{total}"]
    for key, label, fmt in (
        ("loss", "loss", ".4f"),
        ("lr", "lr", ".2e"),
        ("grad_norm", "grad norm", ".3f"),
    ):
        if key in record:
            parts.append(f"{label} {record[key]:{fmt}}")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    parts.append(f"{clock_text(elapsed)} elapsed" + (f", ETA {clock_text(eta)}" if eta is not None else ""))
    return " | ".join(parts)


class Progress:
    """A bar when `progress` and stderr is a terminal; else a line every `every` steps (0: none)
    and at `total`, printed to `out`."""

    def __init__(
        self,
        *,
        total: int,
        start: int,
        progress: bool,
        every: int,
        out: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.start, self.every = total, start, every
        self.out = out or sys.stderr
        self.clock = clock
        self.t0 = clock()
        self.bar = None
        if progress and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def step(self, record: Mapping[str, Any], detail: str = "") -> None:
        """Step `record["step"]` done; `detail` (GRPO's per-level line) is printed with its line,
        and above the bar on a terminal."""
        step = int(record["step"])
        if self.bar is not None:
            postfix = {k: f"{record[k]:.4g}" for k in ("loss", "grad_norm") if k in record}
            if "tokens_per_s" in record:
                postfix["tok/s"] = f"{record['tokens_per_s']:.0f}"
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
            if detail and self._due(step):
                self.bar.write(f"step {step}/{self.total}: {detail}", file=sys.stderr)
            return
        if self._due(step):
            elapsed = self.clock() - self.t0
            done = step - self.start
            eta = elapsed / done * (self.total - step) if done > 0 else None
            line = step_line(record, self.total, elapsed, eta)
            print(line + (f" | {detail}" if detail else ""), file=self.out, flush=True)

    def status(self, text: str) -> None:
        """News inside a step: the bar's postfix, or a line."""
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)
        else:
            print(text, file=self.out, flush=True)

    def message(self, text: str) -> None:
        """A line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.total)

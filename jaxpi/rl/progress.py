"""A GRPO collection's progress while it runs: attempts done of those scheduled, the successes
among them (the pass rate so far, over finished attempts, admitted or not), sampled tokens per
second of the finished attempts.

    collection 3/20: 48/96 attempts, 20 passed (0.42), 1234 tok/s, 0:02:05

The collector calls `done(success, tokens)` as each attempt ends (from any thread); a line goes
to `emit` at most every `every_s` seconds and always at the end, so an hours-long collection
says how far it is without flooding a log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from jaxpi.train.progress import clock_text


class CollectionProgress:
    """Counts one collection's finished attempts; `begin` starts (or, for a redone collection,
    restarts) the count, `end` reports the last line."""

    def __init__(
        self,
        label: str,
        scheduled: int,
        emit: Callable[[str], None],
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.scheduled, self.emit, self.every_s, self.clock = (
            label,
            scheduled,
            emit,
            every_s,
            clock,
        )
        self.lock = threading.Lock()
        self.begin()

    def begin(self) -> None:
        with self.lock:
            self.attempts = self.successes = self.tokens = 0
            self.t0 = self.last = self.clock()

    def done(self, success: bool, tokens: int) -> None:
        with self.lock:
            self.attempts += 1
            self.successes += bool(success)
            self.tokens += int(tokens)
            now = self.clock()
            if now - self.last < self.every_s or self.attempts >= self.scheduled:
                return  # the last attempt's line is `end`'s
            self.last = now
            line = self.line(now)
        self.emit(line)

    def end(self) -> None:
        with self.lock:
            line = self.line(self.clock())
        self.emit(line)

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        rate = f"{self.successes / self.attempts:.2f}" if self.attempts else "-"
        return (
            f"{self.label}: {self.attempts}/{self.scheduled} attempts, {self.successes} passed ({rate}), "
            f"{self.tokens / max(elapsed, 1e-9):.0f} tok/s, {clock_text(elapsed)}"
        )

"""Concurrent requests into few engine calls: one worker thread owns the engine.

Request threads `submit` rows (one per prompt and choice) and wait. The worker takes the first
waiting row, keeps gathering for `wait_s` (or until `max_rows` are waiting), groups the rows by
what one engine call must share (temperature, top-p, stop ids), and runs each group with the
largest `max_tokens` among its rows; a row asking for fewer tokens is cut at its own limit
afterwards. Cutting is exact: sampling keys depend on (row key, position) only, and tokens after
the cut never influence the ones before it. The engine's shapes are bucketed (prefill chunks,
power-of-two decode buffers), so a new batch composition compiles nothing new.

A row with a `stream` queue gets its tokens as they are sampled: its group then decodes
`stream_interval` tokens per engine call (the same tokens, see `JaxEngine._turn`) and each new
piece, cut at the row's own limit, goes on the queue as `(index, ids, logprobs)`; `(index, None,
None)` follows once the row is done. A row whose `cancelled` event is set (its client went away)
stops at the next piece.

Each row's sampling key comes from its request's seed (and its choice index), not from its place
in the batch: a seeded request gives the same tokens alone or batched with any others. Rows
without a seed get a key the server draws.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from jaxpi.rollout.engine import Completion, SamplingParams


@dataclasses.dataclass
class Row:
    """One prompt to complete; `done` is set when `result` or `error` is filled."""

    prompt: list[int]
    params: SamplingParams  # max_new_tokens: this row's own limit; seed: unused (see row_key)
    row_key: int | None  # the row's sampling key (31 bits); None: the server draws one
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None
    stream: queue.Queue | None = None  # tokens as they are sampled: (index, ids, logprobs)
    index: int = 0  # the row's place in its request (names it on `stream`)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    sent: int = 0  # tokens put on `stream` so far

    def finish(self) -> None:
        self.done.set()
        if self.stream is not None:
            self.stream.put((self.index, None, None))

    def key(self) -> tuple:
        p = self.params
        return (p.temperature, p.top_p, p.stop_token_ids)


def cut(c: Completion, n: int) -> Completion:
    """The completion as if sampled with max_new_tokens = n."""
    if len(c.token_ids) <= n:
        return c
    return dataclasses.replace(
        c,
        token_ids=c.token_ids[:n],
        logprobs=c.logprobs[:n],
        sampling_logprobs=c.sampling_logprobs[:n],
        finish_reason="length",
    )


OnTokens = Callable[[int, list[int], list[float]], "bool | None"]


def generate_keyed(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    keys: Sequence[int],
    on_tokens: OnTokens | None = None,
    interval: int = 1,
) -> list[Completion]:
    """One turn per prompt, row i sampled with key fold_in(key(params.seed), keys[i]).

    `JaxEngine.generate` keys rows by their index in the call; its `_turn` takes the row ids, so
    the server calls that (in waves of the engine's batch size) to key rows by request instead.
    `on_tokens(i, ids, logprobs)` sees row i's tokens as they are sampled, `interval` at a time.
    Engines without `_turn` (any other `RolloutEngine`) fall back to `generate`, and `on_tokens`
    then sees each row's tokens once, at the end.
    """
    turn = getattr(engine, "_turn", None)
    if turn is None:
        out = engine.generate(prompts, params)
        for i, c in enumerate(out if on_tokens else ()):
            on_tokens(i, list(c.token_ids), list(c.logprobs))  # type: ignore[misc]
        return out
    out = []
    for i in range(0, len(prompts), engine.batch_size):
        sessions = engine.start(prompts[i : i + engine.batch_size])
        wave = (lambda j, ids, lps, i=i: on_tokens(i + j, ids, lps)) if on_tokens else None
        try:
            out += turn(
                sessions,
                [[]] * len(sessions),
                params,
                row_ids=keys[i : i + engine.batch_size],
                **({"on_tokens": wave, "interval": interval} if wave else {}),
            )
        finally:
            engine.close(sessions)
    return out


@dataclasses.dataclass
class Stats:
    """Counters `GET /jaxpi/stats` reports."""

    requests: int = 0
    rows: int = 0
    engine_calls: int = 0
    batched_rows_max: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Batcher:
    def __init__(self, engine: Any, *, max_rows: int, wait_s: float, seed: int = 0, stream_interval: int = 1):
        self.engine, self.max_rows, self.wait_s = engine, max_rows, wait_s
        self.stream_interval = stream_interval
        self.stats = Stats()
        self._q: queue.Queue[Row | None] = queue.Queue()
        self._rng = np.random.default_rng(seed)
        # Held around every engine call: a trainer swapping weights (`engine.update_weights`)
        # takes it too, so no batch ever runs on half-updated weights.
        self.engine_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxpi-serve-batcher", daemon=True)
        self._thread.start()

    def put(self, rows: Sequence[Row]) -> None:
        """Queue the rows of one request (their `done`, and `stream`, tell when they are)."""
        if self._stop.is_set():
            raise RuntimeError("the server is shutting down")
        with self._lock:
            self.stats.requests += 1
        for r in rows:
            self._q.put(r)

    def waiting(self) -> int:
        """Rows queued and not yet in an engine call."""
        return self._q.qsize()

    def submit(self, rows: Sequence[Row], timeout: float | None = None) -> list[Completion]:
        """Queue the rows of one request and wait for all of them."""
        self.put(rows)
        for r in rows:
            if not r.done.wait(timeout):
                raise TimeoutError(f"no completion within {timeout} s")
            if r.error is not None:
                raise r.error
        return [r.result for r in rows]  # type: ignore[misc]

    def close(self) -> None:
        self._stop.set()
        self._q.put(None)
        self._thread.join(timeout=30)

    # ---- worker ---------------------------------------------------------------------------------
    def _gather(self, first: Row) -> list[Row]:
        rows = [first]
        deadline = time.monotonic() + self.wait_s
        while len(rows) < self.max_rows:
            left = deadline - time.monotonic()
            try:
                r = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
            except queue.Empty:
                break
            if r is None:  # shutdown: finish what we hold, then stop
                self._stop.set()
                break
            rows.append(r)
        return rows

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._q.get()
            if first is None:
                break
            rows = self._gather(first)
            groups: dict[tuple, list[Row]] = {}
            for r in rows:
                groups.setdefault(r.key(), []).append(r)
            for members in groups.values():
                self._generate(members)
        while True:  # fail whatever is still queued
            try:
                r = self._q.get_nowait()
            except queue.Empty:
                break
            if r is not None:
                r.error = RuntimeError("the server shut down before this request ran")
                r.finish()

    def _generate(self, rows: list[Row]) -> None:
        params = dataclasses.replace(
            rows[0].params, seed=0, max_new_tokens=max(r.params.max_new_tokens for r in rows)
        )
        keys = [r.row_key if r.row_key is not None else int(self._rng.integers(0, 2**31 - 1)) for r in rows]
        t0 = time.perf_counter()
        streamed = any(r.stream is not None for r in rows)
        try:
            with self.engine_lock:
                comps = generate_keyed(
                    self.engine,
                    [r.prompt for r in rows],
                    params,
                    keys,
                    partial(_piece, rows) if streamed else None,
                    self.stream_interval,
                )
        except BaseException as e:  # reported to each waiting request; the worker lives on
            for r in rows:
                r.error = e
                r.finish()
            return
        with self._lock:
            s = self.stats
            s.engine_calls += 1
            s.rows += len(rows)
            s.batched_rows_max = max(s.batched_rows_max, len(rows))
            s.busy_s += time.perf_counter() - t0
            for r, c in zip(rows, comps, strict=True):
                r.result = cut(c, r.params.max_new_tokens)
                s.completion_tokens += len(r.result.token_ids)
        for r in rows:
            r.finish()


def _piece(rows: Sequence[Row], i: int, ids: list[int], lps: list[float]) -> bool:
    """Row i's newly sampled tokens onto its stream, cut at its own limit; False: stop the row
    (its limit is reached, or its client went away)."""
    r = rows[i]
    take = max(0, min(len(ids), r.params.max_new_tokens - r.sent))
    if r.stream is not None and take:
        r.stream.put((r.index, list(ids[:take]), list(lps[:take])))
    r.sent += take
    return not r.cancelled.is_set() and r.sent < r.params.max_new_tokens

"""Per-attempt call records of `jaxpi gateway`: one JSON line per call, fsync'd, in `<dir>/<attempt>.jsonl`.

A record (all keys always present; `error` is null on success):

    attempt, call           attempt id and the call's index within it (0, 1, ...): call k is
                            line k + 1 of the file
    time, latency_s         wall-clock start (unix s) and the upstream round trip
    stream                  whether the client streamed
    request                 the client's body as sent (messages, tools, sampling fields)
    reasoning_effort        the requested effort (null when the client sent none)
    prompt_token_ids        what upstream rendered and tokenised
    completion_token_ids    the sampled tokens of choice 0
    logprobs                their log-probabilities (same length)
    finish_reason           stop | length | tool_calls
    message, usage          the reply's message and usage as upstream gave them
    status, error           HTTP status to the client; {type, message} of an upstream failure

Records live on disk only: the store keeps per attempt the next call index and, for listings,
the number of good records of each file at its last seen size, never the records themselves.
A line that is not a good record (not JSON, not an object, a field of the wrong type, logprobs
that do not match the tokens) is skipped with one warning naming `file:line`; a torn last line
(the gateway killed mid-write) is dropped without one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxpi.gateway.records")
ATTEMPT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")
_warned: set[tuple[str, int]] = set()
_warned_lock = threading.Lock()


def valid_attempt(attempt: Any) -> bool:
    return isinstance(attempt, str) and ATTEMPT_ID.fullmatch(attempt) is not None and ".." not in attempt


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def record_problem(rec: Any) -> str | None:
    """Why `rec` is not a call record the trajectory builder can use, or None."""
    if not isinstance(rec, dict):
        return f"not a JSON object ({type(rec).__name__})"
    call = rec.get("call")
    if isinstance(call, bool) or not isinstance(call, int) or call < 0:
        return f"'call' must be a non-negative integer, got {json.dumps(call)[:40]}"
    if not isinstance(rec.get("attempt"), str):
        return "'attempt' must be a string"
    err = rec.get("error")
    if err is not None:
        return None if isinstance(err, dict) else "'error' must be an object or null"
    for key in ("prompt_token_ids", "completion_token_ids"):
        if not _ints(rec.get(key)):
            return f"'{key}' must be a list of token ids"
    lps = rec.get("logprobs")
    if not isinstance(lps, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in lps
    ):
        return "'logprobs' must be a list of finite numbers"
    if len(lps) != len(rec["completion_token_ids"]):
        return f"{len(lps)} logprobs for {len(rec['completion_token_ids'])} completion tokens"
    if not isinstance(rec.get("finish_reason"), str):
        return "'finish_reason' must be a string"
    return None


def _warn_once(path: Path, line: int, why: str) -> None:
    key = (str(path), line)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("%s:%d: %s; record skipped", path, line, why)


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The good records of one attempt file, in file order, read line by line (see the module
    docstring for what is skipped)."""
    path = Path(path)
    out = []
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            torn = not raw.endswith(b"\n")  # only the last line can lack its newline
            if not raw.strip():
                if not torn:
                    _warn_once(path, i, "an empty line")
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if not torn:
                    _warn_once(path, i, "not a JSON record")
                continue
            why = record_problem(rec)
            if why is not None:
                _warn_once(path, i, why)
                continue
            out.append(rec)
    return out


def _lines(path: Path) -> int:
    """Lines of an attempt file, after ending a torn last line (so the next record starts a line
    of its own; the torn one is then skipped with a warning when read)."""
    if not path.exists():
        return 0
    n, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    if last != b"\n":
        with path.open("ab") as f:
            f.write(b"\n")
        n += 1
    return n


class RecordStore:
    """Appends call records per attempt to `directory` (None: a private temporary directory,
    removed by `close()`)."""

    def __init__(self, directory: str | os.PathLike | None):
        self._own = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="jaxpi-gateway-")) if directory is None else Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._next: dict[str, int] = {}  # attempt -> its next call index (= lines in its file)
        self._good: dict[str, tuple[int, int]] = {}  # attempt -> (file size, good records) last seen
        self._lock = threading.Lock()

    def path(self, attempt: str) -> Path:
        return self.dir / f"{attempt}.jsonl"

    def exists(self, attempt: str) -> bool:
        return attempt in self._next or self.path(attempt).exists()

    def append(self, attempt: str, record: dict[str, Any]) -> dict[str, Any]:
        """Give the record its call index, write it durably, return it."""
        with self._lock:
            path = self.path(attempt)
            if attempt not in self._next:
                self._next[attempt] = _lines(path)
            record = {"attempt": attempt, "call": self._next[attempt], **record}
            line = (json.dumps(record) + "\n").encode()
            # One write per line and an fsync: a crash loses at most the line being written.
            # Opened per append, no handle kept: many attempts of few calls each.
            with path.open("ab") as f:
                size = f.tell()
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._next[attempt] += 1
            seen = self._good.get(attempt)
            if seen is not None and seen[0] == size:
                self._good[attempt] = (size + len(line), seen[1] + (record_problem(record) is None))
            return record

    def get(self, attempt: str) -> list[dict[str, Any]] | None:
        """The attempt's good records (from its file), or None if it has none on file."""
        path = self.path(attempt)
        try:
            return read_records(path)
        except FileNotFoundError:
            return None

    def attempts(self) -> dict[str, int]:
        """{attempt: number of good records}, over every file in the directory."""
        out = {}
        for path in sorted(self.dir.glob("*.jsonl")):
            attempt = path.name[: -len(".jsonl")]
            if not valid_attempt(attempt):
                continue
            try:
                size = path.stat().st_size
                seen = self._good.get(attempt)
                if seen is None or seen[0] != size:
                    # Read only when the file changed since: a listing costs a stat per attempt.
                    seen = (size, len(read_records(path)))
                    self._good[attempt] = seen
            except OSError as e:
                log.warning("%s: unreadable (%s); left out of the listing", path, e)
                continue
            out[attempt] = seen[1]
        return out

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)

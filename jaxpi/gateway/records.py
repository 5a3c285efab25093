"""Per-attempt call records of `jaxpi gateway`: one JSON line per call, fsync'd, in `<dir>/<attempt>.jsonl`.

A record (all keys always present; `error` is null on success):

    attempt, call           attempt id and the call's index within it (0, 1, ...)
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
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

ATTEMPT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")


def valid_attempt(attempt: str) -> bool:
    return ATTEMPT_ID.fullmatch(attempt) is not None and ".." not in attempt


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of one attempt file; a torn last line (killed mid-write) is dropped, any other
    bad line is an error naming the file and line."""
    path = Path(path)
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record") from None
    return out


class RecordStore:
    """Appends call records per attempt; `directory` None keeps them in memory only."""

    def __init__(self, directory: str | os.PathLike | None):
        self.dir = Path(directory) if directory is not None else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        self._mem: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def _load(self, attempt: str) -> list[dict[str, Any]]:
        if attempt not in self._mem:
            path = self.path(attempt)
            self._mem[attempt] = read_records(path) if path is not None and path.exists() else []
        return self._mem[attempt]

    def path(self, attempt: str) -> Path | None:
        return None if self.dir is None else self.dir / f"{attempt}.jsonl"

    def append(self, attempt: str, record: dict[str, Any]) -> dict[str, Any]:
        """Give the record its call index, write it durably, return it."""
        with self._lock:
            calls = self._load(attempt)
            record = {"attempt": attempt, "call": len(calls), **record}
            path = self.path(attempt)
            if path is not None:
                # One write per line and an fsync: a crash loses at most the line being written.
                # Opened per append, no handle kept: many attempts of few calls each.
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            calls.append(record)
            return record

    def get(self, attempt: str) -> list[dict[str, Any]] | None:
        with self._lock:
            path = self.path(attempt)
            if attempt not in self._mem and (path is None or not path.exists()):
                return None
            return list(self._load(attempt))

    def attempts(self) -> dict[str, int]:
        with self._lock:
            names = set(self._mem)
            if self.dir is not None:
                names |= {p.stem for p in self.dir.glob("*.jsonl")}
            return {a: len(self._load(a)) for a in sorted(names)}

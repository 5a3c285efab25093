"""The one printing path of the commands: `--json` prints one JSON object, else the human text."""

from __future__ import annotations

import json
from typing import Any


def emit(obj: Any, as_json: bool, text: str, *, one_line: bool = False) -> None:
    """Print `obj` as JSON under --json (indented, or on `one_line` for a reader that waits for
    that line, as a server's start-up does), else `text`; flushed either way."""
    if as_json:
        text = json.dumps(obj) if one_line else json.dumps(obj, indent=2)
    print(text, flush=True)

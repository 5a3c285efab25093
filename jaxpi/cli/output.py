"""The one printing path of the commands: `--json` prints one JSON object, else the human text."""

from __future__ import annotations

import json
from typing import Any


def emit(obj: Any, as_json: bool, text: str) -> None:
    """Print `obj` as indented JSON under --json, else `text`."""
    print(json.dumps(obj, indent=2) if as_json else text)

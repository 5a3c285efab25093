"""What the reports are written with: the one Markdown table, and JSON without NaN."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A Markdown table: the first column left-aligned (names), the others right-aligned (figures),
    padded so the columns line up in plain text too."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(":" + "-" * (w + 1) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in body)])


def finite(obj: Any) -> Any:
    """JSON has no NaN/inf: undefined numbers become null (in dicts, lists and tuples)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj

"""Argument types shared by several commands."""

from __future__ import annotations

import argparse

from jaxpi.configfile import parse_size


def size(text: str) -> int:
    """A byte count: 5GB, 500MiB, 1000000 (binary units either way)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

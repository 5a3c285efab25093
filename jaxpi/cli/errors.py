"""The exit statuses every `jaxpi` command uses (the README's table)."""

from __future__ import annotations

OK = 0
CHECK_FAILED = 1  # the command ran and a check failed: parity, plan's fit, an audit, no data admitted
BAD_INPUT = 2  # before any work: arguments, an unknown or mistyped config key, a missing file
# The trainers' documented stops (non-finite loss, collection failed, ...) are 3 and up.

# What `main` reports as bad input (`jaxpi CMD: error: ...`, exit 2).
BAD_INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, FileExistsError, KeyError)

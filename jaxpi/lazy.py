"""Package facades that import on first use (PEP 562): a package lists where each of its public
names lives, and `facade` gives it the module `__getattr__` and `__dir__` that import the defining
module when a name is first read (then keep the value in the package's namespace). So
`from jaxpi.serve import ServeConfig` imports the config module only, not the server and jax.

The package root `jaxpi/__init__.py` keeps its own copy: it may import nothing at load."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def facade(
    package: str, where: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__, __dir__ = facade(__name__, _WHERE, globals())` in a package's `__init__`."""

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted([*namespace, *where])

    return getattr_, dir_

"""`jaxpi serve`: an OpenAI-compatible server (vLLM's wire format) on the embedded JAX engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxpi.serve.config import GatewayConfig, HttpLimits, ServeConfig
    from jaxpi.serve.server import ServeHandle, serve_engine, start_server

# name -> the module that defines it, imported on first use (PEP 562)
_WHERE = {
    "GatewayConfig": "jaxpi.serve.config",
    "HttpLimits": "jaxpi.serve.config",
    "ServeConfig": "jaxpi.serve.config",
    "ServeHandle": "jaxpi.serve.server",
    "serve_engine": "jaxpi.serve.server",
    "start_server": "jaxpi.serve.server",
}

__all__ = ["GatewayConfig", "HttpLimits", "ServeConfig", "ServeHandle", "serve_engine", "start_server"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxpi.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])

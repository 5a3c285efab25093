"""`jaxpi serve`: an OpenAI-compatible server (vLLM's wire format) on the embedded JAX engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpi.lazy import facade

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


__getattr__, __dir__ = facade(__name__, _WHERE, globals())

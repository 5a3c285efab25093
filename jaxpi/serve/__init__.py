"""`jaxpi serve`: an OpenAI-compatible server (vLLM's wire format) on the embedded JAX engine."""

from jaxpi.serve.config import ServeConfig
from jaxpi.serve.server import ServeHandle, serve_engine, start_server

__all__ = ["ServeConfig", "ServeHandle", "serve_engine", "start_server"]

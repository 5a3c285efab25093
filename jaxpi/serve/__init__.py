"""`jaxpi serve`: an OpenAI-compatible server (vLLM's wire format) on the embedded JAX engine."""

from jaxpi.serve.config import ServeConfig
from jaxpi.serve.server import ServeHandle, start_server

__all__ = ["ServeConfig", "ServeHandle", "start_server"]

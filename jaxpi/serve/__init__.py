"""`jaxpi serve`: an OpenAI-compatible server (vLLM's wire format) on the embedded JAX engine."""

from jaxpi.serve.config import GatewayConfig, HttpLimits, ServeConfig
from jaxpi.serve.server import ServeHandle, serve_engine, start_server

__all__ = ["GatewayConfig", "HttpLimits", "ServeConfig", "ServeHandle", "serve_engine", "start_server"]

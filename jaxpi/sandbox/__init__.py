"""Sandboxed execution of model-issued commands (bubblewrap + limits + one allowed endpoint)."""

from jaxpi.sandbox.bwrap import bwrap_path, run_sandboxed
from jaxpi.sandbox.config import KILL_REASONS, SandboxConfig, SandboxResult

__all__ = ["KILL_REASONS", "SandboxConfig", "SandboxResult", "bwrap_path", "run_sandboxed"]

"""SFT data front end: Pi sessions in, admission gates, chat-template rendering with loss masks."""

from jaxpi.data.examples import build_examples, token_stats
from jaxpi.data.gates import PI_EFFORTS, GateConfig, GateReport, admit
from jaxpi.data.render import EffortStyle, Example, RenderConfig, RenderError, load_tokenizer, render_session
from jaxpi.data.sessions import DataError, Rejection, Session, SessionMeta, read_sessions
from jaxpi.data.tiny_tokenizer import ASSETS
from jaxpi.data.tools import PI_TOOL_NAMES, pi_tools

TINY_TOKENIZER = ASSETS / "tiny_tokenizer"
DEMO_DATA = ASSETS / "demo"

__all__ = [
    "DEMO_DATA",
    "PI_EFFORTS",
    "PI_TOOL_NAMES",
    "TINY_TOKENIZER",
    "DataError",
    "EffortStyle",
    "Example",
    "GateConfig",
    "GateReport",
    "Rejection",
    "RenderConfig",
    "RenderError",
    "Session",
    "SessionMeta",
    "admit",
    "build_examples",
    "load_tokenizer",
    "pi_tools",
    "read_sessions",
    "render_session",
    "token_stats",
]

"""An isolated Pi config home per attempt (`PI_CODING_AGENT_DIR`): models.json, settings.json;
and what one `jaxpi pi run` attempt is asked (`PiRunConfig`).

Pi reads everything from its agent dir (`dist/config.js`: `PI_CODING_AGENT_DIR`, else
`~/.pi/agent`), so one fresh directory per attempt keeps attempts from seeing each other or the
user's own Pi. The provider is an `openai-completions` one whose `baseUrl` is the gateway and whose
`apiKey` is the token the gateway issued for the attempt: Pi sends it as `Authorization: Bearer
<token>`, which is how the gateway files each call under its attempt (and under no other).

Thinking levels (`pi --thinking LEVEL`) reach the server as `reasoning_effort` (pi-ai's
openai-completions provider: `params.reasoning_effort = thinkingLevelMap[level] ?? level` for
`reasoning: true` models). Pi hides `xhigh` unless the model's map names it, so the map lists every
level as itself; `off` sends no `reasoning_effort` at all.

`compat` is spelled out in full because the releases guess differently for a host they do not know
(0.73 sends the system prompt as `developer` and tools with `strict: false`; 1.x sends `system` and
no `strict`): no `developer` role, no `store`, no `strict`, `reasoning_effort` in OpenAI's form.
Both releases ignore keys they do not know, so one file serves both (docs/pi.md, "Pi 0.73 and
1.x"). Compaction and Pi's own retries are off: a compaction summary or a retried call would be a
model call that is not part of the attempt's behaviour. 0.73 also retried inside its HTTP client
unless `retry.provider.maxRetries` is 0; 1.x gives up on a response silent for 300 s
(`httpIdleTimeoutMs`), which a slow policy server must not hit: the sandbox's wall clock is the
attempt's only time limit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

PROVIDER = "jaxpi"
LEVELS = ("off", "minimal", "low", "medium", "high", "xhigh")


@dataclasses.dataclass(frozen=True)
class PiRunConfig:
    """One `jaxpi pi run`: a task, the endpoint Pi talks to, and the attempt's settings."""

    task: str  # a task directory
    endpoint: str  # OpenAI-compatible base URL, e.g. http://127.0.0.1:8001/v1 (usually the gateway)
    level: str = "medium"  # Pi thinking level (off, minimal, low, medium, high, xhigh)
    model_id: str = "policy"  # model name sent to the endpoint
    attempt_id: str | None = None  # the attempt's id, naming its outputs; None: a random one
    # the API key Pi sends: a jaxpi gateway's token for the attempt (POST /jaxpi/attempts), or the
    # server's --api-key; None: the attempt id
    api_key: str | None = dataclasses.field(default=None, repr=False)
    out: str | None = None  # output directory; None: runs/pi/<attempt id>
    wall_seconds: float = 0.0  # the whole attempt; 0 = the task's limit

    def __post_init__(self) -> None:
        errors = []
        if self.level not in LEVELS:
            errors.append(f"level: thinking level must be one of {LEVELS}, got {self.level!r}")
        if not self.endpoint:
            errors.append("endpoint must be a URL, e.g. http://127.0.0.1:8001/v1")
        if self.wall_seconds < 0:
            errors.append(f"wall_seconds must be >= 0 (0 = the task's limit), got {self.wall_seconds}")
        if errors:
            raise ValueError("; ".join(errors))


def models_json(
    base_url: str, api_key: str, model_id: str, *, context_window: int, max_tokens: int
) -> dict[str, Any]:
    """Pi's models.json for one provider serving one reasoning model (pure)."""
    if context_window < 1 or max_tokens < 1:
        raise ValueError(f"context_window and max_tokens must be >= 1, got {context_window}, {max_tokens}")
    return {
        "providers": {
            PROVIDER: {
                "baseUrl": base_url.rstrip("/"),
                "api": "openai-completions",
                "apiKey": api_key,
                "compat": {
                    "supportsDeveloperRole": False,
                    "supportsStore": False,
                    "supportsStrictMode": False,
                    "supportsReasoningEffort": True,
                    "thinkingFormat": "openai",
                    # The gateway re-streams the usage chunk; Pi's per-turn token counts come from it.
                    "supportsUsageInStreaming": True,
                    # jaxpi serve and vLLM read both names; max_tokens is the one every server knows.
                    "maxTokensField": "max_tokens",
                },
                "models": [
                    {
                        "id": model_id,
                        "name": model_id,
                        "reasoning": True,
                        "thinkingLevelMap": {lv: lv for lv in LEVELS if lv != "off"},
                        "input": ["text"],
                        "contextWindow": context_window,
                        "maxTokens": max_tokens,
                        # Zero cost keeps Pi from pricing (and printing) anything.
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                    }
                ],
            }
        }
    }


def settings_json(model_id: str, level: str) -> dict[str, Any]:
    """Pi's settings.json: our provider/model/level by default; no compaction, no retries."""
    if level not in LEVELS:
        raise ValueError(f"thinking level must be one of {LEVELS}, got {level!r}")
    return {
        "defaultProvider": PROVIDER,
        "defaultModel": model_id,
        "defaultThinkingLevel": level,
        "quietStartup": True,
        "compaction": {"enabled": False},
        "retry": {"enabled": False, "provider": {"maxRetries": 0}},
        "httpIdleTimeoutMs": "disabled",
        # 1.x: a `.pi/` directory in the workspace (settings, extensions) is never trusted.
        "defaultProjectTrust": "never",
    }


def write_pi_home(
    home: Path,
    *,
    base_url: str,
    api_key: str,
    model_id: str,
    level: str,
    context_window: int,
    max_tokens: int,
) -> Path:
    """Fill `home` (an empty directory) as Pi's agent dir; returns it."""
    home.mkdir(parents=True, exist_ok=True)
    models = models_json(base_url, api_key, model_id, context_window=context_window, max_tokens=max_tokens)
    (home / "models.json").write_text(json.dumps(models, indent=2))
    (home / "settings.json").write_text(json.dumps(settings_json(model_id, level), indent=2))
    (home / "sessions").mkdir(exist_ok=True)
    return home

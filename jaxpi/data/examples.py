"""Sessions on disk -> admitted, rendered training examples, plus the report and token statistics."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from jinja2.exceptions import TemplateError

from jaxpi.data.gates import GateConfig, GateReport, admit
from jaxpi.data.render import Example, RenderConfig, RenderError, load_tokenizer, render_session
from jaxpi.data.sessions import ReadLimits, read_sessions

# What a chat template can raise on one odd session (its own `raise_exception`, a filter applied to
# a value it did not expect, a structure nested beyond the recursion limit): that session is
# excluded with the error, the others are still rendered.
_RENDER_FAILURES = (TemplateError, TypeError, ValueError, KeyError, AttributeError, RecursionError)


def build_examples(
    paths: Iterable[str | Path],
    render_cfg: RenderConfig,
    gate_cfg: GateConfig | None = None,
    *,
    strict: bool = False,
    limits: ReadLimits | None = None,
) -> tuple[list[Example], GateReport]:
    """Read, gate, render; the token limit is applied after rendering (any example too long
    excludes its whole session, so a session is never trained on in part)."""
    gate_cfg = gate_cfg or GateConfig()
    sessions, rejections = read_sessions(paths, strict=strict, limits=limits)
    admitted, report = admit(sessions, gate_cfg, rejections)
    tok = load_tokenizer(render_cfg.tokenizer_dir)
    examples: list[Example] = []
    for s in admitted:
        try:
            rendered = render_session(s, tok, render_cfg)
        except _RENDER_FAILURES as e:  # e.g. reasoning in a turn rendered with thinking off
            detail = str(e) if isinstance(e, RenderError) else f"{s.meta.source}: {type(e).__name__}: {e}"
            where = getattr(e, "location", "") or s.meta.source
            report.exclude(s.meta.source, {"render_error": detail[:500]}, {"render_error": where})
            report.admitted -= 1
            continue
        longest = max((e.num_tokens for e in rendered), default=0)
        if gate_cfg.max_tokens is not None and longest > gate_cfg.max_tokens:
            report.exclude(s.meta.source, {"too_many_tokens": f"{longest} tokens > {gate_cfg.max_tokens}"})
            report.admitted -= 1
            continue
        examples += rendered
    return examples, report


def token_stats(examples: Iterable[Example]) -> dict:
    """Totals and per-effort counts: examples, tokens, supervised tokens, reasoning tokens."""
    keys = ("examples", "tokens", "supervised_tokens", "reasoning_tokens")
    per: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(keys, 0))
    for e in examples:
        for bucket in (per["all"], per[f"effort={e.effort}"]):
            bucket["examples"] += 1
            bucket["tokens"] += e.num_tokens
            bucket["supervised_tokens"] += e.assistant_tokens
            bucket["reasoning_tokens"] += e.reasoning_tokens
    return {k: per[k] for k in sorted(per, key=lambda k: (k != "all", k))}

"""From an attempt's recorded calls to token-exact training samples (pure functions).

Merge rule. Calls are taken in order; failed calls (`error` set) are skipped. Call k joins the
current sample when its prompt ids start with the sample's ids so far, i.e. with call k-1's
prompt + completion, token for token:

    sample   | prompt_1 ................ | completion_1 | delta_2 ......... | completion_2 |
    mask     | 0 ....................... 0 | 1 ......... 1 | 0 ............. 0 | 1 ......... 1 |
    logprobs | 0 ....................... 0 | engine lp    | 0 ............. 0 | engine lp    |

where delta_2 = prompt_2[len(sample):] (tool results, the next generation prompt). Otherwise a new
sample starts with call k's whole prompt; that boundary is a "split". Splits happen when the
client (or the template) rewrites history: an edited earlier message, reasoning the client did not
send back (templates then render an empty thinking block), a turn cut at max_tokens (its re-render
closes the block), or tokenisation that differs from what was sampled.

Reasoning tokens are those inside thinking blocks of the completions only (tags excluded), by
`count_reasoning_tokens`; whether a completion starts inside an open block is read off its prompt
(the last `<think>` after the last `</think>`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxpi.envs.agent_loop import EndReason, Trajectory
from jaxpi.envs.toolcalls import count_reasoning_tokens


@dataclasses.dataclass(frozen=True)
class Sample:
    """One token sequence of an attempt; `calls` are the merged calls' indices."""

    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int  # tokens before the first completion
    calls: tuple[int, ...]
    reasoning_tokens: int
    output_tokens: int
    effort: str | None
    finish_reason: str  # of the last merged call


@dataclasses.dataclass(frozen=True)
class AttemptSamples:
    """All samples of one attempt with the merge statistics."""

    attempt: str | None
    samples: tuple[Sample, ...]
    calls: int  # successful calls used
    failed_calls: tuple[str, ...]  # "call k: <error message>" for each failed call
    splits: int  # boundaries between successive calls that did not extend

    @property
    def boundaries(self) -> int:
        return max(self.calls - 1, 0)


def think_ids(tokenizer: Any) -> tuple[int, int]:
    """(`<think>`, `</think>`) ids of a tokenizer (-1 where absent)."""
    vocab = tokenizer.get_vocab()
    return vocab.get("<think>", -1), vocab.get("</think>", -1)


def thinking_open(prompt: Sequence[int], think_open: int, think_close: int) -> bool:
    """Whether the prompt ends inside a thinking block (the generation prompt opened one)."""
    p = list(prompt)
    last_open = len(p) - 1 - p[::-1].index(think_open) if think_open in p else -1
    last_close = len(p) - 1 - p[::-1].index(think_close) if think_close in p else -1
    return last_open > last_close


def build_samples(
    records: Iterable[Mapping[str, Any]], think_open: int, think_close: int, *, attempt: str | None = None
) -> AttemptSamples:
    """Merge an attempt's call records (as the gateway writes them) into samples."""
    samples: list[Sample] = []
    failed: list[str] = []
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    cur: dict[str, Any] = {}
    used = splits = 0

    def flush() -> None:
        if cur:
            samples.append(
                Sample(
                    ids,
                    mask,
                    lps,
                    cur["prompt_len"],
                    tuple(cur["calls"]),
                    cur["reasoning"],
                    sum(mask),
                    cur["effort"],
                    cur["finish"],
                )
            )

    for rec in sorted(records, key=lambda r: r["call"]):
        k = rec["call"]
        if rec.get("error"):
            failed.append(f"call {k}: {rec['error'].get('message', rec['error'])}")
            continue
        prompt, out, lp = (
            list(rec["prompt_token_ids"]),
            list(rec["completion_token_ids"]),
            list(rec["logprobs"]),
        )
        if len(lp) != len(out):
            raise ValueError(
                f"attempt {attempt} call {k}: {len(lp)} logprobs for {len(out)} completion tokens"
            )
        if cur and prompt[: len(ids)] == ids and len(prompt) >= len(ids):
            delta = prompt[len(ids) :]
            ids, mask, lps = ids + delta, mask + [0] * len(delta), lps + [0.0] * len(delta)
        else:
            if cur:
                splits += 1
                flush()
            ids, mask, lps = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
            cur = {
                "prompt_len": len(prompt),
                "calls": [],
                "reasoning": 0,
                "effort": rec.get("reasoning_effort"),
            }
        ids, mask, lps = ids + out, mask + [1] * len(out), lps + [float(x) for x in lp]
        cur["calls"].append(k)
        cur["reasoning"] += count_reasoning_tokens(
            out, think_open, think_close, thinking_open=thinking_open(prompt, think_open, think_close)
        )
        cur["finish"] = rec["finish_reason"]
        used += 1
    flush()
    return AttemptSamples(attempt, tuple(samples), used, tuple(failed), splits)


def split_stats(attempts: Iterable[AttemptSamples]) -> dict[str, float]:
    """How often calls failed to extend their predecessor, over many attempts."""
    attempts = list(attempts)
    boundaries = sum(a.boundaries for a in attempts)
    splits = sum(a.splits for a in attempts)
    return {
        "attempts": len(attempts),
        "calls": sum(a.calls for a in attempts),
        "samples": sum(len(a.samples) for a in attempts),
        "boundaries": boundaries,
        "splits": splits,
        "split_rate": splits / boundaries if boundaries else 0.0,
        "failed_calls": sum(len(a.failed_calls) for a in attempts),
    }


def to_trajectory(
    sample: Sample,
    task_id: str,
    level: str,
    *,
    success: bool,
    finish_reason: EndReason = "answer",
    malformed: bool = False,
    reason: str | None = None,
    final_answer: str | None = None,
    messages: Sequence[dict] = (),
    attempt_id: str | None = None,
    tool_calls: int | None = None,
) -> Trajectory:
    """The sample as the GRPO code's `Trajectory` (the verifier's outcome and the harness's tool-call
    count come from the caller)."""
    return Trajectory(
        task_id=task_id,
        level=level,
        token_ids=list(sample.token_ids),
        mask=list(sample.mask),
        logprobs=list(sample.logprobs),
        prompt_len=sample.prompt_len,
        reasoning_tokens=sample.reasoning_tokens,
        output_tokens=sample.output_tokens,
        turns=len(sample.calls),
        finish_reason=finish_reason,
        success=success,
        malformed=malformed,
        reason=reason,
        final_answer=final_answer,
        messages=tuple(messages),
        attempt_id=attempt_id,
        tool_calls=tool_calls,
    )

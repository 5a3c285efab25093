"""Deterministic demo data: small Pi v3 session files, one OpenAI-style file, a tiny tokenizer.

`tools/make_demo_data.py` calls `write_demo` to regenerate `jaxpi/assets/demo/` and
`jaxpi/assets/tiny_tokenizer/`; tests regenerate into a temp dir and compare bytes. The sessions
are synthetic coding tasks on a toy Python project (fix a bug, add a function, write a script,
explain code), each a real multi-turn Pi session with thinking, tool calls and results, across all
effort levels. Some are deliberately malformed or failed so every admission gate has a witness;
`manifest.json` records what each file is meant to be (admitted, or the reasons it is not).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxpi.atomic import atomic_dir
from jaxpi.data.gates import PI_EFFORTS
from jaxpi.data.tiny_tokenizer import ASSETS, tokenizer_files
from jaxpi.data.tools import pi_tools

_T0 = 1_795_000_000_000  # a fixed epoch (ms) so timestamps are reproducible
_MODULES = ("parser", "config", "cache", "stats", "paths", "retry", "units", "tokens", "queue", "report")
_VERBS = ("parse", "load", "merge", "count", "split", "format", "scale", "clean", "join", "check")
_NOUNS = ("line", "items", "keys", "values", "path", "name", "rows", "words", "limits", "fields")


# ---------------------------------------------------------------------------------------------
# Pi session writer


@dataclass
class _Writer:
    """Appends Pi v3 entries; `parent` is where the next entry hangs (moving it makes a branch)."""

    rng: random.Random
    lines: list[dict] = field(default_factory=list)
    parent: str | None = None
    clock: int = 0
    n_calls: int = 0

    def _id(self) -> str:
        return f"{self.rng.getrandbits(32):08x}"

    def _ts(self) -> int:
        self.clock += 1500
        return _T0 + self.clock

    def _iso(self, ms: int) -> str:
        s, ms = divmod(ms, 1000)
        import datetime as dt

        return dt.datetime.fromtimestamp(s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms:03d}Z"

    def header(self, cwd: str) -> None:
        sid = "-".join(f"{self.rng.getrandbits(b):0{b // 4}x}" for b in (32, 16, 16, 16, 48))
        self.lines.append(
            {"type": "session", "version": 3, "id": sid, "timestamp": self._iso(_T0), "cwd": cwd}
        )

    def entry(self, kind: str, **fields: Any) -> str:
        eid, ms = self._id(), self._ts()
        self.lines.append(
            {"type": kind, "id": eid, "parentId": self.parent, "timestamp": self._iso(ms), **fields}
        )
        self.parent = eid
        return eid

    def user(self, content: Any) -> str:
        return self.entry(
            "message", message={"role": "user", "content": content, "timestamp": _T0 + self.clock}
        )

    def assistant(self, blocks: list[dict], stop: str | None = None) -> str:
        if stop is None:
            stop = "toolUse" if any(b["type"] == "toolCall" for b in blocks) else "stop"
        msg = {
            "role": "assistant",
            "content": blocks,
            "api": "openai-completions",
            "provider": "vllm",
            "model": "qwen3.5-27b",
            "usage": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "totalTokens": 0},
            "stopReason": stop,
            "timestamp": _T0 + self.clock,
        }
        return self.entry("message", message=msg)

    def call(self, name: str, args: dict) -> dict:
        self.n_calls += 1
        return {
            "type": "toolCall",
            "id": f"call_{self.rng.getrandbits(24):06x}{self.n_calls}",
            "name": name,
            "arguments": args,
        }

    def result(self, call: dict, text: str, is_error: bool = False) -> str:
        msg = {
            "role": "toolResult",
            "toolCallId": call["id"],
            "toolName": call["name"],
            "content": [{"type": "text", "text": text}],
            "isError": is_error,
            "timestamp": _T0 + self.clock,
        }
        return self.entry("message", message=msg)

    def dump(self) -> str:
        return "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in self.lines)


def _think(rng: random.Random, effort: str, facts: list[str]) -> list[dict]:
    """Thinking blocks whose length grows with the effort level ('off' thinks not at all)."""
    n = {"off": 0, "minimal": 1, "low": 1, "medium": 2, "high": 3, "xhigh": 4}[effort]
    if n == 0:
        return []
    picked = [facts[i % len(facts)] for i in range(n)]
    extra = rng.choice(("Keep the change small.", "Check the tests after.", "Do not touch other files."))
    return [{"type": "thinking", "thinking": " ".join(picked) + (" " + extra if n > 1 else "")}]


# ---------------------------------------------------------------------------------------------
# Task scripts: each plays one Pi session into a writer


@dataclass
class _Task:
    mod: str
    fn: str
    noun: str
    effort: str
    task_id: str


def _code(t: _Task, buggy: bool) -> str:
    bound = "len(items) - 1" if buggy else "len(items)"
    return (
        f'"""Helpers for {t.mod}."""\n\n\n'
        f"def {t.fn}(items):\n"
        f'    """Return the {t.noun} that are not empty."""\n'
        f"    out = []\n"
        f"    for i in range({bound}):\n"
        f"        if items[i]:\n"
        f"            out.append(items[i])\n"
        f"    return out\n"
    )


def _fix_bug(w: _Writer, t: _Task, *, branch: bool = False, summary: bool = True) -> None:
    """Failing test -> read -> edit -> tests pass -> short summary."""
    path, test = f"src/{t.mod}.py", f"tests/test_{t.mod}.py"
    user = w.user(f"The test for {t.fn} in {path} fails. Please fix it.")
    think = ["The user says a test fails.", f"Run {test} first to see the error.", f"Then read {path}."]
    c1 = w.call("bash", {"command": f"python -m pytest -q {test}"})
    if branch:
        # an abandoned first attempt: a different command, then the user went back in the tree
        cx = w.call("read", {"path": path, "limit": 40})
        w.assistant(_think(w.rng, t.effort, think[2:]) + [cx])
        w.result(cx, _code(t, buggy=True))
        w.parent = user
        if summary:
            w.entry(
                "branch_summary", fromId=w.lines[-1]["id"], summary=f"Read {path} before running the tests."
            )
    w.assistant(_think(w.rng, t.effort, think) + [c1])
    w.result(
        c1,
        f"F\nFAILED {test}::test_{t.fn} - AssertionError: last {t.noun[:-1] if t.noun.endswith('s') else t.noun} is missing\n1 failed in 0.12s",
    )
    c2 = w.call("read", {"path": path})
    w.assistant(_think(w.rng, t.effort, ["The last element is dropped.", "Look at the loop bound."]) + [c2])
    w.result(c2, _code(t, buggy=True))
    c3 = w.call(
        "edit",
        {"path": path, "edits": [{"oldText": "range(len(items) - 1)", "newText": "range(len(items))"}]},
    )
    w.assistant(
        _think(w.rng, t.effort, ["The loop stops one early.", "range(len(items)) is right."])
        + [{"type": "text", "text": "The loop skips the last item; fixing the bound."}, c3]
    )
    w.result(c3, f"Successfully replaced 1 block(s) in {path}.")
    c4 = w.call("bash", {"command": f"python -m pytest -q {test}"})
    w.assistant([c4])
    w.result(c4, ".\n1 passed in 0.10s")
    w.assistant(
        _think(w.rng, t.effort, ["The test passes now."])
        + [
            {
                "type": "text",
                "text": f"Fixed {t.fn} in {path}: the loop now covers every item, and {test} passes.",
            }
        ]
    )


def _add_function(w: _Writer, t: _Task) -> None:
    """Read a module, add a helper with edit, run a quick check."""
    path, new = f"src/{t.mod}.py", f"count_{t.noun}"
    w.user(f"Add a function {new}(items) to {path} that returns how many {t.noun} are not empty.")
    c1 = w.call("read", {"path": path})
    w.assistant(_think(w.rng, t.effort, [f"I need to see {path} first.", "Match the existing style."]) + [c1])
    w.result(c1, _code(t, buggy=False))
    body = (
        f'\n\ndef {new}(items):\n    """How many {t.noun} are not empty."""\n    return len({t.fn}(items))\n'
    )
    c2 = w.call(
        "edit",
        {"path": path, "edits": [{"oldText": "    return out\n", "newText": "    return out\n" + body}]},
    )
    w.assistant(_think(w.rng, t.effort, [f"Reuse {t.fn} so the rule lives in one place."]) + [c2])
    w.result(c2, f"Successfully replaced 1 block(s) in {path}.")
    c3 = w.call(
        "bash",
        {"command": f"python -c 'from src.{t.mod} import {new}; print({new}([1, 0, 2]))'", "timeout": 30},
    )
    w.assistant([c3])
    w.result(c3, "2")
    w.assistant(
        [{"type": "text", "text": f"Added {new} to {path}; it reuses {t.fn} and returns 2 for [1, 0, 2]."}]
    )


def _write_script(w: _Writer, t: _Task) -> None:
    """Write a new script, run it, report."""
    path = f"scripts/show_{t.noun}.py"
    w.user(f"Write a small script {path} that prints each of the {t.noun} in data.txt, one per line, sorted.")
    content = (
        "import sys\n\n\n"
        "def main(path):\n"
        "    with open(path) as f:\n"
        "        rows = [line.strip() for line in f if line.strip()]\n"
        "    for row in sorted(rows):\n"
        "        print(row)\n\n\n"
        'if __name__ == "__main__":\n'
        '    main(sys.argv[1] if len(sys.argv) > 1 else "data.txt")\n'
    )
    c1 = w.call("write", {"path": path, "content": content})
    w.assistant(_think(w.rng, t.effort, ["A new file, so write is right.", "Skip blank lines."]) + [c1])
    w.result(c1, f"Successfully wrote {len(content)} bytes to {path}")
    c2 = w.call("bash", {"command": f"printf 'b\\na\\n\\nc\\n' > /tmp/d.txt && python {path} /tmp/d.txt"})
    w.assistant([c2])
    w.result(c2, "a\nb\nc")
    w.assistant(
        [
            {
                "type": "text",
                "text": f"Created {path}. It skips blank lines and prints the rest sorted (a, b, c on a test file).",
            }
        ]
    )


def _explain(w: _Writer, t: _Task) -> None:
    """Read-only question: grep, read, answer."""
    path = f"src/{t.mod}.py"
    w.user(f"What does {t.fn} in {path} do? Do not change anything.")
    c1 = w.call("bash", {"command": f"grep -n 'def {t.fn}' -r src"})
    w.assistant(_think(w.rng, t.effort, ["Only explain, no edits.", "Find the function first."]) + [c1])
    w.result(c1, f"{path}:4:def {t.fn}(items):")
    c2 = w.call("read", {"path": path, "offset": 1, "limit": 20})
    w.assistant([c2])
    w.result(c2, _code(t, buggy=False))
    w.assistant(
        _think(w.rng, t.effort, ["It filters falsy items and keeps order."])
        + [
            {
                "type": "text",
                "text": f"{t.fn} walks the list and returns the {t.noun} that are truthy, in their original order.",
            }
        ]
    )


def _follow_up(w: _Writer, t: _Task) -> None:
    """A second user message after the first task is done (reasoning of earlier turns gets dropped)."""
    path = f"src/{t.mod}.py"
    w.user(f"Thanks. Now add a docstring example to {t.fn}.")
    old = f'    """Return the {t.noun} that are not empty."""\n'
    new = (
        f'    """Return the {t.noun} that are not empty.\n\n    >>> {t.fn}([1, 0, 2])\n    [1, 2]\n    """\n'
    )
    c1 = w.call("edit", {"path": path, "edits": [{"oldText": old, "newText": new}]})
    w.assistant(_think(w.rng, t.effort, ["A doctest shows the behaviour best."]) + [c1])
    w.result(c1, f"Successfully replaced 1 block(s) in {path}.")
    c2 = w.call("bash", {"command": f"python -m doctest -v {path} | tail -n 1"})
    w.assistant([c2])
    w.result(c2, "Test passed.")
    w.assistant([{"type": "text", "text": f"Added a doctest to {t.fn}; it passes."}])


_TASKS: tuple[Callable[..., None], ...] = (_fix_bug, _add_function, _write_script, _explain)


# ---------------------------------------------------------------------------------------------
# The demo set: (file name, writer script, expected outcome)


def _session(rng: random.Random, i: int, variant: str) -> tuple[str, str, dict[str, str] | None, dict]:
    """One Pi session file: (text, sidecar JSON or None, expected outcome)."""
    mod = _MODULES[i % len(_MODULES)]
    verb, noun = _VERBS[(i * 3) % len(_VERBS)], _NOUNS[(i * 7) % len(_NOUNS)]
    effort = PI_EFFORTS[i % len(PI_EFFORTS)]
    t = _Task(mod=mod, fn=f"{verb}_{noun}", noun=noun, effort=effort, task_id=f"demo-{i:03d}")
    w = _Writer(rng)
    w.header(f"/home/dev/{mod}-project")
    w.entry("model_change", provider="vllm", modelId="qwen3.5-27b")
    w.entry("thinking_level_change", thinkingLevel=effort)
    if variant == "branch":  # an abandoned attempt, with a branch summary in all but the last
        _fix_bug(w, t, branch=True, summary=i < 20)
    else:
        _TASKS[i % len(_TASKS)](w, t)
    reasons: list[str] = []
    verified: bool | None = True
    sidecar = None
    if variant == "follow_up":
        _follow_up(w, t)
    elif variant == "compaction":
        first_kept = w.user("Before you finish: list the files you touched.")
        w.assistant([{"type": "text", "text": f"I only touched src/{mod}.py and ran its tests."}])
        w.entry(
            "compaction",
            summary=f"The user asked for work on src/{mod}.py ({t.fn}); it is done and tested.",
            firstKeptEntryId=first_kept,
            tokensBefore=4200,
        )
        w.user("One more check: is the work tree clean?")
        c = w.call("bash", {"command": "git status --short"})
        w.assistant([c])
        w.result(c, f" M src/{mod}.py")
        w.assistant([{"type": "text", "text": f"Only src/{mod}.py is modified, as expected."}])
    elif variant == "custom_message":
        w.entry(
            "custom_message", customType="reminder", content="Reminder: keep answers short.", display=True
        )
        w.user("Anything else to do?")
        w.assistant([{"type": "text", "text": "No, the task is complete."}])
    elif variant == "failed":
        verified = False
        reasons.append("verifier_failed")
    elif variant == "unverified":
        verified = None
        reasons.append("verifier_unknown")
    elif variant == "unknown_tool":
        w.user("Also search for TODOs.")
        c = w.call("grep", {"pattern": "TODO"})
        w.assistant([c])
        w.result(c, "Tool grep not found", is_error=True)
        w.assistant([{"type": "text", "text": "There is no grep tool; I will stop here."}])
        reasons.append("unknown_tool")
    elif variant == "bad_arguments":
        w.user("Show me the README.")
        c = w.call("read", {"file": "README.md"})
        w.assistant([c])
        w.result(c, "Validation failed for tool read: path is required", is_error=True)
        w.assistant([{"type": "text", "text": "The read call failed."}])
        reasons.append("bad_arguments")
    elif variant == "call_without_result":
        w.user("Run the whole test suite.")
        c = w.call("bash", {"command": "python -m pytest -q"})
        w.assistant([c])
        w.assistant([{"type": "text", "text": "All tests pass."}])
        reasons.append("call_without_result")
    elif variant == "image":
        w.user(
            [
                {"type": "text", "text": "What is in this screenshot?"},
                {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
            ]
        )
        w.assistant([{"type": "text", "text": "A terminal."}])
        reasons.append("image_content")
    elif variant == "ends_with_user":
        w.user("Wait, one more thing.")
        reasons.append("not_ending_with_assistant")
    elif variant == "sidecar":
        sidecar = {"task_id": t.task_id, "verified": True, "effort": effort}
    if variant != "sidecar" and verified is not None:
        w.entry(
            "custom",
            customType="jaxpi.attempt",
            data={"task_id": t.task_id, "verified": verified, "effort": effort},
        )
    if variant != "sidecar":
        w.entry("label", targetId=w.lines[2]["id"], label="start")
    text = w.dump()
    if variant == "truncated":
        last = text.rstrip("\n").rsplit("\n", 1)
        text = last[0] + "\n" + last[1][: len(last[1]) // 2] + "\n"
        reasons = ["invalid_json"]
    expected = {
        "variant": variant,
        "effort": effort,
        "task_id": t.task_id,
        "admitted": not reasons,
        "reasons": reasons,
    }
    return text, (json.dumps(sidecar, indent=2) + "\n" if sidecar else None), expected


_VARIANTS: tuple[str, ...] = (
    ("plain",) * 3
    + ("branch", "follow_up", "plain", "compaction", "plain", "follow_up", "branch", "custom_message")
    + ("plain",) * 4
    + ("failed", "unverified", "unknown_tool", "bad_arguments", "call_without_result", "image")
    + ("truncated", "ends_with_user", "sidecar", "follow_up", "branch", "failed")
    + ("plain",) * 8
)


def _openai_records(rng: random.Random) -> list[dict]:
    """A few OpenAI-style records (a system prompt, reasoning_content, JSON-string arguments)."""
    out = []
    for k in range(4):
        mod, noun = _MODULES[(k * 3 + 1) % len(_MODULES)], _NOUNS[(k * 5 + 2) % len(_NOUNS)]
        effort = ("low", "medium", "high", "off")[k]
        call = {
            "id": f"call_oa{k}",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": f"wc -l src/{mod}.py"})},
        }
        asst1: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        asst2: dict[str, Any] = {
            "role": "assistant",
            "content": f"src/{mod}.py has {10 + rng.randrange(90)} lines of {noun} helpers.",
        }
        if effort != "off":
            asst1["reasoning_content"] = f"Count the lines of src/{mod}.py with wc."
            asst2["reasoning_content"] = "wc printed the count; report it."
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a careful coding agent."},
                    {"role": "user", "content": f"How long is src/{mod}.py?"},
                    asst1,
                    {"role": "tool", "tool_call_id": f"call_oa{k}", "content": f"{10 + k} src/{mod}.py"},
                    asst2,
                ],
                "tools": pi_tools(),
                "meta": {"task_id": f"oa-{k}", "verified": True, "effort": effort},
            }
        )
    return out


def demo_files(seed: int = 0) -> dict[str, str]:
    """Relative path (under assets/demo) -> file text, for every demo file including the manifest."""
    rng = random.Random(seed)
    files: dict[str, str] = {}
    manifest: dict[str, dict] = {}
    for i, variant in enumerate(_VARIANTS):
        text, sidecar, expected = _session(rng, i, variant)
        name = f"sessions/{i:03d}_{variant}.jsonl"
        files[name] = text
        if sidecar:
            files[name + ".meta.json"] = sidecar
        manifest[name] = expected
    records = _openai_records(rng)
    files["openai/records.jsonl"] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    for k, r in enumerate(records, start=1):
        manifest[f"openai/records.jsonl:{k}"] = {
            "variant": "openai",
            "effort": r["meta"]["effort"],
            "task_id": r["meta"]["task_id"],
            "admitted": True,
            "reasons": [],
        }
    files["manifest.json"] = json.dumps(manifest, indent=2) + "\n"
    return files


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Replace directory `root` with exactly `files`, atomically (`jaxpi.atomic.atomic_dir`)."""
    with atomic_dir(root, overwrite=True) as tmp:
        for rel, text in files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")


def write_demo(assets: Path = ASSETS, seed: int = 0) -> dict[str, Path]:
    """Regenerate `assets/demo/` and `assets/tiny_tokenizer/`; returns the two directories."""
    files = demo_files(seed)
    write_tree(assets / "demo", files)
    write_tree(assets / "tiny_tokenizer", tokenizer_files(files))
    return {"demo": assets / "demo", "tokenizer": assets / "tiny_tokenizer"}

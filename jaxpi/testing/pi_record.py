"""Record real Pi sessions against `jaxpi serve`, for each Pi release, as small test fixtures.

    python tools/record_pi_sessions.py --out tests/fixtures/pi_sessions          # 1.6.0 and 0.73.1

Per release: Pi is installed into a prefix of its own; a tiny checkpoint (the bundled tokenizer and
chat template) is served behind the recording gateway; one sandboxed attempt at a one-line shell
task records Pi's real request (its system prompt, the bash tool's schema, the user's message).
The checkpoint's LM head is then solved to replay a two-turn script on exactly that request
(`jaxpi.testing.scripted`: reasoning and a `bash` call, the tool's result, reasoning and an
answer), and a second attempt runs Pi against the scripted model at temperature 0: Pi issues the
call, it runs in the sandbox, the verifier passes. What that attempt left is the fixture:

    <out>/<version>/session.jsonl   Pi's session file (and the runner's .meta.json sidecar beside it)
    <out>/<version>/events.jsonl    Pi's `--mode json` stream
    <out>/<version>/calls.json      the gateway's records: each call's request, prompt and
                                    completion token ids, finish reason, effort
    <out>/<version>/record.json     the runner's attempt record (without the calls)
    <out>/<version>/meta.json       the release, Node, date, task, level, tokenizer

so that tests can check, without Pi, that a session file of each release reads into the very
token ids the model was given and produced.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path
from typing import Any

from jaxpi.atomic import atomic_dir
from jaxpi.config import TINY
from jaxpi.convert.tiny import make_checkpoint
from jaxpi.gateway import gateway_in_front
from jaxpi.runner.attempt import RunnerConfig, run_attempt
from jaxpi.runner.install import NODE_VERSION, find_pi, pi_setup
from jaxpi.serve import ServeConfig, start_server
from jaxpi.serve.loading import Loaded
from jaxpi.tasks.task import load_task
from jaxpi.testing.scripted import scripted_model

LEVEL = "low"
INSTRUCTION = "Create a file named hello.txt that contains the word hello."
COMMAND = "echo hello > hello.txt"
MAX_LEN = 4096
# hidden >= the tokens the script supervises (fit_head solves the head exactly on them)
CFG = TINY.replace(hidden_size=256, intermediate_size=512)


def write_task(root: Path, *, max_tokens: int = 1024) -> Path:
    """A one-line shell task: its instruction, limits (`max_tokens` sampled tokens per attempt),
    verifier and oracle."""
    d = root / "hello-file"
    (d / "tests").mkdir(parents=True, exist_ok=True)
    (d / "solution").mkdir(exist_ok=True)
    (d / "instruction.md").write_text(INSTRUCTION + "\n")
    (d / "task.toml").write_text(
        '[metadata]\nid = "hello-file"\ncategory = "shell"\ndifficulty = "easy"\n\n'
        f"[limits]\nwall_seconds = 120\nmax_turns = 4\nmax_tokens = {max_tokens}\n\n[verifier]\ntimeout = 20\n"
    )
    (d / "tests" / "test.sh").write_text('#!/bin/bash\n[ "$(cat hello.txt 2>/dev/null)" = hello ]\n')
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{COMMAND}\n")
    return d


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def script_from(request: dict) -> tuple[list[dict], list[dict]]:
    """(messages, tools): the two-turn script on Pi's own system prompt, user message and tools."""
    system, user = (_text(m["content"]) for m in request["messages"][:2])
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "bash", "arguments": {"command": COMMAND}},
    }
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Write the file with bash.",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "(no output)"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "The file is written."},
    ]
    return messages, list(request["tools"])


def _attempt(model: Any, ckpt: Path, task: Any, attempt_id: str, out: Path, pi: Any, max_new: int) -> Any:
    cfg = ServeConfig(
        model=str(ckpt), served_name="policy", port=0, max_len=MAX_LEN, max_new_tokens=max_new, max_batch=1
    )
    server = start_server(cfg, loaded=Loaded(model, ckpt, ckpt, ()) if model is not None else None)
    try:
        with gateway_in_front(server.url) as (url, trace, key, _):
            runner = RunnerConfig(
                tools=("bash",),
                temperature=0.0,
                seed=0,
                context_window=MAX_LEN,
                max_tokens_per_call=max_new,
                jobs=1,
            )
            return run_attempt(
                task, LEVEL, url, attempt_id, out_dir=out, cfg=runner, trace=trace, key=key, pi=pi
            )
    finally:
        server.close()


def record(version: str, out: str | Path, workdir: str | Path) -> dict[str, Any]:
    """Record release `version`'s fixture into `out/<version>/` (atomically); returns its meta."""
    work = Path(workdir)
    prefix = work / f"pi-{version}"
    pi_setup(prefix, version=version)
    pi = find_pi(prefix)
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        make_checkpoint(ckpt, CFG, seed=2, tokenizer=True)
    task = load_task(write_task(work / "tasks"))
    probe = _attempt(None, ckpt, task, f"probe-{version}", work / f"probe-{version}", pi, 4)
    if not probe.calls:
        raise RuntimeError(f"Pi {version} made no model call: {probe.reason} {probe.detail}")
    messages, tools = script_from(probe.calls[0]["request"])
    model, _ = scripted_model(ckpt, messages, tools, LEVEL)
    runs = work / f"run-{version}"
    shutil.rmtree(runs, ignore_errors=True)
    rec = _attempt(model, ckpt, task, f"fixture-{version}", runs, pi, 256)
    if not (rec.admitted and rec.success and len(rec.calls) == 2):
        raise RuntimeError(f"Pi {version}: the scripted attempt did not replay the script: {rec.to_json()}")
    keep = ("request", "reasoning_effort", "prompt_token_ids", "completion_token_ids", "finish_reason")
    meta = {
        "pi": {"package": pi.release.package, "version": version},
        "node": NODE_VERSION,
        "recorded": datetime.date.today().isoformat(),
        "task": task.id,
        "level": LEVEL,
        "tokenizer": "jaxpi/assets/tiny_tokenizer (the checkpoint's own copy)",
        "served": {"max_len": MAX_LEN, "max_new_tokens": 256},
        "command": "python tools/record_pi_sessions.py",
    }
    with atomic_dir(Path(out) / version, overwrite=True) as tmp:
        shutil.copyfile(runs / "session.jsonl", tmp / "session.jsonl")
        shutil.copyfile(runs / "session.jsonl.meta.json", tmp / "session.jsonl.meta.json")
        shutil.copyfile(runs / "events.jsonl", tmp / "events.jsonl")
        calls = [{k: c[k] for k in keep} for c in rec.calls]
        (tmp / "calls.json").write_text(json.dumps(calls, indent=1) + "\n")
        brief = {
            k: v
            for k, v in dataclasses.asdict(rec).items()
            if k not in ("calls", "session_path", "events_path")
        }
        (tmp / "record.json").write_text(json.dumps(brief, indent=2) + "\n")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta

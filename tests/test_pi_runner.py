"""Real Pi sessions as rollouts, end to end with the real Pi CLI (installed by `make pi`).

The chain under test, all real: a tiny Qwen3.5 (toy-random base) served by `jaxpi serve` behind the
recording gateway; Pi 0.73.1 in the sandbox with an isolated config home; the task's verifier.

1. `jaxpi eval` on the untrained model at low effort (the command starts serve + gateway): the
   table, results.json, the PNG and a paired comparison; Pi's real request is recorded by the
   gateway (system prompt, the bash tool's schema, `reasoning_effort: low`, filed under the attempt
   by the token the gateway issued for it); the attempt ends at the per-call cap and fails the
   verifier (an admitted failure).
2. LoRA SFT (30 steps) on one scripted session built from that very request (Pi's system prompt
   + the bash tool, a `bash` call that solves the task, Pi's "(no output)" tool result, a final
   answer): the prompt is ~1.5k tokens with the tiny tokenizer (1626 with both turns), so
   2048-token rows hold the session whole.
3. `jaxpi grpo`'s loop (`run_grpo`) with `env.name: pi`: the trainer's JaxEngine on the SFT
   policy, served by `PiCollector` behind the gateway; the attempt runs greedily: Pi issues the
   bash call, it executes in the sandbox, the verifier passes, the trainer records the attempt and
   makes its update; the gateway's token-exact trajectory has mask 0 on the prompt and the tool
   result.
4. A GRPO update (the trainer's loss and train step) over the group {SFT success, untrained
   failure} moves the adapters (the trainer's own update above had a group of one: advantage 0).

Pi's tool set is restricted to bash (`--tools bash`): Pi's four default tools make a 3.2k-token
prompt, which would double the SFT's cost; the prompt is otherwise Pi's own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from jaxpi.runner.install import PI_VERSION, find_pi
from jaxpi.runner.pi_config import LEVELS, models_json, settings_json
from jaxpi.runner.record import AttemptRecord, read_session_summary
from jaxpi.sandbox import bwrap_path
from jaxpi.testing import pi_record


def _pi_installed() -> bool:
    try:
        find_pi()
    except FileNotFoundError:
        return False
    return True


needs_pi = pytest.mark.skipif(
    bwrap_path() is None or not _pi_installed(), reason="needs bubblewrap and Pi (`make pi`)"
)

LEVEL = "low"
MAX_LEN = 2048
INSTRUCTION, COMMAND = pi_record.INSTRUCTION, pi_record.COMMAND
# Enough steps that greedy decoding reproduces the session whatever the prompt's length: Pi's
# system prompt names its install path, so the prompt's tokens depend on the checkout's path (a
# clone under /tmp/tmp.*/ made it 1573 tokens, /work/main 1534); at 30 steps one such clone
# ended at loss 0.015 and decoded a corrupted command.
SFT_STEPS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_task(root: Path) -> Path:
    return pi_record.write_task(root, max_tokens=512)


# ---- pure parts -------------------------------------------------------------------------------------


def test_models_json_points_pi_at_the_gateway_with_the_attempt_key():
    m = models_json("http://127.0.0.1:9/v1/", "att-1", "policy", context_window=2048, max_tokens=64)
    prov = m["providers"]["jaxpi"]
    assert prov["baseUrl"] == "http://127.0.0.1:9/v1" and prov["apiKey"] == "att-1"
    assert prov["api"] == "openai-completions" and prov["compat"]["supportsDeveloperRole"] is False
    model = prov["models"][0]
    assert model["reasoning"] is True and model["contextWindow"] == 2048 and model["maxTokens"] == 64
    # xhigh only exists for Pi when the map names it; off sends no reasoning_effort at all.
    assert model["thinkingLevelMap"]["xhigh"] == "xhigh" and "off" not in model["thinkingLevelMap"]
    s = settings_json("policy", "xhigh")
    assert s["defaultThinkingLevel"] == "xhigh" and s["compaction"]["enabled"] is False
    assert s["retry"]["enabled"] is False
    with pytest.raises(ValueError, match="thinking level"):
        settings_json("policy", "max")
    with pytest.raises(ValueError, match="context_window"):
        models_json("http://h:1", "k", "m", context_window=0, max_tokens=1)
    assert LEVELS == ("off", "minimal", "low", "medium", "high", "xhigh")


def test_session_summary_reads_turns_and_names_bad_lines(tmp_path):
    good = tmp_path / "s.jsonl"
    lines = [
        {"type": "session", "version": 3, "id": "x", "cwd": "/workspace"},
        {"type": "message", "id": "1", "parentId": None, "message": {"role": "user", "content": "hi"}},
        {
            "type": "message",
            "id": "2",
            "parentId": "1",
            "message": {
                "role": "assistant",
                "content": [{"type": "toolCall", "id": "c", "name": "bash", "arguments": {"command": "ls"}}],
                "usage": {"output": 7},
                "stopReason": "toolUse",
            },
        },
        {
            "type": "message",
            "id": "3",
            "parentId": "2",
            "message": {"role": "toolResult", "toolCallId": "c", "content": [{"type": "text", "text": "x"}]},
        },
        {
            "type": "message",
            "id": "4",
            "parentId": "3",
            "message": {
                "role": "assistant",
                "content": [{"type": "text", "text": "Done."}],
                "usage": {"output": 3},
                "stopReason": "stop",
            },
        },
        {
            "type": "custom",
            "id": "5",
            "parentId": "4",
            "customType": "jaxpi.limit",
            "data": {"reason": "max_turns"},
        },
    ]
    good.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    s = read_session_summary(good)
    assert (s.turns, s.output_tokens, s.tool_calls, s.final_text, s.limit) == (2, 10, 1, "Done.", "max_turns")
    assert s.error is None and s.last_stop == "stop"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: undecodable"):
        read_session_summary(bad)
    with pytest.raises(ValueError, match="admitted with finish"):
        AttemptRecord("a", "t", "low", True, False, None, None, 0, 0, 0, 0.0)
    with pytest.raises(ValueError, match="must be admitted"):
        AttemptRecord("a", "t", "low", False, True, "timeout", None, 0, 0, 0, 0.0)


def test_session_summary_counts_tool_calls_by_tool(tmp_path):
    def turn(i: int, *names: str) -> dict:
        blocks = [
            {"type": "toolCall", "id": f"c{i}{j}", "name": n, "arguments": {}} for j, n in enumerate(names)
        ]
        msg = {"role": "assistant", "content": blocks, "usage": {"output": 1}, "stopReason": "toolUse"}
        return {"type": "message", "id": str(i), "parentId": None, "message": msg}

    session = tmp_path / "s.jsonl"
    entries = [
        {"type": "session", "version": 3, "id": "x", "cwd": "/w"},
        turn(1, "bash", "read"),
        turn(2, "bash"),
    ]
    session.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    s = read_session_summary(session)
    assert s.tool_calls_by_name == {"bash": 2, "read": 1} and s.tool_calls == 3 and s.turns == 2
    # The record keeps them by tool, with the model calls; its JSON builds the record again.
    rec = AttemptRecord(
        "a", "t", "low", True, True, None, "answer", 2, 2, 0, 1.0,
        tool_calls=s.tool_calls_by_name, model_calls=2,
    )  # fmt: skip
    d = json.loads(json.dumps(rec.to_json()))
    assert (d["tool_calls"], d["model_calls"]) == ({"bash": 2, "read": 1}, 2)
    assert AttemptRecord(**d) == rec
    # A record written before the counts existed still loads: nothing counted, no model call known.
    old = {k: v for k, v in d.items() if k not in ("tool_calls", "model_calls")}
    assert (AttemptRecord(**old).tool_calls, AttemptRecord(**old).model_calls) == ({}, 0)


def test_attempt_files_get_the_umasks_permissions(tmp_path, monkeypatch):
    """record.json is written with the mode `open(..., "w")` would give it (0o666 less the umask),
    not mkstemp's 0600, so another user (a trainer, a reviewer) can read the attempts."""
    import os

    from jaxpi.runner import attempt

    rec = AttemptRecord("a", "t", LEVEL, False, False, "timeout", None, 0, 0, 0, 0.0)
    monkeypatch.setattr(attempt, "_run", lambda *a: rec)  # Pi itself is not needed for the write
    old = os.umask(0o022)
    try:
        attempt.run_attempt(None, LEVEL, "http://127.0.0.1:1/v1", "a", out_dir=tmp_path, pi=object())
    finally:
        os.umask(old)
    assert (tmp_path / "record.json").stat().st_mode & 0o777 == 0o644
    assert json.loads((tmp_path / "record.json").read_text())["reason"] == "timeout"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]  # no temporary left


@needs_pi
def test_pi_setup_is_idempotent():
    from jaxpi.runner.install import pi_setup

    pi_setup()  # installs only if the stamp is missing (`make pi` normally wrote it)
    info = pi_setup()
    assert info["installed"] is False and info["version"] == PI_VERSION
    pi = find_pi()
    assert pi.cli_js.is_file() and pi.version == PI_VERSION


# ---- Pi in the sandbox, no model needed ---------------------------------------------------------------


@needs_pi
def test_unreachable_endpoint_and_wall_limit_are_not_admitted(tmp_path):
    from jaxpi.runner.attempt import RunnerConfig, run_attempt
    from jaxpi.tasks.task import load_task

    task = load_task(write_task(tmp_path))
    # Nothing listens there: the sandbox relays the port, the connection is refused, Pi records an error.
    rec = run_attempt(
        task, LEVEL, f"http://127.0.0.1:{free_port()}/v1", "att-down", out_dir=tmp_path / "down"
    )
    assert not rec.admitted and rec.reason == "upstream_error" and "Connection" in rec.detail
    assert rec.verifier_returncode is None  # a not-admitted attempt is not scored
    saved = json.loads((tmp_path / "down" / "record.json").read_text())
    assert saved["reason"] == "upstream_error" and saved["session_path"].endswith("session.jsonl")
    # A wall clock too short for node to even start Pi: the sandbox is killed, the attempt timed out.
    rec = run_attempt(
        task,
        LEVEL,
        f"http://127.0.0.1:{free_port()}/v1",
        "att-slow",
        out_dir=tmp_path / "slow",
        cfg=RunnerConfig(wall_seconds=0.2),
    )
    assert not rec.admitted and rec.reason == "timeout"


# ---- the end-to-end chain -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pi-e2e")


@pytest.fixture(scope="module")
def task(workdir):
    from jaxpi.tasks.task import load_task

    return load_task(write_task(workdir / "tasks"))


@pytest.fixture(scope="module")
def base(workdir):
    from jaxpi.experiments.toy.bases import make_toy_base

    # Two layers, the second full attention: the turn after the tool result must see the result.
    return make_toy_base(workdir / "base", seed=0, layers=2, attention_every=2)


def runner_cfg(**kw):
    from jaxpi.runner.attempt import RunnerConfig

    return RunnerConfig(tools=("bash",), temperature=0.0, seed=0, context_window=MAX_LEN, jobs=1, **kw)


@pytest.fixture(scope="module")
def evaluated(workdir, task, base):
    """`jaxpi eval` on the untrained model (it starts serve + gateway itself), compared with a saved
    evaluation in which the task passed: (the command's JSON report, its output directory)."""
    from jaxpi.cli import main
    from jaxpi.eval.run import results_object, save_results

    oracle = {"attempt_id": "o", "task_id": task.id, "level": LEVEL, "admitted": True, "success": True}
    oracle |= {"reason": None, "finish": "answer", "turns": 2, "output_tokens": 40, "reasoning_tokens": 0}
    save_results(
        results_object([{**oracle, "wall_seconds": 1.0}], [LEVEL], name="oracle", meta={}), workdir / "oracle"
    )
    out = workdir / "eval"
    argv = ["eval", "--model", str(base), "--tasks", str(task.path), "--levels", LEVEL, "--attempts", "1"]
    argv += ["--max-len", str(MAX_LEN), "--max-new-tokens", "8", "--tools", "bash", "--temperature", "0"]
    argv += ["--jobs", "1", "--out", str(out), "--compare", str(workdir / "oracle"), "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue()), out


@pytest.fixture(scope="module")
def untrained(evaluated):
    """The untrained model's attempt, with the gateway's records of its calls."""
    _, out = evaluated
    (r,) = json.loads((out / "results.json").read_text())["records"]
    d = json.loads((out / "attempts" / r["attempt_id"] / "record.json").read_text())
    return AttemptRecord(**{**d, "calls": tuple(d["calls"])})


@needs_pi
def test_jaxpi_eval_writes_the_table_json_png_and_comparison(evaluated):
    report, out = evaluated
    low = report["table"][LEVEL]
    # The untrained model answers 8 tokens of noise: an admitted attempt that fails its verifier.
    assert (low["attempts"], low["admitted"], low["successes"]) == (1, 1, 0)
    assert low["pass_rate"]["value"] == 0.0 and low["pass_rate"]["hi"] > 0.5  # Wilson at 0/1
    assert low["output_tokens"] == 8 and low["turns"] == 1 and low["wall_seconds"] > 0
    assert (low["tool_calls"], low["tool_calls_by_tool"], low["model_calls"]) == (0.0, {}, 1.0)
    (r,) = json.loads((out / "results.json").read_text())["records"]
    assert r["task_id"] == "hello-file" and r["verifier_returncode"] != 0 and r["reason"] is None
    assert Path(r["session_path"]).is_file() and (out / "frontier.png").stat().st_size > 1000
    assert (out / "table.txt").read_text().splitlines()[0].startswith("base: 1 attempts")
    # Paired with the saved evaluation where the task passed: -1 on the one shared task.
    assert report["compare"]["differences"][LEVEL]["value"] == -1.0 and (out / "compare.png").is_file()


@needs_pi
def test_untrained_attempt_records_pis_real_request(untrained):
    rec = untrained
    # Ran to an end the model is answerable for (cut at the 8-token cap) and failed the verifier.
    assert rec.admitted and not rec.success and rec.finish == "length" and rec.verifier_returncode != 0
    assert rec.turns == 1 and len(rec.calls) == 1 and rec.output_tokens == 8
    call = rec.calls[0]
    # Filed under the attempt whose token Pi sent as its API key; the effort arrived as reasoning_effort.
    assert call["attempt"] == rec.attempt_id and call["reasoning_effort"] == LEVEL
    req = call["request"]
    assert [t["function"]["name"] for t in req["tools"]] == ["bash"]
    # Pi's system prompt names the working directory (1.x in a <cwd> section of its own).
    cwd = (
        "<cwd>\n/workspace\n</cwd>"
        if find_pi().version.startswith("1.")
        else "Current working directory: /workspace"
    )
    assert req["messages"][0]["role"] == "system" and cwd in req["messages"][0]["content"]
    assert req["temperature"] == 0.0 and req["seed"] == 0  # set by the runner's Pi extension
    assert len(call["prompt_token_ids"]) > 1000  # Pi's system prompt and tool schema, rendered
    assert read_session_summary(Path(rec.session_path)).turns == 1


@pytest.fixture(scope="module")
def sft_ckpt(workdir, base, untrained):
    """LoRA SFT of the base on one scripted session built from Pi's recorded request."""
    from jaxpi.configfile import load_config
    from jaxpi.sft import SFTConfig, run_sft

    req = untrained.calls[0]["request"]

    def text(content):
        return content if isinstance(content, str) else "".join(p["text"] for p in content)

    system, user = (text(m["content"]) for m in req["messages"][:2])
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "bash", "arguments": {"command": COMMAND}},
    }
    record = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
            {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "(no output)"},
            {"role": "assistant", "content": "Done.", "reasoning_content": ""},
        ],
        "tools": req["tools"],
        "meta": {"effort": LEVEL, "verified": True, "task_id": "hello-file"},
    }
    data = workdir / "sft.jsonl"
    data.write_text(json.dumps(record) + "\n")
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        SFTConfig,
        root / "configs" / "sft" / "tiny.yaml",
        [
            f"model.base={base}",
            f"data.sessions=[{data}]",
            f"data.seq_len={MAX_LEN}",
            "data.batch_size=1",
            "data.val_fraction=0.0",
            "data.shuffle=false",
            "optim.lr=2e-2",
            "optim.warmup_steps=2",
            f"train.steps={SFT_STEPS}",
            "train.eval_every=0",
            f"train.checkpoint_every={SFT_STEPS}",
            f"output.dir={workdir / 'sft'}",
            "output.loggers=[]",
        ],
    )
    summary = run_sft(cfg, progress=False, out=sys.stderr)
    assert summary["final_loss"] < 0.01, summary  # the session is memorised (measured 0.002)
    return Path(summary["checkpoint"])


def pi_grpo_overrides(workdir: Path, sft_ckpt: Path, out: Path) -> dict:
    """`jaxpi grpo` on the test's task with `env.name: pi`: one collection of one greedy attempt."""
    overrides = {
        "model": {"adapter": str(sft_ckpt), "dtype": "float32"},
        "env": {"name": "pi", "tasks_dir": str(workdir / "tasks")},
        # the TwIL-8B-pi card's tool-efficiency bonus rides along (a group of one success: bonus 0)
        "reward": {"kind": "binary", "levels": [LEVEL], "tool_bonus": 0.1},
        "collect": {
            "tasks": 1,
            "group": 1,
            "temperature": 0.0,
            "max_turns": 4,
            "max_tokens": 512,
            "max_new_tokens": 96,
            "max_context": MAX_LEN,
            "row_bucket": 256,
            "engine_batch": 1,
        },
        "train": {"collections": 1, "eval_group": 0, "checkpoint_every": 1},
        "output": {"dir": str(out), "loggers": []},
    }
    return overrides


def run_pi_grpo(cfg, task, attempts_dir: Path) -> dict:
    """`run_grpo` with the registry's Pi entry swapped for one whose runner allows Pi only the
    bash tool (the short prompt the tiny model was fit on) on this module's task."""
    from jaxpi.rl.envs import register_env
    from jaxpi.rl.fleet.pi import make_fleet_pi_collector
    from jaxpi.rl.pi_env import PiCollector, PiEnv, make_pi_env
    from jaxpi.rl.trainer import run_grpo

    make = lambda _: (PiEnv(str(attempts_dir), runner_cfg()), [task], [])  # noqa: E731
    register_env("pi", make, PiCollector, make_fleet_pi_collector)
    try:
        return run_grpo(cfg, progress=False, out=sys.stderr)
    finally:
        register_env("pi", make_pi_env, PiCollector, make_fleet_pi_collector)


@pytest.fixture(scope="module")
def collected(workdir, task, sft_ckpt):
    """`jaxpi grpo`'s loop (`run_grpo`, one collection + one update) with `env.name: pi`: the trainer
    builds its JaxEngine on the SFT policy and hands it to `PiCollector` through its environment
    registry. The task pool is this module's task directory; the registry entry is swapped for one
    whose runner config allows Pi only the bash tool (the short prompt the tiny model was fit on)."""
    import jax

    from jaxpi.configfile import from_dict
    from jaxpi.data.render import load_tokenizer
    from jaxpi.gateway import build_samples, split_stats, think_ids
    from jaxpi.rl.config import GRPOConfig
    from jaxpi.rl.pi_env import attempt_trajectory
    from jaxpi.rl.policy import load_policy

    overrides = pi_grpo_overrides(workdir, sft_ckpt, workdir / "grpo")
    cfg = from_dict(GRPOConfig, overrides)
    attempts_dir = workdir / "collect"
    summary = run_pi_grpo(cfg, task, attempts_dir)
    pol = load_policy(cfg, workdir / "grpo", jax.random.key(0))
    tok = load_tokenizer(pol.tokenizer_dir)
    recs = []
    for f in sorted(attempts_dir.glob("collection-*/*/record.json")):
        d = json.loads(f.read_text())
        recs.append(AttemptRecord(**{**d, "calls": tuple(d["calls"])}))
    trajs = [attempt_trajectory(r, r.calls, think_ids(tok)) for r in recs]
    stats = split_stats([build_samples(r.calls, *think_ids(tok), attempt=r.attempt_id) for r in recs])
    return types.SimpleNamespace(
        pol=pol, cfg=cfg, tok=tok, trajs=trajs, recs=recs, stats=stats, summary=summary
    )


@needs_pi
def test_the_trainer_collected_and_updated_through_env_pi(collected, workdir):
    last = collected.summary["last"]
    assert last["attempts"] == 1 and last["admitted"] == 1 and np.isfinite(last["loss"])
    assert last[f"level/{LEVEL}/pass_rate"] == 1.0
    lines = [json.loads(x) for x in (workdir / "grpo" / "attempts.jsonl").read_text().splitlines()]
    assert [(a["task_id"], a["success"], a["admitted"]) for a in lines] == [("hello-file", True, True)]
    assert collected.summary["checkpoint"].endswith("/1")


@needs_pi
def test_pi_solves_the_task_with_a_real_tool_call(collected):
    rec, traj, stats = collected.recs[0], collected.trajs[0], collected.stats
    detail = Path(rec.events_path).parent
    assert rec.admitted and rec.success, (rec, (detail / "pi_stderr.txt").read_text()[-2000:])
    assert rec.finish == "answer" and rec.turns == 2 and rec.verifier_returncode == 0
    # The bash call ran inside the sandbox: Pi's session holds the call and its result.
    entries = [json.loads(x) for x in Path(rec.session_path).read_text().splitlines()]
    msgs = [e["message"] for e in entries if e["type"] == "message"]
    calls = [b for m in msgs if m["role"] == "assistant" for b in m["content"] if b["type"] == "toolCall"]
    assert [(c["name"], c["arguments"]["command"]) for c in calls] == [("bash", COMMAND)]
    results = [m for m in msgs if m["role"] == "toolResult"]
    assert len(results) == 1 and not results[0].get("isError")
    assert "exit 0" in (detail / "verifier.txt").read_text()
    # One token-exact sample: the second call's prompt extends the first call's prompt + completion.
    assert stats["samples"] == 1 and stats["splits"] == 0 and traj.admitted and traj.success
    # The record counts what Pi ran by tool, and the gateway's two call records; GRPO carries the total.
    assert rec.tool_calls == {"bash": 1} and rec.model_calls == 2 and traj.tool_calls == 1
    assert rec.pi == f"@earendil-works/pi-coding-agent@{PI_VERSION}" and rec.settings["temperature"] == 0.0
    # The verifier's outcome lies beside the session, so the attempt directory is SFT data as it is.
    sidecar = json.loads((detail / "session.jsonl.meta.json").read_text())
    assert sidecar == {"task_id": "hello-file", "verified": True, "effort": LEVEL}


@needs_pi
def test_trajectory_masks_exclude_the_prompt_and_tool_results(collected):
    tok, recs = collected.tok, collected.recs
    t, calls = collected.trajs[0], recs[0].calls
    ids, mask, lp = np.array(t.token_ids), np.array(t.mask), np.array(t.logprobs)
    assert len(ids) == len(mask) == len(lp) and t.prompt_len == len(calls[0]["prompt_token_ids"])
    # Sampled tokens are exactly the two completions, in order; everything else is masked out.
    sampled = [x for c in calls for x in c["completion_token_ids"]]
    assert ids[mask == 1].tolist() == sampled and mask[: t.prompt_len].sum() == 0
    assert t.output_tokens == int(mask.sum()) == recs[0].output_tokens
    # The observation between the turns (tool result + next generation prompt) is all mask 0.
    first_end = t.prompt_len + len(calls[0]["completion_token_ids"])
    second_prompt = calls[1]["prompt_token_ids"]
    obs = slice(first_end, len(second_prompt))
    assert ids[: len(second_prompt)].tolist() == second_prompt
    assert mask[obs].sum() == 0 and "(no output)" in tok.decode(ids[obs].tolist())
    # Log-probs are the engine's under the mask (greedy decoding: each near 0, none positive) and 0 elsewhere.
    assert np.all(lp[mask == 0] == 0.0) and np.all(lp[mask == 1] <= 0.0)
    assert "bash" in tok.decode(ids[t.prompt_len : first_end].tolist())


@needs_pi
def test_one_grpo_update_consumes_the_attempt(collected, untrained):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpi.gateway import think_ids
    from jaxpi.lora import LoRAParam
    from jaxpi.rl.batch import bucket_length, trajectory_batch
    from jaxpi.rl.loss import make_grpo_loss_fn, sequence_logprobs, trajectory_weights
    from jaxpi.rl.pi_env import attempt_trajectory
    from jaxpi.rl.reward import score_collection
    from jaxpi.train.schedule import make_optimizer
    from jaxpi.train.step import make_train_step, split_trainable

    pol, cfg, tok, trajs = collected.pol, collected.cfg, collected.tok, collected.trajs
    # The group: the SFT policy's success and the untrained policy's failure on the same task and level.
    failure = attempt_trajectory(untrained, untrained.calls, think_ids(tok))
    group = [trajs[0], failure]
    assert failure.admitted and not failure.success
    score = score_collection([t.to_attempt() for t in group], cfg.reward)
    assert score.advantages[0] > 0 > score.advantages[1]
    length = bucket_length(max(len(t.token_ids) for t in group), cfg.collect.row_bucket, MAX_LEN)
    batch = {k: jnp.asarray(v) for k, v in trajectory_batch(group, score.advantages, length=length).items()}
    # Jitted as the trainer does: the log-probs of the sampling policy, then one update.
    logp = jax.jit(lambda train, rest, ids: sequence_logprobs(nnx.merge(pol.graphdef, train, rest), ids))
    batch["logp_old"] = logp(pol.train, pol.rest, batch["input_ids"])
    optimizer = make_optimizer(cfg.optim, 1)
    step = make_train_step(
        pol.graphdef,
        optimizer,
        loss_fn=make_grpo_loss_fn(cfg.loss),
        trainable=LoRAParam,
        weight_fn=trajectory_weights,
    )

    @jax.jit
    def update(train, rest, opt_state, batch):
        params, _, metrics = step(nnx.merge_state(train, rest), opt_state, batch)
        return split_trainable(params, LoRAParam)[0], metrics

    before = jax.tree.map(np.asarray, pol.train)
    after, m = update(pol.train, pol.rest, optimizer.init(pol.train), batch)
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(b) - a).max()), before, after))
    assert max(moved) > 0


@needs_pi
def test_grpo_env_pi_is_registered_with_the_trainer():
    from jaxpi.rl.envs import env_entry
    from jaxpi.rl.pi_env import PiCollector, make_pi_env

    entry = env_entry("pi")
    assert entry.make is make_pi_env and entry.collector is PiCollector


# ---- the same collection on a Ray fleet -------------------------------------------------------------


def _attempt_workers() -> list[tuple[int, float]]:
    """(pid, start time in clock ticks) of Ray workers running a Pi attempt (ray::remote_attempt)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "cmdline").read_bytes().startswith(b"ray::remote_attempt"):
                out.append((int(d.name), float((d / "stat").read_text().split()[21])))
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def fleet_collected(workdir, task, sft_ckpt, collected):
    """The collection of `collected` with `collect.backend=ray` (a Ray cluster the run starts on
    this machine): the attempt runs as a Ray task, and the worker running it is SIGKILLed a second
    into the attempt; the fleet runs it again under a new id."""
    import threading

    pytest.importorskip("ray")
    from jaxpi.configfile import from_dict
    from jaxpi.rl.config import GRPOConfig

    overrides = pi_grpo_overrides(workdir, sft_ckpt, workdir / "grpo-fleet")
    overrides["collect"] |= {"backend": "ray", "ray_workers": 1}
    cfg = from_dict(GRPOConfig, overrides)
    killed: list[int] = []
    done = threading.Event()

    def kill_first_attempt() -> None:
        while not done.is_set() and not killed:
            found = _attempt_workers()
            if found:
                time.sleep(1.0)  # the worker is in its attempt: the sandbox up, Pi starting
                os.kill(found[0][0], signal.SIGKILL)
                killed.append(found[0][0])
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_first_attempt, daemon=True)
    watcher.start()
    try:
        summary = run_pi_grpo(cfg, task, workdir / "collect-fleet")
    finally:
        done.set()
        watcher.join(timeout=10)
    return types.SimpleNamespace(summary=summary, killed=killed, out=workdir / "grpo-fleet")


@needs_pi
def test_pi_attempt_on_the_fleet_survives_its_worker_and_trains_the_same(fleet_collected, collected, workdir):
    """Run again after its worker died, the Ray attempt is the local one (greedy, the same policy):
    the same outcome, tokens and reward, and the same update; the lost try's calls stay its own."""
    assert fleet_collected.killed, "no Pi attempt was running on the fleet to be killed"
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    local, fleet = read(workdir / "grpo" / "attempts.jsonl"), read(fleet_collected.out / "attempts.jsonl")
    assert [a["attempt_id"] for a in fleet] == [local[0]["attempt_id"] + ".r1"]
    assert [{**a, "attempt_id": ""} for a in fleet] == [{**a, "attempt_id": ""} for a in local]
    m_local, m_fleet = (
        read(workdir / "grpo" / "metrics.jsonl")[-1],
        read(fleet_collected.out / "metrics.jsonl")[-1],
    )
    for key in ("loss", "grad_norm", "logp_diff_max", "admitted", "scored", f"level/{LEVEL}/pass_rate"):
        assert m_fleet[key] == m_local[key], key
    assert m_fleet["fleet/retries"] == 1 and m_fleet["fleet/lost_attempts"] == 0
    # The attempt's files came back from the worker; its record holds the gateway's two calls.
    (d,) = [p.parent for p in (workdir / "collect-fleet").glob("collection-*/*/record.json")]
    assert (
        d.name.endswith(".r1")
        and (d / "session.jsonl").is_file()
        and (d / "session.jsonl.meta.json").is_file()
    )
    rec = json.loads((d / "record.json").read_text())
    assert rec["success"] and len(rec["calls"]) == 2 and rec["tool_calls"] == {"bash": 1}

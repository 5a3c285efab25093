"""Toy SFT sessions for the LookupEnv: token layout through the real agent loop, verifier, masks,
per-level reasoning lengths, the `toy_lookup` SFT source, the toy base's scaled LM head, and the
copy pre-training of the "toy-copy" base (a few steps here; the learned copy in a slow test)."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_agent_loop import spans  # the supervised runs of a mask, as the agent-loop tests read them

from jaxpi.config import QwenConfig
from jaxpi.configfile import load_config
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.data.tiny_tokenizer import ASSETS
from jaxpi.envs import LookupEnv, make_tasks
from jaxpi.experiments.toy import bases
from jaxpi.experiments.toy.bases import (
    CopyPretrainConfig,
    answer_positions,
    make_copy_base,
    make_toy_base,
    pretrain_copy,
)
from jaxpi.experiments.toy.evaluate import evaluate_toy, load_run, summarize
from jaxpi.experiments.toy.sessions import (
    ToySFTConfig,
    pick_phrases,
    script,
    toy_config,
    toy_sessions,
    toy_trajectories,
)
from jaxpi.sft import DataConfig, SFTConfig, run_sft

TOK_DIR = ASSETS / "tiny_tokenizer"
CONFIG = "configs/sft/toy.yaml"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(TOK_DIR))


@pytest.fixture(scope="module")
def trajs(tok):
    return toy_trajectories(45, 5, tok, render_cfg=RenderConfig(TOK_DIR))


def test_sessions_are_deterministic(tok):
    a, b = toy_sessions(9, 3, tok), toy_sessions(9, 3, tok)
    c = toy_sessions(9, 4, tok)
    assert [e["session_id"] for e in a] == [f"value-3-{i}" for i in range(9)]
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(
            x["loss_mask"], y["loss_mask"]
        )
        assert x["input_ids"].dtype == np.int32 and x["loss_mask"].shape == x["input_ids"].shape
    assert any(not np.array_equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c, strict=True))
    assert [e["level"] for e in a] == ["low", "medium", "xhigh"] * 3


def test_sessions_pass_the_verifier_and_masks_cover_exactly_the_turns(tok, trajs):
    env = LookupEnv()
    tasks = {t.task_id: t for t in make_tasks(45, 5, keys_per_task=0, max_value=10)}
    assert len({task.payload["table"]["value"] for task in tasks.values()}) == 10  # values 0-9
    for t in trajs:
        task = tasks[t.task_id]
        value = task.payload["table"]["value"]
        assert (t.finish_reason, t.success, t.turns, t.malformed) == ("answer", True, 2, False)
        # the verifier, run again on the answer decoded from the session's own tokens
        assert env.verify(env.reset(task, 0), t.final_answer) and t.final_answer == str(value)
        assert not env.verify(env.reset(task, 0), str(value + 1))
        # mask: 0 on the prompt and the observation, 1 exactly on the two scripted turns
        (a1, b1), (a2, b2) = spans(t.mask)
        assert a1 == t.prompt_len and t.mask[: t.prompt_len] == [0] * t.prompt_len and b2 == len(t.token_ids)
        dec = lambda a, b, ids=t.token_ids: tok.decode(ids[a:b], skip_special_tokens=False)  # noqa: E731
        first, second = dec(a1, b1), dec(a2, b2)
        # an unkeyed task: get() without an argument, nothing copied from the instruction
        assert first.endswith("</think>\n\n<tool_call>\n<function=get>\n</function>\n</tool_call><|im_end|>")
        assert first.startswith("need the value.") and second == f"got it.\n</think>\n\n{value}<|im_end|>"
        assert dec(b1, a2) == (
            f"\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
        )
        assert dec(0, a1).endswith("What is the value?<|im_end|>\n<|im_start|>assistant\n<think>\n")
        assert f"Reasoning effort: {t.level}." in dec(0, a1)
        # the same ids a fresh render of the finished conversation gives (template-consistent)
        full = tok.apply_chat_template(
            list(t.messages), tools=list(task.tools), tokenize=False, enable_thinking=True
        )
        assert t.token_ids == tok(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]


def test_keyed_sessions_copy_the_key_into_the_call(tok):
    cfg = ToySFTConfig(keys_per_task=3, max_value=100)
    tasks = make_tasks(6, 2, keys_per_task=3, max_value=100)
    for t, task in zip(toy_trajectories(6, 2, tok, cfg=cfg), tasks, strict=True):
        key = task.payload["target"]
        (a1, b1), _ = spans(t.mask)
        first = tok.decode(t.token_ids[a1:b1], skip_special_tokens=False)
        assert t.success and t.task_id == task.task_id and first.count(f"({key})") >= 1
        assert first.endswith(f"<parameter=key>\n{key}\n</parameter>\n</function>\n</tool_call><|im_end|>")


def test_unkeyed_env_ignores_arguments_and_keyed_env_still_resolves_keys():
    env = LookupEnv()
    (task,) = make_tasks(1, 0, keys_per_task=0, max_value=10)
    state = env.reset(task, 0)
    assert (
        task.instruction == "What is the value?" and task.tools[0]["function"]["parameters"]["required"] == []
    )
    value = task.payload["table"]["value"]
    assert env.run_tool(state, "get", {}) == str(value) == env.run_tool(state, "get", {"key": "zz"})
    assert env.run_tool(state, "put", {}).startswith("error") and env.answer(state) == value
    (keyed,) = make_tasks(1, 0)
    ks = env.reset(keyed, 0)
    assert env.run_tool(ks, "get", {"key": "zz"}) == "error: no key zz"
    assert env.run_tool(ks, "get", {"key": keyed.payload["target"]}) == str(env.answer(ks))
    with pytest.raises(ValueError, match="keys_per_task >= 0"):
        make_tasks(1, 0, keys_per_task=-1)


def test_reasoning_lengths_follow_the_levels(tok, trajs):
    cfg = ToySFTConfig()
    by_level = {lv: [t.reasoning_tokens for t in trajs if t.level == lv] for lv in cfg.levels}
    for lv, values in by_level.items():
        lo, hi = cfg.reasoning[lv]
        assert len(values) == 15 and all(lo <= v <= hi for v in values), (lv, values)
        assert len(set(values)) > 1  # spread within a level
    # on average low reasons longer than medium (over 100 sessions a level: low's spread is wide)
    many = toy_trajectories(300, 6, tok)
    mean = {lv: np.mean([t.reasoning_tokens for t in many if t.level == lv]) for lv in cfg.levels}
    assert mean["low"] > 1.1 * mean["medium"] and mean["xhigh"] > mean["low"], mean
    # low spreads on both sides of medium: the room below it that effort-ordered GRPO can reach
    assert min(by_level["low"]) < min(by_level["medium"]) and max(by_level["low"]) > max(by_level["medium"])
    # the examples carry the agent loop's count
    ex = toy_sessions(6, 5, tok)
    assert [e["reasoning_tokens"] for e in ex] == [t.reasoning_tokens for t in trajs[:6]]
    # custom ranges move the lengths; a range no phrase count fits is refused
    short = ToySFTConfig(levels=("low",), reasoning={"low": (12, 20)})
    assert all(12 <= e["reasoning_tokens"] <= 20 for e in toy_sessions(6, 1, tok, cfg=short))
    with pytest.raises(ValueError, match="no phrase count"):
        pick_phrases(tok, None, (2, 3), np.random.default_rng(0))


def test_config_validation():
    with pytest.raises(ValueError, match="no reasoning range"):
        ToySFTConfig(levels=("low", "high"))
    with pytest.raises(ValueError, match="lo <= hi"):
        ToySFTConfig(reasoning={"low": (9, 3), "medium": (1, 2), "xhigh": (1, 2)})
    with pytest.raises(ValueError, match="toy_reasoning"):
        DataConfig(source="toy_lookup", toy_reasoning=(1, 2, 3))
    with pytest.raises(ValueError, match="toy_lookup"):
        DataConfig(source="toy")
    d = DataConfig(source="toy_lookup", toy_levels=("low", "medium"), toy_reasoning=(30, 40, 10, 20))
    assert dict(toy_config(d).reasoning) == {"low": (30, 40), "medium": (10, 20)}


def test_summarize_scripted_sessions(trajs):
    s = summarize(trajs, ("low", "medium", "xhigh"))
    for lv in ("low", "medium", "xhigh"):
        r = s["levels"][lv]
        want = np.mean([t.reasoning_tokens for t in trajs if t.level == lv])
        assert r["attempts"] == 15 and r["pass_rate"] == 1.0 and r["malformed"] == 0.0
        assert r["reasoning_mean"] == pytest.approx(want) and r["finish"] == {"answer": 15}
        assert r["mixed_groups"] == 0.0  # every group all successes: nothing for GRPO to learn
    assert s["T_L/T_M"] == pytest.approx(
        s["levels"]["low"]["reasoning_mean"] / s["levels"]["medium"]["reasoning_mean"]
    )
    assert s["T_M/T_H"] < 1.0


def test_script_text():
    first, second = script("ka", 7, 2)
    assert first.startswith("key (ka). find (ka).\n</think>\n\n<tool_call>")
    assert second == "got it.\n</think>\n\n7<|im_end|>"
    first, _ = script(None, 7, 2)
    assert first.startswith("need the value. call get.\n</think>\n\n<tool_call>\n<function=get>\n</function>")


def test_toy_base_scales_head_attention_gains_and_decay(tmp_path):
    from safetensors.numpy import load_file

    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import make_checkpoint

    base = make_toy_base(tmp_path / "base", seed=3, layers=4, attention_every=2, head_scale=4.0, qk_gain=2.0)
    types = ("linear_attention", "full_attention") * 2
    plain = make_checkpoint(tmp_path / "plain", TINY.replace(num_hidden_layers=4, layer_types=types), seed=3)
    assert QwenConfig.from_hf(base).layer_types == types
    a, b = load_file(base / "model.safetensors"), load_file(plain / "model.safetensors")
    assert sorted(a) == sorted(b)
    gains = [n for n in a if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(gains) == 4
    for name in a:
        want = b[name]
        if name == "lm_head.weight":
            want = b[name] * np.float32(4.0)
        elif name in gains:
            want = np.float32(2.0) * (1.0 + b[name]) - 1.0
        elif name.endswith("A_log"):  # slow DeltaNet decay: exp(A_log) in the default (0.002, 0.05)
            assert np.all((np.exp(a[name]) >= 0.002 - 1e-6) & (np.exp(a[name]) <= 0.05 + 1e-6)), name
            assert np.all(np.exp(b[name]) >= 0.5 - 1e-6), name
            continue
        np.testing.assert_allclose(a[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    # written atomically: nothing but the two checkpoints is left beside them
    assert (base / "tokenizer.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "base",
        "plain",
    ]
    with pytest.raises(ValueError, match="attention_every"):
        make_toy_base(tmp_path / "bad", attention_every=0)


def test_sft_on_toy_lookup_then_evaluate(tmp_path):
    base = make_toy_base(tmp_path / "base", layers=2)
    cfg = load_config(
        SFTConfig,
        CONFIG,
        [
            f"model.base={base}",
            "model.tiny_layers=2",
            "data.toy_examples=8",
            "data.batch_size=2",
            "train.steps=2",
            "train.eval_every=0",
            "train.checkpoint_every=2",
            f"output.dir={tmp_path / 'run'}",
            "output.loggers=[]",
        ],
    )
    assert cfg.data.source == "toy_lookup" and cfg.data.seq_len >= 512
    summary = run_sft(cfg, progress=False, out=open(tmp_path / "log.txt", "w"))  # noqa: SIM115
    assert summary["checkpoint"] and np.isfinite(summary["final_loss"])
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["source"] == "toy_lookup" and report["train_examples"] + report["val_examples"] == 8
    assert report["examples"]["truncated"] == 0 and report["reasoning"]["low"] == [17, 68]

    model, tok, render_cfg = load_run(tmp_path / "run")
    out = evaluate_toy(
        model,
        tok,
        make_tasks(1, seed=99, keys_per_task=0, max_value=10),
        ["low", "medium"],
        2,
        seed=0,
        render_cfg=render_cfg,
        max_new_tokens=8,
        max_turns=2,
        max_context=400,
    )
    for lv in ("low", "medium"):
        r = out["levels"][lv]
        assert r["attempts"] == 2 and 0.0 <= r["pass_rate"] <= 1.0
        assert sum(r["finish"].values()) == 2 and r["reasoning_max"] <= 16
    assert out["settings"]["max_new_tokens"] == 8


def test_copy_pretrain_config_and_answer_positions(tok):
    with pytest.raises(ValueError, match="examples >= batch"):
        CopyPretrainConfig(batch=8, examples=4)
    with pytest.raises(ValueError, match="warmup"):
        CopyPretrainConfig(steps=5, warmup=5)
    with pytest.raises(ValueError, match="lo <= hi"):
        CopyPretrainConfig(reasoning=(9, 3))
    ex = toy_sessions(6, 2, tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    pos = answer_positions(ex, end)
    tasks = make_tasks(6, 2, keys_per_task=0, max_value=10)
    for e, p, task in zip(ex, pos, tasks, strict=True):
        value = task.payload["table"][task.payload["target"]]
        assert tok.decode(e["input_ids"][p : p + 2], skip_special_tokens=False).endswith(f"{value}<|im_end|>")
        assert e["loss_mask"][p] == 1 and p + 1 == len(e["input_ids"]) - 1
    with pytest.raises(ValueError, match="no supervised end of turn"):
        answer_positions([{**ex[0], "loss_mask": np.zeros_like(ex[0]["loss_mask"])}], end)


def test_copy_pretraining_trains_every_weight_and_writes_a_checkpoint(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from jaxpi.convert.hf import load_hf

    random = make_toy_base(tmp_path / "random", layers=2, attention_every=2)
    cfg = CopyPretrainConfig(steps=3, batch=2, warmup=1, examples=4, reasoning=(12, 20), max_value=10)
    lines = []
    out = pretrain_copy(random, tmp_path / "copy", cfg, say=lines.append)
    report = json.loads((out / "pretrain.json").read_text())
    assert len(report["losses"]) == 3 and all(np.isfinite(report["losses"]))
    assert 0.0 <= report["val_answer_accuracy"] <= 1.0 and np.isfinite(report["val_loss"])
    assert lines and lines[-1].startswith("toy base pre-training  step 3/3")
    a, b = load_file(random / "model.safetensors"), load_file(next(out.glob("*.safetensors")))
    assert sorted(a) == sorted(b)
    # full-parameter training: the embedding, the head and the layers all move
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert np.max(np.abs(a[name] - b[name])) > 1e-5, name
    assert (out / "tokenizer.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "copy",
        "random",
    ]
    cfg_out, _ = load_hf(out, "float32")
    assert cfg_out.num_hidden_layers == 2
    # make_copy_base = make_toy_base + pretrain_copy (the training just checked; here a copy, so
    # nothing compiles twice), with the random base removed afterwards
    seen = []

    def copy_only(random_dir, out_dir, cfg, *, say=None):
        seen.append((QwenConfig.from_hf(random_dir).num_hidden_layers, cfg))
        shutil.copytree(random_dir, out_dir)
        return Path(out_dir)

    monkeypatch.setattr(bases, "pretrain_copy", copy_only)
    base = make_copy_base(tmp_path / "base", seed=1, layers=2, cfg=cfg)
    assert seen == [(2, dataclasses.replace(cfg, seed=1))] and (base / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "copy", "random"]


@pytest.mark.slow
def test_copy_pretraining_learns_the_copy(tmp_path):
    """The default pre-training (~3-6 min on 2 cores): the answer is the copied number on held-out
    sessions with values 0-9, where a guess is right 1 time in 10."""
    base = make_copy_base(tmp_path / "base", seed=0, layers=4)
    report = json.loads((base / "pretrain.json").read_text())
    assert report["val_answer_accuracy"] >= 0.9, report["val_answer_accuracy"]
    assert report["losses"][-1] < 0.5 * report["losses"][0]

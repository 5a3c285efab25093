"""Rendering with the chat template and the assistant-only loss mask, on every demo session."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jaxpi.data import (
    DEMO_DATA,
    TINY_TOKENIZER,
    RenderConfig,
    RenderError,
    load_tokenizer,
    read_sessions,
    render_session,
)
from jaxpi.data.render import conversation
from jaxpi.data.tiny_tokenizer import ASSETS, SPECIAL_TOKENS, VOCAB_SIZE, tokenizer_files
from jaxpi.testing.demo_data import demo_files, write_demo

CFG = RenderConfig(TINY_TOKENIZER)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY_TOKENIZER)


@pytest.fixture(scope="module")
def rendered(tok):
    """Every demo session the reader accepts (gates not applied: malformed ones render too)."""
    sessions, _ = read_sessions([DEMO_DATA])
    assert len(sessions) >= 30
    return [(s, render_session(s, tok, CFG)) for s in sessions]


def _thinking_on(session, cfg: RenderConfig = CFG) -> bool:
    return conversation(session, cfg)[2].get("enable_thinking", True) is not False


def _expected_own(m: dict, thinking: bool) -> str:
    """What the tiny template makes of one assistant message, written out independently."""
    content, calls = m.get("content") or "", ""
    for j, c in enumerate(m.get("tool_calls", [])):
        sep = ("\n\n" if content else "") if j == 0 else "\n"
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
            for k, v in c["function"]["arguments"].items()
        )
        calls += f"{sep}<tool_call>\n<function={c['function']['name']}>\n{params}</function>\n</tool_call>"
    head = (m.get("reasoning_content", "") + "\n</think>\n\n") if thinking else ""
    return head + content + calls + "<|im_end|>"


def _runs(mask: np.ndarray, value: int) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.r_[0, (mask == value).astype(int), 0]))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_masked_in_spans_are_exactly_the_assistant_turns(tok, rendered):
    checked = 0
    for s, examples in rendered:
        assistants = [m for m in s.messages if m["role"] == "assistant"]
        spans = [(e, sp) for e in examples for sp in e.spans]
        assert len(spans) == len(assistants), s.meta.source
        thinking = _thinking_on(s)
        for (e, (a, b)), m in zip(spans, assistants, strict=True):
            assert tok.decode(e.input_ids[a:b].tolist()) == _expected_own(m, thinking), s.meta.source
            checked += 1
        for e in examples:
            assert e.input_ids.dtype == np.int32 and e.loss_mask.dtype == np.int32
            assert e.input_ids.shape == e.loss_mask.shape and set(np.unique(e.loss_mask)) <= {0, 1}
            assert int(e.input_ids.max()) < VOCAB_SIZE and int(e.input_ids.min()) >= 0
            assert _runs(e.loss_mask, 1) == list(e.spans)  # mask 1 exactly on the turns, nowhere else
            assert e.assistant_tokens == int(e.loss_mask.sum())
    assert checked > 150


def test_masked_out_text_holds_no_supervised_text(tok, rendered):
    gen_on, gen_off = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for s, examples in rendered:
        thinking = _thinking_on(s)
        assistants = iter(m for m in s.messages if m["role"] == "assistant")
        for e in examples:
            out = [tok.decode(e.input_ids[a:b].tolist()) for a, b in _runs(e.loss_mask, 0)]
            # every masked-out run ends with the generation prompt (which the model did not produce)
            for text in out[: len(e.spans)]:
                assert text.endswith(gen_on if thinking else gen_off), (s.meta.source, text[-40:])
            masked_out = "".join(out)
            for _ in e.spans:
                m = next(assistants)
                own = _expected_own(m, thinking)[: -len("<|im_end|>")]
                assert own not in masked_out, s.meta.source
                if m.get("reasoning_content"):
                    assert m["reasoning_content"] not in masked_out
            # the tokens after the last turn are not trained on: an example ends at its last <|im_end|>
            assert e.loss_mask[-1] == 1


def test_reasoning_token_counts(tok, rendered):
    think_end = tok.convert_tokens_to_ids("</think>")
    for s, examples in rendered:
        assistants = iter(m for m in s.messages if m["role"] == "assistant")
        for e in examples:
            total = 0
            for a, b in e.spans:
                m, ids = next(assistants), e.input_ids[a:b].tolist()
                if not _thinking_on(s):
                    assert think_end not in ids
                    continue
                n = ids.index(think_end)
                assert tok.decode(ids[:n]) == m.get("reasoning_content", "") + "\n"
                total += n
            assert e.reasoning_tokens == total
    efforts = {s.meta.effort: sum(e.reasoning_tokens for e in ex) for s, ex in rendered if s.meta.effort}
    assert efforts["off"] == 0 and efforts["xhigh"] > 0


def test_several_user_messages_give_several_examples(tok, rendered):
    multi = {s.meta.source.rsplit("/", 1)[-1]: (s, ex) for s, ex in rendered}
    for name in ("004_follow_up.jsonl", "008_follow_up.jsonl", "024_follow_up.jsonl", "006_compaction.jsonl"):
        s, examples = multi[name]
        assert len(examples) == 2, name
        second = examples[1]
        a0 = second.spans[0][0]
        prompt = tok.decode(second.input_ids[:a0].tolist())
        earlier = [m for m in s.messages if m["role"] == "assistant"][: len(examples[0].spans)]
        for m in earlier:  # the earlier turns appear in the prompt, stripped of their reasoning
            if m.get("reasoning_content"):
                assert m["reasoning_content"] not in prompt
            if m.get("content"):
                assert m["content"] in prompt
        assert second.loss_mask[:a0].sum() == 0
        if _thinking_on(s):
            assert second.reasoning_tokens > 0  # the supervised turns keep their reasoning
    single = [ex for s, ex in rendered if sum(m["role"] == "user" for m in s.messages) == 1]
    assert single and all(len(ex) == 1 for ex in single)


def test_agrees_with_apply_chat_template_on_the_whole_conversation(tok, rendered):
    for s, examples in rendered:
        msgs, tools, kwargs, _ = conversation(s, CFG)
        ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        k = 0
        for e in examples:
            k += len(e.spans)
            upto = ends[k - 1] + 1  # through this example's last supervised turn
            ref = tok.apply_chat_template(msgs[:upto], tools=tools, tokenize=False, **kwargs)
            assert tok.decode(e.input_ids.tolist()) + "\n" == ref, s.meta.source
        if examples and msgs[-1]["role"] == "assistant":
            full = tok.apply_chat_template(msgs, tools=tools, tokenize=False, **kwargs)
            assert tok.decode(examples[-1].input_ids.tolist()) + "\n" == full


def test_effort_mapping_changes_system_and_kwargs(tok, rendered):
    by_effort = {s.meta.effort: s for s, _ in rendered if s.meta.effort}
    msgs, tools, kwargs, effort = conversation(by_effort["high"], CFG)
    assert effort == "high" and kwargs == {"enable_thinking": True}
    assert msgs[0]["role"] == "system" and msgs[0]["content"].endswith("\n\nReasoning effort: high.")
    assert [t["function"]["name"] for t in tools] == ["read", "bash", "edit", "write"]
    msgs, _, kwargs, _ = conversation(by_effort["off"], CFG)
    assert kwargs == {"enable_thinking": False} and "Reasoning effort" not in msgs[0]["content"]

    custom = RenderConfig(
        TINY_TOKENIZER,
        efforts={
            "low": {"template_kwargs": {"enable_thinking": True}, "system": "Be brief."},
            "off": {"template_kwargs": {"enable_thinking": False}},
        },
        default_effort="low",
    )
    s = by_effort["high"]  # not in the custom mapping: falls back to default_effort
    e = render_session(s, tok, custom)[0]
    text = tok.decode(e.input_ids.tolist())
    assert "Be brief." in text and "Reasoning effort" not in text
    assert "# Tools" in text and '"name": "edit"' in text
    a = e.spans[0][0]
    assert tok.decode(e.input_ids[:a].tolist()).endswith("<think>\n")
    off = render_session(by_effort["off"], tok, custom)[0]
    a = off.spans[0][0]
    assert tok.decode(off.input_ids[:a].tolist()).endswith("<think>\n\n</think>\n\n")
    assert off.reasoning_tokens == 0
    # reasoning in a session rendered with thinking off is not what the model could have produced
    no_think = RenderConfig(
        TINY_TOKENIZER,
        efforts={"high": {"template_kwargs": {"enable_thinking": False}}},
        default_effort="high",
    )
    with pytest.raises(RenderError, match="changes its prompt"):
        render_session(s, tok, no_think)
    with pytest.raises(ValueError, match="default_effort"):
        RenderConfig(TINY_TOKENIZER, default_effort="max")


def test_session_system_prompt_is_kept(tok):
    sessions, _ = read_sessions([DEMO_DATA / "openai" / "records.jsonl"])
    msgs = conversation(sessions[0], CFG)[0]
    assert msgs[0]["content"] == "You are a careful coding agent.\n\nReasoning effort: low."
    no_keep = RenderConfig(TINY_TOKENIZER, keep_session_system=False)
    assert conversation(sessions[0], no_keep)[0][0]["content"].startswith(
        "You are an expert coding assistant"
    )


def test_template_that_keeps_reasoning_gives_one_example(tok, rendered):
    """The mask logic does not depend on the template: with one that never drops reasoning, a
    session with a follow-up question is one prefix-consistent example."""
    import copy

    keep = copy.copy(tok)
    keep.chat_template = tok.chat_template.replace("loop.index0 > ns.last_query", "true")
    assert keep.chat_template != tok.chat_template
    s = next(s for s, _ in rendered if s.meta.source.endswith("004_follow_up.jsonl"))
    (e,) = render_session(s, keep, CFG)
    assistants = [m for m in s.messages if m["role"] == "assistant"]
    assert len(e.spans) == len(assistants)
    for (a, b), m in zip(e.spans, assistants, strict=True):
        assert keep.decode(e.input_ids[a:b].tolist()) == _expected_own(m, _thinking_on(s))


def test_example_is_a_mapping(rendered):
    e = rendered[0][1][0]
    assert set(dict(e)) == {"input_ids", "loss_mask"} and "input_ids" in e and e["loss_mask"] is e.loss_mask
    assert e.num_tokens == e.input_ids.shape[0] and e.source == rendered[0][0].meta.source


def test_tokenizer_files(tok):
    assert len(tok) == VOCAB_SIZE and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    cfg = json.loads((TINY_TOKENIZER / "tokenizer_config.json").read_text())
    assert "<tool_call>" in cfg["chat_template"]
    text = "def f(x):\n    return x  # ünïcode\n<|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < VOCAB_SIZE


def test_fixtures_are_reproducible(tmp_path):
    files = demo_files()
    assert len([f for f in files if f.startswith("sessions/") and f.endswith(".jsonl")]) >= 30
    write_demo(tmp_path)
    for sub in ("demo", "tiny_tokenizer"):
        ours = sorted(p.relative_to(tmp_path / sub) for p in (tmp_path / sub).rglob("*") if p.is_file())
        committed = sorted(p.relative_to(ASSETS / sub) for p in (ASSETS / sub).rglob("*") if p.is_file())
        assert ours == committed, sub
        for rel in ours:
            assert (tmp_path / sub / rel).read_bytes() == (ASSETS / sub / rel).read_bytes(), rel
    assert tokenizer_files(files) == tokenizer_files(demo_files())
    size = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert size < 1_000_000, size


def test_data_check_cli(capsys, tmp_path):
    from jaxpi.cli import main

    assert main(["data", "check", str(DEMO_DATA), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gates"]["admitted"] == 30 and out["gates"]["reasons"]["verifier_failed"] == 2
    assert any(re.search(r"021_truncated\.jsonl:\d+$", r["source"]) for r in out["gates"]["excluded"])
    stats = out["tokens"]
    assert stats["all"]["examples"] == sum(v["examples"] for k, v in stats.items() if k != "all")
    assert stats["effort=off"]["reasoning_tokens"] == 0 and stats["effort=xhigh"]["reasoning_tokens"] > 0
    assert main(["data", "check", str(DEMO_DATA / "sessions" / "015_failed.jsonl")]) == 1
    assert "verifier_failed" in capsys.readouterr().out


def test_checkpoint_with_tokenizer(tmp_path):
    from jaxpi.config import TINY
    from jaxpi.hf_fixtures import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", TINY, tokenizer=True)
    assert (ckpt / "config.json").exists() and (ckpt / "tokenizer.json").exists()
    sessions, _ = read_sessions([DEMO_DATA / "sessions" / "000_plain.jsonl"])
    a = render_session(sessions[0], load_tokenizer(ckpt), RenderConfig(ckpt))
    b = render_session(sessions[0], load_tokenizer(TINY_TOKENIZER), CFG)
    assert [e.input_ids.tolist() for e in a] == [e.input_ids.tolist() for e in b]

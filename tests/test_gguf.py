"""GGUF export, checked by real llama.cpp (built from the llama-cpp-python sdist, `jaxpi gguf setup`).

- the base GGUF jaxpi writes, loaded by llama.cpp, gives jaxpi's logits on drawn checkpoints
  (head ratios, layer patterns, tied or not, mrope sections, CausalLM or ConditionalGeneration):
  the test that the tensor mapping (norm offsets, -exp(A_log), value-head reorder) is right;
- jaxpi's importance matrix equals llama.cpp's own `llama-imatrix` on the same tokens;
- llama-quantize makes real K-quants from it (a model whose rows are multiples of 256), which
  llama.cpp loads and whose logits stay near the float ones;
- the LoRA adapter GGUF applied by llama.cpp (`--lora`) gives jaxpi's adapted logits;
- `jaxpi export --format gguf --report`: files, table, picture, llama.cpp's BF16 perplexity
  beside jaxpi's own;
- bad inputs: unknown quant types, llama.cpp missing, a checkpoint without a tensor, no
  tokenizer, a malformed tokenizer, key != value head dims, an interrupted export: each named,
  nothing half-written left.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, note, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.cli import main as cli_main
from jaxpi.config import TINY
from jaxpi.convert import gguf as gguf_mod
from jaxpi.convert.gguf import write_base_gguf
from jaxpi.convert.gguf_export import export_gguf, tensor_types
from jaxpi.convert.hf import load_hf
from jaxpi.convert.imatrix import collect, read_imatrix, split_by_task, write_imatrix
from jaxpi.data.sessions import Session, SessionMeta
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.llamacpp import setup as lsetup
from jaxpi.llamacpp.runtime import QUANT_TYPES, LlamaCppMissingError, find, gguf_logits, parse_quants
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.lora.peft import save_peft
from jaxpi.testing.parity_configs import text_configs

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "jaxpi" / "assets" / "tiny_tokenizer"
DEMO_SESSIONS = ROOT / "jaxpi" / "assets" / "demo" / "sessions"
SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=False)
# llama.cpp F32 (with a float32 KV cache) against jaxpi float32, ‖Δ‖max / max|ours|. Measured on
# the tiny preset: 4.6e-6; a wrong mapping (no value-head reorder, no norm offset) moves it to O(1).
LOGIT_BOUND = 1e-4


@pytest.fixture(scope="module")
def lc():
    """The cached llama.cpp build (`make test` builds it first; built here if it is missing)."""
    if not lsetup.is_ready(lsetup.default_dir()):
        lsetup.build()
    return find()


def jaxpi_logits(ckpt: Path, ids: list[int]) -> np.ndarray:
    _, model = load_hf(ckpt, "float32")
    return np.asarray(model(jnp.asarray([ids]))[0], np.float64)


def rel_max(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def with_tokenizer(ckpt: Path) -> Path:
    for f in TOKENIZER.iterdir():
        shutil.copy(f, ckpt / f.name)
    return ckpt


@st.composite
def gguf_cases(draw):
    """A drawn text config that llama.cpp's qwen35 can hold (one DeltaNet head size for keys and
    values, a vocabulary covering the tiny tokenizer's 512 ids), how it is built, and a length."""
    cfg = draw(text_configs())
    cfg["linear_value_head_dim"] = cfg["linear_key_head_dim"]
    # a hybrid stack, as every Qwen3.5 (llama.cpp refuses the others: see the bad-input test)
    layers = max(cfg["num_hidden_layers"], 2)
    kinds = st.sampled_from(["linear_attention", "full_attention"])
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = draw(
        st.lists(kinds, min_size=layers, max_size=layers).filter(lambda t: len(set(t)) == 2)
    )
    cfg.pop("full_attention_interval", None)
    cfg["vocab_size"] = draw(st.integers(512, 560))
    cfg.pop("pad_token_id", None)
    # llama.cpp normalizes the DeltaNet's q and k with rms_norm_eps, transformers with 1e-6: the
    # graphs agree only at 1e-6, every Qwen3.5's value (at 1e-5 llama.cpp is 3.5e-4 off float64
    # transformers, jaxpi 1e-7; write_base_gguf warns)
    cfg["rms_norm_eps"] = 1e-6
    return {
        "config": cfg,
        "kind": draw(st.sampled_from(["causal", "conditional"])),
        "tie": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "seq_len": draw(st.integers(2, 48)),
    }


def check_logits(case, tmp, lc) -> None:
    from jaxpi.hf_fixtures import make_hf_checkpoint

    note(f"case: {json.dumps(case, sort_keys=True)}")
    ckpt = with_tokenizer(
        make_hf_checkpoint(
            tmp / "ckpt", case["config"], kind=case["kind"], tie=case["tie"], seed=case["seed"]
        )
    )
    write_base_gguf(ckpt, tmp / "m.gguf", dtype="F32")
    ids = np.random.default_rng(case["seed"]).integers(0, 512, case["seq_len"]).tolist()
    ours = jaxpi_logits(ckpt, ids)
    theirs = gguf_logits(lc, tmp / "m.gguf", ids)
    assert theirs.shape == ours.shape
    assert rel_max(theirs, ours) < LOGIT_BOUND, rel_max(theirs, ours)


@fixed_seed(20261204)
@settings(max_examples=4, **SETTINGS)
@given(case=gguf_cases())
def test_llama_cpp_gives_jaxpi_logits_on_drawn_checkpoints(case, tmp_path_factory, lc):
    check_logits(case, tmp_path_factory.mktemp("gguf"), lc)


@pytest.mark.slow
@fixed_seed(11)
@settings(max_examples=40, **SETTINGS)
@given(case=gguf_cases())
def test_llama_cpp_gives_jaxpi_logits_on_many_drawn_checkpoints(case, tmp_path_factory, lc):
    check_logits(case, tmp_path_factory.mktemp("gguf"), lc)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", TINY, seed=4, tokenizer=True)


def test_the_value_head_reorder_is_what_makes_the_logits_agree(tiny, tmp_path, lc, monkeypatch):
    """TINY has 3 value heads per key head: without the reorder llama.cpp's logits are far off."""
    ids = list(range(3, 40))
    ours = jaxpi_logits(tiny, ids)
    write_base_gguf(tiny, tmp_path / "ok.gguf", dtype="F32")
    assert rel_max(gguf_logits(lc, tmp_path / "ok.gguf", ids), ours) < LOGIT_BOUND
    monkeypatch.setattr(gguf_mod, "v_head_order", lambda cfg, dim: None)
    write_base_gguf(tiny, tmp_path / "bad.gguf", dtype="F32")
    assert rel_max(gguf_logits(lc, tmp_path / "bad.gguf", ids), ours) > 100 * LOGIT_BOUND


def test_metadata_and_tokenizer_are_llama_cpps(tiny, tmp_path, lc):
    info = write_base_gguf(tiny, tmp_path / "m.gguf", dtype="BF16")
    assert info["special_tokens"] == {"eos_token": 2, "pad_token": 0}
    import gguf

    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "qwen35"
    assert field("qwen35.attention.recurrent_layers") == [t == "linear_attention" for t in TINY.layer_types]
    assert field("tokenizer.ggml.pre") == "gpt-2"  # the tiny tokenizer is GPT-2's byte-level BPE
    template = json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    assert field("tokenizer.chat_template") == template
    kinds = {t.name: t.tensor_type.name for t in r.tensors}
    assert kinds["blk.0.attn_qkv.weight"] == "BF16" and kinds["blk.0.ssm_a"] == "F32"
    # llama.cpp's own tokenizer, from the embedded vocabulary, agrees with transformers'
    from transformers import AutoTokenizer

    text = "<|im_start|>user\nfix the bug in `parse()`: it's off by one\n<|im_end|>\n<think>\n"
    llm = lc.bindings().Llama(model_path=str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    try:
        ours = llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()
    assert ours == AutoTokenizer.from_pretrained(tiny)(text, add_special_tokens=False)["input_ids"]


def test_a_qwen35_pre_tokenizer_is_named_and_tokenizes_as_transformers(tiny, tmp_path, lc):
    """The tiny tokenizer with Qwen3.5's split regex (as Qwen's tokenizer.json spells it) in front of
    a byte-level step without its own regex: the GGUF says "qwen35" and llama.cpp cuts digits,
    marks, contractions and newlines as transformers does."""
    import gguf
    from transformers import AutoTokenizer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": gguf_mod._QWEN35_REGEX},
                "behavior": "Isolated",
                "invert": False,
            },
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    }
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    write_base_gguf(ckpt, tmp_path / "m.gguf", dtype="F32")
    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.pre"].contents() == "qwen35"
    text = "It's 2026: naïve café\n\n  x = f(12345)  # don't\r\n\tdone<|im_end|>"
    llm = lc.bindings().Llama(model_path=str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    try:
        ours = llm.tokenize(text.encode(), add_bos=False, special=True)
    finally:
        llm.close()
    assert ours == AutoTokenizer.from_pretrained(ckpt)(text, add_special_tokens=False)["input_ids"]


def test_our_imatrix_is_llama_imatrixs_own(tiny, tmp_path, lc):
    """The same 8 windows of 64 tokens through llama-imatrix (on the F32 GGUF) and jaxpi."""
    write_base_gguf(tiny, tmp_path / "m.gguf", dtype="F32")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    text = "".join((DEMO_SESSIONS / f).read_text()[:1500] for f in sorted(os.listdir(DEMO_SESSIONS))[:4])
    (tmp_path / "text.txt").write_text(text)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ctx, n = 64, 8
    assert len(ids) >= ctx * n
    (tmp_path / "cut.txt").write_text(tok.decode(ids[: ctx * n]))
    cut = tok((tmp_path / "cut.txt").read_text(), add_special_tokens=False)["input_ids"]
    assert cut[: ctx * n] == ids[: ctx * n]
    lc.imatrix(tmp_path / "m.gguf", tmp_path / "cut.txt", tmp_path / "ref.gguf", ctx=ctx)
    stats = collect(tiny, [np.asarray(ids[i * ctx : (i + 1) * ctx]) for i in range(n)], ctx=ctx)
    write_imatrix(tmp_path / "ours.gguf", stats, datasets=["cut.txt"], ctx=ctx)
    ref, ours = read_imatrix(tmp_path / "ref.gguf"), read_imatrix(tmp_path / "ours.gguf")
    assert set(ref) == set(ours) and len(ref) == 31  # every matmul of the 4 layers
    for name, (sums, count) in ref.items():
        assert ours[name][1] == count == ctx * n, name
        # measured 5.8e-5 at worst (float32 sums over 512 tokens, two matmul orders)
        assert np.abs(ours[name][0] - sums).max() <= 1e-3 * np.abs(sums).max(), name


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Every row a multiple of 256, so llama-quantize applies the K-quants as on a release (no
    fallback types); transformers' own init (a random-weight model is chaotic: BF16 rounding alone
    moves its logits 5%)."""
    from jaxpi.hf_fixtures import make_hf_checkpoint

    cfg = TINY.replace(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64,
    )  # fmt: skip
    text = {
        k: v
        for k, v in cfg.to_hf().items()
        if k not in ("architectures", "tie_word_embeddings", "model_type")
    }
    ckpt = make_hf_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", text, weights="init", seed=6)
    return with_tokenizer(ckpt)


def test_k_quants_are_made_and_loaded(wide, tmp_path, lc):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    for f in sorted(DEMO_SESSIONS.iterdir())[:6]:
        shutil.copy(f, sessions / f.name)
    s = export_gguf(
        wide, tmp_path / "out", quants="BF16,Q8_0,Q4_K_M", sessions=sessions, ctx=128, llamacpp=lc
    )
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["ckpt-BF16.gguf", "ckpt-Q4_K_M.gguf", "ckpt-Q8_0.gguf", "imatrix.gguf"]
    assert s["variants"]["Q4_K_M"]["fallback_tensors"] == 0 and s["variants"]["Q4_K_M"]["imatrix"]
    types = tensor_types(tmp_path / "out" / "ckpt-Q4_K_M.gguf")
    assert {"Q4_K", "Q6_K"} <= set(types), types
    assert set(tensor_types(tmp_path / "out" / "ckpt-Q8_0.gguf")) == {"F32", "Q8_0"}
    ids = list(range(5, 69))
    ours = jaxpi_logits(wide, ids)
    err = {}
    for q in ("BF16", "Q8_0", "Q4_K_M"):
        theirs = gguf_logits(lc, tmp_path / "out" / f"ckpt-{q}.gguf", ids)
        assert np.isfinite(theirs).all()
        err[q] = float(np.linalg.norm(theirs - ours) / np.linalg.norm(ours))
    # measured (‖Δ‖/‖ours‖): BF16 0.008, Q8_0 0.029, Q4_K_M 0.25 (Q6_K 0.074); fewer bits, more error
    assert 0 < err["BF16"] < err["Q8_0"] < err["Q4_K_M"] < 0.5, err
    assert err["Q8_0"] < 0.06, err


def test_adapter_gguf_applied_by_llama_cpp_gives_jaxpi_adapted_logits(tiny, tmp_path, lc):
    _, model = load_hf(tiny, "float32")
    lcfg = LoraConfig(rank=4, alpha=8.0)
    add_lora(model, lcfg)
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        var.set_value(jnp.asarray(rng.normal(0, 0.2, var.get_value().shape), jnp.float32))
    save_peft(model, lcfg, tmp_path / "peft", base_dir=tiny)
    code = cli_main(["export", "--format", "gguf", "--adapter", str(tmp_path / "peft"), "--base", str(tiny),
                     "--out", str(tmp_path / "lora"), "--json"])  # fmt: skip
    assert code == 0
    (adapter,) = (tmp_path / "lora").iterdir()
    write_base_gguf(tiny, tmp_path / "base.gguf", dtype="F32")
    ids = list(range(7, 50))
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray([ids]))[0], np.float64)
    plain = gguf_logits(lc, tmp_path / "base.gguf", ids)
    adapted = gguf_logits(lc, tmp_path / "base.gguf", ids, lora=adapter)
    # the arbiter: transformers + peft in float64. Measured: llama.cpp 8.1e-5, jaxpi float32 4.7e-5
    # (the adapter's 0.2-sized factors make this model's logits touchier than the base's)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64).eval()
    with torch.no_grad():
        ref = (
            PeftModel.from_pretrained(hf, tmp_path / "peft")
            .double()
            .eval()(input_ids=torch.tensor([ids]))
            .logits[0]
        )
    ref = ref.numpy()
    assert rel_max(ours, ref) < 3e-4 and rel_max(adapted, ref) < 3e-4, (
        rel_max(ours, ref),
        rel_max(adapted, ref),
    )
    assert rel_max(plain, ref) > 0.05  # the adapter moves the logits: the comparison can fail


def test_adapter_gguf_refuses_what_llama_cpp_cannot_apply(tiny, tmp_path, capsys):
    _, model = load_hf(tiny, "float32")
    lcfg = LoraConfig(rank=2, alpha=4.0)
    add_lora(model, lcfg)
    save_peft(model, lcfg, tmp_path / "peft", base_dir=tiny)
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "peft" / "adapter_config.json").write_text(
        json.dumps({**conf, "alpha_pattern": {"q_proj": 16}})
    )
    args = ["export", "--format", "gguf", "--adapter", str(tmp_path / "peft"), "--base", str(tiny)]
    assert cli_main([*args, "--out", str(tmp_path / "a")]) == 2
    assert "alpha_pattern" in capsys.readouterr().err
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(conf))
    assert (
        cli_main([*args, "--out", str(tmp_path / "b"), "--quant", "Q4_K_M"]) == 2
    )  # quant: a model's option
    err = capsys.readouterr().err
    assert "--quant" in err and "add --merged" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peft"]


def test_export_cli_with_report(tiny, tmp_path, lc, capsys):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    for f in sorted(DEMO_SESSIONS.iterdir())[:10]:
        shutil.copy(f, sessions / f.name)
    out = tmp_path / "out"
    code = cli_main(["export", "--format", "gguf", "--base", str(tiny), "--out", str(out), "--quant", "BF16,Q8_0,Q4_K_M",
                     "--sessions", str(sessions), "--report", "--ctx", "128", "--heldout", "0.3", "--json"])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["ckpt-BF16.gguf", "ckpt-Q8_0.gguf", "ckpt-Q4_K_M.gguf", "imatrix.gguf",
                            "gguf_report.json", "gguf_report.md", "fidelity.png"])  # fmt: skip
    report = json.loads((out / "gguf_report.json").read_text())
    held, calib = set(report["split"]["heldout_tasks"]), set(report["split"]["calibration_tasks"])
    assert held and calib and not held & calib
    rows = {(r["format"], r["imatrix"]): r for r in report["rows"]}
    assert set(rows) == {
        ("BF16", False),
        ("Q8_0", True),
        ("Q8_0", False),
        ("Q4_K_M", True),
        ("Q4_K_M", False),
    }
    # llama.cpp's BF16 perplexity is jaxpi's float32 one up to BF16 rounding (measured 0.02%)
    assert abs(rows[("BF16", False)]["ppl"] / report["jaxpi_float32_ppl"] - 1) < 0.005
    assert summary["report"]["rows"] == report["rows"]
    assert (out / "fidelity.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "spec, says",
    [("Q4_K_X", "unknown GGUF quant type 'Q4_K_X'"), ("", "lists no types"), ("Q8_0,,nope", "'nope'")],
)
def test_unknown_quant_types_are_refused_before_any_work(tiny, tmp_path, capsys, spec, says):
    code = cli_main(
        ["export", "--format", "gguf", "--base", str(tiny), "--out", str(tmp_path / "o"), "--quant", spec]
    )
    assert code == 2 and says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_every_quant_type_we_accept_is_one_llama_quantize_lists(lc):
    """`all` is the seed's 17 variants, and each accepted name is in `llama-quantize --help`."""
    import re
    import subprocess

    text = subprocess.run([str(lc.tool("llama-quantize")), "--help"], capture_output=True, text=True)
    listed = set(re.findall(r"^\s+\d+\s+or\s+(\w+)\s*:", text.stdout + text.stderr, re.MULTILINE))
    assert {"Q8_0", "Q4_K_M", "IQ2_M"} <= listed
    assert set(parse_quants(",".join(QUANT_TYPES))) <= listed, set(QUANT_TYPES) - listed
    assert len(parse_quants("all")) == 17 and parse_quants("q8_0, all")[0] == "Q8_0"


def test_a_missing_llama_cpp_is_named(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXPI_LLAMACPP_DIR", str(tmp_path / "none"))
    with pytest.raises(LlamaCppMissingError, match="jaxpi gguf setup"):
        find()
    code = cli_main(["export", "--format", "gguf", "--base", str(tiny), "--out", str(tmp_path / "o")])
    assert code == 2 and "jaxpi gguf setup" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_stale_or_partial_build_is_not_ready(tmp_path):
    root = tmp_path / "lc"
    (root / "bin").mkdir(parents=True)
    (root / "python" / "llama_cpp").mkdir(parents=True)
    for t in lsetup.TOOLS:
        (root / "bin" / t).write_text("")
    assert not lsetup.is_ready(root)  # no stamp: half-built
    (root / lsetup.STAMP_NAME).write_text(json.dumps({**lsetup.stamp(), "llama_cpp_python": "0.0.1"}))
    assert not lsetup.is_ready(root)  # another version
    (root / lsetup.STAMP_NAME).write_text(json.dumps(lsetup.stamp()))
    assert lsetup.is_ready(root)
    (root / "bin" / "llama-imatrix").unlink()
    assert not lsetup.is_ready(root)


def _broken(tmp_path: Path, tiny: Path, what: str) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    if what == "tensor":
        from safetensors.numpy import load_file, save_file

        t = load_file(bad / "model.safetensors")
        del t["model.layers.1.linear_attn.A_log"]
        save_file(t, bad / "model.safetensors")
    elif what == "tokenizer":
        (bad / "tokenizer.json").unlink()
    elif what == "tokenizer-json":
        (bad / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0,}}}')
    elif what == "token-id":
        tok = json.loads((bad / "tokenizer.json").read_text())
        tok["model"]["vocab"]["zz"] = 4096
        (bad / "tokenizer.json").write_text(json.dumps(tok))
    elif what == "pre-tokenizer":
        tok = json.loads((bad / "tokenizer.json").read_text())
        tok["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated"}
        (bad / "tokenizer.json").write_text(json.dumps(tok))
    elif what == "only-linear":
        cfg = json.loads((bad / "config.json").read_text())
        cfg["layer_types"] = ["linear_attention"] * cfg["num_hidden_layers"]
        (bad / "config.json").write_text(json.dumps(cfg))
    elif what == "head-dims":
        cfg = json.loads((bad / "config.json").read_text())
        cfg["linear_value_head_dim"] = 8
        (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize(
    "what, says",
    [
        ("tensor", "model.layers.1.linear_attn.A_log"),
        ("tokenizer", "no tokenizer.json"),
        ("tokenizer-json", "tokenizer.json"),
        ("token-id", "'zz' has id 4096"),
        ("head-dims", "linear_key_head_dim == linear_value_head_dim"),
        ("only-linear", "hybrid stacks only"),
        ("pre-tokenizer", "a pre-tokenizer llama.cpp's qwen35 model does not know"),
    ],
)
def test_bad_checkpoints_are_named_and_nothing_is_written(tiny, tmp_path, capsys, lc, what, says):
    bad = _broken(tmp_path, tiny, what)
    out = tmp_path / "out"
    code = cli_main(["export", "--format", "gguf", "--base", str(bad), "--out", str(out), "--quant", "Q8_0"])
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_an_interrupted_export_leaves_nothing(tiny, tmp_path, lc, monkeypatch):
    calls = []

    def fail(self, src, dst, quant, **kw):
        calls.append(quant)
        Path(dst).write_bytes(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr(type(lc), "quantize", fail)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(tiny, tmp_path / "out", quants="Q8_0", llamacpp=lc)
    assert calls == ["Q8_0"] and list(tmp_path.iterdir()) == []


def test_a_truncated_gguf_is_named_by_the_scorer(tiny, tmp_path, lc, capsys):
    write_base_gguf(tiny, tmp_path / "m.gguf", dtype="F32")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    sessions = tmp_path / "s"
    sessions.mkdir()
    shutil.copy(sorted(DEMO_SESSIONS.iterdir())[0], sessions)
    code = cli_main(["gguf", "ppl", "--gguf", str(tmp_path / "cut.gguf"), "--sessions", str(sessions),
                     "--tokenizer", str(tiny), "--ctx", "64"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "cannot load" in err and "cut.gguf" in err, err
    code = cli_main(["gguf", "ppl", "--gguf", str(tmp_path / "m.gguf"), "--sessions", str(sessions),
                     "--tokenizer", str(tiny), "--ctx", "64", "--json"])  # fmt: skip
    assert code == 0 and json.loads(capsys.readouterr().out)["rows"][0]["ppl"] > 1


def test_an_abort_inside_llama_cpp_is_an_error_not_our_death(tmp_path, lc, monkeypatch):
    """llama.cpp 0.3.36 aborts (GGML_ASSERT) on a stack without attention layers; evaluated in a
    child process, that is a LlamaCppError naming the file, and this process goes on."""
    from jaxpi.llamacpp.runtime import LlamaCppError

    ckpt = make_checkpoint(
        tmp_path / "ckpt", TINY.replace(layer_types=("linear_attention",) * 4), tokenizer=True
    )
    monkeypatch.setattr(gguf_mod, "check_supported", lambda cfg, where: None)
    write_base_gguf(ckpt, tmp_path / "m.gguf", dtype="F32")
    with pytest.raises(LlamaCppError, match=r"aborted \(SIGABRT\) evaluating .*m\.gguf.*GGML_ASSERT"):
        gguf_logits(lc, tmp_path / "m.gguf", list(range(8)))


def test_iq2_without_an_importance_matrix_is_refused(tiny, tmp_path, lc):
    with pytest.raises(ValueError, match="IQ2_XXS needs an importance matrix"):
        export_gguf(tiny, tmp_path / "out", quants="IQ2_XXS", llamacpp=lc)
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=50, **SETTINGS)
@given(
    tasks=st.lists(st.sampled_from([f"t{i}" for i in range(8)] + [None]), min_size=1, max_size=30),
    heldout=st.sampled_from([0.0, 0.2, 0.5, 0.9]),
)
def test_the_held_out_split_never_shares_a_task(tasks, heldout):
    sessions = [Session([], None, SessionMeta(source=f"s{i}.jsonl", task_id=t)) for i, t in enumerate(tasks)]
    calib, held = split_by_task(sessions, heldout)
    key = lambda s: s.meta.task_id or s.meta.source  # noqa: E731
    assert len(calib) + len(held) == len(sessions)
    assert not {key(s) for s in calib} & {key(s) for s in held}
    n_tasks = len({key(s) for s in sessions})
    if heldout > 0 and n_tasks >= 2:
        assert held and calib
    if heldout == 0:
        assert not held


def test_imatrix_cli_writes_atomically_with_the_umask(tiny, tmp_path, capsys):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    for f in sorted(DEMO_SESSIONS.iterdir())[:3]:
        shutil.copy(f, sessions / f.name)
    old = os.umask(0o027)
    try:
        code = cli_main(["imatrix", "--model", str(tiny), "--sessions", str(sessions), "--out", str(tmp_path / "im.gguf"),
                         "--ctx", "128", "--json"])  # fmt: skip
    finally:
        os.umask(old)
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors"] == 31 and summary["windows"] > 0
    assert (tmp_path / "im.gguf").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["im.gguf", "sessions"]
    assert len(read_imatrix(tmp_path / "im.gguf")) == 31

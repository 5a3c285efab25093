"""PEFT and merged exports, checked against the real `peft` and `transformers` (fp32, CPU).

- `save_peft` → `PeftModel.from_pretrained` on the transformers model (CausalLM and
  ConditionalGeneration, all layers and a partial selection): peft loads every tensor (its own
  load report has no missing or unexpected adapter keys, and its weights equal the file's), the
  adapted modules are exactly our targets, and the logits equal jaxpi's with the adapter;
- `save_merged` → `transformers` reload gives the adapted logits; the source model is untouched;
- `load_peft(save_peft(x)) == x` bit for bit; missing / unexpected / mis-shaped keys are named;
- `jaxpi export` from a peft directory and from a trainer checkpoint.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.numpy import load_file, save_file
from transformers import Qwen3_5ForCausalLM as HFCausalLM
from transformers import Qwen3_5ForConditionalGeneration as HFConditional

from jaxpi import TINY, load_hf
from jaxpi.cli import main as cli_main
from jaxpi.convert.safetensors_io import CheckpointError
from jaxpi.hf_fixtures import make_checkpoint
from jaxpi.lora import TARGETS, LoraConfig, LoRAMask, LoRAParam, add_lora, module_paths, select_modules
from jaxpi.lora.peft import load_peft, save_merged, save_peft, target_modules

CFG9 = TINY.replace(num_hidden_layers=9)  # two scanned groups of 4 + one unrolled tail layer
IDS = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 11)).astype(np.int32)
FWD = jax.jit(lambda m, x: m(x))
FULL = LoraConfig(rank=4, alpha=8.0)
# Layers 1, 3 and 8: stacked adapters used in some groups only, and the tail layer.
PARTIAL = LoraConfig(
    rank=3, alpha=5.0, targets=("q_proj", "o_proj", "in_proj_qkv", "down_proj"), layers=(1, 3, 8)
)


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖, as the parity harness measures logits."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_checkpoint(tmp_path_factory.mktemp(kind), CFG9, kind=kind, seed=3)
        return made[kind]

    return get


def randomize(model, seed: int = 0, scale: float = 0.1) -> None:
    """Non-zero A and B wherever a layer is selected; the rows of unselected layers in a stacked
    adapter stay zero, as `add_lora` leaves them (their LoRAMask is 0)."""
    rng = np.random.default_rng(seed)
    flat = dict(nnx.to_flat_state(nnx.state(model, (LoRAParam, LoRAMask))))
    for path, var in sorted(flat.items(), key=lambda kv: str(kv[0])):
        if not isinstance(var, LoRAParam):
            continue
        name, where = str(path[-1]), path[:-1]
        if name.startswith("lora_a_"):
            hf = name.removeprefix("lora_a_")
        else:  # lora_b_<proj>: the module's adapter whose parts include proj
            proj = name.removeprefix("lora_b_")
            hf = next(h for h, (_, ps) in TARGETS.items() if proj in ps and (*where, f"lora_a_{h}") in flat)
        shape = var.get_value().shape
        noise = scale * rng.standard_normal(shape).astype(np.float32)
        mask = flat.get((*where, f"lora_mask_{hf}"))
        if mask is not None:
            noise = noise * np.asarray(mask.get_value()).reshape(-1, *([1] * (len(shape) - 1)))
        var.set_value(jnp.asarray(noise))


def adapted(ckpt_dir: Path, lcfg: LoraConfig, seed: int = 0):
    _, model = load_hf(ckpt_dir)
    add_lora(model, lcfg, key=jax.random.key(seed))
    randomize(model, seed)
    return model


def torch_model(kind: str, path: Path):
    cls = HFCausalLM if kind == "causal" else HFConditional
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(IDS).long()).logits.float().numpy()


# ---- PEFT export against peft -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "lcfg"), [("causal", FULL), ("conditional", FULL), ("conditional", PARTIAL)]
)
def test_peft_adapter_loads_in_peft_with_equal_logits(ckpt, tmp_path, kind, lcfg):
    base_dir = ckpt(kind)
    model = adapted(base_dir, lcfg)
    ours = np.asarray(FWD(model, IDS))
    out = save_peft(model, lcfg, tmp_path / "adapter", base_dir=base_dir)

    config = json.loads((out / "adapter_config.json").read_text())
    reference = PeftLoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM").to_dict()
    assert set(config) == set(reference), set(config) ^ set(reference)
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == (
        "LORA",
        "CAUSAL_LM",
        lcfg.rank,
        lcfg.alpha,
    )
    tensors = load_file(out / "adapter_model.safetensors")
    prefix = "base_model.model.model.language_model." if kind == "conditional" else "base_model.model.model."
    assert all(k.startswith(prefix + "layers.") for k in tensors)
    assert len(tensors) == 2 * len(select_modules(CFG9, lcfg))

    hf = torch_model(kind, base_dir)
    base_logits = torch_logits(hf)
    assert rel(ours, base_logits) > 1e-2  # the adapter really changes the output
    expected_modules = {
        name
        for name, mod in hf.named_modules()
        if isinstance(mod, torch.nn.Linear)
        and ".layers." in name
        and (int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1])
        in set(select_modules(CFG9, lcfg))
    }
    peft_model = PeftModel.from_pretrained(hf, out).eval()
    adapted_modules = {
        n.removeprefix("base_model.model.")
        for n, m in peft_model.named_modules()
        if hasattr(m, "lora_A") and "default" in m.lora_A
    }
    assert adapted_modules == expected_modules
    # peft's own load report for a second load of the same files: nothing missing or left over.
    report = peft_model.load_adapter(out, adapter_name="again")
    assert report.missing_keys == []
    assert [k for k in report.unexpected_keys if "lora" in k] == []
    # ...and what it loaded is exactly the file (peft strips the adapter name on export).
    loaded = {k: v.numpy() for k, v in get_peft_model_state_dict(peft_model, adapter_name="default").items()}
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        np.testing.assert_array_equal(loaded[k], v, err_msg=k)

    peft_model.set_adapter("default")
    theirs = torch_logits(peft_model)
    err = rel(ours, theirs)
    print(f"{kind} {lcfg.layers or 'all layers'}: max rel logits error vs peft {err:.2e}")
    assert err <= 1e-4


def test_target_modules_is_a_name_list_or_a_regex_anchored_at_the_text_model():
    assert target_modules(CFG9, FULL, "model.language_model.") == sorted(FULL.targets)
    regex = target_modules(CFG9, PARTIAL, "model.language_model.")
    assert isinstance(regex, str) and regex.startswith(r"model\.language_model\.layers\.")
    names = [f"model.language_model.{p}" for _, _, p in module_paths(CFG9)]
    hits = {n for n in names if re.fullmatch(regex, n)}
    want = {
        f"model.language_model.{p}"
        for i, hf, p in module_paths(CFG9)
        if (i, hf) in select_modules(CFG9, PARTIAL)
    }
    assert (
        hits == want and len(want) == 7
    )  # q/o_proj of layer 3, in_proj_qkv of 1 and 8, down_proj of 1, 3, 8
    assert not re.fullmatch(regex, "model.layers.1.linear_attn.in_proj_qkv")  # the CausalLM path


# ---- merged export -------------------------------------------------------------------------------
def test_merged_export_reloads_in_transformers(ckpt, tmp_path):
    base_dir = ckpt("conditional")
    model = adapted(base_dir, FULL)
    ours = np.asarray(FWD(model, IDS))
    base_logits = torch_logits(torch_model("conditional", base_dir))
    out = save_merged(model, tmp_path / "merged", base_dir=base_dir)
    theirs = torch_logits(torch_model("conditional", out))
    assert rel(theirs, ours) <= 1e-4
    assert rel(theirs, base_logits) > 1e-2
    # The source model still carries its (unmerged) adapters and computes the same logits.
    assert jax.tree.leaves(nnx.state(model, LoRAParam))
    np.testing.assert_array_equal(np.asarray(FWD(model, IDS)), ours)
    src, dst = load_file(base_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert {k for k in src if k.startswith(("model.visual.", "mtp."))} <= set(dst)


# ---- load_peft ------------------------------------------------------------------------------------
def lora_arrays(model) -> dict:
    return {
        tuple(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam))
    }


@pytest.mark.parametrize("lcfg", [FULL, PARTIAL])
def test_load_peft_inverts_save_peft_exactly(ckpt, tmp_path, lcfg):
    base_dir = ckpt("causal")
    model = adapted(base_dir, lcfg, seed=1)
    out = save_peft(model, lcfg, tmp_path / "adapter", base_dir=base_dir)
    want = lora_arrays(model)

    loaded_cfg, state = load_peft(CFG9, out)
    assert set(select_modules(CFG9, loaded_cfg)) == set(select_modules(CFG9, lcfg))
    assert (loaded_cfg.rank, loaded_cfg.alpha) == (lcfg.rank, lcfg.alpha)
    got = {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))

    _, fresh = load_hf(base_dir)
    load_peft(fresh, out)
    for k, v in lora_arrays(fresh).items():
        np.testing.assert_array_equal(v, want[k], err_msg=str(k))
    np.testing.assert_array_equal(np.asarray(FWD(fresh, IDS)), np.asarray(FWD(model, IDS)))


def test_load_peft_names_bad_keys(ckpt, tmp_path):
    base_dir = ckpt("causal")
    model = adapted(base_dir, FULL)
    good = save_peft(model, FULL, tmp_path / "good", base_dir=base_dir)
    tensors = load_file(good / "adapter_model.safetensors")
    key = "base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight"

    def variant(name: str, t: dict) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
        save_file(t, d / "adapter_model.safetensors", metadata={"format": "pt"})
        return d

    missing = variant("missing", {k: v for k, v in tensors.items() if k != key})
    with pytest.raises(CheckpointError, match=re.escape(f"missing key '{key}'")):
        load_peft(CFG9, missing)
    extra_key = "base_model.model.model.layers.3.self_attn.q_norm.lora_A.weight"
    extra = variant("extra", {**tensors, extra_key: np.zeros((4, 32), np.float32)})
    with pytest.raises(CheckpointError, match=re.escape(f"unexpected key '{extra_key}'")):
        load_peft(CFG9, extra)
    wrong = variant("wrong", {**tensors, key: np.zeros((64, 5), np.float32)})
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' has shape \[64, 5\], expected \[64, 4\]"):
        load_peft(CFG9, wrong)
    # A module target_modules does not select, although it exists in the model.
    narrow = variant("narrow", tensors)
    cfg = json.loads((narrow / "adapter_config.json").read_text())
    (narrow / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    with pytest.raises(CheckpointError, match=r"unexpected key .* does not select this module"):
        load_peft(CFG9, narrow)


# ---- CLI ----------------------------------------------------------------------------------------------
def test_cli_exports_a_peft_dir_and_its_merge(ckpt, tmp_path, capsys):
    base_dir = ckpt("causal")
    model = adapted(base_dir, PARTIAL)
    ours = np.asarray(FWD(model, IDS))
    src = save_peft(model, PARTIAL, tmp_path / "src", base_dir=base_dir)
    out = tmp_path / "again"
    assert (
        cli_main(["export", "--adapter", str(src), "--base", str(base_dir), "--out", str(out), "--json"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "peft" and summary["source"] == "peft"
    a, b = load_file(src / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    merged = tmp_path / "merged"
    argv = [
        "export",
        "--adapter",
        str(src),
        "--base",
        str(base_dir),
        "--out",
        str(merged),
        "--merged",
        "--json",
    ]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert rel(torch_logits(torch_model("causal", merged)), ours) <= 1e-4
    # A second export to the same place is refused (nothing is overwritten silently).
    assert cli_main(argv) == 2
    assert "exists" in capsys.readouterr().err


def test_cli_exports_a_trainer_checkpoint(ckpt, tmp_path, capsys):
    checkpoint = pytest.importorskip("jaxpi.train.checkpoint")
    if not hasattr(checkpoint, "load_adapter"):
        pytest.skip("trainer checkpoints are not readable yet")
    base_dir = ckpt("causal")
    model = adapted(base_dir, PARTIAL, seed=2)
    store = checkpoint.CheckpointStore(tmp_path / "run")
    meta = {
        "base": str(base_dir),
        "model_config": CFG9.to_hf(),
        "lora": {
            **dataclasses.asdict(PARTIAL),
            "targets": list(PARTIAL.targets),
            "layers": list(PARTIAL.layers),
        },
        "step": 7,
        "config": {},
    }
    store.save(7, nnx.state(model, LoRAParam), {"count": np.zeros((), np.int32)}, {"step": 7}, meta)
    store.close()
    out = tmp_path / "adapter"
    assert (
        cli_main(
            [
                "export",
                "--adapter",
                str(tmp_path / "run"),
                "--base",
                str(base_dir),
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["source"] == "jaxpi checkpoint"
    want = save_peft(model, PARTIAL, tmp_path / "direct", base_dir=base_dir)
    a, b = load_file(want / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # two more compiles of the model (~20 s); `make test` covers dropout in test_lora
def test_dropout_masks_do_not_depend_on_layer_scanning(ckpt, tmp_path):
    """Each layer's key is the step key folded with its HF index: the scanned model and the same
    adapter loaded (through peft's format) into an unrolled model drop the same inputs."""
    base_dir = ckpt("causal")
    lcfg = LoraConfig(rank=4, alpha=8.0, dropout=0.2)
    scanned = adapted(base_dir, lcfg)
    adapter = save_peft(scanned, lcfg, tmp_path / "adapter", base_dir=base_dir)
    _, unrolled = load_hf(base_dir, config_overrides={"scan_layers": False})
    assert unrolled.groups is None
    load_peft(unrolled, adapter)
    assert unrolled.lora_config.dropout == 0.2
    fwd = jax.jit(lambda m, x, k: m(x, dropout_key=k))
    key = jax.random.key(7)
    a, b = np.asarray(fwd(scanned, IDS, key)), np.asarray(fwd(unrolled, IDS, key))
    assert rel(b, a) < 1e-5
    assert rel(np.asarray(fwd(scanned, IDS, jax.random.key(8))), a) > 1e-3  # the key matters

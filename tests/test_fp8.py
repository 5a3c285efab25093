"""Block-wise FP8 export (`jaxpi export --format fp8`, jaxpi.convert.fp8), checked by its consumers.

- the codes and scales are transformers' own FP8 quantizer's (`Fp8Quantize`), block by block,
  ragged edge blocks included, over drawn shapes and magnitudes; the error is within E4M3's
  half-ulp of every weight;
- the export of a tiny checkpoint loads in `transformers` (FineGrainedFP8, dequantized on CPU):
  its weights are exactly our dequantization, its logits exactly those of the float32 model
  holding those weights, and within a measured bound of the source model's;
- the 27B export's size from the architecture alone, against the seed report's 30.39 GB;
- a base + adapter export, refusals (already quantized, NaN weight, bad flags) that leave nothing.
"""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from jaxpi.cli import main as cli_main
from jaxpi.config import QWEN3_5_27B, TINY
from jaxpi.convert.fp8 import (
    VISION_DEFAULTS,
    dequantize_blockwise,
    export_fp8,
    fp8_size,
    mtp_shapes,
    quantize_blockwise,
    vision_shapes,
)
from jaxpi.convert.safetensors_io import read_array, read_index
from jaxpi.hf_fixtures import make_checkpoint

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
IDS = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 9))
# TINY with every quantized dimension a multiple of 128 or within one block, as in every Qwen3.5
# release (TINY's fused in_proj_qkv has 160 rows: see test_ragged_weights_are_listed).
WHOLE = TINY.replace(linear_num_value_heads=4)


def transformers_quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' `Fp8Quantize` applied to each block of `w` on its own (its block size set to
    the block's extent), so that ragged edge blocks are quantized by transformers too."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    rows, cols = w.shape
    bm, bn = block
    q = np.empty(w.shape, E4M3)
    s = np.empty((-(-rows // bm), -(-cols // bn)), np.float32)
    for i, r0 in enumerate(range(0, rows, bm)):
        for j, c0 in enumerate(range(0, cols, bn)):
            tile = w[r0 : r0 + bm, c0 : c0 + bn]
            cfg = FineGrainedFP8Config(weight_block_size=list(tile.shape))
            op = Fp8Quantize(SimpleNamespace(quantization_config=cfg))
            got = op.convert({"x.weight": torch.from_numpy(np.ascontiguousarray(tile))})
            q[r0 : r0 + bm, c0 : c0 + bn] = got["x.weight"].view(torch.uint8).numpy().view(E4M3)
            s[i, j] = got["x.weight_scale_inv"].reshape(()).item()
    return q, s


def arrays(d) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (safetensors' numpy reader has no FP8)."""
    return {n: read_array(i) for n, i in read_index(d).items()}


@st.composite
def weights(draw):
    rows, cols = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    exponent = draw(st.integers(-30, 30))
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 10.0**exponent).astype(np.float32)
    if draw(st.booleans()):
        w[: min(rows, 128), : min(cols, 128)] = 0.0  # an all-zero block keeps scale 1
    return w


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(w=weights())
def test_codes_and_scales_are_transformers_own_block_by_block(w):
    q, s = quantize_blockwise(w)
    tq, ts = transformers_quantize(w, (128, 128))
    assert s.shape == ts.shape and np.array_equal(s, ts)
    assert np.array_equal(q.view(np.uint8), tq.view(np.uint8))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(w=weights(), bm=st.sampled_from([1, 16, 128]), bn=st.sampled_from([8, 128, 200]))
def test_dequantized_weight_is_within_half_an_e4m3_ulp(w, bm, bn):
    q, s = quantize_blockwise(w, (bm, bn))
    assert (
        q.dtype == E4M3 and s.dtype == np.float32 and s.shape == (-(-w.shape[0] // bm), -(-w.shape[1] // bn))
    )
    back = dequantize_blockwise(q, s, (bm, bn))
    scale = np.repeat(np.repeat(s, bm, 0), bn, 1)[: w.shape[0], : w.shape[1]].astype(np.float64)
    # 3 mantissa bits: a relative half-ulp of 2^-4 for normal codes, 2^-10 (in units of the block's
    # scale) for the subnormals below 2^-6; a little more for float32's own rounding.
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert (np.abs(back.astype(np.float64) - w) <= bound).all()
    # Each block's largest weight maps to the largest code, 448 (up to float32 rounding).
    assert np.abs(q.astype(np.float32)).max() == (448.0 if np.abs(w).max() > 0 else 0.0)


def test_nan_weight_has_no_scale():
    w = np.ones((4, 4), np.float32)
    w[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_blockwise(w)


# ---- the export, loaded by transformers ----------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_checkpoint(root / "src", WHOLE, kind="conditional", seed=5, tokenizer=True)
    out = root / "fp8"
    summary = export_fp8(src, out)
    return SimpleNamespace(src=src, out=out, summary=summary)


def test_export_layout_and_quantization_config(exported):
    src, out = read_index(exported.src), read_index(exported.out)
    fp8 = sorted(n for n, i in out.items() if i.dtype == "F8_E4M3")
    # Every layer's linear modules but the delta rule's two small projections; no vision, MTP, head.
    modules = {n.split(".")[-2] for n in fp8}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"} | {
        "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert all(n.startswith("model.language_model.layers.") for n in fp8)
    assert len(fp8) == exported.summary["quantized_tensors"] == 3 * 4 + 4 * 1 + 3 * 3  # 4 layers, 1 full
    assert exported.summary["ragged"] == []
    for n in fp8:
        scale = out[n.removesuffix(".weight") + ".weight_scale_inv"]
        assert scale.dtype == "F32" and scale.shape == tuple(-(-d // 128) for d in out[n].shape)
    kept = [n for n in out if n in src and n not in fp8]
    assert set(kept) | set(fp8) == set(src)  # nothing dropped, nothing renamed
    for n in kept:  # carried byte for byte (the vision tower, MTP head, norms, embeddings)
        assert out[n].dtype == src[n].dtype and out[n].shape == src[n].shape
    q = json.loads((exported.out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["activation_scheme"] == "dynamic"
    assert q["weight_block_size"] == [128, 128]
    nc = q["modules_to_not_convert"]
    assert "lm_head" in nc and "model.language_model.layers.0.linear_attn.in_proj_a" in nc
    assert "model.visual.blocks.0.attn.qkv" in nc and "mtp.fc" in nc
    assert not any(n.removesuffix(".weight") in nc for n in fp8)
    files = lambda d: sorted(p.name for p in d.iterdir())  # noqa: E731
    assert files(exported.out) == files(exported.src)  # tokenizer and generation files travel too


def test_transformers_loads_the_export_and_its_logits_are_ours(exported):
    from transformers import Qwen3_5ForConditionalGeneration as HF

    fp8 = HF.from_pretrained(exported.out, dtype=torch.float32).eval()  # no GPU: dequantized
    src = HF.from_pretrained(exported.src, dtype=torch.float32).eval()
    tensors = arrays(exported.out)
    ours, bf16 = src.state_dict(), src.state_dict()
    n_fp8 = 0
    for name, q in tensors.items():
        if q.dtype != E4M3:
            continue
        n_fp8 += 1
        w = dequantize_blockwise(q, tensors[name.removesuffix(".weight") + ".weight_scale_inv"])
        got = fp8.state_dict()[name].numpy()
        assert np.array_equal(got, w), name  # transformers' dequantization is ours exactly
        ours[name] = torch.from_numpy(w)
        bf16[name] = ours[name].bfloat16().float()  # the same weights rounded to BF16 instead
    assert n_fp8 == exported.summary["quantized_tensors"]
    ref, rounded = (HF.from_pretrained(exported.src, dtype=torch.float32).eval() for _ in range(2))
    ref.load_state_dict(ours)
    rounded.load_state_dict(bf16)
    x = torch.from_numpy(IDS)
    with torch.no_grad():
        a, b, c, d = (m(input_ids=x).logits.numpy().astype(np.float64) for m in (fp8, ref, src, rounded))
    assert np.array_equal(a, b)  # the same weights give the same logits: the mapping is right
    # Against the unquantized source (‖Δ‖/‖ref‖). Measured on this random 4-layer model over three
    # seeds, both architectures: FP8 0.197-0.302, the same weights in BF16 0.0145-0.022; the weights'
    # own error is 0.026 (FP8) and ~0.0015 (BF16): a random tiny model amplifies weight noise ~10x
    # into its logits whatever the format (docs/export.md, "FP8").
    rel = lambda u: np.linalg.norm(u - c) / np.linalg.norm(c)  # noqa: E731
    assert rel(d) < rel(a) < 0.4, (rel(a), rel(d))


def test_cli_converts_a_base_and_refuses_what_it_cannot(exported, tmp_path, capsys):
    out = tmp_path / "cli"
    assert (
        cli_main(["export", "--format", "fp8", "--base", str(exported.src), "--out", str(out), "--json"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert (
        summary["format"] == "fp8" and summary["quantized_tensors"] == exported.summary["quantized_tensors"]
    )
    assert summary["bytes"] < summary["source_bytes"]
    a, b = arrays(out), arrays(exported.out)  # the command writes what export_fp8 wrote
    assert a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)) for k in a)
    # Already FP8: refused, naming the file.
    again = tmp_path / "again"
    assert cli_main(["export", "--format", "fp8", "--base", str(out), "--out", str(again)]) == 2
    assert "already quantized" in capsys.readouterr().err and not again.exists()
    # Flags that contradict each other or are missing.
    assert (
        cli_main(["export", "--format", "fp8", "--merged", "--base", str(exported.src), "--out", str(again)])
        == 2
    )
    assert "disagree" in capsys.readouterr().err
    assert cli_main(["export", "--out", str(again)]) == 2
    assert "--adapter is required" in capsys.readouterr().err
    assert cli_main(["export", "--format", "peft", "--size-of", "qwen3_5_27b"]) == 2
    assert "--format fp8" in capsys.readouterr().err
    assert not again.exists()


def test_ragged_weights_are_listed(tmp_path, capsys):
    """TINY's in_proj_qkv [160, 64] ends in a 32-row block: exported (vLLM's block-FP8 layout), and
    listed, since transformers' CPU dequantization infers a block of 80 rows from the grid."""
    src = make_checkpoint(tmp_path / "src", TINY, seed=2)
    assert cli_main(["export", "--format", "fp8", "--base", str(src), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert (
        "3 weights end in a partial 128x128 block (e.g. model.layers.0.linear_attn.in_proj_qkv.weight)" in err
    )
    t = arrays(tmp_path / "o")
    q, s = (
        t["model.layers.0.linear_attn.in_proj_qkv.weight"],
        t["model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"],
    )
    assert q.shape == (160, 64) and s.shape == (2, 1)
    w = arrays(src)["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert np.abs(dequantize_blockwise(q, s) - w).max() <= np.abs(w).max() * 2.0**-4


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("{not json", "config.json"),
        ('{"model_type": "qwen3_5_text", "hidden_size": "wide"}', "hidden_size"),
        ('{"model_type": "llama"}', "model_type"),
    ],
)
def test_a_malformed_config_is_named_and_nothing_is_written(tmp_path, capsys, config, says):
    src = make_checkpoint(tmp_path / "src", TINY, seed=2)
    (src / "config.json").write_text(config)
    out = tmp_path / "out"
    assert cli_main(["export", "--format", "fp8", "--base", str(src), "--out", str(out)]) == 2
    assert says in capsys.readouterr().err
    assert cli_main(["export", "--format", "fp8", "--size-of", str(src)]) == 2
    assert says in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_nan_weight_is_named_and_nothing_is_left(tmp_path, capsys):
    src = make_checkpoint(tmp_path / "src", TINY, seed=2)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 4] = np.nan
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert cli_main(["export", "--format", "fp8", "--base", str(src), "--out", str(out)]) == 2
    assert name in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no output, no hidden temporary


def test_base_plus_adapter_is_merged_then_quantized(tmp_path, capsys):
    import jax

    from jaxpi import load_hf
    from jaxpi.lora import LoraConfig, LoRAParam, add_lora
    from jaxpi.lora.peft import save_merged, save_peft

    base = make_checkpoint(tmp_path / "base", TINY, seed=4)
    _, model = load_hf(base)
    add_lora(
        model, LoraConfig(rank=2, alpha=4.0, targets=("gate_proj", "in_proj_qkv")), key=jax.random.key(0)
    )
    from flax import nnx

    for _, v in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        v.set_value(0.05 * jax.random.normal(jax.random.key(1), v.get_value().shape))
    adapter = save_peft(
        model,
        LoraConfig(rank=2, alpha=4.0, targets=("gate_proj", "in_proj_qkv")),
        tmp_path / "a",
        base_dir=base,
    )
    merged = save_merged(model, tmp_path / "merged", base_dir=base)
    out = tmp_path / "fp8"
    argv = [
        "export",
        "--adapter",
        str(adapter),
        "--base",
        str(base),
        "--out",
        str(out),
        "--format",
        "fp8",
        "--json",
    ]
    assert cli_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["adapter"] == str(adapter) and summary["source"] == "peft"
    want, got = arrays(merged), arrays(out)
    name = "model.layers.0.mlp.gate_proj.weight"
    q, s = quantize_blockwise(want[name])
    unmerged, _ = quantize_blockwise(arrays(base)[name])
    assert not np.array_equal(unmerged.view(np.uint8), q.view(np.uint8))  # the adapter moved the codes
    assert np.array_equal(got[name].view(np.uint8), q.view(np.uint8))
    assert np.array_equal(got[name.replace(".weight", ".weight_scale_inv")], s)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "base", "fp8", "merged"]  # scratch removed
    assert cli_main(argv) == 2 and "exists" in capsys.readouterr().err  # not replaced without --overwrite


# ---- sizes without weights -------------------------------------------------------------------------
# The 27B's one-layer MTP head written out by hand, with the names vLLM's Qwen3.5 MTP module loads
# (vllm/model_executor/models/qwen3_5_mtp.py: fc over [embedding; hidden], three norms, a decoder
# layer) and the shapes of a full-attention layer of the 27B (q_proj holds the query and its gate).
MTP_27B = {
    "mtp.fc.weight": (5120, 10240),
    "mtp.norm.weight": (5120,),
    "mtp.pre_fc_norm_embedding.weight": (5120,),
    "mtp.pre_fc_norm_hidden.weight": (5120,),
    "mtp.layers.0.input_layernorm.weight": (5120,),
    "mtp.layers.0.post_attention_layernorm.weight": (5120,),
    "mtp.layers.0.self_attn.q_proj.weight": (12288, 5120),
    "mtp.layers.0.self_attn.k_proj.weight": (1024, 5120),
    "mtp.layers.0.self_attn.v_proj.weight": (1024, 5120),
    "mtp.layers.0.self_attn.o_proj.weight": (5120, 6144),
    "mtp.layers.0.self_attn.q_norm.weight": (256,),
    "mtp.layers.0.self_attn.k_norm.weight": (256,),
    "mtp.layers.0.mlp.gate_proj.weight": (17408, 5120),
    "mtp.layers.0.mlp.up_proj.weight": (17408, 5120),
    "mtp.layers.0.mlp.down_proj.weight": (5120, 17408),
}


def test_vision_and_mtp_shapes_are_the_checkpoints(tmp_path):
    """The analytic vision tower is transformers' own module tree (defaults and the tiny one); the
    MTP head is the released 27B's, written out above; the fixture carries the same head."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {k: v for k, v in TINY.to_hf().items() if k != "architectures"}
    for vision in ({"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2}, {}):
        cfg = Qwen3_5Config(text_config=text, vision_config={**vision, "out_hidden_size": TINY.hidden_size})
        with torch.device("meta"):
            model = Qwen3_5ForConditionalGeneration(cfg)
        theirs = {n: tuple(p.shape) for n, p in model.state_dict().items() if n.startswith("model.visual.")}
        assert vision_shapes(vision, TINY.hidden_size) == theirs
    assert mtp_shapes(QWEN3_5_27B) == MTP_27B
    src = make_checkpoint(tmp_path / "c", TINY, kind="conditional", seed=0)
    index = read_index(src)
    assert {n: i.shape for n, i in index.items() if n.startswith("mtp.")} == mtp_shapes(TINY)


def test_27b_fp8_size_is_the_seed_reports(capsys):
    r = fp8_size(QWEN3_5_27B, vision=dict(VISION_DEFAULTS), mtp=True)
    text, vision, mtp = (r["parts"][k] for k in ("text", "vision", "mtp"))
    assert vision["tensors"] == 333 and mtp["tensors"] == 15  # the released checkpoint's counts
    # The seed: "the main download is about 30.39 GB" (text model in FP8, vision tower in BF16).
    assert abs((text["bytes"] + vision["bytes"]) / 30.39e9 - 1) < 0.01
    assert text["bf16_bytes"] / text["bytes"] > 1.8
    assert cli_main(["export", "--format", "fp8", "--size-of", "qwen3_5_27b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == r["bytes"]
    assert cli_main(["export", "--format", "fp8", "--size-of", "qwen3_5_27b"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[1].startswith("text") and "GB" in table


def test_size_of_a_config_json_counts_what_it_describes(tmp_path):
    src = make_checkpoint(tmp_path / "c", TINY, kind="conditional", seed=0)
    report = fp8_size(TINY, vision=json.loads((src / "config.json").read_text())["vision_config"], mtp=True)
    index = read_index(src)
    assert report["tensors"] == len(index)
    assert report["params"] == sum(int(np.prod(i.shape)) for i in index.values())
    exported = export_fp8(src, tmp_path / "o", dtype="BF16")
    assert exported["bytes"] == report["bytes"]  # the same sizes as the file the export writes


def test_sharded_bf16_export_loads_as_the_single_file_one(exported, tmp_path):
    """Small shards with an index, kept tensors cast to BF16: transformers reads the same model."""
    from transformers import Qwen3_5ForConditionalGeneration as HF

    out = tmp_path / "sharded"
    summary = export_fp8(exported.src, out, dtype="BF16", max_shard_bytes=150_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    index = read_index(out)
    assert {i.dtype for i in index.values()} == {"F8_E4M3", "F32", "BF16"}  # scales stay float32
    assert {i.dtype for n, i in index.items() if n.endswith("weight_scale_inv")} == {"F32"}
    assert summary["bytes"] == sum(i.end - i.begin for i in index.values())
    x = torch.from_numpy(IDS)
    with torch.no_grad():
        a = HF.from_pretrained(out, dtype=torch.float32).eval()(input_ids=x).logits
        b = HF.from_pretrained(exported.out, dtype=torch.float32).eval()(input_ids=x).logits
    # The same FP8 weights; only the kept tensors (embeddings, norms, head) rounded to BF16.
    assert 0 < float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_a_side_file_linked_out_of_the_checkpoint_is_refused(tmp_path, capsys):
    """As root, a downloaded checkpoint whose tokenizer.json links to a secret must not land in a
    world-readable export; a HF cache snapshot's links into its own blobs/ are followed."""
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0")
    src = make_checkpoint(tmp_path / "src", TINY, seed=2)
    (src / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    assert cli_main(["export", "--format", "fp8", "--base", str(src), "--out", str(out)]) == 2
    assert "outside the checkpoint" in capsys.readouterr().err and not out.exists()
    # The hub cache layout: snapshots/REV/file -> ../../blobs/HASH
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in (tmp_path / "src").iterdir():
        if f.name == "tokenizer.json":
            continue
        blob = repo / "blobs" / f.name
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    out = tmp_path / "from-cache"
    assert cli_main(["export", "--format", "fp8", "--base", str(snap), "--out", str(out)]) == 0
    assert (out / "generation_config.json").read_bytes() == (
        repo / "blobs" / "generation_config.json"
    ).read_bytes()

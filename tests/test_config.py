"""QwenConfig: HF config.json in and out, presets, validation."""

import dataclasses
import json

import pytest

from jaxpi.config import (
    FULL,
    GDN_KERNEL_KNOBS,
    GDN_KERNEL_PRECISIONS,
    LINEAR,
    QWEN3_5_27B,
    TINY,
    QwenConfig,
    parse_gdn_kernel,
    preset,
)


def test_27b_preset_matches_published_numbers():
    c = QWEN3_5_27B
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        64,
        5120,
        17408,
        248320,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 48)
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (128, 128, 4)
    assert c.rotary_dim == 64 and c.rope_theta == 1e7 and c.rms_norm_eps == 1e-6
    assert not c.tie_word_embeddings
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == list(range(3, 64, 4))


def test_from_hf_reads_both_checkpoint_kinds(tmp_path):
    text = QWEN3_5_27B.to_hf()
    causal = QwenConfig.from_hf(text)
    outer = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {k: v for k, v in text.items() if k != "architectures"},
        "vision_config": {"depth": 27},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(outer))
    multimodal = QwenConfig.from_hf(tmp_path)
    assert causal == multimodal == QwenConfig.from_hf(tmp_path / "config.json")
    for field in (
        "hidden_size",
        "layer_types",
        "rope_theta",
        "partial_rotary_factor",
        "linear_num_value_heads",
    ):
        assert getattr(causal, field) == getattr(QWEN3_5_27B, field)


def test_to_hf_round_trip_keeps_extras():
    raw = TINY.to_hf()
    raw["eos_token_id"] = 7
    raw["rope_parameters"]["mrope_section"] = [11, 11, 10]
    cfg = QwenConfig.from_hf(raw)
    again = cfg.to_hf()
    assert again["eos_token_id"] == 7
    assert again["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert QwenConfig.from_hf(again) == cfg
    hash(cfg)  # static argument of jitted functions


def test_layer_types_default_and_full_attention_interval():
    raw = {k: v for k, v in TINY.to_hf().items() if k != "layer_types"}
    raw.update(num_hidden_layers=6, full_attention_interval=3)
    cfg = QwenConfig.from_hf(raw)
    assert cfg.layer_types == (LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL)
    assert TINY.replace(num_hidden_layers=9).layer_types[3::4] == (FULL, FULL)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"linear_num_value_heads": 5}, "multiple of linear_num_key_heads"),
        ({"layer_types": ("linear_attention",)}, "layer_types has 1 entries"),
        ({"layer_types": ("moe",) * 4}, "unknown layer types"),
        ({"remat": "sometimes"}, "remat"),
        ({"gdn_chunk_size": 48}, "power of two"),
        ({"gdn_impl": "pallas", "gdn_kernel": "block_v=16,warps=4"}, r"'warps=4' is not NAME=VALUE"),
        ({"gdn_impl": "pallas", "gdn_kernel": "block_v=0"}, "block_v must be a positive integer"),
        ({"gdn_impl": "pallas", "gdn_kernel": "precision=fp8"}, "precision must be one of"),
        ({"gdn_kernel": "block_v=16"}, "applies only to gdn_impl pallas"),
        ({"attn_impl": "pallas", "attn_kernel": "block_q=0"}, "block_q must be a positive integer"),
        ({"attn_kernel": "block_q=32"}, "applies only to attn_impl pallas"),
    ],
)
def test_invalid_configs_are_explained(change, message):
    with pytest.raises(ValueError, match=message):
        TINY.replace(**change)


def test_from_hf_rejects_other_models(tmp_path):
    with pytest.raises(ValueError, match=r"not a Qwen3\.5"):
        QwenConfig.from_hf({**TINY.to_hf(), "model_type": "llama"})
    with pytest.raises(ValueError, match="rope_type"):
        QwenConfig.from_hf({**TINY.to_hf(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(FileNotFoundError):
        QwenConfig.from_hf(tmp_path)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("qwen9")


def test_gdn_kernel_settings_parse_to_the_kernel_options():
    from jaxpi.kernels.pallas import KernelOptions
    from jaxpi.kernels.pallas.gdn import _PRECISIONS

    assert parse_gdn_kernel("") == {}
    got = parse_gdn_kernel(" block_v=16, num_stages=2 ,precision=tf32,num_warps=8")
    assert got == {"block_v": 16, "num_stages": 2, "precision": "tf32", "num_warps": 8}
    assert KernelOptions(**got).resolve_block_v(128) == 16
    # the names and precisions accepted here are exactly the kernels' options
    assert set(GDN_KERNEL_PRECISIONS) == set(_PRECISIONS)
    assert set(GDN_KERNEL_KNOBS) == {f.name for f in dataclasses.fields(KernelOptions)} - {"interpret"}
    assert TINY.replace(gdn_impl="pallas_split", gdn_kernel="block_v=8").gdn_kernel == "block_v=8"

"""Every HF config field is honoured as transformers honours it, or refused with its name.

A property test against `transformers`' own `Qwen3_5TextConfig` / `Qwen3_5Config`: configs drawn
from valid ones with fields dropped, retyped (`"false"` for a bool, `1.0` for an int, a string
for a number) or changed. Whatever transformers refuses, jaxpi refuses; whatever jaxpi accepts,
transformers reads the same way (layer pattern, RoPE, eps, tying, pad row); what jaxpi refuses
and transformers accepts is one of the documented refusals, named in the error.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from jaxpi.config import QwenConfig
from jaxpi.hf_schema import HFConfigError

BASE = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 6,
}
OPTIONAL = {
    "linear_conv_kernel_dim": [2, 4, 6],
    "layer_types": [["linear_attention", "full_attention", "linear_attention"], None],
    "full_attention_interval": [1, 2, 4],
    "rms_norm_eps": [1e-6, 1e-5, 1],
    "tie_word_embeddings": [True, False],
    "pad_token_id": [0, 5, 63, -1, None],
    "rope_parameters": [
        {"rope_type": "default", "rope_theta": 5e5},
        {"rope_type": "default", "partial_rotary_factor": 0.5},
        {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        {"rope_type": "linear", "factor": 2.0},
    ],
    "rope_theta": [1e6],
    "hidden_act": ["silu", "gelu"],
    "attention_bias": [False, True],
    "attention_dropout": [0.0, 0.1],
    "max_position_embeddings": [4096],
    "bos_token_id": [1],
    "eos_token_id": [2, [2, 3]],
}
WRONG_TYPES = ["false", "tiny", 1.5, True, None, [], {}, -3]
# What jaxpi refuses although transformers accepts it, and the field the error must name.
REFUSALS = {
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "rope_type",
    "rope_parameters",
    "rms_norm_eps",
    "pad_token_id",
    "linear_conv_kernel_dim",
    "full_attention_interval",
    "rotary",
    *BASE,
}


@st.composite
def raw_configs(draw):
    cfg = dict(BASE)
    for name, values in OPTIONAL.items():
        if draw(st.booleans()):
            value = draw(st.sampled_from(values))
            if value is not None or name == "layer_types":
                cfg[name] = value
    for name in draw(st.lists(st.sampled_from(sorted(cfg)), max_size=2, unique=True)):
        how = draw(st.sampled_from(["drop", "retype"]))
        if how == "drop":
            cfg.pop(name)
        else:
            cfg[name] = draw(st.sampled_from(WRONG_TYPES))
    return cfg


def transformers_reads(cfg: dict):
    from transformers import Qwen3_5TextConfig

    try:
        return Qwen3_5TextConfig.from_dict(json.loads(json.dumps(cfg)))
    except Exception as e:  # transformers' strict dataclass errors are of several types
        return e


@fixed_seed(11)
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(raw_configs())
def test_fields_are_read_as_transformers_reads_them_or_refused_by_name(cfg):
    hf = transformers_reads(cfg)
    try:
        ours = QwenConfig.from_hf(cfg)
    except HFConfigError as e:
        ours = e
    if isinstance(hf, Exception):
        assert isinstance(ours, HFConfigError), f"transformers refuses ({hf}) but jaxpi reads {cfg}"
        return
    if isinstance(ours, HFConfigError):
        message = str(ours)
        assert any(name in message for name in REFUSALS), message
        return
    rope = hf.rope_parameters
    assert ours.layer_types == tuple(hf.layer_types), cfg
    assert ours.rope_theta == rope["rope_theta"], cfg
    assert ours.partial_rotary_factor == rope["partial_rotary_factor"], cfg
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.linear_conv_kernel_dim == hf.linear_conv_kernel_dim
    pad = hf.pad_token_id
    assert ours.pad_token_id == (None if pad is None else pad % hf.vocab_size)
    for name in BASE:
        assert getattr(ours, name) == getattr(hf, name), name


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"num_hidden_layers": 3.0}, "num_hidden_layers"),
        ({"vocab_size": True}, "vocab_size"),
        ({"layer_types": ["linear_attention", "moe", "full_attention"]}, "layer_types.1"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"pad_token_id": 64}, "pad_token_id"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
    ],
)
def test_bad_fields_are_named(change, field):
    with pytest.raises(HFConfigError) as err:
        QwenConfig.from_hf({**BASE, **change})
    assert field in str(err.value), str(err.value)


def test_conditional_generation_ties_by_its_top_level_flag():
    text = {**BASE, "tie_word_embeddings": True}
    outer = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False}
    assert not QwenConfig.from_hf(outer).tie_word_embeddings
    assert QwenConfig.from_hf({**outer, "tie_word_embeddings": True}).tie_word_embeddings
    with pytest.raises(HFConfigError, match=r"^text_config\.hidden_size"):
        QwenConfig.from_hf({**outer, "text_config": {**text, "hidden_size": "64"}})


def test_defaults_are_transformers_defaults():
    cfg = QwenConfig.from_hf(BASE)  # no rope, no layer_types, no eps, no tying given
    hf = transformers_reads(BASE)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 10_000.0
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.pad_token_id is None and not cfg.tie_word_embeddings
    assert QwenConfig.from_hf({**BASE, "pad_token_id": 7}).to_hf()["pad_token_id"] == 7

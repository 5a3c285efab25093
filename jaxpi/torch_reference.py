"""`transformers`' Qwen3.5 and Qwen3 as the parity reference: float32, bfloat16, and a true float64.

`transformers` computes several steps in float32 whatever the model's dtype: the RMSNorms
(`x.float()`), the gated norm, the rotary tables, the softmax, the decay gate
(`A_log.float()`) and the whole chunked gated delta rule (`.to(torch.float32)`). A model loaded
with `dtype=torch.float64` is therefore not a float64 computation: its DeltaNet gradients carry
the same float32 rounding as the float32 model's, and an arbiter built on it favours torch's own
float32 run. `float64_modeling()` executes the same modeling source with each of those upcasts
widened to float64 (a checked, textual change of the listed casts and nothing else), so the
reference is `transformers`' algorithm in double precision throughout. Each family's modeling
module is listed in `MODELING` with its upcasts (Qwen3's: the RMSNorm, the softmax, the rotary
tables). Tests check that it is:
its logits equal jaxpi's own float64 run to ~1e-13, where any float32 step would show at ~1e-7.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Modeling:
    """One family's `transformers` modeling module as the reference: its float32 upcasts (and how
    many it has: a new transformers release that moves them fails here instead of silently
    computing in float32), the towers its top class builds through AutoModel, and its model
    class per config `model_type`."""

    module: str
    upcasts: dict[str, int]
    towers: tuple[tuple[str, str], ...]  # (config attribute, this module's class) built via AutoModel
    classes: dict[str, str]  # config.json model_type -> the class that loads it


# Every modeling module the float64 arbiter knows how to widen, by HF model_type. A model built
# from any other module's classes is refused (`load_reference`).
MODELING: dict[str, Modeling] = {}
_QWEN3_5 = Modeling(
    "transformers.models.qwen3_5.modeling_qwen3_5",
    {
        ".to(torch.float32": 4,  # gated norm (2), chunked and recurrent gated delta rules
        "dtype=torch.float32)": 1,  # the attention softmax
        ".float()": 11,  # rotary tables (2), decay gate (2 + 1 in a comment), RMSNorm (2), rope on q/k (4)
        "dtype=torch.float)": 4,  # rotary inverse frequencies
    },
    (("text_config", "Qwen3_5TextModel"), ("vision_config", "Qwen3_5VisionModel")),
    {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM"},
)
_QWEN3 = Modeling(
    "transformers.models.qwen3.modeling_qwen3",
    {
        ".to(torch.float32": 1,  # RMSNorm
        "dtype=torch.float32)": 1,  # the attention softmax
        ".float()": 1,  # rotary positions
        "dtype=torch.float)": 2,  # rotary inverse frequencies (2)
    },
    (),
    {"qwen3": "Qwen3ForCausalLM"},
)
for _m in (_QWEN3_5, _QWEN3):
    MODELING.update(dict.fromkeys(_m.classes, _m))


def _widen(source: str, ref: Modeling = _QWEN3_5) -> str:
    name = ref.module
    found = {k: source.count(k) for k in ref.upcasts}
    if found != ref.upcasts:
        raise RuntimeError(
            f"{name}: its float32 upcasts changed ({found}, expected {ref.upcasts}); "
            "the float64 reference must be re-checked against this transformers version"
        )
    # a ConditionalGeneration model builds its towers through AutoModel, which would pick the
    # original (float32-upcasting) classes: build this module's own instead
    for tower, cls in ref.towers:
        call = f"AutoModel.from_config(config.{tower})"
        if source.count(call) != 1:
            raise RuntimeError(f"{name}: expected one {call}; the float64 reference must be re-checked")
        source = source.replace(call, f"{cls}._from_config(config.{tower})")
    out = source.replace(".to(torch.float32", ".to(torch.float64")
    out = out.replace("dtype=torch.float32)", "dtype=torch.float64)")
    out = out.replace(".float()", ".double()")
    out = out.replace("dtype=torch.float)", "dtype=torch.float64)")
    if "torch.float32" in out or "torch.float)" in out or ".float()" in out:
        raise RuntimeError(f"{name}: a float32 cast is left after widening")
    return out


@functools.cache
def float64_modeling(model_type: str = "qwen3_5_text") -> types.ModuleType:
    """The modeling module of `model_type` with its float32 upcasts widened to float64 (see the
    module docstring)."""
    ref = modeling(model_type)
    original = importlib.import_module(ref.module)
    path = Path(original.__file__)
    module = types.ModuleType(ref.module + "_float64")
    module.__file__ = str(path)
    module.__package__ = original.__package__
    sys.modules[module.__name__] = module
    # dont_inherit: this file's `from __future__ import annotations` would turn its annotations into strings
    exec(compile(_widen(path.read_text(), ref), str(path), "exec", dont_inherit=True), module.__dict__)
    return module


def modeling(model_type: str) -> Modeling:
    """The reference modeling module of a config.json `model_type`; an unknown one is refused."""
    try:
        return MODELING[model_type]
    except KeyError:
        raise ValueError(
            f"no float64 reference for model_type {model_type!r}; known: {sorted(MODELING)}"
        ) from None


def _quiet() -> None:
    import transformers

    # The fallback-kernel notices and load bars would drown the report.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_reference(hf_dir: str | Path, dtype: str) -> Any:
    """The checkpoint as a `transformers` model (eager attention, CPU, eval mode) in `dtype`:
    "float32", "bfloat16", or "float64" (`float64_modeling`'s classes)."""
    import torch
    from transformers import AutoConfig

    _quiet()
    kind = AutoConfig.from_pretrained(hf_dir).model_type
    ref = modeling(kind)
    module = float64_modeling(kind) if dtype == "float64" else importlib.import_module(ref.module)
    cls = getattr(module, ref.classes[kind])
    model = cls.from_pretrained(hf_dir, dtype=getattr(torch, dtype), attn_implementation="eager")
    foreign = {
        type(m).__qualname__
        for m in model.modules()
        if type(m).__module__.startswith("transformers.")
        and type(m).__module__ not in (module.__name__, "transformers.activations")
    }
    if foreign:  # a submodule built from another module's classes would compute in its precision
        raise RuntimeError(
            f"the {dtype} reference holds modules from outside {module.__name__}: {sorted(foreign)}"
        )
    return model.eval()


def reference_grads(
    hf_dir: str | Path, ids: np.ndarray, dtype: str, segment_ids: np.ndarray | None = None
) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """Logits, mean next-token loss and every parameter's gradient (as float64 numpy arrays).

    segment_ids [B, T]: packed rows. transformers has no packed form, so each segment runs on
    its own (positions from 0, no state carried in) and the loss is the mean over the next-token
    pairs inside segments: what a packed run must equal.
    """
    return run_reference(load_reference(hf_dir, dtype), ids, dtype, segment_ids)


def run_reference(
    model: Any, ids: np.ndarray, dtype: str, segment_ids: np.ndarray | None = None
) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """`reference_grads` on a loaded model (a transformers model, or a peft model around one: the
    gradients are then the trainable adapters'), keyed by `named_parameters`."""
    import torch
    import torch.nn.functional as F

    wide = torch.float64 if dtype == "float64" else torch.float32
    x = torch.tensor(ids, dtype=torch.long)
    if segment_ids is None:
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].to(wide).reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    else:
        rows, total, pairs = [], 0.0, 0
        for b in range(x.shape[0]):
            bounds = np.flatnonzero(np.diff(segment_ids[b])) + 1
            pieces = []
            for lo, hi in zip([0, *bounds], [*bounds, x.shape[1]], strict=True):
                part = x[b : b + 1, lo:hi]
                lg = model(input_ids=part, use_cache=False).logits
                pieces.append(lg[0])
                if hi - lo > 1:
                    total = total + F.cross_entropy(lg[0, :-1].to(wide), part[0, 1:], reduction="sum")
                    pairs += hi - lo - 1
            rows.append(torch.cat(pieces))
        logits = torch.stack(rows)
        loss = total / max(pairs, 1)
    loss.backward()
    grads = {n: p.grad.to(torch.float64).numpy() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().to(torch.float64).numpy(), float(loss.item()), grads


# ---- QLoRA: peft + bitsandbytes, and the float64 arbiter on the dequantized base ----------------


def quantization_config(base_quant: str, dtype: str) -> Any:
    """transformers' `BitsAndBytesConfig` of a QLoRA base: nf4 with double-quantized scales (blocks
    of 64, peft's QLoRA recipe) or LLM.int8, computing in `dtype`."""
    import torch
    from transformers import BitsAndBytesConfig

    if base_quant == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=getattr(torch, dtype),
        )
    if base_quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"base_quant must be nf4 or int8, not {base_quant!r}")


def load_quantized(hf_dir: str | Path, base_quant: str, dtype: str) -> Any:
    """The checkpoint with its linear layers quantized by bitsandbytes (CPU), weights cast to
    `dtype` before quantizing as transformers does, eager attention."""
    import torch
    from transformers import AutoConfig

    _quiet()
    kind = AutoConfig.from_pretrained(hf_dir).model_type
    ref = modeling(kind)
    cls = getattr(importlib.import_module(ref.module), ref.classes[kind])
    return cls.from_pretrained(
        hf_dir,
        dtype=getattr(torch, dtype),
        attn_implementation="eager",
        quantization_config=quantization_config(base_quant, dtype),
    )


def with_adapter(model: Any, adapter_dir: str | Path) -> Any:
    """`PeftModel.from_pretrained(model, adapter_dir)`, its adapters trainable, in train mode
    (bitsandbytes' CPU int8 layers run the dequantized matmul only while training)."""
    from peft import PeftModel

    peft = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    return peft.train()


def quantized_layers(model: Any) -> dict[str, Any]:
    """Every bitsandbytes linear layer of a model by its module name."""
    import bitsandbytes as bnb

    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def dequantized_weights(model: Any) -> dict[str, Any]:
    """`{parameter name: the weight as bitsandbytes computes with it}` of every quantized layer, in
    the layer's dtype: NF4 through `dequantize_4bit`; int8 as its CPU training matmul rebuilds it,
    `CB · (SCB · (1/127))`."""
    import bitsandbytes.functional as F
    import torch

    out = {}
    for name, layer in quantized_layers(model).items():
        w = layer.weight
        if hasattr(w, "quant_state"):
            out[f"{name}.weight"] = F.dequantize_4bit(w.data, w.quant_state)
        else:
            cb = w.data.to(torch.float32)
            out[f"{name}.weight"] = cb.mul_(w.SCB.unsqueeze(1).mul(1.0 / 127.0))
    return out


def quant_states(model: Any) -> dict[str, dict[str, np.ndarray]]:
    """The stored state of every quantized layer (numpy), by its weight's name: nf4 `codes` (packed,
    flat), `absmax` (8-bit codes), `scale` (second level), `offset`; int8 `codes`, `scale`."""
    out = {}
    for name, layer in quantized_layers(model).items():
        w = layer.weight
        if hasattr(w, "quant_state"):
            qs = w.quant_state
            out[f"{name}.weight"] = {
                "codes": w.data.numpy().reshape(-1),
                "absmax": qs.absmax.numpy(),
                "scale": qs.state2.absmax.numpy(),
                "offset": np.float32(qs.offset.item()),
            }
        else:
            out[f"{name}.weight"] = {"codes": w.data.numpy(), "scale": w.SCB.numpy()}
    return out


def dequantized_reference(hf_dir: str | Path, weights: dict[str, Any], adapter_dir: str | Path) -> Any:
    """The float64 arbiter of a QLoRA run: `float64_modeling`'s model with every quantized layer's
    weight replaced by the dequantized one (exact in float64), and the adapter on top."""
    import torch

    model = load_reference(hf_dir, "float64")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            if name not in params:
                raise KeyError(f"the float64 reference has no parameter {name!r}")
            params[name].copy_(w.to(torch.float64))
    return with_adapter(model, adapter_dir).double()

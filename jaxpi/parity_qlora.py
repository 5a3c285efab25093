"""QLoRA parity: jaxpi's quantized base + LoRA against peft + bitsandbytes on the same checkpoint.

    jaxpi      load_hf(base_quant=...) + adapters          (A random, B random: every factor gets a gradient)
    torch      transformers + BitsAndBytesConfig (CPU) + PeftModel.from_pretrained(the same adapter)
    arbiter    transformers in true float64 (`float64_modeling`) on bitsandbytes' dequantized
               weights (exact in float64) + the same adapter in float64

Both sides quantize the checkpoint themselves; the report says how their stored bases compare
(codes, scales, offsets: `quant`). With the same codes the two hold the same dequantized weights,
so the arbiter is the exact computation both approximate and each is judged as `jaxpi parity`
judges a dense base (`jaxpi.parity.judge`): jaxpi at most `ratio` times as far from float64 as
torch's own run of the dtype, on the logits and every LoRA factor's gradient. The base gets no
gradient on either side. docs/qlora.md has the measured bounds.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxpi.convert.hf import load_hf, text_prefix
from jaxpi.convert.quantize import quant_targets
from jaxpi.convert.safetensors_io import read_array, read_index
from jaxpi.convert.table import text_rules
from jaxpi.kernels.inject import inject_bug
from jaxpi.lora import LoraConfig, LoRAParam, add_lora
from jaxpi.lora.peft import adapter_tensors, base_prefix, save_peft
from jaxpi.parity import (
    DTYPES,
    ParityReport,
    choose_reference,
    jax_reference,
    judge_all,
    random_segments,
)
from jaxpi.quant import int8, nf4
from jaxpi.torch_reference import (
    dequantized_reference,
    dequantized_weights,
    load_quantized,
    quant_states,
    run_reference,
    with_adapter,
)

PEFT_TAG = ".default"  # the adapter's name inside peft's parameter names


def random_adapter(model: nnx.Module, lcfg: LoraConfig, seed: int) -> None:
    """Adapters with A as initialised and B drawn too (B = 0 would give A no gradient)."""
    add_lora(model, lcfg, key=jax.random.key(seed))
    rng = np.random.default_rng(seed)
    state = nnx.state(model, LoRAParam)
    filled = jax.tree.map(
        lambda v: v + (0.05 * rng.standard_normal(v.shape)).astype(np.float32) if v.ndim else v, state
    )
    nnx.update(model, filled)


def compare_bases(hf_dir: Path, base_quant: str, dtype: str, states: dict[str, dict]) -> dict:
    """How jaxpi's quantization of each HF tensor compares with bitsandbytes' stored state: the
    number of tensors whose codes, scales (8-bit codes and second level; int8 row absmax) and
    offsets are identical, and the largest offset difference in float32 ulps."""
    index = read_index(hf_dir)
    store = np.dtype(jax.numpy.dtype(dtype))
    counts = {"tensors": 0, "codes": 0, "scales": 0}
    if base_quant == "nf4":
        counts["offsets"] = 0
    ulps = 0
    for name, ref in states.items():
        if name not in index or name.startswith("model.visual."):
            continue
        w = read_array(index[name]).astype(store).astype(np.float32)
        counts["tensors"] += 1
        if base_quant == "nf4":
            t = nf4.quantize(w)
            same_offset = t.offset == ref["offset"]
            counts["codes"] += bool(np.array_equal(t.codes, ref["codes"]))
            counts["offsets"] += bool(same_offset)
            # scales compared given bitsandbytes' offset (jaxpi's mean may differ in the last bit)
            u = nf4.quantize(w, offset=ref["offset"])
            counts["scales"] += bool(
                np.array_equal(u.absmax, ref["absmax"]) and np.array_equal(u.scale, ref["scale"])
            )
            ulps = max(
                ulps, abs(int(t.offset.view(np.int32)) - int(np.float32(ref["offset"]).view(np.int32)))
            )
        else:
            t = int8.quantize(w)
            counts["codes"] += bool(np.array_equal(t.codes, ref["codes"]))
            counts["scales"] += bool(np.array_equal(t.scale, ref["scale"]))
    if base_quant == "nf4":
        counts["offset_ulps"] = ulps
    return counts


def check_dequantization(states: dict[str, dict], weights: dict) -> None:
    """Refuse a comparison whose torch side computes with weights other than its own codes say:
    bitsandbytes 0.50.2's AVX-512 CPU kernel (`dequantizeBlockwise4bitCpu`) indexes the block
    scales per row, so a weight whose input size is a multiple of 16 but not of 64 (blocks
    straddling rows) is dequantized with other rows' scales. Real Qwen3.5 shapes never hit it."""
    import torch

    wrong = []
    for name, st in states.items():
        if "offset" not in st or name.startswith("model.visual."):
            continue
        w = weights[name]
        t = nf4.NF4Tensor(st["codes"], st["absmax"], st["scale"], np.float32(st["offset"]), tuple(w.shape))
        want = torch.from_numpy(nf4.dequantize(t)).to(w.dtype)  # the float32 result, rounded as torch rounds
        if not torch.equal(want, w):
            wrong.append(f"{name} {list(w.shape)}")
    if wrong:
        raise ValueError(
            "bitsandbytes' dequantized weights disagree with its own stored codes for these (its AVX-512 CPU kernel "
            "indexes block scales per row, wrong when the input size is not a multiple of 64): "
            + ", ".join(wrong[:4])
            + (f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else "")
            + "; compare on a checkpoint whose linear inputs are multiples of 64"
        )


def _peft_grads(grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """torch's adapter gradients under the adapter file's names (peft's `.default` dropped)."""
    return {n.replace(PEFT_TAG, ""): g for n, g in grads.items() if "lora_" in n}


def run_qlora_parity(
    hf_dir: str | Path,
    *,
    base_quant: str = "nf4",
    seq_len: int = 64,
    batch: int = 2,
    dtype: str = "float32",
    seed: int = 0,
    inject: str | None = None,
    reference: str = "auto",
    segments: int = 1,
    rank: int = 4,
) -> ParityReport:
    """`jaxpi parity --base-quant nf4|int8`: logits, loss and every LoRA gradient of jaxpi's
    quantized base against peft + bitsandbytes, judged against float64 (module docstring)."""
    if base_quant not in ("nf4", "int8"):
        raise ValueError(f"base_quant must be nf4 or int8 for a QLoRA comparison, not {base_quant!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if seq_len < 2 or batch < 1:
        raise ValueError(f"seq_len ({seq_len}) must be >= 2 and batch ({batch}) >= 1")
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    reference, note = choose_reference(reference, hf_dir, batch, seq_len)
    cfg, model = load_hf(hf_dir, dtype=dtype, base_quant=base_quant)
    quant_targets(
        cfg, text_rules(cfg, text_prefix(read_index(hf_dir))), base_quant
    )  # refuses what it cannot store
    lcfg = LoraConfig(rank=rank, alpha=2.0 * rank, base_quant=base_quant)
    random_adapter(model, lcfg, seed)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq_len))
    segment_ids = random_segments(rng, batch, seq_len, segments)
    with tempfile.TemporaryDirectory(prefix="jaxpi-qlora-parity-") as tmp:
        adapter_dir = save_peft(model, lcfg, Path(tmp) / "adapter", base_dir=hf_dir, dtype="float32")
        precision = "highest" if dtype == "float32" else "default"
        with inject_bug(inject), jax.default_matmul_precision(precision):
            logits_j, loss_j, grads_j = jax_reference(model, ids, segment_ids, trainable=LoRAParam)
        # jaxpi's adapter gradients in the adapter file's layout and names
        nnx.update(model, nnx.from_flat_state([(p, LoRAParam(g)) for p, g in grads_j.items()]))
        ours = adapter_tensors(model, lcfg, base_prefix(hf_dir))
        del model

        quantized = load_quantized(hf_dir, base_quant, dtype)
        states, weights = quant_states(quantized), dequantized_weights(quantized)
        quant = compare_bases(hf_dir, base_quant, dtype, states)
        check_dequantization(states, weights)
        logits_t, loss_t, grads_t = run_reference(
            with_adapter(quantized, adapter_dir), ids, dtype, segment_ids
        )
        grads_t = _peft_grads(grads_t)
        del quantized
        missing = sorted(set(ours) ^ set(grads_t))
        if missing:
            raise KeyError(f"jaxpi's and peft's adapters differ: {missing[:4]}")
        if reference == "fp64":
            arbiter = dequantized_reference(hf_dir, weights, adapter_dir)
            logits_r, loss_r, grads_r = run_reference(arbiter, ids, "float64", segment_ids)
            grads_r = _peft_grads(grads_r)
            del arbiter
    fp64 = (logits_r, loss_r, grads_r) if reference == "fp64" else None
    judged = judge_all(dtype, ours, logits_j, (logits_t, loss_t, grads_t), fp64)
    return ParityReport(
        hf_dir=str(hf_dir),
        dtype=dtype,
        reference=reference,
        batch=batch,
        seq_len=seq_len,
        segments=max(segments, 1),
        inject=inject,
        loss_jax=loss_j,
        loss_torch=loss_t,
        **judged,
        note=note,
        seconds=time.perf_counter() - start,
        base_quant=base_quant,
        quant=quant,
    )

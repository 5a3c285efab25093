"""LoRA adapters on the linear layers of the Qwen3.5 text model.

For a frozen projection W (stored input-major, `[*in, *out]`) the adapted layer computes

    y = x·W + s · (drop(x)·A)·B          A: [*in, r]   B: [r, *out]   s = alpha / r

with B initialised to zero, so an adapter starts as the identity (as `peft` does), and `drop` the
inverted dropout `peft` applies to the adapter's input (only when the forward pass is given a
`dropout_key`). Targets are named as `peft`/HF name the modules: attention
`q_proj k_proj v_proj o_proj`, DeltaNet `in_proj_qkv in_proj_z in_proj_b in_proj_a out_proj`, MLP
`gate_proj up_proj down_proj`. HF's fused `in_proj_qkv` is stored by jaxpi as three projections, so
its adapter has one shared A and one B per part (`b_q`, `b_k`, `b_v`), which concatenate to `peft`'s
`lora_B`.

Which modules get an adapter: every module named in `targets`, optionally narrowed to some layers
(`layers`) and/or to the HF module paths a regex fullmatches (`pattern`, over paths relative to the
text model such as `layers.3.self_attn.q_proj`). In a scanned layer group the adapters of one
position are stacked over the groups; when only some of those layers are selected, a `LoRAMask`
(1.0 / 0.0 per group) zeroes the others' update, and so their gradients.

Adapter weights are `LoRAParam` variables (float32, with logical axes like every parameter), kept
apart from the frozen `nnx.Param` base weights: `nnx.state(model, LoRAParam)` is the trainable state.
They sit in the slots the model layer declares (`jaxpi.models.adapters`: the slot names, which are
the state paths, and `adapter_for`, through which `project` reads them), not in ad-hoc attributes.

Merging is a pure function over trees: `merged_params(params, lora, scale)` returns the `nnx.Param`
state with W + s·A·B in every adapted projection and `unmerged_params` its inverse; `merge_lora` /
`unmerge_lora` apply them to a model in place.

Modules: `config` (what to adapt), `adapters` (attach), `merge` (merge, unmerge: pure and in place),
`peft` (the peft format: export, merged export, import).
"""

from jaxpi.lora.adapters import LoRAMask, LoRAParam, adapted_modules, adapter_module, add_lora
from jaxpi.lora.config import ALL_LINEAR, HF_BLOCK, TARGETS, LoraConfig, module_paths, select_modules
from jaxpi.lora.merge import (
    ADAPTER,
    lora_deltas,
    merge_lora,
    merged_params,
    merged_state,
    model_scale,
    unmerge_lora,
    unmerged_params,
)

__all__ = [
    "ADAPTER",
    "ALL_LINEAR",
    "HF_BLOCK",
    "TARGETS",
    "LoRAMask",
    "LoRAParam",
    "LoraConfig",
    "adapted_modules",
    "adapter_module",
    "add_lora",
    "lora_deltas",
    "merge_lora",
    "merged_params",
    "merged_state",
    "model_scale",
    "module_paths",
    "select_modules",
    "unmerge_lora",
    "unmerged_params",
]

"""The model with its scanned layer groups unstacked: every layer a module of its own, in order.

The scanned layout keeps each parameter of a group position stacked over the G groups
(`groups/blocks/j/...`, `[G, ...]`), which keeps compile time flat in depth for training. A
forward pass then slices group g's weights out of the stack, and XLA:CPU makes each slice a copy:
for the decode engine that was a copy of every weight per prefill call and per decode call (and
per step, in the loop over groups of a deeper stack). Unstacked, layer `P·g + j` holds group g's
slice of position j (copied once, here), and the cache is per layer too.

    scanned:   groups/blocks/j/<name> [G, ...]   tail/i/<name>
    unstacked: tail/(P·g + j)/<name> [...]       tail/(P·G + i)/<name>

LoRA adapters move with their modules (a stacked adapter's per-group mask becomes a scalar).
`unstack_state` maps a (partial) state of the scanned layout, e.g. the trainer's adapters, onto
the unstacked one.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxpi.models.qwen3_5 import Qwen3_5ForCausalLM, layer_plan

STACK_AXIS = "layers"  # the logical name of the stacked axis (the groups' nnx.vmap)


def _slice(var: nnx.Variable, g: int) -> nnx.Variable:
    """Group g's slice of a stacked Variable, its logical axes without the stacked one."""
    sharding = var.get_metadata().get("out_sharding")
    meta = {}
    if sharding and sharding[0] == STACK_AXIS:
        meta["out_sharding"] = tuple(sharding[1:])
    return var.replace(var.get_value()[g], **meta)


def _group_slice(state: nnx.State, g: int) -> nnx.State:
    return jax.tree.map(lambda v: _slice(v, g), state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def unstack_layers(model: Qwen3_5ForCausalLM) -> Qwen3_5ForCausalLM:
    """The same model with every layer in the unrolled tail (`scan_layers` off). A model without
    groups is returned as is; otherwise the result holds copies of the groups' weights and shares
    the rest (embedding, tail layers, norm, LM head) with `model`."""
    if model.groups is None:
        return model
    p, g = layer_plan(model.cfg)
    new = nnx.merge(*nnx.split(model))  # new module objects over the same arrays
    blocks = []
    for gi in range(g):
        for j in range(p):
            graphdef, state = nnx.split(model.groups.blocks[j])
            blocks.append(nnx.merge(graphdef, _group_slice(state, gi)))
    new.cfg = model.cfg.replace(scan_layers=False)
    new.groups = None
    new.tail = nnx.List([*blocks, *new.tail])
    return new


def unstack_state(cfg: Any, state: nnx.State) -> nnx.State:
    """A (partial) state of the scanned layout (`cfg` its config) on the unstacked layout's paths:
    `groups/blocks/j/...` `[G, ...]` becomes G entries `tail/(P·g + j)/...`, `tail/i/...` moves to
    `tail/(P·G + i)/...`, the rest keeps its path."""
    p, g = layer_plan(cfg)
    if not g:
        return state
    out: dict[tuple, nnx.Variable] = {}
    for path, var in nnx.to_flat_state(state):
        if path[:2] == ("groups", "blocks"):
            j, rest = int(path[2]), path[3:]
            for gi in range(g):
                out[("tail", p * gi + j, *rest)] = _slice(var, gi)
        elif path[:1] == ("tail",):
            out[("tail", p * g + int(path[1]), *path[2:])] = var
        else:
            out[path] = var
    return nnx.from_flat_state(out)

"""Sharding strategies as data: tables from logical axis names to mesh axes.

The model names the axes of every parameter (`("layers", "embed", "q_heads", "head_dim")`) and of
the activations at block boundaries (`("batch", "seq", "embed")`); a `Strategy` says which mesh
axes each logical axis is split over, once for parameters and once for activations. Everything
else — `PartitionSpec`s, `NamedSharding`s for a parameter state, an optax state, a batch, the
resolver the model's `constrain` calls — is derived here from those two tables and a mesh.

LoRA factors follow the table like every parameter (A has the adapted weight's input axes and
`lora_rank`, B `lora_rank` and its output axes), so a factor whose axes the table does not split
would sit whole on every device (under FSDP: B of q_proj, A of down_proj, ...). A strategy's
`adapters` mesh axes (ZeRO-3 for the adapters; `fsdp` in the FSDP strategies) take such a factor:
it is split over them on its largest dimension they divide (never `layers` or `lora_rank`), and
its optimizer state with it. The model gathers each factor for its use as the activation table
says (`jaxpi.models.layers.for_use`), so how a factor is stored never reaches the product.

Resolution rules (`spec_for`):
- mesh axes the mesh lacks, or of size 1, are dropped (one table serves every mesh shape);
- two logical axes of one tensor on the same mesh axis is an error (`ShardingCollisionError`);
- a dimension its mesh axes do not divide keeps the longest prefix of them that does (often none:
  replicated) and the fact is recorded as a `Fallback` (27B: 4 kv heads on `tensor=8`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxpi.axes import ActivationResolver, activation_sharding

MeshAxes = str | Sequence[str] | None
MeshLike = Mesh | AbstractMesh
Fallbacks = MutableSequence["Fallback"]


class ShardingCollisionError(ValueError):
    """Two logical axes of one tensor are mapped to the same mesh axis."""


@dataclass(frozen=True)
class Fallback:
    """A dimension the table asked to split over `mesh_axes` that they do not divide."""

    tensor: str
    logical_axis: str
    size: int
    mesh_axes: tuple[str, ...]
    mesh_size: int
    kept: tuple[str, ...]  # the prefix of `mesh_axes` still used; () means replicated

    def __str__(self) -> str:
        kept = f"split over {'×'.join(self.kept)} only" if self.kept else "replicated"
        return (
            f"{self.tensor}: {self.logical_axis} ({self.size}) is not divisible by "
            f"{'×'.join(self.mesh_axes)} ({self.mesh_size}); {kept}"
        )


def _as_axes(value: MeshAxes, where: str) -> tuple[str, ...]:
    """Normalise a table value (None, "fsdp", ("data", "fsdp")) to a tuple of mesh axis names."""
    if value is None:
        axes: tuple = ()
    elif isinstance(value, str):
        axes = (value,)
    elif isinstance(value, Sequence):
        axes = tuple(value)
    else:
        raise ValueError(f"{where}: {value!r} is not a mesh axis name, a sequence of them, or None")
    for a in axes:
        if not isinstance(a, str) or not a.isidentifier():
            raise ValueError(f"{where}: mesh axis {a!r} is not an identifier")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{where}: mesh axes {axes} repeat an axis")
    return axes


def _as_table(table: Mapping[str, MeshAxes], where: str) -> Mapping[str, tuple[str, ...]]:
    if not isinstance(table, Mapping):
        raise TypeError(
            f"{where} must be a mapping from logical axis to mesh axes, not {type(table).__name__}"
        )
    out = {}
    for logical, value in table.items():
        if not isinstance(logical, str) or not logical.isidentifier():
            raise ValueError(f"{where}: logical axis {logical!r} is not an identifier")
        out[logical] = _as_axes(value, f"{where}[{logical!r}]")
    return MappingProxyType(out)


@dataclass(frozen=True)
class Strategy:
    """Which mesh axes each logical axis is split over; a logical axis not listed is replicated.

    `params` applies to parameters (and so to gradients and the optimizer state that mirrors
    them), `activations` to the tensors the model passes to `constrain` (`batch`, `seq`, ...).
    """

    name: str
    params: Mapping[str, MeshAxes] = field(default_factory=dict, hash=False)
    activations: Mapping[str, MeshAxes] = field(default_factory=dict, hash=False)
    description: str = field(default="", compare=False)
    # Mesh axes a LoRA factor the params table leaves on none of them is split over (see above).
    adapters: MeshAxes = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"strategy name {self.name!r} is not an identifier")
        # Frozen, read-only copies: a strategy cannot change after it has placed arrays.
        object.__setattr__(self, "params", _as_table(self.params, f"strategy {self.name!r} params"))
        object.__setattr__(
            self, "activations", _as_table(self.activations, f"strategy {self.name!r} activations")
        )
        object.__setattr__(self, "adapters", _as_axes(self.adapters, f"strategy {self.name!r} adapters"))

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis the strategy uses, in table order."""
        seen = [a for t in (self.params, self.activations) for axes in t.values() for a in axes]
        return tuple(dict.fromkeys([*seen, *self.adapters]))

    def describe(self) -> str:
        """The two tables as text (one line per logical axis)."""
        keys = list(dict.fromkeys([*self.params, *self.activations]))

        def fmt(t: Mapping[str, tuple[str, ...]], k: str) -> str:
            return ",".join(t[k]) if t.get(k) else "-"

        rows = [
            f"  {k:<12} params: {fmt(self.params, k):<12} activations: {fmt(self.activations, k)}"
            for k in keys
        ]
        if self.adapters:
            rows.append(f"  {'(adapters)':<12} params: {','.join(self.adapters)}")
        return "\n".join([f"{self.name}: {self.description}".rstrip(": "), *rows])


# ---- built-in strategies ------------------------------------------------------------------------
# `fsdp` is a data axis for activations in every strategy: with ZeRO-3 each fsdp shard computes on
# its own slice of the batch; in `dp`/`tp` a mesh's fsdp axis simply acts as more data parallelism.
_BATCH = {"batch": ("data", "fsdp")}
# Megatron: heads, MLP columns (rows of down_proj) and the vocabulary are split; the residual
# stream [B, T, D] stays whole on every tensor shard (one all-reduce after each block's output).
_MEGATRON = {a: "tensor" for a in ("q_heads", "kv_heads", "gdn_k_heads", "gdn_v_heads", "mlp", "vocab")}

DP = Strategy(
    "dp", params={}, activations=_BATCH, description="data parallel: params replicated, batch split"
)
FSDP = Strategy(
    "fsdp",
    params={"embed": "fsdp"},
    activations=_BATCH,
    description="ZeRO-3: params, grads and optimizer state split on embed over fsdp; batch split",
    adapters="fsdp",
)
TP = Strategy(
    "tp",
    params=_MEGATRON,
    activations={**_BATCH, **_MEGATRON},
    description="Megatron tensor parallel: heads, MLP and vocab over tensor; batch over data",
)
FSDP_TP = Strategy(
    "fsdp_tp",
    params={"embed": "fsdp", **_MEGATRON},
    activations={**_BATCH, **_MEGATRON},
    description="ZeRO-3 over fsdp combined with Megatron tensor parallelism over tensor",
    adapters="fsdp",
)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DP, FSDP, TP, FSDP_TP)}


def get_strategy(name: str | Strategy) -> Strategy:
    """A built-in (or registered) strategy by name; a `Strategy` passes through."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown sharding strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def register_strategy(strategy: Strategy, *, overwrite: bool = False) -> Strategy:
    """Add a strategy to `STRATEGIES` (so `get_strategy` and the CLI find it by name)."""
    if strategy.name in STRATEGIES and not overwrite and STRATEGIES[strategy.name] != strategy:
        raise ValueError(f"a different strategy named {strategy.name!r} is already registered")
    STRATEGIES[strategy.name] = strategy
    return strategy


# ---- resolution ---------------------------------------------------------------------------------
def spec_for(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    table: Mapping[str, MeshAxes],
    mesh: MeshLike | Mapping[str, int],
    *,
    name: str = "tensor",
    fallbacks: Fallbacks | None = None,
) -> PartitionSpec:
    """The `PartitionSpec` of a tensor with these logical axes and shape (one entry per dimension).

    Raises `ShardingCollisionError` (naming `name`, both logical axes and the mesh axis) when two
    dimensions claim one mesh axis — whatever the mesh, so a table is valid or not on its own.
    Appends a `Fallback` to `fallbacks` for each dimension its mesh axes do not divide.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(
            f"{name}: {len(logical_axes)} logical axes {tuple(logical_axes)} for shape {tuple(shape)}"
        )
    sizes = dict(mesh.shape) if not isinstance(mesh, Mapping) else dict(mesh)
    claimed: dict[str, str] = {}
    entries: list[str | tuple[str, ...] | None] = []
    for logical, dim in zip(logical_axes, shape, strict=True):
        wanted = _as_axes(table.get(logical), f"{name}[{logical!r}]") if logical is not None else ()
        for a in wanted:
            if a in claimed:
                raise ShardingCollisionError(
                    f"{name}: logical axes {claimed[a]!r} and {logical!r} are both mapped to mesh axis {a!r}"
                )
            claimed[a] = logical
        axes = tuple(a for a in wanted if sizes.get(a, 1) > 1)
        kept = _divisible_prefix(axes, dim, sizes)
        if kept != axes and fallbacks is not None:
            record = Fallback(name, logical, int(dim), axes, math.prod(sizes[a] for a in axes), kept)
            if record not in fallbacks:
                fallbacks.append(record)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def _divisible_prefix(axes: tuple[str, ...], dim: int, sizes: Mapping[str, int]) -> tuple[str, ...]:
    for n in range(len(axes), 0, -1):
        if dim % math.prod(sizes[a] for a in axes[:n]) == 0:
            return axes[:n]
    return ()


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes_of(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axes a parameter was declared with (None if it carries none)."""
    axes = var.get_metadata().get("out_sharding")
    return None if axes is None else tuple(axes)


def param_shardings(
    state: nnx.State, strategy: Strategy, mesh: MeshLike, *, fallbacks: Fallbacks | None = None
) -> nnx.State:
    """`NamedSharding`s for a parameter state, as a state of the same structure.

    Works on `nnx.eval_shape` output (nothing is allocated) or on real arrays; the result is what
    `jax.jit(in_shardings=..., out_shardings=...)` and `jax.device_put` take for that state.
    Variables without logical axes are replicated.
    """

    def one(path: tuple, var: nnx.Variable) -> nnx.Variable:
        shape = tuple(var.get_value().shape)
        axes = logical_axes_of(var)
        if axes is None:
            return var.replace(NamedSharding(mesh, PartitionSpec()))
        spec = spec_for(axes, shape, strategy.params, mesh, name=_path_str(path), fallbacks=fallbacks)
        if LORA_RANK in axes:
            spec = adapter_spec(spec, axes, shape, strategy.adapters, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


LORA_RANK = "lora_rank"  # the logical axis of a LoRA factor's rank (jaxpi.lora)
# Never split: the rank (r columns of every token's x·A; at rank 32 no 64-way split divides it)
# and the stacked layer axis (the layer scan slices it, so a split would gather it every step).
_NEVER_SPREAD = (LORA_RANK, "layers")


def adapter_spec(
    spec: PartitionSpec,
    axes: Sequence[str | None],
    shape: Sequence[int],
    over: Sequence[str],
    mesh: MeshLike | Mapping[str, int],
) -> PartitionSpec:
    """`spec` of a LoRA factor, split over the mesh axes `over` on its largest free dimension they
    divide when the table put it on none of them (see the module docstring); else `spec`."""
    sizes = dict(mesh.shape) if not isinstance(mesh, Mapping) else dict(mesh)
    over = tuple(a for a in over if sizes.get(a, 1) > 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if not over or used & set(over):
        return spec
    n = math.prod(sizes[a] for a in over)
    free = [
        i
        for i, (ax, e) in enumerate(zip(axes, entries, strict=True))
        if e is None and ax not in _NEVER_SPREAD
    ]
    fits = [i for i in free if shape[i] % n == 0]
    if not fits:
        return spec
    i = max(fits, key=lambda k: (shape[k], -k))  # the largest; the first of equals
    entries[i] = over[0] if len(over) == 1 else over
    return PartitionSpec(*entries)


def _path_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def opt_state_shardings(opt_state: Any, params: Any, shardings: Any, mesh: MeshLike) -> Any:
    """Shardings for an optax state: every subtree shaped like `params` (Adam's mu and nu, a
    momentum trace, ...) gets `shardings`, the params' own; everything else (step counts,
    scalars, empty states) is replicated.

    Subtrees are matched by tree structure and leaf shapes, never by name, so any optax chain
    works; `opt_state` and `params` may be abstract (`jax.eval_shape(optimizer.init, params)`).
    """
    target = jax.tree.structure(params)
    shapes = [tuple(x.shape) for x in jax.tree.leaves(params)]
    replicated = NamedSharding(mesh, PartitionSpec())

    def mirrors_params(node: Any) -> bool:
        return (
            jax.tree.structure(node) == target
            and [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(node)] == shapes
        )

    def place(node: Any) -> Any:
        return shardings if mirrors_params(node) else replicated

    return jax.tree.map(place, opt_state, is_leaf=mirrors_params)


def activation_resolver(
    strategy: Strategy, mesh: MeshLike, *, fallbacks: Fallbacks | None = None
) -> ActivationResolver:
    """The resolver `jaxpi.models.params.activation_sharding` installs for `constrain`."""

    @functools.cache
    def resolve(logical_axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        name = f"activation {logical_axes}"
        spec = spec_for(logical_axes, shape, strategy.activations, mesh, name=name, fallbacks=fallbacks)
        return NamedSharding(mesh, spec)

    return resolve


def batch_sharding(
    strategy: Strategy,
    mesh: MeshLike,
    shape: Sequence[int],
    logical_axes: Sequence[str | None] = ("batch", "seq"),
    *,
    fallbacks: Fallbacks | None = None,
) -> NamedSharding:
    """The sharding of a `[B, T]` input batch (token ids, loss mask, segment ids)."""
    spec = spec_for(logical_axes, shape, strategy.activations, mesh, name="batch", fallbacks=fallbacks)
    return NamedSharding(mesh, spec)


def with_activation_constraints(
    fn: Callable[..., Any], strategy: Strategy, mesh: MeshLike, *, fallbacks: Fallbacks | None = None
) -> Callable[..., Any]:
    """`fn` with the strategy's activation resolver installed while it runs (i.e. while jit
    traces it), so that the model's `constrain` calls become sharding constraints."""
    resolver = activation_resolver(strategy, mesh, fallbacks=fallbacks)

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with activation_sharding(resolver):
            return fn(*args, **kwargs)

    return traced


ShardingFn = Callable[[tuple, tuple], jax.sharding.Sharding]


def loader_shardings(
    state: nnx.State, strategy: Strategy, mesh: MeshLike, *, fallbacks: Fallbacks | None = None
) -> ShardingFn:
    """The `shardings=` callback of `jaxpi.convert.load_hf`: `fn(path, logical_axes)`.

    `state` is the model's abstract parameter state (`nnx.state(nnx.eval_shape(...), nnx.Param)`);
    shapes come from it, since divisibility decides the spec.
    """
    by_path = {
        tuple(p): v for p, v in nnx.to_flat_state(param_shardings(state, strategy, mesh, fallbacks=fallbacks))
    }
    declared = {tuple(p): logical_axes_of(v) for p, v in nnx.to_flat_state(state)}

    def fn(path: tuple, logical_axes: tuple) -> jax.sharding.Sharding:
        path = tuple(path)
        if path not in by_path:
            raise KeyError(
                f"no parameter {'/'.join(map(str, path))} in the state the shardings were planned for"
            )
        if tuple(logical_axes or ()) != tuple(declared[path] or ()):
            raise ValueError(
                f"{'/'.join(map(str, path))}: loader gives logical axes {tuple(logical_axes)}, "
                f"the planned state {declared[path]}"
            )
        return by_path[path].get_value()

    return fn

"""What LoRA adapts: `LoraConfig` (rank, alpha, dropout, targets, layers, pattern) and its
resolution against a model's config (`select_modules`), over the HF table's linear modules."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from jaxpi.config import FULL, QwenConfig
from jaxpi.convert.table import LINEAR_MODULES, LINEAR_NAMES
from jaxpi.quant import check_base_quant

# Views of the HF table's linear modules (`jaxpi.convert.table.LINEAR_MODULES`).
# HF module name -> (owning block, our projection attributes). One A per HF module, one B per part.
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {m.hf: (m.block, m.parts) for m in LINEAR_MODULES}
ALL_LINEAR = LINEAR_NAMES
# Our block -> the HF submodule that holds it inside `layers.N`.
HF_BLOCK = {m.block: m.hf_block for m in LINEAR_MODULES}
# Number of leading (input) dims of each stored projection (when not 1); the rest are output dims.
IN_DIMS = {p: m.n_in for m in LINEAR_MODULES for p in m.parts if m.n_in != 1}


def _layers(value: object) -> tuple[int, ...] | None:
    """`layers` as a sorted tuple: from ints, a range, or text like "0,3,8-11" (YAML / CLI)."""
    if value is None:
        return None
    if isinstance(value, str):
        out: list[int] = []
        for part in value.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"LoRA layers {value!r}: expected indices like '0,3,8-11'")
            out += range(int(lo), int(hi or lo) + 1)
        value = out
    if not isinstance(value, Iterable):
        raise ValueError(f"LoRA layers must be layer indices, got {value!r}")
    items = list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise ValueError(f"LoRA layers must be non-negative integers, got {items}")
    if not items:
        raise ValueError("LoRA layers is empty: give at least one layer index (or None for all)")
    return tuple(sorted(set(items)))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapter shape and placement.

    `targets`: HF module names. `layers`: layer indices (a list, a range or "0,3,8-11"; None = all).
    `pattern`: a regex that must fullmatch a module's path relative to the text model, e.g.
    `layers\\.(1|3)\\..*\\.q_proj` (paths look like `layers.0.linear_attn.in_proj_qkv`,
    `layers.3.self_attn.o_proj`, `layers.5.mlp.up_proj`). A module is adapted when all given
    criteria select it; `select_modules` resolves them against a model and rejects an empty match.
    `base_quant`: how the frozen base is stored under the adapters: "none" (the base dtype),
    "nf4" (QLoRA: bitsandbytes' 4-bit NormalFloat with double-quantized scales) or "int8"
    (bitsandbytes' row-wise absmax int8); every linear layer of the text layers is quantized.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_LINEAR
    layers: tuple[int, ...] | None = None
    pattern: str | None = None
    base_quant: str = "none"

    def __post_init__(self) -> None:
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "layers", _layers(self.layers))
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA targets {unknown}; known: {list(TARGETS)}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module")
        check_base_quant(self.base_quant, "lora.base_quant")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"LoRA pattern {self.pattern!r} is not a valid regex: {e}") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def module_paths(cfg: QwenConfig) -> list[tuple[int, str, str]]:
    """(layer, HF module name, path relative to the text model) of every adaptable linear layer."""
    out = []
    for i, layer_type in enumerate(cfg.layer_types):
        owners = ("attn" if layer_type == FULL else "gdn", "mlp")
        out += [
            (i, hf, f"layers.{i}.{HF_BLOCK[kind]}.{hf}")
            for hf, (kind, _) in TARGETS.items()
            if kind in owners
        ]
    return out


def select_modules(cfg: QwenConfig, lcfg: LoraConfig) -> list[tuple[int, str]]:
    """The (layer, HF module name) pairs `lcfg` adapts in a model of config `cfg`, in layer order."""
    n = cfg.num_hidden_layers
    if lcfg.layers is not None and lcfg.layers[-1] >= n:
        bad = [i for i in lcfg.layers if i >= n]
        raise ValueError(f"LoRA layers {bad} out of range: the model has {n} layers (0..{n - 1})")
    paths = module_paths(cfg)
    rx = re.compile(lcfg.pattern) if lcfg.pattern is not None else None
    if rx is not None and not any(rx.fullmatch(p) for _, _, p in paths):
        raise ValueError(
            f"LoRA pattern {lcfg.pattern!r} matches no module of this model; it must fullmatch paths "
            f"like {paths[0][2]!r} or 'layers.{n - 1}.mlp.down_proj'"
        )
    chosen = [
        (i, hf)
        for i, hf, p in paths
        if hf in lcfg.targets
        and (lcfg.layers is None or i in lcfg.layers)
        and (rx is None or rx.fullmatch(p))
    ]
    if not chosen:
        raise ValueError(
            f"LoRA selection matches no module: targets={list(lcfg.targets)}, layers={lcfg.layers}, "
            f"pattern={lcfg.pattern!r} (attention modules live in {cfg.layer_types.count(FULL)} of "
            f"{n} layers, DeltaNet modules in the rest)"
        )
    return chosen

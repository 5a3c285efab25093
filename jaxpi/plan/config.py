"""What `jaxpi plan` is asked on the command line (`PlanConfig`): one step's shape, the mesh (or a
sharding preset that gives it), and the strategies to compile, one `PlanRequest` each. No jax here:
the mesh must be known before jax starts its backend."""

from __future__ import annotations

import dataclasses
import math

from jaxpi.config import ATTN_IMPLS, GDN_IMPLS, REMAT_POLICIES
from jaxpi.configfile import parse_size
from jaxpi.plan.presets import load_preset
from jaxpi.quant import BASE_QUANTS

DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """One `jaxpi plan` run (`jaxpi plan --help` lists every key with its flag)."""

    model: str = "qwen3_5_27b"  # model preset (qwen3_5_27b, qwen3_5_9b, tiny, qwen3_8b, qwen3_tiny)
    mesh: str | None = None  # e.g. fsdp=64 or data=2,fsdp=4,tensor=2; None: the preset's
    dcn: str | None = None  # the part of each axis across slices/hosts, e.g. data=2
    preset: str | None = None  # configs/sharding/NAME.yaml (or a path): mesh, dcn, device memory, strategy
    strategy: str | None = None  # dp, fsdp, tp, fsdp_tp; None: the preset's, else fsdp
    compare: tuple[str, ...] = ()  # strategies compiled side by side, one column each
    seq_len: int = 8192
    batch_per_device: int = 1
    lora_rank: int | None = None  # LoRA on all linear layers; None: full fine-tuning
    # bytes per device, or a size such as 95GiB; the run exits 1 when the step does not fit
    device_memory: int | str | None = None
    dtype: str = "bfloat16"
    remat: str = "full"  # what each layer group saves for the backward (one of REMAT_POLICIES)
    loss_chunk: int = 0  # the LM head this many positions at a time (0: all at once)
    attn_impl: str = "jax"  # QwenConfig.attn_impl: jax (blocked, scores kept) | pallas (flash)
    gdn_impl: str = "jax"  # QwenConfig.gdn_impl, compiled as given
    # true: the analytic figures only, in seconds (the peak and the fit verdict are then the
    # analytic arguments + temp, which ran 8-31% below the compiled temp on one device)
    no_compile: bool = False
    # the frozen base: none (dtype), nf4 or int8 (QLoRA; needs lora_rank)
    base_quant: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "compare", tuple(s.strip() for s in self.compare if s.strip()))
        if self.preset:  # the preset fills what was not given
            p = load_preset(self.preset)
            object.__setattr__(self, "mesh", self.mesh or p.mesh)
            object.__setattr__(self, "dcn", self.dcn or p.dcn)
            if self.device_memory is None and p.device_memory:
                object.__setattr__(self, "device_memory", p.device_memory)
            if not self.strategy and not self.compare:
                object.__setattr__(self, "strategy", p.strategy)
        if self.device_memory is not None:
            object.__setattr__(self, "device_memory", parse_size(self.device_memory))
        errors = []
        if not self.mesh:
            errors.append("give --mesh (e.g. fsdp=64) or --preset (mesh=..., preset=...)")
        if self.seq_len < 2:
            errors.append(f"seq_len must be >= 2, got {self.seq_len}")
        if self.batch_per_device < 1:
            errors.append(f"batch_per_device must be >= 1, got {self.batch_per_device}")
        if self.lora_rank is not None and self.lora_rank < 1:
            errors.append(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.loss_chunk < 0:
            errors.append(f"loss_chunk must be >= 0 (0: the LM head at once), got {self.loss_chunk}")
        if self.base_quant not in BASE_QUANTS:
            errors.append(f"base_quant must be one of {', '.join(BASE_QUANTS)}, got {self.base_quant!r}")
        elif self.base_quant != "none" and self.lora_rank is None:
            errors.append(
                f"base_quant {self.base_quant!r} needs LoRA (--lora-rank): a quantized base is frozen, "
                "and without lora_rank the plan is full fine-tuning"
            )
        for name, allowed in (
            ("dtype", DTYPES),
            ("remat", REMAT_POLICIES),
            ("attn_impl", ATTN_IMPLS),
            ("gdn_impl", GDN_IMPLS),
        ):
            if getattr(self, name) not in allowed:
                errors.append(f"{name} {getattr(self, name)!r} is not one of {tuple(allowed)}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def strategies(self) -> list[str]:
        """The strategies to compile: `compare`'s, else the one `strategy` (fsdp by default)."""
        return list(self.compare) if self.compare else [self.strategy or "fsdp"]

    def request_fields(self, strategy: str) -> dict:
        """`PlanRequest`'s fields for one strategy."""
        return {
            "model": self.model,
            "mesh": self.mesh,
            "strategy": strategy,
            "seq_len": self.seq_len,
            "batch_per_device": self.batch_per_device,
            "lora_rank": self.lora_rank,
            "device_memory": self.device_memory,
            "dtype": self.dtype,
            "remat": self.remat,
            "dcn": self.dcn,
            "loss_chunk": self.loss_chunk,
            "attn_impl": self.attn_impl,
            "gdn_impl": self.gdn_impl,
            "compile": not self.no_compile,
            "base_quant": self.base_quant,
        }

    @property
    def devices(self) -> int | None:
        """The mesh's device count; None for a mesh `PlanRequest` will refuse with the reason."""
        try:
            return math.prod(int(part.split("=")[1]) for part in (self.mesh or "").split(","))
        except (IndexError, ValueError):
            return None

"""What `jaxpi plan` is asked (`PlanRequest`) and what it reports (`PlanResult`), and the XLA
settings a planning process compiles under."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpi.config import ATTN_IMPLS, GDN_IMPLS, REMAT_POLICIES
from jaxpi.quant import check_base_quant
from sharding.mesh import parse_mesh_spec
from sharding.strategies import get_strategy


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    model: str = "qwen3_5_27b"
    mesh: str = "fsdp=8"
    strategy: str = "fsdp"
    seq_len: int = 8192
    batch_per_device: int = 1
    lora_rank: int | None = None
    device_memory: int | None = None  # bytes
    dtype: str = "bfloat16"
    remat: str = "full"
    dcn: str | None = None
    loss_chunk: int = 0  # the LM head this many positions at a time (0: all at once)
    attn_impl: str = "jax"  # QwenConfig.attn_impl: "jax" (blocked, scores kept) | "pallas" (flash)
    gdn_impl: str = "jax"  # QwenConfig.gdn_impl (one of GDN_IMPLS)
    compile: bool = True  # False: the analytic figures only (seconds, not a minute of XLA compile)
    base_quant: str = "none"  # the frozen base: none (dtype) | nf4 | int8 (needs LoRA: QLoRA)

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_per_device < 1:
            raise ValueError("seq_len must be >= 2 and batch_per_device >= 1")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 0 (0: the LM head at once), got {self.loss_chunk}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat {self.remat!r} is not one of {REMAT_POLICIES}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl {self.attn_impl!r} is not one of {ATTN_IMPLS}")
        if self.gdn_impl not in GDN_IMPLS:
            raise ValueError(f"gdn_impl {self.gdn_impl!r} is not one of {GDN_IMPLS}")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError("lora_rank must be >= 1")
        check_base_quant(self.base_quant)
        if self.base_quant != "none" and self.lora_rank is None:
            raise ValueError(
                f"base_quant {self.base_quant!r} needs LoRA (lora_rank): a quantized base is frozen, "
                "and without lora_rank the plan is full fine-tuning, which trains the base"
            )
        parse_mesh_spec(self.mesh)
        get_strategy(self.strategy)


@dataclasses.dataclass
class PlanResult:
    request: PlanRequest
    devices: int
    global_batch: int
    compiled: dict[str, int] | None  # per device, from memory_analysis(); None: not compiled
    analytic: dict[str, int]  # per device, from shapes and shardings
    collectives: dict[str, dict[str, int]] | None  # None: not compiled
    collectives_analytic: dict[str, dict[str, int]]
    peak_bytes: int  # compiled: arguments + temp + outputs - aliased; else analytic arguments + temp
    fits: bool | None
    fallbacks: list[str]
    compile_seconds: float

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["request"] = dataclasses.asdict(self.request)
        return out

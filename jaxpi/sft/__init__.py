"""LoRA SFT: the config (`jaxpi.sft.config`), the data sources and the session split
(`jaxpi.sft.data`), the loop (`jaxpi.sft.loop`); `jaxpi sft` is `jaxpi/cli/sft.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpi.lazy import facade

if TYPE_CHECKING:
    from jaxpi.sft.config import DataConfig, SFTConfig, TrainConfig
    from jaxpi.sft.data import SourceRequest, prepare_data, register_source
    from jaxpi.sft.loop import NonFiniteError, run_sft

# name -> the module that defines it, imported on first use (PEP 562)
_WHERE = {
    "DataConfig": "jaxpi.sft.config",
    "SFTConfig": "jaxpi.sft.config",
    "TrainConfig": "jaxpi.sft.config",
    "SourceRequest": "jaxpi.sft.data",
    "prepare_data": "jaxpi.sft.data",
    "register_source": "jaxpi.sft.data",
    "NonFiniteError": "jaxpi.sft.loop",
    "run_sft": "jaxpi.sft.loop",
}

__all__ = [
    "DataConfig",
    "NonFiniteError",
    "SFTConfig",
    "SourceRequest",
    "TrainConfig",
    "prepare_data",
    "register_source",
    "run_sft",
]

__getattr__, __dir__ = facade(__name__, _WHERE, globals())

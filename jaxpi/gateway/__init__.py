"""`jaxpi gateway`: a recording OpenAI-compatible proxy, and the trajectory builder over its records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpi.lazy import facade

if TYPE_CHECKING:
    from jaxpi.gateway.front import call_record, gateway_in_front
    from jaxpi.gateway.proxy import start_gateway
    from jaxpi.gateway.records import RecordStore, read_records
    from jaxpi.gateway.trajectory import (
        AttemptSamples,
        Sample,
        build_samples,
        split_stats,
        think_ids,
        to_trajectory,
    )

# name -> the module that defines it, imported on first use (PEP 562)
_WHERE = {
    "call_record": "jaxpi.gateway.front",
    "gateway_in_front": "jaxpi.gateway.front",
    "start_gateway": "jaxpi.gateway.proxy",
    "RecordStore": "jaxpi.gateway.records",
    "read_records": "jaxpi.gateway.records",
    "AttemptSamples": "jaxpi.gateway.trajectory",
    "Sample": "jaxpi.gateway.trajectory",
    "build_samples": "jaxpi.gateway.trajectory",
    "split_stats": "jaxpi.gateway.trajectory",
    "think_ids": "jaxpi.gateway.trajectory",
    "to_trajectory": "jaxpi.gateway.trajectory",
}

__all__ = [
    "AttemptSamples",
    "RecordStore",
    "Sample",
    "build_samples",
    "call_record",
    "gateway_in_front",
    "read_records",
    "split_stats",
    "start_gateway",
    "think_ids",
    "to_trajectory",
]


__getattr__, __dir__ = facade(__name__, _WHERE, globals())

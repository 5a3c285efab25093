"""`jaxpi gateway`: a recording OpenAI-compatible proxy, and the trajectory builder over its records."""

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

__all__ = [
    "AttemptSamples",
    "RecordStore",
    "Sample",
    "build_samples",
    "read_records",
    "split_stats",
    "start_gateway",
    "think_ids",
    "to_trajectory",
]

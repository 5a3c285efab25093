"""Collectives in a compiled (SPMD-partitioned) HLO module, counted per training step.

XLA prints each computation as `%name (...) -> ... {` … `}`; a scanned layer stack becomes a
`while` whose body runs `known_trip_count` times, so a collective inside it is counted that many
times. Bytes are the collective's result size on one device (for an all-gather, the gathered
array; for a reduce-scatter, the scattered shard), summed over executions.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_COMP = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")
_OP = re.compile(r"^\s*%\S+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_WHILE = re.compile(r"\swhile\(.*?body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(
    r"(?:to_apply|calls|true_computation|false_computation|branch_computations)=\{?%([\w.\-]+)"
)


@dataclass
class Collectives:
    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, other: Collectives, times: int = 1) -> None:
        for k in KINDS:
            self.count[k] += other.count[k] * times
            self.bytes[k] += other.bytes[k] * times

    def to_json(self) -> dict[str, dict[str, int]]:
        return {k: {"count": self.count[k], "bytes": self.bytes[k]} for k in KINDS}


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


def count_collectives(hlo_text: str) -> Collectives:
    """Collectives executed by one run of the module's ENTRY computation."""
    own: dict[str, Collectives] = defaultdict(Collectives)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo_text.splitlines():
        head = _COMP.match(line)
        if head:
            current = head.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        op = _OP.match(line)
        if op:
            own[current].count[op.group(2)] += 1
            own[current].bytes[op.group(2)] += _shape_bytes(op.group(1))
            continue
        loop = _WHILE.search(line)
        if loop:
            trip = _TRIP.search(line)
            calls[current].append((loop.group(1), int(trip.group(1)) if trip else 1))
            continue
        for callee in _CALLS.findall(line):
            calls[current].append((callee, 1))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    def total(name: str, seen: frozenset[str]) -> Collectives:
        out = Collectives()
        out.add(own.get(name, Collectives()))
        for callee, times in calls.get(name, []):
            if callee not in seen:
                out.add(total(callee, seen | {callee}), times)
        return out

    return total(entry, frozenset({entry}))

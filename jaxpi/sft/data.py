"""What `jaxpi sft` trains on: examples from a data source, split by session, packed into rows.

`data.source` names a source: "sessions" (Pi sessions through the gates and the renderer) and
"synthetic" (random-token chains, for tests) are built in; others are registered with
`register_source`, or by an installed package through the `jaxpi.sft_sources` entry-point group
(`name = "module:builder"`, as the toy lookup study registers "toy_lookup"), so the trainer never
imports the experiment that defines them. A builder is called as `builder(request)` with a
`SourceRequest` and returns (examples, data report); an example is a mapping (or object) with
`input_ids` and `loss_mask`, and a `session_id` (or `session`, `source`, `path`) for the split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpi.data.examples import build_examples
from jaxpi.data.pipeline import PipelineConfig, example_stats, packing_stats
from jaxpi.data.render import RenderConfig

if TYPE_CHECKING:
    from jaxpi.sft.config import DataConfig, SFTConfig

ENTRY_POINT_GROUP = "jaxpi.sft_sources"
BUILT_IN = ("sessions", "synthetic")


# ---- sources -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SourceRequest:
    """What a source builds from: the `data:` section, the run's seed, the base checkpoint (its
    tokenizer, unless `data.tokenizer` names one) and the model's vocabulary size."""

    data: DataConfig
    seed: int
    base_dir: Path
    vocab: int

    @property
    def tokenizer_dir(self) -> str:
        return self.data.tokenizer or str(self.base_dir)


SourceBuilder = Callable[[SourceRequest], tuple[list[Any], dict[str, Any]]]


def _sessions(request: SourceRequest) -> tuple[list[Any], dict[str, Any]]:
    d = request.data
    examples, report = build_examples(list(d.sessions), RenderConfig(request.tokenizer_dir), d.gate)
    return list(examples), {"source": "sessions", "paths": list(d.sessions), "report": jsonable(report)}


def _synthetic(request: SourceRequest) -> tuple[list[Any], dict[str, Any]]:
    d = request.data
    examples = synthetic_examples(d.synthetic_examples, d.seq_len, request.vocab, request.seed)
    return examples, {"source": "synthetic", "examples": len(examples)}


_SOURCES: dict[str, SourceBuilder] = {"sessions": _sessions, "synthetic": _synthetic}


def register_source(name: str, build: SourceBuilder) -> None:
    """Make `data.source: name` read its examples with `build(request)`."""
    _SOURCES[name] = build


def _registered(name: str) -> SourceBuilder | None:
    if name not in _SOURCES:
        for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
            _SOURCES[name] = ep.load()
    return _SOURCES.get(name)


def is_source(name: str) -> bool:
    """Whether `name` is a built-in, registered or installed source (nothing is imported)."""
    return name in _SOURCES or bool(entry_points(group=ENTRY_POINT_GROUP, name=name))


def source_names() -> list[str]:
    """Every source: the built-in ones first, then the registered and installed ones, sorted."""
    others = set(_SOURCES) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return [*BUILT_IN, *sorted(others - set(BUILT_IN))]


# ---- examples ------------------------------------------------------------------------------------
def session_key(example: Any, index: int) -> str:
    """The session an example came from (examples of one session stay on one side of the split).

    File sources count by file name (and line), not by directory, so the split does not change when
    the data is moved or read from another checkout."""
    for name in ("session_id", "session", "source", "path"):
        value = example.get(name) if isinstance(example, dict) else getattr(example, name, None)
        if value:
            return Path(str(value)).name if name in ("source", "path") else str(value)
    return f"example-{index}"


def split_by_session(examples: Sequence[Any], val_fraction: float) -> tuple[list[Any], list[Any]]:
    """(train, val): the sessions whose SHA-256 ranks lowest are held out, ⌈fraction · sessions⌉ of
    them (at least one when the fraction is positive and there are two sessions or more). Depends
    only on the set of sessions, so every restart draws the same split."""
    keys = [session_key(e, i) for i, e in enumerate(examples)]
    sessions = sorted(set(keys), key=lambda k: hashlib.sha256(k.encode()).hexdigest())
    n_val = 0 if val_fraction == 0 or len(sessions) < 2 else max(1, math.ceil(val_fraction * len(sessions)))
    held = set(sessions[: min(n_val, len(sessions) - 1)])
    train = [e for e, k in zip(examples, keys, strict=True) if k not in held]
    val = [e for e, k in zip(examples, keys, strict=True) if k in held]
    return train, val


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    """Random-length token chains that follow a fixed random successor map over a 64-token subset
    (learnable in a few dozen steps), the first quarter of each masked as a prompt. Two examples
    per "session"."""
    rng = np.random.default_rng(seed)
    alphabet = rng.choice(vocab, size=min(64, vocab), replace=False)
    successor = dict(zip(alphabet.tolist(), rng.permutation(alphabet).tolist(), strict=True))
    out = []
    for i in range(n):
        length = int(rng.integers(max(4, seq_len // 4), seq_len + 1))
        ids = [int(rng.choice(alphabet))]
        for _ in range(length - 1):
            ids.append(successor[ids[-1]])
        mask = np.ones(length, np.int32)
        mask[: length // 4] = 0
        out.append(
            {"input_ids": np.asarray(ids, np.int32), "loss_mask": mask, "session_id": f"synthetic/{i // 2}"}
        )
    return out


def build_data(cfg: SFTConfig, base_dir: Path, vocab: int) -> tuple[list[Any], dict[str, Any]]:
    """Admitted examples and the data report (gate counts), from the source `data.source` names."""
    build = _registered(cfg.data.source)
    if build is None:
        raise ValueError(f"data.source {cfg.data.source!r} is not registered (have {source_names()})")
    return build(SourceRequest(cfg.data, cfg.train.seed, Path(base_dir), vocab))


def jsonable(obj: Any) -> Any:
    """A gate report (dataclasses, counters) as plain JSON values."""
    # Field by field, not dataclasses.asdict: asdict rebuilds a Counter from (key, count) pairs.
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "to_json"):
        return jsonable(obj.to_json())
    return str(obj)


# ---- the run's data ------------------------------------------------------------------------------
@dataclasses.dataclass
class SFTData:
    """The admitted examples split by session, the pipeline settings, the data report."""

    train: list[Any]
    val: list[Any]
    pipeline: PipelineConfig
    report: dict[str, Any]


def prepare_data(cfg: SFTConfig, base_dir: Path, vocab: int) -> SFTData:
    """Examples from the source, the session split, packing statistics of one epoch."""
    examples, report = build_data(cfg, base_dir, vocab)
    train, val = split_by_session(examples, cfg.data.val_fraction)
    if not train:
        raise ValueError("no training examples were admitted (see the data report)")
    pipe = PipelineConfig(
        seq_len=cfg.data.seq_len,
        batch_size=cfg.data.batch_size,
        seed=cfg.train.seed,
        shuffle=cfg.data.shuffle,
        num_epochs=None,  # the run is measured in steps; epochs wrap
        overlong=cfg.data.overlong,
        packing=cfg.data.packing,
    )
    pack = packing_stats(train, pipe)
    report.update(
        train_examples=len(train),
        val_examples=len(val),
        sessions={
            "train": len({session_key(e, i) for i, e in enumerate(train)}),
            "val": len({session_key(e, i) for i, e in enumerate(val)}),
        },
        examples=dataclasses.asdict(example_stats(train, pipe)),
        packing={**dataclasses.asdict(pack), "efficiency": pack.efficiency},
        epoch_steps=pack.batches / cfg.train.grad_accum,
    )
    return SFTData(train, val, pipe, report)


def report_text(report: dict[str, Any], seq_len: int) -> str:
    """The data report as the lines `jaxpi sft` prints before training."""
    lines = [
        f"data: {report['source']}, {report['train_examples']} train / {report['val_examples']} val examples "
        f"({report['sessions']['train']} / {report['sessions']['val']} sessions)"
    ]
    gate = report.get("report")
    if isinstance(gate, dict):
        lines.append(
            "gates: " + ", ".join(f"{k}={v}" for k, v in gate.items() if not isinstance(v, (list, dict)))
        )
        if gate.get("reasons"):
            lines.append("excluded: " + ", ".join(f"{k}={v}" for k, v in gate["reasons"].items()))
    ex, pk = report["examples"], report["packing"]
    lines.append(
        f"tokens: {ex['tokens']} ({ex['supervised_tokens']} supervised), {ex['truncated']} truncated, "
        f"{ex['dropped']} dropped; packing {pk['efficiency']:.1%} of {seq_len}-token rows, "
        f"{report['epoch_steps']:.1f} steps per epoch"
    )
    return "\n".join(lines)

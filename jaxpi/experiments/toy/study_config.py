"""What a `jaxpi study` is: the seeds, the arms and the overrides (`StudySpec`), and `study.json`,
the resolved SFT and GRPO settings every run of the study shares.

The settings that define the runs (the resolved configs, minus the seed and the paths) are kept
in `study.json`; a rerun with other settings is refused, more seeds may be added.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxpi import atomic
from jaxpi.configfile import load_config, to_dict
from jaxpi.experiments.toy.result import CONFIGS, SHORT
from jaxpi.rl.config import GRPOConfig
from jaxpi.sft.config import SFTConfig

SFT_CONFIG = CONFIGS / "sft" / "toy.yaml"
GRPO_CONFIG = CONFIGS / "grpo" / "toy.yaml"
ARMS: dict[str, str] = {"effort_ordered": "effort-ordered", "binary": "binary"}  # reward.kind → dir
# Set by the study per run: an override of one of these would make the seeds or arms collide.
STUDY_KEYS = ("train.seed", "output.dir", "model.adapter", "reward.kind", "output.name")
# Not part of what a run means: may differ between a study and its rerun.
FREE_KEYS = {"output": None, "train": ("seed", "checkpoint_every", "keep_checkpoints", "eval_every")}


@dataclasses.dataclass(frozen=True)
class StudySpec:
    seeds: tuple[int, ...]
    arms: tuple[str, ...] = tuple(ARMS)
    short: bool = False
    sft: tuple[str, ...] = ()  # overrides of configs/sft/toy.yaml
    grpo: tuple[str, ...] = ()  # overrides of configs/grpo/toy.yaml
    starts: str | None = None  # another study whose seed-k/sft runs are the starts (not rerun)

    def __post_init__(self) -> None:
        errors = []
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            errors.append(f"seeds must be distinct and >= 0, got {list(self.seeds)}")
        unknown = [a for a in self.arms if a not in ARMS]
        if not self.arms or unknown or len(set(self.arms)) != len(self.arms):
            errors.append(f"arms must be distinct names of {list(ARMS)}, got {list(self.arms)}")
        for o in (*self.sft, *self.grpo):
            key = o.partition("=")[0].strip()
            if key in STUDY_KEYS:
                errors.append(f"{key} is set by the study per run; not an override ({o!r})")
        if self.starts and self.sft:
            errors.append("with starts the SFT runs are another study's: give no SFT overrides")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def sft_overrides(self) -> list[str]:
        return [*(SHORT[0] if self.short else ()), "output.loggers=[]", *self.sft]

    @property
    def grpo_overrides(self) -> list[str]:
        return [*(SHORT[1] if self.short else ()), "output.loggers=[]", *self.grpo]


def _strip(d: dict[str, Any], free: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for section, fields in d.items():
        if section in free and free[section] is None:
            continue
        if isinstance(fields, dict):
            out[section] = {k: v for k, v in fields.items() if k not in (free.get(section) or ())}
        else:
            out[section] = fields
    return out


def resolved_settings(spec: StudySpec) -> dict[str, Any]:
    """The SFT and GRPO configs every run of the study shares (seed, paths and arm left out),
    validated here so that a bad override fails before anything starts."""
    sft = to_dict(load_config(SFTConfig, SFT_CONFIG, spec.sft_overrides))
    grpo = to_dict(load_config(GRPOConfig, GRPO_CONFIG, spec.grpo_overrides))
    grpo["model"].pop("adapter", None)
    grpo["reward"].pop("kind", None)
    settings = {"sft": _strip(sft, FREE_KEYS), "grpo": _strip(grpo, FREE_KEYS)}
    return _portable(settings, str(CONFIGS.parent))


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ. A key only one side has is a field added (or removed)
    since: it kept the old behaviour at its default, as the trainers' resume assumes."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) & set(b)) for d in _diff(a[k], b[k], f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _portable(obj: Any, root: str) -> Any:
    """Paths inside the checkout (defaults such as the demo sessions) as `<repo>/...`, so that a
    study reads the same from another checkout of the same code."""
    if isinstance(obj, dict):
        return {k: _portable(v, root) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v, root) for v in obj]
    return "<repo>" + obj[len(root) :] if isinstance(obj, str) and obj.startswith(root) else obj


def prepare(root: Path, spec: StudySpec) -> dict[str, Any]:
    """Write (or check against) `root/study.json`: the settings a rerun must share."""
    settings = resolved_settings(spec)
    if spec.starts:
        other = json.loads((Path(spec.starts) / "study.json").read_text())
        if other["short"] != spec.short:
            raise ValueError(f"{spec.starts} is a {'short' if other['short'] else 'full'} study")
        settings["sft"] = other["settings"]["sft"]
    path = root / "study.json"
    record = {"short": spec.short, "starts": spec.starts, "settings": settings}
    if path.exists():
        saved = json.loads(path.read_text())
        diffs = [d.removeprefix("settings.") for d in _diff({k: saved.get(k) for k in record}, record)]
        if diffs:
            raise ValueError(
                f"{root} holds a study with different settings ({', '.join(diffs[:8])}); "
                "rerun it with the same ones or choose another --out"
            )
    root.mkdir(parents=True, exist_ok=True)
    # The overrides as given, so that `--report-only` needs none of them again.
    record["overrides"] = {"sft": list(spec.sft), "grpo": list(spec.grpo)}
    atomic.write_text(path, json.dumps(record, indent=2) + "\n")
    return record


def saved_spec(root: Path, seeds: Sequence[int]) -> StudySpec:
    """The spec of the study in `root` (study.json), for `seeds`, with the arms it has runs of."""
    path = root / "study.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no study here (run `jaxpi study --out {root}` first)")
    saved = json.loads(path.read_text())
    over = saved.get("overrides") or {"sft": [], "grpo": []}
    arms = tuple(a for a, d in ARMS.items() if any(root.glob(f"seed-*/{d}/done.json"))) or tuple(ARMS)
    return StudySpec(
        tuple(seeds), arms, saved["short"], tuple(over["sft"]), tuple(over["grpo"]), saved["starts"]
    )

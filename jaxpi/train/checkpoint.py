"""Training checkpoints with orbax: LoRA adapter, optimizer state, data position, RNG, metadata.

Layout of a run directory (`output.dir`):

    checkpoints/<step>/adapter/     LoRA weights, float32, one array per adapter variable
    checkpoints/<step>/opt_state/   optimizer state (AdamW moments, step count), float32
    checkpoints/<step>/trainer/     JSON: step, seed, dropout key data, data iterator state
    checkpoints/<step>/meta/        JSON: the run config, base checkpoint path, LoRA and model config
    checkpoints/<step>/_CHECKPOINT_METADATA, commit_success.txt   written by orbax

Atomicity: orbax writes every item of a step into `<step>.orbax-checkpoint-tmp` and renames
it to `<step>` only after all items are on disk (`commit_success.txt` marks it). A killed save
leaves the temporary directory, which orbax never lists as a step and this module deletes on the
next start. A step directory missing orbax's metadata or one of our items (a partial copy, a
hand-made directory) is not complete either: `complete_steps` skips it with a warning.

Arrays are stored under flat names (`groups/blocks/0/mixer/lora_a_q_proj`), so a checkpoint can be
read without the model: `load_adapter` (used by `jaxpi export --adapter`) rebuilds the adapter
state from the metadata alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxpi.config import QwenConfig
from jaxpi.lora import LoraConfig, LoRAParam

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
ITEMS = ("adapter", "opt_state", "trainer", "meta")
SAMPLER = "sampler"  # optional: the adapter of the next collection (asynchronous GRPO)
_ORBAX_MARKER = "_CHECKPOINT_METADATA"
_TMP_MARKER = ".orbax-checkpoint-tmp"


@dataclasses.dataclass
class Restored:
    """What `CheckpointStore.restore` gives back (arrays placed on the targets' shardings)."""

    step: int
    adapter: nnx.State
    opt_state: Any
    trainer: dict[str, Any]
    meta: dict[str, Any]
    sampler: nnx.State | None = None  # the adapter the next collection is sampled by, when saved


def flat_arrays(tree: Any) -> dict[str, Any]:
    """A pytree as `{"a/b/0/c": leaf}` (the names stored on disk)."""
    # Flat string keys rather than the pytree itself: orbax then needs no knowledge of nnx.State or
    # optax's named tuples, and the files can be read back without building the model.
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        name = name.removesuffix("/value")  # nnx.Variable's own leaf name adds nothing
        out[name] = leaf
    if len(out) != len(leaves):
        raise ValueError("two leaves of the tree have the same flat name")
    return out


def unflat_arrays(template: Any, flat: Mapping[str, Any]) -> Any:
    """The inverse of `flat_arrays`: `template`'s structure with the leaves from `flat`."""
    names = list(flat_arrays(template))
    missing = [n for n in names if n not in flat]
    if missing:
        raise KeyError(f"checkpoint has no array {missing[0]!r} (and {len(missing) - 1} more missing)")
    treedef = jax.tree.structure(template)
    return jax.tree.unflatten(treedef, [flat[n] for n in names])


class CheckpointStore:
    """An orbax `CheckpointManager` over `<run dir>/checkpoints` keeping the last `keep` steps.

    Saves are synchronous: the adapter and its optimizer state are small (LoRA is under 1% of
    the model), and a save that has returned is on disk, which is what a run killed right
    afterwards needs.
    """

    def __init__(self, run_dir: str | Path, *, keep: int = 3) -> None:
        self.directory = Path(run_dir).absolute() / CHECKPOINTS
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()
        # Synchronous saves: the next step donates (overwrites) the arrays being saved, and a run
        # killed right after a save must find it on disk.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=True, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def _remove_temporaries(self) -> None:
        for p in self.directory.glob(f"*{_TMP_MARKER}*"):
            log.warning("removing unfinished checkpoint %s", p)
            shutil.rmtree(p, ignore_errors=True)

    def complete_steps(self) -> list[int]:
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(
        self,
        step: int,
        adapter: nnx.State,
        opt_state: Any,
        trainer: Mapping[str, Any],
        meta: Mapping[str, Any],
        sampler: nnx.State | None = None,
    ) -> Path:
        """Write one step (all items or nothing); returns its directory. `sampler`: the adapter
        the next collection is sampled by when that is not `adapter` (asynchronous GRPO)."""
        items = {
            "adapter": ocp.args.StandardSave(flat_arrays(adapter)),
            "opt_state": ocp.args.StandardSave(flat_arrays(opt_state)),
            "trainer": ocp.args.JsonSave(dict(trainer)),
            "meta": ocp.args.JsonSave(dict(meta)),
        }
        if sampler is not None:
            items[SAMPLER] = ocp.args.StandardSave(flat_arrays(sampler))
        args = ocp.args.Composite(**items)
        if not self.manager.save(step, args=args, force=True):
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
        self.manager.wait_until_finished()
        return self.step_dir(step)

    def restore(self, step: int, adapter_target: nnx.State, opt_target: Any) -> Restored:
        """Restore `step` onto the structure, dtypes and shardings of the two targets (abstract
        `jax.ShapeDtypeStruct`s with `.sharding`, or real arrays); the sampler adapter too when
        the step holds one (onto the adapter's target)."""

        # Restoring onto abstract arrays with shardings places every shard directly on its devices
        # (a resumed sharded run never gathers the adapter or optimizer state on one host).
        def abstract(tree: Any) -> dict[str, jax.ShapeDtypeStruct]:
            return {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
                for k, v in flat_arrays(tree).items()
            }

        items = {
            "adapter": ocp.args.StandardRestore(abstract(adapter_target)),
            "opt_state": ocp.args.StandardRestore(abstract(opt_target)),
            "trainer": ocp.args.JsonRestore(),
            "meta": ocp.args.JsonRestore(),
        }
        has_sampler = (self.step_dir(step) / SAMPLER).is_dir()
        if has_sampler:
            items[SAMPLER] = ocp.args.StandardRestore(abstract(adapter_target))
        got = self.manager.restore(step, args=ocp.args.Composite(**items))
        return Restored(
            step=step,
            adapter=unflat_arrays(adapter_target, got.adapter),
            opt_state=unflat_arrays(opt_target, got.opt_state),
            trainer=dict(got.trainer),
            meta=dict(got.meta),
            sampler=unflat_arrays(adapter_target, got[SAMPLER]) if has_sampler else None,
        )

    def close(self) -> None:
        self.manager.close()


def complete_steps(directory: Path) -> list[int]:
    """Steps under `directory` that a finished save wrote (orbax's metadata and all our items)."""
    steps = []
    if not directory.is_dir():
        return steps
    for p in directory.iterdir():
        if not p.is_dir() or not p.name.isdigit():
            continue  # orbax's temporaries ("7.orbax-checkpoint-tmp") and anything else
        missing = [x for x in (_ORBAX_MARKER, *ITEMS) if not (p / x).exists()]
        if missing:
            warnings.warn(f"ignoring incomplete checkpoint {p} (no {', '.join(missing)})", stacklevel=2)
            continue
        steps.append(int(p.name))
    return sorted(steps)


def resolve_step_dir(path: str | Path) -> Path:
    """A run dir (→ its latest complete step), a `checkpoints` dir (same), or one step's dir."""
    path = Path(path).absolute()  # orbax restores from absolute paths only
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if (path / "meta").is_dir() and (path / "adapter").is_dir():
        if path.name.isdigit() and path.parent.is_dir() and int(path.name) not in complete_steps(path.parent):
            raise ValueError(f"{path} is an incomplete checkpoint")
        return path
    directory = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    steps = complete_steps(directory)
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint under {directory}")
    return directory / str(steps[-1])


def read_meta(step_dir: str | Path) -> dict[str, Any]:
    """The JSON metadata of one step (config, base path, LoRA and model config, step)."""
    path = Path(step_dir) / "meta" / "metadata"  # where orbax's JsonSave puts the object
    if not path.exists():
        raise FileNotFoundError(f"{step_dir}: no meta item ({path})")
    return json.loads(path.read_text())


def abstract_adapter(model_cfg: QwenConfig, lora_cfg: LoraConfig) -> nnx.State:
    """The adapter state's structure (shapes, float32, logical axes) for a model config, nothing
    allocated."""
    from jaxpi.lora import add_lora
    from jaxpi.models.families import model_class

    def build() -> Any:
        return add_lora(model_class(model_cfg)(model_cfg, rngs=nnx.Rngs(0)), lora_cfg, key=jax.random.key(0))

    return nnx.state(nnx.eval_shape(build), LoRAParam)


def load_adapter(ckpt_path: str | Path) -> tuple[nnx.State, LoraConfig, dict[str, Any]]:
    """`(adapter_state, lora_cfg, meta)` of a checkpoint, for export.

    `ckpt_path`: a run directory (its latest complete step), its `checkpoints` directory, or one
    step directory. `adapter_state` is the `nnx.State` of `LoRAParam`s (float32 numpy arrays, the
    structure `add_lora` gives the model of `meta["model_config"]`); `nnx.update(model, state)`
    puts it into a model with adapters. `meta` holds at least `base` (the HF base checkpoint
    directory), `model_config` (HF `config.json` text settings), `lora` (`LoraConfig` fields),
    `step` and `config` (the whole run config).
    """
    step_dir = resolve_step_dir(ckpt_path)
    meta = read_meta(step_dir)
    model_cfg = QwenConfig.from_hf(meta["model_config"])
    lora_cfg = LoraConfig(**{**meta["lora"], "targets": tuple(meta["lora"]["targets"])})
    target = abstract_adapter(model_cfg, lora_cfg)
    # Host (CPU) arrays whatever the run trained on: export runs on any machine.
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        flat = ckptr.restore(
            step_dir / "adapter",
            args=ocp.args.StandardRestore(
                {
                    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_host_sharding())
                    for k, v in flat_arrays(target).items()
                }
            ),
        )
    flat = {k: np.asarray(v) for k, v in flat.items()}
    return unflat_arrays(target, flat), lora_cfg, meta


def _host_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])

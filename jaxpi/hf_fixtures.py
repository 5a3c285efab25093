"""Test fixtures: jaxpi models with seeded random weights, built without running the initialisers,
and (re-exported from `jaxpi.convert.tiny`) the tiny random checkpoints built by `transformers`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpi.config import TINY, QwenConfig
from jaxpi.convert.tiny import (
    hf_text_config,
    make_causal_lm,
    make_checkpoint,
    make_hf_checkpoint,
    randomize_,
)

__all__ = [
    "hf_text_config",
    "make_causal_lm",
    "make_checkpoint",
    "make_hf_checkpoint",
    "random_jax_model",
    "randomize_",
    "seeded_noise",
]


def seeded_noise(state: Any, seed: int = 0) -> Any:
    """Seeded noise in every variable of an `nnx.State` (abstract ones too, from `nnx.eval_shape`),
    shaped like real weights: DeltaNet decay `A_log = log U(0.5, 4.5)`, `dt_bias ≈ 1`, norms and
    conv windows larger than projections, LoRA B non-zero (so gradients reach A). Filling an
    abstract state skips the model's initialisers, which run slowly op by op on CPU."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)

    def fill(path: tuple, var: nnx.Variable) -> nnx.Variable:
        shape, name = var.get_value().shape, str(getattr(path[-1], "key", path[-1]))
        noise = rng.standard_normal(shape)
        if name == "A_log":
            value = np.log(rng.uniform(0.5, 4.5, shape))
        elif name == "dt_bias":
            value = 1.0 + 0.5 * noise
        elif "norm" in name:
            value = 0.2 * noise
        elif name.startswith("conv"):
            value = 0.3 * noise
        else:
            value = 0.05 * noise
        return var.replace(jnp.asarray(value, var.get_value().dtype))

    return jax.tree_util.tree_map_with_path(fill, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def random_jax_model(cfg: QwenConfig = TINY, seed: int = 0, dtype: Any = "float32") -> Any:
    """A jaxpi `Qwen3_5ForCausalLM` of `cfg` with `seeded_noise` in every weight. Built abstractly
    and filled on the host: on CPU, running the initialisers (`rngs=nnx.Rngs(...)`) compiles a
    random-number program per parameter shape, ~7 s for the tiny model."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxpi.models.families import model_class

    abstract = nnx.eval_shape(lambda: model_class(cfg)(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return nnx.merge(graphdef, seeded_noise(state, seed))

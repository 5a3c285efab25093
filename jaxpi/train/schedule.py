"""Learning-rate schedule and the optimizer of a LoRA run (pure constructors, no state).

    lr(s) = peak · s / warmup                                         s < warmup
    lr(s) = end + (peak − end) · ½ (1 + cos(π · (s − warmup) / (total − warmup)))   after
    end   = peak · min_lr_ratio

AdamW (decoupled weight decay) behind global-norm clipping: the update of step s uses lr(s) with
s counted from 0, so the first step trains at lr(0) = 0 only when warmup > 0.
"""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # the cosine ends at lr · min_lr_ratio
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0  # global gradient norm; 0 disables clipping

    def __post_init__(self) -> None:
        errors = []
        if not self.lr > 0:
            errors.append(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            errors.append(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            errors.append(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            errors.append(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            errors.append(f"optim.b1 and optim.b2 must be in [0, 1), got {self.b1}, {self.b2}")
        if not self.eps > 0:
            errors.append(f"optim.eps must be > 0, got {self.eps}")
        if self.clip_norm < 0:
            errors.append(f"optim.clip_norm must be >= 0 (0 disables), got {self.clip_norm}")
        if errors:
            raise ValueError("; ".join(errors))


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `cfg.lr` over `warmup_steps`, then cosine decay to
    `lr · min_lr_ratio` at `total_steps` (held there beyond)."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    decay = max(total_steps - warmup, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=warmup + decay,  # optax counts decay_steps from 0, warmup included
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule (one transformation, state in float32
    for float32 adapters)."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.clip_norm == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)

"""What `jaxpi serve` runs with: one frozen, validated config (the CLI flags map onto it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Settings of one `jaxpi serve` process.

    model: a HF checkpoint directory (with a tokenizer, or `tokenizer` given), or a jaxpi SFT/GRPO
        run / checkpoint directory (base and tokenizer from its metadata, the adapter applied).
    adapter: an extra adapter on top of `model`: a jaxpi (orbax) checkpoint or a PEFT directory.
    tokenizer: tokenizer directory when the checkpoint has none (default: the model's own).
    served_name: the model id clients pass (`model` in requests); None: the directory's name.
    max_batch: engine rows, the most requests one compiled call decodes together.
    batch_wait_ms: how long the batcher holds the first request of a batch for others to join.
    max_len: context limit per request (prompt + completion), tokens.
    max_new_tokens: default and upper bound of a request's `max_tokens`.
    prefill_chunks: the engine's prefill chunk sizes (each one compiled program).
    dtype: weights' dtype ("float32" or "bfloat16").
    seed: seeds requests that bring none (the server's draw of per-batch seeds).
    """

    model: str
    adapter: str | None = None
    tokenizer: str | None = None
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    batch_wait_ms: float = 5.0
    max_len: int = 4096
    max_new_tokens: int = 1024
    prefill_chunks: tuple[int, ...] = (256, 32, 4, 1)
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "prefill_chunks", tuple(int(c) for c in self.prefill_chunks))
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        # A default turn must leave room for at least one prompt token.
        if not 1 <= self.max_new_tokens < self.max_len:
            raise ValueError(
                f"max_new_tokens must be in [1, max_len={self.max_len}), got {self.max_new_tokens}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if 1 not in self.prefill_chunks or min(self.prefill_chunks) < 1:
            raise ValueError(f"prefill_chunks must be positive and include 1, got {self.prefill_chunks}")

    @property
    def name(self) -> str:
        return self.served_name or Path(self.model).name

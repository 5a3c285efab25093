"""What `jaxpi serve` and `jaxpi gateway` run with: frozen, validated configs (the CLI flags map
onto them), and the HTTP limits both servers share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

API_KEY_ENV = "JAXPI_API_KEY"  # as vLLM's VLLM_API_KEY: the key clients must send, when set
UPSTREAM_API_KEY_ENV = "JAXPI_UPSTREAM_API_KEY"  # the gateway's key for its upstream


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one client may cost a server (`jaxpi.serve.httpbase.Server`).

    read_timeout_s: a client's time to send one whole request (head and body), counted from its
        first byte or from the moment its connection went idle; then 408 and the connection closes.
        A deadline per request, not per read: a client that trickles a byte at a time is cut too.
    max_body_bytes: the largest request body; a larger Content-Length is 413 before any of it is read.
    max_connections: open connections at most (reading, waiting or being answered); one more is 503.
    workers: threads that answer complete requests; requests still being read hold none.
    """

    read_timeout_s: float = 30.0
    max_body_bytes: int = 64 * 2**20
    max_connections: int = 512
    workers: int = 128

    def __post_init__(self) -> None:
        errors = []
        if not self.read_timeout_s > 0:
            errors.append(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        for name in ("max_body_bytes", "max_connections", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                errors.append(f"{name} must be an integer >= 1, got {v!r}")
        if errors:
            raise ValueError("; ".join(errors))


def _check_http(cfg: ServeConfig | GatewayConfig) -> list[str]:
    """The errors of the fields a serve and a gateway config share (keys, HTTP limits), by name."""
    errors = []
    for name in ("api_key", "upstream_api_key"):
        key = getattr(cfg, name, None)
        # What fits in "Authorization: Bearer <key>" as one token.
        if key is not None and (
            not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() or " " in key
        ):
            errors.append(f"{name} must be a non-empty string of printable ASCII without spaces (or None)")
    for name in ("read_timeout_s", "max_request_mb"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            errors.append(f"{name} must be a number > 0, got {v!r}")
    for name in ("max_connections", "http_workers"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            errors.append(f"{name} must be an integer >= 1, got {v!r}")
    return errors


def _limits(cfg: ServeConfig | GatewayConfig) -> HttpLimits:
    return HttpLimits(
        read_timeout_s=cfg.read_timeout_s,
        max_body_bytes=max(1, int(cfg.max_request_mb * 2**20)),
        max_connections=cfg.max_connections,
        workers=cfg.http_workers,
    )


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Settings of one `jaxpi serve` process (`jaxpi serve --help` lists them with the flags)."""

    # a HF checkpoint directory (with a tokenizer, or `tokenizer` given), or a jaxpi SFT/GRPO run
    # or checkpoint directory (base and tokenizer from its metadata, the adapter applied)
    model: str
    # an extra adapter on top of `model`: a jaxpi (orbax) checkpoint or a PEFT directory
    adapter: str | None = None
    tokenizer: str | None = None  # tokenizer directory when the checkpoint has none (None: its own)
    served_name: str | None = None  # the model id clients pass (`model` in requests); None: the dir's name
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    max_batch: int = 8  # engine rows: the most requests one compiled call decodes together
    batch_wait_ms: float = 5.0  # how long the batcher holds a batch's first request for others to join
    max_len: int = 4096  # context limit per request (prompt + completion), tokens
    # a chat request's `max_tokens` when it sends none (within the context its prompt leaves; a
    # request may ask for up to that context); None: min(1024, max_len - 1)
    max_new_tokens: int | None = None
    # tokens per engine call while a stream is in the batch (vLLM's --stream-interval): each call
    # hands its tokens to the streams; 1 streams every token as it is sampled
    stream_interval: int = 1
    prefill_chunks: tuple[int, ...] = (256, 32, 4, 1)  # the engine's prefill chunk sizes (one program each)
    dtype: str = "float32"  # the weights' dtype: float32 or bfloat16
    seed: int = 0  # seeds requests that bring none (the server's draw of per-batch seeds)
    # when set, every route but /health needs `Authorization: Bearer <api_key>` (else 401), as
    # vLLM's --api-key; never printed (left out of the repr)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    read_timeout_s: float = 30.0  # seconds a client has to send a whole request (then 408)
    max_request_mb: float = 64.0  # the largest request body, MiB (a larger one is 413)
    max_connections: int = 512  # open connections at most (then 503)
    http_workers: int = 128  # threads answering complete requests (those still being read hold none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", str(self.model))
        errors = _check_http(self)
        if errors:
            raise ValueError("; ".join(errors))
        object.__setattr__(self, "prefill_chunks", tuple(int(c) for c in self.prefill_chunks))
        if self.max_new_tokens is None and isinstance(self.max_len, int):
            object.__setattr__(self, "max_new_tokens", min(1024, self.max_len - 1))
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
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

    @property
    def limits(self) -> HttpLimits:
        return _limits(self)


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Settings of one `jaxpi gateway` process (`jaxpi gateway --help` lists them with the flags)."""

    upstream: str  # base URL of vLLM or `jaxpi serve` (a trailing /v1 is dropped)
    host: str = "127.0.0.1"
    port: int = 8100  # 0 picks a free port
    # where `<attempt>.jsonl` files go; None: a private temporary directory, removed when the
    # gateway closes (records are never held in memory)
    record_dir: str | None = None
    timeout_s: float = 600.0  # how long one upstream call may take (then 504)
    # the gateway's own key: it creates attempts, reads records and may name the attempt of a call
    # itself (`X-Jaxpi-Attempt`); None: a random key, on the handle (`.api_key`)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # sent upstream as `Authorization: Bearer ...` (vLLM's or jaxpi serve's --api-key); the
    # clients' own keys never leave the gateway
    upstream_api_key: str | None = dataclasses.field(default=None, repr=False)
    read_timeout_s: float = 30.0  # seconds a client has to send a whole request (then 408)
    max_request_mb: float = 64.0  # the largest request body, MiB (a larger one is 413)
    max_connections: int = 512  # open connections at most (then 503)
    http_workers: int = 128  # threads answering complete requests (those still being read hold none)

    def __post_init__(self) -> None:
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", str(self.record_dir))
        errors = _check_http(self)
        if not isinstance(self.upstream, str) or not self.upstream.startswith(("http://", "https://")):
            errors.append(f"upstream must be an http:// or https:// URL, got {self.upstream!r}")
        if not 0 <= self.port < 65536:
            errors.append(f"port must be in [0, 65535], got {self.port}")
        if not self.timeout_s > 0:
            errors.append(f"timeout_s must be > 0, got {self.timeout_s}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def limits(self) -> HttpLimits:
        return _limits(self)

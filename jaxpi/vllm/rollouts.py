"""The trainer's side of vLLM rollouts: one object that owns the server (or reaches a running one),
the engine, adapter sync, and recovery after failures.

    backend = VLLMBackend(settings, base_dir, lora_cfg, vocab_size, adapters_dir, log)
    backend.start()                                  # server up (started here unless `url` is given)
    backend.push(model, version, expected, base)     # export → load → probe; engine now samples it
    ... collector.run(...) with backend.engine ...
    backend.recover()                                # after an EngineError: server back; push again
    backend.close()

`recover` waits for an external server's `/health` (up to `wait_s`), or restarts the one it owns;
the caller then pushes (and probes) the current adapter again: a restarted server has none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from jaxpi.vllm.engine import EngineError, VLLMEngine, VLLMEngineConfig
from jaxpi.vllm.server import BASE_NAME, ServerConfig, ServerError, VLLMServer
from jaxpi.vllm.sync import PROBE_TOL, AdapterSync, ProbeResult


@dataclasses.dataclass(frozen=True)
class VLLMSettings:
    url: str = ""  # a running server; "" = start one on the base checkpoint
    max_len: int = 2048
    batch_size: int = 64
    concurrency: int = 16
    timeout_s: float = 120.0
    retries: int = 2
    wait_s: float = 60.0  # how long `recover` waits for an external server's /health
    probe_tol: float = PROBE_TOL
    keep_versions: int = 1  # older adapters kept loaded (what max_staleness may still admit)
    startup_timeout_s: float = 600.0


class VLLMBackend:
    def __init__(
        self,
        settings: VLLMSettings,
        base_dir: str | Path,
        lora_cfg: Any,
        vocab_size: int,
        adapters_dir: str | Path,
        log: Callable[[str], None] = print,
    ) -> None:
        self.s, self.base_dir, self.lora_cfg, self.log = settings, Path(base_dir), lora_cfg, log
        self.vocab_size, self.adapters_dir = vocab_size, Path(adapters_dir)
        self.server: VLLMServer | None = None
        self.engine: VLLMEngine | None = None
        self.sync: AdapterSync | None = None

    @property
    def url(self) -> str:
        return self.s.url or (self.server.url if self.server else "")

    def start(self) -> None:
        if not self.s.url:
            self.server = VLLMServer(
                ServerConfig(
                    model=str(self.base_dir),
                    max_lora_rank=self.lora_cfg.rank,
                    max_loras=self.s.keep_versions + 1,
                    max_model_len=self.s.max_len,
                    startup_timeout_s=self.s.startup_timeout_s,
                ),
                log_path=self.adapters_dir.parent / "vllm_server.log",
            )
            self.server.start(log=self.log)
        cfg = VLLMEngineConfig(
            url=self.url,
            max_len=self.s.max_len,
            batch_size=self.s.batch_size,
            concurrency=self.s.concurrency,
            timeout_s=self.s.timeout_s,
            retries=self.s.retries,
        )
        self.engine = VLLMEngine(cfg, model=BASE_NAME)
        self.sync = AdapterSync(
            self.engine,
            self.adapters_dir,
            self.base_dir,
            self.lora_cfg,
            self.vocab_size,
            tol=self.s.probe_tol,
            keep=self.s.keep_versions,
            log=self.log,
        )

    def probe_ids(self) -> list[int]:
        assert self.sync is not None
        return self.sync.probe

    def push(self, model: Any, version: int, expected: np.ndarray, expected_base: np.ndarray) -> ProbeResult:
        assert self.sync is not None
        return self.sync.push(model, version, expected, expected_base)

    def recover(self) -> None:
        """Bring the server back: restart ours, or wait for theirs (up to `wait_s`)."""
        assert self.sync is not None
        if self.server is not None:
            if not self.server.healthy():
                self.log(f"vLLM server unhealthy; restarting it (log {self.server.log_path})")
                self.server.stop()
                self.server.start(log=self.log)
                self.engine.rebind(self.server.url)
        else:
            deadline = time.monotonic() + self.s.wait_s
            while not _healthy(self.s.url):
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"the vLLM server at {self.s.url} is not healthy after {self.s.wait_s:.0f} s"
                    )
                time.sleep(1.0)
        # Whatever it held is gone (a restart) or suspect: the caller pushes the current adapter again.
        self.sync.forget_server()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.server is not None:
            self.server.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


RECOVERABLE = (EngineError, ServerError)

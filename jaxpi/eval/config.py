"""What `jaxpi eval` and `jaxpi select` run with: frozen, validated configs (the CLI flags map onto
them; `jaxpi eval --help` lists every key)."""

from __future__ import annotations

import dataclasses

from jaxpi.runner.attempt import RunnerConfig
from jaxpi.runner.pi_config import LEVELS


@dataclasses.dataclass(frozen=True)
class AttemptsConfig:
    """The attempts both commands run: which tasks, at which levels, how many, and how."""

    tasks: str  # a task directory or a directory of them
    levels: tuple[str, ...] = ("low", "medium", "xhigh")  # Pi thinking levels, each a row of the table
    attempts: int = 1  # attempts per task and level (K)
    jobs: int = 2  # attempts at once (and engine rows of the served model)
    max_len: int = 8192  # served context per request, tokens (what Pi is told the model has)
    max_new_tokens: int = 2048  # tokens per model call
    wall_seconds: float = 0.0  # per attempt; 0 = the task's limit (the TwIL-8B-pi card: 1200)
    max_turns: int = 0  # model calls per attempt (one per Pi turn); 0 = the task's limit (the card: 30)
    tools: tuple[str, ...] = ()  # Pi's tool allowlist, e.g. [bash]; () = Pi's read, bash, edit, write
    temperature: float | None = None  # sampling temperature; None = the server's (the card: 0.8)
    top_p: float | None = None  # nucleus sampling; None = the server's
    seed: int = 0  # seed of the first call; attempts draw apart from it

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", str(self.tasks))
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "tools", tuple(self.tools))
        errors = []
        if not self.levels or any(lv not in LEVELS for lv in self.levels):
            errors.append(f"levels must be a comma list of {LEVELS}, got {list(self.levels)}")
        for name in ("attempts", "jobs", "max_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.wall_seconds < 0 or self.max_turns < 0:
            errors.append(
                f"wall_seconds and max_turns must be >= 0 (0 = the task's limit), got {self.wall_seconds}, {self.max_turns}"
            )
        if self.temperature is not None and not self.temperature >= 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if errors:
            raise ValueError("; ".join(errors))

    def runner(self, model_id: str) -> RunnerConfig:
        """How each attempt runs against the served `model_id`."""
        return RunnerConfig(
            model_id=model_id,
            context_window=self.max_len,
            max_tokens_per_call=self.max_new_tokens,
            wall_seconds=self.wall_seconds,
            max_turns=self.max_turns,
            jobs=self.jobs,
            tools=self.tools,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig(AttemptsConfig):
    """One `jaxpi eval`: a checkpoint served for the run, or a running endpoint."""

    model: str | None = None  # checkpoint to serve (HF dir or jaxpi run/checkpoint)
    adapter: str | None = None  # adapter on top of `model`
    endpoint: str | None = None  # a running OpenAI-compatible endpoint instead of `model`
    model_id: str | None = None  # model name sent to `endpoint`
    api_key: str | None = dataclasses.field(default=None, repr=False)  # the API key Pi sends to `endpoint`
    name: str | None = None  # name in tables and plots; None: the model dir's
    out: str | None = None  # output directory; None: runs/eval/<name>
    compare: str | None = None  # a saved eval (dir with results.json) or a checkpoint, evaluated alike

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.model is None) == (self.endpoint is None):
            raise ValueError("give exactly one of --model and --endpoint (model=..., endpoint=...)")


@dataclasses.dataclass(frozen=True)
class SelectConfig(AttemptsConfig):
    """One `jaxpi select`: checkpoints or saved evaluations, ranked by pooled pass rate."""

    # saved `jaxpi eval` outputs (a dir with results.json, reused as is) or checkpoints (evaluated)
    ckpts: tuple[str, ...] = ()
    out: str = "runs/select"  # where new evaluations are written

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ckpts", tuple(str(c) for c in self.ckpts))
        if not self.ckpts:
            raise ValueError("ckpts must name at least one checkpoint or saved evaluation")

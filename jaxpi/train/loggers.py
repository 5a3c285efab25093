"""Where a run's step records go: one `Logger` interface, four implementations.

    jsonl         `<dir>/metrics.jsonl`, always: the whole record, one flushed line per step
    tensorboard   tensorboardX events under `<dir>/tb`
    wandb         `wandb.init(dir=<dir>)` + `run.log(scalars, step=step)`; `WANDB_MODE=offline`
                  writes the run under `<dir>/wandb` (`pip install 'jaxpi[wandb]'`)
    mlflow        `mlflow.start_run` + `mlflow.log_metrics(scalars, step=step)` to
                  `MLFLOW_TRACKING_URI`, or a file store in `<dir>/mlruns` (`pip install 'jaxpi[mlflow]'`)

`output.loggers` names the ones besides jsonl. Every logger writes a record's finite numbers under
the record's own keys (`loss`, `level/low/pass_rate`, `eval/level/low/pass_rate`) at its `step`:
a tag reads the same in metrics.jsonl, TensorBoard, W&B and MLflow.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

# Logger name -> (the module it imports, the pip extra that installs it).
LOGGERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboardX", ""),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


class Logger(Protocol):
    """Takes each step's record (`{"step": int, key: value, ...}`) as it is written."""

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MissingLoggerError(ValueError):
    """`output.loggers` names a logger whose library is not installed."""


def logger_errors(names: Sequence[str], key: str = "output.loggers") -> list[str]:
    """What is wrong with a list of logger names (unknown, with the closest known name; repeated)."""
    errors = []
    for name in names:
        if name not in LOGGERS:
            close = difflib.get_close_matches(name, list(LOGGERS), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{key}: unknown logger {name!r}{hint}; known: {', '.join(LOGGERS)}")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        errors.append(f"{key} names {', '.join(map(repr, repeated))} more than once")
    return errors


def require_loggers(names: Sequence[str], key: str = "output.loggers") -> None:
    """Fail before any work when a named logger's library is missing, naming the extra to install."""
    for name in names:
        module, extra = LOGGERS[name]
        if importlib.util.find_spec(module) is None:
            how = f"pip install 'jaxpi[{extra}]'" if extra else f"pip install {module}"
            raise MissingLoggerError(f"{key} names {name!r}, but {module} is not installed: {how}")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers by key, `step` left out (what every logger but jsonl writes)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class JsonlLogger:
    """`<dir>/metrics.jsonl`, appended one flushed line per record: a kill loses at most a torn
    last line, which `jaxpi.train.metrics.truncate_jsonl` drops on resume."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def log(self, record: Mapping[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    """tensorboardX events under `<dir>/tb`; events after `start_step` (a killed run's tail) are purged."""

    def __init__(self, run_dir: Path, start_step: int) -> None:
        from tensorboardX import SummaryWriter

        # purge_step: events at steps >= it are hidden; a fresh run (0) drops a killed fresh run's.
        # The suffix keeps a resume within the same second (file names hold whole seconds) from
        # overwriting the file before it, and sorts after it.
        self.writer = SummaryWriter(
            str(run_dir / "tb"),
            purge_step=start_step + 1 if start_step else 0,
            filename_suffix=f".from{start_step:09d}",
        )

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One W&B run per process, in `<dir>/wandb`; `WANDB_PROJECT` (default "jaxpi"), `WANDB_MODE`
    and the rest of W&B's environment apply. A resumed run is a new W&B run whose steps go on."""

    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "jaxpi",
            name=name,
            dir=str(run_dir),
            config=dict(config),
        )

    def log(self, record: Mapping[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class MLflowLogger:
    """One MLflow run per process in experiment `MLFLOW_EXPERIMENT_NAME` (default "jaxpi"), at
    `MLFLOW_TRACKING_URI`, or without one a file store in `<dir>/mlruns`; the config goes in as
    the artifact config.json."""

    def __init__(self, run_dir: Path, name: str, config: Mapping[str, Any]) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses a file store unless asked: this one is the run's own, local copy.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        experiment = mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or "jaxpi")
        self.mlflow = mlflow
        self.run_id = mlflow.start_run(experiment_id=experiment.experiment_id, run_name=name).info.run_id
        mlflow.log_dict(dict(config), "config.json", run_id=self.run_id)

    def log(self, record: Mapping[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.mlflow.log_metrics(values, step=int(record["step"]), run_id=self.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


def open_loggers(
    names: Sequence[str], run_dir: Path, *, start_step: int, name: str, config: Mapping[str, Any]
) -> list[Logger]:
    """The loggers `names` (`output.loggers`) for the run in `run_dir`, resuming after `start_step`."""
    require_loggers(names)
    out: list[Logger] = []
    try:
        for n in names:
            if n == "tensorboard":
                out.append(TensorBoardLogger(run_dir, start_step))
            elif n == "wandb":
                out.append(WandbLogger(run_dir, name, config))
            else:
                out.append(MLflowLogger(run_dir, name, config))
    except BaseException:
        for logger in out:
            logger.close()
        raise
    return out

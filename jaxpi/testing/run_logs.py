"""Read back what a run's loggers wrote, as `{(step, key): value}`, to compare with metrics.jsonl.

    tensorboard_scalars(run_dir / "tb")     tensorboardX's own event protos; purged steps dropped
    wandb_offline_history(run_dir)          the `.wandb` file of a WANDB_MODE=offline run
    mlflow_metrics(run_dir / "mlruns")      MLflow's client on the file store

The TensorBoard and W&B files are record logs of protobufs: TFRecord framing (u64 length, u32
crc, data, u32 crc) and LevelDB's log framing (32 KiB blocks of crc32c, u16 length, u8 type).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

Scalars = dict[tuple[int, str], float]


def tensorboard_scalars(tb_dir: Path) -> Scalars:
    """Every scalar of the event files in `tb_dir`, oldest file first; a file's start-of-session
    event at step p hides the earlier files' steps >= p, as TensorBoard does (`purge_step`)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out: Scalars = {}
    for path in sorted(Path(tb_dir).glob("events.out.tfevents.*")):
        for data in _tfrecords(path.read_bytes()):
            event = Event.FromString(data)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = {k: v for k, v in out.items() if k[0] < event.step}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out[(int(event.step), value.tag)] = float(value.simple_value)
    return out


def wandb_offline_history(run_dir: Path) -> Scalars:
    """The history rows of the one offline W&B run under `run_dir/wandb` (W&B's own `_` keys left out)."""
    import json

    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")
    out: Scalars = {}
    for data in _leveldb_records(path.read_bytes()):
        rec = Record.FromString(data)
        if rec.WhichOneof("record_type") != "history":
            continue
        step = int(rec.history.step.num)
        for item in rec.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                out[(step, key)] = float(json.loads(item.value_json))
    return out


def mlflow_metrics(store: Path) -> Scalars:
    """Every metric of the one run in the file store `store`, by step."""
    import mlflow

    with _env("MLFLOW_ALLOW_FILE_STORE", "true"):
        client = mlflow.MlflowClient(Path(store).absolute().as_uri())
        experiments = client.search_experiments()
        (run,) = client.search_runs([e.experiment_id for e in experiments])
        out: Scalars = {}
        for key in run.data.metrics:
            for m in client.get_metric_history(run.info.run_id, key):
                out[(int(m.step), key)] = float(m.value)
    return out


# ---- framing -------------------------------------------------------------------------------------
def _tfrecords(data: bytes) -> Iterator[bytes]:
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        yield data[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def _leveldb_records(data: bytes, block: int = 32768) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (no :W&B header)")
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            yield parts
            parts = b""
        elif kind == 0:  # zero padding
            parts = b""


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old

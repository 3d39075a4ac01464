"""Read back what the experiment trackers wrote, each with its own library's reader (for the tests of
``peagle.pipeline.tracking``): TensorBoard's ``EventAccumulator``, W&B's offline run file (its
``wandb_internal_pb2.Record`` protobufs in W&B's LevelDB-style log, the format ``wandb sync`` uploads),
``MlflowClient`` and Trackio's SQLite database. Each returns ``{tag: [(step, value), ...]}``.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

Series = dict[str, list[tuple[int, float]]]


def tensorboard_scalars(log_dir: Path) -> Series:
    """Every scalar series in ``log_dir``, as TensorBoard shows it (events past a resume point purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_hparams(log_dir: Path) -> dict[str, Any]:
    """The hyperparameters of the hparams tab (its session-start record)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(log_dir))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in hparams.items()}


def tensorboard_texts(log_dir: Path) -> dict[str, str]:
    """The text tab's entries (tag -> its last text)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {tag: tensor_util.make_ndarray(events.Tensors(tag)[-1].tensor_proto).item().decode()
            for tag in events.Tags()["tensors"] if tag.endswith("/text_summary")}


WANDB_BLOCK = 32768
WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
WANDB_RECORD = struct.Struct("<IHB")  # crc32, length, type (1 full, 2 first, 3 middle, 4 last)


def wandb_records(path: Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` messages of an offline run file (``run-ID.wandb``)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _, _ = WANDB_HEADER.unpack_from(data)
    assert ident == b":W&B", f"{path} is not a W&B run file"
    pos, pending = WANDB_HEADER.size, b""
    while pos + WANDB_RECORD.size <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < WANDB_RECORD.size:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = WANDB_RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        pos += WANDB_RECORD.size
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_offline_run(run_dir: Path) -> dict[str, Any]:
    """{"run_id", "name", "project", "config", "history": Series, "summary"} of one offline run directory
    (no ``run_id`` when the file holds no run record yet: W&B writes it every few seconds)."""
    out: dict[str, Any] = {"config": {}, "history": defaultdict(list), "summary": {}}
    (path,) = run_dir.glob("run-*.wandb")
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(run_id=record.run.run_id, name=record.run.display_name, project=record.run.project)
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = int(items.pop("_step", record.history.step.num))
            for key, value in items.items():
                if not key.startswith("_"):
                    out["history"][key].append((step, float(value)))
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.summary.update})
    out["history"] = dict(out["history"])
    return out


def mlflow_run(tracking_uri: str, run_id: str) -> dict[str, Any]:
    """{"params", "status", "name", "metrics": Series} of an MLflow run, read with ``MlflowClient``."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    metrics = {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}
    return {"params": dict(run.data.params), "status": run.info.status, "name": run.info.run_name,
            "metrics": metrics, "artifacts": [f.path for f in client.list_artifacts(run_id, "peagle")]}


def trackio_run(db: Path, run_name: str) -> dict[str, Any]:
    """{"config", "metrics": Series} of a Trackio run, from the project's SQLite database."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY id", (run_name,)).fetchall()
        configs = conn.execute("SELECT config FROM configs WHERE run_name = ?", (run_name,)).fetchall()
    series: Series = defaultdict(list)
    for step, metrics in rows:
        for key, value in json.loads(metrics).items():
            if isinstance(value, (int, float)):
                series[key].append((int(step), float(value)))
    return {"config": json.loads(configs[0][0]) if configs else {}, "metrics": dict(series)}

"""Read a tracker's store back with the tracker's own reader: {key: {step: value}} per tracker.

``python -m tests.runs.tracker_readers trackio PROJECT RUN`` prints trackio's logs as JSON
(trackio fixes its database folder, ``$TRACKIO_DIR``, when it is imported, so the test reads
it in a process of its own).
"""

from __future__ import annotations

import glob
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any


def tensorboard_scalars(logdir: Path) -> tuple[dict[str, dict[int, float]], str]:
    """Scalars (float64 tensors) and the config text, through TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    ea.Reload()
    out: dict[str, dict[int, float]] = {}
    config = ""
    for tag in ea.Tags()["tensors"]:
        for ev in ea.Tensors(tag):
            arr = tensor_util.make_ndarray(ev.tensor_proto)
            if tag.startswith("config"):
                config = arr.item().decode() if arr.ndim == 0 else arr.ravel()[0].decode()
            else:
                out.setdefault(tag, {})[int(ev.step)] = float(arr)
    return out, config


def mlflow_metrics(uri: str, run_name: str) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """Metric histories and params of the run named ``run_name``, through MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("icsd")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, runs
    run = runs[0]
    out = {k: {int(m.step): float(m.value) for m in client.get_metric_history(run.info.run_id, k)}
           for k in run.data.metrics}
    return out, dict(run.data.params)


def trackio_logs(project: str, run: str) -> dict[str, dict[int, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[str, dict[int, float]] = {}
    for rec in SQLiteStorage.get_logs(project, run):
        for k, v in rec.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                out.setdefault(k, {})[int(rec["step"])] = float(v)
    return out


def _leveldb_records(data: bytes) -> list[bytes]:
    """The records of W&B's transaction log: LevelDB log framing (32 KiB blocks, 7-byte headers) after
    a 7-byte file header (``:W&B``, magic, version)."""
    assert data[:4] == b":W&B", data[:7]
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            out.append(part + chunk)
        elif kind == 0:
            break
    return out


def wandb_history(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, Any]]:
    """History rows and config of the offline run under ``run_dir``, decoded with wandb's own protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    out: dict[str, dict[int, float]] = {}
    config: dict[str, Any] = {}
    for raw in _leveldb_records(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            step = int(row.get("_step", rec.history.step.num))
            for k, v in row.items():
                if not k.startswith("_"):
                    out.setdefault(k, {})[step] = math.nan if v in ("NaN", None) else float(v)
        elif kind in ("run", "config"):
            items = rec.run.config.update if kind == "run" else rec.config.update
            for i in items:
                config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out, config


if __name__ == "__main__":
    if sys.argv[1] == "trackio":
        print(json.dumps(trackio_logs(sys.argv[2], sys.argv[3])))

"""Experiment trackers (``icsd train --report-to tensorboard,mlflow,trackio,wandb``): every step's record, live.

Each tracker is an optional extra (``pip install 'icsd-audit[tensorboard]'``, ...,
``[trackers]`` for all four) and writes locally unless told otherwise:

* ``tensorboard``: event files in ``<run>/tensorboard/`` (scalars as float64 tensors, so a
  value read back equals ``metrics.jsonl`` exactly; the config as a JSON text summary);
* ``mlflow``: ``$MLFLOW_TRACKING_URI`` if set, else a SQLite store ``<run>/mlflow.db`` (MLflow's
  local backend); experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``icsd``; the config as params;
* ``trackio``: trackio's local database (``$TRACKIO_DIR``, default in the Hugging Face cache),
  project ``$TRACKIO_PROJECT`` or ``icsd``; ``trackio show`` opens it;
* ``wandb``: offline (``$WANDB_MODE`` overrides it) under ``<run>/wandb/``, project
  ``$WANDB_PROJECT`` or ``icsd``; ``wandb sync`` uploads it later.

Every numeric key of a step's record is logged at that step (the keys of
``metrics.jsonl``; a value the log writes as ``null`` is logged as NaN), the run name is the
run folder's name and the config goes with the run.  A tracker whose package is missing
is one line naming its extra, before any work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, Sequence

__all__ = ["TRACKERS", "TrackerUnavailable", "parse_report_to", "check_available", "Trackers", "open_trackers",
           "scalars", "hf_report_to"]

#: Tracker name -> the module it needs (the extra has the tracker's name).
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "mlflow": "mlflow", "trackio": "trackio", "wandb": "wandb"}


class TrackerUnavailable(ValueError):
    """A requested tracker's package is not installed; the message names the extra."""


def parse_report_to(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"tensorboard,mlflow"`` (or a list) -> validated names; ``""``, ``"none"`` or None -> ()."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(x).strip().lower() for x in items if str(x).strip()]
    if names in ([], ["none"]):
        return ()
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ValueError(f"unknown tracker {bad[0]!r}: choose from {', '.join(TRACKERS)} (comma-separated) or none")
    return tuple(dict.fromkeys(names))


def check_available(names: Sequence[str]) -> None:
    """One line naming the extra of the first requested tracker whose package is missing."""
    for name in names:
        try:
            found = importlib.util.find_spec(TRACKERS[name]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise TrackerUnavailable(f"--report-to {name} needs the {name} package: pip install 'icsd-audit[{name}]' "
                                     "(all trackers: 'icsd-audit[trackers]')")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Every numeric key of a step record except ``step``, as float (None -> NaN)."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, (str, list, dict, tuple)):
            continue
        if v is None:
            out[k] = math.nan
        elif isinstance(v, bool):
            out[k] = float(v)
        else:
            try:
                out[k] = float(v)
            except (TypeError, ValueError):
                continue
    return out


class _Sink(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Trackers that announce themselves on stdout say it on stderr (stdout belongs to the command)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


class _TensorBoard:
    def __init__(self, out: Path, config: Mapping[str, Any], run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = out / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)
        self.writer.flush()

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step, new_style=True, double_precision=True)
        self.writer.flush()  # a crash loses nothing already logged

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, out: Path, config: Mapping[str, Any], run_name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        local = "MLFLOW_TRACKING_URI" not in os.environ
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "icsd")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            name, artifact_location=(out / "mlflow-artifacts").resolve().as_uri() if local else None)
        run = self.client.create_run(exp_id, run_name=run_name, tags={"icsd.run_dir": str(out.resolve())})
        self.run_id = run.info.run_id
        params = [Param(k, json.dumps(v, default=str) if not isinstance(v, str) else v)
                  for k, v in sorted(config.items())]
        for i in range(0, len(params), 100):  # MLflow's per-batch limit on params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, out: Path, config: Mapping[str, Any], run_name: str) -> None:
        import trackio

        with _quiet_stdout():
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "icsd"), name=run_name,
                                    config=dict(config), auto_log_cpu=False, auto_log_gpu=False, embed=False)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        import trackio

        with _quiet_stdout():
            if trackio.context_vars.current_run.get() is self.run:
                trackio.finish()  # also clears trackio's current run, or its exit hook finishes it again
            else:
                self.run.finish()


class _Wandb:
    def __init__(self, out: Path, config: Mapping[str, Any], run_name: str) -> None:
        import wandb

        with _quiet_stdout():
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "icsd"), name=run_name, config=dict(config),
                                  dir=str(out.resolve()), mode=os.environ.get("WANDB_MODE", "offline"),
                                  reinit="create_new")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        with _quiet_stdout():
            self.run.finish()


_SINKS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "trackio": _Trackio, "wandb": _Wandb}


class Trackers:
    """The open trackers of one run: ``log(record)`` per step, ``close()`` once (idempotent)."""

    def __init__(self, sinks: Mapping[str, _Sink]) -> None:
        self.sinks = dict(sinks)
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        values = scalars(record)
        for sink in self.sinks.values():
            sink.log(step, values)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self.sinks.values():
            sink.close()


def open_trackers(names: Sequence[str], *, out_dir: str | Path, config: Mapping[str, Any],
                  run_name: str | None = None) -> Trackers:
    """Start each named tracker for the run in ``out_dir`` (its package checked first)."""
    names = parse_report_to(list(names))
    check_available(names)
    out = Path(out_dir)
    name = run_name or out.resolve().name
    cfg = json.loads(json.dumps(dict(config), default=str))
    sinks: dict[str, _Sink] = {}
    try:
        for n in names:
            sinks[n] = _SINKS[n](out, cfg, name)
    except BaseException:
        Trackers(sinks).close()
        raise
    return Trackers(sinks)


def hf_report_to(names: Sequence[str], out_dir: str | Path) -> list[str]:
    """``report_to`` for a Hugging Face / TRL trainer, with the same local stores as :func:`open_trackers`.

    The trainers' callbacks read their stores from the environment; only unset
    variables are given defaults (the run folder), so a user's own settings stand.
    """
    names = parse_report_to(list(names))
    check_available(names)
    out = Path(out_dir).resolve()
    if "tensorboard" in names:
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(out / "tensorboard"))
    if "mlflow" in names:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}")
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "icsd")
    if "wandb" in names:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(out))
        os.environ.setdefault("WANDB_PROJECT", "icsd")
    if "trackio" in names:
        os.environ.setdefault("TRACKIO_PROJECT", "icsd")
    return list(names)

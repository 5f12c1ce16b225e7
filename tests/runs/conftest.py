"""Shared fixtures of the runs tests: real short training runs, made once per session."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def installed_trackers() -> list[str]:
    return [t for t in ("tensorboard", "mlflow", "trackio", "wandb") if importlib.util.find_spec(t) is not None]


def tracker_env(root: Path) -> dict[str, str]:
    """Local stores under ``root``: MLflow's file store (read back by the tests), trackio's database, W&B offline."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ICSD_THREADS="1", MLFLOW_TRACKING_URI=(root / "mlruns").as_uri(),
               MLFLOW_ALLOW_FILE_STORE="true", TRACKIO_DIR=str(root / "trackio"), WANDB_MODE="offline",
               WANDB_SILENT="true", TQDM_DISABLE="1")
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    env.pop("TRACKIO_PROJECT", None)
    return env


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sdar-0``, ``sdar-1``, ``icsd-0``, ``icsd-1``: two steps each; ``icsd-0`` reports to the installed trackers."""
    root = tmp_path_factory.mktemp("tiny_runs")
    res = subprocess.run([sys.executable, "-m", "tests.runs.tiny_runs", str(root / "runs"), ",".join(installed_trackers())],
                         cwd=ROOT, env=tracker_env(root), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return root

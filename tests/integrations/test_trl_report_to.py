"""``icsd train --engine trl --report-to tensorboard``: TRL's own tracker logs its keys into the run folder,
and the run folder gets ``run.json`` through the trainer callback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engines
ROOT = Path(__file__).resolve().parents[2]


def test_trl_reports_to_tensorboard_and_writes_a_manifest(tmp_path):
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    pytest.importorskip("tensorboard", reason="tensorboard not installed: pip install 'icsd-audit[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TENSORBOARD_LOGGING_DIR"}
    r = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "train", "--engine", "trl", "--preset", "cpu-demo",
                        "--model", "tiny-random", "--adv", "grpo", "--steps", "2", "--out", str(run),
                        "--report-to", "tensorboard", "--set", "n_tasks=2", "--set", "group_size=2",
                        "--set", "max_turns=2", "--set", "max_response_tokens=8", "--set", "max_prompt_tokens=3000",
                        "--set", "one_shot=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    logs = list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert logs, sorted(str(p) for p in run.rglob("*"))[:40]
    ea = EventAccumulator(str(logs[0].parent), size_guidance={"scalars": 0})
    ea.Reload()
    tags = ea.Tags()["scalars"]
    # TRL's keys, ours among them (icsd/tcm_* is NaN for the untrained model: TRL drops it, as TRL does)
    assert "train/icsd/fallback_share" in tags and "train/icsd/aux_loss" in tags and "train/reward" in tags, tags
    steps = sorted({e.step for e in ea.Scalars("train/reward")})
    assert steps == [1, 2]  # TRL counts optimizer steps from 1
    m = json.loads((run / "run.json").read_text())
    assert m["engine"] == "trl" and m["status"] == "finished" and m["completed_steps"] == 2
    assert m["config"]["report_to"] == "tensorboard"

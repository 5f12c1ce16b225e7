"""``--report-to``: each tracker's store, read back with the tracker's own reader, equals metrics.jsonl.

Trackers are optional extras (``pip install -e '.[trackers]'``); a tracker that is not installed
is skipped here (CI installs them in a step of its own, .ci/run).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from icsd_audit.runs import trackers as T
from tests.runs.conftest import ROOT, installed_trackers, tracker_env
from tests.runs import tracker_readers as R


def jsonl_scalars(run: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {key: {step: value}}, null -> NaN (what a tracker receives for a non-finite value)."""
    out: dict[str, dict[int, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec.items():
            if k != "step" and (v is None or isinstance(v, (int, float))):
                out.setdefault(k, {})[rec["step"]] = math.nan if v is None else float(v)
    return out


def assert_same(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], who: str) -> None:
    assert set(got) == set(want), (who, sorted(set(got) ^ set(want)))
    for k, steps in want.items():
        assert set(got[k]) == set(steps), (who, k)
        for s, v in steps.items():
            g = got[k][s]
            assert (math.isnan(g) and math.isnan(v)) or g == v, (who, k, s, g, v)


def read_back(tracker: str, run: Path, store: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[int, float]]:
    if tracker == "tensorboard":
        scalars, config = R.tensorboard_scalars(run / "tensorboard")
        assert json.loads(config.strip().removeprefix("```json").removesuffix("```")) == \
            json.loads((run / "config.json").read_text())
        return scalars
    if tracker == "mlflow":
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the tests' store is MLflow's local file store
        metrics, params = R.mlflow_metrics((store / "mlruns").as_uri(), run.name)
        assert params["allocator"] == json.loads((run / "config.json").read_text())["allocator"]
        return metrics
    if tracker == "trackio":
        res = subprocess.run([sys.executable, "-m", "tests.runs.tracker_readers", "trackio", "icsd", run.name],
                             cwd=ROOT, env=tracker_env(store), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return {k: {int(s): v for s, v in d.items()} for k, d in json.loads(res.stdout).items()}
    history, config = R.wandb_history(run)
    assert config["allocator"] == json.loads((run / "config.json").read_text())["allocator"]
    return history


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow", "trackio", "wandb"])
def test_store_equals_metrics_jsonl_with_a_live_allocation(tiny_runs, tracker, monkeypatch):
    """A real run whose allocation is not degenerate (finite alloc/tcm at every step): every key of every step."""
    if tracker not in installed_trackers():
        pytest.skip(f"{tracker} not installed: pip install -e '.[{tracker}]'")
    run = tiny_runs / "runs" / "icsd-0"
    want = jsonl_scalars(run)
    assert all(math.isfinite(v) for v in want["alloc/tcm"].values()) and len(want["alloc/tcm"]) == 2
    assert "alloc/share/pos_delta_neg_adv" in want
    # trackio keeps NaN as NaN, W&B as "NaN"; all four keep every key
    assert_same(read_back(tracker, run, tiny_runs, monkeypatch), want, tracker)


def test_cli_report_to_every_installed_tracker(tmp_path, monkeypatch):
    """`icsd train --model tiny-random --steps 2 --report-to ... --out D` (the issue's command): the stores equal
    metrics.jsonl, key for key (the untrained tiny model's turns are all invalid, so no token is active: the steps log
    alloc/tcm_active_tokens 0 and leave alloc/tcm out, and no store may hold one)."""
    names = installed_trackers()
    if not names:
        pytest.skip("no tracker installed: pip install -e '.[trackers]'")
    out = tmp_path / "D"
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "train", "--model", "tiny-random", "--steps", "2",
                          "--report-to", ",".join(names), "--out", str(out), "--plain"], cwd=ROOT,
                         env=tracker_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout == ""  # trackers announce themselves on stderr, never on stdout
    want = jsonl_scalars(out)
    assert len(want["rollout/success"]) == 2
    assert "alloc/tcm" not in want and set(want["alloc/tcm_active_tokens"].values()) == {0.0}
    for tracker in names:
        assert_same(read_back(tracker, out, tmp_path, monkeypatch), want, tracker)
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "finished" and manifest["completed_steps"] == 2 and manifest["engine"] == "builtin"


def test_report_to_names_are_checked():
    assert T.parse_report_to("TensorBoard, mlflow,tensorboard") == ("tensorboard", "mlflow")
    assert T.parse_report_to("none") == () and T.parse_report_to("") == ()
    with pytest.raises(ValueError, match="unknown tracker 'tensorbord'"):
        T.parse_report_to("tensorbord")
    assert T.scalars({"step": 3, "a": None, "b": True, "c": 2, "d": "text", "e": [1]}) == \
        {"a": pytest.approx(math.nan, nan_ok=True), "b": 1.0, "c": 2.0}


def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path):
    """With the package unimportable, `icsd train --report-to wandb` stops before loading anything, exit 2."""
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from icsd_audit.cli.main import main\n"
            f"main(['train', '--model', 'tiny-random', '--report-to', 'wandb', '--out', {str(tmp_path / 'r')!r}])")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: --report-to wandb needs the wandb package: pip install 'icsd-audit[wandb]' "
        "(all trackers: 'icsd-audit[trackers]')"]
    assert not (tmp_path / "r").exists()
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "train", "--report-to", "tensorbord", "--out",
                          str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "unknown tracker 'tensorbord'" in res.stderr

"""``icsd compare`` on real short training runs (tiny random model, built-in loop): manifests, scores, curves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.runs import compare_runs, load_runs
from tests.runs.conftest import ROOT


def logged(run: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_run_has_a_finished_manifest(tiny_runs):
    for run in sorted((tiny_runs / "runs").iterdir()):
        if not run.is_dir():
            continue
        m = json.loads((run / "run.json").read_text())
        assert m["engine"] == "builtin" and m["status"] == "finished" and m["completed_steps"] == 2
        assert m["config"] == json.loads((run / "config.json").read_text())
        assert m["seed"] == m["config"]["seed"] and m["started"] <= m["ended"]
        assert m["versions"]["torch"] and m["hardware"]["cpus"] >= 1
        assert [s["start_step"] for s in m["sessions"]] == [0] and m["sessions"][0]["end_step"] == 2


def test_compare_scores_real_runs_by_hand(tiny_runs):
    runs, skipped = load_runs([tiny_runs / "runs"])
    assert skipped == [] and len(runs) == 4
    c = compare_runs(runs, metric="alloc/tcm", last=2, n_resamples=2000)
    assert c.labels == ("sdar", "icsd") and c.strata == ("webshop",) and not c.excluded
    for lab in c.labels:
        per_run = [np.mean(logged(tiny_runs / "runs" / f"{lab}-{s}", "alloc/tcm")) for s in (0, 1)]
        g = c.group(lab)
        assert g.n_runs == 2 and g.mean.estimate == pytest.approx(np.mean(per_run), rel=1e-12)
        assert g.mean.ci_low <= g.mean.estimate <= g.mean.ci_high
    p = c.pair("icsd", "sdar")
    assert [s for s, *_ in p.paired] == [0, 1]
    want = np.mean([np.mean(logged(tiny_runs / "runs" / f"icsd-{s}", "alloc/tcm")) for s in (0, 1)]) - \
        np.mean([np.mean(logged(tiny_runs / "runs" / f"sdar-{s}", "alloc/tcm")) for s in (0, 1)])
    assert p.difference_of_means.estimate == pytest.approx(want, rel=1e-12)


def test_mechanism_from_dumps_equals_the_logged_trajectory(tiny_runs, tmp_path):
    """`--dumps` recomputes per-step TCM and sign-region shares from each run's dumps: the group curves equal
    the means of what the loop logged, to float32 precision (the loop's statistic uses its in-memory
    coefficients, the dumps store inputs and coefficients in float32: measured 6e-9 relative)."""
    out = tmp_path / "cmp"
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "compare", str(tiny_runs / "runs"), "--metric",
                          "rollout/reward", "--last", "2", "--dumps", "--out", str(out), "--resamples", "300"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "comparison.json").read_text())
    for key in ("alloc/tcm", "alloc/tcm_trust", "alloc/share/pos_delta_neg_adv", "alloc/share_trust/neutral"):
        for lab in ("sdar", "icsd"):
            curve = next(c for c in data["curves"] if c["key"] == key and c["label"] == lab)
            want = np.mean([logged(tiny_runs / "runs" / f"{lab}-{s}", key) for s in (0, 1)], axis=0)
            assert curve["steps"] == [0, 1] and curve["n_runs"] == [2, 2]
            assert curve["mean"] == pytest.approx(want.tolist(), rel=1e-6, abs=1e-9), (key, lab)
    assert (out / "figures" / "mechanism.png").is_file() and (out / "figures" / "curves.pdf").is_file()


def _copy_run(src: Path, dst: Path, **config: object) -> Path:
    """A copy of run folder ``src`` whose config.json claims other allocator settings."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_mechanism_from_dumps_uses_the_settings_the_dumps_record_not_the_config(tiny_runs, tmp_path):
    """SPEC 9: `compare --dumps` recomputes with the deployed settings recorded in the shards, as `icsd audit`
    does; a config.json that says otherwise (edited, or a run resumed with other flags) does not change them."""
    from icsd_audit.runs.curves import dump_series

    lied = _copy_run(tiny_runs / "runs" / "icsd-0", tmp_path / "icsd-0", trust="sigmoid", trust_beta=2.0,
                     allocator="sdar", min_group=2)
    (run,), _ = load_runs([lied])
    series = dump_series(run)
    for key in ("alloc/tcm", "alloc/tcm_trust", "alloc/share/pos_delta_neg_adv"):
        assert series[key].values.tolist() == pytest.approx(logged(lied, key), rel=1e-6, abs=1e-9), key
    # the config's settings give other values: the test would see them
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.run import AuditRequest, run_audit

    o = AllocatorOptions(allocator="sdar", trust="sigmoid", trust_beta=2.0, min_group=2)
    res = run_audit([lied / "dumps"], AuditRequest(base=o, compare=AllocatorOptions(trust="sigmoid", trust_beta=2.0),
                                                    n_resamples=1, seed=0, by="step"), statistics=("tcm",))
    config_tcm = [res.tcm[s].base.estimate for s in res.tcm.keys]
    assert np.max(np.abs(np.array(config_tcm) - np.array(logged(lied, "alloc/tcm_trust")))) > 1e-3


def test_mechanism_from_dumps_without_recorded_settings_takes_the_run_config(tiny_runs, tmp_path):
    """Older dumps record no settings: the run's config.json says what was deployed (one warning), not SPEC's defaults."""
    import warnings

    import pyarrow.parquet as pq

    from icsd_audit.dumps.reader import DumpWarning
    from icsd_audit.runs.curves import dump_series

    run_dir = _copy_run(tiny_runs / "runs" / "icsd-0", tmp_path / "icsd-0", trust="sigmoid", trust_beta=2.0)
    for shard in sorted((run_dir / "dumps").rglob("*.parquet")):  # as an older version wrote them
        t = pq.read_table(shard)
        meta = json.loads(t.schema.metadata[b"icsd.dump"])
        meta.pop("allocator", None)
        pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"icsd.dump": json.dumps(meta).encode()}),
                       shard)
    (run,), _ = load_runs([run_dir])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        series = dump_series(run)
    lines = [str(w.message) for w in seen if issubclass(w.category, DumpWarning)]
    assert any("no deployed allocator settings recorded (older dumps); mechanism curves use the run's config.json "
               "(icsd" in line for line in lines), lines
    # the config's settings (here: sigmoid trust, beta 2, min_group 4), not SPEC's defaults (Laplace, 8)
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.run import AuditRequest, run_audit

    def tcm(**opts: object) -> list[float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DumpWarning)
            res = run_audit([run_dir / "dumps"], AuditRequest(base=AllocatorOptions(allocator="sdar", **opts),
                                                               compare=AllocatorOptions(**opts), n_resamples=1, seed=0,
                                                               by="step"), statistics=("tcm",))
        return [res.tcm[s].compare.estimate for s in res.tcm.keys]

    want = tcm(trust="sigmoid", trust_beta=2.0, min_group=4)
    assert series["alloc/tcm"].values.tolist() == pytest.approx(want, rel=1e-12)
    assert np.max(np.abs(np.array(tcm()) - np.array(want))) > 1e-3

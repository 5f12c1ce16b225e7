"""``icsd audit tcm|quadrants|shift|clip|landscape`` end to end on small synthetic dumps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from icsd_audit.alloc.options import AllocatorOptions

from icsd_audit.dumps.coeffs import compute_coefficients
from icsd_audit.dumps.writer import DumpWriter
from icsd_audit.dumps.synth import synth_tokens


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dumps")
    w = DumpWriter(out, producer="test", synthetic=True)
    for step in (0, 1):
        cols = synth_tokens(6000, seed=step, n_batches=2, step=step)
        cols["batch_id"] = cols["batch_id"] + 10 * step
        w.write(**cols)
    return out


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=300)


def test_tcm_json_matches_numpy_from_coefficients(dumps: Path, tmp_path: Path) -> None:
    res = cli("audit", "tcm", str(dumps), "--resamples", "300", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # exactly one JSON object, nothing else on stdout
    assert {"n_tokens", "n_turns", "n_batches", "sdar", "icsd", "diff"} <= out.keys()
    compute_coefficients([dumps], tmp_path / "c.parquet", AllocatorOptions())
    t = pq.read_table(tmp_path / "c.parquet").to_pydict()
    delta, u, g, c = (np.asarray(t[k]) for k in ("delta", "u", "g", "c"))
    active = (delta > 0) & (np.abs(u) > 1e-4)
    conflict = active & (u < 0)
    for name, w in (("sdar", g), ("icsd", c)):
        want = w[conflict].sum() / w[active].sum()
        got = out[name]
        assert got["estimate"] == pytest.approx(want, rel=1e-9)
        assert got["ci_low"] <= got["estimate"] <= got["ci_high"]
    assert out["diff"]["estimate"] == pytest.approx(out["icsd"]["estimate"] - out["sdar"]["estimate"], abs=1e-12)
    assert out["n_tokens"] == 12000 and out["n_batches"] == 4


def test_quadrants_by_step_and_exact_zero_double_negative(dumps: Path) -> None:
    res = cli("audit", "quadrants", str(dumps), "--resamples", "200", "--json", "--by", "step")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["by"] == "step" and [g["key"] for g in out["groups"]] == [0, 1]
    for grp in out["groups"]:
        regions = grp["regions"]
        assert set(regions) == {"pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv", "neg_delta_neg_adv", "neutral"}
        assert regions["neg_delta_neg_adv"]["diff"] == {**regions["neg_delta_neg_adv"]["diff"], "estimate": 0.0, "ci_low": 0.0, "ci_high": 0.0}
        total = sum(r["icsd"]["estimate"] for r in regions.values())
        assert total == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("cmd", ["shift", "clip", "landscape"])
def test_other_statistics_emit_one_json_object(dumps: Path, cmd: str) -> None:
    extra = [] if cmd == "landscape" else ["--resamples", "100"]
    res = cli("audit", cmd, str(dumps), "--json", *extra)
    assert res.returncode == 0, res.stderr
    assert isinstance(json.loads(res.stdout), dict)


def test_bad_by_column_and_allocator_are_one_line_errors(dumps: Path) -> None:
    res = cli("audit", "tcm", str(dumps), "--by", "env", "--resamples", "10")
    assert res.returncode == 2 and "column 'env'" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("audit", "tcm", str(dumps), "--compare", "bogus", "--resamples", "10")
    assert res.returncode == 2 and "unknown allocator 'bogus'" in res.stderr

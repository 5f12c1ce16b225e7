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

from icsd_audit.audit.coeffs import compute_coefficients
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


def test_fisher_without_score_norm_is_a_one_line_error(dumps: Path, tmp_path: Path) -> None:
    """SPEC 5: fisher needs the score_norm column; its absence names the file and the column."""
    res = cli("audit", "tcm", str(dumps), "--compare", "fisher", "--resamples", "10")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "column 'score_norm'" in res.stderr and ".parquet" in res.stderr and "fisher" in res.stderr
    out = tmp_path / "c.parquet"
    res = cli("audit", "coeffs", str(dumps), "--allocator", "fisher", "--out", str(out))
    assert res.returncode == 2 and "column 'score_norm'" in res.stderr and not out.exists()


def test_fisher_reads_score_norm_from_the_dump(tmp_path: Path) -> None:
    """With the column, the audit's fisher equals the library's fisher on the same arrays."""
    import torch

    from icsd_audit.alloc.variants import allocate

    cols = synth_tokens(3000, seed=5, n_batches=1)
    rng = np.random.default_rng(0)
    cols["score_norm"] = rng.uniform(0, 1.4, size=cols["advantage"].shape[0]).astype(np.float32)
    DumpWriter(tmp_path / "d", producer="test", synthetic=True).write(**cols)
    summary = compute_coefficients([tmp_path / "d"], tmp_path / "c.parquet", AllocatorOptions(allocator="fisher"))
    assert summary.n_tokens > 0
    got = pq.read_table(tmp_path / "c.parquet")
    t = {k: torch.from_numpy(got.column(k).to_numpy().astype(np.float64)) for k in ("advantage", "ratio", "delta",
                                                                                    "score_norm")}
    ids = {k: torch.from_numpy(np.array(got.column(k).to_numpy(zero_copy_only=False)))
           for k in ("traj_id", "turn_id", "batch_id", "valid")}
    want = allocate(**t, **ids, allocator="fisher")
    assert np.allclose(got.column("c").to_numpy(), want.c.numpy(), rtol=1e-12, atol=1e-15)
    # a negative norm is bad input, with file, column and row
    cols["score_norm"][7] = -0.5
    DumpWriter(tmp_path / "bad", producer="test", synthetic=True).write(**cols)
    res = cli("audit", "coeffs", str(tmp_path / "bad"), "--allocator", "fisher", "--out", str(tmp_path / "x.parquet"))
    assert res.returncode == 2 and "column 'score_norm', row 7" in res.stderr

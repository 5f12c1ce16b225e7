"""``icsd audit gradcos`` against an independent numpy computation on dense ``grad`` dumps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from icsd_audit.alloc.options import AllocatorOptions

from icsd_audit.audit.coeffs import compute_coefficients
from icsd_audit.dumps.writer import write_table_atomic
from icsd_audit.dumps.synth import synth_tokens

K = 24


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gdumps")
    cols = synth_tokens(3000, seed=4, n_batches=3)
    rng = np.random.default_rng(0)
    # gradients correlated with the teacher gap so cosines are far from zero
    g = rng.normal(size=(3000, K)) + np.outer(cols["delta"], rng.normal(size=K))
    cols["ratio"][:5] = [1.5, 0.5, 3.5, 1.0, 1.0]  # flat-surrogate tokens exercise the RL mask
    t = pa.table(cols).append_column("grad", pa.FixedSizeListArray.from_arrays(pa.array(g.astype(np.float32).ravel()), K))
    write_table_atomic(t, out / "g.parquet", row_group_size=700)
    return out


def test_cosines_and_gain_equal_numpy(dumps: Path, tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "audit", "gradcos", str(dumps), "--json",
                          "--resamples", "500", "--permutations", "5"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    compute_coefficients([dumps], tmp_path / "c.parquet", AllocatorOptions())
    t = pq.read_table(tmp_path / "c.parquet")
    grad = np.asarray(t.column("grad").combine_chunks().flatten().to_numpy(), dtype=np.float64).reshape(-1, K)
    d = {k: t.column(k).to_numpy().astype(np.float64) for k in ("batch_id", "advantage", "ratio", "g", "c")}
    a = d["advantage"] * d["ratio"]
    flat = ((d["advantage"] > 0) & (d["ratio"] > 1.2)) | ((d["advantage"] < 0) & ((d["ratio"] < 0.8) | (d["ratio"] > 3.0)))
    a[flat] = 0.0
    gains = []
    for row in out["batches"]:
        sel = d["batch_id"] == row["batch_id"]
        r = grad[sel].T @ a[sel]

        def cos(w: np.ndarray) -> float:
            v = grad[sel].T @ w[sel]
            return float(r @ v / np.linalg.norm(r) / np.linalg.norm(v))

        assert row["cos_sdar"] == pytest.approx(cos(d["g"]), abs=1e-4)
        assert row["cos_icsd"] == pytest.approx(cos(d["c"]), abs=1e-4)
        gains.append(cos(d["c"]) - cos(d["g"]))
    assert out["gain"]["estimate"] == pytest.approx(np.mean(gains), abs=1e-4)
    assert out["pairing_gain"]["estimate"] == pytest.approx(out["gain"]["estimate"] - out["perm_gain"]["estimate"], abs=1e-12)
    assert out["sketch_error"]["blocks"] == 8 and out["sketch_error"]["gain"] > 0


def test_missing_sketch_is_a_one_line_error(tmp_path: Path) -> None:
    write_table_atomic(pa.table(synth_tokens(100, seed=0, n_batches=1)), tmp_path / "x.parquet")
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "audit", "gradcos", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "no gradient sketch" in res.stderr and len(res.stderr.strip().splitlines()) == 1

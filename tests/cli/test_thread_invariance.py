"""Audit numbers do not depend on ICSD_THREADS (issue 16 item 14): coefficients and every CI bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import write_table_atomic

from tests.helpers import cli


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("thr")
    # batches far above torch's parallel grain (32768 elements), where summation order follows the thread count
    write_table_atomic(pa.table(synth_tokens(600_000, seed=3, n_batches=2)), out / "x.parquet")
    return out / "x.parquet"


def test_coefficients_and_ci_bounds_identical_across_thread_counts(dump: Path, tmp_path: Path) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        runs = {}
        for n in (1, 3):
            res = cli("audit", "coeffs", str(dump), "--out", str(tmp_path / f"c{n}.parquet"), threads=n)
            assert res.returncode == 0, res.stderr
            res = cli("audit", "quadrants", str(dump), "--resamples", "200", "--json", threads=n)
            assert res.returncode == 0, res.stderr
            runs[n] = json.loads(res.stdout)
    finally:
        torch.set_num_threads(before)
    a, b = pq.read_table(tmp_path / "c1.parquet"), pq.read_table(tmp_path / "c3.parquet")
    for k in ("g", "u", "m", "c"):
        assert np.array_equal(a.column(k).to_numpy(), b.column(k).to_numpy()), k
    assert runs[1] == runs[3]  # estimates, CI bounds and standard errors, bit for bit


def test_library_strata_sets_its_own_thread_count(dump: Path) -> None:
    """``run_strata`` called from Python under torch's 3 threads gives the bits of the 1-thread CLI path."""
    import torch

    from icsd_audit.audit.run import AuditRequest
    from icsd_audit.audit.strata import run_strata

    req = AuditRequest(n_resamples=200, seed=0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        many = run_strata([dump], req, by="abs_delta", bins=4)
        assert torch.get_num_threads() == 3  # the caller's setting comes back
        torch.set_num_threads(1)
        one = run_strata([dump], req, by="abs_delta", bins=4)
    finally:
        torch.set_num_threads(before)
    assert many == one

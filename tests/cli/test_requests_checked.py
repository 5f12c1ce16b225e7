"""Every value of an audit request is checked before the work starts (issue 21 item 4, audit side).

Option errors name the option; resource requests (landscape grid, resamples,
permutations, batch sizes) are checked against the memory they need, in one line
giving the estimate and the limit.  ``ICSD_MEMORY_LIMIT`` pins the limit so the
expected lines are worked out by hand here.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import dump_metadata, write_table_atomic

from tests.helpers import cli, one_line_exit_2

GiB = 1 << 30


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("in")
    cols = synth_tokens(6000, seed=2, n_batches=2)
    g = np.random.default_rng(0).normal(size=(6000, 16)).astype(np.float32)
    t = pa.table(cols).append_column("grad", pa.FixedSizeListArray.from_arrays(pa.array(g.ravel()), 16))
    return write_table_atomic(t, d / "x.parquet", metadata=dump_metadata(producer="test", synthetic=True))


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any batch is allocated: the checks must come first."""
    import icsd_audit.alloc.options as alloc_options
    import icsd_audit.audit.coeffs as coeffs  # imported first: it binds allocate_batch by name

    def never(*args: object, **kw: object) -> None:
        raise AssertionError("a batch was allocated before the request was checked")

    for module in (alloc_options, coeffs):
        monkeypatch.setattr(module, "allocate_batch", never)


@pytest.mark.parametrize("args,line", [
    (["audit", "tcm", "{d}", "--seed", "-1"], "Invalid value for '--seed': -1 is not an integer in [0, 2^63)"),
    (["audit", "tcm", "{d}", "--seed", "99999999999999999999"], "Invalid value for '--seed'"),
    (["audit", "coeffs", "{d}", "--out", "{o}", "--trust", "sigmoid", "--trust-beta", "nan"],
     "Invalid value for '--trust-beta': nan is not a finite number > 0"),
    (["audit", "coeffs", "{d}", "--out", "{o}", "--trust-beta", "-1"],
     "Invalid value for '--trust-beta': -1.0 is not a finite number > 0"),
    (["audit", "report", "{d}", "--out", "{o}", "--trust-beta", "inf"], "Invalid value for '--trust-beta': inf"),
    (["audit", "tcm", "{d}", "--eps", "inf"], "Invalid value for '--eps': inf is not a finite number > 0"),
    (["audit", "tcm", "{d}", "--min-group", "0"], "Invalid value for '--min-group': 0 is not an integer >= 1"),
    (["audit", "tcm", "{d}", "--confidence", "1"], "Invalid value for '--confidence': 1.0 is not a number in (0, 1)"),
    (["audit", "clip", "{d}", "--clip-eps", "nan"], "Invalid value for '--clip-eps': nan is not a number in (0, 1)"),
    (["audit", "clip", "{d}", "--dual-clip", "1"], "Invalid value for '--dual-clip': 1.0 is not a finite number > 1"),
    (["audit", "tcm", "{d}", "--resamples", "0"], "Invalid value for '--resamples': 0 is not an integer >= 1"),
    (["audit", "landscape", "{d}", "--grid", "0"], "Invalid value for '--grid': 0 is not an integer >= 1"),
    (["audit", "gradcos", "{d}", "--permutations", "-1"], "Invalid value for '--permutations': -1 is not an integer >= 0"),
    (["synth", "{o}", "--tokens", "0"], "Invalid value for '--tokens' / '-n': 0 is not an integer >= 1"),
    (["synth", "{o}", "--seed", "-1"], "Invalid value for '--seed': -1"),
])
def test_option_errors_name_the_option(dump: Path, tmp_path: Path, args: list[str], line: str) -> None:
    out = tmp_path / "out"
    one_line_exit_2(cli(*[a.format(d=dump, o=out) for a in args]), f"error: {line}")
    assert not out.exists()


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def test_grid_beyond_the_cap(dump: Path, no_allocation: None) -> None:
    for g in (5000, 100_000):
        cells = g * g
        for cmd in (["audit", "landscape", str(dump)], ["audit", "report", str(dump), "--out", "unused"]):
            line = one_line_exit_2(cli(*cmd, "--grid", str(g)))
            size = cells * 1000  # 1000 bytes per cell and environment (a report's grids, JSON, figure, HTML)
            shown = _gib(size) if size < 1 << 40 else f"{size / (1 << 40):,.1f} TiB"
            assert line == (f"error: --grid {g}: at most 1,000 bins per axis; {g:,} x {g:,} = {cells:,} cells per "
                            f"environment would need about {shown} of memory and {8 * g ** 3:.1e} floating-point "
                            "operations of smoothing")


@pytest.mark.parametrize("resamples", [10**9, 99999999999999999999])
def test_resamples_beyond_memory(dump: Path, monkeypatch: pytest.MonkeyPatch, no_allocation: None,
                                 resamples: int) -> None:
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", "16G")
    # tcm: 3 quantities (base, compare, diff); replicates in float32 (over 256 MiB), and the
    # percentile pass sorts one column at a time with six float64 arrays of R values
    need = resamples * 3 * 4 + 6 * 8 * resamples
    shown = _gib(need) if need < 1 << 60 else f"{need / GiB:.2e} GiB"
    line = one_line_exit_2(cli("audit", "tcm", str(dump), "--resamples", str(resamples)))
    assert line == (f"error: --resamples {resamples}: needs about {shown} of memory ({resamples:,} resamples x 3 "
                    "statistics), more than ICSD_MEMORY_LIMIT=16.0 GiB")


def test_report_counts_every_statistic(dump: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", "1G")
    r = 20_000_000
    k = 3 + 15 + 33 + 15 + 6  # tcm, quadrants, shift (5 + 5 + neutral bins), clip, landscape regions
    need = r * k * 4 + 6 * 8 * r
    line = one_line_exit_2(cli("audit", "report", str(dump), "--out", "unused", "--resamples", str(r)))
    assert f"needs about {_gib(need)} of memory ({r:,} resamples x {k} statistics)" in line


def test_groups_of_by_are_counted_once_known(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--by task``: the number of groups is known only after reading; checked before the bootstrap."""
    cols = synth_tokens(6000, seed=2, n_batches=2)
    cols["task"] = cols["traj_id"]  # one task per trajectory: many groups
    dump = write_table_atomic(pa.table(cols), tmp_path / "t.parquet", metadata=dump_metadata(producer="test", synthetic=True))
    tasks = len(np.unique(cols["task"]))
    assert tasks >= 10
    r = 200_000
    need_one = r * 3 * 8 + 6 * 8 * r * 3  # passes: 19.5 MiB
    need_all = r * 3 * tasks * 4 + 6 * 8 * r * min(3 * tasks, (1 << 22) // r)  # float32 above 256 MiB
    if r * 3 * tasks * 8 <= 1 << 28:
        need_all = r * 3 * tasks * 8 + 6 * 8 * r * min(3 * tasks, (1 << 22) // r)
    limit = (need_one + need_all) // 2
    assert need_one < limit < need_all
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", str(limit))
    line = one_line_exit_2(cli("audit", "tcm", str(dump), "--resamples", str(r), "--by", "task"))
    assert f"({r:,} resamples x 3 statistics in up to {tasks} groups, {3 * tasks} values per resample)" in line


def test_permutations_and_batch_size_against_memory(dump: Path, monkeypatch: pytest.MonkeyPatch,
                                                    no_allocation: None) -> None:
    import pyarrow.parquet as pq

    ids = pq.read_table(dump, columns=["batch_id"]).column("batch_id").to_numpy()
    b, rows = max(((int(x), int((ids == x).sum())) for x in np.unique(ids)), key=lambda t: t[1])
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", "64M")
    p = 1000
    line = one_line_exit_2(cli("audit", "gradcos", str(dump), "--permutations", str(p), "--resamples", "50"))
    assert line == (f"error: --permutations {p}: needs about {3 * 8 * rows * (p + 2) / (1 << 20):,.1f} MiB of memory "
                    f"({p + 2:,} coefficient columns of the largest batch, {rows:,} rows), more than "
                    "ICSD_MEMORY_LIMIT=64.0 MiB")
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", "1M")
    for cmd in (["audit", "tcm", str(dump)], ["audit", "coeffs", str(dump), "--out", "unused.parquet"]):
        line = one_line_exit_2(cli(*cmd, "--resamples", "50") if cmd[1] == "tcm" else cli(*cmd))
        assert line.startswith(f"error: batch {b} ({rows:,} rows, the largest): needs about "
                               f"{300 * rows * 3 / (1 << 20):,.1f} MiB of memory (3 batches in flight; write smaller "
                               "batches), more than ICSD_MEMORY_LIMIT=1.0 MiB")


def test_requests_that_fit_run(dump: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", "2G")
    res = cli("audit", "landscape", str(dump), "--grid", "200", "--resamples", "30", "--json")
    assert res.returncode == 0, res.stderr


def test_bad_memory_limit_is_one_line(dump: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ICSD_MEMORY_LIMIT", "lots")
    one_line_exit_2(cli("audit", "tcm", str(dump)), "ICSD_MEMORY_LIMIT='lots': expected bytes or a number with K, M, G")


def test_limit_parsing_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from icsd_audit.stats import budget

    for text, n in (("123", 123), ("4K", 4096), ("1.5G", 3 * (1 << 29)), ("2TiB", 2 << 40), ("512mb", 512 << 20)):
        monkeypatch.setenv("ICSD_MEMORY_LIMIT", text)
        assert budget.memory_limit() == (n, "ICSD_MEMORY_LIMIT")
    monkeypatch.delenv("ICSD_MEMORY_LIMIT")
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(x.split()[1]) * 1024 for x in fh if x.startswith("MemAvailable:"))
    except OSError:
        pytest.skip("no /proc/meminfo")
    assert 0 < budget.memory_limit()[0] <= avail * 1.1  # MemAvailable moves a little between the reads


@pytest.mark.parametrize("statistics", [("tcm",), ("quadrants",), ("shift",), ("clip",), ("tcm", "shift", "clip")])
@pytest.mark.parametrize("n_bins", [3, 5])
def test_statistic_count_matches_the_accumulator(statistics: tuple[str, ...], n_bins: int) -> None:
    from icsd_audit.stats.accumulator import AuditAccumulator
    from icsd_audit.stats.budget import audit_statistic_count
    from icsd_audit.tokens import Tokens, Weights

    cols = synth_tokens(3000, seed=1, n_batches=1)
    t = Tokens.from_mapping({k: cols[k].astype(np.float64) if cols[k].dtype.kind == "f" else cols[k] for k in cols})
    acc = AuditAccumulator(statistics=statistics, n_bins=n_bins)
    w = np.random.default_rng(0).random(3000)
    acc.add(t, Weights(w, w * 1.5 + 0.1))
    fams = acc.families()
    assert sum(len(f.numerator_index) + len(f.differences) for _, f in fams) == audit_statistic_count(statistics, n_bins)


def test_landscape_statistic_count_matches_the_accumulator() -> None:
    from icsd_audit.stats.api import LandscapeAccumulator
    from icsd_audit.stats.budget import LANDSCAPE_STATISTICS
    from icsd_audit.tokens import Tokens, Weights

    cols = synth_tokens(3000, seed=1, n_batches=1)
    t = Tokens.from_mapping({k: cols[k].astype(np.float64) if cols[k].dtype.kind == "f" else cols[k] for k in cols})
    acc = LandscapeAccumulator(grid=10)
    w = np.random.default_rng(0).random(3000)
    acc.add(t, Weights(w, w * 1.5 + 0.1))
    ((_, fam),) = acc.families()
    assert len(fam.numerator_index) + len(fam.differences) == LANDSCAPE_STATISTICS


def test_library_refuses_bad_allocator_settings() -> None:
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.alloc.variants import allocate
    from icsd_audit.report.results import ReportOptions
    from icsd_audit.stats.budget import ResourceError

    for kw, msg in (({"trust_beta": math.nan}, "trust_beta must be a finite number > 0, got nan"),
                    ({"trust_beta": -1.0}, "trust_beta must be a finite number > 0, got -1.0"),
                    ({"eps": math.inf}, "eps must be a finite number > 0, got inf"),
                    ({"min_group": 0}, "min_group must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
            AllocatorOptions(**kw)
    cols = synth_tokens(300, seed=4, n_batches=1)
    import torch

    arrays = {k: torch.as_tensor(cols[k]) for k in ("advantage", "ratio", "delta", "traj_id", "turn_id")}
    with pytest.raises(ValueError, match="trust_eta must lie in"):
        allocate(**arrays, trust_eta=1.0)
    with pytest.raises(ValueError, match="trust_beta must be a finite"):
        allocate(**arrays, trust="sigmoid", trust_beta=math.nan)
    with pytest.raises(ResourceError, match="--grid 5000: at most 1,000 bins per axis"):
        ReportOptions(grid=5000)

"""One interval per statistic (SPEC 7) for the token strata: ``icsd audit strata`` prints the report's numbers.

The report computes the strata beside every other statistic on one bootstrap; the command
computes them alone.  The same statistic (covariate and K or q), dumps, seed and number of
resamples must give the same estimates and interval bounds, bit for bit, whatever the
worker count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_one_interval import intervals
from .test_outputs import cli
from .test_strata_command import without_entropy

#: the cpu-demo run's dumps carry the entropy column, so the report's strata are by entropy
DUMPS = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "dumps"
R = "700"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("strata-one-interval") / "report"
    res = cli("audit", "report", str(DUMPS), "--out", str(out), "--resamples", R, threads=2)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("args,index,threads", [(("--bins", "10"), 0, 1), ((), 0, 2), (("--top", "0.2"), 1, 1)])
def test_strata_command_prints_the_report_s_intervals(report: dict, args: tuple, index: int, threads: int) -> None:
    res = cli("audit", "strata", str(DUMPS), "--by", "entropy", *args, "--json", "--resamples", R, threads=threads)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    want = report["strata"][index]
    assert got["statistic"] == want["statistic"] and got["edges"] == want["edges"]
    pairs = list(zip(intervals(got["bins"]), intervals(want["bins"])))
    assert len(pairs) == 7 * len(got["bins"]) > 0
    for (path_g, g), (path_w, w) in pairs:
        assert path_g == path_w and g == w, path_g
    assert got["bins"] == want["bins"]


def test_the_report_s_forking_line_quotes_the_top_bin(report: dict, tmp_path: Path) -> None:
    """The summary line's numbers are the top bin's of ``--top 0.2`` (percent, one decimal)."""
    out = tmp_path / "rep"
    res = cli("audit", "report", str(DUMPS), "--out", str(out), "--resamples", R)
    assert res.returncode == 0, res.stderr
    top = report["strata"][1]["bins"][-1]
    b = top["share"]["base"]
    t = top["tcm"]["compare"]
    assert [s["statistic"] for s in report["strata"]] == ["strata:entropy:K10", "strata:entropy:top0.2"]
    head = "forking tokens (top 20 % by next-token entropy)"
    line = next(x for x in res.stderr.splitlines() if x.strip().startswith(head))
    assert f"SDAR {100 * b['estimate']:.1f} [{100 * b['ci_low']:.1f}, {100 * b['ci_high']:.1f}] %" in line
    assert f"ICSD {100 * t['estimate']:.1f} [{100 * t['ci_low']:.1f}, {100 * t['ci_high']:.1f}] %" in line


def test_strata_bins_of_the_report(tmp_path: Path) -> None:
    """``--strata-bins K`` is the command's ``--bins K``; 0 leaves the section out, with the reason."""
    out = tmp_path / "rep"
    res = cli("audit", "report", str(DUMPS), "--out", str(out), "--resamples", "300", "--strata-bins", "4")
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "summary.json").read_text())
    res = cli("audit", "strata", str(DUMPS), "--by", "entropy", "--bins", "4", "--json", "--resamples", "300")
    assert json.loads(res.stdout)["bins"] == rep["strata"][0]["bins"]
    res = cli("audit", "report", str(DUMPS), "--out", str(out), "--resamples", "50", "--strata-bins", "0")
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "summary.json").read_text())
    assert rep["strata"] == [] and rep["omitted"] == {"strata": "not asked for (--strata-bins 0)"}
    assert "*Not shown: not asked for (--strata-bins 0).*" in (out / "summary.md").read_text()


def test_report_on_dumps_without_entropy_takes_the_logp_strata(tmp_path: Path) -> None:
    """On dumps without ``entropy`` (cpu-demo's with the column dropped) the report's strata are by log-probability,
    and its top-20 % split is ``icsd audit strata --by logp --top 0.2``'s, bit for bit."""
    dumps = without_entropy(DUMPS, tmp_path / "plain")
    out = tmp_path / "rep"
    res = cli("audit", "report", str(dumps), "--out", str(out), "--resamples", "300")
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "summary.json").read_text())
    assert [s["statistic"] for s in rep["strata"]] == ["strata:logp:K10", "strata:logp:top0.2"]
    assert "strata" not in rep.get("omitted", {})
    got = cli("audit", "strata", str(dumps), "--by", "logp", "--top", "0.2", "--json", "--resamples", "300")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["bins"] == rep["strata"][1]["bins"]
    b = rep["strata"][1]["bins"][-1]["share"]["base"]
    line = next(x for x in res.stderr.splitlines() if x.strip().startswith("top 20 % by log-probability"))
    assert f"SDAR {100 * b['estimate']:.1f} [{100 * b['ci_low']:.1f}, {100 * b['ci_high']:.1f}] %" in line

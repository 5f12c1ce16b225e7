"""``icsd audit signs`` on the shipped cpu-demo dumps: a loop over the dumps' own columns, and the report's interval.

The reference reads the dumps' deployed ``g`` (SDAR's weighting), ``c`` (ICSD's), ``delta`` and
``valid`` (float32) with pyarrow and sums token by token; the audit recomputes both weightings
from the recorded settings in float64, so the two agree to the float32 storage of the dumps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import cli

from .test_one_interval import intervals

DUMPS = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "dumps"
R = "500"


def _hand() -> dict[str, dict[str, float]]:
    files = sorted(DUMPS.rglob("*.parquet"))
    t = pa.concat_tables([pq.read_table(f, columns=["g", "c", "delta", "valid"]) for f in files])
    d = {k: t.column(k).to_numpy(zero_copy_only=False) for k in ("g", "c", "delta", "valid")}
    sums = {w: {"positive": 0.0, "negative": 0.0, "zero": 0.0} for w in ("tokens", "g", "c")}
    for i in range(d["valid"].size):
        if not d["valid"][i]:
            continue
        x = float(d["delta"][i])
        s = "positive" if x > 0 else "negative" if x < 0 else "zero"
        sums["tokens"][s] += 1.0
        sums["g"][s] += float(d["g"][i])
        sums["c"][s] += float(d["c"][i])
    return {w: {s: v / sum(by.values()) for s, v in by.items()} for w, by in sums.items()}


@pytest.fixture(scope="module")
def command() -> dict:
    res = cli("audit", "signs", str(DUMPS), "--json", "--resamples", R)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_signs_json_reproduces_the_loop_over_the_dump_columns(command: dict) -> None:
    want = _hand()
    assert command["statistic"] == "signs" and command["weightings"] == ["sdar", "icsd"]
    assert command["reference"] == "sdar" and command["notes"] == []
    assert command["settings"]["icsd"]["trust"] == "laplace"
    zero = want["tokens"]["zero"] > 0
    assert ("zero" in command["token_share"]) == zero
    signs = ("positive", "negative", "zero") if zero else ("positive", "negative")
    for s in signs:
        assert command["token_share"][s]["estimate"] == pytest.approx(want["tokens"][s], abs=1e-12)
        assert command["shares"]["sdar"][s]["estimate"] == pytest.approx(want["g"][s], abs=1e-6)
        assert command["shares"]["icsd"][s]["estimate"] == pytest.approx(want["c"][s], abs=1e-6)
        assert command["diff"]["icsd"][s]["estimate"] == pytest.approx(want["c"][s] - want["g"][s], abs=1e-6)
        for side in ("sdar", "icsd"):
            r = command["shares"][side][s]
            assert r["ci_low"] <= r["estimate"] <= r["ci_high"] and r["n_resamples"] == int(R)
    n = command["tokens"]
    assert n["positive"] + n["negative"] + n["zero"] == command["n_tokens"]


def test_the_command_prints_the_report_s_interval(command: dict, tmp_path: Path) -> None:
    out = tmp_path / "report"
    res = cli("audit", "report", str(DUMPS), "--out", str(out), "--resamples", R, "--strata-bins", "0", threads=2)
    assert res.returncode == 0, res.stderr
    want = json.loads((out / "summary.json").read_text())["signs"]
    pairs = list(zip(intervals(command), intervals(want)))
    assert len(pairs) == 4 * len(command["token_share"]) > 0  # token shares, two weightings, one difference
    for (pg, g), (pw, w) in pairs:
        assert pg == pw and g == w, pg
    assert command == want
    md = (out / "summary.md").read_text()
    assert "## Mass by sign of \u0394" in md and "icsd audit signs\\` gives the same intervals" in md
    p = command["shares"]["sdar"]["positive"]
    line = next(x for x in res.stderr.splitlines() if x.strip().startswith("mass on \u0394 > 0"))
    assert f"SDAR {100 * p['estimate']:.1f} [{100 * p['ci_low']:.1f}, {100 * p['ci_high']:.1f}] %" in line


def test_a_table_without_json_and_one_line_errors(tmp_path: Path) -> None:
    res = cli("audit", "signs", str(DUMPS), "--resamples", "50")
    assert res.returncode == 0, res.stderr
    assert "icsd audit signs" in res.stdout and "sdar mass" in res.stdout and "icsd \u2212 sdar (pp)" in res.stdout
    bad = cli("audit", "signs", str(tmp_path / "missing"), "--json")
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1

"""Terminal tables speak percent and say so; --json keeps fractions (issue 15)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from icsd_audit.cli.main import app

DUMPS = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "dumps"


def run(*args: str) -> str:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "ICSD_THREADS": "1"}, terminal_width=200)
    assert res.exit_code == 0, res.output
    return res.output


def test_tcm_table_in_percent_with_caption_and_json_in_fractions() -> None:
    payload = json.loads(run("audit", "tcm", str(DUMPS), "--resamples", "200", "--json"))
    text = run("audit", "tcm", str(DUMPS), "--resamples", "200")
    for side, unit in (("sdar", "%"), ("icsd", "%"), ("diff", "pp")):
        b = payload[side]
        assert 0 < abs(b["estimate"]) < 1  # JSON: fractions
        cells = [f"{100 * b[k]:.2f} {unit}" for k in ("estimate", "ci_low", "ci_high")]
        row = next(line for line in text.splitlines() if f"│ {side} " in line)
        assert all(c in row for c in cells), (row, cells)
    assert "95 % CI low" in text
    caption = " ".join(text.split())  # the caption wraps to the table's width
    assert "diff = icsd − sdar in percentage points (pp); 95 % percentile bootstrap CI over 200 action-turn resamples" in caption


def test_shift_table_drops_the_duplicate_pp_rows() -> None:
    payload = json.loads(run("audit", "shift", str(DUMPS), "--resamples", "100", "--json"))
    assert "shift_pp" in payload["bins"]["neg_1"]  # JSON unchanged
    text = run("audit", "shift", str(DUMPS), "--resamples", "100")
    assert "shift_pp" not in text and "neg_1.diff" in text

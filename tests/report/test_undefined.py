"""A statistic with no value says n/a and why, in words, on every surface; never nan (issue 24 item 6).

Before: ``icsd audit tcm`` printed a table of ``-`` with no reason, the report's
terminal line ``TCM nan % -> nan % (+nan pp)``.
"""

from __future__ import annotations

import json
from html import unescape
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from icsd_audit.cli.main import app
from icsd_audit.stats.results import tcm_undefined_reason

ZERO_ADV = "every token with delta > 0 has advantage 0"
NO_SUPPORT = "no token has delta > 0"
NAN = re.compile(r"\bnan\b", re.IGNORECASE)


def _dumps(path: Path, *, adv_scale: float = 1.0, delta_sign: float = 0.0, seed: int = 0) -> Path:
    """Two batches of 8 trajectories x 5 turns x 10 tokens; ``delta_sign`` -1 makes every delta negative."""
    from icsd_audit.dumps.writer import DumpWriter

    rng = np.random.default_rng(seed)
    w = DumpWriter(path, producer={"name": "test", "engine": "user"}, synthetic=True)
    for b in range(2):
        n = 400
        traj = np.repeat(np.arange(8), 50)
        turn = np.tile(np.repeat(np.arange(5), 10), 8)
        adv = (adv_scale * np.repeat(rng.normal(size=40), 10)).astype(np.float32)
        delta = rng.normal(size=n).astype(np.float32)
        if delta_sign:
            delta = (delta_sign * np.abs(delta) - (delta == 0)).astype(np.float32)
        w.write(batch_id=b, traj_id=traj, turn_id=turn, advantage=adv, ratio=np.ones(n, np.float32), delta=delta,
                step=b)
    return path


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"}, terminal_width=200)
    return res.exit_code, res.output


def test_reason_names_the_empty_part_of_the_denominator() -> None:
    kw = dict(n_tokens=100, eps=1e-4)
    assert tcm_undefined_reason(n_active=0, n_supported=0, n_supported_zero_advantage=0, **kw).startswith(NO_SUPPORT)
    assert tcm_undefined_reason(n_active=0, n_supported=40, n_supported_zero_advantage=40, **kw).startswith(ZERO_ADV)
    tiny = tcm_undefined_reason(n_active=0, n_supported=40, n_supported_zero_advantage=10, **kw)
    assert tiny == "no token with delta > 0 has |u| = |advantage x ratio x delta| > eps = 0.0001"
    assert tcm_undefined_reason(n_active=0, n_supported=0, n_supported_zero_advantage=0, n_tokens=0, eps=1e-4) == \
        "no valid token"


@pytest.mark.parametrize("kind, reason", [("zero-advantage", ZERO_ADV), ("no-support", NO_SUPPORT),
                                          ("tiny-influence", "no token with delta > 0 has |u|")])
def test_library_and_json_say_why(tmp_path: Path, kind: str, reason: str) -> None:
    from icsd_audit import Weights, allocate, read_dumps, tcm

    d = _dumps(tmp_path / "d", adv_scale={"zero-advantage": 0.0, "tiny-influence": 1e-7}.get(kind, 1.0),
               delta_sign=-1.0 if kind == "no-support" else 0.0)
    for tokens in read_dumps(d):
        out = allocate(tokens, allocator="icsd")
        res = tcm(tokens, Weights(out.g, out.c), n_resamples=50, rng=0)
        assert res.n_active_tokens == 0 and res.undefined.startswith(reason), res.undefined
        d_json = res.to_dict()
        assert d_json["undefined"] == res.undefined and d_json["icsd"]["estimate"] is None
        json.dumps(d_json, allow_nan=False)
    code, text = _cli("audit", "tcm", str(d), "--resamples", "50", "--json")
    assert code == 0, text
    payload = json.loads(text)
    assert payload["undefined"].startswith(reason) and payload["n_active_tokens"] == 0
    import pyarrow.parquet as pq

    deltas = np.concatenate([pq.read_table(f, columns=["delta"])["delta"].to_numpy() for f in sorted(d.rglob("*.parquet"))])
    assert payload["n_supported_tokens"] == int((deltas > 0).sum()) == (0 if kind == "no-support" else payload["n_supported_tokens"])


def test_defined_statistics_have_no_reason(tmp_path: Path) -> None:
    d = _dumps(tmp_path / "d")
    code, text = _cli("audit", "tcm", str(d), "--resamples", "50", "--json")
    assert code == 0, text
    payload = json.loads(text)
    assert payload["undefined"] is None and payload["n_active_tokens"] > 0
    assert payload["n_supported_tokens"] >= payload["n_active_tokens"]
    code, text = _cli("audit", "tcm", str(d), "--resamples", "50")
    assert "n/a" not in text


def test_terminal_tables_say_n_a_and_why(tmp_path: Path) -> None:
    d = _dumps(tmp_path / "d", adv_scale=0.0)
    code, text = _cli("audit", "tcm", str(d), "--resamples", "50")
    assert code == 0, text
    assert text.count("n/a") >= 9 and f"n/a: {ZERO_ADV}" in text, text
    assert not NAN.search(text)
    code, text = _cli("audit", "tcm", str(d), "--resamples", "50", "--by", "step")
    assert f"n/a for step=0: {ZERO_ADV}" in text and f"n/a for step=1: {ZERO_ADV}" in text, text
    code, text = _cli("audit", "shift", str(_dumps(tmp_path / "neg", delta_sign=-1.0)), "--resamples", "50")
    assert "n/a: no token has delta > 0, i.e. S+ is empty" in text, text


@pytest.mark.parametrize("kind", ["zero-advantage", "no-support"])
def test_report_says_n_a_and_why_everywhere(tmp_path: Path, kind: str) -> None:
    d = _dumps(tmp_path / "d", adv_scale=0.0 if kind == "zero-advantage" else 1.0,
               delta_sign=-1.0 if kind == "no-support" else 0.0)
    reason = ZERO_ADV if kind == "zero-advantage" else NO_SUPPORT
    res = CliRunner().invoke(app, ["audit", "report", str(d), "--out", str(tmp_path / "r"), "--resamples", "50"],
                             env={"COLUMNS": "400"}, terminal_width=400)
    assert res.exit_code == 0, res.output
    assert f"trusted-conflict mass: n/a ({reason}" in res.output and not NAN.search(res.output), res.output
    md = (tmp_path / "r" / "summary.md").read_text()
    html = unescape((tmp_path / "r" / "report.html").read_text())
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert f"Trusted-conflict mass is n/a: {reason}" in md
    assert f"Trusted-conflict mass is n/a: {reason}" in html
    assert summary["tcm"]["undefined"].startswith(reason)
    assert "trusted-conflict mass is n/a at every step" in summary["omitted"]["dynamics"]
    for text in (md, re.sub(r"base64,[A-Za-z0-9+/=]+", "", html)):
        assert not NAN.search(text)
    if kind == "no-support":
        assert "n/a: no token has delta > 0, i.e. S+ is empty" in md
        assert not (tmp_path / "r" / "figures" / "shift.png").exists()

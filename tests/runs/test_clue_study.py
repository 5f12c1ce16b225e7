"""examples/clue-study: the README's numbers are what `icsd compare` and `icsd audit report` give on the shipped files."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import cli
from tests.runs.conftest import ROOT

EXAMPLE = ROOT / "examples" / "clue-study"
RUNS = EXAMPLE / "runs"
CELL = re.compile(r"^(-?\d+\.\d+) \[(-?\d+\.\d+|-), (-?\d+\.\d+|-)\]$")


def _rows(first_header: str) -> list[list[str]]:
    """The body rows of the README table whose header row starts with ``| first_header |``."""
    lines = (EXAMPLE / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert rows, first_header
    return rows


def _cell(text: str) -> tuple[float, float | None, float | None]:
    m = CELL.match(text)
    assert m, text
    return tuple(None if g == "-" else float(g) for g in m.groups())  # type: ignore[return-value]


def _same(cell: str, stat: dict) -> None:
    est, lo, hi = _cell(cell)
    assert abs(est - stat["estimate"]) <= 0.005 + 1e-9, (cell, stat)
    if stat["ci_low"] is None:
        assert lo is None and hi is None, cell
    else:
        assert abs(lo - stat["ci_low"]) <= 0.005 + 1e-9 and abs(hi - stat["ci_high"]) <= 0.005 + 1e-9, (cell, stat)


def _compare(paths: list, metric: str, *options: str) -> dict:
    r = cli("compare", *map(str, paths), "--metric", metric, *options, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _runs(acc: str) -> list:
    return sorted((RUNS / f"acc{acc}").glob("*-seed*"))


def test_every_shipped_run_finished_its_200_updates_and_the_readme_counts_them():
    runs = sorted(RUNS.glob("acc*/*-seed*"))
    assert runs
    for run in runs:
        cfg = json.loads((run / "config.json").read_text())
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        assert cfg["total_steps"] == 200 and last["step"] == 199, run
        assert f"acc{cfg['clue_accuracy']}" == run.parent.name and run.name.startswith(cfg["allocator"] + "-seed")
    text = " ".join((EXAMPLE / "README.md").read_text().split())
    assert f"{len(runs)} runs of 200 updates" in text


@pytest.mark.parametrize("metric,options", [("eval/success", ()), ("alloc/tcm", ("--last", "50"))])
def test_the_per_accuracy_tables_are_what_icsd_compare_prints(metric, options):
    groups = [r for r in _rows("clue accuracy") if r[1] == metric and len(r) == 6]
    pairs = [r for r in _pair_rows() if r[1] == metric]
    accs = sorted({r[0] for r in groups})
    assert accs
    for acc in accs:
        d = _compare(_runs(acc), metric, *options, "--baseline", "sdar")
        got = {g["label"]: g for g in d["groups"]}
        mine = [r for r in groups if r[0] == acc]
        assert sorted(r[2] for r in mine) == sorted(got)
        for r in mine:
            g = got[r[2]]
            assert int(r[3]) == g["n_runs"]
            _same(r[4], g["mean"])
            _same(r[5], g["iqm"])
        comps = {f"{c['x']} − {c['y']}": c for c in d["comparisons"]}
        mine = [r for r in pairs if r[0] == acc]
        assert sorted(r[2] for r in mine) == sorted(comps)
        for r in mine:
            _same(r[3], comps[r[2]]["difference_of_means"])
            _same(r[4], comps[r[2]]["probability_of_improvement"])


def _pair_rows() -> list[list[str]]:
    lines = (EXAMPLE / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| clue accuracy | metric | x − y |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_dial_table_is_what_icsd_compare_prints_by_clue_accuracy():
    for r in _rows("allocator"):
        alloc = r[0]
        paths = [p for acc in ("0.4", "1.0") for p in _runs(acc) if p.name.startswith(f"{alloc}-seed")]
        d = _compare(paths, "alloc/tcm", "--last", "50", "--group-by", "clue_accuracy")
        n = {g["label"]: g["n_runs"] for g in d["groups"]}
        assert r[2] == f"{n['0.4']}, {n['1.0']}"
        (c,) = [c for c in d["comparisons"] if {c["x"], c["y"]} == {"0.4", "1.0"}]
        diff, pi = c["difference_of_means"], c["probability_of_improvement"]
        if c["x"] != "0.4":  # the README states 0.4 - 1.0
            flip = {"ci_low": diff["ci_high"], "ci_high": diff["ci_low"]}
            diff = {"estimate": -diff["estimate"], **{k: None if v is None else -v for k, v in flip.items()}}
            flip = {"ci_low": pi["ci_high"], "ci_high": pi["ci_low"]}
            pi = {"estimate": 1 - pi["estimate"], **{k: None if v is None else 1 - v for k, v in flip.items()}}
        _same(r[3], diff)
        _same(r[4], pi)


def _audit_rows(first_header: str) -> list[tuple[list[str], dict]]:
    """The 4 rows of an audit table, each with the summary.json of the report it names (run, dumped updates)."""
    folders = {"0, 10, ..., 190": "", "0, 10, ..., 40": "-first41"}
    rows = _rows(first_header)
    assert len(rows) == 4
    out = []
    for r in rows:
        acc = re.fullmatch(r"sdar-seed0, clue accuracy (\S+)", r[0]).group(1)
        out.append((r, json.loads((EXAMPLE / f"audit-sdar-acc{acc}{folders[r[1]]}" / "summary.json").read_text())))
    return out


def test_the_audit_rows_are_the_shipped_reports_summaries():
    """'| audited run | dumped updates | tokens | TCM under g | TCM under c | c − g |': each report's summary.json."""
    for r, summary in _audit_rows("audited run"):
        tcm = summary["tcm"]
        assert int(r[2].replace(",", "")) == tcm["n_tokens"]
        for cell, key in zip(r[3:6], ("sdar", "icsd", "diff")):
            m = re.fullmatch(r"(-?\d+\.\d) (?:%|pp) \[(-?\d+\.\d), (-?\d+\.\d)\]", cell)
            assert m, cell
            want = [100 * tcm[key][k] for k in ("estimate", "ci_low", "ci_high")]
            assert all(abs(float(g) - w) <= 0.05 + 1e-9 for g, w in zip(m.groups(), want)), (cell, want)


def test_the_sign_of_delta_rows_are_the_shipped_reports_signs():
    """'| sign-of-Δ audit | ... |': each report's summary.json "signs" (the deployed SDAR weighting is the reference)."""
    for r, summary in _audit_rows("sign-of-Δ audit"):
        signs = summary["signs"]
        assert signs["reference"] == "sdar"
        assert int(r[2].replace(",", "")) == signs["tokens"]["positive"]
        stats = (signs["token_share"]["positive"], signs["shares"]["sdar"]["positive"],
                 signs["shares"]["icsd"]["positive"], signs["diff"]["icsd"]["positive"])
        for cell, stat in zip(r[3:7], stats):
            m = re.fullmatch(r"(-?\d+\.\d) (?:%|pp) \[(-?\d+\.\d), (-?\d+\.\d)\]", cell)
            assert m, cell
            want = [100 * stat[k] for k in ("estimate", "ci_low", "ci_high")]
            assert all(abs(float(g) - w) <= 0.05 + 1e-9 for g, w in zip(m.groups(), want)), (cell, want)

"""Report tables: ranges as [lo, hi]; a column equal by construction is merged and explained (issue 15)."""

from __future__ import annotations

from icsd_audit.report.render import _range


def test_ranges_are_always_brackets() -> None:
    assert _range(-0.25, 0.5) == "[-0.25, 0.5]"
    assert _range(0.01, 0.01) == "[0.01, 0.01]"  # was a single number
    assert _range(float("nan"), 1.0) == "empty"


def test_landscape_table_merges_means_equal_by_construction() -> None:
    import dataclasses

    from icsd_audit.report.render import report_tables
    from tests.report import figure_fixtures as fx

    rep = fx.audit_report()
    land = rep.landscape
    envs = {k: dataclasses.replace(g, mean={land.base_name: 0.4, land.compare_name: 0.4}) for k, g in land.envs.items()}
    same = dataclasses.replace(rep, landscape=dataclasses.replace(land, envs=envs))
    (t,) = [t for t in report_tables(same) if t.section == "landscape"]
    assert t.headers[-1] == "mean coefficient" and "by construction" in t.note
    envs = {k: dataclasses.replace(g, mean={land.base_name: 0.4, land.compare_name: 0.5}) for k, g in land.envs.items()}
    differ = dataclasses.replace(rep, landscape=dataclasses.replace(land, envs=envs))
    (t,) = [t for t in report_tables(differ) if t.section == "landscape"]
    assert t.headers[-2:] == ("mean SDAR", "mean ICSD") and not t.note and t.rows[0][-2:] == ("0.4", "0.5")

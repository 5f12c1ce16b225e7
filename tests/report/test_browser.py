"""report.html and the compare page in a real browser: every figure loads, no console error, no page wider than the
window at 1280 and 390 px.

Runs headless Debian ``chromium`` over the DevTools protocol (:mod:`tests.browser`).  Without the binary the
tests skip with the reason, except under CI (``CI`` set to a true value), where ``.ci/run`` installs it: there
a missing browser fails, so the check can never pass by being skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser import PageCheck, check_page, chromium_binary
from tests.report import figure_fixtures as fx
from tests.runs.helpers import write_run

WIDTHS = (1280, 390)


@pytest.fixture(scope="module")
def browser() -> str:
    binary = chromium_binary()
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI is set but no chromium binary is on PATH: .ci/run installs Debian's chromium "
                        "(apt-get install -y chromium); the browser check must run in CI, not skip")
        pytest.skip("no chromium binary on PATH (apt-get install -y chromium): the browser check needs it")
    return binary


def _assert_clean(page: Path, checks: list[PageCheck], n_figures: int) -> None:
    assert [c.width for c in checks] == list(WIDTHS)
    for c in checks:
        where = f"{page.name} at {c.width} px"
        assert c.inner_width == c.width, where
        assert len(c.images) == n_figures, (where, c.images)
        for im in c.images:
            assert im["complete"] and im["naturalWidth"] > 0, (where, im)
        assert c.errors == [], (where, c.errors)
        assert c.scroll_width <= c.inner_width, (where, c.scroll_width, c.wide)


def test_the_detectors_fire_on_a_broken_page(browser: str, tmp_path: Path) -> None:
    """Control: a console error, an image that does not load and a too-wide line are each seen."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><head><meta name="viewport" content="width=device-width"></head><body>'
                    '<script>console.error("control-error")</script><img src="missing.png" alt="gone">'
                    '<p style="white-space: nowrap">' + "wide " * 300 + "</p></body></html>")
    checks = check_page(page, WIDTHS, binary=browser)
    for c in checks:
        assert any("control-error" in e for e in c.errors), c.errors
        assert c.images[0]["naturalWidth"] == 0
        assert c.scroll_width > c.inner_width == c.width
        assert any(w.startswith("p reaches") for w in c.wide), c.wide


def test_report_html_in_a_browser(browser: str, tmp_path: Path) -> None:
    from icsd_audit.report.build import write_report

    out = tmp_path / "report"
    write_report(fx.audit_report(), out)  # the default 200 dpi, as users get it
    page = out / "report.html"
    checks = check_page(page, WIDTHS, binary=browser)
    _assert_clean(page, checks, n_figures=5)
    # a figure is scaled to the window, never wider (at 200 dpi every figure is wider than 390 px)
    assert any(im["naturalWidth"] > 390 for im in checks[-1].images)
    assert all(im["right"] <= 390 for im in checks[-1].images), checks[-1].images


def test_compare_page_in_a_browser(browser: str, tmp_path: Path) -> None:
    for lab in ("sdar", "icsd"):
        for seed in range(3):
            write_run(tmp_path / "runs" / f"{lab}{seed}", [
                {"step": s, "rollout/success": 0.1 * seed + 0.05 * s + (0.1 if lab == "icsd" else 0.0),
                 "rollout/invalid_rate": 0.3 - 0.02 * s, "alloc/tcm": 0.5 - 0.01 * s,
                 "alloc/share/pos_delta_neg_adv": 0.3} for s in range(6)], allocator=lab, seed=seed)
    # a long name in the "Left out" list must wrap, not widen the page
    stray = tmp_path / ("notes-" + "x" * 160 + ".md")
    stray.write_text("not a run\n")
    out = tmp_path / "cmp"
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "compare", str(tmp_path / "runs"), str(stray), "--metric",
                          "rollout/success", "--curves", "rollout/invalid_rate", "--resamples", "200", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    page = out / "report.html"
    checks = check_page(page, WIDTHS, binary=browser)
    # a learning curve per metric (success, invalid rate) and the mechanism trajectory
    _assert_clean(page, checks, n_figures=3)
    assert [im["alt"] for im in checks[0].images] == [
        "Learning curve of rollout/success", "Learning curve of rollout/invalid_rate", "Mechanism trajectory"]
    text = page.read_text()
    assert "<strong>Learning curve of rollout/invalid_rate.</strong> Per training step" in text
    assert "(curves" not in text and "(mechanism" not in text
    assert stray.name in text  # the page does list it

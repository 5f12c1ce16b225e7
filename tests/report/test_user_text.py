"""User strings reach figures and summary.md as written: no mathtext parse, no raw HTML, no Markdown link."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import dump_metadata, write_table_atomic
from icsd_audit.report.figures.style import new_figure, plain, render
from icsd_audit.report.render import md_text
from tests.cli.test_outputs import cli
from tests.runs.helpers import write_run

FRAC = r"$\frac{1}{$"
SCRIPT = "<script>alert(1)</script>"
LINK = "[x](javascript:alert(1))"


def test_plain_text_is_drawn_as_written() -> None:
    fig = new_figure()
    ax = fig.subplots()
    for i, s in enumerate((FRAC, "$x$", r"a\$b", "no dollars")):
        t = ax.text(0.1, 0.2 * i, plain(s))
        # matplotlib's own decision: not mathtext, and the string it draws is the original
        assert t._preprocess_math(t.get_text()) == (s, False)
    assert render(fig, "png")[:4] == b"\x89PNG"
    bad = new_figure()
    bad.subplots().set_title(FRAC)
    try:
        render(bad, "png")
    except ValueError as exc:  # what an unescaped label does
        assert "frac" in str(exc)
    else:
        raise AssertionError("an unescaped unbalanced $ label rendered: the test no longer shows the hazard")


def test_md_text_by_hand() -> None:
    assert md_text(SCRIPT) == "&lt;script>alert(1)&lt;/script>"  # no '<': no tag, no autolink
    assert md_text(FRAC) == r"\$\\frac\{1\}\{\$"
    assert md_text(LINK) == r"[x\](javascript:alert(1))"
    assert md_text("![i](http://e.org/x.png)") == r"\![i\](http://e.org/x.png)"
    assert md_text("[ref]: http://e.org") == r"[ref\]: http://e.org"
    assert md_text("_a_ *b* `c` d|e ~~f~~ # A & B") == r"\_a\_ \*b\* \`c\` d\|e \~\~f\~\~ \# A &amp; B"
    assert md_text("> quote, a > b") == "&gt; quote, a > b"  # a quote only where the text starts
    # our own formatting is left readable
    assert md_text("0.8 [0.3, 1.3]") == "0.8 [0.3, 1.3]" and md_text("pos_delta_neg_adv") == "pos_delta_neg_adv"


def _no_user_markup(md: str) -> None:
    assert "<script" not in md.lower() and "<" not in md.replace("&lt;", "")
    assert not re.search(r"(?<!\\)\]\(javascript", md) and FRAC not in md  # a link needs an unescaped ](


def test_compare_pages_with_hostile_labels(tmp_path: Path) -> None:
    metric = "m" + FRAC
    for i, label in enumerate((FRAC, SCRIPT, LINK)):
        for seed in range(2):  # (folders by position: names from hash() % 1000 collide in about 3 of 1,000 processes)
            write_run(tmp_path / "runs" / f"{i}-{seed}",
                      [{"step": s, metric: 0.1 * s + seed, "alloc/tcm": 0.3} for s in range(4)],
                      allocator=label, seed=seed, env="env" + FRAC)
    out = tmp_path / "cmp"
    res = cli("compare", str(tmp_path / "runs"), "--metric", metric, "--out", str(out), "--resamples", "50")
    assert res.returncode == 0, res.stderr
    assert (out / "figures" / "curves.png").stat().st_size > 0 and (out / "figures" / "mechanism.png").is_file()
    md = (out / "summary.md").read_text()
    _no_user_markup(md)
    for label in (FRAC, SCRIPT, LINK):
        assert f"| {md_text(label)} | 2 |" in md  # each group's row, its label escaped
    assert "<script" not in (out / "report.html").read_text().lower()


def test_audit_report_with_hostile_env_and_producer(tmp_path: Path) -> None:
    cols = synth_tokens(3000, seed=2, n_batches=3)
    envs = np.array([FRAC, SCRIPT, LINK])[cols["batch_id"] % 3]
    t = pa.table(cols).append_column("env", pa.array(envs.tolist()))
    meta = dump_metadata(producer={"name": SCRIPT}, synthetic=True, allocator={"allocator": "icsd"})
    f = write_table_atomic(t, tmp_path / "d.parquet", metadata=meta)
    out = tmp_path / "rep"
    res = cli("audit", "report", str(f), "--out", str(out), "--resamples", "50")
    assert res.returncode == 0, res.stderr
    assert (out / "figures" / "landscape.png").is_file()
    md = (out / "summary.md").read_text()
    _no_user_markup(md)
    assert '"name": "&lt;script>alert(1)&lt;/script>"' in md  # the producer block, from the dump's metadata
    for env in (FRAC, SCRIPT, LINK):
        assert f"| {md_text(env)} |" in md
    assert "<script" not in (out / "report.html").read_text().lower()

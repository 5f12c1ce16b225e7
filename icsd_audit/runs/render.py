"""Presenting a comparison: table rows (terminal, Markdown, HTML), the JSON payload and the ``--out`` folder.

One list of :class:`~icsd_audit.report.render.Table` objects feeds every text form, so the
terminal, ``summary.md`` and ``report.html`` can never disagree.  The HTML page is
self-contained like the audit report's (figures as base64 PNG, inline CSS, a
Content-Security-Policy that forbids any request), and the ``--out`` folder is swapped in
whole (:func:`icsd_audit.outputs.publish_directory`).
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from dataclasses import dataclass

from icsd_audit.runs.compare import ACROSS, Comparison
from icsd_audit.runs.estimates import STATISTICS
from icsd_audit.stats.bootstrap import BootstrapResult

__all__ = ["Table", "comparison_tables", "comparison_payload", "render_markdown", "render_html", "write_comparison",
           "comparison_owns", "FIGURES", "fmt_ci", "footer", "figure_title"]

@dataclass(frozen=True)
class Table:
    """A titled table of formatted cells (the shape of :class:`icsd_audit.report.render.Table`, whose module
    imports the allocators and torch: ``--json`` and the terminal table need neither)."""

    section: str
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


#: Figure stems of the ``--out`` folder.
FIGURES = ("curves", "mechanism")
_FILES = ("comparison.json", "summary.md", "report.html")
_NAMES = {"mean": "mean", "median": "median", "iqm": "IQM"}


def comparison_owns(rel: str) -> bool:
    """Whether ``rel`` (inside an ``--out`` folder) is a file :func:`write_comparison` writes."""
    name = rel.rsplit("/", 1)[-1]
    if rel in _FILES or (name.startswith(".") and name.endswith(".tmp")):
        return True
    stem, _, ext = rel.removeprefix("figures/").rpartition(".")
    return rel.startswith("figures/") and ext in ("png", "pdf") and stem.split("-")[0] in FIGURES


def _num(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.4g}"


def fmt_ci(b: BootstrapResult) -> str:
    """``estimate [low, high]``, or the estimate alone where no interval exists."""
    if b.n_resamples == 0 or not math.isfinite(b.ci_low):
        return _num(b.estimate)
    return f"{_num(b.estimate)} [{_num(b.ci_low)}, {_num(b.ci_high)}]"


def comparison_tables(c: Comparison) -> list[Table]:
    """Per stratum (and across strata): the groups' statistics, then the between-group comparisons."""
    level = f"{100 * c.confidence_level:g} %"
    out: list[Table] = []
    strata = list(c.strata) + ([ACROSS] if len(c.strata) > 1 else [])
    for st in strata:
        rows = tuple((g.label, str(g.n_runs), *(fmt_ci(g.statistic(s)) for s in STATISTICS))
                     for g in c.groups if g.stratum == st)
        title = f"{c.metric} ({c.score_rule}) in {st}" if st != ACROSS else \
            f"{c.metric} ({c.score_rule}) across strata (unweighted mean of {len(c.strata)} strata)"
        out.append(Table("groups", title, ("group", "runs", *(f"{_NAMES[s]} [{level} CI]" for s in STATISTICS)), rows))
        pr = tuple((f"{p.x} vs {p.y}", fmt_ci(p.difference_of_means), fmt_ci(p.probability_of_improvement),
                    ", ".join(f"{s}: {a - b:+.4g}" for s, a, b in p.paired) or "-")
                   for p in c.pairs if p.stratum == st)
        if pr:
            out.append(Table("pairs", f"Between groups in {st}", (
                "x vs y", f"mean x \u2212 mean y [{level} CI]", f"P(x > y) [{level} CI]", "paired seeds (x \u2212 y)"),
                pr))
    return out


def footer(c: Comparison) -> str:
    """How the numbers were made, in one sentence block (under every table)."""
    return (f"Per run: the {'final logged value' if c.last is None else f'mean of the last {c.last} logged values'} "
            f"of {c.metric}. Intervals: percentile, {c.n_resamples:,} bootstrap resamples of runs within each "
            f"group and stratum, seed {c.seed} (SPEC 10; rliable's estimators).")


def comparison_payload(c: Comparison, curves: Sequence[Any] = ()) -> dict[str, Any]:
    """The ``--json`` object: the comparison, plus the curves when computed."""
    d = c.to_dict()
    if curves:
        d["curves"] = [cv.to_dict() for cv in curves]
    return d


def render_markdown(c: Comparison, figures: Sequence[str] = ()) -> str:
    from icsd_audit.report.render import md_table, md_text

    parts = ["# icsd compare", "", md_text(footer(c)), ""]
    for t in comparison_tables(c):
        parts += [f"**{md_text(t.title)}**", "", md_table(t.headers, t.rows), ""]
    for name in figures:
        parts += [f"![{name}](figures/{name}.png)", ""]
    parts += _left_out_lines(c, md_text)
    return "\n".join(parts).rstrip() + "\n"


def _left_out_lines(c: Comparison, esc: Any) -> list[str]:
    lines = []
    if c.notes:
        lines += ["## Notes", ""] + [f"- {esc(n)}" for n in c.notes] + [""]
    if c.excluded:
        lines += ["## Left out", ""] + [f"- {esc(p)}: {esc(r)}" for p, r in c.excluded] + [""]
    return lines


_CAPTIONS = {
    "curves": "Per training step: mean over each group's runs, band = percentile bootstrap interval of that mean "
              "over runs (none where a group has one run).",
    "mechanism": "Per-step TCM and sign-region shares of the deployed coefficients c, mean over runs with bootstrap "
                 "band.",
}
_TITLES = {"curves": "Learning curve", "mechanism": "Mechanism trajectory"}


def figure_title(name: str, key: str | None = None) -> str:
    """What a reader calls figure ``name`` (a file stem such as ``curves-2``): its kind, and the metric it draws."""
    title = _TITLES.get(name.split("-")[0], "Figure")
    return f"{title} of {key}" if key else title


def render_html(c: Comparison, figures: Mapping[str, bytes], *, keys: Mapping[str, str] | None = None) -> str:
    """One self-contained page: tables, figures inline, notes and what was left out.

    ``keys``: the metric each learning-curve figure draws (figure name -> key), named in its caption."""
    from icsd_audit.report.render import CSP, html_table, page_css

    e = html.escape
    body = ["<h1>icsd compare</h1>", f"<p class=\"headline\">{e(footer(c))}</p>"]
    for t in comparison_tables(c):
        body.append(html_table(t.title, t.headers, t.rows))
    for name, png in figures.items():
        data = base64.b64encode(png).decode("ascii")
        title = figure_title(name, (keys or {}).get(name))
        body.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{e(title)}\">"
                    f"<figcaption><strong>{e(title)}.</strong> {e(_CAPTIONS.get(name.split('-')[0], ''))}"
                    "</figcaption></figure>")
    if c.notes:
        body += ["<h2>Notes</h2>", "<ul>" + "".join(f"<li>{e(n)}</li>" for n in c.notes) + "</ul>"]
    if c.excluded:
        body += ["<h2>Left out</h2>", "<ul>" + "".join(f"<li><code>{e(p)}</code>: {e(r)}</li>" for p, r in c.excluded)
                 + "</ul>"]
    runs = [(g.label, g.stratum, r.path, str(r.seed), _num(r.score)) for g in c.groups if g.stratum != ACROSS
            for r in g.runs]
    body += ["<h2>Runs</h2>", html_table("Per-run scores", ("group", "stratum", "run", "seed", "score"), runs,
                                         numeric=False)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta name=\"referrer\" content=\"no-referrer\"><link rel=\"icon\" href=\"data:,\">"
            f"<title>icsd compare: {e(c.metric)}</title><style>{page_css()}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write_comparison(out: str | Path, c: Comparison, curves: Sequence[Any] = (), *, dpi: int = 200) -> dict[str, Path]:
    """``comparison.json``, ``summary.md``, ``report.html`` and ``figures/{curves,mechanism}*.{png,pdf}``, as one set."""
    from icsd_audit.outputs import publish_directory
    from icsd_audit.report.figures.curves import MECHANISM_PANELS, curves_figure, mechanism_figure
    from icsd_audit.report.figures.style import render
    from icsd_audit.runs.curves import MECHANISM_KEYS

    figs: dict[str, Any] = {}
    keys = list(dict.fromkeys(cv.key for cv in curves))
    plain = [k for k in keys if k not in MECHANISM_PANELS and k not in MECHANISM_KEYS]
    drawn: dict[str, str] = {}  # figure name -> the metric it draws
    for i, key in enumerate(plain):
        name = "curves" if i == 0 else f"curves-{i + 1}"
        drawn[name] = key
        figs[name] = curves_figure(curves, key, labels=c.labels)
    if any(cv.key in MECHANISM_PANELS for cv in curves):
        figs["mechanism"] = mechanism_figure(curves, labels=c.labels)
    files: dict[str, bytes] = {}
    pngs: dict[str, bytes] = {}
    for name, fig in figs.items():
        pngs[name] = render(fig, "png", dpi)
        files[f"figures/{name}.png"] = pngs[name]
        files[f"figures/{name}.pdf"] = render(fig, "pdf")
    files["comparison.json"] = (json.dumps(comparison_payload(c, curves), indent=2, allow_nan=False) + "\n").encode()
    files["summary.md"] = render_markdown(c, list(pngs)).encode()
    files["report.html"] = render_html(c, pngs, keys=drawn).encode()
    return publish_directory(out, files, owned=comparison_owns)

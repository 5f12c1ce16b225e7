"""Tables, Markdown and the self-contained HTML page of the audit report.

Why separate from :mod:`icsd_audit.report.build`: computing and presenting change for
different reasons.  Both outputs are built from one list of :class:`Table` objects,
so the Markdown summary and the HTML page can never disagree.  The HTML page makes
no network request: figures are base64 PNG data URIs, the CSS is inline, fonts are
the reader's system fonts, and a Content-Security-Policy forbids anything else, so
an archived report renders the same offline, forever.
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from icsd_audit.report.figures.style import display_name
from icsd_audit.report.results import AuditReport
from icsd_audit.report.signs_tables import signs_line, signs_tables
from icsd_audit.report.strata_tables import forking_line, strata_tables

__all__ = ["Table", "report_tables", "render_markdown", "render_html", "CSP", "CAPTIONS", "md_table", "md_text",
           "html_table", "page_css", "terminal_lines"]

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"

CAPTIONS: dict[str, str] = {
    "quadrants": "Auxiliary mass share of each sign region of (\u0394, \u00c2) under both allocations; whiskers are "
                 "bootstrap intervals, brackets give the paired point difference (compare \u2212 base) in points.",
    "landscape": "Normalized allocation intensity (mean coefficient in a joint rank bin / environment mean) over "
                 "the mid-ranks of \u0394 (x) and \u00c2 (y); grey contours show token density (multiples of the "
                 "independence density), dotted lines the rank of a zero signal, grey cells hold no tokens.",
    "shift": "Conditional share shift inside S+ = {\u0394 > 0}: per equal-frequency advantage bin, the compare "
             "share of S+ mass minus the base share, in points, with bootstrap whiskers; exact-zero advantages apart.",
    "alignment": "Cosine between the RL gradient and the distillation direction per batch, base \u2192 compare and "
                 "base \u2192 permuted compare multipliers; diamonds are means with batch-bootstrap intervals; the "
                 "bottom panel gives the gain, the permutation gain and the pairing-specific gain.",
    "strata": "Token strata (SPEC 11): per quantile bin of the covariate, left each allocation's share of all mass "
              "(grey ticks: the bin's share of tokens), right the bin's trusted-conflict mass; whiskers are "
              "action-turn bootstrap intervals with the edges fixed.",
    "dynamics": "Trusted-conflict mass (share of trusted mass on negative-advantage tokens) per training step: pale "
                "lines per step, dark lines centred five-step means; below, the paired difference with its "
                "per-step bootstrap band.",
}
_TITLES = {"quadrants": "Sign regions", "landscape": "Allocation landscape", "shift": "Conditional share shift",
           "alignment": "Gradient compatibility", "dynamics": "Training dynamics", "strata": "Token strata",
           "signs": "Mass by sign of \u0394"}


#: the report's sections, in display order
SECTIONS = ("summary", "signs", "quadrants", "landscape", "shift", "strata", "clip", "alignment", "dynamics")


def _title(section: str) -> str:
    return _TITLES.get(section, "Summary" if section == "summary" else "Clipping exposure")


@dataclass(frozen=True)
class Table:
    """A titled table of already formatted cells; ``section`` ties it to a figure."""

    section: str
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


def _pct(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{100.0 * x:.{digits}f}"


def _ci(b: Any, digits: int = 2, scale: float = 100.0) -> str:
    if b is None:
        return "n/a"
    f = (lambda v: "n/a" if v != v else f"{scale * v:.{digits}f}")
    return f"{f(b.estimate)} [{f(b.ci_low)}, {f(b.ci_high)}]"


def _signed(b: Any, digits: int = 2, scale: float = 100.0) -> str:
    if b is None:
        return "n/a"
    if b.estimate == 0 and b.ci_low == 0 and b.ci_high == 0 and b.standard_error == 0:
        return "0 (exact)"
    f = (lambda v: "n/a" if v != v else f"{scale * v:+.{digits}f}")
    return f"{f(b.estimate)} [{f(b.ci_low)}, {f(b.ci_high)}]"


def report_tables(report: AuditReport) -> list[Table]:
    """Every table of the report, in display order."""
    s, o = report.stats, report.options
    bn, cn = display_name(o.base), display_name(o.compare)
    level = f"{100 * o.confidence_level:g} %"
    out: list[Table] = []
    if s.tcm is not None:
        t = s.tcm
        out.append(Table("summary", "Trusted-conflict mass (%)", ("weighting", f"estimate [{level} CI]", "SE"), (
            (bn, _ci(t.base), _pct(t.base.standard_error)),
            (cn, _ci(t.compare), _pct(t.compare.standard_error)),
            (f"{cn} \u2212 {bn} (pp)", _signed(t.diff), _pct(t.diff.standard_error)),
        ), f"{t.n_active_tokens:,} active teacher-supported tokens of {t.n_tokens:,}; eps = {t.eps:g}."
           + _na_note(t)))
    if s.quadrants is not None:
        q = s.quadrants
        rows = tuple((r, f"{q.region_tokens[r]:,}", _ci(p.base), _ci(p.compare), _signed(p.diff))
                     for r, p in q.regions.items())
        out.append(Table("quadrants", "Mass share by sign region (%)",
                         ("region", "tokens", bn, cn, f"{cn} \u2212 {bn} (pp)"), rows, _na_note(q).strip()))
    if s.shift is not None:
        sh = s.shift
        rows = tuple((k, f"{b.n_tokens:,}", _range(b.advantage_min, b.advantage_max), _ci(b.base), _ci(b.compare),
                      _signed(b.diff)) for k, b in sh.bins.items())
        out.append(Table("shift", "Share of S+ mass by advantage bin (%)",
                         ("bin", "tokens", "advantage range", bn, cn, "shift (pp)"), rows,
                         f"{sh.n_splus_tokens:,} tokens with \u0394 > 0." + _na_note(sh)))
    land = report.landscape
    grids = list(land.envs.values())
    same = all(abs(g.mean[land.base_name] - g.mean[land.compare_name]) <= 1e-9 * max(abs(g.mean[land.base_name]), 1e-300)
               for g in grids)
    if same:  # one column, and why: a mass-preserving compare has the base's mean by construction
        out.append(Table("landscape", "Landscape grids", ("environment", "tokens", "grid", "mean coefficient"),
                         tuple(("all" if g.env is None else str(g.env), f"{g.n_tokens:,}", f"{g.grid} \u00d7 {g.grid}",
                                f"{g.mean[land.base_name]:.4g}") for g in grids),
                         f"{bn} and {cn} have the same mean coefficient here: {cn} moves weight between the tokens "
                         "of each action turn and keeps the turn's total, so the means agree by construction; "
                         "each grid's intensity is relative to its own weighting's mean."))
    else:
        out.append(Table("landscape", "Landscape grids", ("environment", "tokens", "grid", f"mean {bn}", f"mean {cn}"),
                         tuple(("all" if g.env is None else str(g.env), f"{g.n_tokens:,}", f"{g.grid} \u00d7 {g.grid}",
                                f"{g.mean[land.base_name]:.4g}", f"{g.mean[land.compare_name]:.4g}") for g in grids)))
    reg_rows = tuple(("all" if g.env is None else str(g.env), name, f"{r.n_tokens:,}", _ci(r.base, scale=1.0),
                      _ci(r.compare, scale=1.0), _ci(r.ratio, scale=1.0))
                     for g in land.envs.values() for name, r in (getattr(g, "regions", None) or {}).items())
    if reg_rows:
        sm = getattr(land, "smoothing", None) or {}
        out.append(Table("landscape", "Region multipliers (mean coefficient in the region / environment mean)",
                         ("environment", "region", "tokens", bn, cn, f"{cn} / {bn}"), reg_rows,
                         "trusted_supported: top fifth of both delta and advantage ranks, delta > 0, A > 0; "
                         "trusted_opposed: top fifth of delta ranks, delta > 0, A < 0. 95 % action-turn bootstrap "
                         "intervals. Colours: Gaussian-kernel smoothed intensity"
                         + (f", bandwidth {sm.get('bandwidth'):g} in rank units." if sm else ".")
                         + (" n/a: the region holds no token." if any(r[2] == "0" for r in reg_rows) else "")))
    if s.clip is not None:
        c = s.clip
        rows = tuple((label, f"{cs.n_tokens:,}", _ci(cs.tokens), _ci(cs.mass.base), _ci(cs.mass.compare),
                      _ci(cs.abs_delta_mass.base), _ci(cs.abs_delta_mass.compare))
                     for label, cs in ((f"ratio outside [{1 - c.clip_eps:g}, {1 + c.clip_eps:g}]", c.outside),
                                       ("clipped surrogate flat", c.flat)))
        out.append(Table("clip", "Clipping exposure (%)",
                         ("set", "tokens", "token share", f"{bn} mass", f"{cn} mass", f"{bn} |\u0394| mass",
                          f"{cn} |\u0394| mass"), rows,
                         f"Dual-clip cap ({c.dual_clip:g}) binds on {c.dual_clip_cap_count:,} tokens; "
                         f"ratio mean {c.ratio_mean:.4f}, sd {c.ratio_std:.4f}."))
    out += [Table(*t) for t in strata_tables(report)]
    out += [Table(*t) for t in signs_tables(report)]
    g = report.gradcos
    if g is not None:
        rows = [(f"mean cos, {bn}", _ci(g.mean_base, 3, 1.0)), (f"mean cos, {cn}", _ci(g.mean_compare, 3, 1.0)),
                ("gain", _signed(g.gain, 3, 1.0))]
        if g.cos_perm is not None:
            rows += [(f"mean cos, permuted {cn} ({g.n_permutations} shuffles)", _ci(g.mean_perm, 3, 1.0)),
                     ("permutation gain", _signed(g.perm_gain, 3, 1.0)),
                     ("pairing-specific gain", _signed(g.pairing_gain, 3, 1.0))]
        out.append(Table("alignment", "Gradient compatibility (batch bootstrap)", ("quantity", f"estimate [{level} CI]"),
                         tuple(rows), f"{len(g.batch_ids)} batches; gain positive in "
                         f"{sum(b < c for b, c in zip(g.cos_base, g.cos_compare))}." + _skipped_note(g)))
    if report.dynamics is not None:
        rows = tuple((str(k), _ci(r.base), _ci(r.compare), _signed(r.diff)) for k, r in report.dynamics.items())
        out.append(Table("dynamics", "Trusted-conflict mass per step (%)", ("step", bn, cn, f"{cn} \u2212 {bn} (pp)"), rows,
                         _steps_na_note(report.dynamics)))
    return out


def _na_note(result: Any) -> str:
    """`` n/a: reason.`` for a statistic that has no value on these tokens ('' when it has one)."""
    why = getattr(result, "undefined", None)
    return f" n/a: {why}." if why else ""


def _steps_na_note(per_step: Any) -> str:
    """Which steps have no TCM and why, one sentence per reason ('' when every step has one)."""
    reasons: dict[str, list[str]] = {}
    for k, r in per_step.items():
        why = getattr(r, "undefined", None)
        if why:
            reasons.setdefault(why, []).append(str(k))
    return " ".join(f"n/a at step{'s' if len(ks) > 1 else ''} {', '.join(ks)}: {why}." for why, ks in reasons.items())


def _skipped_note(g: Any) -> str:
    """Batches left out of the gradient means, and why ('' when none)."""
    if not g.skipped:
        return ""
    shown = "; ".join(f"batch {b}: {r}" for b, r in g.skipped[:5])
    more = f"; {len(g.skipped) - 5} more" if len(g.skipped) > 5 else ""
    return f" Skipped {len(g.skipped)} batch{'es' if len(g.skipped) > 1 else ''} with an undefined cosine ({shown}{more})."


def _range(lo: float, hi: float) -> str:
    """``[lo, hi]`` always, also for a bin whose advantages are all equal."""
    if lo != lo or hi != hi:
        return "empty"
    return f"[{lo:.3g}, {hi:.3g}]"


def _provenance_rows(report: AuditReport) -> list[tuple[str, str]]:
    p, o = report.provenance, report.options
    files = p.get("files", [])
    shown = ", ".join(files[:4]) + (f", \u2026 ({len(files)} files)" if len(files) > 4 else "")
    boot = f"{o.n_resamples:,} resamples, {100 * o.confidence_level:g} % percentile, action turns within batches"
    return [
        ("synthetic data", {True: "yes", False: "no"}.get(p.get("synthetic"), str(p.get("synthetic")))),
        ("input", shown),
        ("tokens / batches / rows", f"{p.get('n_tokens', 0):,} / {p.get('n_batches', 0):,} / {p.get('n_rows', 0):,}"),
        ("producer", "; ".join(json.dumps(x, sort_keys=True) for x in p.get("producers", []))),
        ("dump schema", "; ".join(f"{x.get('schema')} v{x.get('version')}" for x in p.get("schemas", []))),
        ("allocator recorded in dumps", "; ".join(json.dumps(x, sort_keys=True) for x in p.get("dump_allocators", [])) or "{}"),
        ("audit: base", json.dumps(p.get("audit", {}).get("base", {}), sort_keys=True)),
        ("audit: compare", json.dumps(p.get("audit", {}).get("compare", {}), sort_keys=True)),
        ("bootstrap", f"{boot}; seed {o.seed}"),
        ("icsd", f"{p.get('icsd_version')} (generated {p.get('generated_at')})"),
    ]


def _synthetic_words(report: AuditReport) -> str:
    flag = report.provenance.get("synthetic")
    if flag is True:
        return "the dump metadata marks every file synthetic"
    if flag == "mixed":
        return "the dump metadata marks some files synthetic"
    return "the dump metadata does not say whether the data are synthetic"


def _headline(report: AuditReport) -> str:
    t, o = report.stats.tcm, report.options
    if t is None:
        return ""
    if "summary" in report.omitted:  # the recorded trainer lacks an input the statistic needs
        return f"Trusted-conflict mass is n/a: {report.omitted['summary']}."
    if t.undefined:
        return f"Trusted-conflict mass is n/a: {t.undefined}."
    return (f"Trusted-conflict mass: {display_name(o.base)} {_pct(t.base.estimate, 1)} %, "
            f"{display_name(o.compare)} {_pct(t.compare.estimate, 1)} %; difference "
            f"{_signed(t.diff, 1)} points ({100 * o.confidence_level:g} % action-turn bootstrap CI).")


#: Markdown-active characters escaped with a backslash wherever they stand (see :func:`md_text`).
_MD_ACTIVE = re.compile(r"([\\`*$~|#!{}])")
#: ``_`` that could open or close emphasis (not between two word characters), ``]`` that could close a link.
_MD_EDGE = re.compile(r"(?<!\w)_|_(?!\w)|\](?=[(\[:])")


def md_text(text: object) -> str:
    """``text`` as inert Markdown: what the HTML page does with ``html.escape``, for ``summary.md``.

    ``&`` and ``<`` become entities (no raw HTML, no autolink), and so does a ``>`` that
    starts the text (a quote); elsewhere ``>`` is inert once no ``<`` can open a tag. The
    characters that start code, emphasis, maths, strikethrough or a table cell get a
    backslash, and so do an ``_`` at a word's edge and a ``]`` that could close a link or
    image (``](``, ``][``, ``]:``), so every run label, path, environment or metric name
    reads as written. Formatted numbers and prose stay as they are: ``0.8 [0.3, 1.3]``,
    ``pos_delta_neg_adv``, ``delta > 0``.
    """
    s = re.sub(r"^(\s*)>", r"\1&gt;", str(text).replace("&", "&amp;").replace("<", "&lt;"))
    return _MD_EDGE.sub(lambda m: "\\" + m.group(0), _MD_ACTIVE.sub(r"\\\1", s))


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(map(md_text, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(md_text, r)) + " |" for r in rows]
    return "\n".join(lines)


def render_markdown(report: AuditReport, figures: Sequence[str]) -> str:
    """``summary.md``: headline, provenance, then per section its figure (figures/NAME.png) and tables."""
    tables = report_tables(report)
    parts = ["# icsd audit report", ""]
    if report.provenance.get("synthetic") not in (False,):
        parts += [f"> **Synthetic or unlabelled data** ({_synthetic_words(report)}): "
                  "these numbers describe the generator, not a training run.", ""]
    parts += [md_text(_headline(report)), "", "## Provenance", "", _md_table(("field", "value"), _provenance_rows(report)), ""]
    for section in SECTIONS:
        sec_tables = [t for t in tables if t.section == section]
        if section in report.omitted:
            parts += [f"## {_title(section)}", "", f"*Not shown: {md_text(report.omitted[section])}.*", ""]
            continue
        if not sec_tables and section not in figures:
            continue
        parts += [f"## {_title(section)}", ""]
        if section in figures:
            parts += [f"![{section}](figures/{section}.png)", "", f"*{CAPTIONS[section]}*", ""]
        for t in sec_tables:
            parts += [f"**{md_text(t.title)}**", "", _md_table(t.headers, t.rows), ""]
            if t.note:
                parts += [md_text(t.note), ""]
    return "\n".join(parts).rstrip() + "\n"


_CSS = """
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       margin: 2rem auto; max-width: 60rem; padding: 0 1rem; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.2rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
.headline { font-size: 1.05rem; }
.warn { background: #fff4d6; border-left: 4px solid #E69F00; padding: .5rem .8rem; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; display: block; }
figcaption { font-size: .88rem; color: #444; margin-top: .3rem; overflow-wrap: anywhere; }
.table-wrap { max-width: 100%; overflow-x: auto; margin: .5rem 0 1rem; }
table { border-collapse: collapse; font-size: .86rem; }
th, td { border-bottom: 1px solid #e3e3e3; padding: .25rem .6rem; text-align: left; vertical-align: top; }
th { background: #f5f5f5; white-space: nowrap; } td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { overflow-wrap: anywhere; }
caption { text-align: left; font-weight: 600; padding-bottom: .2rem; }
.note { font-size: .85rem; color: #555; }
code { font-size: .85rem; word-break: break-all; }
"""


def _html_table(t_title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], note: str = "",
                numeric: bool = True) -> str:
    e = html.escape
    cls = "num" if numeric else "text"
    head = "".join(f"<th scope=\"col\">{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td class=\"{cls}\">{e(str(c))}</td>" if i else f"<td>{e(str(c))}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    # a narrow window scrolls the table inside its box instead of widening the whole page
    out = (f"<div class=\"table-wrap\"><table><caption>{e(t_title)}</caption><thead><tr>{head}</tr></thead>"
           f"<tbody>{body}</tbody></table></div>")
    return out + (f"<p class=\"note\">{e(note)}</p>" if note else "")


#: Shared with the other self-contained pages (``icsd compare``), so every page of the toolkit looks alike.
md_table = _md_table
html_table = _html_table


def page_css() -> str:
    """The inline stylesheet of the toolkit's HTML pages."""
    return _CSS


def render_html(report: AuditReport, figures: Mapping[str, bytes]) -> str:
    """``report.html``: one file, figures inline as base64 PNG, no external resource of any kind."""
    e = html.escape
    tables = report_tables(report)
    body = ["<h1>icsd audit report</h1>", f"<p class=\"headline\">{e(_headline(report))}</p>"]
    if report.provenance.get("synthetic") is not False:
        body.append(f"<p class=\"warn\"><strong>Synthetic or unlabelled data</strong> "
                    f"({e(_synthetic_words(report))}): these numbers describe the generator, not a training run.</p>")
    body += ["<h2>Provenance</h2>", _html_table("Data and settings", ("field", "value"), _provenance_rows(report),
                                                            numeric=False)]
    for section in SECTIONS:
        sec_tables = [t for t in tables if t.section == section]
        if section in report.omitted:
            body += [f"<h2 id=\"{section}\">{e(_title(section))}</h2>",
                     f"<p class=\"note\">Not shown: {e(report.omitted[section])}.</p>"]
            continue
        if not sec_tables and section not in figures:
            continue
        title = _title(section)
        body.append(f"<h2 id=\"{section}\">{e(title)}</h2>")
        if section in figures:
            data = base64.b64encode(figures[section]).decode("ascii")
            body.append(f"<figure><img src=\"data:image/png;base64,{data}\" alt=\"{e(title)} figure\">"
                        f"<figcaption><strong>{e(title)}.</strong> {e(CAPTIONS[section])}</figcaption></figure>")
        body += [_html_table(t.title, t.headers, t.rows, t.note) for t in sec_tables]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta name=\"referrer\" content=\"no-referrer\"><link rel=\"icon\" href=\"data:,\">"
            f"<title>icsd audit report</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def terminal_lines(report: AuditReport, out: Any) -> list[str]:
    """What ``icsd audit report`` prints when done: where to look, and the headline mechanism numbers."""
    s, o, p = report.stats, report.options, report.provenance
    bn, cn = display_name(o.base), display_name(o.compare)
    level = f"{100 * o.confidence_level:g} % CI"
    lines = [f"report: {out}/report.html (self-contained: open it in a browser); summary.md and summary.json beside it",
             f"  data: {p.get('n_tokens', 0):,} tokens in {p.get('n_batches', 0):,} batches"]
    t = s.tcm
    if t is not None:
        if t.undefined:
            lines.append(f"  trusted-conflict mass: n/a ({t.undefined})")
        else:
            lines.append(f"  trusted-conflict mass: {bn} {_pct(t.base.estimate, 1)} % -> {cn} {_pct(t.compare.estimate, 1)} %, "
                         f"difference {_signed(t.diff, 1)} pp ({level}; lower is less trusted mass on A < 0 tokens)")
    g = report.gradcos
    if g is not None:
        lines.append(f"  cosine with the RL gradient: {bn} {_ci(g.mean_base, 3, 1.0)} -> {cn} {_ci(g.mean_compare, 3, 1.0)}, "
                     f"gain {_signed(g.gain, 3, 1.0)} over {len(g.batch_ids)} batches ({level})")
    if len(report.strata) > 1:
        lines.append("  " + forking_line(report.strata[1]))
    if report.signs is not None and "signs" not in report.omitted:
        lines.append("  " + signs_line(report.signs))
    if report.omitted:
        lines.append(f"  not shown (why: summary.md): {', '.join(report.omitted)}")
    return lines

"""The report's token-strata tables and its forking-token line (SPEC 11), from the result objects.

Kept beside :mod:`icsd_audit.report.render`, which lays these tables out with the others;
percent and percentage points as every other table of the report.
"""

from __future__ import annotations

from typing import Any

from icsd_audit.report.figures.strata import covariate_label
from icsd_audit.report.figures.style import display_name

__all__ = ["strata_tables", "forking_line"]


def _fmt(r: Any, *, scale: float = 100.0, digits: int = 2, signed: bool = False) -> str:
    def f(v: float) -> str:
        if v != v:
            return "n/a"
        return f"{scale * v:+.{digits}f}" if signed else f"{scale * v:.{digits}f}"

    return f"{f(r.estimate)} [{f(r.ci_low)}, {f(r.ci_high)}]"


def _top_words(res: Any) -> str:
    """What the top share is: the forking tokens by entropy; by another covariate, just the top share."""
    what = f"top {100 * res.spec.top:g} % by {covariate_label(res.covariate)}"
    if res.covariate == "entropy":
        return f"forking tokens ({what})"
    return what + (" (the most confident tokens; the forking tokens need the dumps' entropy column)"
                   if res.covariate == "logp" else "")


def forking_line(res: Any) -> str:
    """One sentence: the top share of tokens by the covariate, and each allocation's mass and TCM there."""
    top = res.bins[-1]
    bn, cn = display_name(res.base_name), display_name(res.compare_name)
    level = f"{100 * res.confidence_level:g} % CI"
    tcm = (f"trusted-conflict mass there {bn} {_fmt(top.tcm.base, digits=1)} %, "
           f"{cn} {_fmt(top.tcm.compare, digits=1)} %"
           if top.tcm_undefined is None else f"trusted-conflict mass there n/a ({top.tcm_undefined})")
    return (f"{_top_words(res)} ({top.n_tokens:,} tokens = {_fmt(top.token_share, digits=1)} %): "
            f"share of the mass {bn} "
            f"{_fmt(top.share.base, digits=1)} %, {cn} {_fmt(top.share.compare, digits=1)} %, difference "
            f"{_fmt(top.share.diff, digits=1, signed=True)} pp; {tcm} ({level}).")


def strata_tables(report: Any) -> list[tuple[Any, ...]]:
    """The forking-token table (summary section) and the per-bin table (strata section); none when omitted.

    Each as ``(section, title, headers, rows, note)``, the fields of :class:`icsd_audit.report.render.Table`.
    """
    if not report.strata:
        return []
    o = report.options
    bn, cn = display_name(o.base), display_name(o.compare)
    out: list[tuple[Any, ...]] = []
    if len(report.strata) > 1:
        f = report.strata[1]
        top = f.bins[-1]
        out.append((
            "summary", f"{_top_words(f)[0].upper()}{_top_words(f)[1:]} (%)",
            ("weighting", "share of the mass", "intensity", "trusted-conflict mass"), (
                (bn, _fmt(top.share.base), _fmt(top.intensity_base, scale=1.0, digits=3), _fmt(top.tcm.base)),
                (cn, _fmt(top.share.compare), _fmt(top.intensity_compare, scale=1.0, digits=3), _fmt(top.tcm.compare)),
                (f"{cn} \u2212 {bn} (pp)", _fmt(top.share.diff, signed=True), "", _fmt(top.tcm.diff, signed=True)),
            ),
            f"{top.n_tokens:,} of {f.n_tokens:,} tokens at or above the edge {f.edges[0]:.4g} "
            f"(`icsd audit strata --by {f.covariate} --top {f.spec.top:g}`)."
            + (f" Trusted-conflict mass n/a: {top.tcm_undefined}." if top.tcm_undefined else "")))
    r = report.strata[0]
    rows = tuple((f"{b.index}", f"{b.lo:.4g} .. {b.hi:.4g}", f"{b.n_tokens:,}", _fmt(b.token_share), _fmt(b.share.base),
                  _fmt(b.share.compare), _fmt(b.share.diff, signed=True), _fmt(b.tcm.base), _fmt(b.tcm.compare),
                  _fmt(b.tcm.diff, signed=True)) for b in r.bins)
    na = [f"bin {b.index}: {b.tcm_undefined}" for b in r.bins if b.tcm_undefined]
    out.append((
        "strata", f"Token strata by {covariate_label(r.covariate)}, {len(r.bins)} quantile bins (%)",
        ("bin", "range", "tokens", "token share", f"{bn} share", f"{cn} share", "share diff (pp)", f"{bn} TCM",
         f"{cn} TCM", "TCM diff (pp)"), rows,
        f"Bin b holds lo <= x < hi (the last: x <= hi); `icsd audit strata --by {r.covariate} --bins {r.spec.k}`."
        + (f" TCM n/a: {'; '.join(na)}." if na else "")))
    return out

"""The report's sign-of-delta table and terminal line, from :class:`~icsd_audit.stats.signs.SignSharesResult`.

Kept beside :mod:`icsd_audit.report.render`, which lays the table out with the others; percent
and percentage points as every other table of the report.
"""

from __future__ import annotations

from typing import Any

from icsd_audit.report.figures.style import display_name

__all__ = ["SIGN_LABELS", "signs_tables", "signs_line"]

SIGN_LABELS = {"positive": "\u0394 > 0", "negative": "\u0394 < 0", "zero": "\u0394 = 0"}


def _fmt(r: Any, *, signed: bool = False, digits: int = 2) -> str:
    def f(v: float) -> str:
        if v != v:
            return "n/a"
        return f"{100 * v:+.{digits}f}" if signed else f"{100 * v:.{digits}f}"

    if signed and r.estimate == 0 and r.ci_low == 0 and r.ci_high == 0 and r.standard_error == 0:
        return "0 (exact)"
    return f"{f(r.estimate)} [{f(r.ci_low)}, {f(r.ci_high)}]"


def _trust(res: Any, name: str) -> str:
    s = (res.settings or {}).get(name)
    return "" if s is None or name == "opsd" else f" ({s['trust']} trust)"


def signs_tables(report: Any) -> list[tuple[Any, ...]]:
    """The table of the ``signs`` section (``(section, title, headers, rows, note)``); none when omitted."""
    res = report.signs
    if res is None:
        return []
    signs = [s for s in SIGN_LABELS if res.token_share.get(s) is not None]
    counts = {"positive": res.n_positive, "negative": res.n_negative, "zero": res.n_zero}
    ref = display_name(res.reference)
    rows = [("tokens (count)", *(f"{counts[s]:,}" for s in signs)),
            ("tokens (share)", *(_fmt(res.token_share.get(s)) for s in signs))]
    rows += [(f"{display_name(n)}{_trust(res, n)}", *(_fmt(sp.get(s)) for s in signs))
             for n, sp in zip(res.weightings, res.shares)]
    rows += [(f"{display_name(n)} \u2212 {ref} (pp)", *(_fmt(d.get(s), signed=True) for s in signs))
             for n, d in zip(res.weightings[1:], res.diffs)]
    note = (f"Share of each weighting's mass on the {res.n_tokens:,} valid tokens by the sign of "
            "\u0394 = teacher log-prob \u2212 student log-prob (needs no advantage); "
            f"`icsd audit signs` gives the same intervals.")
    if res.notes:
        note += " " + " ".join(f"{n[0].upper()}{n[1:]}." for n in res.notes)
    if res.undefined:
        note += f" n/a: {res.undefined}."
    return [("signs", "Mass by sign of \u0394 (%)", ("weighting", *(SIGN_LABELS[s] for s in signs)), tuple(rows),
             note)]


def signs_line(res: Any) -> str:
    """One terminal line: each weighting's share of the mass on tokens the teacher rates above the student."""
    shares = ", ".join(f"{display_name(n)} {_fmt(sp.positive, digits=1)} %" for n, sp in zip(res.weightings,
                                                                                         res.shares))
    diffs = "; ".join(f"{display_name(n)} \u2212 {display_name(res.reference)} {_fmt(d.positive, signed=True, digits=1)}"
                      " pp" for n, d in zip(res.weightings[1:], res.diffs))
    return (f"mass on \u0394 > 0 ({_fmt(res.token_share.positive, digits=1)} % of the tokens): {shares}"
            + (f"; {diffs}" if diffs else "") + f" ({100 * res.confidence_level:g} % CI)")

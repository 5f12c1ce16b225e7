"""``icsd audit signs``: each weighting's share of the distillation mass on tokens with delta > 0, < 0 and = 0.

A few lines over :func:`icsd_audit.audit.signs.run_signs`.  It needs no advantage, so it is the
conflict statistic a recording of a trainer without one (TRL's SDFT) supports.  The table goes
to the terminal; ``--json`` prints exactly one JSON object on stdout and nothing else there.
"""

from __future__ import annotations

import json
import sys
from typing import Any, List, Optional


from . import options as O
from .apps import audit_app
from .common import audit_settings, handle_errors, set_threads, stderr_console, thread_count

#: --compare names the allocator of the deployed side: giving it replaces the recorded one
COMPARE_FLAG = {"allocator": "--compare"}
_LABELS = {"positive": "\u0394 > 0", "negative": "\u0394 < 0", "zero": "\u0394 = 0"}


def _ci(r: Any, signed: bool = False) -> str:
    def f(v: float) -> str:
        return "n/a" if v != v else (f"{100 * v:+.2f}" if signed else f"{100 * v:.2f}")

    return f"{f(r.estimate)} [{f(r.ci_low)}, {f(r.ci_high)}]"


def _table(res: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    signs = [s for s in _LABELS if res.token_share.get(s) is not None]
    level = f"{100 * res.confidence_level:g} %"
    table = Table(title=f"icsd audit signs ({res.n_tokens:,} tokens, {res.n_turns:,} turns, {res.n_batches:,} "
                        "batches)",
                  caption=(f"Share of each weighting's mass (and of the tokens) by the sign of delta, in percent; "
                           f"differences against {res.reference} in percentage points; {level} percentile "
                           f"action-turn bootstrap CI over {res.n_resamples:,} resamples. --json gives fractions."),
                  caption_justify="left")
    table.add_column("weighting", justify="left")
    for s in signs:
        table.add_column(_LABELS[s], justify="right")
    counts = {"positive": res.n_positive, "negative": res.n_negative, "zero": res.n_zero}
    table.add_row("tokens (count)", *(f"{counts[s]:,}" for s in signs))
    table.add_row("tokens (share)", *(_ci(res.token_share.get(s)) for s in signs))
    for name, split in zip(res.weightings, res.shares):
        table.add_row(f"{name} mass", *(_ci(split.get(s)) for s in signs))
    for name, d in zip(res.weightings[1:], res.diffs):
        table.add_row(f"{name} \u2212 {res.reference} (pp)", *(_ci(d.get(s), signed=True) for s in signs))
    con = Console()
    con.print(table)
    if res.undefined:
        con.print(f"n/a: {res.undefined}.", highlight=False, soft_wrap=True)


@audit_app.command("signs")
@handle_errors
@O.allocator_options()
def signs(
    paths: List[str] = O.PATHS,
    base: Optional[str] = O.BASE,
    compare: Optional[str] = O.COMPARE,
    resamples: int = O.RESAMPLES,
    confidence: float = O.CONFIDENCE,
    seed: Optional[int] = O.SEED,
    as_json: bool = O.JSON,
    *, settings: dict[str, Any],
) -> None:
    """Share of each weighting's distillation mass on tokens with delta > 0, delta < 0 and delta = 0,
    compared with the deployed weighting, with action-turn bootstrap CIs. Needs no advantage: on a
    recording without one (TRL's SDFT) ICSD's side is SDAR, under SPEC 3's laplace trust where the
    dumps record a uniform one.

    Example: icsd audit signs runs/sdft-recorded/dumps --json
    """
    set_threads()
    s = audit_settings(paths, flags=COMPARE_FLAG, allocator=compare, **settings, seed=seed)
    b, c = s.pair(base, compare)
    from icsd_audit.audit.signs import run_signs

    fixed = tuple(side for side, v in (("base", base), ("compare", compare)) if v is not None)
    kw = dict(keep_trust=settings.get("trust") is not None, fixed=fixed, n_resamples=resamples,
              confidence_level=confidence, seed=0 if seed is None else seed, workers=thread_count())
    if not as_json and sys.stderr.isatty():
        with stderr_console().status("reading and allocating batches") as status:
            res = run_signs(paths, b, c, progress=lambda i, n: status.update(f"batch {i}/{n}"), **kw)
    else:
        res = run_signs(paths, b, c, **kw)
    for line in res.notes:
        print(f"note: {line}", file=sys.stderr)
    if as_json:
        sys.stdout.write(json.dumps(res.to_dict(), allow_nan=False) + "\n")
    else:
        _table(res)

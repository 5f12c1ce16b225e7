"""``icsd audit strata``: where each allocation's mass and conflict mass lands by a per-token covariate (SPEC 11).

A few lines over :func:`icsd_audit.audit.strata.run_strata`.  The table goes to the
terminal; ``--json`` prints exactly one JSON object (SPEC 11's shape) on stdout and nothing
else there.
"""

from __future__ import annotations

import json
import sys
from typing import Any, List, Optional

import typer

from . import options as O
from .apps import audit_app
from .common import audit_settings, check_backend, handle_errors, set_threads, stderr_console, thread_count

_COVARIATES = ("entropy", "logp", "pos", "abs_delta")
#: --compare names the allocator of the deployed side: giving it replaces the recorded one
COMPARE_FLAG = {"allocator": "--compare"}


def _ci(r: Any, scale: float = 100.0, signed: bool = False, digits: int = 2) -> str:
    def f(v: float) -> str:
        return "n/a" if v != v else (f"{scale * v:+.{digits}f}" if signed else f"{scale * v:.{digits}f}")

    return f"{f(r.estimate)} [{f(r.ci_low)}, {f(r.ci_high)}]"


def strata_lines(res: Any) -> list[str]:
    """The ``n/a`` lines of the bins whose TCM has no value, and why."""
    return [f"n/a: TCM of bin {b.index} ({b.lo:.4g} .. {b.hi:.4g}): {b.tcm_undefined}." for b in res.bins
            if b.tcm_undefined]


def _table(res: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    bn, cn = res.base_name, res.compare_name
    level = f"{100 * res.confidence_level:g} %"
    what = f"top {100 * res.spec.top:g} % vs the rest" if res.spec.top is not None else f"{res.spec.k} quantile bins"
    table = Table(title=f"icsd audit strata --by {res.covariate} ({what}; {res.n_tokens:,} tokens, {res.n_turns:,} "
                        f"turns, {res.n_batches:,} batches)",
                  caption=(f"Bin b holds lo <= x < hi (the last: x <= hi). Shares and TCM in percent, diff = {cn} "
                           f"\u2212 {bn} in percentage points, intensity = mass share / token share; {level} "
                           f"percentile action-turn bootstrap CI over {res.n_resamples:,} resamples, edges fixed. "
                           "--json gives fractions."),
                  caption_justify="left")
    for col in ("bin", "x range", "tokens", "token share", f"{bn} share", f"{cn} share", "share diff (pp)",
                f"{bn} intensity", f"{cn} intensity", f"{bn} TCM", f"{cn} TCM", "TCM diff (pp)"):
        table.add_column(col, justify="left" if col in ("bin", "x range") else "right")
    for b in res.bins:
        table.add_row(str(b.index), f"{b.lo:.4g} .. {b.hi:.4g}", f"{b.n_tokens:,}", _ci(b.token_share),
                      _ci(b.share.base), _ci(b.share.compare), _ci(b.share.diff, signed=True),
                      _ci(b.intensity_base, 1.0, digits=3), _ci(b.intensity_compare, 1.0, digits=3),
                      _ci(b.tcm.base), _ci(b.tcm.compare), _ci(b.tcm.diff, signed=True))
    con = Console()
    con.print(table)
    for line in strata_lines(res):
        con.print(line, highlight=False, soft_wrap=True)


@audit_app.command("strata")
@handle_errors
@O.allocator_options()
def strata(
    paths: List[str] = O.PATHS,
    by: str = typer.Option(..., "--by", help="Covariate: entropy (the dumps' next-token entropy column), logp, pos "
                                             "(position in the turn's response) or abs_delta (|delta|)."),
    bins: Optional[int] = typer.Option(None, "--bins", show_default=False, callback=O.AT_LEAST_1,
                                       help="Quantile bins K (default 10; duplicate edges merge bins)."),
    top: Optional[float] = typer.Option(None, "--top", show_default=False, callback=O.OPEN_UNIT,
                                        help="Instead of --bins: split the tokens at or above the (1 - q) quantile "
                                             "from the rest (0.2: the 'forking tokens' of the entropy literature)."),
    base: Optional[str] = O.BASE,
    compare: Optional[str] = O.COMPARE,
    resamples: int = O.RESAMPLES,
    confidence: float = O.CONFIDENCE,
    seed: Optional[int] = O.SEED,
    as_json: bool = O.JSON,
    backend: str = O.BACKEND,
    ray_address: Optional[str] = O.RAY_ADDRESS,
    *, settings: dict[str, Any],
) -> None:
    """Token strata: per bin of a per-token covariate, each allocation's token share, mass share, intensity
    and trusted-conflict mass, compare minus base, with action-turn bootstrap CIs.

    Example: icsd audit strata runs/dumps --by entropy --top 0.2 --json
    """
    from icsd_audit.audit.run import AuditRequest
    from icsd_audit.stats.results import StrataSpec

    if by not in _COVARIATES:
        raise ValueError(f"--by must be one of {', '.join(_COVARIATES)}, got {by!r}")
    StrataSpec(by, bins, top)  # --bins with --top: one line before any file is read
    check_backend(backend, ray_address)
    set_threads()
    s = audit_settings(paths, flags=COMPARE_FLAG, allocator=compare, **settings, seed=seed)
    b, c = s.pair(base, compare)
    req = AuditRequest(base=b, compare=c, n_resamples=resamples, confidence_level=confidence,
                       seed=0 if seed is None else seed, eps=c.eps, workers=thread_count())
    if backend == "ray":
        from functools import partial

        from icsd_audit.audit.strata_ray import run_strata_ray

        run_strata = partial(run_strata_ray, ray_address=ray_address)
    else:
        from icsd_audit.audit.strata import run_strata

    if not as_json and sys.stderr.isatty():
        with stderr_console().status("reading and allocating batches") as status:
            res = run_strata(paths, req, by=by, bins=bins, top=top,
                             progress=lambda i, n: status.update(f"batch {i}/{n}"))
    else:
        res = run_strata(paths, req, by=by, bins=bins, top=top)
    if as_json:
        sys.stdout.write(json.dumps(res.to_dict(), allow_nan=False) + "\n")
    else:
        _table(res)

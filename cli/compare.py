"""``icsd compare``: runs across seeds and allocators (SPEC 10), the paper's tables from runs.

A few lines over :mod:`icsd_audit.runs`.  Tables go to stdout (``--json``: one JSON
object and nothing else there); what was left out, notes and file names go to stderr,
one line each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from . import options as O
from .apps import app
from .common import fail, handle_errors, stderr_console


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _say_left_out(items: Any, notes: Any = ()) -> None:
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    for path, reason in items:
        print(f"left out: {path}: {reason}", file=sys.stderr)


def _print_tables(tables: Any, footer: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for t in tables:
        table = Table(title=t.title, title_justify="left")
        for i, h in enumerate(t.headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for row in t.rows:
            table.add_row(*row)
        con.print(table)
    con.print(footer, highlight=False, soft_wrap=True)


@app.command("compare")
@handle_errors
def compare_cmd(
    paths: List[str] = typer.Argument(..., help="Run folders (any engine), or folders holding them; on an object "
                                      "store too (s3://, gs://, hf://, memory://; the cloud extra).", readable=False),
    metric: Optional[str] = typer.Option(
        None, "--metric", help="metrics.jsonl key to score runs by: eval/success, rollout/success, alloc/tcm, ..."),
    last: Optional[int] = typer.Option(
        None, "--last", help="Score = mean over the run's last K logged steps (default: the final logged value)."),
    group_by: str = typer.Option("allocator", "--group-by", help="Config field(s) naming a group: allocator,model,..."),
    baseline: Optional[str] = typer.Option(None, help="Compare every group with this one (default: every pair)."),
    allow_mixed: str = typer.Option("", "--allow-mixed", help="Config fields runs of a stratum may differ in."),
    curves: str = typer.Option("", "--curves", help="More metrics.jsonl keys to draw learning curves of (--out)."),
    dumps: bool = typer.Option(False, "--dumps", help="Mechanism trajectory recomputed from each run's dumps/."),
    table: Optional[str] = typer.Option(None, "--table", help="A paper table instead: paper-1, paper-3 or paper-4."),
    fmt: str = typer.Option("markdown", "--format", help="Format of --table: markdown, latex or csv."),
    out_arg: Optional[str] = typer.Option(None, "--out", "-o", metavar="PATH", help="Folder for report.html, summary.md, "
                                       "comparison.json and figures/ (PNG and PDF)."),
    resamples: int = O.RESAMPLES,
    confidence: float = O.CONFIDENCE,
    seed: int = typer.Option(0, help="Seed of the bootstrap."),
    as_json: bool = O.JSON,
) -> None:
    """Compare runs by a metric across seeds: per group mean, median and IQM with bootstrap CIs over runs, difference of means and probability of improvement between groups, stratified by environment (and Search-QA subset).

    Example: icsd compare examples/curves/* --metric rollout/invalid_rate --last 5

    Example: icsd compare runs/ --metric eval/success --group-by adv_estimator,allocator --out cmp/

    Paper table: icsd compare runs/ --table paper-1 --format latex
    """
    from icsd_audit.runs.curves import MECHANISM_KEYS
    from icsd_audit.runs.folders import load_runs, location

    out = None if out_arg is None else location(out_arg)
    if isinstance(out, str):
        raise fail(f"{out_arg}: --out takes a local folder (the runs may be read from a store, the comparison is "
                   "written here)")

    # only the keys this command reads: columns of the other ~70 per step are most of the loading time
    wanted = {metric, *_names(curves), *MECHANISM_KEYS}
    runs, skipped = load_runs(paths, keys=(lambda k: k.startswith("eval/")) if table is not None else
                              (lambda k: k in wanted or k.startswith("eval/subsets/")))
    common = dict(last=last, n_resamples=resamples, confidence_level=confidence, seed=seed,
                  allow_mixed=_names(allow_mixed), skipped=skipped)
    if table is not None:
        from icsd_audit.runs.tables import paper_table, render_table

        t = paper_table(runs, table, **common)
        text = render_table(t, fmt)
        _say_left_out(t.excluded)
        sys.stdout.write(text)
        return
    if metric is None:
        raise fail("--metric is required (e.g. --metric eval/success) unless --table is given")
    if fmt != "markdown":
        raise fail(f"--format {fmt} applies to --table only (the comparison: the terminal table, --json or --out)")
    from icsd_audit.runs.compare import compare_runs

    cmp = compare_runs(runs, metric=metric, group_by=_names(group_by), baseline=baseline, **common)
    curve_set: tuple = ()
    if as_json or out is not None:
        curve_set = _curves(cmp, runs, [metric, *_names(curves)], dumps=dumps, n_resamples=resamples,
                            confidence_level=confidence, seed=seed)
    if out is not None:
        from icsd_audit.outputs import check_output_dir
        from icsd_audit.runs.render import comparison_owns, write_comparison

        for r in runs:
            if isinstance(r.path, Path) and out.resolve() == r.path.resolve():
                raise fail(f"{out}: --out is the run folder {r.name}; an output never replaces an input")
        check_output_dir(out, [], owned=comparison_owns)
        written = write_comparison(out, cmp, curve_set)
        stderr_console().print(f"wrote {len(written)} files to [bold]{out}[/]", highlight=False, soft_wrap=True)
    _say_left_out(cmp.excluded, cmp.notes)
    if as_json:
        from icsd_audit.runs.render import comparison_payload

        sys.stdout.write(json.dumps(comparison_payload(cmp, curve_set), allow_nan=False) + "\n")
        return
    from icsd_audit.runs.render import comparison_tables, footer

    _print_tables(comparison_tables(cmp), footer(cmp))


def _curves(cmp: Any, runs: Any, keys: list[str], *, dumps: bool, **boot: Any) -> tuple:
    from icsd_audit.runs.curves import BAND_RESAMPLES, MECHANISM_KEYS, dump_series, group_curves

    boot["n_resamples"] = min(boot["n_resamples"], BAND_RESAMPLES)

    by_name = {r.name: r for r in runs}
    mech = list(MECHANISM_KEYS)
    series = None
    if dumps:
        names = {n for per in cmp.members.values() for ns in per.values() for n in ns}
        series = {n: dump_series(by_name[n]) for n in sorted(names)}
    plain = group_curves(cmp.members, by_name, list(dict.fromkeys(k for k in keys if k not in mech)), **boot)
    return plain + group_curves(cmp.members, by_name, mech, dumps=series, **boot)

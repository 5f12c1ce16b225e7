"""``icsd audit tcm | quadrants | shift | clip | landscape``: SPEC 6 statistics with bootstrap CIs.

Each command is a few lines over :mod:`icsd_audit.audit.run`.  Tables go to the
terminal; ``--json`` prints exactly one JSON object on stdout and nothing else
there; progress goes to stderr only when stderr is a terminal.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterator, List, Optional

import typer

from . import options as O
from .common import (audit_settings, check_backend, handle_errors, set_threads, stderr_console, thread_count,
                     without_options)
from .apps import audit_app

#: --by value that audits each group of files deployed with the same settings on its own
BY_SETTINGS = "settings"
#: --compare names the allocator of the deployed side: giving it replaces the recorded one
COMPARE_FLAG = {"allocator": "--compare"}


def _request(settings: Any, base: Optional[str], compare: Optional[str], seed: Optional[int], resamples: int,
             confidence: float, unit: str, by: Optional[str], **extra: Any) -> Any:
    """The request for one set of files: the deployed side and SDAR with the settings ``settings`` resolved."""
    from icsd_audit.audit.run import AuditRequest

    b, c = settings.pair(base, compare)
    return AuditRequest(base=b, compare=c, n_resamples=resamples, confidence_level=confidence, unit=unit,
                        seed=0 if seed is None else seed, by=by, eps=c.eps, workers=thread_count(), **extra)


def _check_by(by: Optional[str]) -> None:
    from icsd_audit.audit.run import BY_COLUMNS

    if by is not None and by not in (*BY_COLUMNS, BY_SETTINGS):
        raise ValueError(f"--by must be one of {', '.join((*BY_COLUMNS, BY_SETTINGS))}, got {by!r}")


def _triples(d: Any, prefix: str = "", by: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every {estimate, ci_low, ci_high} leaf of a result dict, with its dotted path."""
    if isinstance(d, dict):
        if {"estimate", "ci_low", "ci_high"} <= d.keys():
            yield prefix, d
            return
        for k, v in d.items():
            if k in ("regions", "groups", "bins"):
                yield from _triples(v, prefix, by)
            elif k != "bootstrap":
                yield from _triples(v, f"{prefix}.{k}" if prefix and not prefix.endswith(" ") else f"{prefix}{k}", by)
    elif isinstance(d, list):
        for item in d:
            label = f"{by}={item.get('key')}" if by else str(item.get("key"))
            yield from _triples({k: v for k, v in item.items() if k != "key"}, f"{prefix}{label} ", by)


def _emit(name: str, payload: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(payload, allow_nan=False) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    head = {k: payload[k] for k in ("n_tokens", "n_turns", "n_batches") if k in payload}
    rows = [(path, t) for path, t in _triples(payload, by=payload.get("by", ""))
            if not path.endswith("shift_pp")]  # = diff, which this table already shows in pp
    first = rows[0][1] if rows else {}
    level = f"{100 * first.get('confidence_level', 0.95):g} %"
    boot = f"{first.get('n_resamples', 0):,} {first.get('unit', 'action-turn')} resamples" if rows else ""
    table = Table(title=f"icsd audit {name}" + (f"  ({', '.join(f'{k}={v:,}' for k, v in head.items())})" if head else ""),
                  caption=(f"Shares in percent; diff = {payload.get('compare', 'compare')} \u2212 "
                           f"{payload.get('base', 'base')} in percentage points (pp); {level} percentile "
                           f"bootstrap CI over {boot}. --json gives fractions."),
                  caption_justify="left")
    for col in ("quantity", "estimate", f"{level} CI low", f"{level} CI high"):
        table.add_column(col, justify="left" if col == "quantity" else "right")
    for path, t in rows:
        unit = " pp" if path.split(".")[-1] == "diff" else " %"
        table.add_row(path, *(f"{100 * t[k]:.2f}{unit}" if t[k] is not None else "n/a" for k in ("estimate", "ci_low", "ci_high")))
    Console().print(table)
    for line in undefined_lines(payload):
        Console().print(line, highlight=False, soft_wrap=True)


def undefined_lines(payload: dict[str, Any]) -> list[str]:
    """``n/a: reason`` for the statistic (or each group of ``--by``) that has no value, in words."""
    if payload.get("undefined"):
        return [f"n/a: {payload['undefined']}."]
    by = payload.get("by", "group")
    return [f"n/a for {by}={g.get('key')}: {g['undefined']}." for g in payload.get("groups", []) if g.get("undefined")]


def _run_by_settings(statistic: str, paths: List[str], as_json: bool, flags: dict[str, Any], backend: str,
                     ray_address: Optional[str], **request: Any) -> None:
    """``--by settings``: each group of files deployed alike, audited with its own settings."""
    from icsd_audit.audit.settings import settings_groups
    from icsd_audit.audit.run import run_audit_groups

    set_threads()
    groups = []
    for s, files in settings_groups(paths, flags=COMPARE_FLAG, **flags):
        for line in s.overrides:
            print(f"note: {line}", file=sys.stderr)
        groups.append((s.recorded.label() if s.recorded is not None else "not recorded", files,
                       _request(s, by=None, **request)))
    res = run_audit_groups(groups, statistics=(statistic,), by=BY_SETTINGS, backend=backend, ray_address=ray_address)
    payload = getattr(res, statistic).to_dict()
    for g, (_, files, req) in zip(payload["groups"], groups):
        g.update(files=[str(f) for f in files], base=req.base.allocator, compare=req.compare.allocator)
    _emit(statistic, payload, as_json)


def _run(statistic: str, paths: List[str], as_json: bool, req: Any, **backend: Any) -> None:
    from icsd_audit.audit.run import run_audit

    set_threads()
    # rich (about 40 ms of imports) only when a spinner will be shown
    if not as_json and sys.stderr.isatty():
        with stderr_console().status("reading and allocating batches") as status:
            res = run_audit(paths, req, statistics=(statistic,),
                            progress=lambda i, n: status.update(f"batch {i}/{n}"), **backend)
    else:
        res = run_audit(paths, req, statistics=(statistic,), **backend)
    _emit(statistic, getattr(res, statistic).to_dict(), as_json)


def _stat_command(statistic: str, doc: str, example: str) -> None:
    @handle_errors
    @O.allocator_options()
    def command(
        paths: List[str] = O.PATHS,
        base: Optional[str] = O.BASE,
        compare: Optional[str] = O.COMPARE,
        resamples: int = O.RESAMPLES,
        confidence: float = O.CONFIDENCE,
        unit: str = typer.Option("action-turn", help="Resampling unit: action-turn (stratified by batch) or batch."),
        seed: Optional[int] = O.SEED,
        by: Optional[str] = typer.Option(None, help="Report per step, env or task (needs that column), or per group "
                                                    "of files deployed with the same settings (settings)."),
        clip_eps: float = O.CLIP_EPS,
        dual_clip: float = O.DUAL_CLIP,
        as_json: bool = O.JSON,
        backend: str = O.BACKEND,
        ray_address: Optional[str] = O.RAY_ADDRESS,
        *, settings: dict[str, Any],
    ) -> None:
        _check_by(by)
        check_backend(backend, ray_address)
        flags = dict(allocator=compare, **settings, seed=seed)
        request = dict(base=base, compare=compare, seed=seed, resamples=resamples, confidence=confidence, unit=unit,
                       clip_eps=clip_eps, dual_clip=dual_clip)
        if by == BY_SETTINGS:
            _run_by_settings(statistic, paths, as_json, flags, backend, ray_address, **request)
            return
        _run(statistic, paths, as_json, _request(audit_settings(paths, flags=COMPARE_FLAG, **flags), by=by, **request),
             backend=backend, ray_address=ray_address)

    command.__doc__ = f"{doc}\n\nExample: {example}"
    if statistic != "clip":  # --clip-eps and --dual-clip change clip's numbers only
        command = without_options(command, clip_eps=O.CLIP_EPS.default, dual_clip=O.DUAL_CLIP.default)
    audit_app.command(statistic)(command)


_stat_command("tcm", "Trusted-conflict mass of base and compare weightings, and their paired difference.",
              "icsd audit tcm runs/dumps --resamples 10000 --json")
_stat_command("quadrants", "Mass shares of the four (delta, advantage) sign regions plus neutral.",
              "icsd audit quadrants runs/dumps --base sdar --compare fisher")
_stat_command("shift", "Conditional share shift inside S+ = {delta > 0} by advantage bin (5 + 5 + neutral).",
              "icsd audit shift runs/dumps --json")
_stat_command("clip", "Clipping exposure: tokens and mass where the clipped surrogate is flat or out of range.",
              "icsd audit clip runs/dumps --clip-eps 0.2 --dual-clip 3")


@audit_app.command("landscape")
@handle_errors
@O.allocator_options()
def landscape(
    paths: List[str] = O.PATHS,
    base: Optional[str] = O.BASE,
    compare: Optional[str] = O.COMPARE,
    grid: int = O.GRID,
    seed: Optional[int] = O.SEED,
    resamples: int = O.RESAMPLES,
    confidence: float = O.CONFIDENCE,
    as_json: bool = O.JSON,
    backend: str = O.BACKEND,
    ray_address: Optional[str] = O.RAY_ADDRESS,
    *, settings: dict[str, Any],
) -> None:
    """Normalized allocation intensity on the joint mid-rank grid of delta and advantage (per env), its
    Gaussian-kernel smoothing and the region multipliers with action-turn bootstrap CIs.

    Example: icsd audit landscape runs/dumps --grid 20 --resamples 2000 --json
    """
    from icsd_audit.audit.run import run_landscape

    check_backend(backend, ray_address)
    set_threads()
    settings = audit_settings(paths, flags=COMPARE_FLAG, allocator=compare, **settings, seed=seed)
    req = _request(settings, base, compare, seed, resamples, confidence, "action-turn", None)
    res = run_landscape(paths, req, grid=grid, backend=backend, ray_address=ray_address)
    base, compare = req.base.allocator, req.compare.allocator
    payload = res.to_dict()
    if as_json:
        sys.stdout.write(json.dumps(payload, allow_nan=False) + "\n")
    else:
        stderr_console().print(f"landscape: {grid}x{grid} grid; use --json for the intensity and density matrices")
        from rich.console import Console

        Console().print_json(data={k: v for k, v in payload.items() if not isinstance(v, (list, dict))})
        def f(v: Any) -> str:
            return "n/a" if v is None else f"{v:.3g}"

        for g in payload["envs"]:
            for name, r in (g.get("regions") or {}).items():
                b, c = r[base], r[compare]
                if not r["n_tokens"]:
                    Console().print(f"{g['env'] or 'all'} {name}: 0 tokens; multiplier n/a (the region holds no token)")
                    continue
                Console().print(f"{g['env'] or 'all'} {name}: {r['n_tokens']} tokens; multiplier {base} "
                                f"{f(b['estimate'])} [{f(b['ci_low'])}, {f(b['ci_high'])}], {compare} "
                                f"{f(c['estimate'])} [{f(c['ci_low'])}, {f(c['ci_high'])}]")

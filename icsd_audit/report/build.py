"""The audit report: every statistic and figure of the paper's mechanism analysis from token dumps.

Why one entry point: a researcher auditing a run wants the paper's evidence for
their own batches (trusted-conflict mass, sign-region shares, share shift,
landscape, clipping exposure, gradient compatibility when the dumps carry
gradient sketches, and training dynamics when they span several steps) in one
pass, with the provenance of the data attached so a figure is never separated
from what it was computed on.

:func:`audit_dumps` streams the dumps batch by batch through the allocator library
(:func:`icsd_audit.alloc.options.weight_pair`) into the statistics accumulators of
:mod:`icsd_audit.stats.api`; statistics are computed there, once, and this module only
arranges their result objects.  :func:`write_figures` and :func:`write_report`
render everything in memory first, write the set into a fresh sibling directory
and swap it in (:func:`icsd_audit.outputs.publish_directory`): a reader sees the
old report or the new one, never a mix, and no file of an earlier run survives.
Rendering of tables and the HTML page lives in :mod:`icsd_audit.report.render`.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from icsd_audit.version import __version__
from icsd_audit.alloc.options import required_columns, weighted_batches
from icsd_audit.audit.signs import SignsSection
from icsd_audit.audit.gradcos import CosineRows, GradcosSummary, batch_cosines, batch_source, permutation_matrix
from icsd_audit.dumps.reader import DumpError, DumpReader, TokenBatch, prefetch, schema_names
from icsd_audit.report.results import FIGURE_NAMES, REPORT_SCHEMA, AuditReport, ReportOptions, figures_own, report_owns
from icsd_audit.report.strata import STRATA_COLUMNS, ReportStrata
from icsd_audit.stats import AuditAccumulator, LandscapeAccumulator
from icsd_audit.stats.budget import check_resources
from icsd_audit.stats.turns import turn_index
from icsd_audit.audit.threads import single_threaded_maths

__all__ = [
    "ReportOptions",
    "GradcosSummary",
    "AuditReport",
    "audit_dumps",
    "missing_inputs",
    "make_figures",
    "write_figures",
    "write_report",
    "FIGURE_NAMES",
    "REPORT_SCHEMA",
]

# --------------------------------------------------------------------------- computing


def _column(batch: TokenBatch, reader: DumpReader, name: str) -> np.ndarray:
    if name not in batch.tokens.columns:
        f = reader.paths[int(batch.file_index[0])]
        raise DumpError(f, "column present in other input files but missing here", column=name)
    return batch.tokens.columns[name]


def provenance(reader: DumpReader, opts: ReportOptions, n_tokens: int, n_batches: int) -> dict[str, Any]:
    """Where the numbers come from: files, producers, schema, recorded allocator, synthetic flag."""
    metas = reader.metadata()

    def unique(values: Sequence[Any]) -> list[Any]:
        seen: dict[str, Any] = {}
        for v in values:
            seen.setdefault(json.dumps(v, sort_keys=True, default=str), v)
        return list(seen.values())

    flags = {m.get("synthetic") for m in metas}
    synthetic: Any = flags.pop() if len(flags) == 1 else "mixed"
    return {
        "files": [str(p) for p in reader.paths],
        "n_files": len(reader.paths),
        "n_rows": int(reader.n_rows),
        "n_tokens": int(n_tokens),
        "n_batches": int(n_batches),
        "producers": unique([m.get("producer", "unknown") for m in metas]),
        "schemas": unique([{"schema": m.get("schema", "unknown"), "version": m.get("version")} for m in metas]),
        "dump_allocators": unique([m.get("allocator", {}) for m in metas]),
        "synthetic": synthetic,
        "icsd_version": __version__,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "audit": {"base": opts.allocator(opts.base).to_dict(), "compare": opts.allocator(opts.compare).to_dict()},
    }


class _Stream:
    """What the report's stream reduces each batch into: the accumulators and the token count."""

    def __init__(self, opts: ReportOptions, ranks: Any, strata: ReportStrata, signs: SignsSection, *, per_step: bool,
                 sketch_cols: Sequence[str]):
        acc_kw = dict(eps=opts.eps, clip_eps=opts.clip_eps, dual_clip=opts.dual_clip, base_name=opts.base,
                      compare_name=opts.compare)
        self.pooled = AuditAccumulator(n_bins=opts.n_bins, **acc_kw)
        # the per-step curve needs two steps: one-step dumps skip its accumulator (a fifth of the stream's time)
        self.per_step = AuditAccumulator(statistics=("tcm",), by="step", **acc_kw) if per_step else None
        self.land = LandscapeAccumulator(grid=opts.grid, base_name=opts.base, compare_name=opts.compare, ranks=ranks)
        self.with_perm = bool(sketch_cols) and opts.compare == "icsd" and opts.permutations > 0
        self.cos_rows = CosineRows(with_perm=self.with_perm, clip_eps=opts.clip_eps, dual_clip=opts.dual_clip)
        self.strata, self.signs = strata, signs
        self.n_tokens = self.n_batches = 0

    def add(self, batch: TokenBatch, weights: Any, u: np.ndarray, reader: DumpReader, opts: ReportOptions,
            names: set[str], sketch_cols: Sequence[str]) -> None:
        tokens = batch.tokens
        turns = turn_index(tokens)  # one index of the batch's action turns for the accumulators below
        self.pooled.add(tokens.replace(u=u), weights, turns=turns)  # (u: the allocator's, as icsd audit tcm)
        self.strata.add(reader, batch, weights, u)
        self.signs.add(tokens, weights, turns=turns)
        if self.per_step is not None:
            self.per_step.add(tokens, weights, group=_column(batch, reader, "step"))
        self.land.add(tokens, weights, env=_column(batch, reader, "env") if "env" in names else None, turns=turns)
        if sketch_cols:
            perm = (permutation_matrix(tokens, opts.allocator(opts.compare), opts.permutations, opts.seed)
                    if self.with_perm else None)
            source = batch_source(batch, reader.paths[int(batch.file_index[0])], paths=reader.paths)
            cos, jack = batch_cosines(tokens, weights, source, perm, clip_eps=opts.clip_eps, dual_clip=opts.dual_clip,
                                      blocks=opts.jackknife_blocks)
            self.cos_rows.add(batch.batch_id, tokens, cos, jack)
        self.n_tokens += int(tokens.valid.sum())
        self.n_batches += 1

    def merge(self, part: "_Stream") -> None:
        """A one-batch stream's sums after these (the bits of adding that batch here)."""
        self.pooled.merge(part.pooled)
        if self.per_step is not None:
            self.per_step.merge(part.per_step)
        self.land.merge(part.land)
        self.strata.merge(part.strata)
        self.signs.merge(part.signs)
        c, q = self.cos_rows, part.cos_rows
        c.ids += q.ids
        c.rows += q.rows
        c.jack += q.jack
        c.skipped += q.skipped
        self.n_tokens += part.n_tokens
        self.n_batches += part.n_batches


def report_part(paths: Sequence[str], opts: ReportOptions, ranks: Any, strata: ReportStrata, signs: SignsSection,
                per_step: bool, sketch_cols: Sequence[str], strata_cols: Sequence[str], names: set[str],
                batch_id: int) -> _Stream:
    """One batch of the report's stream on its own (what a Ray task runs; merged in batch order)."""
    import warnings

    from icsd_audit.audit.ray_backend import worker_reader
    from icsd_audit.audit.threads import one_intra_op_thread

    with one_intra_op_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the driver has shown them
        reader = worker_reader(paths, ("step", "env", *strata_cols, *sketch_cols),
                               tuple(required_columns(opts.base, opts.compare)))
        out = _Stream(opts, ranks, strata.fresh(), signs.fresh(), per_step=per_step, sketch_cols=sketch_cols)
        for batch, weights, u in weighted_batches([reader.batch(batch_id)], opts.allocator(opts.base),
                                                  opts.allocator(opts.compare)):
            out.add(batch, weights, u, reader, opts, names, sketch_cols)
    return out


@single_threaded_maths
def audit_dumps(paths: Sequence[str | Path], options: ReportOptions | None = None, *, workers: int = 1,
                backend: str = "local", ray_address: str | None = None) -> AuditReport:
    """Stream the dumps once (after a light first pass for the landscape's ranks) and compute every statistic.

    First pass: delta and advantage only, for the landscape's exact mid-rank edges
    (:func:`icsd_audit.audit.run.landscape_ranks`).  Then per batch: allocate (base and
    compare), feed the pooled accumulator (TCM, quadrants, shift, clip), the landscape
    (per ``env`` when that column exists), the per-step TCM (when a ``step`` column holds
    two or more steps) and, when a dense ``grad`` column exists, the gradient cosines.
    Statistics never cross batches.  One bootstrap at the end serves every statistic
    (each from its own per-turn sums on the resample stream of its layout, SPEC 7), so
    every interval here equals the one ``icsd audit tcm|quadrants|shift|clip|landscape``
    prints for the same dumps and seed.  ``workers``: batches allocated at once and
    bootstrap processes; never changes a value.  ``options=None``: SDAR against the
    deployed allocator with the settings the dumps record (SPEC 9);
    ``ReportOptions.deployed(*audit_settings(paths, trust=...).pair())`` overrides some.
    ``backend="ray"``: each batch of the stream is a Ray task (:func:`report_part`), merged
    here in batch order (the first pass and the bootstrap run here): the same numbers.
    """
    if backend not in ("local", "ray"):
        raise ValueError(f"backend must be one of local, ray, got {backend!r}")
    from icsd_audit.stats.bootstrap import bootstrap_ratio_families
    from icsd_audit.audit.run import landscape_ranks

    if options is None:  # SDAR against what the dumps record as deployed
        from icsd_audit.audit.settings import audit_settings

        options = ReportOptions.deployed(*audit_settings(paths).pair())
    opts = options
    # optional columns are read where a file has them; absent ones are never loaded
    names = schema_names(paths)
    sketch_cols = sorted(n for n in names if n == "grad" or n.startswith("sketch."))
    strata_cols = [c for c in STRATA_COLUMNS if c in names]
    reader = DumpReader(paths, columns=["step", "env", *strata_cols, *sketch_cols],
                        require=required_columns(opts.base, opts.compare))
    check_resources(reader, workers=workers, landscape=True, permutations=opts.permutations if sketch_cols else None,
                    n_resamples=opts.n_resamples)
    steps: set[Any] = set()  # two or more values iff the valid tokens span two or more steps
    ranks = landscape_ranks(reader, opts.grid, steps=steps if "step" in names else None)
    strata = ReportStrata(reader, eps=opts.eps, base_name=opts.base, compare_name=opts.compare, bins=opts.strata_bins)
    signs = SignsSection(reader.metadata(), opts.allocator(opts.base), opts.allocator(opts.compare))
    _release_freed_memory()
    stream = _Stream(opts, ranks, strata, signs, per_step=len(steps) >= 2, sketch_cols=sketch_cols)
    if backend == "ray":
        from icsd_audit.audit.ray_backend import ray_parts

        for part in ray_parts(report_part, paths, (opts, ranks, strata, signs, len(steps) >= 2, sketch_cols,
                                                   strata_cols, names), reader.batch_ids, address=ray_address,
                              workers=workers):
            stream.merge(part)
    else:
        for batch, weights, u in weighted_batches(prefetch(reader), opts.allocator(opts.base),
                                                  opts.allocator(opts.compare), workers=workers):
            stream.add(batch, weights, u, reader, opts, names, sketch_cols)
    pooled, per_step, land, cos_rows = stream.pooled, stream.per_step, stream.land, stream.cos_rows
    with_perm, n_tokens, n_batches = stream.with_perm, stream.n_tokens, stream.n_batches
    omitted = _omitted(sketch_cols, cos_rows, "step" in names, steps)
    if strata.reason is not None:
        omitted["strata"] = strata.reason
    omitted.update(missing_inputs(reader.metadata()))
    _release_freed_memory()  # the stream's freed batch temporaries, before the per-turn matrices are built
    # one bootstrap for all: the same intervals as each statistic's own command
    # each statistic's per-batch pieces handed back once its matrix holds them (the peak at 50M tokens)
    parts = [pooled.families(released=_release_freed_memory)]
    dyn = per_step is not None and "dynamics" not in omitted
    if dyn:
        parts.append(per_step.families())
    grids = land.grids()
    parts.append(land.families())
    n_pooled, n_step = len(parts[0]), len(parts[1]) if dyn else 0
    fams = [f for part in parts for _, f in part]
    del parts
    n_land = len(fams)  # the landscape's family last before the strata's: its replicates are kept
    fams += strata.families()  # (their replicates give the intensities' intervals)
    n_strata = len(fams)
    fams += signs.families()
    _release_freed_memory()
    keep = [n_land - 1 <= i < n_strata for i in range(len(fams))]
    # handed over one by one: a statistic's matrix goes once the engine holds what it needs (the share shift's
    # and the clipping's at 50M tokens: 380 MB the fused products' rows then use)
    raws = bootstrap_ratio_families(_handed_over(fams), n_resamples=opts.n_resamples,
                                    confidence_level=opts.confidence_level, rng=opts.seed, workers=workers,
                                    keep_replicates=keep)
    stats = pooled.results(raws[:n_pooled])
    dynamics = per_step.results(raws[n_pooled : n_pooled + n_step]).tcm if dyn else None
    if dynamics is not None and all(r.undefined for r in dynamics.results):  # no curve to draw: say why instead
        why = "; ".join(dict.fromkeys(r.undefined for r in dynamics.results))
        omitted["dynamics"] = f"trusted-conflict mass is n/a at every step: {why}"
        dynamics = None
    return AuditReport(
        stats=stats,
        landscape=land.result(grids, raws[n_land - 1]),
        dynamics=dynamics,
        gradcos=cos_rows.summarize(base_name=opts.base, compare_name=opts.compare,
                                   n_permutations=opts.permutations if with_perm else 0, n_resamples=opts.n_resamples,
                                   confidence_level=opts.confidence_level, seed=opts.seed)
        if "alignment" not in omitted else None,
        provenance=provenance(reader, opts, n_tokens, n_batches),
        options=opts,
        omitted=omitted,
        strata=strata.results(raws[n_land:n_strata]),
        signs=signs.result(raws[n_strata:]),
    )


def _handed_over(items: list[Any]) -> Iterator[Any]:
    """The items of ``items``, each removed from the list as it is handed on (the list keeps none)."""
    items.reverse()
    while items:
        yield items.pop()


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing happens).

    The per-turn pieces each batch leaves behind sit in the heap between the freed
    temporaries of allocation and reading; glibc keeps those free pages resident, so
    without a trim the bootstrap's peak would stand on them (measured at 20M tokens:
    ~200 MB of 1,009 MB at the bootstrap).  No number depends on it.
    """
    import ctypes
    import ctypes.util

    import pyarrow as pa

    # Arrow's allocator (mimalloc or jemalloc) keeps the pages of the decoded columns it has freed until asked
    pa.default_memory_pool().release_unused()
    path = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(path), "malloc_trim", None) if path else None
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


#: report sections that need the teacher (delta) / the advantage, and so are n/a on a recording without one
TEACHER_SECTIONS = ("summary", "signs", "quadrants", "landscape", "shift", "clip", "dynamics")
ADVANTAGE_SECTIONS = ("summary", "quadrants", "shift", "clip", "dynamics")


def missing_inputs(metas: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Section -> reason, for dumps whose producer recorded a stand-in for a missing input.

    A recorded trainer without a teacher (``producer.no_teacher``: delta 0 throughout) supports no
    distillation statistic; one without advantages (``producer.no_advantage``: advantage 0) supports
    none that splits by the advantage's sign (trusted-conflict mass, sign regions, share shift,
    clipping exposure), while the landscape's teacher axis stays.  The producer's sentence is the reason.
    """
    out: dict[str, str] = {}
    for key, sections in (("no_teacher", TEACHER_SECTIONS), ("no_advantage", ADVANTAGE_SECTIONS)):
        why = next((m["producer"][key] for m in metas if isinstance(m.get("producer"), Mapping)
                    and m["producer"].get(key)), None)
        if why is not None:
            for s in sections:
                out.setdefault(s, str(why))
    return out


def _omitted(sketch_cols: Sequence[str], cos_rows: CosineRows, has_step: bool, steps: set[Any]) -> dict[str, str]:
    """Section -> why the data cannot support it; the report prints the reason in the section's place."""
    out: dict[str, str] = {}
    if not sketch_cols:
        out["alignment"] = ("the dumps carry no gradient sketch (a 'grad' column or 'sketch.<layer>.out|in' columns, "
                            "which `icsd train --sketch-k K` writes)")
    elif cos_rows.undefined() is not None:
        out["alignment"] = str(cos_rows.undefined())
    if not has_step:
        out["dynamics"] = "the dumps carry no 'step' column"
    elif len(steps) < 2:
        out["dynamics"] = (f"the dumps hold one training step ({', '.join(map(str, sorted(steps)))}); "
                           "the per-step curve needs two or more")
    return out


# --------------------------------------------------------------------------- output


def make_figures(report: AuditReport, *, include_neutral: bool = True) -> dict[str, Any]:
    """name -> Figure for every figure the report's results support (see :data:`FIGURE_NAMES`)."""
    from icsd_audit.report import figures as F

    out: dict[str, Any] = {}
    s = report.stats
    # a statistic with no value (its tables say n/a and why) gets no empty figure
    if s.quadrants is not None and not s.quadrants.undefined:
        out["quadrants"] = F.quadrant_figure(s.quadrants, include_neutral=include_neutral)
    out["landscape"] = F.landscape_figure(report.landscape)
    if s.shift is not None and not s.shift.undefined:
        out["shift"] = F.shift_figure(s.shift)
    if report.gradcos is not None:
        out["alignment"] = F.alignment_figure(report.gradcos)
    if report.dynamics is not None:
        out["dynamics"] = F.dynamics_figure(report.dynamics, show_diff=True)
    if report.strata:
        out["strata"] = F.strata_figure(report.strata[0])
    return {k: v for k, v in out.items() if k not in report.omitted}  # a section said n/a shows no figure


def _render_all(figs: Mapping[str, Any], formats: Sequence[str], dpi: int | None) -> dict[str, bytes]:
    from icsd_audit.report.figures.style import render

    return {f"{name}.{fmt}": render(fig, fmt, dpi) for name, fig in figs.items() for fmt in formats}


def write_figures(report: AuditReport, out: str | Path, formats: Sequence[str] = ("png",), *,
                  dpi: int | None = None) -> list[Path]:
    """Render every figure in each format (png, pdf, svg) as the whole of ``out``; returns the paths written."""
    from icsd_audit.outputs import publish_directory

    bad = [f for f in formats if f not in ("png", "pdf", "svg")]
    if bad or not formats:
        raise ValueError(f"unknown figure format(s) {', '.join(bad) or '(none)'}; choose from png, pdf, svg")
    blobs = _render_all(make_figures(report), formats, dpi)
    return list(publish_directory(out, blobs, owned=figures_own).values())


def write_report(report: AuditReport, out: str | Path, *, dpi: int = 200) -> dict[str, Path]:
    """Write ``summary.json``, ``summary.md``, ``report.html`` and ``figures/*.png`` as the whole of ``out``.

    The HTML page is self-contained (figures as base64 PNG, inline CSS, a
    Content-Security-Policy that forbids any network request), so it can be mailed
    or archived as one file.
    """
    from icsd_audit.outputs import publish_directory
    from icsd_audit.report.render import render_html, render_markdown

    blobs = _render_all(make_figures(report), ("png",), dpi)
    summary = report.to_dict()
    files = {f"figures/{name}": data for name, data in blobs.items()}
    files["summary.json"] = (json.dumps(summary, indent=2, allow_nan=False) + "\n").encode()
    files["summary.md"] = render_markdown(report, [n for n in FIGURE_NAMES if f"{n}.png" in blobs]).encode()
    files["report.html"] = render_html(report, {n: blobs[f"{n}.png"] for n in FIGURE_NAMES if f"{n}.png" in blobs}).encode()
    return publish_directory(out, files, owned=report_owns)

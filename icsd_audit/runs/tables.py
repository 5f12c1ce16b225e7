"""The paper's result tables from run folders: Table 1 (main), Table 3 (Qwen3-4B ALFWorld), Table 4 (ablation).

Rows are (model, advantage estimator, allocator) groups of runs, the runs of a hybrid
baseline (``hybrid`` in the config: Skill-SD, RLSD, trained with ``allocator='none'``)
under their baseline's name, heading each model block as in the paper's Table 1; each cell is SPEC 10's
mean over the group's runs of the column's evaluation metric (final evaluation, or the
mean of the last K with ``last``), in percent, with the half-width of its 95 % percentile
bootstrap interval over runs and the number of runs: ``72.0 ± 3.1 (3)``; a group with
one run shows ``72.0 (1)``.  Columns and their keys:

* ALFWorld: Pick ... Pick2 = ``eval/subsets/<type>``, Avg = ``eval/subsets/Avg`` (wins over
  episodes, the paper's ALFWorld Avg);
* Search-QA: NQ ... Bam = ``eval/subsets/<subset>`` (exact match), Avg = ``eval/subsets/Avg``
  (the plain mean of the seven, the paper's);
* WebShop: Score = ``eval/score``, Acc. = ``eval/success``.

Formats: Markdown, LaTeX (booktabs, the paper's layout: environment column groups,
a model header row per block, a rule between optimizer families) and CSV (one row per
cell with mean, interval, half-width and run count).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Mapping, Sequence

from icsd_audit.runs.compare import CompareError, compare_runs, label_order
from icsd_audit.runs.folders import Run

__all__ = ["TABLES", "FORMATS", "Column", "PaperTable", "paper_table", "render_table"]

FORMATS = ("markdown", "latex", "csv")
_GROUP_BY = ("model", "adv_estimator", "allocator")


@dataclass(frozen=True)
class Column:
    env: str
    name: str
    key: str
    fallback: str | None = None  # a key to use when a run lacks ``key`` (older runs: eval/success for Avg)


_ALF = tuple(Column("alfworld", n, f"eval/subsets/{n}") for n in ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2")) \
    + (Column("alfworld", "Avg", "eval/subsets/Avg", "eval/success"),)
_SQA = tuple(Column("searchqa", n, f"eval/subsets/{n}") for n in ("NQ", "Triv", "Pop", "Hotp", "2Wk", "MuS", "Bam")) \
    + (Column("searchqa", "Avg", "eval/subsets/Avg"),)
_WEB = (Column("webshop", "Score", "eval/score"), Column("webshop", "Acc.", "eval/success"))
_ENV_TITLES = {"alfworld": "ALFWorld", "searchqa": "Search-QA", "webshop": "WebShop"}
_ADV = {"grpo": "GRPO", "gigpo": "GiGPO"}
#: hybrid baselines (TrainConfig.hybrid), in the paper's row order; their names never clash with an allocator's
_HYBRID = {"skill-sd": "Skill-SD", "rlsd": "RLSD"}
_ALLOC = {"opsd": "OPSD", "sdar": "SDAR", "icsd": "ICSD", "fisher": "Fisher magnitude", "sign": "Sign-only",
          "influence-only": "Influence only", "gaussian": "Gaussian", "permuted": "Permuted"}

#: name -> (caption, columns, row style: "family" = "GRPO", "+ SDAR"; "joined" = "GiGPO+SDAR").
TABLES: dict[str, tuple[str, tuple[Column, ...], str]] = {
    "paper-1": ("Main results (paper Table 1): evaluation success / score in percent", _ALF + _SQA + _WEB, "family"),
    "paper-3": ("Qwen3-4B ALFWorld (paper Table 3): evaluation success in percent", _ALF, "joined"),
    "paper-4": ("Allocation ablation on ALFWorld (paper Table 4): evaluation success in percent", _ALF, "family"),
}


@dataclass(frozen=True)
class Cell:
    mean: float
    ci_low: float
    ci_high: float
    n_runs: int

    @property
    def half_width(self) -> float:
        return (self.ci_high - self.ci_low) / 2.0


@dataclass(frozen=True)
class PaperTable:
    name: str
    caption: str
    columns: tuple[Column, ...]
    #: (model, adv_estimator, allocator, or the hybrid baseline for its rows) in display order, and the row's method name.
    rows: tuple[tuple[tuple[str, str, str], str], ...]
    cells: Mapping[tuple[tuple[str, str, str], int], Cell]
    excluded: tuple[tuple[str, str], ...]
    last: int | None


def _model_name(model: Any) -> str:
    text = str(model)
    return PurePath(text.rstrip("/")).name or text


def _method(adv: str, alloc: str, style: str) -> str:
    a = _ADV.get(adv, adv)
    if alloc in _HYBRID:  # the paper's hybrid rows are GRPO-based (SDAR's scripts); name another optimizer
        return _HYBRID[alloc] + ("" if adv == "grpo" else f" ({a})")
    if alloc == "none":
        return a
    return f"+ {_ALLOC.get(alloc, alloc)}" if style == "family" else f"{a}+{_ALLOC.get(alloc, alloc)}"


def paper_table(runs: Sequence[Run], name: str, *, last: int | None = None, n_resamples: int = 10_000,
                confidence_level: float = 0.95, seed: int = 0, allow_mixed: Sequence[str] = (),
                skipped: Sequence[tuple[str, str]] = ()) -> PaperTable:
    """Build table ``name`` (:data:`TABLES`) from ``runs``; runs of other environments are left out, named."""
    if name not in TABLES:
        raise ValueError(f"--table {name!r}: choose one of {', '.join(TABLES)}")
    caption, columns, style = TABLES[name]
    envs = {c.env for c in columns}
    excluded = list(skipped)
    usable = []
    for r in runs:
        env = (r.config or {}).get("env")
        if env not in envs:
            excluded.append((r.name, f"environment {env!r} has no column in {name}"))
        else:
            usable.append(_with_hybrid(r))
    cells: dict[tuple[tuple[str, str, str], int], Cell] = {}
    rows: set[tuple[str, str, str]] = set()
    for i, col in enumerate(columns):
        members = [r for r in usable if (r.config or {}).get("env") == col.env]
        members = [_with_fallback(r, col) for r in members]
        if not members:
            continue
        try:
            cmp = compare_runs(members, metric=col.key, last=last, group_by=_GROUP_BY, n_resamples=n_resamples,
                               confidence_level=confidence_level, seed=seed, allow_mixed=(*allow_mixed, "hybrid"),
                               with_pairs=False)
        except CompareError as exc:
            if "no run could be scored" in str(exc):
                excluded.extend((r.name, f"no {col.key!r} logged (column {col.env} {col.name})") for r in members)
                continue
            raise
        excluded.extend(e for e in cmp.excluded if e not in excluded)
        for g in cmp.groups:
            key = tuple(str(g.fields[k]) for k in _GROUP_BY)
            rows.add(key)  # type: ignore[arg-type]
            cells[(key, i)] = Cell(100 * g.mean.estimate, 100 * g.mean.ci_low, 100 * g.mean.ci_high, g.n_runs)  # type: ignore[index]
    if not cells:
        raise CompareError(f"--table {name}: no run has an evaluation metric of this table's columns "
                           f"({', '.join(sorted({c.key for c in columns}))}); train with --eval-every N")
    ordered = sorted(rows, key=lambda k: (_model_name(k[0]), k[2] not in _HYBRID, label_order("adv_estimator", k[1]),
                                          list(_HYBRID).index(k[2]) if k[2] in _HYBRID else 0,
                                          label_order("allocator", k[2])))
    return PaperTable(name, caption, columns, tuple((k, _method(k[1], k[2], style)) for k in ordered), cells,
                      tuple(excluded), last)


def _with_hybrid(run: Run) -> Run:
    """A hybrid baseline's run as the table groups it: its ``hybrid`` name in the row's method slot.

    Hybrid runs train with ``allocator='none'``; the table files them under their
    baseline's name instead, so they are not pooled with GRPO's runs and the labels of
    the other rows (and with them their resample streams, SPEC 10) stay those of
    ``icsd compare --group-by model,adv_estimator,allocator``.  Their names never clash
    with an allocator's.
    """
    hybrid = (run.config or {}).get("hybrid")
    if hybrid in _HYBRID and run.config.get("allocator") == "none":  # type: ignore[union-attr]
        from dataclasses import replace

        return replace(run, config={**run.config, "allocator": hybrid})  # type: ignore[dict-item]
    return run


def _with_fallback(run: Run, col: Column) -> Run:
    """The run with ``col.key`` taken from ``col.fallback`` when it lacks the key (older eval records)."""
    if col.fallback is None or col.key in run.columns or col.fallback not in run.columns:
        return run
    from dataclasses import replace

    return replace(run, columns={**run.columns, col.key: run.columns[col.fallback]},
                   logged={**run.logged, col.key: run.logged[col.fallback]})


# --------------------------------------------------------------------------- rendering


def _fmt(cell: Cell | None, *, latex: bool) -> str:
    if cell is None:
        return "--" if latex else "–"
    if cell.n_runs < 2 or not math.isfinite(cell.half_width):
        return f"{cell.mean:.1f} ({cell.n_runs})"
    pm = r"$\pm$" if latex else "±"
    return f"{cell.mean:.1f} {pm} {cell.half_width:.1f} ({cell.n_runs})"


def _blocks(t: PaperTable) -> list[tuple[str, list[tuple[tuple[str, str, str], str]]]]:
    out: list[tuple[str, list[tuple[tuple[str, str, str], str]]]] = []
    for key, method in t.rows:
        model = _model_name(key[0])
        if not out or out[-1][0] != model:
            out.append((model, []))
        out[-1][1].append((key, method))
    return out


def _env_spans(cols: Sequence[Column]) -> list[tuple[str, int]]:
    spans: list[tuple[str, int]] = []
    for c in cols:
        if spans and spans[-1][0] == c.env:
            spans[-1] = (c.env, spans[-1][1] + 1)
        else:
            spans.append((c.env, 1))
    return spans


def _note(t: PaperTable) -> str:
    score = "final evaluation" if t.last is None else f"mean of the last {t.last} evaluations"
    return (f"Cells: mean over runs ({score}) ± half-width of the 95 % percentile bootstrap interval over runs "
            "(SPEC 10), number of runs in parentheses.")


def _markdown(t: PaperTable) -> str:
    envs = len(_env_spans(t.columns)) > 1
    head = ["Method"] + [f"{_ENV_TITLES.get(c.env, c.env)} {c.name}" if envs else c.name for c in t.columns]
    lines = [f"**{t.caption}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, rows in _blocks(t):
        lines.append(f"| *{model}* |" + " |" * len(t.columns))
        for key, method in rows:
            lines.append("| " + " | ".join([method] + [_fmt(t.cells.get((key, i)), latex=False)
                                                        for i in range(len(t.columns))]) + " |")
    return "\n".join(lines + ["", _note(t)]) + "\n"


def _tex(text: str) -> str:
    return text.replace("\\", r"\textbackslash{}").replace("&", r"\&").replace("%", r"\%").replace("_", r"\_") \
        .replace("#", r"\#").replace("±", r"$\pm$")


def _latex(t: PaperTable) -> str:
    n = len(t.columns) + 1
    spans = _env_spans(t.columns)
    lines = [r"% \usepackage{booktabs}", r"\begin{table*}[t]", r"\centering", r"\scriptsize",
             r"\begin{tabular}{l" + "r" * len(t.columns) + "}", r"\toprule"]
    if len(spans) > 1 or t.name == "paper-1":
        lines.append("& " + " & ".join(rf"\multicolumn{{{k}}}{{c}}{{{_ENV_TITLES.get(e, e)}}}" for e, k in spans)
                     + r" \\")
        rules, col = [], 2
        for _, k in spans:
            rules.append(rf"\cmidrule(lr){{{col}-{col + k - 1}}}")
            col += k
        lines.append("".join(rules))
    lines += ["Method & " + " & ".join(_tex(c.name) for c in t.columns) + r" \\", r"\midrule"]
    for b, (model, rows) in enumerate(_blocks(t)):
        if b:
            lines.append(r"\midrule")
        lines.append(rf"\multicolumn{{{n}}}{{l}}{{\emph{{{_tex(model)}}}}} \\")
        prev_family = None
        for key, method in rows:
            family = "hybrid" if key[2] in _HYBRID else key[1]
            if prev_family is not None and family != prev_family:
                lines.append(rf"\cmidrule(lr){{1-{n}}}")
            prev_family = family
            lines.append(_tex(method) + " & " + " & ".join(_fmt(t.cells.get((key, i)), latex=True)
                                                         for i in range(len(t.columns))) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{_tex(t.caption)}. {_tex(_note(t))}}}",
              rf"\label{{tab:icsd-{t.name}}}", r"\end{table*}"]
    return "\n".join(lines) + "\n"


def _csv(t: PaperTable) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["table", "model", "adv_estimator", "allocator", "hybrid", "method", "env", "column", "key", "mean_pct",
                "ci_low_pct", "ci_high_pct", "half_width_pct", "n_runs"])
    for key, method in t.rows:
        for i, c in enumerate(t.columns):
            cell = t.cells.get((key, i))
            if cell is None:
                continue

            def f(x: float) -> str:
                return "" if not math.isfinite(x) else repr(round(x, 10))

            hybrid = key[2] if key[2] in _HYBRID else "none"
            w.writerow([t.name, key[0], key[1], "none" if key[2] in _HYBRID else key[2], hybrid, method, c.env, c.name, c.key, f(cell.mean), f(cell.ci_low),
                        f(cell.ci_high), f(cell.half_width), cell.n_runs])
    return buf.getvalue()


def render_table(t: PaperTable, fmt: str) -> str:
    """``t`` as ``markdown``, ``latex`` (booktabs) or ``csv``."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return {"markdown": _markdown, "latex": _latex, "csv": _csv}[fmt](t)

"""``compare_runs``: SPEC 10's comparison of runs across seeds and allocators.

Runs are grouped by a label (config fields, default ``allocator``), stratified by
environment (and, for Search-QA's ``eval/success``, by subset: each subset's exact match
is a stratum, so the across-strata mean is the paper's Search-QA Avg), and scored by one
metric: the value at the run's final logged step of it (for ``eval/...`` keys, its final
evaluation), or with ``last=K`` the mean over its last K logged steps.  Per group and
stratum: mean, median and IQM with stratified percentile bootstrap intervals over runs;
between groups: difference of means and probability of improvement.  Across strata,
each statistic is the unweighted mean of the strata's values (per resample for the
intervals).  The numbers follow rliable (Agarwal et al., 2021); :mod:`.estimates` has the
maths.

What is refused (``CompareError``, one line): a non-finite score value, a group without
runs in a stratum another group has (mixed environments without strata), runs of one
stratum that disagree on a config field that is neither a grouping key nor bookkeeping
(``allow_mixed`` accepts named fields), and no run with the metric at all.  What is left
out and named: paths without runs, runs without the metric, the grouping fields or an
environment, and runs with fewer than K logged values.  A group with one run in a
stratum gets point values without intervals (nothing to resample), with a note.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

import icsd_audit.runs.estimates as E
from icsd_audit.runs.folders import Run
from icsd_audit.stats.bootstrap import BootstrapResult

__all__ = ["CompareError", "RunScore", "GroupResult", "PairResult", "Comparison", "compare_runs", "ACROSS",
           "BOOKKEEPING_FIELDS", "SUBSET_STRATA", "label_order"]

#: The stratum name of across-strata values.
ACROSS = "all"
#: Config fields that say how a run was executed or recorded, not what it trained: never a reason to refuse.
BOOKKEEPING_FIELDS = frozenset({
    "out_dir", "seed", "alloc_seed", "sketch_seed", "threads", "device", "total_steps", "eval_every",
    "checkpoint_every", "keep_checkpoints", "checkpoint_optimizer", "dump_every", "sketch_k", "sketch_layers",
    "micro_batch_rows", "rollout_batch_rows", "resident_reference", "spill_optimizer_state", "recompute_activations",
    "trim_memory",
    "report_to",
})
#: env -> (metric whose strata are subsets, the prefix of its per-subset keys).
SUBSET_STRATA: dict[str, tuple[str, str]] = {"searchqa": ("eval/success", "eval/subsets/")}
#: Display order of known label values (paper order); other values sort after, alphabetically.
_ORDER: dict[str, tuple[str, ...]] = {
    "allocator": ("none", "opsd", "sdar", "fisher", "sign", "influence-only", "gaussian", "permuted", "icsd"),
    "adv_estimator": ("grpo", "gigpo"),
    "hybrid": ("skill-sd", "rlsd", "none"),
    "env": ("alfworld", "searchqa", "webshop"),
}


class CompareError(ValueError):
    """A comparison that cannot be made as asked: one line saying why and what to do."""


@dataclass(frozen=True)
class RunScore:
    """One run's score in one stratum."""

    path: str
    label: str
    stratum: str
    seed: Any
    score: float
    steps: tuple[int, ...]


@dataclass(frozen=True)
class GroupResult:
    """One group in one stratum (or :data:`ACROSS` strata): SPEC 10's statistics over its runs."""

    label: str
    fields: Mapping[str, Any]
    stratum: str
    runs: tuple[RunScore, ...]
    mean: BootstrapResult
    median: BootstrapResult
    iqm: BootstrapResult

    @property
    def n_runs(self) -> int:
        return len({r.path for r in self.runs})

    def statistic(self, name: str) -> BootstrapResult:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "fields": dict(self.fields), "stratum": self.stratum, "n_runs": self.n_runs,
                **{s: self.statistic(s).to_dict() for s in E.STATISTICS},
                "runs": [{"path": r.path, "stratum": r.stratum, "seed": r.seed, "score": r.score,
                          "steps": list(r.steps)} for r in self.runs]}


@dataclass(frozen=True)
class PairResult:
    """Group ``x`` against group ``y`` in one stratum: difference of means (x - y) and P(x > y)."""

    x: str
    y: str
    stratum: str
    difference_of_means: BootstrapResult
    probability_of_improvement: BootstrapResult
    #: (seed, x score, y score) for the seeds both groups ran in this stratum.
    paired: tuple[tuple[Any, float, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"x": self.x, "y": self.y, "stratum": self.stratum,
                "difference_of_means": self.difference_of_means.to_dict(),
                "probability_of_improvement": self.probability_of_improvement.to_dict(),
                "paired_seeds": [{"seed": s, "x": a, "y": b, "difference": a - b} for s, a, b in self.paired]}


@dataclass(frozen=True)
class Comparison:
    """Everything ``icsd compare`` reports, as data."""

    metric: str
    last: int | None
    group_by: tuple[str, ...]
    strata: tuple[str, ...]
    labels: tuple[str, ...]
    groups: tuple[GroupResult, ...]
    pairs: tuple[PairResult, ...]
    excluded: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    n_resamples: int
    confidence_level: float
    seed: int
    #: label -> stratum -> run folders (for curves and tables).
    members: Mapping[str, Mapping[str, tuple[str, ...]]] = field(repr=False, default_factory=dict)

    @property
    def score_rule(self) -> str:
        return "final" if self.last is None else f"mean of last {self.last}"

    def group(self, label: str, stratum: str | None = None) -> GroupResult:
        stratum = stratum or (self.strata[0] if len(self.strata) == 1 else ACROSS)
        for g in self.groups:
            if g.label == label and g.stratum == stratum:
                return g
        raise KeyError(f"no group {label!r} in stratum {stratum!r}")

    def pair(self, x: str, y: str, stratum: str | None = None) -> PairResult:
        stratum = stratum or (self.strata[0] if len(self.strata) == 1 else ACROSS)
        for p in self.pairs:
            if (p.x, p.y, p.stratum) == (x, y, stratum):
                return p
        raise KeyError(f"no comparison {x!r} vs {y!r} in stratum {stratum!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "score": self.score_rule, "last": self.last, "group_by": list(self.group_by),
                "strata": list(self.strata), "labels": list(self.labels), "n_resamples": self.n_resamples,
                "confidence_level": self.confidence_level, "seed": self.seed, "method": "percentile bootstrap over runs, "
                "stratified by group and stratum (SPEC 10)",
                "groups": [g.to_dict() for g in self.groups], "comparisons": [p.to_dict() for p in self.pairs],
                "excluded": [{"path": p, "reason": r} for p, r in self.excluded], "notes": list(self.notes)}


# --------------------------------------------------------------------------- grouping and scores


def label_order(key: str, value: Any) -> tuple[int, str]:
    known = _ORDER.get(key, ())
    text = str(value)
    return (known.index(text), "") if text in known else (len(known), text)


def _label(run: Run, group_by: Sequence[str]) -> tuple[str, dict[str, Any]]:
    fields = {k: run.field(k) for k in group_by}
    return "/".join(str(fields[k]) for k in group_by), fields


def _stratum_scores(run: Run, env: str, metric: str, last: int | None) -> dict[str, tuple[float, tuple[int, ...]]]:
    """stratum -> (score, steps used); raises LookupError(reason) when the run cannot be scored."""
    sub = SUBSET_STRATA.get(env)
    keys: dict[str, str] = {env: metric}
    if sub is not None and metric == sub[0]:
        names = sorted(k[len(sub[1]):] for k in run.columns if k.startswith(sub[1]) and k[len(sub[1]):] != "Avg")
        if names:
            keys = {f"{env}/{n}": sub[1] + n for n in names}
    out = {}
    for stratum, key in keys.items():
        s = run.series(key)
        if s is None or len(s) == 0:
            raise LookupError(f"no {key!r} logged" + ("" if key == metric else f" (for {metric} per subset)"))
        k = 1 if last is None else last
        if len(s) < k:
            raise LookupError(f"{key} logged at {len(s)} step(s); --last {last} needs {last}")
        vals, steps = s.values[-k:], s.steps[-k:]
        bad = ~np.isfinite(vals)
        if bad.any():
            raise CompareError(f"{run.name}: {key} is non-finite (null in metrics.jsonl) at step {int(steps[bad][0])}; "
                               "a score needs finite values (choose another metric or --last window)")
        out[stratum] = (float(np.mean(vals)) if last is not None else float(vals[-1]),
                        tuple(int(x) for x in steps))
    return out


def _check_compatible(runs: Sequence[Run], stratum: str, skip: set[str]) -> None:
    """Runs of one stratum must agree on every config field they record, apart from ``skip``."""
    seen: dict[str, tuple[str, Any, str]] = {}
    for run in runs:
        fields = dict(run.config or {})
        if run.engine is not None:
            fields["engine"] = run.engine
        for k, v in fields.items():
            if k in skip:
                continue
            enc = json.dumps(v, sort_keys=True, default=str)
            if k not in seen:
                seen[k] = (enc, v, run.name)
            elif seen[k][0] != enc:
                raise CompareError(
                    f"runs disagree on config field {k!r} in stratum {stratum}: {seen[k][2]} has {seen[k][1]!r}, "
                    f"{run.name} has {v!r}; group by it (--group-by ...,{k}), compare them apart, "
                    f"or accept the difference (--allow-mixed {k})")


# --------------------------------------------------------------------------- the comparison


def _check_options(metric: Any, last: Any, group_by: Any, n_resamples: Any, confidence_level: Any) -> None:
    if not isinstance(metric, str) or not metric:
        raise ValueError("metric: give a metrics.jsonl key, e.g. rollout/success or eval/success")
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
        raise ValueError(f"--last must be a positive integer, got {last!r}")
    if not group_by or any(not isinstance(k, str) or not k for k in group_by):
        raise ValueError(f"--group-by: give one or more config field names, got {group_by!r}")
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
        raise ValueError(f"--resamples must be a positive integer, got {n_resamples!r}")
    if not 0.0 < float(confidence_level) < 1.0:
        raise ValueError(f"--confidence must be in (0, 1), got {confidence_level!r}")


def compare_runs(
    runs: Sequence[Run],
    *,
    metric: str,
    last: int | None = None,
    group_by: Sequence[str] = ("allocator",),
    baseline: str | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    seed: int = 0,
    allow_mixed: Sequence[str] = (),
    skipped: Sequence[tuple[str, str]] = (),
    with_pairs: bool = True,
) -> Comparison:
    """Compare ``runs`` by ``metric`` (SPEC 10); ``skipped`` are (path, reason) pairs already left out.

    Between-group comparisons: every later group over every earlier one (display order:
    the paper's for allocators), or each group over ``baseline``; none with ``with_pairs=False``.
    """
    group_by = tuple(group_by)
    _check_options(metric, last, group_by, n_resamples, confidence_level)
    excluded = list(skipped)
    scores: list[RunScore] = []
    fields_of: dict[str, dict[str, Any]] = {}
    by_stratum: dict[str, dict[int, Run]] = defaultdict(dict)
    for run in runs:
        try:
            label, fields = _label(run, group_by)
        except KeyError as exc:
            excluded.append((run.name, f"its config does not record {exc.args[0]!r} (needed by --group-by)"))
            continue
        env = (run.config or {}).get("env")
        if env is None:
            excluded.append((run.name, "its config does not record 'env' (the stratum)"))
            continue
        try:
            per = _stratum_scores(run, str(env), metric, last)
        except LookupError as exc:
            excluded.append((run.name, str(exc.args[0])))
            continue
        fields_of[label] = fields
        run_seed = (run.config or {}).get("seed", (run.manifest or {}).get("seed"))
        for stratum, (score, steps) in per.items():
            scores.append(RunScore(run.name, label, stratum, run_seed, score, steps))
            by_stratum[stratum][id(run)] = run
    if not scores:
        raise CompareError(f"no run could be scored by {metric!r}"
                           + (f" ({len(excluded)} left out: {excluded[0][0]}: {excluded[0][1]}, ...)" if excluded else ""))
    labels = tuple(sorted(fields_of, key=lambda lab: tuple(label_order(k, fields_of[lab][k]) for k in group_by)))
    strata = tuple(sorted({s.stratum for s in scores},
                          key=lambda s: (label_order("env", s.split("/")[0]), s)))
    skip = set(BOOKKEEPING_FIELDS) | set(group_by) | set(allow_mixed)
    for stratum in strata:
        _check_compatible(list(by_stratum[stratum].values()), stratum, skip)
    cell: dict[tuple[str, str], list[RunScore]] = defaultdict(list)
    for s in scores:
        cell[(s.label, s.stratum)].append(s)
    for label in labels:
        missing = [st for st in strata if (label, st) not in cell]
        if missing:
            have = [st for st in strata if (label, st) in cell]
            raise CompareError(
                f"group {label!r} has no run in stratum {missing[0]} (it has {', '.join(have)}): every group needs "
                "runs in every stratum to be compared across them; pass runs of one environment, or the same "
                "environments for every group")
    if baseline is not None and baseline not in labels:
        raise CompareError(f"--baseline {baseline!r} is not a group; groups: {', '.join(labels)}")
    return _estimate(metric, last, group_by, strata, labels, fields_of, cell, excluded, baseline, with_pairs,
                     n_resamples=n_resamples, confidence_level=float(confidence_level), seed=int(seed))


def _estimate(metric: str, last: int | None, group_by: tuple[str, ...], strata: tuple[str, ...],
              labels: tuple[str, ...], fields_of: Mapping[str, Mapping[str, Any]],
              cell: Mapping[tuple[str, str], list[RunScore]], excluded: list[tuple[str, str]], baseline: str | None,
              with_pairs: bool, *, n_resamples: int, confidence_level: float, seed: int) -> Comparison:
    notes: list[str] = []
    single: dict[str, list[str]] = {}
    sorted_x: dict[tuple[str, str], np.ndarray] = {}
    counts: dict[tuple[str, str], np.ndarray | None] = {}
    points: dict[tuple[str, str], dict[str, float]] = {}
    reps: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for (label, stratum), runs in cell.items():
        x = E.check_scores([r.score for r in runs], f"group {label!r} in {stratum}")
        xs = np.sort(x)
        sorted_x[(label, stratum)] = xs
        points[(label, stratum)] = E.point_statistics(x)
        if x.size > 1:
            c = E.resample_counts(x.size, n_resamples, E.stream(seed, "runs", label, stratum))
            counts[(label, stratum)] = c
            reps[(label, stratum)] = E.resampled_statistics(xs, c)
        else:
            counts[(label, stratum)] = None
            single.setdefault(stratum, []).append(label)
        seeds = [r.seed for r in runs]
        dup = sorted({str(s) for s in seeds if seeds.count(s) > 1})
        if dup:
            notes.append(f"group {label!r} has several runs with seed {', '.join(dup)} in {stratum}")

    for stratum, labs in single.items():
        labs = [lab for lab in labels if lab in labs]
        who = f"group {labs[0]!r} has" if len(labs) == 1 else f"groups {', '.join(map(repr, labs))} have"
        notes.insert(0, f"{who} 1 run in {stratum}: no confidence interval is possible; point values only")

    def summarize(point: float, rep: np.ndarray | None) -> BootstrapResult:
        if rep is None:
            return E.point_only(point, confidence_level=confidence_level)
        return E.interval(point, rep, confidence_level=confidence_level)

    groups: list[GroupResult] = []
    across = len(strata) > 1
    for label in labels:
        for stratum in strata:
            key = (label, stratum)
            r = reps.get(key)
            groups.append(GroupResult(label, dict(fields_of[label]), stratum, tuple(cell[key]),
                                      *(summarize(points[key][s], None if r is None else r[s]) for s in E.STATISTICS)))
        if across:
            keys = [(label, st) for st in strata]
            full = all(k in reps for k in keys)
            stats = [summarize(float(np.mean([points[k][s] for k in keys])),
                               np.mean([reps[k][s] for k in keys], axis=0) if full else None) for s in E.STATISTICS]
            runs = tuple(r for k in keys for r in cell[k])
            groups.append(GroupResult(label, dict(fields_of[label]), ACROSS, runs, *stats))

    pairs: list[PairResult] = []
    if not with_pairs:
        order: list[tuple[str, str]] = []
    elif baseline is None:
        order = [(x, y) for i, x in enumerate(labels) for y in labels[:i]]
    else:
        order = [(x, baseline) for x in labels if x != baseline]
    for x, y in order:
        per: list[tuple[float, float, np.ndarray | None, np.ndarray | None]] = []
        for stratum in strata:
            kx, ky = (x, stratum), (y, stratum)
            xs, ys = sorted_x[kx], sorted_x[ky]
            d = points[kx]["mean"] - points[ky]["mean"]
            p = E.improvement_probability(xs, ys)
            cx, cy = counts[kx], counts[ky]
            if cx is not None and cy is not None:
                rd = reps[kx]["mean"] - reps[ky]["mean"]
                rp = E.resampled_improvement(xs, cx, ys, cy)
            else:
                rd = rp = None
            per.append((d, p, rd, rp))
            pairs.append(PairResult(x, y, stratum, summarize(d, rd), summarize(p, rp), _paired(cell[kx], cell[ky])))
        if across:
            full = all(q[2] is not None for q in per)
            pairs.append(PairResult(
                x, y, ACROSS,
                summarize(float(np.mean([q[0] for q in per])), np.mean([q[2] for q in per], axis=0) if full else None),
                summarize(float(np.mean([q[1] for q in per])), np.mean([q[3] for q in per], axis=0) if full else None),
                ()))
    members = {label: {st: tuple(dict.fromkeys(r.path for r in cell[(label, st)])) for st in strata}
               for label in labels}
    return Comparison(metric=metric, last=last, group_by=group_by, strata=strata, labels=labels, groups=tuple(groups),
                      pairs=tuple(pairs), excluded=tuple(excluded), notes=tuple(notes), n_resamples=n_resamples,
                      confidence_level=confidence_level, seed=seed, members=members)


def _paired(xr: Sequence[RunScore], yr: Sequence[RunScore]) -> tuple[tuple[Any, float, float], ...]:
    """Scores of the seeds that each group ran exactly once in the stratum, by seed."""
    def once(rs: Sequence[RunScore]) -> dict[str, RunScore]:
        keys = [json.dumps(r.seed) for r in rs]
        return {k: r for k, r in zip(keys, rs) if r.seed is not None and keys.count(k) == 1}

    a, b = once(xr), once(yr)
    common = sorted(set(a) & set(b), key=lambda k: (not isinstance(a[k].seed, (int, float)), a[k].seed
                                                    if isinstance(a[k].seed, (int, float)) else 0, k))
    return tuple((a[k].seed, a[k].score, b[k].score) for k in common)


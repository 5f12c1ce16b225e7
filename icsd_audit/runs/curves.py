"""Learning curves and mechanism trajectories per group: the mean over runs per step with a bootstrap band.

For one group and one environment, the runs' series of a key are put on the union of
their logged steps (a run that did not log a step is absent there, not zero).  At each
step the curve is the mean over the runs present and its band the percentile interval
of that mean under the same run resampling as SPEC 10 (runs drawn with replacement
within the group; a resample without any run present at a step is left out there).
Vectorized as a product: counts ``(R, n)`` times values ``(n, T)``.

The mechanism trajectory is the same curve for the allocation keys the built-in loop
logs per step (``alloc/tcm``: TCM under the deployed coefficients, ``alloc/tcm_trust``:
under SDAR's trust ``g``, ``alloc/share/REGION`` / ``alloc/share_trust/REGION``: SPEC 6's
sign-region shares), or recomputed from each run's dumps (:func:`dump_series`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

import icsd_audit.runs.estimates as E
from icsd_audit.runs.folders import Run, Series

__all__ = ["Curve", "group_curves", "MECHANISM_KEYS", "REGIONS", "dump_series", "series_of", "BAND_RESAMPLES"]

#: Resamples behind a curve's band: a display, drawn at every step, for which rliable's own
#: performance profiles use 2,000 (the statistics of :mod:`.compare` keep 10,000).
BAND_RESAMPLES = 2_000

#: SPEC 6 sign regions (the order of icsd_audit.stats.results.REGIONS).
REGIONS = ("pos_delta_pos_adv", "pos_delta_neg_adv", "neg_delta_pos_adv", "neg_delta_neg_adv", "neutral")
#: Per-step allocation keys of metrics.jsonl, in display order.
MECHANISM_KEYS = ("alloc/tcm", "alloc/tcm_trust", *(f"alloc/share/{r}" for r in REGIONS),
                  *(f"alloc/share_trust/{r}" for r in REGIONS))


@dataclass(frozen=True)
class Curve:
    """One key of one group in one environment: per-step mean over runs and its bootstrap band."""

    label: str
    env: str
    key: str
    steps: np.ndarray
    mean: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    n_runs: np.ndarray
    confidence_level: float
    n_resamples: int

    def to_dict(self) -> dict[str, Any]:
        def f(a: np.ndarray) -> list[float | None]:
            return [float(v) if np.isfinite(v) else None for v in a]

        return {"label": self.label, "env": self.env, "key": self.key, "steps": [int(s) for s in self.steps],
                "mean": f(self.mean), "ci_low": f(self.ci_low), "ci_high": f(self.ci_high),
                "n_runs": [int(n) for n in self.n_runs], "confidence_level": self.confidence_level,
                "n_resamples": self.n_resamples}


def series_of(run: Run, key: str, dumps: Mapping[str, Mapping[str, Series]] | None = None) -> Series | None:
    """A run's series of ``key``: from ``dumps`` (run path -> key -> series) when given, else metrics.jsonl."""
    if dumps is not None:
        return dumps.get(run.name, {}).get(key)
    return run.series(key)


def _group_curves(label: str, env: str, per_key: Mapping[str, Sequence[Series | None]], *, n_resamples: int,
                  confidence_level: float, seed: int) -> list[Curve]:
    """Every key's curve of one group in one environment, from one draw of run multiplicities.

    ``per_key[key][i]`` is run i's series of the key (None: never logged).  The keys' value
    matrices sit side by side, so one product and one percentile pass serve them all; the
    resampled runs depend on the seed, the group and the environment only.
    """
    n = len(next(iter(per_key.values())))
    blocks = []
    for key, series in per_key.items():
        steps = np.unique(np.concatenate([s.steps for s in series if s is not None]))
        vals = np.full((n, steps.shape[0]), np.nan)
        for i, s in enumerate(series):
            if s is not None:
                vals[i, np.searchsorted(steps, s.steps)] = s.values
        blocks.append((key, steps, vals))
    vals = np.concatenate([b[2] for b in blocks], axis=1)
    present = np.isfinite(vals).astype(np.float64)
    filled = np.where(present > 0, vals, 0.0)
    n_runs = present.sum(axis=0)
    t = vals.shape[1]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = filled.sum(axis=0) / n_runs
        lo = hi = np.full(t, np.nan)
        if n >= 2:
            counts = E.resample_counts(n, n_resamples, E.stream(seed, "curve", label, env))
            # (R, T); NaN where a resample drew no run present at a step
            reps = counts @ filled / (n if present.all() else counts @ present)
            alpha = 1.0 - confidence_level
            lo, hi = _nan_percentiles(reps, 100 * alpha / 2, 100 * (1 - alpha / 2))
            single = n_runs < 2  # one run at a step: no band there
            lo, hi = np.where(single, np.nan, lo), np.where(single, np.nan, hi)
    out, c0 = [], 0
    for key, steps, _ in blocks:
        c1 = c0 + steps.shape[0]
        out.append(Curve(label, env, key, steps, mean[c0:c1], lo[c0:c1], hi[c0:c1], n_runs[c0:c1],
                         confidence_level, n_resamples if n >= 2 else 0))
        c0 = c1
    return out


def _nan_percentiles(reps: np.ndarray, q_lo: float, q_hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Per column, NumPy's linear percentiles over the finite values.

    Columns without NaN (nearly all) go through ``np.percentile`` (a partition, linear
    time); the others are sorted (NaN last) and interpolated over their finite count.
    """
    finite = np.isfinite(reps)
    full = finite.all(axis=0)
    lo = np.full(reps.shape[1], np.nan)
    hi = np.full(reps.shape[1], np.nan)
    if full.any():
        lo[full], hi[full] = np.percentile(reps[:, full], [q_lo, q_hi], axis=0)
    part = ~full
    if part.any():
        srt = np.sort(reps[:, part], axis=0)
        k = finite[:, part].sum(axis=0)
        cols = np.arange(srt.shape[1])

        def pct(q: float) -> np.ndarray:
            h = (k - 1) * q / 100.0
            a_i = np.clip(np.floor(h).astype(np.int64), 0, None)
            b_i = np.minimum(a_i + 1, np.maximum(k - 1, 0))
            a, b = srt[a_i, cols], srt[b_i, cols]
            return np.where(k > 0, a + (h - a_i) * (b - a), np.nan)

        with np.errstate(invalid="ignore"):
            lo[part], hi[part] = pct(q_lo), pct(q_hi)
    return lo, hi


def group_curves(
    members: Mapping[str, Mapping[str, Sequence[str]]],
    runs: Mapping[str, Run],
    keys: Sequence[str],
    *,
    n_resamples: int = BAND_RESAMPLES,
    confidence_level: float = 0.95,
    seed: int = 0,
    dumps: Mapping[str, Mapping[str, Series]] | None = None,
) -> tuple[Curve, ...]:
    """Curves of ``keys`` per group and environment; ``members`` is label -> stratum -> run names.

    Strata that are subsets of one environment (``searchqa/NQ``) share that environment's
    curve.  A group whose runs never logged a key gets no curve for it.
    """
    out: list[Curve] = []
    for label, by_stratum in members.items():
        envs: dict[str, list[str]] = {}
        for stratum, names in by_stratum.items():
            env = stratum.split("/")[0]
            envs.setdefault(env, [])
            envs[env].extend(n for n in names if n not in envs[env])
        for env, names in envs.items():
            per_key = {}
            for key in keys:
                series = [series_of(runs[n], key, dumps) for n in names]
                series = [s if s is not None and len(s) else None for s in series]
                if any(s is not None for s in series):
                    per_key[key] = series
            if per_key:
                out.extend(_group_curves(label, env, per_key, n_resamples=n_resamples,
                                         confidence_level=confidence_level, seed=seed))
    order = {k: i for i, k in enumerate(keys)}
    return tuple(sorted(out, key=lambda c: order[c.key]))


#: run config key -> allocator setting (what ``icsd train`` records in config.json)
_CONFIG_SETTINGS = {"allocator": "allocator", "trust": "trust", "trust_beta": "trust_beta", "trust_eta": "trust_eta",
                    "influence_eta": "influence_eta", "min_group": "min_group", "alloc_eps": "eps", "alloc_seed": "seed"}


def deployed_settings(run: Run, folder: Path | str) -> Any:
    """The allocator settings ``run``'s dumps in ``folder`` were deployed with (an ``AuditSettings``).

    ``icsd audit``'s rule: the settings recorded in the shards (SPEC 9); shards deployed with
    different settings are refused in one line. Dumps that record none (older versions) take
    the run's ``config.json`` instead of SPEC's defaults, with one warning naming the folder.
    """
    import warnings

    from icsd_audit.dumps.reader import DumpWarning
    from icsd_audit.audit.settings import audit_settings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s = audit_settings([folder])
    if s.recorded is not None or not run.config:
        for w in seen:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return s
    given = {ours: run.config[theirs] for theirs, ours in _CONFIG_SETTINGS.items() if run.config.get(theirs) is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DumpWarning)
        s = audit_settings([folder], **given)
    warnings.warn(f"{folder}: no deployed allocator settings recorded (older dumps); mechanism curves use the run's "
                  f"config.json ({s.deployed.allocator}, trust={s.deployed.trust})", DumpWarning, stacklevel=2)
    return s


def _dumps_folder(run: Run) -> Path | str | None:
    """The run's ``dumps/`` (a path, or a URL for a run on a store) when it holds a ``*.parquet`` file, else None."""
    if isinstance(run.path, Path):
        folder = run.path / "dumps"
        return folder if folder.is_dir() and any(folder.rglob("*.parquet")) else None
    from icsd_audit.dumps.store import StoreError, find_objects

    url = run.path.rstrip("/") + "/dumps"
    try:
        _, _, single, objects = find_objects(url)
    except StoreError as exc:
        if exc.reason == "no such file or directory":
            return None
        raise
    return url if not single and any(o.endswith(".parquet") for o in objects) else None


def dump_series(run: Run, *, progress: Any = None) -> dict[str, Series]:
    """Per-step TCM and sign-region shares recomputed from ``run``'s dumps (``dumps/`` in the run folder, on disk
    or on the run's object store).

    The deployed side uses the settings the dumps record (:func:`deployed_settings`, as
    ``icsd audit`` does), the trust side SDAR with the same trust settings; point estimates
    per step (statistics pooled over a step's mini-batches, SPEC 6).  Empty when the run has
    no dumps (e.g. allocator none).
    """
    from icsd_audit.audit.run import AuditRequest, run_audit

    if (run.config or {}).get("allocator") == "none":
        return {}
    folder = _dumps_folder(run)
    if folder is None:
        return {}
    settings = deployed_settings(run, folder)
    base, compare = settings.pair()
    # c = g for SDAR and OPSD: the deployed allocation is the base side (ICSD the other); otherwise g is SDAR's trust
    same = settings.deployed.allocator in ("sdar", "opsd")
    req = AuditRequest(base=base, compare=compare, n_resamples=1, seed=0, by="step", eps=settings.deployed.eps)
    res = run_audit([folder], req, statistics=("tcm", "quadrants"), progress=progress)
    c_side = "base" if same else "compare"
    cols: dict[str, list[tuple[int, float]]] = {}
    for step, t in res.tcm.items():
        cols.setdefault("alloc/tcm", []).append((int(step), getattr(t, c_side).estimate))
        cols.setdefault("alloc/tcm_trust", []).append((int(step), t.base.estimate))
    for step, q in res.quadrants.items():
        for region, p in q.regions.items():
            cols.setdefault(f"alloc/share/{region}", []).append((int(step), getattr(p, c_side).estimate))
            cols.setdefault(f"alloc/share_trust/{region}", []).append((int(step), p.base.estimate))
    out = {}
    for key, pts in cols.items():
        pts.sort()
        out[key] = Series(key, np.array([p[0] for p in pts], dtype=np.int64), np.array([p[1] for p in pts], dtype=float))
    return out

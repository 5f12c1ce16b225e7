"""Audit statistics of SPEC section 6 with action-turn bootstrap intervals (SPEC 7).

Statistics compare two non-negative token weightings, *base* and *compare* (SDAR's
``g`` and ICSD's ``c`` by default, labelled ``"sdar"`` and ``"icsd"``; any two
allocators' weights work, e.g. ``sdar`` vs ``fisher``), pooled over all batches given:

- :func:`tcm` -- trusted-conflict mass;
- :func:`quadrants` -- mass shares of the four sign regions plus ``neutral``;
- :func:`share_shift` -- conditional share shift over advantage bins inside S+;
- :func:`clip_exposure` -- tokens and mass where the clipped surrogate misprices u;
- :func:`landscape` -- normalized allocation intensity on a joint mid-rank grid.

All but the landscape carry percentile bootstrap intervals for both weightings and
for the paired difference (compare minus base, on the same resamples).  Fractions
throughout, never percent (except ``shift_pp``, the share shift in points).

Every function takes ``(tokens, weights, *, options)``: a
:class:`~icsd_audit.tokens.Tokens` (flat per-token arrays, numpy or torch) and the
:class:`~icsd_audit.tokens.Weights` to compare; it reduces them once to per-turn sums (:mod:`icsd_audit.stats.turns`) and bootstraps those
(:mod:`icsd_audit.stats.bootstrap`).  For data that arrive batch by batch, feed an
:class:`AuditAccumulator` (and :class:`LandscapeAccumulator`) and finalize once:
all statistics then share one set of resamples.  ``by`` (a per-token key: step,
env, task) computes every statistic separately per key value.

Definitions, design and the JSON contract: ``docs/statistics.md``.
"""

from __future__ import annotations

from typing import Any

from icsd_audit.tokens import Tokens, Weights

from icsd_audit.stats.accumulator import AuditAccumulator, midrank_bins
from icsd_audit.stats.landscape import LandscapeAccumulator, LandscapeGrid, LandscapeResult, landscape
from icsd_audit.stats.results import (
    CLIP_EPS, DUAL_CLIP, EPS, LANDSCAPE_GRID, MASS_RTOL, N_SHIFT_BINS, REGIONS, STATISTICS, AuditResults,
    ClipResult, ClipSet, GroupedResult, PairedResult, QuadrantsResult, ShiftBin, ShiftResult, TCMResult,
    shift_bin_labels,
)

__all__ = [
    "EPS", "CLIP_EPS", "DUAL_CLIP", "N_SHIFT_BINS", "LANDSCAPE_GRID", "MASS_RTOL", "REGIONS", "STATISTICS",
    "shift_bin_labels", "PairedResult", "TCMResult", "QuadrantsResult", "ShiftBin", "ShiftResult", "ClipSet",
    "ClipResult", "GroupedResult", "AuditResults", "AuditAccumulator", "LandscapeGrid", "LandscapeResult",
    "LandscapeAccumulator", "Tokens", "Weights", "tcm", "quadrants", "quadrant_shares", "share_shift", "clip_exposure", "audit", "landscape", "midrank_bins",
]


# --------------------------------------------------------------------------- one-call API


def _one_call(statistic: str, tokens: Tokens, weights: Weights, *, by: Any, by_name: str | None, n_resamples: int,
              confidence_level: float, unit: str, rng: Any, chunk_size: int | None, workers: int,
              **options: Any) -> Any:
    if isinstance(by, str):
        by_name = by if by_name is None else by_name
        by = tokens.column(by)
    acc = AuditAccumulator(
        statistics=(statistic,) if statistic != "all" else STATISTICS,
        base_name=weights.base_name, compare_name=weights.compare_name,
        by=(by_name or "group") if by is not None else None, **options,
    )
    acc.add(tokens, weights, group=by)
    res = acc.finalize(n_resamples=n_resamples, confidence_level=confidence_level, unit=unit, rng=rng,
                       chunk_size=chunk_size, workers=workers)
    return res if statistic == "all" else getattr(res, statistic)


_COMMON_DOC = """
    Parameters
    ----------
    tokens : :class:`~icsd_audit.tokens.Tokens` -- delta, advantage, ratio, the ids
        (an action turn is (batch, traj, turn); ``batch_id`` defaults to one batch),
        ``valid`` (invalid rows enter no statistic) and optionally ``u``.
    weights : :class:`~icsd_audit.tokens.Weights` -- the two non-negative per-token
        weightings (e.g. ``g`` and ``c``) and their labels (default "sdar" / "icsd").

    Keyword-only options
    --------------------
    by, by_name : optional per-token group key (an array, or the name of a column of
        ``tokens`` such as ``"step"``); every statistic is then computed per key value
        and a :class:`GroupedResult` (labelled ``by_name``, default the column name or
        "group") is returned.
    n_resamples, confidence_level, unit, rng, chunk_size, workers : bootstrap options
        (:func:`icsd_audit.stats.bootstrap.bootstrap_ratio_columns`); ``unit="batch"``
        resamples whole batches instead of action turns.
"""


def tcm(
    tokens: Tokens,
    weights: Weights,
    *,
    by: Any = None,
    by_name: str | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    eps: float = EPS,
) -> TCMResult | GroupedResult:
    """Trusted-conflict mass: sum w over {delta>0, |u|>eps, u<0} / sum w over {delta>0, |u|>eps}.

    ``tokens.u`` (optional) overrides advantage * ratio * delta (computed in float64).
    """
    return _one_call("tcm", tokens, weights, by=by, by_name=by_name, n_resamples=n_resamples,
                     confidence_level=confidence_level, unit=unit, rng=rng, chunk_size=chunk_size, workers=workers,
                     eps=eps)


def quadrants(
    tokens: Tokens,
    weights: Weights,
    *,
    by: Any = None,
    by_name: str | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    mass_rtol: float = MASS_RTOL,
) -> QuadrantsResult | GroupedResult:
    """Share of all valid mass in each sign region of (delta, advantage), plus ``neutral``.

    Regions: pos_delta_pos_adv (delta>0, A>0), pos_delta_neg_adv, neg_delta_pos_adv,
    neg_delta_neg_adv; ``neutral`` holds delta == 0 or A == 0.  A region whose per-turn
    base and compare masses are bitwise identical, under two weightings whose per-turn
    totals agree to ``mass_rtol`` (turn mass matching), gets a difference of exactly 0
    (ICSD's double-negative region) instead of a rounding residue.
    """
    return _one_call("quadrants", tokens, weights, by=by, by_name=by_name, n_resamples=n_resamples,
                     confidence_level=confidence_level, unit=unit, rng=rng, chunk_size=chunk_size, workers=workers,
                     mass_rtol=mass_rtol)


def share_shift(
    tokens: Tokens,
    weights: Weights,
    *,
    by: Any = None,
    by_name: str | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    n_bins: int = N_SHIFT_BINS,
) -> ShiftResult | GroupedResult:
    """Conditional share shift inside S+ = {delta > 0} over advantage bins.

    Negative and positive advantages of S+ tokens are cut separately into ``n_bins``
    equal-frequency bins (:func:`midrank_bins`: ties never split), exact zeros form
    the ``zero`` bin.  Per bin: share of S+ mass under each weighting and
    ``diff`` = compare share - base share (``shift_pp`` = 100 x diff, SPEC 6).
    """
    return _one_call("shift", tokens, weights, by=by, by_name=by_name, n_resamples=n_resamples,
                     confidence_level=confidence_level, unit=unit, rng=rng, chunk_size=chunk_size, workers=workers,
                     n_bins=n_bins)


def clip_exposure(
    tokens: Tokens,
    weights: Weights,
    *,
    by: Any = None,
    by_name: str | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    clip_eps: float = CLIP_EPS,
    dual_clip: float = DUAL_CLIP,
) -> ClipResult | GroupedResult:
    """Clipping exposure (SPEC 6) under the PPO clip ``clip_eps`` and dual-clip ``dual_clip``.

    ``outside``: ratio outside [1 - clip_eps, 1 + clip_eps]; ``flat``: the clipped
    surrogate is flat (A > 0 and ratio > 1 + clip_eps, A < 0 and ratio < 1 - clip_eps,
    or A < 0 and ratio > dual_clip); for each, the share of tokens, of sum w and of
    sum w * |delta|; plus the count of tokens at the dual-clip cap.  The rule is
    evaluated in the ratio's own dtype, as :func:`icsd_audit.grads.compat.surrogate_flat`.
    """
    return _one_call("clip", tokens, weights, by=by, by_name=by_name, n_resamples=n_resamples,
                     confidence_level=confidence_level, unit=unit, rng=rng, chunk_size=chunk_size, workers=workers,
                     clip_eps=clip_eps, dual_clip=dual_clip)


def audit(
    tokens: Tokens,
    weights: Weights,
    *,
    by: Any = None,
    by_name: str | None = None,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
    eps: float = EPS,
    mass_rtol: float = MASS_RTOL,
    n_bins: int = N_SHIFT_BINS,
    clip_eps: float = CLIP_EPS,
    dual_clip: float = DUAL_CLIP,
) -> AuditResults:
    """TCM, quadrants, share shift and clipping exposure on one shared set of resamples."""
    return _one_call("all", tokens, weights, by=by, by_name=by_name, n_resamples=n_resamples,
                     confidence_level=confidence_level, unit=unit, rng=rng, chunk_size=chunk_size, workers=workers,
                     eps=eps, mass_rtol=mass_rtol, n_bins=n_bins, clip_eps=clip_eps, dual_clip=dual_clip)


#: alias under the name the paper and the CLI use for the sign-region statistic
quadrant_shares = quadrants

for _f in (tcm, quadrants, share_shift, clip_exposure, audit):
    _f.__doc__ = (_f.__doc__ or "") + _COMMON_DOC

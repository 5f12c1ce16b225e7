"""Share of distillation mass by the sign of delta: where each weighting puts its mass, teacher-supported or not.

For a non-negative token weighting w over the valid tokens, pooled over every batch given:

- ``positive``: sum of w over {delta > 0} / sum of w (the teacher rates the sampled token above the student);
- ``negative``: sum of w over {delta < 0} / sum of w;
- ``zero``: sum of w over {delta = 0} / sum of w (reported only when some valid token has delta exactly 0,
  e.g. a recorded top-k teacher whose support misses the sampled token);

with the same split of the token count (``token_share``) and, for every compared weighting,
its share minus the reference's (the first weighting: the deployed one).  The three shares of a
weighting add up to 1.  Unlike the statistics of SPEC 6 nothing here splits by the advantage,
so it is defined on recordings of trainers without one (TRL's SDFT, verl's pure distillation):
it says how much of the distillation signal each weighting spends where the teacher agrees with
the sample, which the deployed uniform weighting and SDAR's trust (a function of delta alone)
answer differently.

Intervals: SPEC 7's action-turn bootstrap on the shared machinery
(:func:`~icsd_audit.stats.bootstrap.bootstrap_ratio_families`); the action turns, their order
and their batches are those of :class:`~icsd_audit.stats.accumulator.AuditAccumulator`, so the
resamples are the ones every statistic of the audit reads and the statistic (named ``signs``)
has one interval whichever command computes it.  The accumulator keeps per-turn float64 sums
(3 + 4 per weighting), merged by concatenation in batch order (SPEC 12).

Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from icsd_audit.stats.bootstrap import BootstrapResult, RatioBootstrapResult, RatioFamily, bootstrap_ratio_families
from icsd_audit.stats.turns import ClusterIndex, as_numpy, check_finite, check_turns, masked
from icsd_audit.tokens import Tokens, Weights

__all__ = ["SIGNS", "STATISTIC", "SignSplit", "SignSharesResult", "SignSharesAccumulator", "sign_shares",
           "weightings_of"]

#: the sign classes of delta, in display order
SIGNS = ("positive", "negative", "zero")
#: the statistic's name (the stem of its bootstrap columns' names)
STATISTIC = "signs"
#: per-turn columns per weighting: delta > 0, delta < 0, delta = 0, all (the token count has the first three:
#: its total is their sum, exactly)
_PER = 4


def _row(k: int, r: int) -> int:
    """Row of sign r (3: all) of weighting k (0: the token count) in the per-turn sums."""
    return r if k == 0 else 3 + _PER * (k - 1) + r


@dataclass(frozen=True)
class SignSplit:
    """One quantity split by the sign of delta; ``zero`` is None when no valid token has delta = 0."""

    positive: BootstrapResult
    negative: BootstrapResult
    zero: BootstrapResult | None

    def get(self, sign: str) -> BootstrapResult | None:
        if sign not in SIGNS:
            raise KeyError(f"unknown sign {sign!r}; choose from {', '.join(SIGNS)}")
        return getattr(self, sign)

    def to_dict(self) -> dict[str, Any]:
        return {s: r.to_dict() for s in SIGNS if (r := getattr(self, s)) is not None}


@dataclass(frozen=True)
class SignSharesResult:
    """The share of each weighting's mass (and of the tokens) on delta > 0, < 0 and = 0, with intervals.

    ``weightings``: the labels, the reference (deployed) first; ``shares[i]`` belongs to
    ``weightings[i]``; ``diffs[i]`` is ``weightings[i + 1]`` minus the reference, paired on the
    same resamples.  Fractions, never percent.  ``n_positive`` / ``n_negative`` / ``n_zero``
    count the valid tokens of each sign.
    """

    weightings: tuple[str, ...]
    token_share: SignSplit
    shares: tuple[SignSplit, ...]
    diffs: tuple[SignSplit, ...]
    n_tokens: int
    n_positive: int
    n_negative: int
    n_zero: int
    n_turns: int
    n_batches: int
    n_resamples: int
    confidence_level: float
    unit: str = "action-turn"
    #: each weighting's allocator settings (SPEC 9 keys) where the audit layer allocated them; None otherwise
    settings: Mapping[str, Mapping[str, Any]] | None = None
    #: how the weightings were chosen, one line per departure from the audit's usual pair
    notes: tuple[str, ...] = ()

    @property
    def reference(self) -> str:
        return self.weightings[0]

    def share(self, name: str) -> SignSplit:
        """The split of weighting ``name``'s mass."""
        return self.shares[self._index(name)]

    def diff(self, name: str) -> SignSplit:
        """Weighting ``name``'s shares minus the reference's (``name`` is not the reference)."""
        i = self._index(name)
        if i == 0:
            raise KeyError(f"{name!r} is the reference weighting; the differences are against it")
        return self.diffs[i - 1]

    def _index(self, name: str) -> int:
        try:
            return self.weightings.index(name)
        except ValueError:
            raise KeyError(f"unknown weighting {name!r}; have {', '.join(self.weightings)}") from None

    @property
    def undefined(self) -> str | None:
        """Why the shares have no value (no valid token, or a weighting with no mass); None when defined."""
        if self.n_tokens == 0:
            return "no valid token"
        empty = [n for n, s in zip(self.weightings, self.shares) if not math.isfinite(s.positive.estimate)]
        if empty:
            return f"{', '.join(empty)} put{'s' if len(empty) == 1 else ''} no mass on any valid token"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "statistic": STATISTIC,
            "n_tokens": int(self.n_tokens), "n_turns": int(self.n_turns), "n_batches": int(self.n_batches),
            "tokens": {"positive": int(self.n_positive), "negative": int(self.n_negative), "zero": int(self.n_zero)},
            "reference": self.reference,
            "weightings": list(self.weightings),
            "token_share": self.token_share.to_dict(),
            "shares": {n: s.to_dict() for n, s in zip(self.weightings, self.shares)},
            "diff": {n: d.to_dict() for n, d in zip(self.weightings[1:], self.diffs)},
            "bootstrap": {"n_resamples": int(self.n_resamples), "confidence_level": float(self.confidence_level),
                          "method": "percentile", "unit": self.unit},
            "settings": None if self.settings is None else {k: dict(v) for k, v in self.settings.items()},
            "notes": list(self.notes),
        }


def weightings_of(weights: Weights | Mapping[str, Any]) -> dict[str, Any]:
    """``{label: per-token weights}``, the reference first: a :class:`Weights` pair is (base, compare)."""
    if isinstance(weights, Weights):
        if weights.base_name == weights.compare_name:
            raise ValueError(f"the two weightings need different labels, both are {weights.base_name!r}")
        return {weights.base_name: weights.base, weights.compare_name: weights.compare}
    out = dict(weights)
    if not out:
        raise ValueError("give at least one weighting")
    for name in out:
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"weighting labels must be non-empty strings without ':', got {name!r}")
    return out


class SignSharesAccumulator:
    """Per-turn sums of the sign split of the tokens and of each weighting's mass; one bootstrap at the end.

    ``names``: the weightings' labels, the reference first.  Memory: 3 + 4 x len(names)
    floats per action turn.
    """

    def __init__(self, *, names: Sequence[str]):
        self.names = tuple(weightings_of({n: None for n in names}))
        if len(self.names) != len(names):
            raise ValueError(f"weighting labels must be distinct, got {', '.join(names)}")
        self._sums: list[np.ndarray] = []
        self._batch: list[np.ndarray] = []
        self._counts = np.zeros(3, dtype=np.int64)  # valid tokens with delta > 0, < 0, = 0
        self._rows = 0
        self._batch_final: np.ndarray | None = None

    def add(self, tokens: Tokens, weights: Weights | Mapping[str, Any], *, turns: ClusterIndex | None = None) -> None:
        """Add tokens (one or several batches) and their weightings (labels as given to the constructor).

        ``turns``: :func:`~icsd_audit.stats.turns.turn_index` of these tokens when the caller has it.
        """
        w = weightings_of(weights)
        if tuple(w) != self.names:
            raise ValueError(f"weights are labelled ({', '.join(w)}) but the accumulator holds "
                             f"({', '.join(self.names)})")
        delta = as_numpy(tokens.delta, "delta")
        n = delta.shape[0]
        ws = [as_numpy(v, name, n) for name, v in w.items()]
        traj = as_numpy(tokens.traj_id, "traj_id", n)
        turn = as_numpy(tokens.turn_id, "turn_id", n)
        batch = np.zeros(n, dtype=np.int64) if tokens.batch_id is None else as_numpy(tokens.batch_id, "batch_id", n)
        for name, a in (("traj_id", traj), ("turn_id", turn), ("batch_id", batch)):
            if a.dtype.kind not in "iu":
                raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
        rows = None
        if tokens.valid is not None:
            keep = as_numpy(tokens.valid, "valid", n).astype(bool)
            if not keep.all():
                rows = np.flatnonzero(keep)
                delta, traj, turn, batch = delta[rows], traj[rows], turn[rows], batch[rows]
                ws = [a[rows] for a in ws]
        check_finite("delta", delta, offset=self._rows, rows=rows)
        for name, a in zip(self.names, ws):
            check_finite(name, a, nonnegative=True, offset=self._rows, rows=rows)
        self._rows += n
        if delta.shape[0] == 0:
            return
        check_turns(turns, delta.shape[0])
        # the clusters, and their order, of AuditAccumulator
        cidx = turns if turns is not None else ClusterIndex(batch, traj, turn)
        pos, neg = delta > 0, delta < 0
        zero = ~(pos | neg)
        out = np.empty((3 + _PER * len(ws), cidx.n), dtype=np.float64)
        for r, mask in enumerate((pos, neg, zero)):
            out[r] = cidx.count_where(mask)
        buf = np.empty(delta.shape[0], dtype=np.float64)
        has_zero = bool(zero.any())  # (usually not: the zero rows' sums are then +0.0, as masked sums give)
        for k, a in enumerate(ws, start=1):
            a64 = np.asarray(a, dtype=np.float64)
            for r, mask in enumerate((pos, neg, zero)):
                if r == 2 and not has_zero:
                    out[_row(k, r)] = 0.0
                else:
                    out[_row(k, r)] = cidx.sum(masked(a64, mask, out=buf))
            out[_row(k, 3)] = cidx.sum(a64)
        self._sums.append(out)
        self._batch.append(batch[cidx.first].astype(np.int64))
        self._counts += np.array([pos.sum(), neg.sum(), zero.sum()], dtype=np.int64)

    def merge(self, part: "SignSharesAccumulator") -> None:
        """Append ``part`` (the same weightings, later batches) after the batches here: the bits of adding it here."""
        if part.names != self.names:
            raise ValueError("merge: the part holds other weightings")
        self._sums.extend(part._sums)
        self._batch.extend(part._batch)
        self._counts += part._counts
        self._rows += part._rows

    # -- output
    def _names(self) -> list[str]:
        ratios = [f"{STATISTIC}:tokens:{s}" for s in SIGNS]
        ratios += [f"{STATISTIC}:{n}:{s}" for n in self.names for s in SIGNS]
        diffs = [f"{STATISTIC}:{n}:{s}:diff" for n in self.names[1:] for s in SIGNS]
        return ratios + diffs

    def family(self) -> RatioFamily:
        """The bootstrap request: per-turn columns (turns x (3 + 4 per weighting)), ratios then differences."""
        if not self._sums:
            raise ValueError("no valid tokens to audit")
        M = np.concatenate(self._sums, axis=1)
        self._sums = [M]
        self._batch_final = np.concatenate(self._batch)
        # the token count's total is its three signs' counts added (column M.shape[0], no product of its own):
        # integers, so the same bits as a count column's own product, and a dense column less to multiply
        num, den = [0, 1, 2], [M.shape[0]] * 3
        for k in range(1, 1 + len(self.names)):
            num += [_row(k, r) for r in range(3)]
            den += [_row(k, 3)] * 3
        diffs = [(3 * k + r, r + 3) for k in range(2, 1 + len(self.names)) for r in range(3)]
        return RatioFamily(M.T, num, den, strata=self._batch_final, differences=diffs, names=self._names(),
                           totals=[[0, 1, 2]])

    def results(self, raw: RatioBootstrapResult, *, unit: str = "action-turn") -> SignSharesResult:
        """The result object from the bootstrap of :meth:`family`."""
        has_zero = bool(self._counts[2] > 0)

        def split(stem: str) -> SignSplit:
            r = {s: raw.result(f"{STATISTIC}:{stem}:{s}") for s in ("positive", "negative")}
            return SignSplit(r["positive"], r["negative"],
                             raw.result(f"{STATISTIC}:{stem}:zero") if has_zero else None)

        batch = self._batch_final if self._batch_final is not None else np.concatenate(self._batch)
        return SignSharesResult(
            weightings=self.names, token_share=split("tokens"), shares=tuple(split(n) for n in self.names),
            diffs=tuple(SignSplit(*(raw.result(f"{STATISTIC}:{n}:{s}:diff") for s in ("positive", "negative")),
                                  raw.result(f"{STATISTIC}:{n}:zero:diff") if has_zero else None)
                        for n in self.names[1:]),
            n_tokens=int(self._counts.sum()), n_positive=int(self._counts[0]), n_negative=int(self._counts[1]),
            n_zero=int(self._counts[2]), n_turns=int(batch.size), n_batches=int(np.unique(batch).size),
            n_resamples=raw.n_resamples, confidence_level=raw.confidence_level, unit=unit,
        )

    def finalize(self, *, n_resamples: int = 10_000, confidence_level: float = 0.95, unit: str = "action-turn",
                 rng: Any = None, chunk_size: int | None = None, workers: int = 1) -> SignSharesResult:
        """Bootstrap on the resample stream of this layout (SPEC 7) and build the result."""
        (raw,) = bootstrap_ratio_families([self.family()], n_resamples=n_resamples, confidence_level=confidence_level,
                                          unit=unit, rng=rng, chunk_size=chunk_size, workers=workers)
        return self.results(raw, unit=unit)


def sign_shares(
    tokens: Tokens,
    weights: Weights | Mapping[str, Any],
    *,
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    unit: str = "action-turn",
    rng: Any = None,
    chunk_size: int | None = None,
    workers: int = 1,
) -> SignSharesResult:
    """Share of each weighting's mass on tokens with delta > 0, < 0 and = 0, compared with the reference.

    ``weights``: a :class:`~icsd_audit.tokens.Weights` pair (base = the reference) or an ordered
    mapping ``{label: per-token weights}`` whose first entry is the reference (the deployed
    weighting) and the others the compared allocations.  Only ``delta``, the ids and ``valid`` of
    ``tokens`` are read: no advantage is needed.  Bootstrap options as in
    :func:`icsd_audit.stats.api.tcm`.
    """
    w = weightings_of(weights)
    acc = SignSharesAccumulator(names=tuple(w))
    acc.add(tokens, w)
    return acc.finalize(n_resamples=n_resamples, confidence_level=confidence_level, unit=unit, rng=rng,
                        chunk_size=chunk_size, workers=workers)

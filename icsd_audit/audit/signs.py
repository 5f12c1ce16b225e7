"""Share of mass by the sign of delta over dumps: the library behind ``icsd audit signs`` and the report's section.

Which weightings are compared.  As every audit: the deployed weighting with the settings the
dumps record (SPEC 9) against SDAR or ICSD (:meth:`~icsd_audit.audit.settings.AuditSettings.pair`).
A recording of a trainer without an advantage (TRL's SDFT: ``producer.no_advantage``, every
advantage 0) changes two things (:func:`sign_pair`):

* an allocator whose score needs the advantage (ICSD and its variants) is replaced by SDAR:
  with every advantage 0 its score is the constant 0.5 (SPEC 2's fixed map at u = 0), so its
  turn mass matching returns the trust g, SDAR's weighting, on every token;
* SDAR under the uniform trust such a recording deploys (OPSD) is that uniform weighting
  itself, so the SDAR side takes SPEC 3's default trust (``laplace``), unless the caller set
  a trust.

Each change is one note line, carried in the result (``notes``) and printed by the command.  A
recording without a teacher (``producer.no_teacher``: delta 0 on every token) has no sign to
split by: refused with the producer's reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from icsd_audit.alloc.options import AllocatorOptions, required_columns, weight_pair, weighted_batches
from icsd_audit.alloc.registry import get_allocator
from icsd_audit.alloc.settings import DEFAULTS
from icsd_audit.dumps.reader import DumpReader, prefetch, read_metadata, resolve_paths
from icsd_audit.stats.budget import check_bootstrap, check_resources
from icsd_audit.stats.signs import SIGNS, SignSharesAccumulator, SignSharesResult
from icsd_audit.stats.turns import ClusterIndex
from icsd_audit.tokens import Tokens, Weights

__all__ = ["SignPair", "needs_advantage", "producer_reason", "sign_pair", "sign_statistic_count", "run_signs",
           "SignsSection"]

#: combination rules whose coefficient does not read the advantage (SDAR's trust, OPSD's uniform weight)
_ADVANTAGE_FREE = ("trust", "uniform")


def needs_advantage(allocator: str) -> bool:
    """Whether the allocator's coefficient reads the advantage (ICSD and its variants do; SDAR and OPSD do not)."""
    return get_allocator(allocator).combine not in _ADVANTAGE_FREE


def producer_reason(metas: Sequence[Mapping[str, Any]], key: str) -> str | None:
    """The producer's sentence under ``key`` (``no_advantage``, ``no_teacher``) in any file's metadata, else None."""
    for m in metas:
        prod = m.get("producer") if isinstance(m, Mapping) else None
        if isinstance(prod, Mapping) and prod.get(key):
            return str(prod[key])
    return None


def sign_statistic_count(n_weightings: int = 2) -> int:
    """Bootstrap statistics of the sign split: token shares, each weighting's shares, each difference."""
    return len(SIGNS) * (1 + n_weightings + (n_weightings - 1))


@dataclass(frozen=True)
class SignPair:
    """The (reference, compared) weightings of the sign split and one line per change :func:`sign_pair` made."""

    base: AllocatorOptions
    compare: AllocatorOptions
    notes: tuple[str, ...] = ()


def sign_pair(base: AllocatorOptions, compare: AllocatorOptions, *, no_advantage: str | None,
              keep_trust: bool = False, fixed: Sequence[str] = ()) -> SignPair:
    """The weightings the sign split compares, from the audit's pair (see the module docstring).

    ``no_advantage``: the producer's sentence when the dumps carry no advantage (None: the
    pair is returned as it is).  ``keep_trust``: the caller set the trust; it is kept.
    ``fixed``: the sides (``base``, ``compare``) the caller named; such a side that needs an
    advantage is refused on dumps without one instead of replaced.
    """
    if no_advantage is None:
        return SignPair(base, compare)
    notes: list[str] = []
    sides = {"base": base, "compare": compare}
    for side, other in (("base", "compare"), ("compare", "base")):
        o = sides[side]
        if needs_advantage(o.allocator):
            if side in fixed:
                raise ValueError(f"--{side} {o.allocator} needs an advantage, which these dumps lack "
                                 f"({no_advantage}); compare sdar and opsd there")
            name = "opsd" if sides[other].allocator == "sdar" else "sdar"
            sides[side] = dataclasses.replace(o, allocator=name)
            notes.append(f"{o.allocator} needs an advantage, which these dumps lack ({no_advantage}); with every "
                         f"advantage 0 it gives {name}'s weighting, which is shown instead")
    b, c = sides["base"], sides["compare"]
    if b.allocator == c.allocator:
        raise ValueError(f"base and compare are both {b.allocator} on dumps without an advantage; "
                         "compare two of sdar and opsd")
    pair = {b.allocator, c.allocator}
    if pair == {"opsd", "sdar"} and b.trust == c.trust == "uniform" and not keep_trust:
        trust = DEFAULTS.trust
        sides = {k: dataclasses.replace(v, trust=trust) if v.allocator == "sdar" else v for k, v in
                 (("base", b), ("compare", c))}
        b, c = sides["base"], sides["compare"]
        notes.append(f"sdar under the uniform trust the dumps record is opsd's weighting itself; sdar uses "
                     f"SPEC 3's {trust} trust here (--trust sets another)")
    return SignPair(b, c, tuple(notes))


def _with_settings(res: SignSharesResult, pair: SignPair) -> SignSharesResult:
    return dataclasses.replace(res, notes=pair.notes,
                               settings={pair.base.allocator: pair.base.to_dict(),
                                         pair.compare.allocator: pair.compare.to_dict()})


def _check_teacher(metas: Sequence[Mapping[str, Any]]) -> None:
    why = producer_reason(metas, "no_teacher")
    if why is not None:
        raise ValueError(f"the sign split of delta needs a teacher: {why}")


def run_signs(
    paths: Sequence[str | Path],
    base: AllocatorOptions,
    compare: AllocatorOptions,
    *,
    keep_trust: bool = False,
    fixed: Sequence[str] = (),
    n_resamples: int = 10_000,
    confidence_level: float = 0.95,
    seed: int = 0,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> SignSharesResult:
    """Share of each weighting's mass by the sign of delta over the dumps at ``paths``, with intervals.

    ``base``, ``compare``: the audit's pair (:meth:`~icsd_audit.audit.settings.AuditSettings.pair`),
    turned into the sign split's by :func:`sign_pair` with ``keep_trust`` and ``fixed`` and the
    dumps' provenance.  Batches stream once, each allocated once and reduced to per-turn sums;
    one bootstrap at the end (SPEC 7).
    """
    check_bootstrap(n_resamples, sign_statistic_count())
    metas = [read_metadata(p) for p in resolve_paths(paths)]  # the footers: which inputs the producer lacked
    _check_teacher(metas)
    pair = sign_pair(base, compare, no_advantage=producer_reason(metas, "no_advantage"), keep_trust=keep_trust,
                     fixed=fixed)
    reader = DumpReader(paths, columns=[], require=required_columns(pair.base.allocator, pair.compare.allocator))
    check_resources(reader, workers=workers)
    acc = SignSharesAccumulator(names=(pair.base.allocator, pair.compare.allocator))
    n = len(reader.batch_ids)
    for i, (batch, weights, _) in enumerate(weighted_batches(prefetch(reader), pair.base, pair.compare,
                                                              workers=workers)):
        acc.add(batch.tokens, weights)
        if progress is not None:
            progress(i + 1, n)
    res = acc.finalize(n_resamples=n_resamples, confidence_level=confidence_level, rng=seed, workers=workers)
    return _with_settings(res, pair)


class SignsSection:
    """The report's sign split: fed from the report's stream, bootstrapped with its other statistics.

    Where the sign pair is the report's own pair, the stream's weights are reused; otherwise
    (a recording without an advantage) each batch is allocated once more for the pair.  A
    recording without a teacher has no section (``reason``).
    """

    def __init__(self, metas: Sequence[Mapping[str, Any]], base: AllocatorOptions, compare: AllocatorOptions):
        self.reason = producer_reason(metas, "no_teacher")
        self.pair = sign_pair(base, compare, no_advantage=producer_reason(metas, "no_advantage"))
        self.own = (self.pair.base, self.pair.compare) != (base, compare)
        self.acc = SignSharesAccumulator(names=(self.pair.base.allocator, self.pair.compare.allocator))

    def add(self, tokens: Tokens, weights: Weights, *, turns: ClusterIndex | None = None) -> None:
        if self.reason is not None:
            return
        if self.own:
            weights, _ = weight_pair(tokens, self.pair.base, self.pair.compare)
        self.acc.add(tokens, weights, turns=turns)

    def fresh(self) -> "SignsSection":
        """An empty copy with the same weightings (a Ray task's part of the stream)."""
        out = object.__new__(SignsSection)
        out.reason, out.pair, out.own = self.reason, self.pair, self.own
        out.acc = SignSharesAccumulator(names=self.acc.names)
        return out

    def merge(self, part: "SignsSection") -> None:
        self.acc.merge(part.acc)

    def families(self) -> list[Any]:
        return [] if self.reason is not None else [self.acc.family()]

    def result(self, raws: Sequence[Any]) -> SignSharesResult | None:
        if self.reason is not None or not raws:
            return None
        return _with_settings(self.acc.results(raws[0]), self.pair)

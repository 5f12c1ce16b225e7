"""The registries of trust maps and allocators: names, the functions behind them, duplicates refused.

An allocator is a score ``m`` (how strongly the RL objective supports the teacher's push on a token) plus a
combination rule that turns trust ``g`` and ``m`` into the coefficient ``c``. Trust maps and scores register
where they are defined (:mod:`~icsd_audit.alloc.trust`, :mod:`~icsd_audit.alloc.scores`), with the decorators
below; a bad name lists the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from torch import Tensor

__all__ = ["Combine", "Score", "ScoreFn", "TrustFn", "AllocatorSpec", "register_allocator", "allocator",
           "get_allocator", "allocator_names", "register_trust", "get_trust", "trust_names"]

Combine = Literal["trust-weighted", "influence-only", "trust", "uniform"]


@dataclass(frozen=True)
class Score:
    """A score ``m`` per valid token and how many calibration groups fell back (for the diagnostics)."""

    m: Tensor
    groups_batch_stats: int = 0
    groups_fixed_map: int = 0


#: ``score(*, u, advantage, ratio, delta, fallback, lay, score_norm, eta, eps, min_group, seed) -> Score``
ScoreFn = Callable[..., Score]
#: ``trust(delta, layout, *, eta, beta, eps, min_group) -> (g, number of batches on the fixed map)``
TrustFn = Callable[..., tuple[Tensor, int]]


@dataclass(frozen=True)
class AllocatorSpec:
    """A registry entry: the score that enters turn mass matching and how it combines."""

    name: str
    combine: Combine
    score: ScoreFn | None
    description: str
    #: Optional per-token columns this allocator cannot do without (e.g. ``score_norm``).
    requires: tuple[str, ...] = ()


_ALLOCATORS: dict[str, AllocatorSpec] = {}
_TRUST: dict[str, TrustFn] = {}


def register_allocator(spec: AllocatorSpec) -> AllocatorSpec:
    """Add an allocator; a second entry under the same name is a programming error."""
    if spec.name in _ALLOCATORS:
        raise ValueError(f"allocator {spec.name!r} is already registered")
    _ALLOCATORS[spec.name] = spec
    return spec


def allocator(name: str, *, combine: Combine, description: str,
              requires: tuple[str, ...] = ()) -> Callable[[ScoreFn], ScoreFn]:
    """Register the decorated score function as allocator ``name`` (as verl's ``@register_adv_est`` does)."""

    def add(score: ScoreFn) -> ScoreFn:
        register_allocator(AllocatorSpec(name, combine, score, description, requires))
        return score

    return add


def get_allocator(name: str) -> AllocatorSpec:
    try:
        return _ALLOCATORS[name]
    except KeyError:
        raise ValueError(f"unknown allocator {name!r}; valid: {', '.join(allocator_names())}") from None


def allocator_names() -> list[str]:
    return sorted(_ALLOCATORS)


def register_trust(name: str) -> Callable[[TrustFn], TrustFn]:
    """Register the decorated function as trust map ``name``; a second one under the same name is refused."""

    def add(fn: TrustFn) -> TrustFn:
        if name in _TRUST:
            raise ValueError(f"trust {name!r} is already registered")
        _TRUST[name] = fn
        return fn

    return add


def get_trust(name: str) -> TrustFn:
    try:
        return _TRUST[name]
    except KeyError:
        raise ValueError(f"unknown trust {name!r}; valid: {', '.join(trust_names())}") from None


def trust_names() -> list[str]:
    return sorted(_TRUST)

"""Allocator settings of an audit and the allocation of one batch of dump rows.

An audit recomputes what training deployed with the same allocator functions; this
module holds the settings it applies (SPEC defaults) and the one rule that lets a
SDAR-vs-X comparison allocate once per batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Iterator, TypeVar

import numpy as np

from icsd_audit.alloc.variants import (EPS, INFLUENCE_ETA, MIN_GROUP, SIGMOID_BETA, TRUST_ETA, Allocation, allocate,
                                       check_settings, get_allocator)
from icsd_audit.tokens import Tokens, Weights

__all__ = ["AllocatorOptions", "RUN_FIELDS", "run_allocator_settings", "allocate_batch", "weight_pair", "weighted_batches",
           "required_columns"]

B = TypeVar("B")


@dataclass(frozen=True)
class AllocatorOptions:
    """The allocator settings an audit applies (SPEC defaults; the keys of SPEC 9's ``allocator`` block)."""

    allocator: str = "icsd"
    trust: str = "laplace"
    trust_beta: float = SIGMOID_BETA
    trust_eta: float = TRUST_ETA
    influence_eta: float = INFLUENCE_ETA
    min_group: int = MIN_GROUP
    eps: float = EPS
    seed: int = 0

    def __post_init__(self) -> None:  # before any dump is read, not at the first batch
        check_settings(trust_beta=self.trust_beta, trust_eta=self.trust_eta, influence_eta=self.influence_eta,
                       eps=self.eps, min_group=self.min_group)

    def kwargs(self) -> dict[str, Any]:
        return dict(allocator=self.allocator, trust=self.trust, trust_beta=self.trust_beta, trust_eta=self.trust_eta,
                    influence_eta=self.influence_eta, min_group=self.min_group, eps=self.eps, seed=self.seed)


#: The run config's (``icsd train``'s ``TrainConfig``) field of each :class:`AllocatorOptions` field, where the
#: names differ (``eps`` is a run's ``alloc_eps``, ``seed`` its ``alloc_seed``).
RUN_FIELDS = {"eps": "alloc_eps", "seed": "alloc_seed"}


def run_allocator_settings(cfg: Any) -> dict[str, Any]:
    """Every allocator setting of a run config, under :class:`AllocatorOptions`' names (SPEC 9's keys).

    The one list every engine takes its settings from (the built-in loop's dumps, TRL's
    ``ICSDConfig``, the ``+icsd.*`` overrides of the verl command): a setting added to
    :class:`AllocatorOptions` reaches all of them, or fails here on a config without it.
    """
    return {f.name: getattr(cfg, RUN_FIELDS.get(f.name, f.name)) for f in fields(AllocatorOptions)}


def required_columns(*allocators: str) -> tuple[str, ...]:
    """Optional dump columns the named allocators cannot do without (``fisher``: ``score_norm``)."""
    return tuple(dict.fromkeys(c for name in allocators for c in get_allocator(name).requires))


def allocate_batch(tokens: Tokens, opts: AllocatorOptions) -> Allocation:
    """Allocate one batch's tokens with ``opts`` (float64 on CPU for the reader's tokens)."""
    return allocate(tokens, **opts.kwargs())


def weight_pair(tokens: Tokens, base: AllocatorOptions, compare: AllocatorOptions) -> tuple[Weights, np.ndarray]:
    """(the base and compare weights, u) of one batch's tokens, each allocator computed once.

    SDAR's weights are the trust ``g`` of any non-OPSD allocation with the same trust
    settings, so the usual SDAR-vs-X comparison allocates once per batch.
    """
    first, second = sorted((compare, base), key=lambda o: o.allocator == "sdar")
    alloc = allocate_batch(tokens, first)
    if second == first:
        w2 = alloc.c.numpy()
    elif second.allocator == "sdar" and first.allocator != "opsd" and replace(first, allocator="sdar", seed=second.seed) == second:
        w2 = alloc.g.numpy()
    else:
        w2 = allocate_batch(tokens, second).c.numpy()
    w = {first: alloc.c.numpy(), second: w2}
    return Weights(w[base], w[compare], base_name=base.allocator, compare_name=compare.allocator), alloc.u.numpy()


def weighted_batches(batches: Iterable[B], base: AllocatorOptions, compare: AllocatorOptions, *,
                     workers: int = 1) -> Iterator[tuple[B, Weights, np.ndarray]]:
    """``(batch, weights, u)`` of each batch (anything with ``.tokens``), in input order.

    Batches are allocated independently, so ``workers`` threads allocate up to that
    many batches at once (torch releases the GIL inside its kernels).  Each batch is
    still computed by one thread with torch's one intra-op thread, so every weight is
    bitwise the same whatever ``workers`` is; results come back in input order, so
    downstream sums are too.  At most ``workers`` batches are in flight.
    """
    if workers <= 1:
        for batch in batches:
            yield (batch, *weight_pair(batch.tokens, base, compare))  # type: ignore[attr-defined]
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="icsd-alloc") as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.submit(weight_pair, batch.tokens, base, compare)))  # type: ignore[attr-defined]
            if len(pending) >= workers:
                done, fut = pending.popleft()
                yield (done, *fut.result())
        while pending:
            done, fut = pending.popleft()
            yield (done, *fut.result())

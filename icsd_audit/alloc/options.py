"""The allocation of an audit's batches: one batch with its settings, and the one rule that lets a SDAR-vs-X
comparison allocate once per batch.

An audit recomputes what training deployed with the same allocator functions and the same settings object.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Iterable, Iterator, TypeVar

import numpy as np

from icsd_audit.alloc.registry import get_allocator
from icsd_audit.alloc.settings import AllocatorSettings
from icsd_audit.alloc.variants import Allocation, allocate
from icsd_audit.tokens import Tokens, Weights

__all__ = ["AllocatorOptions", "allocate_batch", "weight_pair", "weighted_batches", "required_columns"]

B = TypeVar("B")


#: the audit's name for the allocator settings (one object: :class:`~icsd_audit.alloc.settings.AllocatorSettings`)
AllocatorOptions = AllocatorSettings


def required_columns(*allocators: str) -> tuple[str, ...]:
    """Optional dump columns the named allocators cannot do without (``fisher``: ``score_norm``)."""
    return tuple(dict.fromkeys(c for name in allocators for c in get_allocator(name).requires))


def allocate_batch(tokens: Tokens, opts: AllocatorOptions) -> Allocation:
    """Allocate one batch's tokens with ``opts`` (float64 on CPU for the reader's tokens)."""
    return allocate(tokens, opts)


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

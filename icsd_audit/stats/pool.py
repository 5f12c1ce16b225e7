"""Work on threads where NumPy releases the GIL (copies, takes, cumulative sums, bincounts).

Pure standard library.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

__all__ = ["on_threads"]

_A = TypeVar("_A")
_R = TypeVar("_R")


def on_threads(fn: Callable[[_A], _R], items: Iterable[_A], workers: int) -> list[_R]:
    """``fn`` of each item, in order, on ``workers`` threads (in this thread when one is asked for or one item is
    given): the same results as a loop, whatever the number of threads, where ``fn``'s calls are independent."""
    items = list(items)
    if workers <= 1 or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))

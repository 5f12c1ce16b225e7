"""Large arrays in plain pages (4 KiB), faulted in when mapped, without NumPy's huge-page advice.

NumPy advises the kernel to back arrays of 4 MB and more (:data:`HUGE_PAGE_BYTES`) with transparent huge pages. On a
kernel whose THP defrag setting is ``madvise`` (as on the development box), that advice makes each first touch
compact memory for a 2 MB page: filling a fresh 283 MB matrix (the strata's per-turn sums at 20M tokens) took 0.70 s there, 0.67 s of it in
the kernel, against 0.17 s in plain pages, with no difference in the bootstrap's products that read it afterwards
(2.26 vs 2.27 ns per resample and turn). An anonymous mapping of its own, which NumPy never advises, gets plain
pages wherever THP is not ``always``; where it is, nothing changes. The mapping is populated when made
(``MAP_POPULATE``, Linux): the kernel faults every page in one call instead of one trap per page at first touch, which
in the development box's virtual machine halved the cost of the strata's 60 batch copies into a fresh 300 MB matrix
(0.13 vs 0.22 s, the mapping included, /tmp script, 3 runs each).

Pure standard library and numpy.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

__all__ = ["HUGE_PAGE_BYTES", "plain_empty"]

#: an anonymous private mapping, faulted in when it is made where the platform can (Linux); None: the platform's
#: default mapping (Windows)
_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)) \
    if hasattr(mmap, "MAP_ANONYMOUS") else None
#: NumPy asks for huge pages on arrays of this size or more (``numpy/_core/src/multiarray/alloc.c``)
HUGE_PAGE_BYTES = 4 << 20


def plain_empty(shape: tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
    """An array of ``shape`` (C order, zeros) in an anonymous mapping of its own, faulted in when made (where the
    platform can) and freed with the array."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    size = max(1, count * dt.itemsize)
    buf = mmap.mmap(-1, size) if _FLAGS is None else mmap.mmap(-1, size, flags=_FLAGS)
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)

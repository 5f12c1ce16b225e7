"""Large arrays in plain pages (4 KiB), faulted in a range at a time, without NumPy's huge-page advice.

NumPy advises the kernel to back arrays of 4 MB and more (:data:`HUGE_PAGE_BYTES`) with transparent huge pages. On a
kernel whose THP defrag setting is ``madvise`` (as on the development box), that advice makes each first touch
compact memory for a 2 MB page: filling a fresh 283 MB matrix (the strata's per-turn sums at 20M tokens) took 0.70 s there, 0.67 s of it in
the kernel, against 0.17 s in plain pages, with no difference in the bootstrap's products that read it afterwards
(2.26 vs 2.27 ns per resample and turn). An anonymous mapping of its own, which NumPy never advises, gets plain
pages wherever THP is not ``always``; where it is, nothing changes. In the development box's virtual machine each
page's first touch is a trap of its own: the strata's 60 batch copies into a fresh 300 MB matrix took 0.22 s so,
against 0.13 s with the mapping populated when made (``MAP_POPULATE``, Linux; the mapping included, /tmp script, 3
runs each). An array written whole is populated so; one sized from an estimate or a bound (the strata's reserved
matrix, the first pass's sample) is faulted in a batch's part at a time, one ``MADV_POPULATE_WRITE`` call per row
(:func:`prefault`), so that capacity never written costs nothing: the 20M-token stream's copies into the matrix took
0.19-0.20 s against 0.39-0.46 s one page at a time.

Pure standard library and numpy.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np

__all__ = ["HUGE_PAGE_BYTES", "plain_empty", "prefault"]

#: an anonymous private mapping (None: the platform's default mapping, as on Windows), and the flag that faults it in
#: when it is made (Linux)
_FLAGS = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if hasattr(mmap, "MAP_ANONYMOUS") else None
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: Linux's MADV_POPULATE_WRITE (5.14 and later; Python's mmap module does not name it): fault a range in, writable,
#: in one call; set to None once the kernel refuses it
_MADV_POPULATE_WRITE: int | None = 23 if sys.platform.startswith("linux") else None
#: NumPy asks for huge pages on arrays of this size or more (``numpy/_core/src/multiarray/alloc.c``)
HUGE_PAGE_BYTES = 4 << 20


def plain_empty(shape: tuple[int, ...], dtype: Any = np.float64, *, populate: bool = True) -> np.ndarray:
    """An array of ``shape`` (C order, zeros) in an anonymous mapping of its own, freed with the array.

    ``populate``: faulted in when made (where the platform can), for an array written whole; otherwise each page at
    its first touch, or a range at a time by :func:`prefault` (an array sized from an estimate)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    size = max(1, count * dt.itemsize)
    buf = mmap.mmap(-1, size) if _FLAGS is None else mmap.mmap(-1, size, flags=_FLAGS | (_POPULATE if populate else 0))
    return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)


def prefault(view: np.ndarray) -> None:
    """Fault in the pages under each row of ``view`` (a 1-D or 2-D slice of a :func:`plain_empty` array), one call
    per row, before they are written; nothing where the kernel or platform cannot (the writes then fault them in)."""
    global _MADV_POPULATE_WRITE
    if view.ndim == 1:
        view = view[None, :]
    if _MADV_POPULATE_WRITE is None or view.ndim != 2 or not view.size or view.strides[1] != view.itemsize:
        return
    base: Any = view
    while isinstance(base, np.ndarray):
        base = base.base
    mapping = base.obj if isinstance(base, memoryview) else base
    if not isinstance(mapping, mmap.mmap):
        return
    start = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
    row_bytes = view.shape[1] * view.itemsize
    try:
        for r in range(view.shape[0]):
            at = view[r].ctypes.data - start
            first = at - at % mmap.PAGESIZE
            mapping.madvise(_MADV_POPULATE_WRITE, first, at + row_bytes - first)
    except OSError:  # a kernel before 5.14
        _MADV_POPULATE_WRITE = None

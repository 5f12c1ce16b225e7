"""stats/pages.py: big arrays in plain pages, faulted in when mapped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.stats import pages
from icsd_audit.stats.pages import plain_empty


@pytest.mark.parametrize("shape,dtype", [((0,), np.float64), ((3, 4), np.float32), ((5,), np.int64)])
def test_plain_empty_is_a_writable_zero_array(shape, dtype):
    a = plain_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    a[...] = 7
    assert (a == 7).all()


def _mapping(address: int) -> dict[str, int]:
    """The kB fields of the /proc/self/smaps entry holding ``address``."""
    entry: dict[str, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = {} if lo <= address < hi else None
        elif entry is not None and line.endswith(" kB"):
            entry[head.rstrip(":")] = int(line.split()[1])
        elif entry is not None and entry and head == "VmFlags:":
            return entry
    raise AssertionError("no mapping holds the array")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_POPULATE and /proc/self/smaps are Linux's")
def test_plain_empty_is_resident_when_made_and_not_in_huge_pages():
    """Faulted in by the mapping itself (no page is touched here), in plain pages: no huge-page advice."""
    a = plain_empty((8 << 20,), np.uint8)
    fields = _mapping(a.ctypes.data)
    assert fields["Rss"] >= 8 << 10  # every page resident
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" not in thp.read_text():
        assert fields.get("AnonHugePages", 0) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and /proc/self/smaps are Linux's")
def test_prefault_brings_in_the_rows_written_and_nothing_else():
    """A lazy array (sized from an estimate) is resident only where prefaulted: 4 of its 64 rows, 3 pages each (the
    row's slice starts mid-page), and 2 pages of a 1-D one; other arrays are left alone.  Resident memory is read as
    a change of the mapping's Rss: the kernel may merge a new mapping with a neighbour's."""
    if tuple(int(x) for x in os.uname().release.split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE came with Linux 5.14")
    page = 4096
    a = plain_empty((64, 64 * page // 8), np.float64, populate=False)  # rows of 64 pages

    def rss(x: np.ndarray) -> int:
        return _mapping(x.ctypes.data)["Rss"]

    before = rss(a)
    pages.prefault(a[10:14, 100:100 + 2 * page // 8])  # 2 pages of values from 800 bytes into a page: 3 pages a row
    assert rss(a) - before == 4 * 3 * page // 1024
    assert not a[10:14].any()
    b = plain_empty((16 * page // 4,), np.float32, populate=False)  # a 1-D array: one row
    before = rss(b)
    pages.prefault(b[page // 4 : 3 * page // 4])  # exactly pages 1 and 2
    assert rss(b) - before == 2 * page // 1024
    before = rss(a)
    pages.prefault(np.zeros((3, 4)))  # not a mapping of ours: nothing
    pages.prefault(a[:, ::2])  # not row-contiguous: nothing
    assert rss(a) == before

"""Forked bootstrap workers: same blocks, same bits, failures reported, children always reaped."""

from __future__ import annotations

import os

import numpy as np
import pytest

from icsd_audit.stats.engine.forked import ForkedBlocks, fork_available
from icsd_audit.stats.engine.resample import BLOCK, resampled_sums

pytestmark = pytest.mark.skipif(not fork_available(), reason="forked workers run on Linux only")


def _block(b: int) -> np.ndarray:
    # depends on b only, like the engine's blocks (each seeded from its own number)
    return np.random.default_rng(b).random((BLOCK, 3, 2))


def _children_left() -> bool:
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return False
    return True


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_every_block_once_in_order(workers: int) -> None:
    n = 37
    with ForkedBlocks(_block, n, workers, shape=(BLOCK, 3, 2)) as fb:
        got = fb.take(range(0, 10)) + fb.take(range(10, 11)) + fb.take(range(11, n))
    assert len(got) == n
    for b, a in enumerate(got):
        assert np.array_equal(a, _block(b)), b
    assert not _children_left()


def test_resampled_sums_identical_for_every_worker_count() -> None:
    rng = np.random.default_rng(5)
    sizes = [700, 40, 1300, 9, 600]  # several strata and two groups (narrow and wide paths)
    sums = rng.normal(size=(sum(sizes), 3))
    sums[rng.random(sum(sizes)) < 0.3] = 0.0  # all-zero clusters: the Binomial path
    groups = [0, 0, 1, 1, 1]
    runs = [np.concatenate([T for _, _, T in resampled_sums(sums, sizes, groups, 2, 1000, rng=7, workers=w,
                                                              chunk_size=c)])
            for w, c in ((1, None), (2, None), (3, 64), (4, 10_000))]
    for r in runs[1:]:
        assert np.array_equal(r, runs[0])


def test_a_failing_child_is_an_error_not_a_hang() -> None:
    import multiprocessing

    parent = os.getpid()
    child_failed = multiprocessing.get_context("fork").Event()  # shared with the forked workers

    def block(b: int) -> np.ndarray:
        if os.getpid() != parent:
            child_failed.set()
            raise MemoryError("child out of memory")
        # the parent waits for a child to take (and fail on) a block, so it cannot drain the queue alone
        child_failed.wait(timeout=60)
        return _block(b)

    with pytest.raises(RuntimeError, match="bootstrap worker process"):
        with ForkedBlocks(block, 60, 2, shape=(BLOCK, 3, 2)) as fb:
            for b0 in range(0, 60, 20):
                fb.take(range(b0, b0 + 20))
    assert not _children_left()


def test_leaving_early_kills_and_reaps_the_children() -> None:
    gen = resampled_sums(np.ones((5000, 2)), [5000], [0], 1, 50_000, rng=1, workers=3, chunk_size=BLOCK)
    next(gen)
    gen.close()  # the consumer stops after one chunk
    assert not _children_left()


def test_a_queue_longer_than_a_pipe_falls_back_to_threads() -> None:
    assert fork_available(1000) and not fork_available(10**7)

"""Two processes publishing the same new report folder at the same instant (issue 21).

Both see no folder and rename their complete set into place; the second rename used to
fail with ``Directory not empty`` (about 1 in 100; here in most rounds, the window between
the check and the rename being widened by 2 ms).  Now the later one swaps its set
over the earlier one, as a second run into an existing report folder does: each
publisher succeeds, the folder holds exactly one publisher's set, and no temporary is
left.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from icsd_audit import outputs

ROUNDS = 60
FILES = ("summary.json", "summary.md", "figures/a.png")


def _owned(rel: str) -> bool:
    return rel in FILES


def _publisher(tag: str, root: str, barrier: "mp.synchronize.Barrier", errors: "mp.Queue", exchange: bool) -> None:
    import time

    if not exchange:
        outputs.exchange_paths = lambda a, b: False  # a file system without renameat2's RENAME_EXCHANGE
    lexists = os.path.lexists

    def slow_lexists(path: object) -> bool:  # widen the window between "no folder yet" and the rename
        found = lexists(path)
        if not found:
            time.sleep(0.002)
        return found

    os.path.lexists = slow_lexists  # (a forked child: the parent's os.path is untouched)
    failed = []
    for r in range(ROUNDS):
        barrier.wait()
        try:
            outputs.publish_directory(Path(root) / f"r{r:03d}", {f: f"{tag} {r} {f}".encode() for f in FILES},
                                      owned=_owned)
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the parent
            failed.append(f"round {r}: {type(exc).__name__}: {exc}")
    errors.put((tag, failed))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to start the publishers at one instant")
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_concurrent_publishers_of_one_new_folder(tmp_path: Path, exchange: bool) -> None:
    ctx = mp.get_context("fork")
    barrier, errors = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_publisher, args=(tag, str(tmp_path), barrier, errors, exchange)) for tag in "AB"]
    for p in procs:
        p.start()
    results = dict(errors.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert results == {"A": [], "B": []}
    for r in range(ROUNDS):
        d = tmp_path / f"r{r:03d}"
        got = {f: (d / f).read_bytes() for f in FILES}
        tags = {v.split()[0] for v in got.values()}
        assert len(tags) == 1, got
        tag = tags.pop().decode()
        assert got == {f: f"{tag} {r} {f}".encode() for f in FILES}  # one publisher's whole set
        assert sorted(str(p.relative_to(d)) for p in d.rglob("*")) == ["figures", *sorted(FILES)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"r{r:03d}" for r in range(ROUNDS)]  # no temporaries

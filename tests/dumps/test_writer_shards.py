"""A dump writer never replaces a shard: two processes, two ranks, restarts, explicit names."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from icsd_audit.dumps.reader import DumpReader
from icsd_audit.dumps.writer import DumpWriter

WORKER = r"""
import sys, time
from pathlib import Path
import numpy as np
from icsd_audit.dumps.writer import DumpWriter
out, who, n, rank = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
w = DumpWriter(out, producer="race", rank=None if rank == "none" else int(rank))
(out.parent / f"ready-{who}").touch()
while not (out.parent / "go").exists():
    time.sleep(0.01)
for i in range(n):
    b = 1000 * who + i
    w.write(batch_id=np.full(3, b), traj_id=np.arange(3), turn_id=np.zeros(3, int),
            advantage=np.full(3, float(b)), ratio=np.ones(3), delta=np.ones(3))
"""


def _batch(b: int) -> dict[str, np.ndarray]:
    return dict(batch_id=np.full(2, b), traj_id=np.arange(2), turn_id=np.zeros(2, int), advantage=np.ones(2),
                ratio=np.ones(2), delta=np.ones(2))


def _race(tmp_path: Path, ranks: tuple[str, str], n: int = 6) -> set[int]:
    out = tmp_path / "dumps"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(out), str(who), str(n), ranks[who]])
             for who in (0, 1)]
    deadline = time.time() + 120
    while not all((tmp_path / f"ready-{who}").exists() for who in (0, 1)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "writer processes did not start"
        time.sleep(0.02)
    (tmp_path / "go").touch()  # both writers exist before either writes
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    return set(DumpReader([out]).batch_ids)


def test_two_writer_processes_on_one_directory_keep_every_batch(tmp_path: Path) -> None:
    want = {1000 * who + i for who in (0, 1) for i in range(6)}
    assert _race(tmp_path, ("none", "none")) == want
    assert len(list((tmp_path / "dumps").glob("*.parquet"))) == 12


def test_two_ranks_and_even_a_repeated_rank_keep_every_batch(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = {1000 * who + i for who in (0, 1) for i in range(6)}
    assert _race(tmp_path / "a", ("0", "1")) == want
    names = sorted(p.name for p in (tmp_path / "a" / "dumps").glob("*.parquet"))
    assert sum("-r00000" in n for n in names) == 6 and sum("-r00001" in n for n in names) == 6
    # a misconfigured launcher giving both processes rank 0 still loses nothing
    assert _race(tmp_path / "b", ("0", "0")) == want


def test_restarted_writer_after_a_deleted_shard_overwrites_nothing(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, producer="t")
    paths = [w.write(**_batch(b)) for b in range(3)]
    paths[0].unlink()  # e.g. a user removed a bad shard
    w2 = DumpWriter(tmp_path, producer="t")
    new = w2.write(**_batch(99))
    assert new not in paths
    assert set(DumpReader([tmp_path]).batch_ids) == {1, 2, 99}
    # sorted names stay chronological: the restarted writer's shard sorts last
    assert sorted(tmp_path.glob("*.parquet"))[-1] == new


def test_rank_is_in_the_name_and_explicit_names_are_never_replaced(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, producer="t", rank=3)
    assert w.write(**_batch(0)).name == "part-000000-r00003.parquet"
    p = w.write(**_batch(1), name="fixed.parquet")
    with pytest.raises(FileExistsError, match="fixed.parquet"):
        w.write(**_batch(2), name="fixed.parquet")
    assert pq.read_table(p).column("batch_id").to_pylist() == [1, 1]
    assert not [q for q in tmp_path.iterdir() if q.name.endswith(".tmp")]
    with pytest.raises(ValueError, match="rank"):
        DumpWriter(tmp_path, producer="t", rank=-1)

"""Steps commit whole, uncommitted steps are skipped with one warning, and resuming into a dump folder keeps it auditable."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.dumps.reader import DumpReader, DumpWarning
from icsd_audit.dumps.writer import DumpWriter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _batch(b: int, value: float = 1.0, n: int = 3) -> dict[str, np.ndarray]:
    return dict(batch_id=np.full(n, b), traj_id=np.arange(n), turn_id=np.zeros(n, int), advantage=np.full(n, value),
                ratio=np.ones(n), delta=np.ones(n))


def _read(paths: list[Path]) -> dict[int, float]:
    """batch id -> the advantage its rows carry (each test batch holds one value)."""
    out = {}
    for b in DumpReader(paths):
        assert len(set(b.tokens.advantage.tolist())) == 1
        out[b.batch_id] = float(b.tokens.advantage[0])
    return out


def test_a_steps_shards_appear_together(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path, producer="t")
    step = w.step(3)
    inside = [w.write(**_batch(3000 + k)) for k in range(2)]
    assert all(p.parent == step.staged and p.parent.name.startswith(".step000003.icsd-step-") for p in inside)
    with pytest.warns(DumpWarning, match=r"uncommitted step000003"):
        with pytest.raises(Exception, match="holds no"):  # the staged shards are invisible
            DumpReader([tmp_path])
    assert step.commit() == tmp_path / "step000003"
    assert sorted(p.name for p in (tmp_path / "step000003").iterdir()) == sorted(p.name for p in inside)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _read([tmp_path]) == {3000: 1.0, 3001: 1.0}
    # a step that raises is discarded whole; one written again replaces the committed one
    with pytest.raises(RuntimeError):
        with w.step(4):
            w.write(**_batch(4000))
            raise RuntimeError("crash mid-step")
    with w.step(3):
        w.write(**_batch(3000, value=2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step000003"]
    assert _read([tmp_path]) == {3000: 2.0}
    assert DumpWriter(tmp_path, producer="t", rank=2).step(5).target.name == "step000005-r00002"


def test_a_killed_writers_staged_step_is_skipped_then_removed(tmp_path: Path) -> None:
    code = ("import sys, numpy as np; from icsd_audit.dumps.writer import DumpWriter\n"
            "w = DumpWriter(sys.argv[1], producer='t'); w.step(7)\n"
            "w.write(batch_id=np.full(2, 7), traj_id=np.arange(2), turn_id=np.zeros(2, int), advantage=np.ones(2), "
            "ratio=np.ones(2), delta=np.ones(2))\n")
    DumpWriter(tmp_path, producer="t").write(**_batch(1))
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)  # exits without committing
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".step000007.")]
    assert len(staged) == 1 and list(staged[0].glob("*.parquet"))
    with pytest.warns(DumpWarning) as seen:
        assert _read([tmp_path]) == {1: 1.0}
    lines = [str(x.message) for x in seen]
    assert len(lines) == 1 and lines[0].startswith(f"{staged[0]}: uncommitted step000007")
    DumpWriter(tmp_path, producer="t")  # the next writer in the folder removes what a dead process staged
    assert not staged[0].exists()


def test_resuming_into_a_dump_folder_keeps_it_auditable(tmp_path: Path) -> None:
    """A restarted trainer (TRL, verl, the verl-agent drop-in) writes batches 2 and 3 again: the latest write counts."""
    first = DumpWriter(tmp_path, producer="t", rank=0)
    for b in range(4):
        first.write(**_batch(b, value=1.0))
    other_rank = DumpWriter(tmp_path, producer="t", rank=1)
    other_rank.write(**_batch(100, value=7.0))
    resumed = DumpWriter(tmp_path, producer="t", rank=0)  # a new launch: a new session
    for b in (2, 3, 4):
        resumed.write(**_batch(b, value=2.0))
    with pytest.warns(DumpWarning) as seen:
        got = _read([tmp_path])
    assert got == {0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0, 100: 7.0}
    lines = [str(x.message) for x in seen]
    assert len(lines) == 1 and "part-000002-r00000.parquet: batch(es) 2 written again later" in lines[0]
    assert "part-000005-r00000.parquet" in lines[0] and "(1 more shard(s) likewise)" in lines[0]
    # the audit recomputes over exactly those batches, from the command line too
    from typer.testing import CliRunner

    from icsd_audit.cli.main import app

    res = CliRunner().invoke(app, ["audit", "tcm", str(tmp_path), "--json", "--resamples", "10"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["n_batches"] == 6 and out["n_tokens"] == 18


def test_a_batch_split_by_one_writer_or_by_two_ranks_is_read_whole(tmp_path: Path) -> None:
    w = DumpWriter(tmp_path / "one", producer="t")
    w.write(**_batch(5))
    w.write(**{**_batch(5), "traj_id": np.arange(3, 6)})  # the same session: one batch in two shards
    r0, r1 = (DumpWriter(tmp_path / "ranks", producer="t", rank=r) for r in (0, 1))
    r0.write(**_batch(6))
    r1.write(**{**_batch(6), "traj_id": np.arange(3, 6)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [b.n_rows for b in DumpReader([tmp_path / "one"])] == [6]
        assert [b.n_rows for b in DumpReader([tmp_path / "ranks"])] == [6]


def test_example_folders_read_without_a_warning() -> None:
    folders = [EXAMPLES / "cpu-demo" / "dumps", EXAMPLES / "alfworld-cpu-demo" / "dumps", EXAMPLES / "synthetic"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for f in folders:
            assert sum(b.n_rows for b in DumpReader([f])) > 0

"""remove_stale (run before every staged dump step): it deletes exactly the temporaries of dead local processes."""

from __future__ import annotations

import os
import subprocess
import sys

from icsd_audit.outputs import remove_stale, temp_prefix


def test_only_a_dead_local_processs_temporaries_are_removed(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    mine = temp_prefix(tmp_path / "step000001", "step")  # .step000001.icsd-step-HOST-PID-
    dead = mine.replace(f"-{os.getpid()}-", f"-{proc.pid}-")
    alive = mine.replace(f"-{os.getpid()}-", f"-{os.getppid()}-")
    other_host = mine.replace("-step-", "-step-elsewhere", 1)
    (tmp_path / f"{dead}dir").mkdir()
    (tmp_path / f"{dead}dir" / "part.parquet").write_bytes(b"x")
    (tmp_path / f"{dead}file").write_bytes(b"x")
    kept = [f"{mine}own", f"{alive}parent", f"{other_host}x", "step000001-r00000", ".hidden", f"{dead}"[1:] + "x"]
    for name in kept:
        (tmp_path / name).mkdir()
    removed = remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted([f"{dead}dir", f"{dead}file"])
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert remove_stale(tmp_path / "missing") == []

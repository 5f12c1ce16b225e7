"""Run folders on an object store (``memory://`` here; S3 in tests/dumps/test_object_store.py): found, read and their
dumps audited as the same folders on disk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.runs.curves import dump_series
from icsd_audit.runs.folders import find_runs, load_run, load_runs
from icsd_audit.runs.jsonl import MAX_LINE_BYTES, RunError

fsspec = pytest.importorskip("fsspec")

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo"


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, str]:
    """A folder of runs on disk and its copy on a memory store: runs at two depths, one inside a hidden folder,
    one below another run's dumps/ (neither is a run of the tree), and a folder without runs."""
    root = tmp_path / "runs"
    shutil.copytree(DEMO, root / "b-run", ignore=shutil.ignore_patterns("report", "*.md"))
    for rel in ("a/x", "a-b", ".hidden/y", "b-run/dumps/z"):
        (root / rel).mkdir(parents=True)
        (root / rel / "metrics.jsonl").write_text('{"step": 0, "m": 1.5}\n{"step": 1, "m": 2.5}\n')
    (root / "a" / "x" / "config.json").write_text(json.dumps({"allocator": "none", "seed": 3}))
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("no run here")
    fs = fsspec.filesystem("memory")
    name = f"/runs-{tmp_path.name}"
    fs.put(str(root), name, recursive=True)
    return root, f"memory:/{name}"


def test_runs_on_a_store_are_found_and_read_as_on_disk(tree: tuple[Path, str]) -> None:
    root, url = tree
    on_disk, left_disk = find_runs([root])
    on_store, left_store = find_runs([url])
    assert [str(p) for p in on_disk] == [str(root / r) for r in ("a/x", "a-b", "b-run")]  # walk order, not into runs
    assert on_store == [str(p).replace(str(root), url) for p in on_disk] and left_store == left_disk == []
    for p, u in zip(on_disk, on_store):
        a, b = load_run(p), load_run(u)
        assert b.path == u and b.name == u and b.config == a.config and b.manifest == a.manifest
        assert np.array_equal(b.steps, a.steps) and b.keys == a.keys
        assert all(np.array_equal(b.columns[k], a.columns[k], equal_nan=True) for k in a.keys)
    assert load_run(on_store[0]).config == {"allocator": "none", "seed": 3}
    _, left = find_runs([f"{url}/notes"])
    assert left == [(f"{url}/notes", "not a run folder: no run.json, metrics.jsonl, config.json in it or below it")]
    _, left = find_runs([f"{url}/notes/readme.txt"])
    assert left == [(f"{url}/notes/readme.txt", "not a run folder (a file)")]
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        find_runs([f"{url}/nothing"])


def test_dumps_of_a_run_on_a_store_are_audited_as_on_disk(tree: tuple[Path, str]) -> None:
    root, url = tree
    (run_disk,), _ = load_runs([root / "b-run"])
    (run_store,), _ = load_runs([f"{url}/b-run"])
    a, b = dump_series(run_disk), dump_series(run_store)
    assert a and b.keys() == a.keys()
    for k in a:
        assert np.array_equal(b[k].steps, a[k].steps) and np.array_equal(b[k].values, a[k].values), k
    assert dump_series(load_run(f"{url}/a-b")) == {}  # no dumps/ there


def test_a_line_over_the_limit_on_a_store_is_refused(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import icsd_audit.runs.jsonl as J

    monkeypatch.setattr(J, "MAX_LINE_BYTES", 64)
    fs = fsspec.filesystem("memory")
    name = f"/long-{tmp_path.name}/run"
    fs.pipe_file(f"{name}/metrics.jsonl", b'{"step": 0, "m": 1}\n{"step": 1, "m": "' + b"x" * 200 + b'"}\n')
    with pytest.raises(RunError, match=r"memory://.*/metrics.jsonl: line 2 is longer than 64 bytes"):
        load_run(f"memory:/{name}")
    assert MAX_LINE_BYTES > 64


def test_an_out_url_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers import one_line_exit_2
    from tests.helpers import cli

    monkeypatch.chdir(tmp_path)
    res = cli("compare", str(DEMO), "--metric", "rollout/reward", "--out", "s3://bucket/cmp")
    one_line_exit_2(res, "s3://bucket/cmp: --out takes a local folder")
    assert list(tmp_path.iterdir()) == []  # no local folder named s3:

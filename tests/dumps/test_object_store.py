"""Dumps on object storage: a real S3 endpoint (moto's standalone server, as s3fs's own tests use) and memory://.

The server listens on 127.0.0.1 and a free port; credentials are dummies and the EC2
metadata service is off, so nothing here reaches beyond this machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from icsd_audit.dumps.reader import DumpError, DumpReader, DumpWarning, resolve_paths
from icsd_audit.dumps.store import StoreFile, committed, marker_name, put_new
from icsd_audit.dumps.writer import DumpWriter
from tests.helpers import cli

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BUCKET = "icsd-test"
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    """An S3 endpoint on loopback with one empty bucket; the environment points every client at it."""
    import s3fs
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _batch(b: int, value: float = 1.0, n: int = 4) -> dict[str, np.ndarray]:
    return dict(batch_id=np.full(n, b), traj_id=np.arange(n) // 2, turn_id=np.zeros(n, int), advantage=np.full(n, value),
                ratio=np.ones(n), delta=np.linspace(-1.0, 1.0, n))


def _read(paths: list) -> dict[int, float]:
    return {b.batch_id: float(b.tokens.advantage[0]) for b in DumpReader(paths)}


def test_tcm_of_dumps_on_s3_is_byte_identical_to_the_local_run(s3: object) -> None:
    local = EXAMPLES / "cpu-demo" / "dumps"
    s3.put(str(local), f"{BUCKET}/cpu-demo/dumps", recursive=True)  # type: ignore[attr-defined]
    url = f"s3://{BUCKET}/cpu-demo/dumps"
    files = resolve_paths([url])
    assert [f.url for f in files] == [f"{url}/{p.relative_to(local).as_posix()}" for p in resolve_paths([local])]
    a = cli("audit", "tcm", str(local), "--json", "--resamples", "1000")
    b = cli("audit", "tcm", url, "--json", "--resamples", "1000")
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    assert b.stdout == a.stdout
    json.loads(b.stdout)  # pure JSON on stdout


def test_verify_and_coeffs_read_a_bucket(s3: object, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/cpu-demo/dumps"
    if not s3.exists(f"{BUCKET}/cpu-demo/dumps"):  # type: ignore[attr-defined]
        s3.put(str(EXAMPLES / "cpu-demo" / "dumps"), f"{BUCKET}/cpu-demo/dumps", recursive=True)  # type: ignore[attr-defined]
    local = EXAMPLES / "cpu-demo" / "dumps"
    a, b = cli("audit", "verify", str(local), "--json"), cli("audit", "verify", url, "--json")
    assert b.returncode == 0, b.stderr
    assert url in b.stdout and b.stdout.replace(url, str(local)) == a.stdout  # the same, files named by URL
    res = cli("audit", "coeffs", url, "--out", str(tmp_path / "c.parquet"))
    assert res.returncode == 0, res.stderr
    ref = cli("audit", "coeffs", str(local), "--out", str(tmp_path / "d.parquet"))
    from icsd_audit.parquet_io import read_table

    ta, tb = read_table(tmp_path / "c.parquet"), read_table(tmp_path / "d.parquet")
    assert ref.returncode == 0 and ta.column_names == tb.column_names
    assert ta.select(["g", "m", "c", "fallback"]).equals(tb.select(["g", "m", "c", "fallback"]))


def test_a_missing_object_is_one_line_exit_2(s3: object) -> None:
    res = cli("audit", "tcm", f"s3://{BUCKET}/no/such/dumps", "--json")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [f"error: s3://{BUCKET}/no/such/dumps: no such file or directory"]


def test_a_step_without_its_commit_marker_is_skipped_with_one_warning(s3: object) -> None:
    url = f"s3://{BUCKET}/run1"
    w = DumpWriter(url, producer="t", rank=0)
    with w.step(0):
        w.write(**_batch(0, 1.0))
        w.write(**_batch(1, 2.0))
    w.step(1)  # written, never committed
    w.write(**_batch(2, 3.0))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = _read([url])
    assert got == {0: 1.0, 1: 2.0}
    msgs = [str(r.message) for r in rec if issubclass(r.category, DumpWarning)]
    assert len(msgs) == 1 and "step000001-r00000" in msgs[0] and "uncommitted" in msgs[0]
    # the CLI: one warning line, and the numbers of the committed step alone
    ref = DumpWriter(f"s3://{BUCKET}/run1-committed", producer="t", rank=0)
    with ref.step(0):
        ref.write(**_batch(0, 1.0))
        ref.write(**_batch(1, 2.0))
    a = cli("audit", "clip", url, "--json", "--resamples", "200")
    b = cli("audit", "clip", f"s3://{BUCKET}/run1-committed", "--json", "--resamples", "200")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    assert sum("uncommitted" in line for line in a.stderr.splitlines()) == 1


def test_a_writer_killed_mid_step_leaves_nothing_a_reader_takes(s3: object) -> None:
    url = f"s3://{BUCKET}/killed"
    script = textwrap.dedent(f"""
        import os, numpy as np
        from icsd_audit.dumps.writer import DumpWriter
        w = DumpWriter({url!r}, producer="t", rank=3)
        with w.step(0):
            w.write(batch_id=np.zeros(4, int), traj_id=np.arange(4), turn_id=np.zeros(4, int), advantage=np.ones(4),
                    ratio=np.ones(4), delta=np.ones(4))
        w.step(1)
        for b in (1, 2):
            w.write(batch_id=np.full(4, b), traj_id=np.arange(4), turn_id=np.zeros(4, int), advantage=np.ones(4),
                    ratio=np.ones(4), delta=np.ones(4))
        os._exit(9)  # dies mid-step: no commit, no clean-up
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 9, res.stderr
    names = sorted(p.rsplit("/", 1)[-1] for p in s3.find(f"{BUCKET}/killed"))  # type: ignore[attr-defined]
    assert sum(n.endswith(".parquet") for n in names) == 3  # the shards are in the store ...
    with pytest.warns(DumpWarning, match=r"uncommitted step shard .*1 more shard"):
        assert _read([url]) == {0: 1.0}  # ... but no reader takes the uncommitted two


def test_writers_never_replace_each_others_objects(s3: object) -> None:
    url = f"s3://{BUCKET}/shared"
    a, b = DumpWriter(url, producer="t", rank=0), DumpWriter(url, producer="t", rank=0)  # same rank, same folder
    pa_, pb = a.write(**_batch(0, 1.0)), b.write(**_batch(1, 2.0))
    assert pa_ != pb
    assert _read([url]) == {0: 1.0, 1: 2.0}
    fs = s3
    with pytest.raises(FileExistsError):
        put_new(fs, pa_[len("s3://"):], b"x", pa_)
    with pytest.raises(FileExistsError):
        a.write(**_batch(5, 5.0), name=pa_.rsplit("/", 1)[-1])
    assert _read([url]) == {0: 1.0, 1: 2.0}


def test_memory_store_round_trip_and_resumed_step() -> None:
    import fsspec

    fsspec.filesystem("memory").rm("/mem-test", recursive=True) if fsspec.filesystem("memory").exists("/mem-test") else None
    url = "memory://mem-test/dumps"
    first = DumpWriter(url, producer="t", rank=1)
    with first.step(0):
        first.write(**_batch(0, 1.0))
        first.write(**_batch(1, 1.0))
    again = DumpWriter(url, producer="t", rank=1)  # a resumed run redoing step 0
    with again.step(0):
        again.write(**_batch(1, 7.0))
    with pytest.warns(DumpWarning, match="written again later"):
        got = _read([url])
    assert got == {0: 1.0, 1: 7.0}
    files = resolve_paths([url])
    assert all(isinstance(f, StoreFile) and f.url.startswith(url + "/step000000-r00001/") for f in files)
    with pytest.raises(DumpError, match="given twice"):
        resolve_paths([url, files[0].url])


def test_committed_takes_only_what_a_marker_lists() -> None:
    s = "0123456789abcdef"
    names = [f"part-000000-s{s}-r00000.parquet", f"part-000001-s{s}-r00000.parquet", marker_name(s), "plain.parquet",
             "part-000002-sfedcba9876543210-r00000.parquet"]
    keep, left = committed(names, lambda m: [names[0]])
    assert keep == [names[0], "plain.parquet"]
    assert left == [names[1], names[4]]


def test_a_local_copy_of_a_bucket_reads_the_same(tmp_path: Path) -> None:
    """The marker rule holds on disk too: a bucket synced to a local folder gives the same batches."""
    url = "memory://mem-copy/dumps"
    w = DumpWriter(url, producer="t", rank=0)
    with w.step(0):
        w.write(**_batch(0, 1.0))
    w.step(1)
    w.write(**_batch(1, 2.0))
    import fsspec

    fsspec.filesystem("memory").get("/mem-copy/dumps", str(tmp_path / "dumps"), recursive=True)
    with pytest.warns(DumpWarning, match="uncommitted step shard"):
        assert _read([tmp_path / "dumps"]) == {0: 1.0}


def _run_tree(root: Path) -> Path:
    """Two copies of the cpu-demo run folder (dumps and metrics), seeds 0 and 1, one below a sub-folder."""
    import shutil

    for rel, seed in (("icsd-0", 0), ("more/icsd-1", 1)):
        dst = shutil.copytree(EXAMPLES / "cpu-demo", root / rel, ignore=shutil.ignore_patterns("report", "*.md"))
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "seed": seed}))
    return root


def test_compare_of_run_folders_on_s3_with_their_dumps_is_the_local_output(s3: object, tmp_path: Path) -> None:
    local = _run_tree(tmp_path / "runs")
    s3.put(str(local), f"{BUCKET}/sweep/runs", recursive=True)  # type: ignore[attr-defined]
    url = f"s3://{BUCKET}/sweep/runs"
    args = ("--metric", "rollout/reward", "--last", "2", "--dumps", "--json", "--resamples", "200")
    a, b = cli("compare", str(local), *args), cli("compare", url, *args)
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    assert f"{url}/more/icsd-1" in b.stdout and b.stdout.replace(url, str(local)) == a.stdout
    from icsd_audit.runs.curves import dump_series
    from icsd_audit.runs.folders import load_run

    on_s3, on_disk = dump_series(load_run(f"{url}/icsd-0")), dump_series(load_run(local / "icsd-0"))
    assert on_s3 and on_s3.keys() == on_disk.keys()  # the mechanism curves were recomputed from the bucket's dumps
    assert all(np.array_equal(on_s3[k].values, on_disk[k].values) for k in on_disk)
    # a location that holds nothing: one line, exit 2
    res = cli("compare", f"s3://{BUCKET}/sweep/none", "--metric", "rollout/reward")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: s3://{BUCKET}/sweep/none: no such file or directory"]


@pytest.mark.slow
def test_ray_workers_read_the_bucket_and_print_the_local_bytes(s3: object) -> None:
    """``--backend ray`` on a URL: every worker resolves it with the store's environment (a private local cluster
    inherits the driver's), for the map and the strata's map alike."""
    pytest.importorskip("ray")
    local = EXAMPLES / "cpu-demo" / "dumps"
    if not s3.exists(f"{BUCKET}/cpu-demo/dumps"):  # type: ignore[attr-defined]
        s3.put(str(local), f"{BUCKET}/cpu-demo/dumps", recursive=True)  # type: ignore[attr-defined]
    url = f"s3://{BUCKET}/cpu-demo/dumps"
    for args in (["tcm"], ["strata", "--by", "logp", "--bins", "4"]):
        a = cli("audit", *args, str(local), "--json", "--resamples", "300", threads=2)
        b = cli("audit", *args, url, "--json", "--resamples", "300", "--backend", "ray", threads=2)
        assert a.returncode == 0 and b.returncode == 0, b.stderr
        assert b.stdout == a.stdout, args

"""Dump writer, streaming reader, validation errors and the coeffs CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from icsd_audit.alloc.variants import allocate
from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.audit.coeffs import compute_coefficients
from icsd_audit.dumps.writer import DumpWriter, write_table_atomic
from icsd_audit.dumps.reader import DumpError, DumpReader, read_metadata
from icsd_audit.dumps.synth import synth_tokens

torch.set_num_threads(1)


def write_synth(tmp: Path, n: int = 5000, batches: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    cols = synth_tokens(n, seed=seed, n_batches=batches)
    w = DumpWriter(tmp, producer="test", synthetic=True, row_group_size=700)
    for b in np.unique(cols["batch_id"]):
        sel = cols["batch_id"] == b
        w.write(**{k: v[sel] for k, v in cols.items()})
    return cols


def test_writer_padded_input_matches_flat(tmp_path: Path) -> None:
    # Two rows, response mask picks 3 + 2 tokens; per-row ids broadcast, pos counts masked slots.
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 0, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[9, 1, 1, 1, 9], [-2, 9, -2, 9, 9]], dtype=torch.float32)
    w = DumpWriter(tmp_path, producer="t", allocator={"allocator": "icsd"})
    path = w.write(batch_id=torch.tensor([5, 5]), traj_id=torch.tensor([1, 0]), turn_id=torch.tensor([0, 3]),
                   advantage=adv, ratio=torch.ones_like(adv), delta=adv * 0.5, mask=mask)
    t = pq.read_table(path)
    # Sorted by (batch, traj, turn, pos): trajectory 0 (row 1) first.
    assert t.column("traj_id").to_pylist() == [0, 0, 1, 1, 1]
    assert t.column("pos").to_pylist() == [0, 1, 0, 1, 2]
    assert t.column("advantage").to_pylist() == [-2, -2, 1, 1, 1]
    meta = read_metadata(path)
    assert meta["version"] == 1 and meta["synthetic"] is False
    # SPEC 9: every allocator key present, null where the writer was not told
    assert meta["allocator"] == {"allocator": "icsd", "trust": None, "trust_beta": None, "trust_eta": None,
                                 "influence_eta": None, "eps": None, "min_group": None, "alloc_scope": None,
                                 "ratio_source": None, "seed": None}


def test_reader_streams_each_batch_whole(tmp_path: Path) -> None:
    cols = write_synth(tmp_path)
    reader = DumpReader([tmp_path])
    seen = 0
    for batch in reader:
        want = np.flatnonzero(cols["batch_id"] == batch.batch_id)
        assert batch.n_rows == want.size
        assert np.array_equal(np.sort(batch.tokens.delta), np.sort(cols["delta"][want].astype(np.float64)))
        seen += batch.n_rows
    assert seen == 5000 and len(reader.batch_ids) == 3


def test_column_groups_read_by_threads_come_in_input_order(tmp_path: Path) -> None:
    cols = write_synth(tmp_path, n=9000, batches=5)  # a file per batch, several row groups each
    reader = DumpReader([tmp_path])
    one = list(reader.column_groups(["delta", "valid", "pos"]))
    assert len(reader.paths) == 5 and len(one) > 5
    for workers in (2, 3, 8):
        many = list(reader.column_groups(["delta", "valid", "pos"], workers=workers))
        assert len(many) == len(one) and all(a.equals(b) for a, b in zip(one, many))
    got = np.concatenate([t.column("delta").to_numpy() for t in one])
    order = np.lexsort((cols["pos"], cols["turn_id"], cols["traj_id"], cols["batch_id"]))  # the writer's row order
    assert np.array_equal(got, cols["delta"][order].astype(got.dtype))


def test_reader_handles_batches_split_across_files(tmp_path: Path) -> None:
    cols = synth_tokens(3000, seed=1, n_batches=2)
    half = np.arange(3000) % 2 == 0  # every batch lands in both files, interleaved
    for name, sel in (("a.parquet", half), ("b.parquet", ~half)):
        write_table_atomic(pa.table({k: v[sel] for k, v in cols.items()}), tmp_path / name, row_group_size=500)
    got = {b.batch_id: b.n_rows for b in DumpReader([tmp_path])}
    assert got == {int(b): int((cols["batch_id"] == b).sum()) for b in np.unique(cols["batch_id"])}


def test_coeffs_equal_direct_allocation_in_input_order(tmp_path: Path) -> None:
    cols = synth_tokens(4000, seed=2, n_batches=2)
    rng = np.random.default_rng(0)
    order = rng.permutation(4000)  # input rows deliberately not sorted
    cols = {k: v[order] for k, v in cols.items()}
    cols["valid"] = rng.random(4000) > 0.05
    cols["extra"] = np.arange(4000)
    write_table_atomic(pa.table(cols), tmp_path / "in.parquet", row_group_size=1000)
    compute_coefficients([tmp_path / "in.parquet"], tmp_path / "out.parquet", AllocatorOptions())
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("extra").to_pylist() == list(range(4000))
    ref = allocate(advantage=torch.from_numpy(cols["advantage"].astype(np.float64)),
                   ratio=torch.from_numpy(cols["ratio"].astype(np.float64)),
                   delta=torch.from_numpy(cols["delta"].astype(np.float64)),
                   traj_id=torch.from_numpy(cols["traj_id"]), turn_id=torch.from_numpy(cols["turn_id"]),
                   batch_id=torch.from_numpy(cols["batch_id"]), valid=torch.from_numpy(cols["valid"]))
    for k in ("g", "u", "m", "c"):
        assert out.schema.field(k).type == pa.float64()
        assert np.allclose(out.column(k).to_numpy(), getattr(ref, k).numpy(), rtol=1e-12, atol=0)
    assert np.array_equal(out.column("fallback").to_numpy(zero_copy_only=False), ref.fallback.numpy())


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda c: c.pop("delta"), "column 'delta': required column missing"),
        (lambda c: c.__setitem__("ratio", np.where(np.arange(c["ratio"].size) == 17, np.nan, c["ratio"])), "column 'ratio', row 17: NaN value"),
        (lambda c: c.__setitem__("advantage", np.where(np.arange(c["ratio"].size) == 3, np.inf, c["advantage"])), "column 'advantage', row 3: infinite value"),
        (lambda c: c.__setitem__("turn_id", c["turn_id"].astype(str)), "column 'turn_id': expected an integer type"),
        (lambda c: c.__setitem__("pos", np.zeros_like(c["pos"])), "column 'pos', row 1: duplicate token row"),
        (lambda c: [c.__setitem__(k, v[:0]) for k, v in list(c.items())], "input holds no rows"),
    ],
)
def test_bad_input_one_line_exit_2_no_output(tmp_path: Path, mutate, expect: str) -> None:
    cols = synth_tokens(200, seed=3, n_batches=1)
    mutate(cols)
    src = tmp_path / "bad.parquet"
    pq.write_table(pa.table(cols), src)
    out = tmp_path / "out.parquet"
    res = run_cli("audit", "coeffs", str(src), "--out", str(out))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith(f"error: {src}") and expect in lines[0], lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == [src]


def test_not_parquet_and_missing_path(tmp_path: Path) -> None:
    junk = tmp_path / "junk.parquet"
    junk.write_text("hello")
    res = run_cli("audit", "coeffs", str(junk), "--out", str(tmp_path / "o.parquet"))
    assert res.returncode == 2 and "not a readable Parquet file" in res.stderr
    res = run_cli("audit", "coeffs", str(tmp_path / "nope"), "--out", str(tmp_path / "o.parquet"))
    assert res.returncode == 2 and "no such file or directory" in res.stderr


def test_mixed_widths_are_accepted(tmp_path: Path) -> None:
    cols = synth_tokens(300, seed=4, n_batches=1)
    cols["batch_id"] = cols["batch_id"].astype(np.int16)
    cols["delta"] = cols["delta"].astype(np.float16)
    cols["ratio"] = cols["ratio"].astype(np.float64)
    pq.write_table(pa.table(cols), tmp_path / "w.parquet")
    (batch,) = list(DumpReader([tmp_path / "w.parquet"]))
    assert batch.tokens.delta.dtype == np.float64 and batch.tokens.batch_id.dtype == np.int64


def test_written_shards_follow_the_umask(tmp_path: Path) -> None:
    import os

    path = write_table_atomic(pa.table({"a": [1]}), tmp_path / "x.parquet")
    umask = os.umask(0)
    os.umask(umask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~umask)

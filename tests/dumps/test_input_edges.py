"""The remaining edges of the audit's input each give one line naming the path (issue 21 items 4 and 5)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import dump_metadata, write_table_atomic

from tests.helpers import cli, one_line_exit_2

META = dump_metadata(producer="test", synthetic=True)


def table(n: int = 600, seed: int = 0, batches: int = 1, **replace: object) -> pa.Table:
    cols = synth_tokens(n, seed=seed, n_batches=batches)
    cols["batch_id"] = cols["batch_id"] + 10 * seed  # files never share a batch
    t = pa.table(cols)
    for name, values in replace.items():
        t = t.set_column(t.column_names.index(name), name, values)
    return t


def write(t: pa.Table, path: Path, **kw: object) -> Path:
    return write_table_atomic(t, path, metadata=META, row_group_size=kw.pop("row_group_size", 1 << 17), **kw)


def refuses(tmp_path: Path, *inputs: str, needles: tuple[str, ...]) -> None:
    """Every audit command refuses the input with the same one line (exit 2) and writes nothing."""
    before = sorted(p.name for p in tmp_path.iterdir())
    for cmd in (["audit", "tcm", *inputs, "--resamples", "20", "--json"],
                ["audit", "coeffs", *inputs, "--out", str(tmp_path / "c.parquet")],
                ["audit", "report", *inputs, "--out", str(tmp_path / "rep"), "--resamples", "20"]):
        one_line_exit_2(cli(*cmd), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_null_batch_id_names_file_column_row(tmp_path: Path) -> None:
    ids = table().column("batch_id").to_pylist()
    ids[417] = None
    f = write(table(batch_id=pa.array(ids, pa.int64())), tmp_path / "n.parquet", row_group_size=200)
    refuses(tmp_path, str(f), needles=(f"{f}: column 'batch_id', row 417: null value",))


@pytest.mark.parametrize("value", [0.0, -0.5])
def test_ratio_must_be_positive(tmp_path: Path, value: float) -> None:
    r = table().column("ratio").to_numpy().copy()
    r[123] = value
    f = write(table(ratio=pa.array(r)), tmp_path / "r.parquet")
    refuses(tmp_path, str(f), needles=(f"{f}: column 'ratio', row 123: ratio {value:g} is not > 0",))


def test_uint64_ids_beyond_int64_mixed_with_int64_refused_before_allocating(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    a = write(table(seed=1), tmp_path / "a.parquet")
    tr = table(seed=2).column("traj_id").to_numpy().astype(np.uint64)
    tr[250:] += np.uint64(2**63)  # row 250 is the first value no int64 holds
    b = write(table(seed=2, traj_id=pa.array(tr, pa.uint64())), tmp_path / "b.parquet", row_group_size=100)
    import icsd_audit.alloc.options as alloc_options
    import icsd_audit.audit.coeffs as coeffs  # imported first: it binds allocate_batch by name

    def never(*args: object, **kw: object) -> None:
        raise AssertionError("allocation ran before the id types were checked")

    for module in (alloc_options, coeffs):
        monkeypatch.setattr(module, "allocate_batch", never)
    refuses(tmp_path, str(a), str(b), needles=(f"{b}: column 'traj_id', row 250: value {int(tr[250])} "
                                               f"does not fit int64, this column's type in {a}",))


def test_uint64_ids_all_below_int64_pool_with_int64_and_coeffs_widens(tmp_path: Path) -> None:
    """uint64 ids that fit int64 pool with signed ones; coeffs writes one common type, values unchanged."""
    t1, t2 = table(seed=1), table(seed=2)
    a = write(t1.set_column(1, "traj_id", t1.column("traj_id").cast(pa.uint64())), tmp_path / "a.parquet")
    neg = pa.array(-1 - t2.column("traj_id").to_numpy())  # negative ids: no unsigned type holds them
    b = write(t2.set_column(1, "traj_id", neg).set_column(2, "turn_id", t2.column("turn_id").cast(pa.int64())),
              tmp_path / "b.parquet")
    out = tmp_path / "c.parquet"
    res = cli("audit", "coeffs", str(a), str(b), "--out", str(out))
    assert res.returncode == 0, res.stderr
    got = pq.read_table(out)
    assert got.schema.field("traj_id").type == pa.int64() and got.schema.field("turn_id").type == pa.int64()
    want = np.concatenate([t1.column("traj_id").to_numpy(), -1 - t2.column("traj_id").to_numpy()])
    np.testing.assert_array_equal(got.column("traj_id").to_numpy(), want)


def test_symlink_loop_is_named(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(table(), d / "a.parquet")
    os.symlink("..", d / "up")  # d/up -> tmp_path, which holds d
    refuses(tmp_path, str(d), needles=(f"{d / 'up'}: symbolic link loop: it points to ..",))


def test_link_to_itself_is_named(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(table(), d / "a.parquet")
    os.symlink("z.parquet", d / "z.parquet")
    refuses(tmp_path, str(d), needles=(f"{d / 'z.parquet'}: symbolic link loop (the link resolves to itself)",))


def test_dangling_parquet_link_in_a_directory_is_named(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(table(), d / "a.parquet")
    os.symlink(tmp_path / "gone.parquet", d / "b.parquet")
    os.symlink(tmp_path / "gone.txt", d / "notes.txt")  # not a dump: ignored as before
    refuses(tmp_path, str(d), needles=(f"{d / 'b.parquet'}: broken symbolic link (its target {tmp_path / 'gone.parquet'} "
                                       "does not exist)",))


def test_a_file_reached_twice_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    a = write(table(), d / "a.parquet")
    os.symlink("a.parquet", d / "b.parquet")
    refuses(tmp_path, str(d), needles=(f"{d / 'b.parquet'}: the same file as {a}",))
    refuses(tmp_path, str(a), str(a), needles=(f"{a}: given twice",))


def test_directory_link_that_does_not_loop_is_followed(tmp_path: Path) -> None:
    write(table(seed=1), tmp_path / "real" / "a.parquet")
    d = tmp_path / "d"
    write(table(seed=2), d / "b.parquet")
    os.symlink(tmp_path / "real", d / "more")
    res = cli("audit", "tcm", str(d), "--resamples", "20", "--json")
    assert res.returncode == 0, res.stderr
    import json

    assert json.loads(res.stdout)["n_tokens"] == 1200


def _with_list(t: pa.Table, name: str, rows: list[list[float]]) -> pa.Table:
    return t.append_column(name, pa.array(rows, pa.list_(pa.float32())))


def test_sketch_of_unequal_lengths_names_file_column_row(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 400
    a = write(_with_list(table(n, seed=1), "grad", [list(rng.normal(size=16)) for _ in range(n)]), tmp_path / "a.parquet")
    rows = [list(rng.normal(size=16)) for _ in range(n)]
    rows[311] = rows[311][:15]  # with row 312's 17 values the total still divides by the row count
    rows[312] = rows[312] + [0.5]
    b = write(_with_list(table(n, seed=2), "grad", rows), tmp_path / "b.parquet")
    needle = f"{b}: column 'grad', row 311: list of 15 values where the batch's first row has 16"
    for cmd in (["audit", "gradcos", str(a), str(b), "--resamples", "20", "--json"],
                ["audit", "report", str(a), str(b), "--out", str(tmp_path / "rep"), "--resamples", "20"]):
        one_line_exit_2(cli(*cmd), needle)
    assert not (tmp_path / "rep").exists()


def test_sketch_column_that_is_not_a_list_names_the_file(tmp_path: Path) -> None:
    t = table().append_column("sketch.lm_head.out", pa.array(np.ones(600)))
    f = write(t.append_column("sketch.lm_head.in", pa.array(np.ones(600))), tmp_path / "s.parquet")
    one_line_exit_2(cli("audit", "gradcos", str(f), "--resamples", "20"),
                    f"{f}: column 'sketch.lm_head.out': expected a fixed-size list of floats (a gradient sketch), "
                    "got double")


def test_sketch_out_without_in_names_the_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f = write(_with_list(table(), "sketch.lm_head.out", [list(rng.normal(size=4)) for _ in range(600)]),
              tmp_path / "s.parquet")
    one_line_exit_2(cli("audit", "gradcos", str(f), "--resamples", "20"),
                    f"{f}: column 'sketch.lm_head.out' has no matching 'sketch.lm_head.in'")

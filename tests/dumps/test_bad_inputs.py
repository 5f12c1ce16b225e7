"""Hostile inputs end in exit 0 with right numbers or exit 2 with one line (issue 16 items 4, 7-11)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.audit.coeffs import compute_coefficients
from icsd_audit.dumps.reader import METADATA_KEY, DumpReader, DumpWarning
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import dump_metadata, write_table_atomic

from tests.helpers import cli, one_line_exit_2

K = 8
META = dump_metadata(producer="test", synthetic=True, allocator={"allocator": "icsd", "eps": 1e-4})


def grad_table(n: int = 3000, batches: int = 3, seed: int = 4, *, mutate=None) -> pa.Table:
    """Synthetic dump with a dense ``grad``; batch ids start at 10 * seed so files never share a batch."""
    cols = synth_tokens(n, seed=seed, n_batches=batches)
    cols["batch_id"] = cols["batch_id"] + 10 * seed
    cols["advantage"] = cols["advantage"].astype(np.float64)
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(n, K)) + np.outer(cols["delta"], rng.normal(size=K))
    if mutate is not None:
        mutate(cols, g)
    return pa.table(cols).append_column("grad", pa.FixedSizeListArray.from_arrays(pa.array(g.astype(np.float32).ravel()), K))


def write(table: pa.Table, path: Path, meta=META, **kw) -> Path:
    return write_table_atomic(table, path, metadata=meta, row_group_size=kw.pop("row_group_size", 700), **kw)


# ---------------------------------------------------------------- item 4: corrupt pages


def _corrupt(path: Path, column: str) -> None:
    """Flip 16 bytes at the start of every chunk of ``column``; the footer stays intact."""
    md = pq.ParquetFile(path).metadata
    j = md.schema.to_arrow_schema().get_field_index(column)
    data = bytearray(path.read_bytes())
    for i in range(md.num_row_groups):
        col = md.row_group(i).column(j)
        start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        data[start : start + 16] = bytes(b ^ 0xFF for b in data[start : start + 16])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("column", ["batch_id", "delta", "grad"])
def test_corrupt_page_is_one_line_in_every_command(tmp_path: Path, column: str) -> None:
    f = write(grad_table(), tmp_path / "d.parquet", compression="none")
    _corrupt(f, column)
    commands = [["audit", "tcm", str(f), "--json"], ["audit", "quadrants", str(f)],
                ["audit", "coeffs", str(f), "--out", str(tmp_path / "c.parquet")],
                ["audit", "report", str(f), "--out", str(tmp_path / "r"), "--resamples", "20"],
                ["audit", "gradcos", str(f), "--resamples", "20", "--json"]]
    for cmd in commands:
        res = cli(*cmd)
        if column == "grad" and cmd[1] in ("tcm", "quadrants"):
            assert res.returncode == 0, res.stderr  # they never read the gradient column
            continue
        one_line_exit_2(res, f"{f}: column '{column}', row 0: corrupt data in row group 0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]


# ---------------------------------------------------------------- item 7: truncated files, differing columns


def test_truncated_file_is_named_in_the_line(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(grad_table(), d / "a.parquet")
    b = write(grad_table(seed=5), d / "b.parquet")
    b.write_bytes(b.read_bytes()[:-200])
    for cmd in (["audit", "report", str(d), "--out", str(tmp_path / "r")], ["audit", "tcm", str(d)],
                ["audit", "gradcos", str(d)], ["audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet")]):
        one_line_exit_2(cli(*cmd), f"{b}: ")


def test_coeffs_refuses_files_with_different_columns_before_any_work(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(grad_table(), d / "a.parquet")
    write(grad_table(seed=5).drop_columns(["grad"]), d / "b.parquet")
    line = one_line_exit_2(cli("audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet")),
                           f"{d / 'b.parquet'}: column 'grad'", "columns differ")
    assert "pyarrow" not in line.lower()
    t = grad_table(seed=6)
    t = t.set_column(t.column_names.index("traj_id"), "traj_id", pa.array(t.column("traj_id").to_numpy()))
    write(t.append_column("note", pa.array(["x"] * t.num_rows)), d / "b.parquet")
    one_line_exit_2(cli("audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet")), "column 'note'")
    assert not (tmp_path / "c.parquet").exists()


def test_coeffs_accepts_castable_type_differences(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(grad_table(), d / "a.parquet")
    t = grad_table(seed=5)
    write(t.set_column(t.column_names.index("delta"), "delta", t.column("delta").cast(pa.float64())), d / "b.parquet")
    res = cli("audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet"))
    assert res.returncode == 0, res.stderr
    assert pq.read_table(tmp_path / "c.parquet").num_rows == 6000


# ---------------------------------------------------------------- item 8: schema version and name


@pytest.mark.parametrize("blob, needle", [
    ({**META, "version": 2}, "version 2"),
    ({**META, "version": "2.1"}, "version '2.1'"),
    ({**META, "schema": "someone.else"}, "someone.else"),
    ("{not json", "not valid JSON"),
    ([1, 2], "not a JSON object"),
])
def test_foreign_or_future_metadata_is_refused(tmp_path: Path, blob, needle: str) -> None:
    t = grad_table()
    raw = blob if isinstance(blob, str) else json.dumps(blob)
    f = tmp_path / "d.parquet"
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: raw}), f)
    for cmd in (["audit", "tcm", str(f)], ["audit", "coeffs", str(f), "--out", str(tmp_path / "c.parquet")]):
        one_line_exit_2(cli(*cmd), str(f), needle)


def test_minor_versions_are_read_and_missing_metadata_warns_once(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(grad_table(), d / "a.parquet", meta={**META, "version": "1.3"})
    for i in range(3):
        write(grad_table(seed=10 + i), d / f"b{i}.parquet", meta=None)
    res = cli("audit", "tcm", str(d), "--json", "--resamples", "20")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "b0.parquet and 2 more" in lines[0], res.stderr
    json.loads(res.stdout)


# ---------------------------------------------------------------- item 9: disagreeing provenance


def test_disagreeing_allocator_settings_are_refused_unless_overridden_and_coeffs_keeps_each_files_provenance(
        tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(grad_table(), d / "a.parquet")
    other = dump_metadata(producer="other", synthetic=False, allocator={"allocator": "sdar", "eps": 1e-3})
    write(grad_table(seed=5), d / "b.parquet", meta=other)
    # SPEC 9: deployed differently, never pooled silently: one line naming both files and the field
    res = cli("audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet"))
    one_line_exit_2(res, "b.parquet")
    assert "a.parquet" in res.stderr and "'allocator'" in res.stderr and not (tmp_path / "c.parquet").exists()
    # the flags replace both differing settings: pooled, each replaced value named on one line
    res = cli("audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet"), "--allocator", "icsd", "--eps", "1e-4")
    assert res.returncode == 0, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: --allocator icsd overrides the deployed allocator 'sdar' (recorded in {d / 'b.parquet'})",
                     f"note: --eps 0.0001 overrides the deployed eps 0.001 (recorded in {d / 'b.parquet'})"]
    meta = json.loads(pq.read_schema(tmp_path / "c.parquet").metadata[METADATA_KEY.encode()])
    assert meta["schema"] == "icsd.token_dump" and meta["version"] == 1
    assert meta["synthetic"] is True  # one input is synthetic, so the pooled output is
    groups = {tuple(g["files"]): g for g in meta["inputs"]}
    assert groups[(str(d / "a.parquet"),)]["allocator"] == META["allocator"]
    assert groups[(str(d / "b.parquet"),)]["allocator"] == other["allocator"]
    assert groups[(str(d / "b.parquet"),)]["producer"]["name"] == "other"
    assert "allocator" not in meta  # no single allocator is claimed for the pooled rows


def test_agreeing_inputs_keep_their_metadata_unchanged(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write(grad_table(), d / "a.parquet")
    write(grad_table(seed=5), d / "b.parquet")
    compute_coefficients([d], tmp_path / "c.parquet", AllocatorOptions())
    meta = json.loads(pq.read_schema(tmp_path / "c.parquet").metadata[METADATA_KEY.encode()])
    assert {k: v for k, v in meta.items() if k != "audit_coeffs"} == json.loads(json.dumps(META))


# ---------------------------------------------------------------- item 10: undefined batches are skipped


def _gradcos(*paths: Path, extra: tuple[str, ...] = ()) -> dict:
    res = cli("audit", "gradcos", *map(str, paths), "--resamples", "50", "--permutations", "2", "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("how, reason", [("invalid", "no valid token"), ("zero_adv", "every advantage is 0")])
def test_undefined_batch_is_skipped_with_its_reason(tmp_path: Path, how: str, reason: str) -> None:
    def mutate(cols, g):
        last = cols["batch_id"] == cols["batch_id"].max()
        if how == "invalid":
            cols["valid"] = ~last
        else:
            cols["advantage"][last] = 0.0

    t = grad_table(mutate=mutate)
    bad = int(np.max(t.column("batch_id").to_numpy()))
    f = write(t, tmp_path / "d.parquet")
    ids = t.column("batch_id").to_numpy()
    keep = write(t.filter(pa.array(ids != bad)), tmp_path / "keep" / "k.parquet")
    out, ref = _gradcos(f), _gradcos(keep)
    assert out["n_skipped"] == 1 and out["skipped"][0]["batch_id"] == bad and reason in out["skipped"][0]["reason"]
    assert "n_skipped" not in ref  # complete runs: no new keys
    # the other batches' numbers are exactly those of a run without the bad batch
    assert out["batches"] == ref["batches"] and out["gain"] == ref["gain"]

    res = cli("audit", "report", str(f), "--out", str(tmp_path / "r"), "--resamples", "30", "--permutations", "2")
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["gradcos"]["n_skipped"] == 1
    assert "Skipped 1 batch" in (tmp_path / "r" / "summary.md").read_text()
    table = cli("audit", "gradcos", str(f), "--resamples", "50", "--permutations", "2")
    assert table.returncode == 0 and "skipped 1 batch" in " ".join(table.stdout.split())


def test_no_batch_left_is_one_line(tmp_path: Path) -> None:
    def mutate(cols, g):
        cols["advantage"][:] = 0.0

    f = write(grad_table(mutate=mutate), tmp_path / "d.parquet")
    one_line_exit_2(cli("audit", "gradcos", str(f)), "every batch", "3 skipped")


# ---------------------------------------------------------------- item 11: grad values, huge advantages


@pytest.mark.parametrize("value, word", [(np.nan, "NaN"), (np.inf, "infinite")])
def test_non_finite_grad_is_named_with_its_row(tmp_path: Path, value: float, word: str) -> None:
    def mutate(cols, g):
        g[1234, 3] = value

    f = write(grad_table(mutate=mutate), tmp_path / "d.parquet")
    one_line_exit_2(cli("audit", "gradcos", str(f)), f"{f}: column 'grad', row 1234: {word}")
    one_line_exit_2(cli("audit", "report", str(f), "--out", str(tmp_path / "r")), "column 'grad', row 1234")


def test_non_finite_sketch_factor_is_named(tmp_path: Path) -> None:
    t = grad_table().drop_columns(["grad"])
    n = t.num_rows
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(n, 8)), rng.normal(size=(n, 8))
    v[2222, 1] = -np.inf
    for name, a in (("sketch.l0.out", u), ("sketch.l0.in", v)):
        t = t.append_column(name, pa.FixedSizeListArray.from_arrays(pa.array(a.astype(np.float32).ravel()), a.shape[1]))
    f = write(t, tmp_path / "s.parquet")
    one_line_exit_2(cli("audit", "gradcos", str(f)), "column 'sketch.l0.in', row 2222: infinite")


def test_one_huge_advantage_keeps_cosines_finite_and_right(tmp_path: Path) -> None:
    t = grad_table()
    ratio = t.column("ratio").to_numpy()
    valid = t.column("valid").to_numpy(zero_copy_only=False) if "valid" in t.column_names else np.ones(t.num_rows, bool)
    row = int(np.flatnonzero((np.abs(ratio - 1) < 0.1) & valid)[0])
    adv = t.column("advantage").to_numpy().copy()
    adv[row] = 1e300
    t = t.set_column(t.column_names.index("advantage"), "advantage", pa.array(adv))
    f = write(t, tmp_path / "d.parquet")
    out = _gradcos(f)
    compute_coefficients([f], tmp_path / "c.parquet", AllocatorOptions(allocator="icsd"))
    c = pq.read_table(tmp_path / "c.parquet")
    grad = c.column("grad").combine_chunks().flatten().to_numpy().astype(np.float64).reshape(-1, K)
    b = c.column("batch_id").to_numpy()
    sel = b == b[row]
    (entry,) = [r for r in out["batches"] if r["batch_id"] == b[row]]
    # the RL direction of that batch is token `row`'s gradient (the rest is 1e-300 of it)
    for col, name in (("g", "cos_sdar"), ("c", "cos_icsd")):
        d = grad[sel].T @ (c.column(col).to_numpy() * valid)[sel]
        want = float(grad[row] @ d / np.linalg.norm(grad[row]) / np.linalg.norm(d))
        assert entry[name] == pytest.approx(want, abs=1e-9)
    res = cli("audit", "report", str(f), "--out", str(tmp_path / "r"), "--resamples", "30", "--permutations", "2")
    assert res.returncode == 0, res.stderr

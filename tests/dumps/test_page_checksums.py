"""Page checksums: every Parquet file icsd writes carries them, every read checks them, a flip is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icsd_audit.dumps.reader import DumpError, DumpReader
from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter, dump_metadata, write_table_atomic

from tests.cli.test_outputs import cli, one_line_exit_2

ROOT = Path(__file__).resolve().parents[2]
META = dump_metadata(producer="test", synthetic=True, allocator={"allocator": "icsd", "eps": 1e-4})


def dump_table(n: int = 6000, seed: int = 3) -> pa.Table:
    return pa.table(synth_tokens(n, seed=seed, n_batches=3))


def chunk(path: Path, row_group: int, column: str) -> tuple[int, int, int]:
    """(start, first data page, end) byte offsets of one column chunk, from the footer."""
    md = pq.ParquetFile(path).metadata
    j = md.schema.to_arrow_schema().get_field_index(column)
    cc = md.row_group(row_group).column(j)
    start = cc.dictionary_page_offset if cc.has_dictionary_page else cc.data_page_offset
    return start, cc.data_page_offset, start + cc.total_compressed_size


def flip(path: Path, offset: int, mask: int = 0x10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def middle_of_data_page(path: Path, row_group: int, column: str) -> int:
    """A byte inside the (only) data page's compressed values: the page header is a few dozen bytes at its start."""
    _, first, end = chunk(path, row_group, column)
    assert end - first > 400  # far more than a page header: the middle is page data
    return (first + end) // 2


def test_every_parquet_call_goes_through_parquet_io() -> None:
    """No module writes or reads Parquet pages around the checksummed helpers (footer-only reads are fine)."""
    direct = re.compile(r"\bpq\.(write_table|ParquetWriter|ParquetFile|read_table|ParquetDataset)\(|write_parquet|"
                        r"(pl|polars)\.(read|scan)_parquet")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "icsd_audit").rglob("*.py")) + sorted(
        (ROOT / "cli").rglob("*.py")) if p.name != "parquet_io.py"
        for i, line in enumerate(p.read_text().splitlines(), 1) if direct.search(line.split("#")[0])]
    assert hits == []


def test_written_shard_fails_on_a_flipped_data_page_and_names_file_column_row_group(tmp_path: Path) -> None:
    f = write_table_atomic(dump_table(), tmp_path / "d.parquet", metadata=META, row_group_size=2500)
    assert pq.ParquetFile(f).metadata.num_row_groups == 3
    before = cli("audit", "tcm", str(f), "--json", "--resamples", "50")
    assert before.returncode == 0, before.stderr
    flip(f, middle_of_data_page(f, 1, "ratio"))
    line = one_line_exit_2(cli("audit", "tcm", str(f), "--json", "--resamples", "50"),
                           f"{f}: column 'ratio', row 2500: corrupt data in row group 1", "checksum")
    assert "Traceback" not in line
    # unverified, the same bytes decode to other numbers: the checksum is what catches the flip
    plain = pq.ParquetFile(f).read_row_group(1, columns=["ratio"]).column(0).to_numpy()
    assert not np.array_equal(plain, dump_table().column("ratio").to_numpy()[2500:5000].astype(np.float32))


def test_unchecksummed_shards_still_read(tmp_path: Path) -> None:
    """Shards written without checksums (older versions, other tools) read as before, with the same numbers."""
    t = dump_table()
    old = tmp_path / "old" / "d.parquet"
    old.parent.mkdir()
    kv = {b"icsd.dump": json.dumps(META).encode()}
    pq.write_table(t.replace_schema_metadata(kv), old, row_group_size=2500, compression="zstd")
    new = write_table_atomic(t, tmp_path / "new" / "d.parquet", metadata=META, row_group_size=2500)
    a = [b.tokens for b in DumpReader([old])]
    b = [b.tokens for b in DumpReader([new])]
    for x, y in zip(a, b, strict=True):
        for col in ("advantage", "ratio", "delta", "traj_id", "turn_id"):
            assert np.array_equal(getattr(x, col), getattr(y, col))
    r_old = cli("audit", "tcm", str(old.parent), "--json", "--resamples", "50")
    r_new = cli("audit", "tcm", str(new.parent), "--json", "--resamples", "50")
    assert r_old.returncode == r_new.returncode == 0, r_old.stderr
    assert json.loads(r_old.stdout) == json.loads(r_new.stdout)
    # and without checksums the same flip goes unnoticed: what the checksums are for
    flip(old, middle_of_data_page(old, 1, "ratio"))
    assert not np.array_equal(np.concatenate([x.tokens.ratio for x in DumpReader([old])]),
                              np.concatenate([x.ratio for x in a]))


@pytest.mark.parametrize("column", ["batch_id", "traj_id", "advantage", "ratio", "delta", "pos", "valid"])
def test_no_flipped_byte_becomes_a_number(tmp_path: Path, column: str) -> None:
    """Property: a one-bit flip anywhere in a column chunk's pages (dictionary, headers, values) is a DumpError
    or leaves every value read identical (a flip in a page header's statistics, which reading never uses)."""
    clean = write_table_atomic(dump_table(2000), tmp_path / "clean.parquet", metadata=META, row_group_size=1000)
    ref = list(DumpReader([clean], columns=None))
    start, _, end = chunk(clean, 1, column)
    rng = np.random.default_rng(sum(map(ord, column)))
    positions = sorted(set(rng.integers(start, end, 24).tolist()) | {start, end - 1})
    outcomes = {"error": 0, "same": 0}
    for pos in positions:
        f = tmp_path / "f.parquet"
        f.write_bytes(clean.read_bytes())
        flip(f, pos, 1 << (pos % 8))
        try:
            got = list(DumpReader([f], columns=None))
        except DumpError as exc:
            assert str(exc).startswith(f"{f}: ") and "row group" in str(exc), str(exc)
            outcomes["error"] += 1
            continue
        assert len(got) == len(ref) and all(g.table.equals(r.table) for g, r in zip(got, ref)), (column, pos - start)
        outcomes["same"] += 1
    assert outcomes["error"] > 0  # the flips did reach the pages


def test_corrupt_page_is_exit_2_in_compare_dumps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    w = DumpWriter(run / "dumps", producer="test", synthetic=True, allocation={"allocator": "icsd"}, row_group_size=1500)
    cols = synth_tokens(3000, seed=1, n_batches=1)
    shard = w.write(**cols)
    (run / "config.json").write_text(json.dumps({"allocator": "icsd", "seed": 0, "env": "webshop"}))
    (run / "metrics.jsonl").write_text('{"step": 0, "rollout/reward": 0.1}\n{"step": 1, "rollout/reward": 0.2}\n')
    ok = cli("compare", str(run), "--metric", "rollout/reward", "--dumps", "--json", "--resamples", "20")
    assert ok.returncode == 0, ok.stderr
    flip(shard, middle_of_data_page(shard, 1, "delta"))
    one_line_exit_2(cli("compare", str(run), "--metric", "rollout/reward", "--dumps", "--json", "--resamples", "20"),
                    f"{shard}: column 'delta', row 1500: corrupt data in row group 1")


def test_coeffs_output_and_helper_files_carry_checksums(tmp_path: Path) -> None:
    """``icsd audit coeffs``'s output and the Search-QA / verl data files are written with checksums too."""
    f = write_table_atomic(dump_table(), tmp_path / "d.parquet", metadata=META, row_group_size=6000)
    out = tmp_path / "c.parquet"
    assert cli("audit", "coeffs", str(f), "--out", str(out)).returncode == 0
    flip(out, middle_of_data_page(out, 0, "c"))
    one_line_exit_2(cli("audit", "coeffs", str(out), "--out", str(tmp_path / "c2.parquet")), f"{out}: column 'c', row 0: corrupt data in row group 0")

    from icsd_audit.envs.searchqa.data import SearchQADataError, read_qa_parquet, write_searchr1
    from icsd_audit.envs.searchqa.kb import builtin_kb

    qa = next(p for p in write_searchr1(builtin_kb(0), tmp_path / "qa") if p.name == "train.parquet")
    n = len(read_qa_parquet(qa))
    flip(qa, middle_of_data_page(qa, 0, "question"))
    with pytest.raises(SearchQADataError, match=f"{re.escape(str(qa))}.*checksum"):
        read_qa_parquet(qa)
    assert n > 0


def test_corrupt_page_in_the_reports_first_pass_is_one_line(tmp_path: Path) -> None:
    """The report's first pass (the landscape's ranks: delta and advantage, the next row group read in a thread
    while this one is ranked) stops at a flipped delta page with the one line, exit 2, and writes nothing."""
    f = write_table_atomic(dump_table(), tmp_path / "d.parquet", metadata=META, row_group_size=2500)
    flip(f, middle_of_data_page(f, 1, "delta"))
    out = tmp_path / "report"
    line = one_line_exit_2(cli("audit", "report", str(f), "--out", str(out), "--resamples", "50"),
                           f"{f}: column 'delta', row 2500: corrupt data in row group 1", "checksum")
    assert "Traceback" not in line and not out.exists()

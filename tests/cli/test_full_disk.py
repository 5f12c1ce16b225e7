"""A full disk is one line naming the path and what failed, exit 2, no signal death, nothing left (issue 21 item 3).

Where the platform allows (Linux, run as root), the tests mount a small tmpfs and let
the commands really run out of space; everywhere, they also simulate ENOSPC at each
write (``posix_fallocate``, pyarrow's writer, ``open().write``) so the paths are
exercised without privileges.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pytest

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import write_table_atomic

from tests.helpers import cli, one_line_exit_2

N = 100_000  # coeffs' scratch: 33 bytes per row = 3.3 MB; its output about 3.2 MB more


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("in")
    cols = synth_tokens(N, seed=0, n_batches=2)
    for b in (0, 1):
        sel = cols["batch_id"] == b
        write_table_atomic(pa.table({k: v[sel] for k, v in cols.items()}), d / f"b{b}.parquet")
    return d


def _mount(where: Path, size: str) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    where.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[callable]:
    mounted: list[Path] = []

    def make(size: str) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        if not _mount(where, size):
            pytest.skip("cannot mount a small tmpfs here (needs Linux and root); the simulated tests cover the paths")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _icsd(*args: str) -> subprocess.CompletedProcess[str]:
    """A separate process: a SIGBUS would show as a negative return code, not kill the test run."""
    env = dict(os.environ, ICSD_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_coeffs_scratch_on_a_full_disk(dumps: Path, small_fs: callable) -> None:
    fs = small_fs("1m")
    res = _icsd("audit", "coeffs", str(dumps), "--out", str(fs / "c.parquet"))
    one_line_exit_2(res, f"error: {fs / 'c.parquet'}: cannot reserve 0.8 MB of scratch space next to it: "
                         "No space left on device")
    assert os.listdir(fs) == []


def test_coeffs_output_on_a_full_disk(dumps: Path, small_fs: callable) -> None:
    fs = small_fs("4m")  # the scratch fits, the output does not
    res = _icsd("audit", "coeffs", str(dumps), "--out", str(fs / "c.parquet"))
    one_line_exit_2(res, f"error: {fs / 'c.parquet'}: cannot write: No space left on device")
    assert os.listdir(fs) == []


def test_report_and_figures_on_a_full_disk(dumps: Path, small_fs: callable) -> None:
    fs = small_fs("64k")
    for cmd in ("report", "figures"):
        res = cli("audit", cmd, str(dumps), "--out", str(fs / "out"), "--resamples", "20")
        line = one_line_exit_2(res, f"error: {fs / 'out'}/", ": cannot write: No space left on device")
        assert line.split(": ")[1].rsplit(".", 1)[1] in ("png", "json", "md", "html")
        assert os.listdir(fs) == []


def test_synth_on_a_full_disk(small_fs: callable) -> None:
    fs = small_fs("64k")
    res = cli("synth", str(fs / "s"), "--tokens", "200000", "--batches", "2")
    one_line_exit_2(res, f"error: {fs / 's'}/", ".parquet: cannot write: No space left on device")
    assert not [p for p in fs.rglob("*") if p.is_file()]


# ---------------------------------------------------------------- simulated, everywhere


def _enospc(*args: object, **kw: object) -> None:
    raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")


def test_simulated_scratch_reservation_failure(dumps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "posix_fallocate", _enospc, raising=False)
    out = tmp_path / "o" / "c.parquet"
    out.parent.mkdir()
    one_line_exit_2(cli("audit", "coeffs", str(dumps), "--out", str(out)),
                    f"error: {out}: cannot reserve 0.8 MB of scratch space next to it: No space left on device")
    assert os.listdir(out.parent) == []


def test_reserve_falls_back_to_zeros_where_fallocate_is_unsupported(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from icsd_audit.outputs import reserve

    def unsupported(*args: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported, raising=False)
    with open(tmp_path / "f", "wb") as fh:
        reserve(fh.fileno(), 3 * (1 << 24) + 5)
    assert (tmp_path / "f").stat().st_size == 3 * (1 << 24) + 5
    assert (tmp_path / "f").stat().st_blocks * 512 >= 3 * (1 << 24)  # written, not sparse


def test_simulated_output_write_failure(dumps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq.ParquetWriter, "write_table", _enospc)
    out = tmp_path / "o" / "c.parquet"
    out.parent.mkdir()
    one_line_exit_2(cli("audit", "coeffs", str(dumps), "--out", str(out)),
                    f"error: {out}: cannot write: No space left on device")
    assert os.listdir(out.parent) == []


def test_simulated_report_write_failure(dumps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import icsd_audit.outputs as outputs

    class Full:
        def __init__(self, path: object, mode: str) -> None:
            self.path = path

        def __enter__(self) -> "Full":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs, "open", Full, raising=False)
    res = cli("audit", "report", str(dumps), "--out", str(tmp_path / "rep"), "--resamples", "20")
    one_line_exit_2(res, f"error: {tmp_path / 'rep'}/", ": cannot write: No space left on device")
    assert sorted(os.listdir(tmp_path)) == []


def test_simulated_shard_write_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq, "write_table", _enospc)
    from icsd_audit.dumps.writer import DumpWriter

    w = DumpWriter(tmp_path / "d", producer="test")
    with pytest.raises(OSError) as info:
        w.write(batch_id=np.zeros(3, int), traj_id=np.zeros(3, int), turn_id=np.zeros(3, int),
                advantage=np.ones(3), ratio=np.ones(3), delta=np.ones(3), name="x.parquet")
    assert (info.value.errno, info.value.filename, info.value.strerror) == (
        errno.ENOSPC, str(tmp_path / "d" / "x.parquet"), "cannot write: No space left on device")
    assert os.listdir(tmp_path / "d") == []

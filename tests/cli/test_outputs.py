"""Outputs never clobber inputs, bad output paths fail first in one line, reports swap in whole."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import DumpWriter, write_table_atomic
from tests.helpers import cli, digest, one_line_exit_2, unprivileged

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("in")
    write_table_atomic(pa.table(synth_tokens(3000, seed=1, n_batches=2)), out / "x.parquet", row_group_size=800)
    return out / "x.parquet"


# ---------------------------------------------------------------- item 1: an output never replaces an input


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink", "relative"])
def test_coeffs_refuses_an_output_that_is_an_input(dump: Path, tmp_path: Path, how: str) -> None:
    src = tmp_path / "x.parquet"
    shutil.copy(dump, src)
    before = digest(src)
    out = {"same": src, "relative": Path(os.path.relpath(src)), "symlink": tmp_path / "link.parquet",
           "hardlink": tmp_path / "hard.parquet"}[how]
    if how == "symlink":
        out.symlink_to(src)
    if how == "hardlink":
        os.link(src, out)
    line = one_line_exit_2(cli("audit", "coeffs", str(src), "--out", str(out)), str(out), "input")
    assert "never replaces an input" in line
    assert digest(src) == before and not list(tmp_path.glob(".*"))


def test_coeffs_refuses_an_output_equal_to_a_file_inside_an_input_directory(dump: Path, tmp_path: Path) -> None:
    d = tmp_path / "dumps"
    d.mkdir()
    shutil.copy(dump, d / "a.parquet")
    before = digest(d / "a.parquet")
    one_line_exit_2(cli("audit", "coeffs", str(d), "--out", str(d / "a.parquet")), "a.parquet")
    assert digest(d / "a.parquet") == before


def test_report_refuses_an_input_file_or_input_directory_as_out(dump: Path, tmp_path: Path) -> None:
    d = tmp_path / "dumps"
    d.mkdir()
    shutil.copy(dump, d / "a.parquet")
    before = digest(d / "a.parquet")
    one_line_exit_2(cli("audit", "report", str(d / "a.parquet"), "--out", str(d / "a.parquet")), "a.parquet")
    one_line_exit_2(cli("audit", "report", str(d), "--out", str(d)), "input")
    one_line_exit_2(cli("audit", "figures", str(d), "--out", str(d)), "input")
    assert sorted(p.name for p in d.iterdir()) == ["a.parquet"] and digest(d / "a.parquet") == before


# ---------------------------------------------------------------- item 5: bad output paths, before any work

HUGE = ["--resamples", "2000000000"]  # would run for hours (or exhaust memory): the check must come first


def test_output_that_is_a_directory_a_file_or_under_a_file_fails_first(dump: Path, tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")
    one_line_exit_2(cli("audit", "coeffs", str(dump), "--out", str(tmp_path / "adir")), "adir", "directory")
    one_line_exit_2(cli("audit", "coeffs", str(dump), "--out", str(tmp_path / "afile" / "c.parquet")), "afile")
    one_line_exit_2(cli("audit", "report", str(dump), "--out", str(tmp_path / "afile"), *HUGE, timeout=60), "afile")
    one_line_exit_2(cli("audit", "report", str(dump), "--out", str(tmp_path / "afile" / "r"), *HUGE, timeout=60),
                    "afile", "not a directory")
    one_line_exit_2(cli("audit", "figures", str(dump), "--out", str(tmp_path / "afile"), *HUGE, timeout=60), "afile")
    assert (tmp_path / "afile").read_text() == "keep" and list((tmp_path / "adir").iterdir()) == []


def test_unwritable_output_directory_fails_first_in_one_line(dump: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_line_exit_2(unprivileged("audit", "coeffs", str(dump), "--out", str(ro / "c.parquet")), str(ro), "permission")
        one_line_exit_2(unprivileged("audit", "report", str(dump), "--out", str(ro / "rep"), *HUGE, timeout=60),
                        str(ro), "permission")
        one_line_exit_2(unprivileged("audit", "coeffs", str(dump), "--out", str(ro / "sub" / "c.parquet")), "permission")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_report_refuses_to_swap_away_files_it_did_not_write(dump: Path, tmp_path: Path) -> None:
    out = tmp_path / "rep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_exit_2(cli("audit", "report", str(dump), "--out", str(out), *HUGE, timeout=60), "notes.txt")
    assert (out / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- item 6: unreadable inputs, usage errors


def test_unreadable_input_is_one_line_on_the_command_line_and_inside_a_directory(dump: Path, tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(dump, d / "a.parquet")
    shutil.copy(dump, d / "b.parquet")
    (d / "b.parquet").chmod(0o000)
    try:
        for cmd in (["audit", "tcm", str(d / "b.parquet"), "--json"], ["audit", "tcm", str(d), "--json"],
                    ["audit", "report", str(d), "--out", str(tmp_path / "r")],
                    ["audit", "coeffs", str(d), "--out", str(tmp_path / "c.parquet")]):
            one_line_exit_2(unprivileged(*cmd), f"{d / 'b.parquet'}: ")
        assert not (tmp_path / "r").exists() and not (tmp_path / "c.parquet").exists()
    finally:
        (d / "b.parquet").chmod(0o644)


def test_usage_errors_are_one_line_with_exit_2(dump: Path) -> None:
    one_line_exit_2(cli("audit", "tcm"), "Missing argument")
    one_line_exit_2(cli("audit", "tcm", str(dump), "--resamples", "many"), "--resamples")
    one_line_exit_2(cli("audit", "tcm", str(dump), "--no-such-flag"), "--no-such-flag")


# ---------------------------------------------------------------- item 13


def test_gradcos_rejects_negative_permutation_and_block_counts(dump: Path) -> None:
    one_line_exit_2(cli("audit", "gradcos", str(dump), "--permutations", "-1"), "--permutations", ">= 0")
    one_line_exit_2(cli("audit", "gradcos", str(dump), "--blocks", "-2"), "--blocks")


# ---------------------------------------------------------------- item 3: a report directory is one set


def _dumps(path: Path, *, grad: bool, steps: int = 1) -> Path:
    w = DumpWriter(path, producer="t", synthetic=True)
    rng = np.random.default_rng(0)
    for step in range(steps):
        cols = synth_tokens(1200, seed=step, n_batches=2, step=step)
        cols["batch_id"] = cols["batch_id"] + 10 * step
        if grad:
            cols["grad"] = rng.normal(size=(1200, 8)) + np.outer(cols["delta"], rng.normal(size=8))
        w.write(**cols)
    return path


def test_rerun_report_leaves_no_stale_figure(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    res = cli("audit", "report", str(_dumps(tmp_path / "g", grad=True)), "--out", str(out), "--resamples", "50",
              "--permutations", "2")
    assert res.returncode == 0, res.stderr
    assert (out / "figures" / "alignment.png").exists()
    res = cli("audit", "report", str(_dumps(tmp_path / "n", grad=False)), "--out", str(out), "--resamples", "50")
    assert res.returncode == 0, res.stderr
    assert not (out / "figures" / "alignment.png").exists()  # an earlier run's figure must not survive
    assert "alignment" not in (out / "summary.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_failure_while_writing_keeps_the_old_report_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import icsd_audit.outputs as outputs
    from icsd_audit.report.build import audit_dumps, write_report
    from icsd_audit.report.results import ReportOptions

    out = tmp_path / "rep"
    rep = audit_dumps([_dumps(tmp_path / "n", grad=False)], ReportOptions(n_resamples=30))
    write_report(rep, out)
    before = {p.relative_to(out): digest(p) for p in out.rglob("*") if p.is_file()}

    calls = {"n": 0}
    real_open = open

    def failing_open(path, mode="r", *a, **k):  # the third file of the new set hits a full disk
        if "w" in mode:
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(28, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(outputs, "open", failing_open, raising=False)
    rep2 = audit_dumps([_dumps(tmp_path / "m", grad=False, steps=2)], ReportOptions(n_resamples=30))
    with pytest.raises(OSError, match="No space"):
        write_report(rep2, out)
    after = {p.relative_to(out): digest(p) for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- item 12: interrupted coeffs


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("big")
    write_table_atomic(pa.table(synth_tokens(600_000, seed=2, n_batches=12)), out / "big.parquet")
    return out / "big.parquet"


def _start_coeffs(src: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-m", "icsd_audit.cli", "audit", "coeffs", str(src), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ICSD_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline:
        tmps = [p for p in out.parent.iterdir() if p.name.startswith(".") and p.is_dir()]
        if tmps:
            return proc, tmps[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    proc.kill()
    raise AssertionError("coeffs never made its scratch directory")


def test_sigterm_removes_the_scratch_directory(big: Path, tmp_path: Path) -> None:
    proc, scratch = _start_coeffs(big, tmp_path / "c.parquet")  # its scratch exists: the run is under way
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "Traceback" not in err
    assert not scratch.exists() and list(tmp_path.iterdir()) == []


def test_a_sigterm_while_the_scratch_is_being_made_still_removes_it(tmp_path: Path, monkeypatch) -> None:
    """The signal lands right after the directory exists, before ``temp_dir`` yields: deferred to the
    ``try`` that removes it, so the process exits 143 and leaves nothing (a SIGTERM there used to kill
    the process with the directory left behind). A helper thread is running, as Arrow's are in a real
    run: a signal sent to the process may reach any thread."""
    from icsd_audit import outputs

    made: list[Path] = []
    real = outputs._mkdtemp

    def make_then_signal(target: Path, kind: str) -> Path:
        made.append(real(target, kind))
        os.kill(os.getpid(), signal.SIGTERM)
        return made[-1]

    monkeypatch.setattr(outputs, "_mkdtemp", make_then_signal)
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        with outputs.temp_dir(tmp_path / "c.parquet", "coeffs"):
            pass
    assert exc.value.code == 128 + signal.SIGTERM
    assert made and not made[0].exists() and list(tmp_path.iterdir()) == []
    stop.set()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_kill_9_leftovers_are_skipped_by_readers_and_removed_by_the_next_run(big: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    proc, scratch = _start_coeffs(big, out_dir / "c.parquet")  # its scratch exists: the run is under way
    proc.kill()
    proc.communicate(timeout=60)
    assert scratch.exists()  # nothing can clean up after SIGKILL ...
    assert not list(scratch.rglob("*.parquet"))  # ... but nothing in it looks like a dump
    small = tmp_path / "s.parquet"
    write_table_atomic(pa.table(synth_tokens(2000, seed=3, n_batches=1)), small)
    res = cli("audit", "coeffs", str(small), "--out", str(out_dir / "c.parquet"))
    assert res.returncode == 0, res.stderr
    assert not scratch.exists()  # the dead process's scratch is gone
    assert sorted(p.name for p in out_dir.iterdir()) == ["c.parquet"]

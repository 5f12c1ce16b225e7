"""``icsd compare`` on hostile metrics.jsonl lines: one line naming the file and line, exit 2; bounded reading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.runs import jsonl
from icsd_audit.runs.folders import load_run
from icsd_audit.runs.jsonl import MAX_LINE_BYTES, RunError, read_records
from tests.cli.test_outputs import cli, one_line_exit_2
from tests.runs.helpers import write_run


def run_with(tmp_path: Path, line: str | bytes, *, name: str = "r") -> Path:
    """A run of two good steps with ``line`` as line 2 of its metrics.jsonl (a third good step after it)."""
    run = write_run(tmp_path / name, [], allocator="icsd", seed=0)
    raw = line.encode() if isinstance(line, str) else line
    (run / "metrics.jsonl").write_bytes(b'{"step": 0, "m": 1.0}\n' + raw + b'\n{"step": 5, "m": 2.0}\n')
    return run


@pytest.mark.parametrize("line, found", [
    ('{"step": NaN, "m": 1}', "found NaN"), ('{"step": Infinity, "m": 1}', "found Infinity"),
    ('{"step": -Infinity}', "found -Infinity"), ('{"step": 1e30}', "found 1e+30"),
    ('{"step": 99999999999999999999}', "found 99999999999999999999"), ('{"step": 1.5}', "found 1.5"),
    ('{"step": "3"}', "found a string"), ('{"step": true}', "found a boolean"), ('{"m": 1}', "found none")])
def test_a_step_that_is_not_a_finite_integer_names_file_and_line(tmp_path, line, found):
    run = run_with(tmp_path, line)
    one_line_exit_2(cli("compare", str(run), "--metric", "m"),
                    f"{run / 'metrics.jsonl'}: line 2 has no integer 'step' ({found})")


def test_deep_nesting_names_file_and_line(tmp_path):
    depth = 100_000
    for value in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
        run = run_with(tmp_path, '{"step": 1, "m": ' + value + "}")
        one_line_exit_2(cli("compare", str(run), "--metric", "m"), f"{run / 'metrics.jsonl'}: line 2 nests JSON deeper")
    run = write_run(tmp_path / "c", [{"step": 0, "m": 1.0}], allocator="icsd", seed=0)
    (run / "config.json").write_text("[" * depth + "]" * depth)
    one_line_exit_2(cli("compare", str(run), "--metric", "m"), f"{run / 'config.json'}: JSON nested deeper")


def test_binary_metrics_names_the_file(tmp_path):
    run = run_with(tmp_path, bytes(range(128, 256)))
    one_line_exit_2(cli("compare", str(run), "--metric", "m"), f"{run / 'metrics.jsonl'}: line 2 is not UTF-8 text")
    run = write_run(tmp_path / "b", [], allocator="icsd", seed=0)
    (run / "metrics.jsonl").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    one_line_exit_2(cli("compare", str(run), "--metric", "m"), f"{run / 'metrics.jsonl'}: line ", "not UTF-8 text")


def test_eval_jsonl_step_is_named_in_its_own_file(tmp_path):
    run = write_run(tmp_path / "r", [{"step": 0, "m": 1.0}], allocator="icsd", seed=0)
    (run / "eval.jsonl").write_text('{"step": 0, "success": 0.5}\n{"step": NaN, "success": 0.5}\n')
    one_line_exit_2(cli("compare", str(run), "--metric", "m"), f"{run / 'eval.jsonl'}: line 2 has no integer 'step'")


def test_an_overlong_line_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """The limit in bytes, at the boundary: a line of exactly the limit reads, one byte more is refused."""
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 64)
    ok = '{"step": 1, "m": 3.0, "pad": "' + "x" * 10 + '"}'
    ok = ok[:-2] + "x" * (64 - len(ok)) + '"}'
    assert len(ok) == 64
    path = run_with(tmp_path, ok) / "metrics.jsonl"
    assert [n for n, _ in read_records(path)[0]] == [1, 2, 3]
    path.write_text(path.read_text().replace('"pad": "', '"pad": "y'))
    with pytest.raises(RunError, match=r"line 2 is longer than 64 bytes, the limit per line \(MAX_LINE_BYTES"):
        read_records(path)
    # the same at the end of a file without a final newline
    path.write_text('{"step": 0}\n' + ok[:-2] + 'yy"}')
    with pytest.raises(RunError, match="line 2 is longer"):
        read_records(path)


def test_a_line_of_millions_of_keys_is_refused_by_the_cli(tmp_path):
    """The real limit: a record beyond MAX_LINE_BYTES (here 4M keys, 2x the limit) is one line naming it."""
    run = write_run(tmp_path / "r", [], allocator="icsd", seed=0)
    n = MAX_LINE_BYTES // 8 + 1  # '"kNNNNNN": 0, ' is >= 8 bytes: the line is past the limit
    with (run / "metrics.jsonl").open("w") as fh:
        fh.write('{"step": 0, "m": 1.0, ' + ", ".join(f'"k{i}": 0' for i in range(n)) + "}\n")
    assert (run / "metrics.jsonl").stat().st_size > MAX_LINE_BYTES
    one_line_exit_2(cli("compare", str(run), "--metric", "m"),
                    f"{run / 'metrics.jsonl'}: line 1 is longer than 16 MiB", "MAX_LINE_BYTES")


def test_only_the_kept_keys_stay(tmp_path):
    run = write_run(tmp_path / "r", [{"step": s, "m": float(s), "big": list(range(50)), **{f"k{i}": i for i in range(30)}}
                                     for s in range(4)], allocator="icsd", seed=0)
    recs, saw_eval = read_records(run / "metrics.jsonl", keep=lambda k: k == "m")
    assert [r for _, r in recs] == [{"step": s, "m": float(s)} for s in range(4)] and not saw_eval
    r = load_run(run, keys=lambda k: k == "m")
    assert r.keys == ["m"] and r.series("m").values.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_torn_last_line_without_newline_is_dropped_a_bad_last_line_too(tmp_path):
    path = run_with(tmp_path, '{"step": 1, "m": 3.0}') / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"step": 9, "m"')
    assert [r["step"] for _, r in read_records(path)[0]] == [0, 1, 5]
    path.write_bytes(path.read_bytes() + b'\n{"step": 10}\n')
    with pytest.raises(RunError, match="line 4 is not valid JSON"):
        read_records(path)


def test_huge_integer_values_are_non_finite_not_a_crash(tmp_path):
    run = run_with(tmp_path, json.dumps({"step": 1, "m": 10**400}))
    r = load_run(run)
    s = r.series("m")
    assert s.steps.tolist() == [0, 1, 5] and np.isnan(s.values[1]) and s.values[[0, 2]].tolist() == [1.0, 2.0]

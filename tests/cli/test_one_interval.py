"""One interval per statistic (SPEC 7): the commands, the report and the library agree bit for bit.

The shipped cpu-demo dumps, seed 0 and the default 10,000 resamples: ``icsd audit tcm``,
``quadrants``, ``shift``, ``clip`` and ``landscape`` each print exactly the object that
``icsd audit report`` writes for that statistic (estimates, interval bounds, standard
errors), whatever else each command computes and whatever the worker count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from icsd_audit import stats
from icsd_audit.alloc.options import AllocatorOptions, weight_pair
from icsd_audit.dumps.reader import DumpReader
from icsd_audit.tokens import Tokens, Weights

from tests.helpers import cli

DUMPS = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo" / "dumps"
STATISTICS = ("tcm", "quadrants", "shift", "clip", "landscape")


def intervals(d: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every {estimate, ci_low, ci_high, ...} object of a result, with its dotted path."""
    if isinstance(d, dict):
        if {"estimate", "ci_low", "ci_high"} <= d.keys():
            yield path, d
            return
        for k, v in d.items():
            yield from intervals(v, f"{path}.{k}")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from intervals(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, stat in enumerate(STATISTICS):
        res = cli("audit", stat, str(DUMPS), "--json", threads=1 + i % 2)  # one and two bootstrap workers
        assert res.returncode == 0, res.stderr
        out[stat] = json.loads(res.stdout)
    res = cli("audit", "tcm", str(DUMPS), "--by", "step", "--json", threads=2)
    assert res.returncode == 0, res.stderr
    out["tcm_by_step"] = json.loads(res.stdout)
    rep = tmp_path_factory.mktemp("one-interval") / "report"
    res = cli("audit", "report", str(DUMPS), "--out", str(rep), threads=2)
    assert res.returncode == 0, res.stderr
    out["report"] = json.loads((rep / "summary.json").read_text())
    return out


@pytest.mark.parametrize("statistic", STATISTICS)
def test_each_command_prints_the_report_s_intervals(outputs: dict[str, Any], statistic: str) -> None:
    mine, report = dict(intervals(outputs[statistic])), dict(intervals(outputs["report"][statistic]))
    assert mine and mine.keys() == report.keys()
    for path, triple in mine.items():
        assert triple == report[path], path  # estimate, bounds and standard error, bit for bit
        assert triple["n_resamples"] == 10_000
    assert outputs[statistic] == outputs["report"][statistic]  # and everything around them


def test_per_step_tcm_is_the_report_s_dynamics(outputs: dict[str, Any]) -> None:
    assert outputs["tcm_by_step"] == outputs["report"]["dynamics"]
    assert [g["key"] for g in outputs["tcm_by_step"]["groups"]] == [0, 1, 2]


def test_the_shared_statistics_printed_today() -> None:
    # the example: tcm and report disagreed (zero-mass turns were dropped per command)
    tcm, quad = (json.loads(cli("audit", s, str(DUMPS), "--json").stdout) for s in ("tcm", "quadrants"))
    both = stats.AuditAccumulator(statistics=("tcm", "quadrants"))
    for tokens, weights in _allocated():
        both.add(tokens, weights)
    res = both.finalize(n_resamples=10_000, rng=0)
    assert res.tcm.to_dict() == tcm and res.quadrants.to_dict() == quad


def _allocated() -> Iterator[tuple[Tokens, Weights]]:
    base, compare = AllocatorOptions(allocator="sdar"), AllocatorOptions(allocator="icsd")
    for batch in DumpReader([DUMPS]):
        weights, u = weight_pair(batch.tokens, base, compare)
        yield batch.tokens.replace(u=u), weights


def test_the_library_one_call_gives_the_same_intervals(outputs: dict[str, Any]) -> None:
    parts = list(_allocated())
    cat = {k: np.concatenate([getattr(t, k) for t, _ in parts]) for k in
           ("advantage", "ratio", "delta", "traj_id", "turn_id", "batch_id", "valid", "u")}
    tokens = Tokens(**cat)
    weights = Weights(np.concatenate([w.base for _, w in parts]), np.concatenate([w.compare for _, w in parts]))
    assert stats.tcm(tokens, weights, rng=0).to_dict() == outputs["tcm"]
    res = stats.audit(tokens, weights, rng=0, workers=3)
    for stat in ("tcm", "quadrants", "shift", "clip"):
        # (the ratio moments of ``clip`` are merged batch by batch in a stream: last bits apart)
        assert dict(intervals(getattr(res, stat).to_dict())) == dict(intervals(outputs[stat])), stat

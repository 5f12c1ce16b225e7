"""examples/cpu-study: the shipped runs are what its README says, and its comparison is their numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs.conftest import ROOT

STUDY = ROOT / "examples" / "cpu-study"
ALLOCATORS = ("none", "sdar", "icsd")


def runs() -> list[Path]:
    return sorted(p for p in STUDY.iterdir() if p.is_dir() and "-seed" in p.name)


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_three_seeds_per_allocator_from_the_warm_start():
    seeds: dict[str, set[int]] = {a: set() for a in ALLOCATORS}
    for run in runs():
        config = json.loads((run / "config.json").read_text())
        manifest = json.loads((run / "run.json").read_text())
        alloc, seed = run.name.split("-seed")
        assert config["allocator"] == alloc and config["seed"] == int(seed)
        assert config["init"] == "warmstart:webshop-smollm2-135m" and config["adv_estimator"] == "grpo"
        assert manifest["status"] == "finished" and manifest["completed_steps"] == len(records(run))
        seeds[alloc].add(int(seed))
    assert all(len(s) >= 3 for s in seeds.values()), seeds


def test_group_means_are_the_runs_last_scores():
    """Each group's mean is the plain mean, over its runs, of the last logged rollout/score (read here directly)."""
    comparison = json.loads((STUDY / "compare" / "comparison.json").read_text())
    assert comparison["metric"] == "rollout/score" and comparison["last"] == 1
    for group in comparison["groups"]:
        mine = [run for run in runs() if run.name.startswith(group["label"] + "-seed")]
        last = [records(run)[-1]["rollout/score"] for run in mine]
        assert group["n_runs"] == len(mine)
        assert group["mean"]["estimate"] == pytest.approx(sum(last) / len(last), abs=1e-12)
        assert group["mean"]["ci_low"] <= group["mean"]["estimate"] <= group["mean"]["ci_high"]


def test_icsd_runs_put_less_trusted_mass_on_conflict_than_sdar_trust():
    """The README's mechanism table: in every ICSD run, at every step, alloc/tcm < alloc/tcm_trust."""
    icsd = [run for run in runs() if run.name.startswith("icsd-seed")]
    assert icsd
    for run in icsd:
        for record in records(run):
            assert record["alloc/tcm"] < record["alloc/tcm_trust"], (run.name, record["step"])

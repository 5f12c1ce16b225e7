"""``compare_runs`` and ``icsd compare``: scores, strata, pairs, refusals; the examples/curves criterion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.runs import estimates as E
from icsd_audit.runs.compare import CompareError, compare_runs
from icsd_audit.runs.folders import find_runs, load_run, load_runs
from tests.runs.helpers import series_run, write_run

ROOT = Path(__file__).resolve().parents[2]
CURVES = ROOT / "examples" / "curves"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def _last_k_mean(folder: Path, key: str, k: int) -> float:
    """By hand: the mean of the last k values of key in a metrics.jsonl."""
    vals = [json.loads(line)[key] for line in (folder / "metrics.jsonl").read_text().splitlines() if key in line]
    return sum(vals[-k:]) / k


def test_examples_curves_criterion():
    """`icsd compare examples/curves/* --metric rollout/invalid_rate --last 5 --json`: per-group means are the
    runs' last-5 means; IQM and P(X > Y) equal rliable's on those numbers; README.md is named and left out."""
    paths = sorted(str(p) for p in CURVES.iterdir())
    res = cli("compare", *paths, "--metric", "rollout/invalid_rate", "--last", "5", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "left out: " in res.stderr and "README.md" in res.stderr and "no confidence interval" in res.stderr
    scores = {g["label"]: g["mean"]["estimate"] for g in out["groups"]}
    want = {name: _last_k_mean(CURVES / name, "rollout/invalid_rate", 5) for name in ("none", "sdar", "icsd")}
    assert scores == pytest.approx(want, abs=1e-15)
    assert want == pytest.approx({"none": 0.9, "sdar": 0.55, "icsd": 0.5125})  # read off the files by eye
    assert out["labels"] == ["none", "sdar", "icsd"] and out["strata"] == ["webshop"]
    assert all(g["n_runs"] == 1 and g["mean"]["ci_low"] is None for g in out["groups"])
    pytest.importorskip("rliable", reason="rliable not installed (pip install -e '.[test]')")
    from rliable import metrics

    for g in out["groups"]:
        assert g["iqm"]["estimate"] == metrics.aggregate_iqm(np.array([[want[g["label"]]]]))
    for p in out["comparisons"]:
        ref = metrics.probability_of_improvement(np.array([[want[p["x"]]]]), np.array([[want[p["y"]]]]))
        assert p["probability_of_improvement"]["estimate"] == ref
        assert p["paired_seeds"] == [{"seed": 0, "x": want[p["x"]], "y": want[p["y"]],
                                      "difference": want[p["x"]] - want[p["y"]]}]


def test_intervals_equal_a_slow_loop_over_the_same_resamples(tmp_path):
    """The group and between-group intervals equal a loop over the resamples drawn by the same streams."""
    rng = np.random.default_rng(4)
    scores = {"sdar": rng.random(5), "icsd": rng.random(7)}
    for lab, xs in scores.items():
        for i, x in enumerate(xs):
            series_run(tmp_path / f"{lab}{i}", "eval/success", [0.0, float(x)], allocator=lab, seed=i)
    c = compare_runs(load_runs([tmp_path])[0], metric="eval/success", n_resamples=500, seed=9)
    draws = {}
    for lab, x in scores.items():
        idx = E.stream(9, "runs", lab, "webshop").integers(0, x.size, (500, x.size))
        draws[lab] = np.sort(x)[idx]  # resampling works on the group's sorted scores
        g = c.group(lab)
        for name, fn in (("mean", np.mean), ("median", np.median)):
            reps = np.array([fn(row) for row in draws[lab]])
            lo, hi = np.percentile(reps, [2.5, 97.5])
            assert (g.statistic(name).ci_low, g.statistic(name).ci_high) == pytest.approx((lo, hi), abs=1e-12)
        assert g.mean.estimate == np.mean(x)
    diff = draws["icsd"].mean(axis=1) - draws["sdar"].mean(axis=1)
    p = c.pair("icsd", "sdar")
    assert (p.difference_of_means.ci_low, p.difference_of_means.ci_high) == pytest.approx(
        tuple(np.percentile(diff, [2.5, 97.5])), abs=1e-12)
    poi = [np.mean([(a > b) + 0.5 * (a == b) for a in xi for b in yi]) for xi, yi in zip(draws["icsd"], draws["sdar"])]
    assert (p.probability_of_improvement.ci_low, p.probability_of_improvement.ci_high) == pytest.approx(
        tuple(np.percentile(poi, [2.5, 97.5])), abs=1e-12)


def test_searchqa_subsets_are_strata_and_avg_is_their_mean(tmp_path):
    subsets = {"NQ": (0.2, 0.4), "Bam": (0.6, 0.0)}
    for lab, k in (("sdar", 0), ("icsd", 1)):
        for seed in (0, 1):
            rec = {"step": 3, "eval/success": 0.5, **{f"eval/subsets/{s}": v[k] + 0.01 * seed for s, v in subsets.items()},
                   "eval/subsets/Avg": 0.0}
            write_run(tmp_path / f"{lab}{seed}", [rec], allocator=lab, seed=seed, env="searchqa")
    c = compare_runs(load_runs([tmp_path])[0], metric="eval/success", n_resamples=100)
    assert c.strata == ("searchqa/Bam", "searchqa/NQ")
    assert c.group("icsd", "searchqa/NQ").mean.estimate == pytest.approx(0.405)
    assert c.group("icsd", "all").mean.estimate == pytest.approx((0.405 + 0.005) / 2)
    assert c.pair("icsd", "sdar", "searchqa/NQ").probability_of_improvement.estimate == 1.0
    assert c.pair("icsd", "sdar", "all").probability_of_improvement.estimate == 0.5
    assert [s for s, *_ in c.pair("icsd", "sdar", "searchqa/NQ").paired] == [0, 1]


def test_runs_left_out_are_named_and_refusals_are_one_line(tmp_path):
    series_run(tmp_path / "a", "rollout/success", [0.1, 0.2, 0.3], allocator="sdar")
    series_run(tmp_path / "b", "rollout/success", [0.1, 0.2, 0.4], allocator="icsd")
    series_run(tmp_path / "short", "rollout/success", [0.5], allocator="icsd")
    series_run(tmp_path / "other", "rollout/score", [0.5, 0.5, 0.5], allocator="icsd")
    write_run(tmp_path / "noenv", [{"step": 0, "rollout/success": 1.0}], allocator="icsd", env=None)
    (tmp_path / "notes.txt").write_text("x")
    runs, skipped = load_runs([tmp_path, tmp_path / "notes.txt"])
    c = compare_runs(runs, metric="rollout/success", last=2, skipped=skipped)
    left = dict(c.excluded)
    assert "--last 2 needs 2" in left[str(tmp_path / "short")]
    assert "no 'rollout/success' logged" in left[str(tmp_path / "other")]
    assert "'env'" in left[str(tmp_path / "noenv")] and "a file" in left[str(tmp_path / "notes.txt")]
    assert c.group("icsd").mean.estimate == pytest.approx(0.3)
    # refusals
    series_run(tmp_path / "nan", "rollout/success", [0.1, None], allocator="sdar", seed=1)
    with pytest.raises(CompareError, match=r"nan: rollout/success is non-finite .* at step 1"):
        compare_runs(load_runs([tmp_path])[0], metric="rollout/success", last=2)
    other = tmp_path / "mixed"
    series_run(other / "x", "rollout/success", [0.1], allocator="sdar", env="alfworld")
    series_run(other / "y", "rollout/success", [0.1], allocator="icsd", env="webshop")
    with pytest.raises(CompareError, match="has no run in stratum"):
        compare_runs(load_runs([other])[0], metric="rollout/success")
    lr = tmp_path / "lr"
    series_run(lr / "x", "rollout/success", [0.1], allocator="sdar", lr=1e-5)
    series_run(lr / "y", "rollout/success", [0.1], allocator="icsd", lr=5e-5)
    with pytest.raises(CompareError, match="disagree on config field 'lr'.*--allow-mixed lr"):
        compare_runs(load_runs([lr])[0], metric="rollout/success")
    ok = compare_runs(load_runs([lr])[0], metric="rollout/success", allow_mixed=["lr"])
    assert ok.labels == ("sdar", "icsd")
    by_lr = compare_runs(load_runs([lr])[0], metric="rollout/success", group_by=["allocator", "lr"])
    assert by_lr.labels == ("sdar/1e-05", "icsd/5e-05")
    with pytest.raises(CompareError, match="no run could be scored"):
        compare_runs(load_runs([lr])[0], metric="eval/success")


def test_cli_errors_are_one_line_with_exit_2(tmp_path):
    series_run(tmp_path / "x", "rollout/success", [0.1, None], allocator="sdar")
    res = cli("compare", str(tmp_path), "--metric", "rollout/success")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and res.stderr.startswith("error: ")
    res = cli("compare", str(tmp_path / "missing"), "--metric", "x")
    assert res.returncode == 2 and "missing" in res.stderr and "Traceback" not in res.stderr
    res = cli("compare", str(tmp_path))
    assert res.returncode == 2 and "--metric is required" in res.stderr


def test_find_runs_walks_parents_not_into_runs(tmp_path):
    series_run(tmp_path / "grp" / "a", "k", [1.0])
    series_run(tmp_path / "grp" / "b", "k", [1.0])
    (tmp_path / "grp" / "a" / "dumps").mkdir()
    series_run(tmp_path / "grp" / "a" / "nested", "k", [1.0])  # inside a run folder: not a run of its own
    found, skipped = find_runs([tmp_path, tmp_path / "grp" / "a"])
    assert sorted(p.name for p in found) == ["a", "b"] and skipped == []


def test_torn_last_line_is_dropped_and_a_bad_middle_line_is_an_error(tmp_path):
    run = series_run(tmp_path / "r", "k", [1.0, 2.0])
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 2, "k": 3')
    assert load_run(run).series("k").values.tolist() == [1.0, 2.0]
    (run / "metrics.jsonl").write_text('{"step": 0, "k": 1}\nnot json\n{"step": 1, "k": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_run(run)


def test_out_folder_is_a_self_contained_page_with_figures(tmp_path):
    for lab in ("sdar", "icsd"):
        for seed in range(3):
            vals = [0.1 * seed + 0.05 * s + (0.1 if lab == "icsd" else 0.0) for s in range(6)]
            write_run(tmp_path / "runs" / f"{lab}{seed}", [
                {"step": s, "rollout/success": v, "alloc/tcm": 0.5 - 0.01 * s,
                 "alloc/share/pos_delta_neg_adv": 0.3} for s, v in enumerate(vals)], allocator=lab, seed=seed)
    out = tmp_path / "cmp"
    res = cli("compare", str(tmp_path / "runs"), "--metric", "rollout/success", "--last", "3", "--out", str(out),
              "--resamples", "400")
    assert res.returncode == 0, res.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["comparison.json", "figures/curves.pdf", "figures/curves.png", "figures/mechanism.pdf",
                     "figures/mechanism.png", "report.html", "summary.md"]
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "Content-Security-Policy" in page and "http" not in page.replace(
        'http-equiv', '')
    data = json.loads((out / "comparison.json").read_text())
    curve = next(c for c in data["curves"] if c["key"] == "rollout/success" and c["label"] == "icsd")
    assert curve["mean"][0] == pytest.approx(np.mean([0.1 * s + 0.1 for s in range(3)]))
    assert curve["n_runs"] == [3] * 6 and curve["ci_low"][0] <= curve["mean"][0] <= curve["ci_high"][0]
    # a second --out into the same folder replaces it; a folder with foreign files is refused
    assert cli("compare", str(tmp_path / "runs"), "--metric", "rollout/success", "--out", str(out),
               "--resamples", "50").returncode == 0
    res = cli("compare", str(tmp_path / "runs"), "--metric", "rollout/success", "--out", str(tmp_path / "runs"))
    assert res.returncode == 2 and "did not write" in res.stderr

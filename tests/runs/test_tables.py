"""The paper's tables from run folders: cells, layout, formats; the docs/reproduce.md commands."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.runs.compare import CompareError
from icsd_audit.runs.folders import load_runs
from icsd_audit.runs.tables import TABLES, paper_table, render_table
from tests.runs.helpers import write_run

ALF = ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2")
SQA = ("NQ", "Triv", "Pop", "Hotp", "2Wk", "MuS", "Bam")


def eval_record(env: str, x: float, step: int = 9) -> dict:
    """One final evaluation of an env with every paper column, values offset by x."""
    if env == "alfworld":
        sub = {n: 0.5 + x + 0.01 * i for i, n in enumerate(ALF)}
        sub["Avg"] = 0.6 + x
        return {"step": step, "eval/success": 0.6 + x, **{f"eval/subsets/{k}": v for k, v in sub.items()}}
    if env == "searchqa":
        sub = {n: 0.2 + x + 0.01 * i for i, n in enumerate(SQA)}
        sub["Avg"] = float(np.mean(list(sub.values())))
        return {"step": step, "eval/success": 0.3, **{f"eval/subsets/{k}": v for k, v in sub.items()}}
    return {"step": step, "eval/success": 0.7 + x, "eval/score": 0.8 + x}


@pytest.fixture(scope="module")
def paper_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("paper_runs")
    for env in ("alfworld", "searchqa", "webshop"):
        for adv, allocs in (("grpo", ("none", "sdar", "icsd")), ("gigpo", ("none", "icsd"))):
            for alloc in allocs:
                for seed in range(3 if alloc == "icsd" else 1):
                    x = 0.1 * (alloc == "icsd") + 0.01 * seed
                    write_run(root / f"{env}-{adv}-{alloc}-{seed}", [{"step": 0, "rollout/success": 0.0},
                                                                     eval_record(env, x)],
                              env=env, adv_estimator=adv, allocator=alloc, seed=seed, model="/models/Qwen2.5-1.5B-Instruct")
    return root


def test_table_1_cells_layout_and_formats(paper_runs):
    runs, skipped = load_runs([paper_runs])
    t = paper_table(runs, "paper-1", n_resamples=500, skipped=skipped)
    assert [m for _, m in t.rows] == ["GRPO", "+ SDAR", "+ ICSD", "GiGPO", "+ ICSD"]
    assert [c.name for c in t.columns] == [*ALF, "Avg", *SQA, "Avg", "Score", "Acc."]
    icsd = ("/models/Qwen2.5-1.5B-Instruct", "grpo", "icsd")
    cell = t.cells[(icsd, 0)]  # ALFWorld Pick of GRPO + ICSD: 0.5 + 0.1 + 0.01 * seed, seeds 0..2
    assert cell.mean == pytest.approx(100 * np.mean([0.6, 0.61, 0.62])) and cell.n_runs == 3
    assert 0 < cell.half_width < 1.0
    none = t.cells[(("/models/Qwen2.5-1.5B-Instruct", "grpo", "none"), 15)]  # WebShop Score
    assert none.mean == pytest.approx(80.0) and none.n_runs == 1
    md = render_table(t, "markdown")
    assert "| *Qwen2.5-1.5B-Instruct* |" in md and "| GRPO | 50.0 (1) |" in md
    assert f"| + ICSD | {cell.mean:.1f} ± {cell.half_width:.1f} (3) |" in md
    tex = render_table(t, "latex")
    assert r"\toprule" in tex and r"\bottomrule" in tex and r"\cmidrule(lr){2-8}\cmidrule(lr){9-16}\cmidrule(lr){17-18}" in tex
    assert r"\multicolumn{7}{c}{ALFWorld} & \multicolumn{8}{c}{Search-QA} & \multicolumn{2}{c}{WebShop}" in tex
    assert r"Method & Pick & Look & Clean & Heat & Cool & Pick2 & Avg & NQ & Triv" in tex
    assert f"+ ICSD & {cell.mean:.1f} $\\pm$ {cell.half_width:.1f} (3)" in tex
    assert r"\multicolumn{18}{l}{\emph{Qwen2.5-1.5B-Instruct}}" in tex and r"\cmidrule(lr){1-18}" in tex
    rows = list(csv.DictReader(io.StringIO(render_table(t, "csv"))))
    assert len(rows) == 5 * 17  # rows x columns (Method is not a column)
    pick = next(r for r in rows if r["method"] == "+ ICSD" and r["adv_estimator"] == "grpo" and r["column"] == "Pick")
    assert float(pick["mean_pct"]) == pytest.approx(cell.mean) and pick["n_runs"] == "3"
    assert float(pick["half_width_pct"]) == pytest.approx(cell.half_width)


def test_tables_3_and_4_use_alfworld_only(paper_runs):
    runs, _ = load_runs([paper_runs])
    t3 = paper_table(runs, "paper-3", n_resamples=200)
    assert [m for _, m in t3.rows] == ["GRPO", "GRPO+SDAR", "GRPO+ICSD", "GiGPO", "GiGPO+ICSD"]
    assert sum("environment 'webshop' has no column" in r for _, r in t3.excluded) == 9
    t4 = paper_table(runs, "paper-4", n_resamples=200)
    assert [m for _, m in t4.rows] == ["GRPO", "+ SDAR", "+ ICSD", "GiGPO", "+ ICSD"]
    tex = render_table(t4, "latex")
    assert r"Method & Pick & Look & Clean & Heat & Cool & Pick2 & Avg \\" in tex
    with pytest.raises(ValueError, match="paper-1, paper-3, paper-4"):
        paper_table(runs, "paper-2")
    assert set(TABLES) == {"paper-1", "paper-3", "paper-4"}


def test_runs_without_evaluations_are_refused(tmp_path):
    write_run(tmp_path / "a", [{"step": 0, "rollout/success": 0.0}], env="alfworld")
    with pytest.raises(CompareError, match="train with --eval-every"):
        paper_table(load_runs([tmp_path])[0], "paper-4")


def test_cli_table_latex(paper_runs):
    res = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "compare", str(paper_runs), "--table", "paper-1",
                          "--format", "latex", "--resamples", "200"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("% \\usepackage{booktabs}") and res.stdout.rstrip().endswith(r"\end{table*}")


def test_table_1_hybrid_rows_head_each_model_block(paper_runs, tmp_path):
    """Skill-SD and RLSD runs (allocator none, hybrid set) get their own rows above GRPO's, as in the paper; the
    other rows keep the cells of a table without them."""
    import shutil

    root = tmp_path / "runs"
    shutil.copytree(paper_runs, root)
    for env in ("alfworld", "searchqa", "webshop"):
        for hybrid, x in (("rlsd", 0.2), ("skill-sd", 0.3)):
            for seed in range(2):
                write_run(root / f"{env}-{hybrid}-{seed}", [eval_record(env, x + 0.01 * seed)], env=env,
                          adv_estimator="grpo", allocator="none", hybrid=hybrid, seed=seed,
                          model="/models/Qwen2.5-1.5B-Instruct")
    before = paper_table(load_runs([paper_runs])[0], "paper-1", n_resamples=500)
    t = paper_table(load_runs([root])[0], "paper-1", n_resamples=500)
    assert [m for _, m in t.rows] == ["Skill-SD", "RLSD", "GRPO", "+ SDAR", "+ ICSD", "GiGPO", "+ ICSD"]
    model = "/models/Qwen2.5-1.5B-Instruct"
    rlsd = t.cells[((model, "grpo", "rlsd"), 16)]  # WebShop Acc.: 0.7 + 0.2 + 0.01 * seed, seeds 0, 1
    assert rlsd.mean == pytest.approx(100 * np.mean([0.9, 0.91])) and rlsd.n_runs == 2
    grpo = ((model, "grpo", "none"), 16)
    assert t.cells[grpo].mean == pytest.approx(70.0) and t.cells[grpo].n_runs == 1  # not pooled with the hybrids
    icsd = ((model, "grpo", "icsd"), 0)
    assert t.cells[icsd] == before.cells[icsd]
    tex = render_table(t, "latex").splitlines()
    i = next(k for k, line in enumerate(tex) if line.startswith("RLSD &"))
    assert tex[i - 1].startswith("Skill-SD &") and tex[i + 1] == r"\cmidrule(lr){1-18}" and tex[i + 2].startswith("GRPO &")
    rows = list(csv.DictReader(io.StringIO(render_table(t, "csv"))))
    hyb = next(r for r in rows if r["method"] == "Skill-SD" and r["column"] == "Pick")
    assert (hyb["allocator"], hyb["hybrid"], hyb["adv_estimator"]) == ("none", "skill-sd", "grpo")
    assert {r["hybrid"] for r in rows if r["method"] == "+ ICSD"} == {"none"}

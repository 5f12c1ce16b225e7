"""The report never aborts for want of a section (issue 21 item 6).

A section the data cannot support (gradient cosines undefined in every batch, no
gradient sketch, one training step) is left out and the report says why in its place;
``icsd audit report`` succeeds on the dumps of a one-step tiny-random run of each
environment (all advantages 0 there: the tiny model never earns a reward).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icsd_audit.dumps.synth import synth_tokens
from icsd_audit.dumps.writer import dump_metadata, write_table_atomic
from icsd_audit.envs.alfworld import engine_available

from tests.helpers import cli

META = dump_metadata(producer="test", synthetic=True)
SMALL = ["--set", "group_size=2", "--set", "max_turns=2", "--set", "max_response_tokens=8",
         "--set", "max_prompt_tokens=384", "--set", "micro_batch_rows=2", "--set", "threads=1"]


def _report(tmp_path: Path, *inputs: Path) -> tuple[dict, str, str]:
    out = tmp_path / "rep"
    res = cli("audit", "report", *map(str, inputs), "--out", str(out), "--resamples", "50")
    assert res.returncode == 0, res.stderr
    return (json.loads((out / "summary.json").read_text()), (out / "summary.md").read_text(),
            (out / "report.html").read_text())


def _dump(tmp_path: Path, *, zero_adv: bool, grad: bool, steps: int, logp: bool = True) -> Path:
    n = 2400
    cols = synth_tokens(n, seed=0, n_batches=3)
    if logp:  # the covariate of the token strata (SPEC 11) when no entropy column exists
        cols["logp"] = -np.abs(np.random.default_rng(1).normal(size=n)).astype(np.float32)
    if zero_adv:
        cols["advantage"] = np.zeros(n, dtype=np.float32)
    assert np.unique(cols["batch_id"]).tolist() == [0, 1, 2]
    cols["step"] = np.minimum(cols["batch_id"], steps - 1).astype(np.int64)
    t = pa.table(cols)
    if grad:
        g = np.random.default_rng(0).normal(size=(n, 16)).astype(np.float32)
        t = t.append_column("grad", pa.FixedSizeListArray.from_arrays(pa.array(g.ravel()), 16))
    return write_table_atomic(t, tmp_path / "d.parquet", metadata=META)


def test_cosines_undefined_everywhere_leave_out_alignment_only(tmp_path: Path) -> None:
    summary, md, html = _report(tmp_path, _dump(tmp_path, zero_adv=True, grad=True, steps=2))
    why = summary["omitted"]["alignment"]
    assert why.startswith("gradient cosine undefined in every batch (3 skipped: batch 0: zero RL direction "
                          "(every advantage is 0)")
    # two steps, but with every advantage 0 TCM is n/a at both: no curve, the reason in its place (issue 24 item 6)
    assert summary["gradcos"] is None and set(summary["omitted"]) == {"alignment", "dynamics"}
    assert summary["omitted"]["dynamics"] == ("trusted-conflict mass is n/a at every step: every token with delta > 0 "
                                              "has advantage 0, as when all rollouts of a group get the same reward "
                                              "and GRPO/GiGPO give that group no signal")
    assert summary["dynamics"] is None and summary["tcm"]["undefined"] is not None
    assert f"*Not shown: {why}.*" in md and "## Gradient compatibility" in md
    assert "<h2 id=\"alignment\">Gradient compatibility</h2><p class=\"note\">Not shown: gradient cosine" in html.replace("\n", "")
    assert not (tmp_path / "rep" / "figures" / "alignment.png").exists()
    assert not (tmp_path / "rep" / "figures" / "dynamics.png").exists()
    assert f"*Not shown: {summary['omitted']['dynamics']}.*" in md


def test_the_same_dumps_with_rewards_keep_every_section(tmp_path: Path) -> None:
    summary, md, _ = _report(tmp_path, _dump(tmp_path, zero_adv=False, grad=True, steps=2))
    assert summary["omitted"] == {} and summary["gradcos"] is not None and "Not shown" not in md
    assert [r["statistic"] for r in summary["strata"]] == ["strata:logp:K10", "strata:logp:top0.2"]
    assert "## Token strata" in md and (tmp_path / "rep" / "figures" / "strata.png").exists()


def test_no_covariate_omits_the_strata_with_the_reason(tmp_path: Path) -> None:
    summary, md, html = _report(tmp_path, _dump(tmp_path, zero_adv=False, grad=True, steps=2, logp=False))
    why = ("the dumps carry neither an 'entropy' nor a 'logp' column in every file (SPEC 11: the strata are by the "
           "student's next-token entropy, else by the token's log-probability)")
    assert summary["omitted"] == {"strata": why} and summary["strata"] == []
    assert f"## Token strata\n\n*Not shown: {why}.*" in md and f"Not shown: {why}" in html.replace("&#x27;", "'")
    assert not (tmp_path / "rep" / "figures" / "strata.png").exists()


def test_one_step_and_no_sketch_say_why(tmp_path: Path) -> None:
    summary, md, _ = _report(tmp_path, _dump(tmp_path, zero_adv=False, grad=False, steps=1))
    assert summary["omitted"] == {
        "alignment": "the dumps carry no gradient sketch (a 'grad' column or 'sketch.<layer>.out|in' columns, which "
                     "`icsd train --sketch-k K` writes)",
        "dynamics": "the dumps hold one training step (0); the per-step curve needs two or more",
    }
    assert md.index("## Gradient compatibility") < md.index("## Training dynamics")


def test_gradcos_alone_still_fails_with_one_line(tmp_path: Path) -> None:
    res = cli("audit", "gradcos", str(_dump(tmp_path, zero_adv=True, grad=True, steps=1)), "--resamples", "20")
    assert res.returncode == 2 and res.stderr.startswith("error: gradient cosine undefined in every batch")


@pytest.mark.parametrize("env", ["webshop", "searchqa", "alfworld"])
def test_report_on_a_one_step_tiny_random_run(tmp_path: Path, env: str) -> None:
    if env == "alfworld" and not engine_available():
        pytest.skip("ALFWorld engine not installed: pip install 'icsd-audit[alfworld]'")
    run = tmp_path / "run"
    res = cli("train", "--env", env, "--model", "tiny-random", "--steps", "1", "--out", str(run), "--plain", *SMALL)
    assert res.returncode == 0, res.stderr
    dumped = pq.read_table(run / "dumps")
    assert any(c.startswith("sketch.") for c in dumped.column_names)
    # what makes the alignment section impossible, worked out from the dumps themselves
    no_rl = not (dumped.column("advantage").to_numpy() != 0).any()
    summary, md, _ = _report(tmp_path, run / "dumps")
    assert summary["provenance"]["n_tokens"] == dumped.num_rows
    assert ("alignment" in summary["omitted"]) == no_rl
    assert summary["omitted"]["dynamics"] == "the dumps hold one training step (0); the per-step curve needs two or more"
    assert summary["tcm"] is not None and "## Sign regions" in md and "## Allocation landscape" in md
    # the built-in loop writes the next-token entropy: the strata are by it, K = 10 and the forking tokens
    assert "entropy" in dumped.column_names
    assert [r["statistic"] for r in summary["strata"]] == ["strata:entropy:K10", "strata:entropy:top0.2"]
    assert "strata" not in summary["omitted"] and "Forking tokens (top 20 % by next-token entropy)" in md

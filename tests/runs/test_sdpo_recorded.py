"""examples/sdpo-recorded: the shipped SDPO recording verifies, and its README's numbers are the shipped files'."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers import cli
from tests.runs.conftest import ROOT

EXAMPLE = ROOT / "examples" / "sdpo-recorded"


def _shards() -> list:
    return sorted((EXAMPLE / "dumps").glob("step*-r00000/*.parquet"))


def _readme() -> str:
    return (EXAMPLE / "README.md").read_text()


def _number(text: str) -> float:
    return float(text.replace(",", "").replace("−", "-"))


def test_the_shipped_dumps_pass_verify():
    r = cli("audit", "verify", str(EXAMPLE / "dumps"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dumps_are_one_committed_step_folder_per_step_of_an_sdpo_recording():
    shards = _shards()
    assert [p.parent.name for p in shards] == [f"step{s:06d}-r00000" for s in range(16)]
    meta = [json.loads(pq.read_schema(p).metadata[b"icsd.dump"]) for p in shards]
    assert all(m["producer"]["trainer"] == "SDPOTrainer" and m["producer"]["distillation_mode"] == "sampled_token"
               and m["producer"]["distillation_weight"] == 1.0 and m["allocator"]["allocator"] == "opsd"
               and m["synthetic"] is False for m in meta)


def test_the_readme_table_is_the_shipped_reports_summary():
    """Each row of the README's table ('| statistic | value |') equals report/summary.json."""
    tcm = json.loads((EXAMPLE / "report" / "summary.json").read_text())["tcm"]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", _readme(), flags=re.M))
    assert _number(rows["tokens"]) == tcm["n_tokens"]
    assert _number(rows["completions (action turns)"]) == tcm["n_turns"]
    assert _number(rows["batches (optimizer steps)"]) == tcm["n_batches"] == len(_shards())
    for label, key in (("trusted-conflict mass, OPSD (as recorded)", "opsd"), ("trusted-conflict mass, ICSD", "icsd"),
                       ("ICSD − OPSD", "diff")):
        m = re.fullmatch(r"(\S+) (?:%|pp) \[(\S+), (\S+)\]", rows[label])
        assert m, rows[label]
        got = [_number(x) for x in m.groups()]
        want = [100 * tcm[key][k] for k in ("estimate", "ci_low", "ci_high")]
        assert np.allclose(got, want, atol=0.005 + 1e-9), (label, got, want)


def test_the_readmes_counts_of_the_dumps_are_the_dumps():
    t = pa.concat_tables([pq.read_table(p) for p in _shards()])
    text = " ".join(_readme().split())
    size = sum(p.stat().st_size for p in _shards())
    assert f"one shard each, {size:,} bytes in all): {t.num_rows:,} completion tokens of" in text
    traj = t["traj_id"].to_numpy()
    n_traj = len(np.unique(traj))
    assert f"completion tokens of {n_traj} completions" in text and t["teacher_logp"].null_count == 0
    term = t["distill_term"].to_numpy()
    zero = {int(x) for x in np.unique(traj)} - {int(x) for x in np.unique(traj[term != 0])}
    assert f"{len(zero)} of the {n_traj} completions have a `distill_term` of 0 on every token" in text

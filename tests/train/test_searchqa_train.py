"""Search-QA in training: presets, prompts, skill keys, per-subset EM, and a CLI step whose
dumps `icsd audit coeffs` recomputes exactly."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("bm25s")

from icsd_audit.envs import StepResult  # noqa: E402
from icsd_audit.envs.searchqa import SearchQAEnv  # noqa: E402
from icsd_audit.train.config import ConfigError, TrainConfig, preset, preset_for  # noqa: E402

ENV = {**os.environ, "ICSD_THREADS": "1"}


def cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**ENV, "ICSD_CACHE": str(cache)})


def test_searchqa_presets_match_table_a1():
    p = preset("paper-searchqa").validate()
    assert p.env == "searchqa" and (p.n_tasks, p.group_size, p.max_turns) == (128, 8, 4)
    assert (p.max_prompt_tokens, p.max_response_tokens) == (4096, 512)
    assert p.mini_batch_rows == 256 * 8 and p.lr == 1e-6 and p.clip_ratio == 0.2
    assert p.kl_coef == 0.001 and p.distill_coef == 0.01 and p.total_steps == 200 and p.eval_tasks == 512
    assert p.retrieval_topk == 3 and p.reward == "score"
    # SDAR's search scripts: invalid_action_penalty_coef 0.01, lr_warmup_steps_ratio 0.1, verl's greedy validation
    assert p.invalid_penalty == 0.01 and p.lr_warmup_steps_ratio == 0.1 and p.eval_temperature == 0.0
    d = preset("cpu-demo-searchqa").validate()
    assert d.env == "searchqa" and d.model == "embedded" and d.device == "cpu"
    assert preset_for("paper", "searchqa") == "paper-searchqa" and preset_for("paper", "webshop") == "paper"
    assert preset_for("cpu-demo", None) == "cpu-demo"


def test_searchqa_settings_are_validated(tmp_path):
    with pytest.raises(ConfigError) as e:
        TrainConfig(env="webshop", searchqa_corpus=str(tmp_path / "nope.jsonl"), retrieval_topk=0).validate()
    msg = str(e.value)
    assert "only apply to env='searchqa'" in msg and "retrieval_topk=0" in msg and "nope.jsonl not found" in msg
    (tmp_path / "t.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match="nothing to search"):
        TrainConfig(env="searchqa", searchqa_data=f"{tmp_path / 't.parquet'}").validate()


def test_student_prompt_asks_for_search_r1_tags_and_lists_no_actions():
    from icsd_audit.train.rollout.prompts import TurnContext, student_messages

    ctx = TurnContext(task="who sang Falling Rain?", observation="No search results yet.", actions=None, env="searchqa")
    text = student_messages(ctx)[0]["content"]
    assert "<search> your query </search>" in text and "<answer> Beijing </answer>" in text
    assert "<action>" not in text and "admissible actions" not in text
    assert text.startswith("You are an expert agent answering questions with the help of a search engine.")


def test_teacher_retrieves_skills_by_data_source():
    from icsd_audit.train.teacher.skills import load_skillbank

    bank = load_skillbank("searchqa")
    q = "Who founded the company that produced The Painted Horizon?"
    assert bank.retrieve(q, key="bamboogle").categories == ("multi_hop_reasoning",)
    assert bank.retrieve("who sang Falling Rain?", key="nq").categories == ("direct_retrieval",)
    assert bank.retrieve("What genre is The Copper Garden?", key="popqa").categories == ("entity_attribute_lookup",)


def test_group_success_is_the_unweighted_subset_mean():
    from icsd_audit.train.eval import group_success
    from icsd_audit.train.rollout.collect import RolloutBatch, Trajectory

    env = SearchQAEnv("eval")  # tasks 0..6 are NQ, Triv, Pop, Hotp, 2Wk, MuS, Bam, then again
    won = {0: True, 7: False, 14: False, 1: True, 8: True, 3: False}
    trajs = [Trajectory(traj=i, slot=i, task=t, rollout=0, won=w) for i, (t, w) in enumerate(won.items())]
    got = group_success(env, RolloutBatch(rows=[], trajectories=trajs, tasks=list(won), group_size=1))
    assert got == {"NQ": pytest.approx(1 / 3), "Triv": 1.0, "Hotp": 0.0, "Avg": pytest.approx((1 / 3 + 1 + 0) / 3)}


class VariedSearchQA(SearchQAEnv):
    """Search-QA with a deterministic pseudo-random reward per step, so that a tiny random
    model (which never writes a valid tag) still gets distinct advantages."""

    created = 0

    def __init__(self, **kw):
        super().__init__(**kw)
        VariedSearchQA.created += 1
        self.ident = VariedSearchQA.created

    def step(self, action):
        res = super().step(action)
        h = hashlib.blake2b(f"{self.item.id}-{self.ident}-{res.info['steps']}".encode(), digest_size=4).digest()
        return StepResult(res.observation, int.from_bytes(h, "little") / 2**32, res.done, res.info)


def _coeffs_match(dumps: Path, tmp: Path, cache: Path, *, min_group: int) -> int:
    out = tmp / "coeffs.parquet"
    proc = cli("audit", "coeffs", str(dumps), "--out", str(out), "--allocator", "icsd", "--min-group", str(min_group),
               cache=cache)
    assert proc.returncode == 0, proc.stderr
    dumped = pa.concat_tables([pq.read_table(p) for p in sorted(dumps.rglob("*.parquet"))])
    audit = pq.read_table(out)
    assert audit.num_rows == dumped.num_rows > 0
    for k in ("g", "m", "c"):
        assert np.array_equal(audit.column(k).to_numpy().astype(np.float32), dumped.column(k).to_numpy()), k
    return dumped.num_rows


def test_cli_train_one_step_writes_searchqa_dumps_that_recompute(tmp_path):
    from icsd_audit.dumps.reader import DumpReader

    run = tmp_path / "run"
    proc = cli("train", "--env", "searchqa", "--model", "tiny-random", "--steps", "1", "--out", str(run), "--plain",
               cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["env"] == "searchqa" and cfg["max_turns"] == 3 and cfg["kl_coef"] == 0.001  # cpu-demo-searchqa
    reader = DumpReader([run / "dumps"], columns=None)
    meta = reader.metadata()[0]
    assert meta["env_data"]["synthetic"] is True and meta["env_data"]["kb_synthetic"] is True
    assert meta["producer"]["env"] == "searchqa"
    envs = set()
    for b in reader:
        envs |= set(b.table.column("env").to_pylist())
    assert envs == {"searchqa"}
    _coeffs_match(run / "dumps", tmp_path, tmp_path / "cache", min_group=cfg["min_group"])


def test_varied_reward_step_recomputes_exactly(tmp_path):
    from icsd_audit.train.loop import train

    VariedSearchQA.created = 0
    cfg = TrainConfig(model="tiny-random", device="cpu", precision="float32", out_dir=str(tmp_path / "run"), threads=1,
                      env="searchqa", n_tasks=2, group_size=2, max_turns=2, history_window=1, max_prompt_tokens=256,
                      max_response_tokens=8, rollout_batch_rows=8, mini_batch_rows=4, micro_batch_rows=2, lr=1e-3,
                      total_steps=1, dump_every=1, checkpoint_every=0, eval_every=1, eval_tasks=7,
                      eval_temperature=0.0, reward="score", min_group=4)
    res = train(cfg, env_factory=lambda split: VariedSearchQA(split=split, max_steps=2))
    table = pa.concat_tables([pq.read_table(p) for p in sorted(res.dumps_dir.rglob("*.parquet"))])
    assert np.abs(table.column("advantage").to_numpy()).max() > 0.01  # non-degenerate
    assert _coeffs_match(res.dumps_dir, tmp_path, tmp_path / "cache", min_group=4) == table.num_rows
    ev = res.evals[0]
    assert list(ev["subsets"]) == ["NQ", "Triv", "Pop", "Hotp", "2Wk", "MuS", "Bam", "Avg"]
    assert ev["n_tasks"] == 7 and res.records[0]["eval/subsets/Avg"] == ev["subsets"]["Avg"]


def test_cli_eval_reports_em_per_subset_with_the_papers_columns(tmp_path):
    out = tmp_path / "eval.json"
    proc = cli("eval", "--env", "searchqa", "--model", "tiny-random", "--tasks", "7", "--temperature", "0",
               "--set", "max_response_tokens=8", "--out", str(out), cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["n_tasks"] == 7 and res["split"] == "eval"
    assert list(res["subsets"]) == ["NQ", "Triv", "Pop", "Hotp", "2Wk", "MuS", "Bam", "Avg"]
    assert res["subsets"]["Avg"] == sum(res["subsets"][c] for c in list(res["subsets"])[:7]) / 7
    assert "  NQ   Triv    Pop   Hotp    2Wk    MuS    Bam    Avg" in proc.stderr

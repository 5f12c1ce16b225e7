"""``icsd train --policy expert``: the loop's rollouts and advantages without a gradient.

The expert's Search-QA turns are valid (``invalid_rate`` 0, where every turn used to be
invalid), and with a scripted policy that writes malformed replies on chosen turns,
exactly those rows are flagged and penalised: their row score is the episode return
minus ``invalid_penalty`` and the GRPO advantages equal a by-hand computation over the
rows of each task group (mean and unbiased std over rows, ``(s - mean) / (std + 1e-6)``,
verl-agent's ``compute_grpo_outcome_advantage`` with its row-level penalty).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from icsd_audit.envs.expert import expert_reply
from icsd_audit.train.config import TrainConfig, from_preset
from icsd_audit.train.rollout.policy import ScriptedPolicy, policy_tokenizer
from icsd_audit.train.rollout.policy_run import play


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_cli_expert_train_step_on_searchqa_has_valid_turns(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ICSD_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "train", "--env", "searchqa", "--model", "tiny-random",
                           "--policy", "expert", "--steps", "1", "--out", str(run)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (rec,) = _lines(run / "metrics.jsonl")
    assert rec["rollout/invalid_rate"] == 0.0 < 1 and rec["rollout/success"] == 1.0 and rec["policy"] == "expert"
    turns = _lines(run / "turns.jsonl")
    cfg = json.loads((run / "config.json").read_text())
    assert len({t["traj"] for t in turns}) == cfg["n_tasks"] * cfg["group_size"]
    assert all(t["valid"] for t in turns) and all(t["prompt"].startswith("<|im_start|>user\nAnswer the given question")
                                                for t in turns)
    assert not (run / "dumps").exists() and not (run / "checkpoints").exists()


def test_exactly_the_malformed_turns_are_penalised(tmp_path):
    bad = {(0, 0): "<think>hm</think><search> unfinished", (1, 1): "", (4, 0): "<think>x</think>Paris",
           (5, 2): "<SEARCH>q</SEARCH>"}

    def script(turn) -> str:
        key = (turn.episode, len(turn.ctx.history))
        return bad[key] if key in bad else expert_reply(turn.env)

    cfg = from_preset("cpu-demo-searchqa", model="tiny-random", out_dir=str(tmp_path / "run"), n_tasks=2,
                                  group_size=3, max_turns=4, adv_estimator="grpo", total_steps=1, invalid_penalty=0.1)
    res = play(cfg, policy=ScriptedPolicy(policy_tokenizer("tiny-random"), script))
    rows = _lines(res.turns_path)
    assert {(r["traj"], r["turn"]) for r in rows if not r["valid"]} == set(bad)
    assert [r["reply"] for r in rows if (r["traj"], r["turn"]) in bad] == [bad[k] for k in sorted(bad)]
    ret: dict[int, float] = {}
    for r in rows:
        ret[r["traj"]] = ret.get(r["traj"], 0.0) + r["reward"]
    for r in rows:
        assert r["row_score"] == ret[r["traj"]] - (0.1 if (r["traj"], r["turn"]) in bad else 0.0)
    adv = np.array([r["advantage"] for r in rows])
    expect = np.zeros(len(rows))
    for g in {r["group"] for r in rows}:
        idx = [i for i, r in enumerate(rows) if r["group"] == g]
        s = np.array([rows[i]["row_score"] for i in idx])
        expect[idx] = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
    assert np.allclose(adv, expect, atol=1e-5)
    (rec,) = res.records
    assert rec["rollout/invalid_rate"] == len(bad) / len(rows)
    from icsd_audit.train.run.folder import RunFolderError

    with pytest.raises(RunFolderError):  # one run per folder, as for training
        play(cfg, policy=ScriptedPolicy(policy_tokenizer("tiny-random"), script))


def test_eval_config_passes_the_runs_rules_and_student_skills(monkeypatch):
    """``icsd eval`` (evaluate_config): the config's invalid rule, and with student_skills='eval'
    the retrieved skill in the student's prompt (Skill-Prompt*), placed as the teacher's."""
    import icsd_audit.train.eval as ev
    from icsd_audit.envs import make_env
    from icsd_audit.train.rollout.prompts import SKILL_HEADER
    from icsd_audit.train.rollout.collect import turn_context

    seen = {}
    monkeypatch.setattr(ev, "evaluate", lambda **kw: seen.update(kw) or "result")
    cfg = from_preset("cpu-demo", model="tiny-random", invalid_rule="admissible", student_skills="eval",
                                  policy="expert", max_prompt_tokens=8192)  # byte-level tokens: no cut
    assert ev.evaluate_config(cfg) == "result"
    assert seen["invalid_rule"] == "admissible" and seen["model"] is None and seen["policy"].name == "expert"
    ctx = turn_context(make_env("webshop", split="eval").reset(0), "webshop")
    tok = seen["tokenizer"]
    text = tok.decode(seen["builder"].student(ctx)[0])
    assert text.startswith(SKILL_HEADER) and text.endswith(seen["builder"].student_text(ctx))
    plain = ev.PromptBuilder.from_config(tok, cfg.replace(student_skills="off"))
    assert plain.student(ctx)[0] == tok(plain.student_text(ctx), add_special_tokens=False).input_ids

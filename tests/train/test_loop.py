"""End-to-end training steps with a tiny random model: WebShop, dumps, audit equality, resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from icsd_audit.envs import StepResult
from icsd_audit.envs.webshop.env import WebShopEnv
from icsd_audit.train.config import ConfigError, TrainConfig, field_docs, parse_override, preset


SKILLS = {
    "format": "icsd-skillbank",
    "version": 1,
    "env": "webshop",
    "general": {"skills": [{"id": "g1", "text": "Search for the product, then buy it."}]},
    "categories": [],
}


@pytest.fixture(scope="module")
def bank(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("bank") / "bank.json"
    p.write_text(json.dumps(SKILLS))
    return str(p)


def tiny_cfg(out: Path, bank: str, **kw) -> TrainConfig:
    """Seconds per step on 2 cores: 2 tasks x 2 rollouts, 2 turns, 8-token replies, short prompts."""
    base = dict(model="tiny-random", device="cpu", precision="float32", out_dir=str(out), threads=1,
                n_tasks=2, group_size=2, max_turns=2, history_window=1, max_prompt_tokens=256, max_response_tokens=8,
                temperature=1.0, rollout_batch_rows=8, mini_batch_rows=4, micro_batch_rows=2, lr=1e-3,
                total_steps=1, dump_every=1, checkpoint_every=0, eval_every=0, skillbank=bank, reward="score",
                min_group=4)
    base.update(kw)
    return TrainConfig(**base)


class VariedReward(WebShopEnv):
    """The built-in WebShop with a deterministic pseudo-random reward per step.

    A tiny random model never writes a valid action, so every turn would get the same
    score and every advantage would be 0; this keeps the pages and the protocol but
    gives distinct rewards, so the allocation has real work to do.
    """

    created = 0

    def __init__(self, **kw):
        super().__init__(**kw)
        VariedReward.created += 1
        self.ident = VariedReward.created

    def reset(self, task=None):
        self._task = task
        return super().reset(task)

    def step(self, action):
        res = super().step(action)
        h = hashlib.blake2b(f"{self._task}-{self.ident}-{res.info['steps']}".encode(), digest_size=4).digest()
        return StepResult(res.observation, int.from_bytes(h, "little") / 2**32, res.done, res.info)


def varied_factory():
    VariedReward.created = 0
    return lambda split: VariedReward(split=split, max_steps=2)


# ----------------------------------------------------------------------------- config


def test_presets_validate_and_match_table_a1():
    p = preset("paper").validate()
    assert (p.n_tasks, p.group_size, p.max_turns) == (16, 8, 15)
    assert (p.max_prompt_tokens, p.max_response_tokens) == (4096, 512)
    assert p.mini_batch_rows == 64 * 8 and p.lr == 1e-6 and p.clip_ratio == 0.2
    assert p.kl_coef == 0.01 and p.distill_coef == 0.01 and p.total_steps == 150 and p.eval_tasks == 128
    assert p.dual_clip == 3.0 and p.gamma == 0.95
    preset("cpu-demo").validate()


def test_validation_lists_every_problem_with_a_fix():
    cfg = TrainConfig(clip_ratio=1.5, allocator="nope", group_size=1, micro_batch_rows=1024)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    msg = str(err.value)
    assert "clip_ratio=1.5" in msg and "allocator='nope'" in msg and "icsd" in msg
    assert "group_size=1" in msg and "micro_batch_rows=1024" in msg
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("fast")


def test_every_field_is_documented_and_overrides_are_typed():
    docs = field_docs()
    assert all(doc for _, doc, _ in docs.values()), [k for k, (_, d, _) in docs.items() if not d]
    assert parse_override("lr=1e-5") == ("lr", 1e-5)
    assert parse_override("one_shot=true") == ("one_shot", True)
    assert parse_override("env_url=none") == ("env_url", None)
    assert parse_override("n_tasks=3") == ("n_tasks", 3)
    with pytest.raises(ConfigError, match="not a valid int"):
        parse_override("n_tasks=x")


def test_allocator_none_means_lambda_zero():
    cfg = TrainConfig(allocator="none", distill_coef=0.5)
    assert not cfg.distill_enabled and cfg.effective_distill_coef == 0.0


# ----------------------------------------------------------------------------- end to end


def test_one_step_on_builtin_webshop(tmp_path, bank):
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.train.loop import train

    res = train(tiny_cfg(tmp_path / "run", bank))
    assert res.next_step == 1
    recs = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["step"] == 0
    r = recs[0]
    for key in ("rollout/success", "rollout/score", "rollout/reward", "actor/kl", "actor/clip_frac", "actor/aux_loss",
                "alloc/fallback_share", "alloc/tcm_active_tokens", "time/rollout", "time/teacher", "time/reference",
                "time/actor", "time/allocation", "time/dump"):
        assert key in r, key
    # the step's TCM is logged where it is defined: some token with delta > 0 and |u| > eps
    assert ("alloc/tcm" in r) == (r["alloc/tcm_active_tokens"] > 0)
    assert r["rollout/rows"] == 2 * 2 * 2  # nothing ends early: the tiny model never buys
    reader = DumpReader([res.dumps_dir], columns=None)
    assert reader.batch_ids == [0, 1]
    meta = reader.metadata()[0]
    assert meta["synthetic"] is False and meta["allocator"]["allocator"] == "icsd"
    assert meta["allocator"]["lambda"] == 0.01
    # SPEC 9: the complete deployed settings and the producer block
    assert {k: meta["allocator"][k] for k in ("trust", "trust_beta", "trust_eta", "influence_eta", "eps", "min_group",
                                              "alloc_scope", "ratio_source", "seed")} == {
        "trust": "laplace", "trust_beta": 5.0, "trust_eta": 0.4, "influence_eta": 0.5, "eps": 1e-4, "min_group": 4,
        "alloc_scope": "mini-batch", "ratio_source": "prepass; fixed-1 on a step's first mini-batch", "seed": 0}
    p = meta["producer"]
    assert (p["name"], p["engine"], p["rank"], p["world_size"], p["env"]) == ("icsd.train", "builtin", 0, 1, "webshop")
    assert p["engine_version"] == p["icsd_version"]
    total = sum(b.n_rows for b in reader)
    assert total == r["actor/tokens"]
    assert res.checkpoint is not None and (res.checkpoint / "trainer_state.json").is_file()


@pytest.mark.parametrize("allocator,scope", [("icsd", "mini-batch"), ("permuted", "mini-batch"),
                                             ("fisher", "mini-batch"), ("icsd", "micro-batch"),
                                             ("fisher", "micro-batch")])
def test_recomputed_allocation_equals_deployed(tmp_path, bank, allocator, scope):
    """icsd audit's allocate_batch with the settings the dump records gives the deployed c exactly (float32
    storage), and ``icsd audit verify`` agrees."""
    from icsd_audit.alloc.options import AllocatorOptions, allocate_batch
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.audit.settings import deployed_options
    from icsd_audit.audit.verify import verify_dumps
    from icsd_audit.train.loop import train

    cfg = tiny_cfg(tmp_path / "run", bank, allocator=allocator, alloc_seed=7, alloc_scope=scope)
    res = train(cfg, env_factory=varied_factory())
    opts = deployed_options([res.dumps_dir])  # SPEC 9: what the shards record
    assert opts == AllocatorOptions(allocator=allocator, trust=cfg.trust, min_group=cfg.min_group, eps=cfg.alloc_eps,
                                    seed=cfg.alloc_seed)
    checked = verify_dumps([res.dumps_dir])
    assert checked.ok and checked.checked == ("g", "m", "c")
    assert len(checked.batches) == (2 if scope == "mini-batch" else 4)
    n = 0
    for batch in DumpReader([res.dumps_dir], columns=None):
        alloc = allocate_batch(batch.tokens, opts)
        cols = {k: batch.table.column(k).to_numpy() for k in ("g", "u", "m", "c")}
        assert np.abs(batch.tokens.advantage).max() > 0.01  # a non-degenerate batch
        for k in ("g", "m", "c"):
            assert np.array_equal(getattr(alloc, k).numpy().astype(np.float32), cols[k]), k
        if allocator == "fisher":  # the score norms are real and vary inside turns
            sn = batch.tokens.columns["score_norm"]
            assert (sn > 0).all() and (sn < np.sqrt(2)).all() and np.ptp(sn) > 1e-5  # near-uniform tiny model
        n += 1
    assert n == (2 if scope == "mini-batch" else 4)  # 2 mini-batches of 2 micro-batches
    rec = res.records[0]
    assert np.isfinite(rec["alloc/tcm"]) and rec["alloc/alloc_ratio_gap"] == 0.0


def test_allocator_none_has_no_teacher_and_no_dumps(tmp_path, bank):
    from icsd_audit.train.loop import train

    res = train(tiny_cfg(tmp_path / "run", bank, allocator="none"), env_factory=varied_factory())
    r = res.records[0]
    assert res.dumps_dir is None and r["actor/aux_loss"] == 0.0
    assert "alloc/tcm" not in r and "time/allocation" in r and r["time/allocation"] == 0.0


def test_resume_reproduces_the_next_step(tmp_path, bank):
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.train.loop import train

    straight = train(tiny_cfg(tmp_path / "a", bank, total_steps=2, checkpoint_every=1), env_factory=varied_factory())
    first = train(tiny_cfg(tmp_path / "b", bank, total_steps=1, checkpoint_every=1), env_factory=varied_factory())
    resumed = train(tiny_cfg(tmp_path / "b", bank, total_steps=2, checkpoint_every=1), resume=True,
                    env_factory=varied_factory())
    assert first.next_step == 1 and resumed.start_step == 1 and resumed.next_step == 2

    def strip(rec):
        return {k: v for k, v in rec.items() if not k.startswith(("time/", "eval/time"))}

    assert strip(resumed.records[0]) == strip(straight.records[1])
    a = {b.batch_id: b for b in DumpReader([straight.dumps_dir], columns=None) if b.batch_id >= 1000}
    b = {b.batch_id: b for b in DumpReader([resumed.dumps_dir], columns=None) if b.batch_id >= 1000}
    assert sorted(a) == sorted(b) == [1000, 1001]
    for k in a:
        assert a[k].table.equals(b[k].table)
    # the metrics file holds each step once
    lines = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [0, 1]


def test_evaluation_on_held_out_split(tmp_path, bank):
    from icsd_audit.train.loop import train

    res = train(tiny_cfg(tmp_path / "run", bank, eval_every=1, eval_tasks=2, eval_temperature=0.0))
    assert len(res.evals) == 1
    ev = res.evals[0]
    assert ev["split"] == "eval" and ev["n_tasks"] == 2 and 0.0 <= ev["success"] <= 1.0
    assert (tmp_path / "run" / "eval.jsonl").is_file()
    assert "eval/score" in res.records[0]


def test_sampler_ignores_the_models_generation_defaults():
    """Sampling is from softmax(logits / T) even when the model's generation_config asks for
    top-k, top-p, a repetition penalty or a minimum length: generate's processed scores equal
    the raw logits divided by T (they would not if any of those leaked in)."""
    import torch

    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.train.update.logprobs import score_rows
    from icsd_audit.train.rollout.collect import sample, sampling_config

    model, tok = tiny_random_causal_lm(seed=1, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    gcm = model.generation_config
    gcm.top_k, gcm.top_p, gcm.repetition_penalty, gcm.min_new_tokens, gcm.typical_p = 3, 0.5, 2.0, 5, 0.5
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    gc = sampling_config(max_new_tokens=6, temperature=0.7, pad_id=tok.pad_token_id, stop_ids=[tok.eos_token_id])
    gc.output_scores = True
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    for logits, scores in zip(out.logits, out.scores):
        assert torch.allclose(scores, logits / 0.7, atol=1e-6)
    # and the recorded old log-probs are the forward pass's log-probs of the sampled tokens
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    resp, logps = sample(model, prompts, max_new_tokens=6, temperature=0.7, pad_id=tok.pad_token_id,
                         stop_ids=[tok.eos_token_id], device=torch.device("cpu"))
    ref = score_rows(model, prompts, resp, [[0], [1]], pad_id=tok.pad_token_id, device=torch.device("cpu"),
                     temperature=0.7)
    for i in range(2):
        assert torch.allclose(logps[i], ref[i], atol=1e-4)


# ----------------------------------------------------------------------------- extended-table baselines


def test_baseline_switches_validate():
    base = dict(model="tiny-random")
    with pytest.raises(ConfigError, match="student_skills"):
        TrainConfig(**base, student_skills="train", allocator="icsd").validate()
    with pytest.raises(ConfigError, match="pg_coef"):
        TrainConfig(**base, allocator="none", pg_coef=0.0).validate()
    TrainConfig(**base, allocator="none", student_skills="both").validate()  # Skill-GRPO*
    TrainConfig(**base, allocator="opsd", pg_coef=0.0).validate()  # stand-alone OPSD


def test_pg_coef_zero_leaves_kl_and_distillation_only():
    import torch

    from icsd_audit.train.update.losses import token_losses

    logp = torch.tensor([-1.0, -2.0])
    kw = dict(logp=logp, old_logp=torch.tensor([-1.1, -1.9]), advantage=torch.tensor([1.0, -1.0]),
              ref_logp=torch.tensor([-1.2, -2.2]), teacher_logp=torch.tensor([-0.5, -2.5]), c=torch.tensor([1.0, 1.0]),
              clip_ratio=0.2, dual_clip=3.0, kl_coef=0.1, distill_coef=1.0)
    full = token_losses(**kw)
    none = token_losses(**kw, pg_coef=0.0)
    assert torch.allclose(none.total, 0.1 * full.kl + full.aux)
    assert torch.allclose(full.total - none.total, full.pg)


def test_skill_grpo_student_sees_the_skill_in_training_only(tmp_path, bank):
    from icsd_audit.train.loop import train

    plain = train(tiny_cfg(tmp_path / "plain", bank, allocator="none"), env_factory=varied_factory())
    skilled = train(tiny_cfg(tmp_path / "sk", bank, allocator="none", student_skills="train"), env_factory=varied_factory())
    # the skill block "[Privileged Skill Information]\n<general skill>\n\n" lengthens every student prompt
    p0, p1 = plain.records[0]["rollout/prompt_tokens_mean"], skilled.records[0]["rollout/prompt_tokens_mean"]
    assert p1 > p0 + 5
    assert skilled.dumps_dir is None and skilled.records[0]["actor/aux_loss"] == 0.0


def test_student_builder_prepends_the_skill_block():
    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.train.rollout.prompts import TurnContext, skill_block
    from icsd_audit.train.rollout.collect import PromptBuilder

    _, tok = tiny_random_causal_lm(seed=0)
    ctx = TurnContext(task="buy a lamp", observation="Search", actions=("search[<your query>]",), env="webshop")
    kw = dict(env="webshop", history_window=1, max_prompt_tokens=512)
    plain = PromptBuilder(tok, **kw)
    skilled = PromptBuilder(tok, **kw, student_skill=lambda c, text: "Search first.")
    base, _ = plain.student(ctx)
    ids, _ = skilled.student(ctx)
    assert ids == plain.encode(skill_block("Search first.")) + base

"""ICSDGRPOTrainer on the tiny random model, on CPU: a few real TRL steps, dumps, exact recomputation."""

from __future__ import annotations

from contextlib import nullcontext as _nullcontext

import numpy as np
import pytest
import torch

pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
datasets = pytest.importorskip("datasets", reason="datasets (a TRL dependency) not installed")

import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from icsd_audit.integrations.core import distillation_loss  # noqa: E402
from icsd_audit.integrations.trl.trainer import ICSDConfig, ICSDGRPOTrainer, skill_teacher_prompt, tcm  # noqa: E402
from icsd_audit.train.models.loading import tiny_random_causal_lm  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)


def _reward(completions, **_):
    return [float(len(c) % 5) for c in completions]


def _trainer(tmp_path, *, steps: int = 3, dump: bool = True, args_kw: dict | None = None,
             **settings) -> ICSDGRPOTrainer:
    from icsd_audit.train.teacher.skills import load_skillbank

    model, tok = tiny_random_causal_lm(seed=0)
    prompts = ["search for a red mug", "buy blue shoes under 30 dollars", "find a wooden chair", "open the drawer"]
    ds = datasets.Dataset.from_dict({"prompt": prompts * 4})
    args = GRPOConfig(**{"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 8, "num_generations": 4,
                         "max_completion_length": 12, "max_steps": steps, "learning_rate": 1e-3, "use_cpu": True,
                         "bf16": False, "report_to": [], "logging_steps": 1, "save_strategy": "no", "seed": 0,
                         "temperature": 1.0, "dataloader_num_workers": 0, **(args_kw or {})})
    bank = load_skillbank("webshop")
    icsd = ICSDConfig(**{"distill_coef": 0.5, "min_group": 4, **settings},
                      dump_dir=str(tmp_path / "dumps") if dump else None)
    return ICSDGRPOTrainer(model=model, processing_class=tok, reward_funcs=_reward, args=args, train_dataset=ds,
                           icsd=icsd, teacher_prompt=skill_teacher_prompt(bank))


def test_trl_run_writes_dumps_that_audit_coeffs_recomputes_exactly(tmp_path):
    import pyarrow.parquet as pq
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.coeffs import compute_coefficients

    tr = _trainer(tmp_path, steps=3)
    tr.train()
    shards = sorted((tmp_path / "dumps").glob("*.parquet"))
    assert [p.name for p in shards] == [f"part-{i:06d}-r00000.parquet" for i in range(3)]
    summary = compute_coefficients(shards, tmp_path / "c.parquet", AllocatorOptions(min_group=4))
    assert summary.n_batches == 3
    assert summary.max_turn_mass_error < 1e-12
    out = pq.read_table(tmp_path / "c.parquet")
    dumped = np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards])
    # the dump stores float32 of the deployed float64 c; the audit recomputes float64 from the float32 inputs
    assert np.array_equal(out.column("c").to_numpy().astype(np.float32), dumped)
    last = tr.icsd_last
    mask = last.c.new_zeros(last.c.shape, dtype=torch.bool)
    sel = out.column("batch_id").to_numpy() == 2
    deployed = last.c[last.pos >= 0]  # row-major == the dump's (traj, turn, pos) order: traj = row index
    assert np.array_equal(out.column("c").to_numpy()[sel], deployed.numpy())
    del mask
    logs = [h for h in tr.state.log_history if "icsd/aux_loss" in h]
    assert logs and all(np.isfinite(h["icsd/aux_loss"]) for h in logs)
    assert all("icsd/tcm_icsd" in h for h in logs)


def test_sigmoid_trust_run_is_audited_as_deployed_without_flags(tmp_path):
    """Done-when of issue 25 for TRL: every shard records the deployed settings (SPEC 9); ``icsd audit coeffs``
    without flags reproduces the deployed c, ``icsd audit verify`` exits 0, and one altered c exits 1 naming it."""
    import pyarrow.parquet as pq
    from icsd_audit.dumps.reader import read_metadata
    from tests.helpers import cli
    from tests.dumps.test_verify import alter

    tr = _trainer(tmp_path, steps=2, trust="sigmoid", trust_beta=3.0, eps=1e-3)
    tr.train()
    shards = sorted((tmp_path / "dumps").glob("*.parquet"))
    meta = read_metadata(shards[0])
    assert meta["allocator"] == {"allocator": "icsd", "trust": "sigmoid", "trust_beta": 3.0, "trust_eta": 0.4,
                                 "influence_eta": 0.5, "eps": 1e-3, "min_group": 4, "alloc_scope": "mini-batch",
                                 "ratio_source": "fixed-1", "seed": 0, "lambda": 0.5}
    p = meta["producer"]
    assert (p["name"], p["engine"], p["engine_version"], p["rank"], p["world_size"]) == (
        "icsd.trl", "trl", trl.__version__, 0, 1)
    r = cli("audit", "coeffs", str(tmp_path / "dumps"), "--out", str(tmp_path / "c.parquet"))
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    dumped = np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards])
    assert np.array_equal(pq.read_table(tmp_path / "c.parquet").column("c").to_numpy().astype(np.float32), dumped)
    v = cli("audit", "verify", str(tmp_path / "dumps"))
    assert v.returncode == 0, v.stdout + v.stderr
    c = pq.read_table(shards[1]).column("c").to_numpy()
    alter(shards[1], "c", 3, c[3] + 0.5)
    v = cli("audit", "verify", str(tmp_path / "dumps"))
    assert v.returncode == 1 and v.stdout.startswith(f"batch 1 ({shards[1]}): c differs on 1 of "), v.stdout


def test_loss_is_trl_loss_plus_weighted_distillation(tmp_path):
    tr = _trainer(tmp_path, steps=1, dump=False)
    tr.model.train()
    tr.current_gradient_accumulation_steps = tr.args.gradient_accumulation_steps  # set by TRL's train loop
    batch = [tr.train_dataset[i] for i in range(8)]
    inputs = tr._generate_and_score_completions(batch)
    torch.manual_seed(0)
    got = tr._compute_loss(tr.model, inputs)
    base = GRPOTrainer._compute_loss(tr, tr.model, inputs)
    comp, cm = inputs["completion_ids"], inputs["completion_mask"]
    ids = torch.cat([inputs["prompt_ids"], comp], 1)
    am = torch.cat([inputs["prompt_mask"], cm], 1)
    logits = tr.model(input_ids=ids, attention_mask=am).logits[:, -comp.size(1) - 1:-1] / tr.temperature
    logp = torch.log_softmax(logits.float(), -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    n = float(cm.sum())  # one process, steps_per_generation == gradient_accumulation_steps
    by_hand = sum(float(inputs["icsd_c"][b, t]) * (float(inputs["icsd_teacher_logps"][b, t]) - float(logp[b, t].detach()))
                  for b in range(cm.size(0)) for t in range(cm.size(1)) if cm[b, t]) / n
    assert float((got - base).detach()) == pytest.approx(0.5 * by_hand, rel=1e-4, abs=1e-7)
    assert float(distillation_loss(logp, inputs["icsd_teacher_logps"], inputs["icsd_c"], cm).detach()) == pytest.approx(by_hand, rel=1e-5)


def _entropy_by_hand(model, prompt_ids, prompt_mask, comp, cmask, temperature: float) -> torch.Tensor:
    """float64 -sum p log p of softmax(logits / T) at each completion token, from a plain forward of the model."""
    with torch.no_grad():
        ids = torch.cat([prompt_ids, comp], 1)
        am = torch.cat([prompt_mask, cmask], 1)
        z = model(input_ids=ids, attention_mask=am).logits[:, -comp.size(1) - 1:-1].double() / temperature
        lp = torch.log_softmax(z, -1)
        return -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("trl_scores_old", [False, True], ids=["on-policy", "old-logps-by-trl"])
def test_dumped_entropy_is_the_models_from_its_logits(tmp_path, trl_scores_old):
    """SPEC 11: the dump's ``entropy`` is the student's next-token entropy at the temperature of ``logp``, from the
    pass that gave ``logp``: ICSDGRPOTrainer's own student pass (on-policy) or TRL's ``old_per_token_logps`` pass
    (two generation steps per optimizer step), checked against a float64 entropy of the model's own logits."""
    import pyarrow.parquet as pq

    kw = {"temperature": 0.7, **({"steps_per_generation": 2} if trl_scores_old else {})}
    with pytest.warns(UserWarning) if trl_scores_old else _nullcontext():
        tr = _trainer(tmp_path, steps=1, args_kw=kw)
    tr.model.train()
    n = 16 if trl_scores_old else 8
    out = tr._generate_and_score_completions([tr.train_dataset[i] for i in range(n)])
    assert ("old_per_token_logps" in out) == trl_scores_old
    cm = out["completion_mask"].bool()
    ref = _entropy_by_hand(tr.model, out["prompt_ids"], out["prompt_mask"], out["completion_ids"], cm, 0.7)
    t = pq.read_table(sorted((tmp_path / "dumps").glob("*.parquet"))[0])
    assert t.schema.field("entropy").type == "float"  # float32
    row, pos = t.column("row").to_numpy(), t.column("pos").to_numpy()
    col = torch.cumsum(cm.long(), 1) - 1  # a completion's tokens are one turn: pos is the index among them
    want = np.array([float(ref[r][cm[r] & (col[r] == p)][0]) for r, p in zip(row, pos)])
    assert len(want) == int(cm.sum())
    np.testing.assert_allclose(t.column("entropy").to_numpy(), want, rtol=0, atol=1e-5)
    assert float(np.ptp(want)) > 1e-3  # the check compares varying values, not one constant


def test_tcm_by_hand():
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    u = torch.tensor([-1.0, 1.0, -2.0, 0.0])
    d = torch.tensor([1.0, 1.0, -1.0, 1.0])
    assert tcm(w, u, d, torch.ones(4, dtype=torch.bool)) == pytest.approx(1 / 3)


def test_multi_turn_rollout_func_env_mask_runs_are_turns(tmp_path, monkeypatch):
    """A TRL ``rollout_func`` marks environment tokens with 0 in ``env_mask``: each run of model tokens is one turn."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import pyarrow.parquet as pq

    from icsd_audit.train.teacher.skills import load_skillbank

    model, tok = tiny_random_causal_lm(seed=0)
    g = torch.Generator().manual_seed(0)

    def rollout(prompts, trainer):
        ids = [list(tok(p, add_special_tokens=False).input_ids) for p in prompts]
        comp, masks = [], []
        for _ in prompts:
            a = torch.randint(3, 250, (4,), generator=g).tolist()
            env = [40, 41, 42]  # an observation fed back by the environment
            b = torch.randint(3, 250, (3,), generator=g).tolist() + [tok.eos_token_id]
            comp.append(a + env + b)
            masks.append([1] * 4 + [0] * 3 + [1] * 4)
        return {"prompt_ids": ids, "completion_ids": comp, "logprobs": [[0.0] * len(c) for c in comp],
                "env_mask": masks}

    ds = datasets.Dataset.from_dict({"prompt": ["search for a red mug", "buy blue shoes"] * 4})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=16, max_steps=2, use_cpu=True, bf16=False, report_to=[],
                      save_strategy="no", seed=0, dataloader_num_workers=0)
    tr = ICSDGRPOTrainer(model=model, processing_class=tok, reward_funcs=_reward, args=args, train_dataset=ds,
                         rollout_func=rollout, icsd=ICSDConfig(min_group=2, dump_dir=str(tmp_path / "dumps")),
                         teacher_prompt=skill_teacher_prompt(load_skillbank("webshop")))
    tr.train()
    t = pq.read_table(sorted((tmp_path / "dumps").glob("*.parquet"))[0])
    traj, turn, pos = (t.column(k).to_numpy() for k in ("traj_id", "turn_id", "pos"))
    for j in np.unique(traj):
        sel = traj == j
        assert turn[sel].tolist() == [0] * 4 + [1] * 4  # the 3 environment tokens are not tokens of the dump
        assert pos[sel].tolist() == list(range(8))


def test_signatures_of_the_trl_methods_we_override_or_call():
    import inspect

    expected = {
        "_generate_and_score_completions": ("self", "inputs"),
        "_get_per_token_logps_and_entropies": ("self", "model", "input_ids", "attention_mask", "logits_to_keep",
                                               "batch_size"),
        "_compute_loss": ("self", "model", "inputs"),
        "_tokenize_prompts": ("self", "prompts"),
    }
    overridden = sorted(k for k, v in vars(ICSDGRPOTrainer).items() if callable(v) and not k.startswith("__")
                        and hasattr(GRPOTrainer, k))
    assert set(overridden) <= set(expected), overridden
    for name, params in expected.items():
        got = tuple(inspect.signature(getattr(GRPOTrainer, name)).parameters)
        assert got[: len(params)] == params, name


def test_two_process_data_parallel_gathers_before_allocating(tmp_path):
    """torchrun, 2 CPU processes (gloo): both compute the same allocation of the gathered generation batch, each
    keeps its own rows, the main process writes the dumps and the audit recomputes them exactly."""
    import glob
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq
    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.coeffs import compute_coefficients

    worker = os.path.join(os.path.dirname(__file__), "trl_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker, str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for b in (0, 1):
        r0 = torch.load(tmp_path / f"rank0-batch{b}.pt")
        r1 = torch.load(tmp_path / f"rank1-batch{b}.pt")
        assert r0["n"] == r1["n"] == 2
        g = r0["c_global"]
        assert torch.equal(g, r1["c_global"])
        k = r0["c_local"].shape[0]
        assert g.shape[0] == 2 * k
        assert torch.equal(r0["c_local"], g[:k, : r0["c_local"].shape[1]].to(r0["c_local"].dtype))
        assert torch.equal(r1["c_local"], g[k:, : r1["c_local"].shape[1]].to(r1["c_local"].dtype))
    shards = sorted(glob.glob(str(tmp_path / "dumps" / "*.parquet")))
    assert [os.path.basename(p) for p in shards] == ["part-000000-r00000.parquet", "part-000001-r00000.parquet"]
    compute_coefficients(shards, tmp_path / "c.parquet", AllocatorOptions(min_group=2))
    rec = pq.read_table(tmp_path / "c.parquet").column("c").to_numpy().astype(np.float32)
    assert np.array_equal(rec, np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards]))


def test_multi_turn_episodes_train_with_the_teacher_on_the_same_tokens_and_recompute_exactly(tmp_path):
    """Whole WebShop episodes of the tiny model through EpisodeRollout: the dumps hold every reply turn of each
    episode, the teacher scored the same completion behind the block, the advantages are TRL's GRPO of the
    episode rewards, and `icsd audit coeffs` recomputes the deployed c exactly."""
    import pyarrow.parquet as pq

    from icsd_audit.alloc.options import AllocatorOptions
    from icsd_audit.audit.coeffs import compute_coefficients
    from icsd_audit.envs import make_env
    from icsd_audit.integrations.trl.rollout import EpisodeRollout, episode_reward
    from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings, turn_context
    from icsd_audit.train.teacher.skills import load_skillbank
    from icsd_audit.train.teacher.self_teacher import skill_retriever

    model, tok = tiny_random_causal_lm(seed=0)
    builder = PromptBuilder(tok, env="webshop", history_window=1, max_prompt_tokens=3000)
    settings = RolloutSettings(max_turns=3, max_response_tokens=10, temperature=1.0, batch_rows=8, require_think=True,
                               reward="score", record_logp=True)
    make = lambda: make_env("webshop", split="train", max_steps=3, seed=0)  # noqa: E731
    probe = make()
    tasks = {builder.student_text(turn_context(probe.reset(t), "webshop")): t for t in (3, 8)}
    batches = []

    class Recorded(EpisodeRollout):
        def play(self, *a, **k):
            batches.append(super().play(*a, **k))
            return batches[-1]

    rollout = Recorded(tokenizer=tok, builder=builder, make_env=make, settings=settings, invalid_penalty=0.1,
                       tasks=tasks, teacher_skill=skill_retriever(load_skillbank("webshop"), skill_mode="match",
                                                                  skill_match="sdar"))
    ds = datasets.Dataset.from_list([{"prompt": p} for p in tasks] * 3)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=3010, max_steps=3, learning_rate=1e-3, use_cpu=True, bf16=False,
                      report_to=[], logging_steps=1, save_strategy="no", seed=0, shuffle_dataset=False,
                      dataloader_num_workers=0)
    # the random model never writes a valid action: every episode scores -0.1, so a length reward makes the
    # GRPO advantages non-zero
    tr = ICSDGRPOTrainer(model=model, processing_class=tok, reward_funcs=[episode_reward, _reward], args=args,
                         train_dataset=ds, rollout_func=rollout, icsd=ICSDConfig(distill_coef=0.5, min_group=4,
                                                                                 dump_dir=str(tmp_path / "dumps")))
    tr.train()
    shards = sorted((tmp_path / "dumps").glob("*.parquet"))
    assert len(shards) == len(batches) == 3
    fresh, _ = tiny_random_causal_lm(seed=0)  # the weights batch 0 was scored with
    for k, (shard, b) in enumerate(zip(shards, batches)):
        t = pq.read_table(shard).to_pydict()
        traj = np.asarray(t["traj_id"]) - (k << 24)
        turn = np.asarray(t["turn_id"])
        rewards = [-0.1 + len(tok.decode(c, skip_special_tokens=True)) % 5 for c in b.completion_ids]
        for r in range(4):
            sel = traj == r
            runs = np.flatnonzero(np.diff(np.r_[0, b.env_mask[r], 0]) == 1)  # where each reply starts
            lengths = np.flatnonzero(np.diff(np.r_[0, b.env_mask[r], 0]) == -1) - runs
            assert b.trajectories[r].n_turns == 3 and len(runs) == 3  # three reply turns, all in the dump
            assert turn[sel].tolist() == np.repeat(np.arange(3), lengths).tolist()
            a, o = rewards[r], rewards[r ^ 1]  # the group: the two episodes of one task
            want = (a - (a + o) / 2) / (abs(a - o) / np.sqrt(2) + 1e-4)
            assert np.allclose(np.asarray(t["advantage"])[sel], want, atol=1e-5)
            if k == 0:  # the teacher scored this completion behind its prompt with the initial weights
                for key, prompt in (("teacher_logp", b.teacher_prompt_ids[r]), ("logp", b.prompt_ids[r])):
                    ids = torch.tensor([prompt + b.completion_ids[r]])
                    with torch.no_grad():
                        lp = torch.log_softmax(fresh(ids).logits[0, len(prompt) - 1:-1].float(), -1)
                    lp = lp.gather(-1, ids[0, len(prompt):, None])[:, 0][torch.tensor(b.env_mask[r]) == 1]
                    assert np.allclose(np.asarray(t[key])[sel], lp.numpy(), atol=2e-5), key
        assert len(b.teacher_prompt_ids[0]) > len(b.prompt_ids[0])
    summary = compute_coefficients(shards, tmp_path / "c.parquet", AllocatorOptions(min_group=4))
    assert summary.n_batches == 3 and summary.max_turn_mass_error < 1e-12
    rec = pq.read_table(tmp_path / "c.parquet").column("c").to_numpy().astype(np.float32)
    assert np.array_equal(rec, np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards]))
    assert any(np.isfinite(h.get("icsd/tcm_icsd") or np.nan) for h in tr.state.log_history)


@pytest.mark.parametrize("field,name", [("advantages", "advantages"), ("old_per_token_logps", "student log-probs")])
def test_a_nan_input_stops_the_allocation_before_any_dump(tmp_path, monkeypatch, field, name):
    from icsd_audit.integrations.checks import BatchInputError

    tr = _trainer(tmp_path, steps=1)
    tr.model.train()
    original = GRPOTrainer._generate_and_score_completions

    def poisoned(self, inputs):
        out = original(self, inputs)
        if field == "old_per_token_logps":  # TRL skips it on-policy; give it one with a NaN
            out[field] = torch.full(out["completion_ids"].shape, -1.0)
            out[field][3, 0] = float("nan")
        else:
            out[field] = out[field].clone()
            out[field][3] = float("nan")
        out["completion_mask"][3, 0] = 1
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", poisoned)
    with pytest.raises(BatchInputError, match=rf"^{name} is nan at row 3, response token 0: values on valid tokens"):
        tr._generate_and_score_completions([tr.train_dataset[i] for i in range(8)])
    assert not list((tmp_path / "dumps").glob("*.parquet"))


def test_a_dataset_without_teacher_prompt_is_refused_when_the_trainer_is_built(tmp_path, monkeypatch):
    """No teacher_prompt function and no 'teacher_prompt' column: one line naming the column and the dataset at
    construction (it was KeyError: 'teacher_prompt' at the first step); with the column it builds."""
    model, tok = tiny_random_causal_lm(seed=0)
    ds = datasets.Dataset.from_dict({"prompt": ["search for a red mug", "buy blue shoes"] * 4})
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, use_cpu=True, bf16=False, report_to=[],
                      save_strategy="no", seed=0, dataloader_num_workers=0)
    with pytest.raises(ValueError) as e:
        ICSDGRPOTrainer(model=model, processing_class=tok, reward_funcs=_reward, args=args, train_dataset=ds)
    assert str(e.value) == (
        "ICSDGRPOTrainer: train_dataset (8 rows, columns prompt) has no 'teacher_prompt' column for the privileged "
        "teacher's prompt; add that column, pass teacher_prompt= (a function of an example; "
        "skill_teacher_prompt(bank) builds SDAR's), or a rollout_func that returns teacher_prompt_ids")
    with_col = ds.add_column("teacher_prompt", ["[skill] " + p for p in ds["prompt"]])
    tr = ICSDGRPOTrainer(model=model, processing_class=tok, reward_funcs=_reward, args=args, train_dataset=with_col)
    assert tr.teacher_prompt(with_col[0]) == "[skill] search for a red mug"

    # a rollout_func may supply teacher_prompt_ids: checked at its first batch, in one line, not as a KeyError
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    def rollout(prompts, trainer):  # returns no teacher_prompt_ids
        ids = [list(tok(p, add_special_tokens=False).input_ids) for p in prompts]
        comp = [[5, 6, 7, tok.eos_token_id] for _ in prompts]
        return {"prompt_ids": ids, "completion_ids": comp, "logprobs": [[0.0] * 4 for _ in comp]}

    tr = ICSDGRPOTrainer(model=model, processing_class=tok, reward_funcs=_reward, args=args, train_dataset=ds,
                         rollout_func=rollout)
    with pytest.raises(ValueError, match=r"^ICSDGRPOTrainer: a training example \(keys prompt\) has no "
                                         r"'teacher_prompt' column .* the rollout_func returned no teacher_prompt_ids"):
        tr.train()

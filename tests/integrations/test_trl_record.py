"""record(trainer, dump_dir) on TRL's GRPO, SDPO and SDFT trainers: training unchanged, dumps right, audits run.

Every trainer loads the tiny random model from a folder (SDPO and SDFT build their teacher from
the model's path) and trains 3 steps on CPU; "unchanged" means bit-identical parameters with and
without ``record`` (TRL 1.16 on CPU is bit-identical run to run).  The dumps' values are checked
against a recomputation with the untrained model on step 0 (whose weights are the initial ones).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
datasets = pytest.importorskip("datasets", reason="datasets (a TRL dependency) not installed")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pyarrow.parquet as pq  # noqa: E402

from icsd_audit.integrations.trl import record  # noqa: E402
from icsd_audit.train.models.loading import tiny_random_causal_lm  # noqa: E402

pytestmark = pytest.mark.engines
torch.set_num_threads(1)

PROMPTS = ["search for a red mug", "buy blue shoes under 30 dollars", "find a wooden chair", "open the drawer"]
MAX_LEN = 12
TOPK = 100


def _reward(completions, **_):
    return [float(len(c) % 3) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    model, tok = tiny_random_causal_lm(seed=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_trainer(kind: str, model_dir, out, *, cls=None, **extra):
    """A TRL trainer of ``kind`` (``grpo``, ``sdpo:MODE:WEIGHT``, ``sdft``) on the tiny model, 3 steps."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    common = dict(output_dir=str(out), per_device_train_batch_size=8, max_completion_length=MAX_LEN, max_steps=3,
                  learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no",
                  seed=0, temperature=1.0, dataloader_num_workers=0, disable_tqdm=True)
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 4})
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOTrainer(model=str(model_dir), processing_class=tok, reward_funcs=_reward,
                           args=GRPOConfig(num_generations=4, **common), train_dataset=ds)
    if kind.startswith("sdpo"):
        from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

        _, mode, weight = kind.split(":")
        cfg = dict(distillation_mode=mode, distillation_weight=float(weight), num_generations=4)
        if mode == "topk_logits":
            cfg.update(distillation_topk=TOPK, distillation_alpha=0.5)
        return (cls or SDPOTrainer)(model=str(model_dir), processing_class=tok, reward_funcs=_reward,
                                    args=SDPOConfig(**common, **cfg), train_dataset=ds, **extra)
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 4, "privileged_context": ["the answer is yes"] * 16})
    return SDFTTrainer(model=str(model_dir), processing_class=tok, args=SDFTConfig(**common), train_dataset=ds)


def params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def read_dump(path) -> dict[str, np.ndarray]:
    files = sorted(path.glob("step*/*.parquet"))
    tables = [pq.read_table(f) for f in files]
    return {k: np.concatenate([t.column(k).to_numpy(zero_copy_only=False) for t in tables]) for k in tables[0].column_names}


KINDS = ["grpo", "sdpo:topk_logits:0.5", "sdpo:topk_logits:1.0", "sdpo:sampled_token:1.0", "sdpo:full_logits:0.5",
         "sdft"]


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """kind -> (plain parameters, recorded parameters, recorded trainer, dump folder); trained once per module."""
    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind.replace(":", "-").replace(".", ""))
        plain = make_trainer(kind, model_dir, root / "plain")
        start = params(plain)
        plain.train()
        tr = make_trainer(kind, model_dir, root / "rec")
        assert record(tr, root / "dumps") is tr
        tr.train()
        out[kind] = (start, params(plain), params(tr), tr, root / "dumps")
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_recording_leaves_training_bit_identical(runs, kind):
    start, plain, recorded, _, _ = runs[kind]
    assert any(not torch.equal(start[k], plain[k]) for k in start), "3 steps did not move the parameters"
    assert plain.keys() == recorded.keys()
    differ = [k for k in plain if not torch.equal(plain[k], recorded[k])]
    assert not differ, f"{kind}: parameters differ with record(): {differ[:3]}"


@pytest.mark.parametrize("kind", KINDS)
def test_one_committed_folder_per_step_and_valid_is_exactly_up_to_eos(runs, kind, model_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    *_, trainer, dumps = runs[kind]
    assert sorted(p.name for p in dumps.iterdir()) == [f"step{k:06d}-r00000" for k in range(3)]
    d = read_dump(dumps)
    assert sorted(set(d["batch_id"])) == [0, 1, 2] and np.array_equal(d["batch_id"], d["step"])
    assert d["valid"].all() and (d["turn_id"] == 0).all()
    assert len(set(zip(d["batch_id"], d["traj_id"]))) == 3 * 8  # one trajectory per completion, 8 per step
    for key in set(zip(d["batch_id"], d["traj_id"])):
        sel = (d["batch_id"] == key[0]) & (d["traj_id"] == key[1])
        toks, pos = d["token_id"][sel], d["pos"][sel]
        assert pos.tolist() == list(range(sel.sum()))
        at = np.flatnonzero(toks == eos)
        # EOS closes a completion and is its last valid token; without EOS the completion ran to the length cap
        assert (at.tolist() == [len(toks) - 1]) if at.size else len(toks) == MAX_LEN
    # a group (one prompt, num_generations completions) shares its task id
    G = trainer.num_generations
    for b in range(3):
        rows = {t: k for k, t in zip(d["task"][d["batch_id"] == b], d["traj_id"][d["batch_id"] == b])}
        assert sorted(np.unique(list(rows.values()), return_counts=True)[1].tolist()) == [G] * (8 // G)


def _step0_logps(model_dir, d, prompts_by_task):
    """Student log-probs of step 0's tokens from the untrained model (the weights step 0 was computed with)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from icsd_audit.integrations.trl.recorder import prompt_hash

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hashes = {}
    for p in PROMPTS:
        ids = torch.tensor([tok(p).input_ids])
        hashes[int(prompt_hash(ids, torch.ones_like(ids))[0])] = ids
    sel0 = d["batch_id"] == 0
    out = np.zeros(sel0.sum())
    logits_all = np.zeros((sel0.sum(), model.config.vocab_size))
    idx = np.flatnonzero(sel0)
    for j in np.unique(d["traj_id"][sel0]):
        rows = idx[d["traj_id"][idx] == j]
        prompt = hashes[int(d["task"][rows[0]])]
        comp = torch.tensor(d["token_id"][rows], dtype=torch.long).view(1, -1)
        with torch.no_grad():
            lg = model(torch.cat([prompt, comp], 1)).logits[0, prompt.size(1) - 1:-1].double()  # temperature 1
        lp = torch.log_softmax(lg, -1)
        where = np.searchsorted(idx, rows)
        out[where] = lp.gather(1, comp.view(-1, 1)).squeeze(1).numpy()
        logits_all[where] = lg.numpy()
    return out, logits_all


@pytest.mark.parametrize("kind", ["grpo", "sdpo:topk_logits:0.5", "sdft"])
def test_step0_columns_equal_a_recomputation_with_the_initial_weights(runs, kind, model_dir):
    *_, dumps = runs[kind]
    d = read_dump(dumps)
    logp, logits = _step0_logps(model_dir, d, PROMPTS)
    sel0 = d["batch_id"] == 0
    assert np.allclose(d["logp"][sel0], logp, atol=2e-5, rtol=0)
    # SPEC 11: the student's next-token entropy from the logits that gave logp (float64 here, float32 dumped)
    lp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    ent = -(np.exp(lp) * lp).sum(1)
    assert d["entropy"].dtype == np.float32 and np.ptp(ent) > 1e-3
    np.testing.assert_allclose(d["entropy"][sel0], ent, atol=1e-5, rtol=0)
    assert np.array_equal(d["old_logp"], d["logp"])  # on-policy: TRL's old log-probs are the current ones
    assert (d["ratio"] == 1.0).all() and (d["c"] == 1.0).all()
    if kind == "grpo":
        assert np.isnan(d["teacher_logp"]).all() and (d["delta"] == 0).all() and (d["distill_term"] == 0).all()
    if kind == "sdft":
        assert (d["advantage"] == 0).all() and "reward" not in d
    else:  # GRPO advantage per prompt group from the recorded rewards: (r - mean) / (std + 1e-4)
        for b in range(3):
            s = d["batch_id"] == b
            first = {t: i for i, t in reversed(list(enumerate(d["traj_id"][s])))}
            rows = np.array(sorted(first.values()))
            r, a, task = d["reward"][s][rows], d["advantage"][s][rows], d["task"][s][rows]
            for t in np.unique(task):
                g = task == t
                want = (r[g] - r[g].mean()) / (r[g].std(ddof=1) + 1e-4)
                assert np.allclose(a[g], want, atol=1e-5)
    if kind.startswith("sdpo:topk"):
        # null exactly where the sampled token is outside the student's top-k at step 0
        top = np.argsort(-logits, axis=1)[:, :TOPK]
        inside = (top == d["token_id"][sel0][:, None]).any(1)
        assert np.array_equal(~np.isnan(d["teacher_logp"][sel0]), inside)
        known = ~np.isnan(d["teacher_logp"])
        assert known.any() and (~known).any()
        assert np.allclose(d["delta"][known], d["teacher_logp"][known] - d["logp"][known], atol=1e-6)
        assert (d["delta"][~known] == 0).all()


def test_sampled_token_distill_term_is_sdpo_reverse_kl_surrogate(runs):
    """sampled_token: term = (logp - teacher_logp) * logp on rows SDPO distils (a successful sibling), else 0."""
    *_, dumps = runs["sdpo:sampled_token:1.0"]
    d = read_dump(dumps)
    want = (d["logp"].astype(np.float64) - d["teacher_logp"]) * d["logp"]
    on = d["distill_term"] != 0
    assert on.any() and (~on).any()
    assert np.allclose(d["distill_term"][on], want[on], rtol=1e-4, atol=1e-6)
    # the distilled rows are whole completions: a row is distilled on every token or none
    for key in set(zip(d["batch_id"], d["traj_id"])):
        s = (d["batch_id"] == key[0]) & (d["traj_id"] == key[1])
        assert on[s].all() or not on[s].any()


def test_provenance_names_trainer_mode_weight_and_what_is_missing(runs):
    from icsd_audit.dumps.reader import read_metadata

    def meta(kind):
        return read_metadata(sorted(runs[kind][-1].glob("step*/*.parquet"))[0])

    m = meta("sdpo:topk_logits:0.5")
    p = m["producer"]
    assert (p["engine"], p["trainer"], p["distillation_mode"], p["distillation_topk"], p["distillation_weight"]) == (
        "trl", "SDPOTrainer", "topk_logits", TOPK, 0.5)
    assert m["allocator"]["allocator"] == "opsd" and m["allocator"]["lambda"] == 0.5
    assert "no_teacher" not in p and "no_advantage" not in p
    assert "without a teacher" in meta("grpo")["producer"]["no_teacher"]
    assert "without rewards or advantages" in meta("sdft")["producer"]["no_advantage"]
    assert meta("sdpo:sampled_token:1.0")["producer"]["distillation_weight"] == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_audit_commands_exit_0_on_recordings(runs, kind, tmp_path):
    from tests.cli.test_outputs import cli

    dumps = runs[kind][-1]
    v = cli("audit", "verify", str(dumps))
    assert v.returncode == 0, v.stdout + v.stderr
    if kind != "sdft":
        t = cli("audit", "tcm", str(dumps), "--resamples", "200")
        assert t.returncode == 0, t.stdout + t.stderr
    r = cli("audit", "report", str(dumps), "--out", str(tmp_path / "rep"), "--resamples", "200")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    if kind == "grpo":
        assert any("without a teacher" in why for why in summary["omitted"].values()), summary["omitted"]
    if kind == "sdft":
        assert any("without rewards or advantages" in why for why in summary["omitted"].values()), summary["omitted"]


def _laplace_trust(delta: list[float], eta: float = 0.4, eps: float = 1e-4, min_group: int = 8) -> list[float]:
    """SPEC 3's default trust of one batch, by hand: the asymmetric Laplace map fitted on its deltas."""
    x = sorted(delta)
    n = len(x)
    mu = x[n // 2] if n % 2 else 0.5 * (x[n // 2 - 1] + x[n // 2])
    lo = [mu - v for v in delta if v < mu]
    hi = [v - mu for v in delta if v >= mu]
    raw_lo, raw_hi = (sum(lo) / len(lo) if lo else 0.0), (sum(hi) / len(hi) if hi else 0.0)
    if n < min_group or not (raw_lo > eps or raw_hi > eps):
        mu, b_lo, b_hi = 0.0, 1.0, 1.0
    else:
        b_lo, b_hi = max(raw_lo, eps), max(raw_hi, eps)
    return [eta * np.exp((v - mu) / b_lo) if v < mu else 1 - (1 - eta) * np.exp(-(v - mu) / b_hi) for v in delta]


def test_sdft_recording_splits_the_mass_by_sign_of_delta(runs, tmp_path):
    """Without an advantage the audit still says where the mass goes by the sign of delta: the deployed uniform
    weighting against SDAR (SPEC 3's laplace trust, the recorded uniform one being OPSD itself), each share
    equal to a loop over the dump's own columns; the report shows the command's intervals."""
    from tests.cli.test_outputs import cli

    dumps = runs["sdft"][-1]
    res = cli("audit", "signs", str(dumps), "--json", "--resamples", "300")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["weightings"] == ["opsd", "sdar"] and got["settings"]["sdar"]["trust"] == "laplace"
    assert any("opsd's weighting itself" in n for n in got["notes"])
    assert any("needs an advantage" in n for n in got["notes"])  # the audit's pair compares ICSD
    assert "note: icsd needs an advantage" in res.stderr
    d = read_dump(dumps)
    assert (d["advantage"] == 0).all()
    sums = {w: {"positive": 0.0, "negative": 0.0, "zero": 0.0} for w in ("opsd", "sdar")}
    for b in sorted(set(d["batch_id"].tolist())):
        sel = np.flatnonzero((d["batch_id"] == b) & d["valid"])
        deltas = [float(v) for v in d["delta"][sel]]
        for v, g in zip(deltas, _laplace_trust(deltas)):
            s = "positive" if v > 0 else "negative" if v < 0 else "zero"
            sums["opsd"][s] += 1.0
            sums["sdar"][s] += g
    for w, by in sums.items():
        tot = sum(by.values())
        for s, v in by.items():
            if s in got["shares"][w]:
                assert got["shares"][w][s]["estimate"] == pytest.approx(v / tot, abs=1e-9), (w, s)
            else:
                assert v == 0.0
    assert got["shares"]["sdar"]["positive"]["estimate"] != pytest.approx(
        got["shares"]["opsd"]["positive"]["estimate"], abs=1e-3)  # the two weightings do differ here
    r = cli("audit", "report", str(dumps), "--out", str(tmp_path / "rep"), "--resamples", "300")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert "signs" not in summary["omitted"] and summary["signs"] == got
    assert "## Mass by sign of \u0394" in (tmp_path / "rep" / "summary.md").read_text()
    bad = cli("audit", "signs", str(dumps), "--compare", "icsd", "--json")
    assert bad.returncode == 2 and "--compare icsd needs an advantage" in bad.stderr and bad.stdout == ""


def test_sign_split_needs_a_teacher_and_runs_on_sdpo(runs, tmp_path):
    from tests.cli.test_outputs import cli

    bad = cli("audit", "signs", str(runs["grpo"][-1]), "--json")
    assert bad.returncode == 2 and "needs a teacher" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    ok = cli("audit", "signs", str(runs["sdpo:topk_logits:0.5"][-1]), "--json", "--resamples", "100")
    assert ok.returncode == 0, ok.stderr
    got = json.loads(ok.stdout)
    assert got["weightings"] == ["opsd", "icsd"] and got["notes"] == []
    # top-k mode: delta is 0 where the sampled token is outside the student's top-k (no teacher value)
    d = read_dump(runs["sdpo:topk_logits:0.5"][-1])
    assert got["tokens"]["zero"] == int((d["delta"] == 0).sum())


def test_record_refuses_twice_and_non_trainers(model_dir, tmp_path):
    tr = make_trainer("grpo", model_dir, tmp_path / "o")
    record(tr, tmp_path / "d")
    with pytest.raises(ValueError, match="already recorded"):
        record(tr, tmp_path / "d2")
    with pytest.raises(TypeError, match="not a TRL GRPOTrainer, SDPOTrainer or SDFTTrainer"):
        record(object(), tmp_path / "d3")


def test_newer_trl_warns_and_records(model_dir, tmp_path, monkeypatch):
    import trl

    tr = make_trainer("grpo", model_dir, tmp_path / "o")
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.warns(RuntimeWarning, match="TRL 1.17.0 is newer"):
        assert record(tr, tmp_path / "d") is tr


def test_record_draws_no_random_number_and_changes_no_setting(model_dir, tmp_path):
    tr = make_trainer("sdpo:topk_logits:1.0", model_dir, tmp_path / "o")
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), torch.get_num_threads(),
              torch.are_deterministic_algorithms_enabled(), torch.get_num_interop_threads())
    record(tr, tmp_path / "d")
    after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), torch.get_num_threads(),
             torch.are_deterministic_algorithms_enabled(), torch.get_num_interop_threads())
    assert torch.equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert before[2:] == after[2:]


def test_importing_the_module_draws_no_random_number():
    # TRL's own import draws from Python's random module: the user has imported it before ours
    code = ("import random, numpy as np, torch\nfrom trl import GRPOTrainer\n"
            "s = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), torch.get_num_threads(),"
            " torch.are_deterministic_algorithms_enabled())\n"
            "import icsd_audit.integrations.trl as t\n"
            "t.record\n"
            "a = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), torch.get_num_threads(),"
            " torch.are_deterministic_algorithms_enabled())\n"
            "assert torch.equal(s[0], a[0]) and np.array_equal(s[1], a[1]) and s[2:] == a[2:]\n"
            "print('ok')\n")
    with warnings.catch_warnings():
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_recorded_log_probs_are_trl_s_bit_for_bit():
    """The dump's logp and teacher_logp are TRL's selective_log_softmax values (the distillation term's inputs);
    the entropy is a float64 reference's to float32 precision, masked (-inf) logits included."""
    from trl.trainer.utils import selective_log_softmax

    from icsd_audit.integrations.trl.recorder import student_logps_and_entropy, token_logps

    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 7, 40, generator=g) * 4
    z[0, 0, :6] = float("-inf")
    ids = torch.randint(6, 40, (3, 7), generator=g)
    logp, ent = student_logps_and_entropy(z, ids)
    assert torch.equal(logp, selective_log_softmax(z, ids)) and torch.equal(token_logps(z, ids), logp)
    p = torch.softmax(z.double(), -1)
    want = -(p * torch.log(p).nan_to_num(neginf=0.0)).sum(-1)
    assert torch.allclose(ent.double(), want, atol=2e-6, rtol=0)


def test_in_topk_equals_torch_topk_membership_ties_included():
    from icsd_audit.integrations.trl.recorder import in_topk

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 30, 50, generator=g)
    z[0, 0, :] = 0.0  # every logit tied
    z[1, :, :10] = 3.0  # ten tied at the top, across the k-th place for k = 5
    ids = torch.randint(0, 50, (4, 30), generator=g)
    ids[1, :5] = torch.arange(5)
    for k in (1, 5, 10, 25, 50):
        want = (torch.topk(z, k, dim=-1).indices == ids.unsqueeze(-1)).any(-1)
        assert torch.equal(in_topk(z, ids, k), want), k


def test_two_processes_record_a_shard_per_rank_and_train_unchanged(model_dir, tmp_path):
    """SDPO on two CPU processes (torchrun, gloo): with and without record the parameters are bit-identical;
    each step is one folder per rank, trajectory ids are unique over the ranks, and the audit reads them."""
    from tests.cli.test_outputs import cli

    worker = os.path.join(os.path.dirname(__file__), "trl_record_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    for rec in ("0", "1"):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker,
                            str(tmp_path / rec), str(model_dir), rec], capture_output=True, text=True, env=env,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = torch.load(tmp_path / "0" / "params.pt"), torch.load(tmp_path / "1" / "params.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    dumps = tmp_path / "1" / "dumps"
    assert sorted(p.name for p in dumps.iterdir()) == [f"step{s:06d}-r{r:05d}" for s in range(3) for r in range(2)]
    d = read_dump(dumps)
    for s in range(3):
        sel = d["batch_id"] == s
        assert len(set(d["traj_id"][sel])) == 8  # 4 completions on each of 2 ranks, none shared
    from icsd_audit.dumps.reader import read_metadata

    ranks = {read_metadata(p)["producer"]["rank"] for p in dumps.glob("step*/*.parquet")}
    assert ranks == {0, 1}
    v = cli("audit", "verify", str(dumps))
    assert v.returncode == 0, v.stdout + v.stderr
    t = cli("audit", "tcm", str(dumps), "--resamples", "200")
    assert t.returncode == 0, t.stdout + t.stderr


def test_bad_value_names_trainer_key_and_row(model_dir, tmp_path):
    from icsd_audit.integrations.checks import BatchInputError
    from icsd_audit.integrations.trl.recorder import recorder_of

    tr = record(make_trainer("sdpo:sampled_token:1.0", model_dir, tmp_path / "o"), tmp_path / "d")
    B, T = 2, 3
    inputs = {"completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": torch.ones(B, T),
              "prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2)}
    adv = torch.tensor([0.5, float("nan")])
    with pytest.raises(BatchInputError, match=r"SDPOTrainer \(record, step 0\): inputs\['advantages'\] is nan at row 1"):
        recorder_of(tr).add(inputs=inputs, logp=torch.full((B, T), -1.0), teacher_logp=torch.full((B, T), -2.0),
                            term=None, advantage=adv, reward=None)
    assert recorder_of(tr).pending == []


def test_gradient_accumulation_writes_one_folder_per_optimizer_step(model_dir, tmp_path):
    """Two micro-batches per optimizer step: both land in the step's one folder, as distinct trajectories."""
    kind = "sdpo:topk_logits:0.5"
    plain = make_trainer(kind, model_dir, tmp_path / "plain")
    plain.args.gradient_accumulation_steps = 2
    plain.train()
    tr = make_trainer(kind, model_dir, tmp_path / "rec")
    tr.args.gradient_accumulation_steps = 2
    record(tr, tmp_path / "dumps").train()
    a, b = params(plain), params(tr)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == [f"step{k:06d}-r00000" for k in range(3)]
    d = read_dump(tmp_path / "dumps")
    for s in range(3):
        assert len(set(d["traj_id"][d["batch_id"] == s])) == 16  # 2 micro-batches x 8 completions


def test_sequence_level_ratio_is_the_completions_mean_log_ratio(model_dir, tmp_path):
    """importance_sampling_level='sequence' (GSPO): the recorded ratio is TRL's per-completion exp(mean log-ratio)."""
    from icsd_audit.integrations.trl.recorder import recorder_of

    tr = record(make_trainer("grpo", model_dir, tmp_path / "o"), tmp_path / "d")
    tr.importance_sampling_level = "sequence"
    B, T = 2, 4
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.5, -2.0, -2.0, 9.0], [-1.2, -1.0, -0.8, -1.0]])
    inputs = {"completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask,
              "prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "old_per_token_logps": old}
    recorder_of(tr).add(inputs=inputs, logp=logp, teacher_logp=None, term=None, advantage=torch.tensor([1.0, -1.0]),
                        reward=None)
    ratio = recorder_of(tr).pending[0]["ratio"]
    want = [np.exp((0.5 + 0.0 - 1.0) / 3)] * 3 + [np.exp(0.0)] * 4  # row 1: (0.2 + 0 - 0.2) / 4
    assert np.allclose(ratio, want, atol=1e-6)

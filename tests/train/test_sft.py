"""``icsd sft``: the expert's turns in the trainer's prompts, the held-out split, the loss, the warm start it writes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="peft not installed: pip install -e '.[train]'")

from icsd_audit.train.config import TrainConfig, from_preset  # noqa: E402
from icsd_audit.train.sft import SFTConfig, SFTExample, batch_gradients, lr_at, reply_nll, train_tasks  # noqa: E402


def _icsd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ICSD_THREADS": "1"}, cwd=cwd)


def _tiny():
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    model, tok = tiny_random_causal_lm(seed=0)
    return model.eval(), tok


def _rows() -> list[SFTExample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for k, (p, r) in enumerate([(7, 3), (12, 5), (4, 1), (9, 6)]):
        out.append(SFTExample(task=k, turn=0, prompt_ids=torch.randint(3, 200, (p,), generator=g).tolist(),
                              reply_ids=torch.randint(3, 200, (r,), generator=g).tolist()))
    return out


def _reference_nll(model, row: SFTExample, temperature: float) -> torch.Tensor:
    """One row alone, no padding: -sum log softmax(logits / T) of the reply tokens, read at the previous position."""
    ids = torch.tensor([row.prompt_ids + row.reply_ids])
    logits = model(input_ids=ids).logits[0].float() / temperature
    p = len(row.prompt_ids)
    logp = torch.log_softmax(logits[p - 1:p - 1 + len(row.reply_ids)], dim=-1)
    return -logp.gather(-1, torch.tensor(row.reply_ids)[:, None]).sum()


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reply_nll_is_the_per_row_reply_loss_without_padding(temperature):
    model, _ = _tiny()
    rows = _rows()
    with torch.no_grad():
        got, n = reply_nll(model, rows, pad_id=0, device=torch.device("cpu"), temperature=temperature)
        want = sum(_reference_nll(model, r, temperature) for r in rows)
    assert n == 3 + 5 + 1 + 6  # prompt tokens carry no loss
    assert float(got) == pytest.approx(float(want), rel=1e-5)


def test_accumulated_gradient_is_the_batch_token_mean_for_any_micro_batch():
    model, _ = _tiny()
    rows = _rows()
    params = [p for p in model.parameters() if p.requires_grad]
    # reference: one autograd pass over the rows one by one, summed and divided by all reply tokens
    loss = sum(_reference_nll(model, r, 1.0) for r in rows) / sum(len(r.reply_ids) for r in rows)
    want = torch.autograd.grad(loss, params)
    for micro, recompute in [(1, False), (3, True), (4, False)]:
        model.zero_grad(set_to_none=True)
        total, n_tok = batch_gradients(model, rows, [0, 1, 2, 3], micro_batch_rows=micro, pad_id=0,
                                       device=torch.device("cpu"), temperature=1.0, recompute_activations=recompute)
        assert n_tok == 15 and total / n_tok == pytest.approx(float(loss.detach()), rel=1e-5)
        for p, w in zip(params, want):
            torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine():
    # 10 steps, warm-up share 0.2: 2 warm-up steps, then cosine over the 8 others
    assert lr_at(0, 10, lr=1.0, warmup=0.2) == pytest.approx(0.5)
    assert lr_at(1, 10, lr=1.0, warmup=0.2) == pytest.approx(1.0)
    assert lr_at(2, 10, lr=1.0, warmup=0.2) == pytest.approx(1.0)
    assert lr_at(6, 10, lr=1.0, warmup=0.2) == pytest.approx(0.5)
    assert lr_at(9, 10, lr=2.0, warmup=0.2) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lr_at(0, 4, lr=3.0, warmup=0.0) == pytest.approx(3.0)


def test_prompt_changes_name_what_differs_from_the_fitted_prompts():
    from icsd_audit.train.sft import prompt_changes, prompt_settings

    cfg = from_preset("cpu-demo", model="tiny-random")
    fitted = prompt_settings(cfg)
    assert prompt_changes(fitted, cfg) is None and prompt_changes(None, cfg) is None
    assert prompt_changes(fitted, cfg.replace(max_turns=9, temperature=0.3)) is None  # no prompt changes
    old, new = prompt_changes(fitted, cfg.replace(history_window=3, one_shot=not cfg.one_shot))
    assert old == f"history_window={cfg.history_window}, one_shot={cfg.one_shot}"
    assert new == f"history_window=3, one_shot={not cfg.one_shot}"


def test_config_validation_names_each_problem():
    from icsd_audit.train.config import ConfigError

    with pytest.raises(ConfigError) as e:
        SFTConfig(episodes=0, lr=float("nan"), micro_batch_rows=9, batch_rows=4, warmup=1.0).validate()
    text = str(e.value)
    for part in ("episodes=0", "lr=nan", "micro_batch_rows=9 exceeds batch_rows=4", "warmup=1.0"):
        assert part in text


# ----------------------------------------------------------------------------- the data


def test_train_tasks_are_distinct_seeded_and_bounded():
    a, b = train_tasks(100, 10, 0), train_tasks(100, 10, 1)
    assert len(set(a)) == 10 and a == sorted(a) and a == train_tasks(100, 10, 0) and a != b
    assert all(0 <= t < 100 for t in a)
    with pytest.raises(ValueError, match="exceeds the 5 tasks"):
        train_tasks(5, 6, 0)


def test_expert_examples_are_the_training_loops_own_prompts(tmp_path):
    """The turns ``icsd sft`` trains on equal, token for token, what ``icsd train --policy expert`` renders
    and writes to turns.jsonl for the same tasks: the trainer's student prompts, no privileged block."""
    from icsd_audit.train.rollout.policy import policy_tokenizer
    from icsd_audit.train.rollout.policy_run import play
    from icsd_audit.train.rollout.collect import PromptBuilder
    from icsd_audit.train.sft import _play_expert

    cfg = from_preset("cpu-demo", model="tiny-random", out_dir=str(tmp_path / "play"), total_steps=1,
                                  n_tasks=3, group_size=2, max_turns=6, max_prompt_tokens=8192, policy="expert")
    play(cfg)
    lines = [json.loads(s) for s in (tmp_path / "play" / "turns.jsonl").read_text().splitlines()]
    lines = [ln for ln in lines if ln["rollout"] == 0]  # the expert plays a group's rollouts alike
    tasks = sorted({ln["task"] for ln in lines})
    tok = policy_tokenizer("tiny-random")
    builder = PromptBuilder.from_config(tok, cfg)
    turns = _play_expert(cfg, tokenizer=tok, builder=builder, split="train", tasks=tasks)
    by_key = {(ln["task"], ln["turn"]): ln for ln in lines}
    assert len(turns) == len(lines) and {(t.task, t.turn) for t in turns} == set(by_key)
    for t in turns:
        ln = by_key[(t.task, t.turn)]
        assert tok.decode(t.prompt_ids) == ln["prompt"] == t.prompt_text  # nothing cut at 8192 tokens
        assert t.reply == ln["reply"] and t.valid == ln["valid"] is True
        assert t.reply_ids == list(tok(t.reply, add_special_tokens=False).input_ids) + [tok.eos_token_id]
        assert "[Privileged Skill Information]" not in ln["prompt"]
    assert all(t.won for t in turns)  # 6 turns suffice for every generated goal's expert path


def test_collect_data_holds_out_the_eval_splits_first_tasks():
    from icsd_audit.train.rollout.policy import policy_tokenizer
    from icsd_audit.train.rollout.collect import PromptBuilder
    from icsd_audit.train.sft import collect_data

    cfg = from_preset("cpu-demo", model="tiny-random", max_turns=5)
    tok = policy_tokenizer("tiny-random")
    data = collect_data(cfg, SFTConfig(episodes=5, heldout_episodes=3), tokenizer=tok,
                        builder=PromptBuilder.from_config(tok, cfg))
    s = data.summary
    assert s["heldout_tasks"] == [0, 1, 2] and s["heldout_split"] == "eval" and s["train_split"] == "train"
    assert {r.task for r in data.train} == set(train_tasks(1900, 5, 0))
    assert {r.task for r in data.heldout} == {0, 1, 2}
    assert s["train"]["episodes"] == 5 and s["train"]["valid_turns"] == len(data.train)
    assert s["train"]["reply_tokens"] == sum(len(r.reply_ids) for r in data.train)
    assert s["heldout"]["valid_turns"] == len(data.heldout)
    # tiny-random's byte tokens: replies are longer than cpu-demo's budget and the run says so
    assert s["train"]["replies_over_max_response_tokens"] == sum(len(r.reply_ids) > cfg.max_response_tokens
                                                                  for r in data.train)


# ----------------------------------------------------------------------------- the command


SFT = ("--model", "tiny-random", "--episodes", "4", "--heldout-episodes", "2", "--tasks", "2", "--epochs", "2",
       "--batch-rows", "4", "--micro-batch-rows", "2", "--lr", "1e-2", "--lora", "4", "--set", "max_turns=3",
       "--set", "max_prompt_tokens=160")


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "warm"
    r = _icsd("sft", *SFT, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warm start written to" in r.stdout
    return out


def test_sft_writes_an_adapter_and_its_report(sft_dir):
    from icsd_audit.train.sft import PROMPT_FIELDS

    names = sorted(p.name for p in sft_dir.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "icsd_adapter.json", "sft.json",
                     "sft_metrics.jsonl"]
    meta = json.loads((sft_dir / "icsd_adapter.json").read_text())
    assert meta["base_model"] == "tiny-random" and meta["producer"] == "icsd sft" and meta["env"] == "webshop"
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "targets": "all-linear"}
    rep = json.loads((sft_dir / "sft.json").read_text())
    assert set(rep["prompts"]) == set(PROMPT_FIELDS) and rep["prompts"]["max_turns"] == 3
    assert rep["prompts"] == meta["prompts"]
    assert [e["epoch"] for e in rep["epochs"]] == [0, 1, 2] and rep["epochs"][0]["train_loss"] is None
    steps = [json.loads(s) for s in (sft_dir / "sft_metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if s["kind"] == "step"]
    per_epoch = math.ceil(rep["data"]["train"]["valid_turns"] / 4)
    assert len(train_steps) == 2 * per_epoch and [s["step"] for s in train_steps] == list(range(1, 2 * per_epoch + 1))
    # an epoch's train loss is the token-weighted mean of its steps' losses
    ep1 = [s for s in train_steps if s["epoch"] == 1]
    want = sum(s["loss"] * s["tokens"] for s in ep1) / sum(s["tokens"] for s in ep1)
    assert rep["epochs"][1]["train_loss"] == pytest.approx(want, rel=1e-9)
    assert rep["epochs"][2]["train_loss"] < rep["epochs"][1]["train_loss"]  # lr 1e-2 on 4 episodes: it fits
    assert rep["eval"]["n_tasks"] == 2 and rep["kind"] == "lora" and rep["load_average"]["start"]
    assert oct((sft_dir / "adapter_model.safetensors").stat().st_mode & 0o777) != "0o600"


def test_icsd_eval_of_the_adapter_reproduces_the_reported_success(sft_dir):
    """The success in sft.json is icsd eval's: the saved adapter, evaluated by `icsd eval --adapter`, gives it again."""
    rep = json.loads((sft_dir / "sft.json").read_text())
    r = _icsd("eval", "--adapter", str(sft_dir), "--tasks", "2", "--set", "max_turns=3", "--set",
              "max_prompt_tokens=160")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    for k in ("success", "score", "invalid_rate", "turns", "n_tasks"):
        assert got[k] == rep["eval"][k], k


def test_train_init_continues_the_warm_start(sft_dir, tmp_path):
    r = _icsd("train", "--init", str(sft_dir), "--steps", "1", "--out", str(tmp_path / "run"), "--plain",
              "--set", "max_turns=3", "--set", "max_prompt_tokens=160", "--set", "n_tasks=1",
              "--set", "group_size=2", "--set", "max_response_tokens=8", "--sketch-k", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    # the warm start's replies were fitted under the preset's 96-token limit: the run says it departs from it
    assert "fitted to prompts with max_response_tokens=96; this run uses max_response_tokens=8" in r.stderr
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["init"] == str(sft_dir) and cfg["model"] == "tiny-random"
    (ckpt,) = (tmp_path / "run" / "checkpoints").iterdir()
    meta = json.loads((ckpt / "icsd_adapter.json").read_text())
    assert meta["init"] == str(sft_dir) and meta["lora"]["rank"] == 4


def test_sft_refuses_an_existing_folder_and_overwrite_moves_it_aside(sft_dir, tmp_path):
    out = tmp_path / "warm"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _icsd("sft", *SFT, "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "exists" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    r = _icsd("sft", *SFT, "--epochs", "1", "--tasks", "0", "--out", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("warm.old-")]
    assert len(aside) == 1 and (aside[0] / "keep.txt").read_text() == "mine"
    assert (out / "sft.json").is_file() and json.loads((out / "sft.json").read_text())["eval"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


@pytest.mark.parametrize("args, says", [
    (("--episodes", "0"), "episodes=0"),
    (("--episodes", "5000"), "exceeds the 1900 tasks"),
    (("--set", "history_window=-1"), "history_window"),
])
def test_sft_bad_input_is_one_line(tmp_path, args, says):
    r = _icsd("sft", "--model", "tiny-random", *args, "--out", str(tmp_path / "w"))
    assert r.returncode == 2 and says in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (tmp_path / "w").exists() and not list(tmp_path.iterdir())


def test_full_fine_tuning_writes_a_model_folder_that_init_takes(tmp_path):
    out = tmp_path / "full"
    r = _icsd("sft", *SFT, "--epochs", "1", "--tasks", "0", "--lora", "0", "--lr", "1e-4", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "sft.json"} <= names and "adapter_config.json" not in names
    assert json.loads((out / "sft.json").read_text())["kind"] == "full"
    cfg = from_preset("cpu-demo", model="tiny-random", init=str(out)).validate()
    assert not cfg.lora_enabled


# ----------------------------------------------------------------------------- shipped warm starts: init=warmstart:NAME


@pytest.fixture()
def shipped(tmp_path, monkeypatch, sft_dir) -> str:
    """A warm-starts folder holding the test's adapter as 'demo' (the tiny-random base)."""
    import shutil

    from icsd_audit.train.config import warmstarts

    root = tmp_path / "warmstarts"
    shutil.copytree(sft_dir, root / "demo")
    monkeypatch.setattr(warmstarts, "warm_starts_dir", lambda: root)
    return str(root / "demo")


def test_warmstart_reference_resolves_to_the_shipped_folder(shipped):
    from icsd_audit.train.config import ConfigError, resolve_init, shipped_warm_starts

    assert shipped_warm_starts() == ["demo"]
    assert resolve_init("warmstart:demo") == shipped and resolve_init("runs/x") == "runs/x" and resolve_init(None) is None
    for bad in ("warmstart:nope", "warmstart:", "warmstart:../demo"):
        with pytest.raises(ConfigError, match="shipped: warmstart:demo"):
            resolve_init(bad)
    cfg = from_preset("cpu-demo", model="tiny-random", init="warmstart:demo").validate()
    assert cfg.init == "warmstart:demo" and cfg.init_path == shipped and cfg.lora_enabled
    assert cfg.input_paths()["init folder"] == shipped  # an --out inside it is refused
    assert "no shipped warm start" in str(pytest.raises(ConfigError, from_preset("cpu-demo",
                                                                                             init="warmstart:x").validate).value)


def test_a_presets_warm_start_is_kept_for_its_base_and_dropped_for_another(shipped, monkeypatch):
    from icsd_audit.train import config

    monkeypatch.setitem(config.PRESETS, "demo-warm", lambda: config.preset("cpu-demo").replace(
        model="tiny-random", init="warmstart:demo"))
    assert config.from_preset("demo-warm").init == "warmstart:demo"
    assert config.from_preset("demo-warm", model="tiny-random").init == "warmstart:demo"
    assert config.from_preset("demo-warm", model="embedded").init is None  # another base: its own weights
    assert config.from_preset("demo-warm", model="embedded", init="x").init == "x"  # explicit wins


def test_the_shipped_webshop_warm_start_fits_the_presets_that_start_from_it():
    """cpu-demo and cpu-study start from the shipped adapter, whose prompts are theirs (no note at start-up), which
    is a rank-4 adapter of the embedded model under 10 MB; another --model drops it."""
    from icsd_audit.train.config import CPU_WARM_START, preset, resolve_init
    from icsd_audit.train.models.lora import adapter_settings, read_adapter_meta
    from icsd_audit.train.sft import prompt_changes

    folder = Path(resolve_init(CPU_WARM_START))
    meta = read_adapter_meta(str(folder))
    assert meta["base_model"] == "embedded" and meta["env"] == "webshop" and adapter_settings(folder).rank == 4
    assert sum(p.stat().st_size for p in folder.iterdir()) < 10 * 2 ** 20
    for name in ("cpu-demo", "cpu-study"):
        cfg = preset(name).validate()
        assert cfg.init == CPU_WARM_START and cfg.lora_enabled and cfg.env == "webshop"
        assert prompt_changes(meta["prompts"], cfg) is None
        assert from_preset(name, model="tiny-random").init is None
    report = json.loads((folder / "sft.json").read_text())
    assert report["epochs"][-1]["heldout_loss"] < report["epochs"][0]["heldout_loss"]

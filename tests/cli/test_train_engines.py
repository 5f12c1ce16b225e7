"""`icsd train --engine ...`: engine choice, the verl command, and the one-line stop without GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from icsd_audit.integrations.verl.launch import verl_overrides, write_verl_command
from icsd_audit.train.config import TrainConfig


def _icsd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "icsd_audit.cli", *args], capture_output=True, text=True, timeout=300)


def test_unknown_engine_is_one_line_exit_2():
    r = _icsd("train", "--engine", "megatron", "--preset", "cpu-demo")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --engine 'megatron': choose one of builtin, trl, verl"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stop on a machine without GPUs")
def test_verl_without_gpus_stops_with_one_line(tmp_path):
    import time

    t0 = time.perf_counter()
    r = _icsd("train", "--engine", "verl", "--preset", "cpu-demo", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and time.perf_counter() - t0 < 120  # seconds on an idle box; no Ray, no hang
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: icsd train --engine verl needs ")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # nothing written


def test_verl_command_carries_the_run_settings(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), allocator="sdar", distill_coef=0.02, group_size=8, n_tasks=16,
                      mini_batch_rows=512, model="/models/qwen")
    ovr = verl_overrides(cfg, n_gpus=4)
    assert "trainer.v1.trainer_mode=icsd_sync" in ovr and "actor_rollout_ref.actor.shuffle=false" in ovr
    assert "+icsd.allocator=sdar" in ovr and "+icsd.distill_coef=0.02" in ovr
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=16" in ovr  # 512 rows / 8 rollouts, capped at 16 prompts
    cfg2 = TrainConfig(out_dir=str(tmp_path / "r2"), group_size=8, n_tasks=128, mini_batch_rows=512)
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=64" in verl_overrides(cfg2)
    assert "trainer.n_gpus_per_node=4" in ovr and "actor_rollout_ref.model.path=/models/qwen" in ovr
    assert ovr[:2] == ["algorithm.adv_estimator=gigpo", "algorithm.gamma=0.95"]  # TrainConfig's default estimator
    assert ovr[-2:] == ["+icsd.step_weight=1.0", "+icsd.gigpo_mode=mean_norm"]
    grpo = verl_overrides(TrainConfig(out_dir=str(tmp_path / "r3"), adv_estimator="grpo", norm_adv_by_std=False))
    assert grpo[:2] == ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false"]
    assert not any("gamma" in o or "step_weight" in o or "gigpo" in o for o in grpo)
    assert f"data.train_files={tmp_path}/run/data/train.parquet" in ovr
    assert f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/run/agent_loops.yaml" in ovr
    assert "actor_rollout_ref.rollout.agent.default_agent_loop=icsd_env" in ovr
    assert "+icsd.alloc_scope=mini-batch" in ovr
    # the embedded model is exported into the run folder, never replaced by another model
    emb = verl_overrides(TrainConfig(out_dir=str(tmp_path / "r4"), model="embedded"))
    assert f"actor_rollout_ref.model.path={tmp_path}/r4/model" in emb
    assert not any("Qwen" in o for o in emb)
    path = write_verl_command(cfg, n_gpus=4)
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "python -m verl.trainer.main_ppo \\" in text
    assert [p.name for p in path.parent.iterdir()] == ["verl_command.sh"]  # no temporary left behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stop on a machine without GPUs")
def test_dry_run_writes_the_envs_data_model_agent_loop_and_a_command_that_stops_without_gpus(tmp_path):
    """The issue's case: --env alfworld --dry-run on a machine without GPUs (and without the ALFWorld engine)."""
    import json
    import time

    import pyarrow.parquet as pq

    run = tmp_path / "run"
    r = _icsd("train", "--engine", "verl", "--env", "alfworld", "--dry-run", "--model", "tiny-random",
              "--out", str(run), "--set", "eval_tasks=6")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in run.iterdir() if p.name != ".icsd-run.lock") == [
        "agent_loops.yaml", "config.json", "data", "model", "verl_command.sh"]
    assert json.loads((run / "config.json").read_text())["env"] == "alfworld"
    train, test = pq.read_table(run / "data" / "train.parquet"), pq.read_table(run / "data" / "test.parquet")
    assert train.num_rows > 100 and test.num_rows == 6
    assert set(train.column("data_source").to_pylist()) == {"icsd/alfworld"}
    text = (run / "verl_command.sh").read_text()
    assert f"actor_rollout_ref.model.path={(run / 'model').resolve()}" in text
    assert (run / "model" / "config.json").exists()
    assert f"data.train_files={(run / 'data').resolve()}/train.parquet" in text
    assert f"run_config: \"{(run / 'config.json').resolve()}\"" in (run / "agent_loops.yaml").read_text()
    t0 = time.perf_counter()  # the command itself stops before Ray on a machine without GPUs
    c = subprocess.run(["bash", str(run / "verl_command.sh")], capture_output=True, text=True, timeout=120)
    assert c.returncode == 2 and time.perf_counter() - t0 < 60
    assert c.stderr.strip().splitlines() == ["error: this verl run needs 1 NVIDIA GPU(s) and torch sees 0; "
                                             "see docs/engines.md"]


def test_dry_run_names_a_local_model_folder_as_given(tmp_path):
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    folder = tmp_path / "my-model"
    m, tok = tiny_random_causal_lm(seed=3)
    m.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    run = tmp_path / "run"
    r = _icsd("train", "--engine", "verl", "--env", "searchqa", "--dry-run", "--model", str(folder), "--gpus", "2",
              "--out", str(run))
    assert r.returncode == 0, r.stderr
    text = (run / "verl_command.sh").read_text()
    assert f"actor_rollout_ref.model.path={folder.resolve()}" in text and "trainer.n_gpus_per_node=2" in text
    assert not (run / "model").exists()
    again = _icsd("train", "--engine", "verl", "--env", "searchqa", "--dry-run", "--model", str(folder), "--out", str(run))
    assert again.returncode == 2 and "holds another run" in again.stderr  # one run per folder, as the built-in loop


def test_dry_run_is_a_verl_option():
    r = _icsd("train", "--engine", "builtin", "--dry-run")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --dry-run and --gpus are options of --engine verl, not --engine builtin"]


@pytest.mark.engines
def test_verl_overrides_are_valid_for_verls_config(tmp_path):
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    import os

    from hydra import compose, initialize_config_dir
    import verl

    from icsd_audit.integrations.verl.trainer import ICSDVerlConfig

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    for est, extra in (("gigpo", dict(gamma=0.9, step_weight=0.4, gigpo_mode="mean_std_norm")), ("grpo", {})):
        cfg = TrainConfig(out_dir=str(tmp_path / est), model="/models/qwen", adv_estimator=est, **extra)
        ovr = [o for o in verl_overrides(cfg) if not o.startswith("data.") or "batch_size" in o or "length" in o]
        assert any("agent_loop_config_path" in o for o in ovr)
        with initialize_config_dir(config_dir=d, version_base=None):
            c = compose(config_name="ppo_trainer", overrides=ovr)
        assert c.trainer.v1.trainer_mode == "icsd_sync" and c.icsd.skillbank == "webshop"
        assert c.actor_rollout_ref.rollout.agent.default_agent_loop == "icsd_env"
        assert c.algorithm.adv_estimator == est
        icsd = ICSDVerlConfig.from_config(c.icsd)  # every +icsd option is one the trainer knows
        if est == "gigpo":
            assert c.algorithm.gamma == 0.9 and (icsd.step_weight, icsd.gigpo_mode) == (0.4, "mean_std_norm")
        else:
            assert c.algorithm.gamma == 1.0 and c.algorithm.norm_adv_by_std_in_grpo is True


def test_trl_engine_checks_that_trl_is_installed_first(tmp_path):
    """cpu-demo's estimator is GiGPO: without TRL the first line says TRL is missing, not the estimator."""
    import importlib.util

    if importlib.util.find_spec("trl") is not None:
        pytest.skip("TRL is installed here: the check this test is about cannot fire")
    r = _icsd("train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random", "--out", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: icsd train --engine trl needs TRL: pip install 'icsd-audit[trl]'"]
    assert not (tmp_path / "run").exists()


@pytest.mark.engines
def test_trl_engine_refuses_an_explicit_gigpo_in_one_line(tmp_path):
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    r = _icsd("train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random", "--adv", "gigpo",
              "--out", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: icsd train --engine trl runs GRPO (one advantage per episode), not adv_estimator='gigpo': "
        "pass --adv grpo, or use --engine builtin or verl for GiGPO"]
    assert not (tmp_path / "run").exists()


@pytest.mark.engines
def test_trl_engine_trains_whole_episodes_and_audit_coeffs_recomputes_them(tmp_path):
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    import numpy as np
    import pyarrow.parquet as pq

    import json

    from icsd_audit.train.run.checkpoint import latest_checkpoint
    from icsd_audit.train.config import TrainConfig

    run = tmp_path / "run"
    # no --adv: the preset's GiGPO becomes GRPO with one line
    r = _icsd("train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random",
              "--steps", "2", "--out", str(run), "--set", "n_tasks=2", "--set", "group_size=2", "--set", "max_turns=3",
              "--set", "max_response_tokens=8", "--set", "max_prompt_tokens=3000", "--set", "one_shot=false")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    assert ("icsd train --engine trl: GRPO advantages (one per episode; TRL has no GiGPO) instead of the preset's "
            "adv_estimator='gigpo'") in lines
    assert not any(line.startswith("{") for line in lines)  # no raw TRL dicts
    # the built-in loop's run folder, key names and per-step lines
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == [
        "checkpoints", "config.json", "dumps", "metrics.jsonl", "run.json", "trl"]
    assert TrainConfig.from_dict(json.loads((run / "config.json").read_text())).adv_estimator == "grpo"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [0, 1]
    for x in recs:  # the random model never ends an episode and 3000 tokens hold three turns: 3 turns each
        assert x["rollout/turns"] == 3 and x["rollout/success"] == 0 and 0 <= x["rollout/invalid_rate"] <= 1
        assert {"actor/kl", "actor/clip_frac", "actor/aux_loss", "alloc/tcm", "alloc/tcm_trust", "time/step",
                "time/rollout", "trl/reward"} <= set(x)
    steps = [line.split("] ", 1)[1] for line in lines if "] step " in line]
    assert [s.split(":")[0] for s in steps] == ["step 0", "step 1"]
    from icsd_audit.train.run.metrics import summary_line

    assert [s.split(", ETA")[0] for s in steps] == [summary_line(x["step"], x) for x in recs]
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and ckpt.name == "step-000001" and (ckpt / "config.json").exists()
    shards = sorted((run / "dumps").rglob("*.parquet"))
    assert [p.name for p in shards] == ["part-000000-r00000.parquet", "part-000001-r00000.parquet"]
    for k, p in enumerate(shards):
        t = pq.read_table(p)
        traj, turn = t.column("traj_id").to_numpy() - (k << 24), t.column("turn_id").to_numpy()
        assert sorted(set(traj.tolist())) == [0, 1, 2, 3]  # 2 tasks x 2 episodes, one TRL row each
        for j in range(4):
            counts = np.bincount(turn[traj == j])
            assert len(counts) == 3 and (counts >= 1).all() and (counts <= 8).all()  # each turn: 1-8 reply tokens
            assert (np.diff(turn[traj == j]) >= 0).all()
    out = tmp_path / "c.parquet"
    a = _icsd("audit", "coeffs", str(run / "dumps"), "--out", str(out), "--min-group", "8")
    assert a.returncode == 0, a.stderr
    rec = pq.read_table(out).column("c").to_numpy().astype(np.float32)
    assert np.array_equal(rec, np.concatenate([pq.read_table(p).column("c").to_numpy() for p in shards]))


@pytest.mark.engines
def test_trl_engine_with_lora_trains_the_adapter_and_audit_coeffs_recomputes(tmp_path):
    """--lora R on TRL: TRL wraps the model (reference = adapter off, no saved copy of the policy)."""
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    import numpy as np
    import pyarrow.parquet as pq

    from icsd_audit.integrations.trl.engine import _trl_policy

    run = tmp_path / "run"
    r = _icsd("train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random", "--adv", "grpo",
              "--lora", "4", "--steps", "1", "--out", str(run), "--set", "n_tasks=2", "--set", "group_size=2",
              "--set", "max_turns=2", "--set", "max_response_tokens=8", "--set", "max_prompt_tokens=3000",
              "--set", "one_shot=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / "trl" / "initial_policy").exists()  # no second copy of the weights for the reference
    shards = sorted((run / "dumps").rglob("*.parquet"))
    assert len(shards) == 1
    out = tmp_path / "c.parquet"
    a = _icsd("audit", "coeffs", str(run / "dumps"), "--out", str(out), "--min-group", "8")
    assert a.returncode == 0, a.stderr
    assert np.array_equal(pq.read_table(out).column("c").to_numpy().astype(np.float32),
                          pq.read_table(shards[0]).column("c").to_numpy())
    # a fresh adapter is TRL's peft_config; a warm start hands TRL the adapter model (TRL copies it as 'ref')
    cfg = TrainConfig(model="tiny-random", lora_rank=4, lora_alpha=16.0, lora_targets="q_proj,v_proj")
    model, _, peft_config = _trl_policy(cfg, torch.device("cpu"))
    assert peft_config.r == 4 and peft_config.lora_alpha == 16.0 and set(peft_config.target_modules) == {"q_proj", "v_proj"}
    from icsd_audit.train.models import lora as lo

    adapter = tmp_path / "adapter"
    lo.AdapterSaver(lo.add_adapter(model, lo.LoraSettings(4, 8.0, "all-linear")),
                    lo.adapter_meta(base_model="tiny-random", base_seed=0, settings=lo.LoraSettings(4, 8.0, "all-linear"),
                                    producer="test")).save_pretrained(str(adapter))
    warm, _, none = _trl_policy(TrainConfig(model="tiny-random", init=str(adapter)), torch.device("cpu"))
    assert none is None and {n for n, p in warm.named_parameters() if p.requires_grad} and all(
        "lora_" in n for n, p in warm.named_parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- TRL: resume and signals

TRL_TINY = ["train", "--engine", "trl", "--preset", "cpu-demo", "--model", "tiny-random", "--adv", "grpo", "--plain",
            "--set", "n_tasks=2", "--set", "group_size=2", "--set", "max_turns=2", "--set", "max_response_tokens=8",
            "--set", "max_prompt_tokens=3000", "--set", "one_shot=false", "--set", "checkpoint_every=1"]

#: the CLI with a dump writer that sends SIGTERM to its own process right after the shard of step 1 is written
TRL_STOP = r"""
import os, signal, sys
from icsd_audit.dumps import writer as w
write = w.DumpWriter.write
def patched(self, **kw):
    path = write(self, **kw)
    if int(kw["batch_id"][0]) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return path
w.DumpWriter.write = patched
sys.argv = ["icsd", *sys.argv[1:]]
from icsd_audit.cli.main import main
main()
"""


def _tables(dumps):
    from icsd_audit.dumps.reader import DumpReader

    return {b.batch_id: b.table for b in DumpReader([dumps], columns=None)}


def _records(run):
    import json

    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/") and "time" not in k}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trl_straight(tmp_path_factory):
    """An uninterrupted 3-step tiny TRL run: what a resumed or stopped-and-resumed run must reproduce."""
    pytest.importorskip("trl", reason="TRL not installed: pip install 'icsd-audit[trl]'")
    run = tmp_path_factory.mktemp("trl") / "straight"
    r = _icsd(*TRL_TINY, "--steps", "3", "--out", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.engines
def test_trl_engine_resume_numbers_dumps_by_training_step_and_reproduces_the_run(tmp_path, trl_straight):
    run = tmp_path / "run"
    r = _icsd(*TRL_TINY, "--steps", "2", "--out", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _icsd(*TRL_TINY, "--steps", "3", "--out", str(run), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: steps 2..2;" in r.stderr
    # step ids 0..2, once each, one committed step folder each: no batch id restarted at 0
    assert sorted(p.name for p in (run / "dumps").iterdir()) == [f"step00000{k}-r00000" for k in range(3)]
    tables = _tables(run / "dumps")
    assert sorted(tables) == [0, 1, 2]
    for k, t in tables.items():
        assert set(t.column("batch_id").to_pylist()) == {k} and set(t.column("step").to_pylist()) == {k}
    v = _icsd("audit", "verify", str(run / "dumps"))
    assert v.returncode == 0 and "3 batches" in v.stdout, v.stdout + v.stderr
    c = _icsd("audit", "coeffs", str(run / "dumps"), "--out", str(tmp_path / "c.parquet"))
    assert c.returncode == 0 and "3 batches" in c.stderr + c.stdout, c.stderr
    # AdamW, the schedule, the step count and the RNG streams continue: the uninterrupted run, bit for bit
    straight = _tables(trl_straight / "dumps")
    assert sorted(straight) == [0, 1, 2] and all(straight[k].equals(tables[k]) for k in straight)
    # (HF's epoch is the share of the launch's planned steps: the first launch planned 2)
    drop_epoch = lambda recs: [{k: v for k, v in x.items() if k != "trl/epoch"} for x in recs]  # noqa: E731
    assert drop_epoch(_records(run)) == drop_epoch(_records(trl_straight))


@pytest.mark.engines
def test_trl_engine_sigterm_mid_step_commits_nothing_of_it_and_resume_gives_the_uninterrupted_run(tmp_path,
                                                                                                 trl_straight):
    import os
    import shlex

    run = tmp_path / "run"
    args = [*TRL_TINY, "--steps", "3", "--out", str(run)]
    proc = subprocess.run([sys.executable, "-c", TRL_STOP, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 143, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM during step 1; steps 0..0 are complete"), last
    assert f"continue with: icsd {shlex.join(args + ['--resume'])} (from checkpoints/step-000000)" in last
    # step 1's shard was staged and dropped; no temporaries, no half-written file
    assert sorted(p.name for p in (run / "dumps").iterdir()) == ["step000000-r00000"]
    assert [p.name for p in run.rglob(".*")] == [".icsd-run.lock"] and not list(run.rglob("*.tmp*"))
    assert [x["step"] for x in _records(run)] == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000000"]
    r = _icsd(*args, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    tables, straight = _tables(run / "dumps"), _tables(trl_straight / "dumps")
    assert sorted(tables) == [0, 1, 2] and all(straight[k].equals(tables[k]) for k in straight)
    assert _records(run) == _records(trl_straight)


RUN_COMMAND = r"""
import sys
from pathlib import Path
from icsd_audit.integrations.verl.launch import CommandStopped, run_command
try:
    run_command(Path(sys.argv[1]))
except CommandStopped as exc:
    print(exc.line(), file=sys.stderr)
    sys.exit(exc.exit_code)
"""


def test_a_job_that_outlives_its_stopped_shell_is_killed_after_the_grace(tmp_path):
    """A job that ignores SIGTERM keeps running after its shell has ended: the launcher kills the group after the
    grace (1 s here), so the child is gone when the launcher returns 143."""
    import signal
    import time

    script = tmp_path / "verl_command.sh"
    script.write_text(f"#!/usr/bin/env bash\ncd {tmp_path}\n"
                      "(trap '' TERM; echo $BASHPID > child.pid; while true; do sleep 0.1; done) &\nwait\n")
    command = RUN_COMMAND.replace("try:", "import icsd_audit.integrations.verl.launch as e\ne.GROUP_GRACE_S = 1.0\ntry:", 1)
    proc = subprocess.Popen([sys.executable, "-c", command, str(script)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "child.pid").exists() or not (tmp_path / "child.pid").read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    child = int((tmp_path / "child.pid").read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert not _runs(child)


def _runs(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (its state in /proc/PID/stat, else signal 0)."""
    import os

    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 tells whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.parametrize("signum, code, body", [
    ("SIGTERM", 143, "sleep 60 & echo $! > child.pid\nwait\n"),
    ("SIGINT", 130, "(echo $BASHPID > child.pid; exec sleep 60)\n"),
])
def test_a_signal_to_the_verl_launcher_reaches_the_command_and_waits_for_it(tmp_path, signum, code, body):
    """`icsd train --engine verl` runs verl_command.sh; SIGTERM / SIGINT pass to it, it ends, then 143 / 130."""
    import os
    import signal
    import time

    script = tmp_path / "verl_command.sh"
    script.write_text(f"#!/usr/bin/env bash\ncd {tmp_path}\necho $$ > shell.pid\n{body}")
    proc = subprocess.Popen([sys.executable, "-c", RUN_COMMAND, str(script)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "child.pid").exists() or not (tmp_path / "child.pid").read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)  # the sleep is running
    t0 = time.monotonic()
    proc.send_signal(getattr(signal, signum))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert time.monotonic() - t0 < 10  # the command ended on the signal, not after its 60 s
    assert err.strip().splitlines()[-1].startswith(f"stopped by {signum}: verl got the signal and has exited; its "
                                                   f"checkpoints are in {tmp_path / 'checkpoints'}; continue with: "
                                                   f"bash {script}")
    for name in ("shell.pid", "child.pid"):  # nothing of the command runs on (a zombie runs nothing: a container's
        pid = int((tmp_path / name).read_text())  # init may never reap the orphaned sleep)
        assert not _runs(pid), name

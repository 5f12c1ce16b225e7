"""`icsd train --env alfworld`: presets, the missing-extra message, dumps the audit recomputes, per-type eval."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icsd_audit.envs import StepResult
from icsd_audit.envs.alfworld.engine import ENGINE_HINT, engine_available
from icsd_audit.train.config import ConfigError, TrainConfig, preset, preset_for
from icsd_audit.train.eval import group_counts, group_success

needs_engine = pytest.mark.skipif(not engine_available(),
                                  reason="ALFWorld engine not installed: pip install 'icsd-audit[alfworld]'")
SMALL = ["--set", "group_size=2", "--set", "max_turns=2", "--set", "max_response_tokens=8",
         "--set", "max_prompt_tokens=384", "--set", "micro_batch_rows=2", "--set", "min_group=4",
         "--set", "threads=1"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path_factory.getbasetemp() / "icsd-cache"))
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)


def test_alfworld_presets_match_table_a1():
    assert preset_for("paper", "alfworld") == "paper-alfworld" and preset_for("cpu-demo", "alfworld") == "cpu-demo-alfworld"
    p = preset("paper-alfworld")
    assert p.env == "alfworld"
    assert (p.n_tasks, p.group_size, p.max_turns, p.eval_tasks) == (16, 8, 50, 128)
    assert (p.max_prompt_tokens, p.max_response_tokens) == (2048, 512)
    assert p.mini_batch_rows == 256 * 8 and p.lr == 1e-6 and p.clip_ratio == 0.2
    assert p.kl_coef == 0.01 and p.distill_coef == 0.01 and p.total_steps == 150
    assert (p.adv_estimator, p.gamma, p.step_weight) == ("gigpo", 0.95, 1.0)
    d = preset("cpu-demo-alfworld")
    assert d.env == "alfworld" and d.model == "embedded" and d.one_shot and d.max_turns == 3
    assert preset(preset_for("cpu-demo", None)).env == "webshop"  # WebShop stays the default
    if engine_available():
        p.validate()
        d.validate()


def test_missing_engine_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    import icsd_audit.envs.alfworld.engine as engine
    from typer.testing import CliRunner

    from icsd_audit.cli.main import app

    monkeypatch.setattr(engine, "engine_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'icsd-audit\[alfworld\]'"):
        preset("cpu-demo-alfworld").validate()
    with pytest.raises(engine.EngineMissingError, match=r"icsd-audit\[alfworld\]"):
        engine.require_engine()
    res = CliRunner().invoke(app, ["train", "--env", "alfworld", "--model", "tiny-random", "--steps", "1",
                                   "--out", str(tmp_path / "run")])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and ENGINE_HINT in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run").exists()


class _Traj:
    def __init__(self, traj: int, task: int, won: bool):
        self.traj, self.task, self.won = traj, task, won


class _Batch:
    def __init__(self, won_by_task: list[bool]):
        self.trajectories = [_Traj(i, i, w) for i, w in enumerate(won_by_task)]


class _TypedEnv:
    """task i has the column below; ALFWorld's ordering and episode average."""

    cols = ["Pick2", "Pick", "Look", "Pick", "Cool", "Pick"]
    task_groups = ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2")
    group_average = "episodes"

    def task_group(self, task: int) -> str:
        return self.cols[task]


def test_per_type_success_by_hand():
    batch = _Batch([True, True, False, False, True, True])
    rates = group_success(_TypedEnv(), batch)
    assert list(rates) == ["Pick", "Look", "Cool", "Pick2", "Avg"]  # the paper's order, empty types left out
    assert rates == {"Pick": 2 / 3, "Look": 0.0, "Cool": 1.0, "Pick2": 1.0, "Avg": 4 / 6}  # Avg = wins / episodes
    assert group_counts(_TypedEnv(), batch) == {"Pick": 3, "Look": 1, "Cool": 1, "Pick2": 1, "Avg": 6}
    env = _TypedEnv()
    env.group_average = "groups"  # Search-QA's Avg: the mean of the columns
    assert group_success(env, batch)["Avg"] == (2 / 3 + 0.0 + 1.0 + 1.0) / 4


@needs_engine
def test_cli_train_writes_alfworld_dumps_that_audit_coeffs_recomputes(tmp_path):
    """The issue's command: `icsd train --env alfworld --model tiny-random --steps 1`, then `icsd audit coeffs`."""
    from typer.testing import CliRunner

    from icsd_audit.cli.main import app

    run = tmp_path / "run"
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--env", "alfworld", "--model", "tiny-random", "--steps", "1", "--out", str(run),
                              "--plain", *SMALL])
    assert res.exit_code == 0, res.output
    shards = sorted((run / "dumps" / "step000000").glob("*.parquet"))
    assert len(shards) == 2  # cpu-demo: 2 tasks x 2 rollouts x 2 turns = 8 rows, 4-row mini-batches
    meta = json.loads(pq.ParquetFile(shards[0]).schema_arrow.metadata[b"icsd.dump"])
    assert meta["producer"]["env"] == "alfworld" and meta["train_config"]["env"] == "alfworld"
    assert meta["env_data"]["synthetic"] is True and meta["env_data"]["name"] == "alfworld"
    deployed = pa.concat_tables([pq.read_table(s) for s in shards])
    assert set(deployed.column("env").to_pylist()) == {"alfworld"}
    out = tmp_path / "coeffs.parquet"
    res = runner.invoke(app, ["audit", "coeffs", str(run / "dumps"), "--out", str(out), "--allocator", "icsd",
                              "--min-group", "4"])
    assert res.exit_code == 0, res.output
    recomputed = pq.read_table(out)
    assert recomputed.num_rows == deployed.num_rows > 0
    for k in ("g", "m", "c"):
        assert np.array_equal(recomputed.column(k).to_numpy().astype(np.float32), deployed.column(k).to_numpy()), k


class VariedAlfWorld:
    """The real ALFWorld env with a deterministic pseudo-random reward per step (see test_loop.VariedReward)."""

    created = 0

    def __init__(self, split: str):
        from icsd_audit.envs.alfworld.env import AlfWorldEnv

        self.inner = AlfWorldEnv(split, max_steps=2)
        VariedAlfWorld.created += 1
        self.ident = VariedAlfWorld.created
        self.name, self.max_steps, self.num_tasks = "alfworld", 2, self.inner.num_tasks
        self.data_info, self.task_column = self.inner.data_info, self.inner.task_column
        self.task_group, self.task_groups, self.group_average = self.inner.task_group, self.inner.task_groups, "episodes"

    def reset(self, task=None):
        self._task = task
        return self.inner.reset(task)

    def step(self, action):
        res = self.inner.step(action)
        h = hashlib.blake2b(f"{self._task}-{self.ident}-{res.info['steps']}".encode(), digest_size=4).digest()
        return StepResult(res.observation, int.from_bytes(h, "little") / 2**32, res.done, res.info)


@needs_engine
def test_allocation_on_alfworld_rollouts_is_recomputed_exactly_and_eval_has_columns(tmp_path):
    from icsd_audit.alloc.options import AllocatorOptions, allocate_batch
    from icsd_audit.dumps.reader import DumpReader
    from icsd_audit.train.loop import train

    cfg = TrainConfig(model="tiny-random", device="cpu", precision="float32", out_dir=str(tmp_path / "run"), threads=1,
                      env="alfworld", n_tasks=2, group_size=2, max_turns=2, history_window=1, max_prompt_tokens=384,
                      max_response_tokens=8, rollout_batch_rows=8, mini_batch_rows=4, micro_batch_rows=2, lr=1e-3,
                      total_steps=1, dump_every=1, checkpoint_every=0, eval_every=1, eval_tasks=3,
                      eval_temperature=0.0, reward="score", min_group=4)
    VariedAlfWorld.created = 0
    res = train(cfg, env_factory=VariedAlfWorld)
    opts = AllocatorOptions(allocator="icsd", trust=cfg.trust, min_group=cfg.min_group, eps=cfg.alloc_eps)
    n = 0
    for batch in DumpReader([res.dumps_dir], columns=None):
        alloc = allocate_batch(batch.tokens, opts)
        assert np.abs(batch.tokens.advantage).max() > 0.01  # a non-degenerate batch
        for k in ("g", "m", "c"):
            assert np.array_equal(getattr(alloc, k).numpy().astype(np.float32), batch.table.column(k).to_numpy()), k
        n += 1
    assert n == 2
    ev = res.evals[0]
    assert list(ev["subsets"]) == ["Pick", "Look", "Clean", "Avg"]  # the first three eval games: one of each
    assert ev["subset_tasks"] == {"Pick": 1, "Look": 1, "Clean": 1, "Avg": 3}
    assert ev["subsets"]["Avg"] == ev["success"]
    assert "eval/subsets/Clean" in res.records[0]

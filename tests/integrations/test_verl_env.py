"""What `icsd train --engine verl` writes (data files, model export, agent-loop config) and the icsd_env agent loop."""

from __future__ import annotations

import asyncio
import os

import pytest

from icsd_audit.train.config import TrainConfig, from_preset, preset_for


def _cfg(tmp_path, env: str, **kw) -> TrainConfig:
    return from_preset(preset_for("cpu-demo", env), env=env, out_dir=str(tmp_path / "run"), **kw)


@pytest.mark.parametrize("env", ["alfworld", "searchqa"])
def test_data_files_list_every_task_in_verl_agents_layout(tmp_path, env):
    import pyarrow.parquet as pq

    from icsd_audit.integrations.verl.env import task_instructions, write_verl_data

    cfg = _cfg(tmp_path, env, eval_tasks=5)
    train, test = write_verl_data(cfg, tmp_path / "data")
    assert (train.name, test.name) == ("train.parquet", "test.parquet")
    tr, te = pq.read_table(train).to_pylist(), pq.read_table(test).to_pylist()
    want = task_instructions(cfg, cfg.train_split)
    assert len(tr) == len(want) > 100 and len(te) == 5
    for i, row in enumerate(tr[:50]):
        assert row["data_source"] == f"icsd/{env}" and row["agent_name"] == "icsd_env" and row["ability"] == "agent"
        assert row["prompt"] == [{"role": "user", "content": want[i]}]
        assert row["extra_info"] == {"split": "train", "index": i, "env": env, "env_split": cfg.train_split, "task": i}
    assert [r["extra_info"]["env_split"] for r in te] == [cfg.eval_split] * 5
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["test.parquet", "train.parquet"]


@pytest.mark.parametrize("alfworld_data", [None, "~/.cache/alfworld"])
def test_alfworld_instructions_are_the_games_tasks_without_the_engine(tmp_path, monkeypatch, alfworld_data):
    """The generated games' task texts, also where importing alfworld has set $ALFWORLD_DATA to its empty default."""
    from icsd_audit.envs.alfworld.games import load_manifest
    from icsd_audit.integrations.verl.env import task_instructions

    monkeypatch.setenv("HOME", str(tmp_path))
    if alfworld_data is None:
        monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    else:
        (tmp_path / ".cache" / "alfworld").mkdir(parents=True)
        monkeypatch.setenv("ALFWORLD_DATA", os.path.expanduser(alfworld_data))
    cfg = from_preset(preset_for("cpu-demo", "alfworld"), env="alfworld")
    got = task_instructions(cfg, "eval", 3)
    assert got == [e["task_text"] for e in load_manifest()["splits"]["eval"][:3]]


def test_export_model_writes_hf_folders_and_passes_others_through(tmp_path):
    from icsd_audit.integrations.verl.env import export_model
    from icsd_audit.train.models.loading import load_model

    path = export_model("tiny-random", tmp_path / "run")
    assert path == str((tmp_path / "run" / "model").resolve())
    assert (tmp_path / "run" / "model" / "config.json").exists()
    lm = load_model(path, dtype="float32")
    assert lm.model.config.vocab_size == 259
    again = export_model("tiny-random", tmp_path / "run")  # a second export replaces the first in place
    assert again == path and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model"]
    assert export_model("Qwen/Qwen2.5-1.5B-Instruct", tmp_path) == "Qwen/Qwen2.5-1.5B-Instruct"
    assert export_model(str(tmp_path / "run" / "model"), tmp_path) == path


# ---------------------------------------------------------------------------------------- the agent loop


class _ScriptedServer:
    """verl's server client for the agent loop: replies from a script, in order."""

    def __init__(self, replies):
        self.replies, self.calls = list(replies), []

    async def generate(self, *, request_id, prompt_ids, sampling_params, **_):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append((list(prompt_ids), dict(sampling_params)))
        ids = self.replies.pop(0)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


@pytest.mark.engines
def test_agent_loop_plays_the_trl_engines_episode(tmp_path):
    """The icsd_env agent loop and the TRL engine's EpisodeRollout, given the same replies, produce the same
    prompt, conversation, mask and episode score: the episode is the same on both engines."""
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    import torch
    from hydra import compose, initialize_config_dir
    import verl
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from icsd_audit.integrations.trl.rollout import EpisodeRollout
    from icsd_audit.integrations.verl.agent_loop import EnvAgentLoop
    from icsd_audit.train.setup import env_factory as make_env_factory
    from icsd_audit.train.models.loading import tiny_random_causal_lm
    from icsd_audit.train.rollout.collect import PromptBuilder, RolloutSettings

    cfg = _cfg(tmp_path, "searchqa", model="tiny-random", max_turns=3, max_response_tokens=16,
               max_prompt_tokens=3000, one_shot=False, invalid_penalty=0.25)
    cfg.save(tmp_path / "config.json")
    model, tok = tiny_random_causal_lm(seed=0)
    texts = ["<think>find it</think><search>paper monument</search>", "no tags at all",
             "<think>ok</think><answer>1990</answer>"]
    replies = [list(tok(t, add_special_tokens=False).input_ids) + [tok.eos_token_id] for t in texts]

    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        vcfg = compose(config_name="ppo_trainer", overrides=["data.max_response_length=4000",
                                                              "data.max_prompt_length=3000"])
    server = _ScriptedServer(replies)
    loop = EnvAgentLoop(trainer_config=DictConfigWrap(vcfg), server_manager=server, tokenizer=tok, processor=None,
                        dataset_cls=RLHFDataset, data_config=DictConfigWrap(vcfg.data),
                        run_config=str(tmp_path / "config.json"))
    row = {"extra_info": {"split": "train", "index": 4, "env": "searchqa", "env_split": "train", "task": 4},
           "raw_prompt": [{"role": "user", "content": "ignored"}]}
    out = asyncio.run(loop.run({"temperature": 1.0}, **row))

    def scripted(model_, contexts, **_):
        r = [replies[len(scripted.seen) + j] for j in range(len(contexts))]
        scripted.seen.extend(contexts)
        return r, [torch.full((len(x),), -0.5) for x in r]

    scripted.seen = []
    builder = PromptBuilder.from_config(tok, cfg)  # as engines.run_trl builds it
    settings = RolloutSettings(max_turns=3, max_response_tokens=16, temperature=1.0, batch_rows=1,
                               require_think=cfg.require_think, reward=cfg.reward, record_logp=True,
                               invalid_rule=cfg.invalid_rule)
    ref = EpisodeRollout(tokenizer=tok, builder=builder, make_env=lambda: make_env_factory(cfg)("train"),
                         settings=settings, invalid_penalty=0.25, tasks={}, sampler=scripted)
    batch = ref.play(model, [4], device=torch.device("cpu"))
    assert out.prompt_ids == batch.prompt_ids[0]
    assert out.response_ids == batch.completion_ids[0] and out.response_mask == batch.env_mask[0]
    assert out.reward_score == pytest.approx(batch.scores(0.25)[0])
    assert out.response_logprobs == batch.logprobs[0]
    assert out.extra_fields["episode_turns"] == batch.trajectories[0].n_turns == 3
    # each turn is sampled from exactly the context the TRL engine samples it from
    assert [c[0] for c in server.calls] == [list(x) for x in scripted.seen]
    assert all(c[1]["max_tokens"] == 16 and c[1]["temperature"] == 1.0 for c in server.calls)


@pytest.mark.engines
def test_agent_loop_refuses_a_row_of_another_env(tmp_path):
    pytest.importorskip("verl", reason="verl not installed: pip install 'icsd-audit[verl]'")
    from hydra import compose, initialize_config_dir
    import verl
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from icsd_audit.integrations.verl.agent_loop import EnvAgentLoop
    from icsd_audit.train.models.loading import tiny_random_causal_lm

    cfg = _cfg(tmp_path, "searchqa", model="tiny-random")
    cfg.save(tmp_path / "config.json")
    _, tok = tiny_random_causal_lm(seed=0)
    d = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=d, version_base=None):
        vcfg = compose(config_name="ppo_trainer")
    loop = EnvAgentLoop(trainer_config=DictConfigWrap(vcfg), server_manager=_ScriptedServer([]), tokenizer=tok,
                        processor=None, dataset_cls=RLHFDataset, data_config=DictConfigWrap(vcfg.data),
                        run_config=str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match="runs 'searchqa'.*names env 'webshop'"):
        asyncio.run(loop.run({}, extra_info={"env": "webshop", "task": 0}))

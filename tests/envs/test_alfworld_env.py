"""ALFWorld on the real engine: expert checks, the environment protocol, the official-data path.

These need the ``alfworld`` extra and skip with the reason when it is absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from icsd_audit.envs import make_env
from icsd_audit.envs.alfworld.engine import engine_available
from icsd_audit.envs.alfworld.games import EXPERT_STEP_LIMIT, SPLIT_SEEDS, load_manifest

pytestmark = pytest.mark.skipif(
    not engine_available(), reason="ALFWorld engine not installed: pip install 'icsd-audit[alfworld]'")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Generated games go to a per-session cache, never the user's."""
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path_factory.getbasetemp() / "icsd-cache"))
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)


def _expert_check(split: str, index: int, expert_env, workdir: Path) -> None:
    from icsd_audit.envs.alfworld.manifest import check_game

    entry = load_manifest()["splits"][split][index]
    won, actions, game = check_game(expert_env, split, index, entry["attempt"], workdir)
    assert won, f"{split}/{index} ({game.task_type}): the expert did not win"
    assert len(actions) <= EXPERT_STEP_LIMIT
    assert actions == entry["walkthrough"], f"{split}/{index}: the expert's play differs from the manifest"


def test_expert_wins_a_sample_of_generated_games(tmp_path):
    """One game of each task type (Pick, Look, Clean from train; Heat, Cool, Pick2 from eval); the slow test plays all."""
    from icsd_audit.envs.alfworld.engine import make_game_env

    env = make_game_env(expert=True)
    for split, offsets in (("train", (6, 5, 4)), ("eval", (3, 2, 1))):
        n = len(load_manifest()["splits"][split])
        for off in offsets:  # among the last six games of a split, n - 6 + k has type k
            _expert_check(split, n - off, env, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "eval"])
def test_expert_wins_every_generated_game(split, tmp_path):
    from icsd_audit.envs.alfworld.engine import make_game_env

    env = make_game_env(expert=True)
    for index in range(len(load_manifest()["splits"][split])):
        _expert_check(split, index, env, tmp_path)


def test_environment_protocol_and_walkthrough_wins():
    env = make_env("alfworld", split="train", max_steps=50)
    assert env.num_tasks == len(load_manifest()["splits"]["train"])
    entry = load_manifest()["splits"]["train"][2]
    obs = env.reset(2)
    assert obs.text.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert obs.instruction == entry["task_text"] + "."
    assert f"Your task is to: {obs.instruction}" in obs.text
    assert "help" not in obs.available_actions and "look" in obs.available_actions
    assert all(a.startswith("go to ") for a in obs.available_actions if a not in ("inventory", "look"))
    assert env.task_column(2) == "Clean" and obs.meta["task_type"] == "pick_clean_then_place_in_recep"
    # an inadmissible action is a counted no-op
    res = env.step("fly to the moon")
    assert res.observation.text == "Nothing happens." and not res.info["valid_action"] and not res.done
    assert res.observation.available_actions == obs.available_actions and res.info["steps"] == 1
    # the recorded expert walkthrough wins, case and spacing aside
    walk = entry["walkthrough"]
    for k, action in enumerate(walk):
        res = env.step("  " + action.upper() + " ")
        assert res.info["valid_action"], action
        assert res.done == (k == len(walk) - 1)
    assert res.won and res.reward == 1.0 and res.info["score"] == 1.0 and not res.info["truncated"]
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("look")


def test_episode_ends_after_max_steps_with_reward_zero():
    env = make_env("alfworld", split="eval", max_steps=3)
    env.reset(0)
    results = [env.step("look") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and results[-1].reward == 0.0 and not results[-1].won
    # a second reset of the same game starts it afresh
    obs = env.reset(0)
    assert obs.meta["step"] == 0 and "Your task is to:" in obs.text
    with pytest.raises(IndexError):
        env.reset(10_000)


def test_data_info_marks_generated_games_synthetic():
    d = make_env("alfworld", split="eval").data_info
    assert d["synthetic"] is True and d["tasks"] == len(load_manifest()["splits"]["eval"])
    assert f"split seed {SPLIT_SEEDS['eval']}" in d["source"]


def _fake_official(root: Path) -> Path:
    """An official-layout data folder built from generated games (json_2.1.1/<split>/<task>/<trial>/)."""
    src = make_env("alfworld", split="train")
    data = root / "alfworld"
    for split, picks in (("train", (0, 1, 2)), ("valid_unseen", (3, 4, 5))):
        for i in picks:
            ref = src.games.ref(i)
            trial = data / "json_2.1.1" / split / f"{ref.task_type}-x-{i}" / "trial_T0"
            trial.mkdir(parents=True)
            for name in ("game.tw-pddl", "traj_data.json"):
                shutil.copy(ref.path.parent / name, trial / name)
    # ALFWorld skips these: an unsolvable game, a movable trial, a sliced task type
    bad = data / "json_2.1.1" / "train" / "pick_and_place_simple-y-9" / "trial_T1"
    shutil.copytree(data / "json_2.1.1" / "train" / "pick_and_place_simple-x-0" / "trial_T0", bad)
    game = json.loads((bad / "game.tw-pddl").read_text())
    game["solvable"] = False
    (bad / "game.tw-pddl").write_text(json.dumps(game))
    shutil.copytree(data / "json_2.1.1" / "train" / "pick_and_place_simple-x-0",
                    data / "json_2.1.1" / "train" / "pick_and_place_simple-movable-0")
    return data


def test_official_data_path_plays_the_same_way(tmp_path, monkeypatch):
    data = _fake_official(tmp_path)
    train = make_env("alfworld", split="train", data=str(data))
    assert train.num_tasks == 3 and train.data_info["synthetic"] is False
    assert [train.task_column(i) for i in range(3)] == ["Look", "Pick", "Clean"]  # sorted by folder name
    monkeypatch.setenv("ALFWORLD_DATA", str(data))
    ev = make_env("alfworld", split="eval")
    assert ev.num_tasks == 3 and [ev.task_column(i) for i in range(3)] == ["Cool", "Heat", "Pick2"]
    walk = json.loads(ev.games.ref(0).path.read_text())["walkthrough"]
    ev.reset(0)
    for action in walk:
        res = ev.step(action)
    assert res.won
    with pytest.raises(FileNotFoundError, match="no valid_seen/ folder"):
        make_env("alfworld", split="valid_seen")


def test_parse_memo_changes_nothing_the_agent_sees(monkeypatch):
    """Every observation and admissible list of a game is the same with TextWorld's own parsing and translation."""
    import textworld.logic as tw_logic
    from textworld.envs.pddl import textgen

    def play() -> list[tuple[str, tuple[str, ...]]]:
        env = make_env("alfworld", split="train")
        walk = load_manifest()["splits"]["train"][1]["walkthrough"]  # a Look game: lamp toggling, holding
        seen = [(env.reset(1).text, env._obs.available_actions)]
        for action in ["examine desk 1", *walk]:
            res = env.step(action)
            seen.append((res.observation.text, res.observation.available_actions))
        return seen

    memoized = play()
    again = play()  # a second load of the same game is served by the PDDL-to-SAS memo
    for module in (textgen, tw_logic):
        assert module._parse_and_convert._icsd_memo
        monkeypatch.setattr(module, "_parse_and_convert", module._parse_and_convert._icsd_original)
    import fast_downward

    assert fast_downward.pddl2sas._icsd_memo
    monkeypatch.setattr(fast_downward, "pddl2sas", fast_downward.pddl2sas._icsd_original)
    assert play() == memoized == again

"""The ALFWorld game generator and the shipped manifest: no engine needed."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from icsd_audit.envs.alfworld.games import (
    SPLIT_SEEDS,
    SPLIT_SIZES,
    load_manifest,
    problem_hash,
)
from icsd_audit.envs.alfworld.generate import draw_game
from icsd_audit.envs.alfworld.scenes import CAN_CONTAIN, OBJECTS, OPENABLE, TASK_COLUMNS, TASK_TYPES, column_of

FACT = re.compile(r"^\((\w+) ([^()]*)\)$")


def facts(problem: str) -> list[tuple[str, tuple[str, ...]]]:
    init = problem.split("(:init", 1)[1].split("(:goal", 1)[0]
    out = []
    for line in init.splitlines():
        m = FACT.match(line.strip())
        if m:
            out.append((m.group(1), tuple(m.group(2).split())))
    return out


def declared(problem: str) -> dict[str, str]:
    block = problem.split("(:objects", 1)[1].split("(:init", 1)[0]
    return {name: kind for name, _, kind in (line.split() for line in block.splitlines() if " - " in line)}


def check_invariants(game) -> None:
    """What every generated game must satisfy, read back from its PDDL text."""
    f = facts(game.problem)
    names = declared(game.problem)
    by_pred: dict[str, list[tuple[str, ...]]] = {}
    for pred, args in f:
        by_pred.setdefault(pred, []).append(args)
        for a in args:
            assert a in names, (pred, a)  # every fact names declared things
    otype = {o: t[: -len("Type")] for o, t in by_pred["objectType"]}
    rtype = {r: t[: -len("Type")] for r, t in by_pred["receptacleType"]}
    home = dict(by_pred["inReceptacle"])
    can = set(by_pred["canContain"])
    loc = dict(by_pred["receptacleAtLocation"])
    # every object sits in one receptacle that may hold it, at that receptacle's location
    assert set(home) == set(otype)
    for o, r in home.items():
        assert otype[o] in CAN_CONTAIN[rtype[r]] or otype[o] == "DeskLamp"
        assert (o, loc[r]) in set(by_pred["objectAtLocation"])
        if otype[o] != "DeskLamp":
            assert (f"{rtype[r]}Type", f"{otype[o]}Type") in can
    # closed receptacles are exactly the openable types; nothing starts open, hot, cool or clean
    assert {r for (r,) in by_pred.get("openable", [])} == {r for r, t in rtype.items() if t in OPENABLE}
    for pred in ("opened", "isHot", "isCool", "isClean", "isToggled", "holds"):
        assert pred not in by_pred, pred
    # the agent starts at a location of its own
    (start,) = [args[1] for args in by_pred["atLocation"]]
    assert start not in loc.values()
    p = game.pddl_params
    targets = [o for o, t in otype.items() if t == p["object_target"]]
    assert targets
    if game.task_type == "look_at_obj_in_light":
        lamps = [o for o, t in otype.items() if t == p["toggle_target"]]
        assert lamps and all((o,) in by_pred["toggleable"] for o in lamps)
        assert p["parent_target"] == ""
    else:
        # the goal is not met at the start: no target starts in a receptacle of the destination's type
        assert all(rtype[home[o]] != p["parent_target"] for o in targets)
        assert p["parent_target"] in rtype.values()
    if game.task_type == "pick_two_obj_and_place":
        assert len(targets) >= 2
    aff = {"pick_clean_then_place_in_recep": ("clean", "cleanable", "SinkBasin"),
           "pick_heat_then_place_in_recep": ("heat", "heatable", "Microwave"),
           "pick_cool_then_place_in_recep": ("cool", "coolable", "Fridge")}.get(game.task_type)
    if aff:
        assert aff[0] in OBJECTS[p["object_target"]][1]
        assert all((o,) in by_pred[aff[1]] for o in targets)
        assert aff[2] in rtype.values() and p["parent_target"] != aff[2]
    assert game.task_text.split()[0] in {"put", "look", "examine", "clean", "heat", "cool", "find"}
    assert p["object_target"].lower() in game.task_text


def test_draw_is_deterministic_and_splits_differ():
    a, b = draw_game(1, 7), draw_game(1, 7)
    assert a.problem == b.problem and a.task_text == b.task_text
    assert draw_game(2, 7).problem != a.problem
    assert draw_game(1, 7, attempt=1).problem != a.problem


def test_task_types_cycle_so_every_prefix_is_balanced():
    types = [draw_game(1, i).task_type for i in range(12)]
    assert types == list(TASK_TYPES) * 2


@pytest.mark.parametrize("split_seed", [1, 2])
def test_generated_problems_satisfy_the_invariants(split_seed):
    for i in range(60):
        check_invariants(draw_game(split_seed, i))


def test_goal_and_declarations_of_a_pick_two_game():
    g = draw_game(1, 5)
    assert g.task_type == "pick_two_obj_and_place"
    goal = g.problem.split("(:goal", 1)[1]
    assert f"(receptacleType ?r {g.pddl_params['parent_target']}Type)" in goal
    assert goal.count(f"(objectType ?o1 {g.pddl_params['object_target']}Type)") == 1
    assert "(not (= ?o1 ?o2))" in goal


def test_columns_are_the_papers():
    assert [column_of(t) for t in TASK_TYPES] == ["Pick", "Look", "Clean", "Heat", "Cool", "Pick2"]
    assert list(TASK_COLUMNS.values()) == ["Pick", "Look", "Clean", "Heat", "Cool", "Pick2"]
    with pytest.raises(ValueError, match="unknown ALFWorld task type"):
        column_of("slice_and_place")


def test_manifest_matches_the_generator_for_every_game():
    """The shipped manifest's hashes are reproduced by the generator (pure Python, ~1 ms a game)."""
    m = load_manifest()
    assert {k: len(v) for k, v in m["splits"].items()} == SPLIT_SIZES
    assert m["split_seeds"] == SPLIT_SEEDS and m["expert_step_limit"] == 50
    for split, entries in m["splits"].items():
        counts = Counter(e["task_type"] for e in entries)
        assert set(counts.values()) == {len(entries) // 6}
        for i, e in enumerate(entries):
            g = draw_game(SPLIT_SEEDS[split], i, e["attempt"])
            assert problem_hash(g.problem) == e["hash"], (split, i)
            assert g.task_type == e["task_type"] and g.task_text == e["task_text"]
            assert 1 <= len(e["walkthrough"]) <= 50
    # held-out games are not train games
    train = {e["hash"] for e in m["splits"]["train"]}
    assert not train & {e["hash"] for e in m["splits"]["eval"]}

"""A seeded generator of ALFWorld games that the real engine (TextWorld's PDDL player) loads.

A game is what the official ALFWorld data holds per trial folder: ``traj_data.json``
(task type and ``pddl_params``, read by the engine's handcoded expert) and
``game.tw-pddl`` (JSON: the ALFRED PDDL domain and text grammar shipped with the
``alfworld`` package, the task text substituted into the grammar, the PDDL problem,
``solvable`` and the expert's ``walkthrough``).

:func:`draw_game` turns ``(split seed, index, attempt)`` into a scene and a task with
plain :mod:`random` (no engine needed); :mod:`.games` writes it, has the engine's expert
play it, and redraws with the next ``attempt`` until the expert wins within the episode
budget. Game ``i`` of a split has task type ``TASK_TYPES[i % 6]``, so every prefix of a
split is balanced across the six types.

The problems use the ALFRED domain's predicates with one location per receptacle and a
start location of their own; object and receptacle ids follow ALFRED's mangled form
(``Mug_bar__plus_01_dot_20_bar_...``) so the engine's name demangler shows ``mug 1``.
Goals state the same conditions as ALFWorld's goal library for each task type, and no
target object starts where the goal wants it (a game is never won before it starts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .scenes import CAN_CONTAIN, LAMPS, OBJECTS, OPENABLE, ROOMS, TASK_TYPES

__all__ = ["GeneratedGame", "draw_game", "task_text", "GENERATOR_VERSION", "ROOMS_FOR_TASK"]

#: Bump when a change to this module or .scenes changes what a (seed, index) produces.
GENERATOR_VERSION = 1

#: Task type -> room kinds it can be set in (the appliance it needs must exist there).
ROOMS_FOR_TASK: dict[str, tuple[str, ...]] = {
    "pick_and_place_simple": ("kitchen", "livingroom", "bedroom", "bathroom"),
    "look_at_obj_in_light": ("bedroom", "livingroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "livingroom", "bedroom", "bathroom"),
}
#: The appliance each state-change task uses (never also the destination).
_APPLIANCE = {"pick_clean_then_place_in_recep": "SinkBasin", "pick_heat_then_place_in_recep": "Microwave",
              "pick_cool_then_place_in_recep": "Fridge"}
_AFFORDANCE = {"pick_clean_then_place_in_recep": "clean", "pick_heat_then_place_in_recep": "heat",
               "pick_cool_then_place_in_recep": "cool"}
#: ALFWorld's task phrasings, two per type (the game text says "Your task is to: <text>.").
_TEMPLATES: dict[str, tuple[str, str]] = {
    "pick_and_place_simple": ("put a {obj} in {recep}", "put some {obj} on {recep}"),
    "look_at_obj_in_light": ("look at {obj} under the {toggle}", "examine the {obj} with the {toggle}"),
    "pick_clean_then_place_in_recep": ("put a clean {obj} in {recep}", "clean some {obj} and put it in {recep}"),
    "pick_heat_then_place_in_recep": ("put a hot {obj} in {recep}", "heat some {obj} and put it in {recep}"),
    "pick_cool_then_place_in_recep": ("put a cool {obj} in {recep}", "cool some {obj} and put it in {recep}"),
    "pick_two_obj_and_place": ("put two {obj} in {recep}", "find two {obj} and put them in {recep}"),
}


@dataclass(frozen=True)
class GeneratedGame:
    """One drawn game: the task and the PDDL problem text."""

    task_type: str
    room: str
    #: ALFRED's pddl_params: object_target, parent_target, toggle_target, mrecep_target, object_sliced.
    pddl_params: dict[str, Any]
    #: The task text as the game shows it (without the trailing period).
    task_text: str
    problem: str
    seed: str
    n_receptacles: int
    n_objects: int
    extra: dict[str, Any] = field(default_factory=dict)

    def traj_data(self) -> dict[str, Any]:
        """The traj_data.json content the engine's expert reads (plus icsd's provenance)."""
        return {"task_type": self.task_type, "pddl_params": dict(self.pddl_params), "scene": {"room": self.room},
                "icsd": {"synthetic": True, "generator_version": GENERATOR_VERSION, "seed": self.seed,
                         "task_text": self.task_text}}


class _Retry(Exception):
    """The drawn scene cannot host the drawn task; draw again."""


def _coord(rng: random.Random) -> str:
    parts = []
    for _ in range(3):
        v = rng.uniform(-4.0, 4.0)
        sign = "plus" if v >= 0 else "minus"
        whole, frac = divmod(round(abs(v) * 100), 100)
        parts.append(f"_{sign}_{whole:02d}_dot_{frac:02d}")
    return "_bar_".join(parts)


def _mangle(type_name: str, rng: random.Random, used: set[str]) -> str:
    while True:
        if type_name == "SinkBasin":  # ALFRED: Sink|x|y|z|SinkBasin, shown as "sinkbasin"
            ident = f"Sink_bar_{_coord(rng)}_bar_SinkBasin"
        elif type_name == "BathtubBasin":
            ident = f"Bathtub_bar_{_coord(rng)}_bar_BathtubBasin"
        else:
            ident = f"{type_name}_bar_{_coord(rng)}"
        if ident not in used:
            used.add(ident)
            return ident


def task_text(task_type: str, params: dict[str, Any], rng: random.Random) -> str:
    """One of ALFWorld's two phrasings of the task, with lower-cased type names."""
    tmpl = rng.choice(_TEMPLATES[task_type])
    return tmpl.format(obj=params["object_target"].lower(), recep=params["parent_target"].lower(),
                       toggle=params["toggle_target"].lower())


def draw_game(split_seed: int, index: int, attempt: int = 0) -> GeneratedGame:
    """Draw game ``index`` of the split seeded ``split_seed`` (``attempt`` redraws it)."""
    task_type = TASK_TYPES[index % len(TASK_TYPES)]
    for sub in range(1000):
        seed = f"icsd-alfworld-v{GENERATOR_VERSION}:{split_seed}:{index}:{attempt}:{sub}"
        try:
            return _draw(task_type, random.Random(seed), seed)
        except _Retry:
            continue
    raise RuntimeError(f"could not draw a {task_type} game for seed {split_seed} index {index}")  # pragma: no cover


def _draw(task_type: str, rng: random.Random, seed: str) -> GeneratedGame:
    room = rng.choice(ROOMS_FOR_TASK[task_type])
    # ---- receptacles
    recep_types: list[str] = []
    for rtype, (lo, hi) in ROOMS[room].items():
        recep_types += [rtype] * rng.randint(lo, hi)
    if task_type == "look_at_obj_in_light" and not any(r in LAMPS["DeskLamp"] for r in recep_types):
        raise _Retry
    used: set[str] = set()
    receps = [(rtype, _mangle(rtype, rng, used)) for rtype in recep_types]
    present = set(recep_types)

    # ---- the task's target and destination
    def placeable(otype: str) -> list[str]:
        return [r for r in present if otype in CAN_CONTAIN.get(r, ())]

    candidates = sorted(o for o, (rooms, aff) in OBJECTS.items() if room in rooms and placeable(o))
    if task_type in _AFFORDANCE:
        candidates = [o for o in candidates if _AFFORDANCE[task_type] in OBJECTS[o][1]]
    if not candidates:
        raise _Retry
    target = rng.choice(candidates)
    toggle = ""
    parent = ""
    if task_type == "look_at_obj_in_light":
        toggle = "DeskLamp"
    else:
        dests = sorted(r for r in present if target in CAN_CONTAIN.get(r, ()) and r != _APPLIANCE.get(task_type))
        # the target must have somewhere else to start from
        dests = [d for d in dests if any(r != d for r in placeable(target))]
        if not dests:
            raise _Retry
        parent = rng.choice(dests)

    # ---- objects: the target (2-3 instances for pick2), distractors, the lamp
    n_target = rng.randint(2, 3) if task_type == "pick_two_obj_and_place" else rng.randint(1, 2)
    others = [o for o in sorted(OBJECTS) if room in OBJECTS[o][0] and o != target and placeable(o)]
    rng.shuffle(others)
    n_kinds = min(len(others), rng.randint(6, 12))
    obj_types = [target] * n_target
    for o in others[:n_kinds]:
        obj_types += [o] * rng.choice((1, 1, 1, 2))
    objects: list[tuple[str, str, str]] = []  # (type, id, receptacle id)
    for otype in obj_types:
        homes = [(rt, rid) for rt, rid in receps if otype in CAN_CONTAIN.get(rt, ())]
        if otype == target and parent:
            homes = [(rt, rid) for rt, rid in homes if rt != parent]  # never start in the goal's destination
        if not homes:
            raise _Retry
        _, home = rng.choice(homes)
        objects.append((otype, _mangle(otype, rng, used), home))
    if toggle:
        stands = [(rt, rid) for rt, rid in receps if rt in LAMPS[toggle]]
        for _ in range(rng.randint(1, min(2, len(stands)))):
            objects.append((toggle, _mangle(toggle, rng, used), rng.choice(stands)[1]))

    params = {"object_target": target, "parent_target": parent, "toggle_target": toggle, "mrecep_target": "",
              "object_sliced": False}
    text = task_text(task_type, params, rng)
    problem = _render_problem(seed, task_type, params, receps, objects, rng)
    return GeneratedGame(task_type=task_type, room=room, pddl_params=params, task_text=text, problem=problem,
                         seed=seed, n_receptacles=len(receps), n_objects=len(objects))


def _loc(i: int) -> str:
    return f"loc_bar_{i}"


def _render_problem(seed: str, task_type: str, params: dict[str, Any], receps: list[tuple[str, str]],
                    objects: list[tuple[str, str, str]], rng: random.Random) -> str:
    otypes = sorted({o for o, _, _ in objects})
    rtypes = sorted({r for r, _ in receps})
    loc_of = {rid: _loc(i + 1) for i, (_, rid) in enumerate(receps)}
    start = _loc(0)
    decl = ["agent1 - agent"]
    decl += [f"{t}Type - otype" for t in otypes]
    decl += [f"{t}Type - rtype" for t in rtypes]
    decl += [f"{oid} - object" for _, oid, _ in objects]
    decl += [f"{rid} - receptacle" for _, rid in receps]
    decl += [f"{loc} - location" for loc in [start, *loc_of.values()]]

    init = [f"(atLocation agent1 {start})"]
    for rtype, rid in receps:
        init.append(f"(receptacleType {rid} {rtype}Type)")
        init.append(f"(receptacleAtLocation {rid} {loc_of[rid]})")
        if rtype in OPENABLE:
            init.append(f"(openable {rid})")
    for rtype in rtypes:
        init += [f"(canContain {rtype}Type {o}Type)" for o in otypes if o in CAN_CONTAIN.get(rtype, ())]
    for otype, oid, home in objects:
        init.append(f"(objectType {oid} {otype}Type)")
        init.append(f"(inReceptacle {oid} {home})")
        init.append(f"(objectAtLocation {oid} {loc_of[home]})")
        if otype in LAMPS:
            init.append(f"(toggleable {oid})")
            continue
        init.append(f"(pickupable {oid})")
        aff = OBJECTS[otype][1]
        for flag, pred in (("clean", "cleanable"), ("heat", "heatable"), ("cool", "coolable"),
                           ("recep", "isReceptacleObject")):
            if flag in aff:
                init.append(f"({pred} {oid})")

    goal = _goal(task_type, params)
    body = "\n        ".join
    return (f"(define (problem icsd_{seed.replace(':', '_').replace('-', '_')})\n(:domain alfred)\n(:objects\n        "
            f"{body(decl)}\n)\n(:init\n        {body(init)}\n)\n(:goal\n{goal}\n)\n)\n")


def _goal(task_type: str, p: dict[str, Any]) -> str:
    obj, recep, toggle = p["object_target"], p["parent_target"], p["toggle_target"]
    if task_type == "look_at_obj_in_light":
        return (f"    (and\n"
                f"        (exists (?ot - object ?r - receptacle ?a - agent ?l - location)\n"
                f"            (and (objectType ?ot {toggle}Type) (toggleable ?ot) (isToggled ?ot)\n"
                f"                 (receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r)))\n"
                f"        (exists (?o - object ?a - agent) (and (objectType ?o {obj}Type) (holds ?a ?o))))")
    if task_type == "pick_two_obj_and_place":
        return (f"    (exists (?r - receptacle ?o1 - object ?o2 - object)\n"
                f"        (and (receptacleType ?r {recep}Type) (not (= ?o1 ?o2))\n"
                f"             (objectType ?o1 {obj}Type) (inReceptacle ?o1 ?r)\n"
                f"             (objectType ?o2 {obj}Type) (inReceptacle ?o2 ?r)))")
    state = {"pick_clean_then_place_in_recep": "(cleanable ?o) (isClean ?o)",
             "pick_heat_then_place_in_recep": "(heatable ?o) (isHot ?o)",
             "pick_cool_then_place_in_recep": "(coolable ?o) (isCool ?o)"}.get(task_type, "")
    return (f"    (exists (?r - receptacle ?o - object)\n"
            f"        (and (objectType ?o {obj}Type) (receptacleType ?r {recep}Type) (inReceptacle ?o ?r)"
            f"{(' ' + state) if state else ''}))")

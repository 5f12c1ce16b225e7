"""Vocabulary of the generated ALFWorld games: rooms, receptacles, objects, task types.

Written for icsd from the ALFRED PDDL domain's predicates (``alfworld/data/alfred.pddl``)
and the task types of ALFWorld. Names are ALFRED's type names (``CounterTop``,
``SinkBasin``); the engine shows them lower-cased with an instance number
(``countertop 1``). Plain data, no engine import.
"""

from __future__ import annotations

__all__ = [
    "TASK_TYPES",
    "TASK_COLUMNS",
    "OPENABLE",
    "ROOMS",
    "OBJECTS",
    "CAN_CONTAIN",
    "LAMPS",
    "column_of",
]

#: ALFWorld's six task types (the ``task_type`` of a game's traj_data.json), in the
#: paper's column order, with the column name of Table 1.
TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
TASK_COLUMNS: dict[str, str] = dict(zip(TASK_TYPES, ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2")))


def column_of(task_type: str) -> str:
    """The paper's column name (Pick, Look, Clean, Heat, Cool, Pick2) of a task type."""
    try:
        return TASK_COLUMNS[task_type]
    except KeyError:
        raise ValueError(f"unknown ALFWorld task type {task_type!r}; known: {list(TASK_TYPES)}") from None


#: Receptacle types that start closed and must be opened before looking inside.
OPENABLE = frozenset({"Cabinet", "Drawer", "Fridge", "Microwave", "Safe"})

#: Room kind -> receptacle type -> (min, max) count.
ROOMS: dict[str, dict[str, tuple[int, int]]] = {
    "kitchen": {
        "Cabinet": (2, 6), "CounterTop": (1, 2), "Drawer": (1, 4), "Fridge": (1, 1), "Microwave": (1, 1),
        "SinkBasin": (1, 1), "StoveBurner": (2, 4), "DiningTable": (0, 1), "GarbageCan": (1, 1),
        "CoffeeMachine": (1, 1), "Toaster": (0, 1), "Shelf": (0, 2),
    },
    "livingroom": {
        "Sofa": (1, 1), "ArmChair": (0, 2), "CoffeeTable": (1, 1), "SideTable": (1, 2), "TVStand": (0, 1),
        "Drawer": (0, 3), "Cabinet": (0, 3), "Shelf": (0, 3), "Dresser": (0, 1), "GarbageCan": (1, 1),
        "DiningTable": (0, 1), "Ottoman": (0, 1),
    },
    "bedroom": {
        "Bed": (1, 1), "Desk": (0, 1), "SideTable": (1, 2), "Dresser": (0, 1), "Drawer": (1, 5), "Shelf": (0, 3),
        "GarbageCan": (1, 1), "Safe": (0, 1), "LaundryHamper": (0, 1), "ArmChair": (0, 1),
    },
    "bathroom": {
        "Toilet": (1, 1), "SinkBasin": (1, 2), "BathtubBasin": (0, 1), "Cabinet": (1, 4), "CounterTop": (1, 1),
        "Drawer": (0, 3), "GarbageCan": (1, 1), "Shelf": (0, 2), "TowelHolder": (0, 1), "HandTowelHolder": (0, 1),
        "ToiletPaperHanger": (1, 1), "Cart": (0, 1),
    },
}

#: Object type -> (rooms it appears in, affordances). Affordances: clean (cleanable in a
#: sink), heat (microwave), cool (fridge), recep (a receptacle object such as a mug).
OBJECTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {}


def _obj(name: str, rooms: str, affordances: str = "") -> None:
    OBJECTS[name] = (frozenset(rooms.split()), frozenset(affordances.split()))


for _n, _a in (("Apple", "clean heat cool"), ("Bread", "heat cool"), ("Egg", "clean heat cool"),
               ("Lettuce", "clean cool"), ("Potato", "clean heat cool"), ("Tomato", "clean heat cool"),
               ("Mug", "clean heat cool recep"), ("Cup", "clean heat cool recep"), ("Bowl", "clean cool recep"),
               ("Plate", "clean heat cool recep"), ("Pan", "clean cool recep"), ("Pot", "clean cool recep"),
               ("Knife", "clean"), ("ButterKnife", "clean"), ("Fork", "clean"), ("Spoon", "clean"),
               ("Spatula", "clean"), ("Ladle", "clean"), ("Kettle", "clean"), ("DishSponge", "clean"),
               ("SaltShaker", ""), ("PepperShaker", ""), ("WineBottle", "cool"), ("SoapBottle", ""),
               ("PaperTowelRoll", "")):
    _obj(_n, "kitchen", _a)
for _n in ("RemoteControl", "Newspaper", "Box", "Statue", "Vase", "Watch", "WateringCan", "TissueBox"):
    _obj(_n, "livingroom")
for _n in ("CellPhone", "CD", "Pen", "Pencil", "AlarmClock", "BaseballBat", "TennisRacket", "BasketBall", "TeddyBear"):
    _obj(_n, "bedroom")
for _n in ("KeyChain", "CreditCard", "Laptop", "Pillow", "Book"):
    _obj(_n, "livingroom bedroom")
for _n, _a in (("SoapBar", "clean"), ("Cloth", "clean"), ("ToiletPaper", ""), ("SprayBottle", ""),
               ("Candle", ""), ("HandTowel", ""), ("Towel", ""), ("ScrubBrush", ""), ("Plunger", "")):
    _obj(_n, "bathroom", _a)
OBJECTS["DishSponge"] = (frozenset({"kitchen", "bathroom"}), frozenset({"clean"}))
OBJECTS["SoapBottle"] = (frozenset({"kitchen", "bathroom"}), frozenset())
OBJECTS["Mug"] = (frozenset({"kitchen", "bedroom"}), OBJECTS["Mug"][1])
OBJECTS["Bowl"] = (frozenset({"kitchen", "livingroom"}), OBJECTS["Bowl"][1])

#: Toggleable light sources for "look at X under the lamp" (not pickupable), and where they stand.
LAMPS: dict[str, tuple[str, ...]] = {"DeskLamp": ("Desk", "SideTable", "Dresser")}

_FOOD = {"Apple", "Bread", "Egg", "Lettuce", "Potato", "Tomato"}
_DISHES = {"Mug", "Cup", "Bowl", "Plate"}
_COOKWARE = {"Pan", "Pot", "Kettle"}
_CUTLERY = {"Knife", "ButterKnife", "Fork", "Spoon", "Spatula", "Ladle"}
_SMALL = {"KeyChain", "CreditCard", "CellPhone", "CD", "Pen", "Pencil", "Watch", "RemoteControl"}
_TOILETRY = {"SoapBar", "SoapBottle", "Cloth", "ToiletPaper", "SprayBottle", "Candle", "DishSponge", "TissueBox"}
_DESK = _SMALL | {"Book", "Laptop", "AlarmClock", "Mug", "Bowl", "Box", "Statue", "Vase", "Newspaper",
                  "TissueBox", "Candle", "WateringCan"}
_KITCHEN_ALL = {n for n, (rooms, _) in OBJECTS.items() if "kitchen" in rooms}

#: Receptacle type -> object types it can hold (the problem's ``canContain`` facts).
CAN_CONTAIN: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    "CounterTop": _KITCHEN_ALL | _TOILETRY | {"CellPhone", "CreditCard", "KeyChain"},
    "DiningTable": _KITCHEN_ALL | _DESK,
    "Cabinet": (_DISHES | _COOKWARE | _TOILETRY | {"SaltShaker", "PepperShaker", "WineBottle", "PaperTowelRoll",
                                                    "Book", "Box", "Vase", "Statue", "KeyChain", "CreditCard"}),
    "Drawer": _CUTLERY | _SMALL | _TOILETRY - {"SoapBottle"} | {"Book", "DishSponge", "SaltShaker", "PepperShaker"},
    "Shelf": _DISHES | _DESK | _TOILETRY | {"SaltShaker", "PepperShaker", "WineBottle", "Kettle", "PaperTowelRoll"},
    "Fridge": _FOOD | _DISHES | {"Pan", "Pot", "WineBottle"},
    "Microwave": _FOOD - {"Lettuce"} | _DISHES,
    "SinkBasin": (_FOOD - {"Bread"}) | _DISHES | _COOKWARE | _CUTLERY | {"DishSponge", "SoapBar", "Cloth"},
    "BathtubBasin": {"SoapBar", "Cloth", "SoapBottle"},
    "StoveBurner": _COOKWARE,
    "GarbageCan": _FOOD | {"SoapBottle", "Pen", "Pencil", "CD", "Newspaper", "PaperTowelRoll", "ToiletPaper",
                           "SprayBottle", "TissueBox", "Candle", "SoapBar", "DishSponge", "Cloth", "CreditCard"},
    "CoffeeMachine": {"Mug", "Cup"},
    "Toaster": {"Bread"},
    "Sofa": {"Pillow", "Laptop", "Book", "RemoteControl", "Newspaper", "CellPhone", "KeyChain", "CreditCard", "Box"},
    "ArmChair": {"Pillow", "Laptop", "Book", "RemoteControl", "Newspaper", "CellPhone", "KeyChain", "CreditCard"},
    "Ottoman": {"Pillow", "Laptop", "Book", "RemoteControl", "Newspaper", "KeyChain", "CreditCard", "Box"},
    "CoffeeTable": _DESK,
    "SideTable": _DESK | {"Pillow"},
    "TVStand": _DESK - {"Mug"},
    "Desk": _DESK | {"BaseballBat", "TennisRacket", "BasketBall"},
    "Dresser": _DESK | {"TeddyBear"},
    "Bed": {"Pillow", "Laptop", "Book", "CellPhone", "TeddyBear", "BaseballBat", "TennisRacket", "BasketBall"},
    "Safe": {"CellPhone", "KeyChain", "CreditCard", "CD", "Watch", "Statue"},
    "LaundryHamper": {"Cloth", "Towel", "HandTowel"},
    "Toilet": {"SoapBottle", "SoapBar", "Candle", "SprayBottle", "ToiletPaper", "Cloth", "TissueBox"},
    "TowelHolder": {"Towel"},
    "HandTowelHolder": {"HandTowel"},
    "ToiletPaperHanger": {"ToiletPaper"},
    "Cart": _TOILETRY | {"Towel", "HandTowel", "ScrubBrush", "Plunger"},
}.items()}

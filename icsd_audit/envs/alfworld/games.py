"""Where an ALFWorld split's games come from: the built-in generated games, or the official data.

Both sources give the same thing, a sorted list of :class:`GameRef` (a ``game.tw-pddl``
path, its task type and task text), and the environment plays them the same way.

* **Generated** (default): game ``i`` of split ``train`` / ``eval`` is
  ``draw_game(SPLIT_SEEDS[split], i, attempt)`` with the ``attempt`` recorded in the
  shipped manifest (``envs/data/alfworld_games.v1.json.gz``), the first one the engine's
  handcoded expert wins within :data:`EXPERT_STEP_LIMIT` steps. The manifest also holds
  each problem's hash and the expert's winning walkthrough; a game is written (with
  ``solvable: true`` and that walkthrough, as ``alfworld-generate`` writes official
  games) into the cache on first use: ``<cache>/alfworld/v<N>/<split>/<index>/``, where
  ``<cache>`` is ``$ICSD_CACHE``, else ``$XDG_CACHE_HOME/icsd``, else ``~/.cache/icsd``.
  ``python -m icsd_audit.envs.alfworld.manifest`` rebuilds the manifest (it runs the
  expert on every game).
* **Official** (``alfworld_data=PATH`` or ``$ALFWORLD_DATA``; alfworld's default
  ``~/.cache/alfworld`` counts once ``alfworld-download`` has filled it): the trial folders under
  ``json_2.1.1/train`` and ``json_2.1.1/valid_unseen`` (``eval``), filtered as
  ALFWorld's ``AlfredTWEnv`` filters them: one of the six task types, a ``game.tw-pddl``
  marked solvable, no "movable" or "Sliced" trial.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .generate import GENERATOR_VERSION, draw_game
from .scenes import TASK_TYPES

__all__ = [
    "GameRef",
    "SPLITS",
    "SPLIT_SEEDS",
    "SPLIT_SIZES",
    "OFFICIAL_SPLITS",
    "EXPERT_STEP_LIMIT",
    "MANIFEST_PATH",
    "load_manifest",
    "problem_hash",
    "generated_games",
    "official_games",
    "game_files",
    "engine_files",
    "write_game",
]

SPLITS = ("train", "eval")
#: Fixed seeds of the generated splits (disjoint draws of the same generator).
SPLIT_SEEDS = {"train": 1, "eval": 2}
#: Games per generated split (a multiple of six: every type equally often).
SPLIT_SIZES = {"train": 300, "eval": 180}
#: Split name -> the official data's folder (the paper evaluates on valid_unseen).
OFFICIAL_SPLITS = {"train": "train", "eval": "valid_unseen", "valid_seen": "valid_seen", "valid_unseen": "valid_unseen"}
#: A generated game is kept only when the expert wins it within this many steps (the paper's episode limit).
EXPERT_STEP_LIMIT = 50
MANIFEST_PATH = Path(__file__).resolve().parent.parent / "data" / f"alfworld_games.v{GENERATOR_VERSION}.json.gz"


@dataclass(frozen=True)
class GameRef:
    """One playable game."""

    path: Path  # the game.tw-pddl file
    task_type: str
    task_text: str
    synthetic: bool


def problem_hash(problem: str) -> str:
    return hashlib.sha256(problem.encode("utf-8")).hexdigest()[:16]


@lru_cache(maxsize=2)
def _read_manifest(path_str: str) -> dict[str, Any]:
    data = json.loads(gzip.decompress(Path(path_str).read_bytes()))
    if data.get("format") != "icsd-alfworld-games" or data.get("generator_version") != GENERATOR_VERSION:
        raise ValueError(f"{path_str} is not an icsd ALFWorld games manifest for generator v{GENERATOR_VERSION}; "
                         "rebuild it with `python -m icsd_audit.envs.alfworld.manifest`")
    return data


def load_manifest(path: str | Path | None = None) -> dict[str, Any]:
    """The shipped manifest: per split, each game's accepted attempt, problem hash and expert walkthrough."""
    p = Path(path) if path is not None else MANIFEST_PATH
    if not p.exists():
        raise FileNotFoundError(f"ALFWorld games manifest {p} not found; rebuild it with "
                                "`python -m icsd_audit.envs.alfworld.manifest`")
    return _read_manifest(str(p.resolve()))


def engine_files() -> tuple[str, str]:
    """The ALFRED PDDL domain and text grammar shipped with the ``alfworld`` package."""
    from .engine import require_engine

    require_engine()
    import alfworld

    base = Path(alfworld.__file__).resolve().parent / "data"
    return (base / "alfred.pddl").read_text(), (base / "alfred.twl2").read_text()


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        from icsd_audit.outputs import umask_mode

        umask_mode(tmp)  # mkstemp makes it private; the cache is ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_game(folder: Path, game: Any, *, walkthrough: list[str] | None) -> Path:
    """Write ``traj_data.json`` and ``game.tw-pddl`` of a :class:`GeneratedGame` into ``folder``."""
    domain, grammar = engine_files()
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / "traj_data.json", json.dumps(game.traj_data(), indent=1))
    gamedata = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", game.task_text),
                "pddl_problem": game.problem, "solvable": walkthrough is not None, "walkthrough": walkthrough}
    path = folder / "game.tw-pddl"
    _atomic_write(path, json.dumps(gamedata))
    return path


def _cache_dir() -> Path:
    from icsd_audit.paths import cache_root

    return cache_root() / "alfworld" / f"v{GENERATOR_VERSION}"


class _LazyGames:
    """The generated games of a split; each one is written to the cache when first asked for."""

    synthetic = True

    def __init__(self, split: str, manifest: dict[str, Any], cache: Path):
        self.split = split
        self.entries: list[dict[str, Any]] = manifest["splits"][split]
        self.cache = cache / split

    def __len__(self) -> int:
        return len(self.entries)

    def describe(self) -> dict[str, Any]:
        return {"synthetic": True, "source": f"icsd ALFWorld game generator v{GENERATOR_VERSION}, "
                                             f"split seed {SPLIT_SEEDS[self.split]}"}

    def task_type(self, i: int) -> str:
        return TASK_TYPES[i % len(TASK_TYPES)]

    def ref(self, i: int) -> GameRef:
        entry = self.entries[i]
        folder = self.cache / f"{i:04d}"
        path = folder / "game.tw-pddl"
        game = draw_game(SPLIT_SEEDS[self.split], i, entry["attempt"])
        if problem_hash(game.problem) != entry["hash"]:
            raise ValueError(f"ALFWorld game {self.split}/{i}: the generator no longer reproduces the manifest's "
                             "game (hash mismatch); rebuild it with `python -m icsd_audit.envs.alfworld.manifest`")
        if not path.exists():
            write_game(folder, game, walkthrough=list(entry["walkthrough"]))
        return GameRef(path=path, task_type=game.task_type, task_text=game.task_text, synthetic=True)


def generated_games(split: str, *, manifest: str | Path | None = None, cache: str | Path | None = None) -> _LazyGames:
    """The built-in generated games of ``split`` (``train`` or ``eval``), written on first use."""
    if split not in SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r} for the generated games; choose one of {list(SPLITS)}")
    return _LazyGames(split, load_manifest(manifest), Path(cache) if cache is not None else _cache_dir())


@lru_cache(maxsize=8)
def _scan_official(root_str: str, folder: str) -> tuple[GameRef, ...]:
    base = Path(root_str)
    split_dir = base / "json_2.1.1" / folder if (base / "json_2.1.1").is_dir() else base / folder
    if not split_dir.is_dir():
        raise FileNotFoundError(f"ALFWorld data {base}: no {folder}/ folder (looked for {split_dir}); point "
                                "ALFWORLD_DATA or alfworld_data= at the folder holding json_2.1.1/")
    refs: list[GameRef] = []
    for traj in sorted(split_dir.rglob("traj_data.json")):
        root = traj.parent
        if "movable" in str(root) or "Sliced" in str(root):
            continue
        game = root / "game.tw-pddl"
        if not game.exists():
            continue
        try:
            meta = json.loads(traj.read_text())
            solvable = json.loads(game.read_text()).get("solvable")
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"ALFWorld data {root}: unreadable traj_data.json or game.tw-pddl ({exc})") from None
        if meta.get("task_type") not in TASK_TYPES or not solvable:
            continue
        refs.append(GameRef(path=game, task_type=meta["task_type"], task_text="", synthetic=False))
    if not refs:
        raise FileNotFoundError(f"ALFWorld data {split_dir}: no solvable game.tw-pddl of the six task types found")
    return tuple(refs)


def official_games(data: str | Path, split: str) -> tuple[GameRef, ...]:
    """The official games of ``split`` (``train``, ``eval`` = valid_unseen, ``valid_seen``, ``valid_unseen``)."""
    if split not in OFFICIAL_SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; choose one of {list(OFFICIAL_SPLITS)}")
    return _scan_official(str(Path(data).expanduser().resolve()), OFFICIAL_SPLITS[split])


def game_files(split: str, *, data: str | Path | None = None) -> Any:
    """The games of ``split``: official ones under ``data`` (or ``$ALFWORLD_DATA``), else the generated ones.

    Returns a sequence-like object with ``len()`` and ``ref(i) -> GameRef``.
    """
    data = data if data else _env_data()
    if data:
        return _OfficialGames(official_games(data, split), Path(data).expanduser().resolve())
    return generated_games(split)


def _env_data() -> str | None:
    """``$ALFWORLD_DATA``, unless it is only alfworld's own default with nothing downloaded.

    Importing ``alfworld`` sets ``ALFWORLD_DATA`` to ``~/.cache/alfworld`` (and creates
    it) when it is unset, so that value counts only when ``alfworld-download`` filled it.
    """
    value = os.environ.get("ALFWORLD_DATA", "").strip()
    if not value:
        return None
    path = Path(value).expanduser()
    if path == Path("~/.cache/alfworld").expanduser() and not (path / "json_2.1.1").is_dir():
        return None
    return value


class _OfficialGames:
    synthetic = False

    def __init__(self, refs: tuple[GameRef, ...], root: Path):
        self.refs, self.root = refs, root

    def describe(self) -> dict[str, Any]:
        return {"synthetic": False, "source": f"official ALFWorld data under {self.root}"}

    def __len__(self) -> int:
        return len(self.refs)

    def task_type(self, i: int) -> str:
        return self.refs[i].task_type

    def ref(self, i: int) -> GameRef:
        return self.refs[i]

"""Run folders as data: find them, read their config, manifest and per-step metrics.

A *run folder* is a directory holding ``run.json`` (:mod:`.manifest`), ``metrics.jsonl``
or ``config.json`` -- what ``icsd train`` writes with any engine.  Given a parent folder,
:func:`find_runs` walks it for run folders (not into them).  A path that is not a run
folder and holds none is reported, never guessed at.

Run folders may also sit on an object store: a path ``SCHEME://...`` (``s3://``, ``gs://``,
``hf://``, ``memory://``; the ``cloud`` extra) is listed and read through fsspec
(:mod:`icsd_audit.dumps.store`), with the same rules; such a run's ``path`` is its URL (a
string), and ``file://`` is a local path.

``metrics.jsonl`` holds one JSON object per logged step.  A key absent from a record
was not logged at that step; a key present with ``null`` was logged as a non-finite
number (the writer turns NaN and infinities into null).  :class:`Series` keeps the two
apart, because SPEC 10's scores refuse non-finite values but skip unlogged steps.
Evaluation records from ``eval.jsonl`` fill in ``eval/...`` keys when ``metrics.jsonl``
has none (an engine that logs evaluations only there). Both are read line by line within
a size limit per line, keeping only the keys asked for (:mod:`.jsonl`); a ``step`` that
is not a finite integer is refused naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from icsd_audit.runs.jsonl import MAX_LINE_BYTES, RunError, read_records

if TYPE_CHECKING:  # the store's module is imported where a URL is given (the dumps package imports pyarrow)
    from icsd_audit.dumps.store import StoreFile

__all__ = ["Run", "Series", "RunError", "find_runs", "load_run", "load_runs", "is_run_folder", "location", "run_file",
           "RUN_MARKERS"]

#: Files whose presence makes a directory a run folder.
RUN_MARKERS = ("run.json", "metrics.jsonl", "config.json")
#: Sub-folders of a run folder that never hold runs (not walked).
_NOT_RUNS = {"dumps", "checkpoints", "tensorboard", "mlflow", "wandb", "trl", "__pycache__"}


@dataclass(frozen=True)
class Series:
    """One metric over the logged steps of a run.

    ``steps`` are the steps that logged the key (ascending); ``values`` their values,
    NaN where the record held ``null`` (a non-finite number) or a non-number.
    """

    key: str
    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return int(self.steps.shape[0])


@dataclass(frozen=True)
class Run:
    """A run folder read into memory: config, manifest (``run.json``) and metric columns.

    ``path``: the folder (a ``Path``), or its URL for a run on an object store.
    """

    path: Path | str
    name: str
    config: Mapping[str, Any] | None
    manifest: Mapping[str, Any] | None
    steps: np.ndarray
    columns: Mapping[str, np.ndarray] = field(repr=False)
    logged: Mapping[str, np.ndarray] = field(repr=False)

    @property
    def engine(self) -> str | None:
        return None if self.manifest is None else self.manifest.get("engine")

    def field(self, key: str) -> Any:
        """A config field (``engine`` from the manifest); KeyError when the run does not record it."""
        if key == "engine" and self.engine is not None:
            return self.engine
        if self.config is not None and key in self.config:
            return self.config[key]
        if self.manifest is not None and key in self.manifest and key in ("seed", "engine"):
            return self.manifest[key]
        raise KeyError(key)

    @property
    def keys(self) -> list[str]:
        return sorted(self.columns)

    def series(self, key: str) -> Series | None:
        """The key's values at the steps that logged it, or None when no step did."""
        col = self.columns.get(key)
        if col is None:
            return None
        mask = self.logged[key]
        return Series(key, self.steps[mask], col[mask])


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in RUN_MARKERS)


def location(raw: str | Path) -> Path | str:
    """A local path (also ``file://``), or the URL of a store location as given (``SCHEME://...``)."""
    if isinstance(raw, Path) or "://" not in raw:
        return Path(raw)
    from icsd_audit.dumps.store import local_path

    p = local_path(raw)
    return p if p is not None else raw


def run_file(folder: Path | str, name: str) -> Path | StoreFile:
    """The file ``name`` of a run folder: a local path, or the object of a run on a store (by URL)."""
    if isinstance(folder, Path):
        return folder / name
    from icsd_audit.dumps.store import store_object

    return store_object(folder.rstrip("/") + "/" + name)


def _store_runs(url: str) -> tuple[list[str], list[tuple[str, str]]]:
    """:func:`find_runs` of one store URL: the topmost folders holding a run marker, in the order a walk of
    sorted folders meets them (hidden folders and :data:`_NOT_RUNS` below ``url`` not entered)."""
    from icsd_audit.dumps.store import StoreError, find_objects

    try:
        _, root, single, objects = find_objects(url)
    except StoreError as exc:
        if exc.reason == "no such file or directory":
            raise FileNotFoundError(2, "no such file or directory", url) from None
        raise
    if single:
        return [], [(url, "not a run folder (a file)")]
    folders: dict[str, set[str]] = {}
    for p in objects:
        parent, _, name = p[len(root):].strip("/").rpartition("/")
        folders.setdefault(parent, set()).add(name)
    found: list[str] = []
    for rel in sorted((f for f, names in folders.items() if not names.isdisjoint(RUN_MARKERS)),
                      key=lambda f: f.split("/") if f else []):
        parts = rel.split("/") if rel else []
        if any(x.startswith(".") or x in _NOT_RUNS for x in parts):
            continue
        if any(not f or rel.startswith(f + "/") for f in found):
            continue  # inside a run folder: not walked
        found.append(rel)
    base = url.rstrip("/")
    if not found:
        return [], [(url, f"not a run folder: no {', '.join(RUN_MARKERS)} in it or below it")]
    return [f"{base}/{rel}" if rel else base for rel in found], []


def find_runs(paths: Sequence[str | Path]) -> tuple[list[Path | str], list[tuple[str, str]]]:
    """Run folders under ``paths`` (each a run folder or a parent of some), and the paths that held none.

    A path that does not exist is an error (``FileNotFoundError``); a file or a folder
    without runs comes back in the second list with the reason, to be named and left out.
    """
    found: list[Path | str] = []
    skipped: list[tuple[str, str]] = []
    for raw in paths:
        p = location(raw)
        if isinstance(p, str):
            runs, left = _store_runs(p)
            found.extend(runs)
            skipped.extend(left)
            continue
        if not os.path.lexists(p):
            raise FileNotFoundError(2, "no such file or directory", str(p))
        if is_run_folder(p):
            found.append(p)
            continue
        if not p.is_dir():
            skipped.append((str(p), "not a run folder (a file)"))
            continue
        below = _walk(p)
        if below:
            found.extend(below)
        else:
            skipped.append((str(p), f"not a run folder: no {', '.join(RUN_MARKERS)} in it or below it"))
    seen: set[Path | str] = set()
    unique = []
    for f in found:
        key = f.resolve() if isinstance(f, Path) else f
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique, skipped


def _walk(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if here != root and is_run_folder(here):
            out.append(here)
            dirnames.clear()
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _NOT_RUNS)
    return out


def _read_json(path: Path | StoreFile) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open("rb") as fh:
        raw = fh.read(MAX_LINE_BYTES + 1)
    if len(raw) > MAX_LINE_BYTES:
        raise RunError(f"{path}: larger than {MAX_LINE_BYTES // 2**20} MiB (MAX_LINE_BYTES), not a run's settings")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RunError(f"{path}: not UTF-8 text (byte {exc.start + 1})") from None
    except ValueError as exc:
        raise RunError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise RunError(f"{path}: JSON nested deeper than can be read") from None
    if not isinstance(data, dict):
        raise RunError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _eval_records(path: Path | StoreFile, keep: Callable[[str], bool] | None) -> list[tuple[int, dict[str, Any]]]:
    """``eval.jsonl`` records as ``eval/...`` keys (subsets flattened as ``eval/subsets/NAME``), with line numbers."""
    out = []
    for number, rec in read_records(path)[0]:
        if "step" not in rec:
            continue
        if _step(rec["step"]) is None:
            raise RunError(f"{path}: line {number} has no integer 'step' (found {_shown(rec['step'])})")
        flat: dict[str, Any] = {"step": rec["step"]}
        for k, v in rec.items():
            if k == "subsets" and isinstance(v, Mapping):
                flat.update({f"eval/subsets/{g}": x for g, x in v.items()})
            elif k not in ("step", "split", "subset_tasks"):
                flat[f"eval/{k}"] = v
        out.append((number, {k: v for k, v in flat.items() if k == "step" or keep is None or keep(k)}))
    return out


_ABSENT = object()


def _number(v: Any) -> float | None:
    """A logged value as float; None for anything that is not a number (strings, lists, dicts, absent)."""
    if v is _ABSENT:
        return None
    if v is None:
        return math.nan
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, float):
        return v
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:  # beyond float64: not a finite number
            return math.nan
    return None


def _step(value: Any) -> int | None:
    """A record's ``step`` as an int64-sized integer, or None (absent, not a number, NaN, infinite, fractional)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and -2**63 <= value < 2**63 else None


def _shown(value: Any) -> str:
    """A bad ``step`` value for a message: a number as written (NaN, Infinity, 1e+30), else its JSON type."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = json.dumps(value) if isinstance(value, float) else str(value)
        return text if len(text) <= 24 else text[:20] + "..."
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null"}[type(value)]


def _columns(records: Sequence[tuple[int, Mapping[str, Any]]], source: Path | StoreFile, wanted: Callable[[str], bool] | None
             ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    by_step: dict[int, dict[str, Any]] = {}
    for number, rec in records:
        step = _step(rec.get("step"))
        if step is None:
            shown = _shown(rec["step"]) if "step" in rec else "none"
            raise RunError(f"{source}: line {number} has no integer 'step' (found {shown})")
        if step in by_step:
            by_step[step] = {**by_step[step], **rec}  # a step logged twice: its later record wins
        else:
            by_step[step] = rec  # type: ignore[assignment]
    steps = np.array(sorted(by_step), dtype=np.int64)
    rows = [by_step[s] for s in steps.tolist()]
    keys = set().union(*rows) - {"step"} if rows else set()
    values: dict[str, np.ndarray] = {}
    logged: dict[str, np.ndarray] = {}
    for k in sorted(keys):
        if wanted is not None and not wanted(k):
            continue
        raw = [r.get(k, _ABSENT) for r in rows]
        nums = [_number(v) for v in raw]
        if all(x is None for x in nums):
            continue  # text or structured values: not a metric
        values[k] = np.array([math.nan if x is None else x for x in nums], dtype=np.float64)
        logged[k] = np.array([v is not _ABSENT and x is not None for v, x in zip(raw, nums)], dtype=bool)
    return steps, values, logged


def load_run(path: str | Path, *, name: str | None = None, keys: Callable[[str], bool] | None = None) -> Run:
    """Read one run folder (``RunError`` / ``OSError`` on unreadable files); a URL reads it from its store.

    ``keys`` keeps only the metrics it accepts (all by default): a comparison needs a few
    of the ~70 keys a step logs, and building columns is most of the reading time.
    """
    p = location(path)
    p = p.rstrip("/") if isinstance(p, str) else p
    config = _read_json(run_file(p, "config.json"))
    manifest = _read_json(run_file(p, "run.json"))
    if config is None and manifest is not None and isinstance(manifest.get("config"), dict):
        config = manifest["config"]
    recs, saw_eval = read_records(run_file(p, "metrics.jsonl"), keep=keys)
    if not saw_eval:
        recs = recs + _eval_records(run_file(p, "eval.jsonl"), keys)
    steps, cols, logged = _columns(recs, run_file(p, "metrics.jsonl"), keys)
    return Run(path=p, name=name or str(p), config=config, manifest=manifest, steps=steps, columns=cols, logged=logged)


def load_runs(paths: Sequence[str | Path], *, keys: Callable[[str], bool] | None = None
              ) -> tuple[list[Run], list[tuple[str, str]]]:
    """Every run under ``paths`` (:func:`find_runs`), read; and the paths left out, with reasons."""
    folders, skipped = find_runs(paths)
    return [load_run(f, keys=keys) for f in folders], skipped

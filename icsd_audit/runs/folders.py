"""Run folders as data: find them, read their config, manifest and per-step metrics.

A *run folder* is a directory holding ``run.json`` (:mod:`.manifest`), ``metrics.jsonl``
or ``config.json`` -- what ``icsd train`` writes with any engine.  Given a parent folder,
:func:`find_runs` walks it for run folders (not into them).  A path that is not a run
folder and holds none is reported, never guessed at.

``metrics.jsonl`` holds one JSON object per logged step.  A key absent from a record
was not logged at that step; a key present with ``null`` was logged as a non-finite
number (the writer turns NaN and infinities into null).  :class:`Series` keeps the two
apart, because SPEC 10's scores refuse non-finite values but skip unlogged steps.
Evaluation records from ``eval.jsonl`` fill in ``eval/...`` keys when ``metrics.jsonl``
has none (an engine that logs evaluations only there).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["Run", "Series", "RunError", "find_runs", "load_run", "load_runs", "is_run_folder", "RUN_MARKERS"]

#: Files whose presence makes a directory a run folder.
RUN_MARKERS = ("run.json", "metrics.jsonl", "config.json")
#: Sub-folders of a run folder that never hold runs (not walked).
_NOT_RUNS = {"dumps", "checkpoints", "tensorboard", "mlflow", "wandb", "trl", "__pycache__"}


class RunError(ValueError):
    """A run folder that cannot be read: one line naming the file (and line) and what is wrong."""


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
    """A run folder read into memory: config, manifest (``run.json``) and metric columns."""

    path: Path
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


def find_runs(paths: Sequence[str | Path]) -> tuple[list[Path], list[tuple[str, str]]]:
    """Run folders under ``paths`` (each a run folder or a parent of some), and the paths that held none.

    A path that does not exist is an error (``FileNotFoundError``); a file or a folder
    without runs comes back in the second list with the reason, to be named and left out.
    """
    found: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for p in map(Path, paths):
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
    seen: set[Path] = set()
    unique = []
    for f in found:
        key = f.resolve()
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


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise RunError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RunError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSONL records; a torn last line (a crash mid-write) is dropped, any other bad line is an error."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise RunError(f"{path}: line {i + 1} is not valid JSON") from None
        if not isinstance(rec, dict):
            raise RunError(f"{path}: line {i + 1} is not a JSON object")
        out.append(rec)
    return out


def _eval_records(path: Path) -> list[dict[str, Any]]:
    """``eval.jsonl`` records as ``eval/...`` keys (subsets flattened as ``eval/subsets/NAME``)."""
    out = []
    for rec in _records(path):
        if "step" not in rec:
            continue
        flat: dict[str, Any] = {"step": rec["step"]}
        for k, v in rec.items():
            if k == "subsets" and isinstance(v, Mapping):
                flat.update({f"eval/subsets/{g}": x for g, x in v.items()})
            elif k not in ("step", "split", "subset_tasks"):
                flat[f"eval/{k}"] = v
        out.append(flat)
    return out


_ABSENT = object()
#: Files at least this large are read with polars (below it, json per line is as fast as polars' import).
_FAST_MIN_BYTES = 1 << 20


def _number(v: Any) -> float | None:
    """A logged value as float; None for anything that is not a number (strings, lists, dicts, absent)."""
    if v is _ABSENT:
        return None
    if v is None:
        return math.nan
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _columns(records: Sequence[Mapping[str, Any]], source: Path, wanted: Callable[[str], bool] | None
             ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    by_step: dict[int, dict[str, Any]] = {}
    for i, rec in enumerate(records):
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
            raise RunError(f"{source}: record {i + 1} has no integer 'step'")
        if int(step) in by_step:
            by_step[int(step)] = {**by_step[int(step)], **rec}  # a step logged twice: its later record wins
        else:
            by_step[int(step)] = rec  # type: ignore[assignment]
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


def _fast_columns(path: Path, wanted: Callable[[str], bool] | None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """:func:`_columns` through polars' NDJSON reader (5x faster than ``json`` per line), or None.

    None (the caller takes the line-by-line path, which explains any problem) when the file
    is absent or is not clean NDJSON with one record per step and a type per key, or when
    it holds no ``eval/`` key beside an ``eval.jsonl`` (merged on that path).  polars
    reads an absent key and a ``null`` alike; a null of a kept key is told apart by looking
    for ``"key": null`` on its line (the writer turns non-finite numbers into null).
    """
    if not path.is_file() or path.stat().st_size < _FAST_MIN_BYTES:
        return None  # small files: the line-by-line path is as fast and spares importing polars
    import polars as pl

    text = path.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        df = pl.read_ndjson(text.encode(), infer_schema_length=None)
    except Exception:  # any parse or type problem: the careful path reports it  # noqa: BLE001
        return None
    if df.height != len(lines) or "step" not in df.columns:
        return None
    if not any(c.startswith("eval/") for c in df.columns) and (path.parent / "eval.jsonl").is_file():
        return None
    step = df.get_column("step")
    if not step.dtype.is_integer() or step.null_count() or step.n_unique() != df.height:
        return None
    order = np.argsort(step.to_numpy(), kind="stable")
    values: dict[str, np.ndarray] = {}
    logged: dict[str, np.ndarray] = {}
    for k in sorted(df.columns):
        col = df.get_column(k)
        if k == "step" or (wanted is not None and not wanted(k)):
            continue
        if not (col.dtype.is_numeric() or col.dtype in (pl.Boolean, pl.Null)):
            continue  # text, lists, objects: not a metric (as on the careful path)
        present = col.is_not_null().to_numpy()
        if not present.all():
            null = re.compile(r'"' + re.escape(k) + r'"\s*:\s*null')
            present = present | np.array([bool(null.search(ln)) for ln in lines])
        values[k] = col.cast(pl.Float64).to_numpy()[order]  # null -> NaN
        logged[k] = present[order]
    return np.sort(step.to_numpy()).astype(np.int64), values, logged


def load_run(path: str | Path, *, name: str | None = None, keys: Callable[[str], bool] | None = None) -> Run:
    """Read one run folder (``RunError`` / ``OSError`` on unreadable files).

    ``keys`` keeps only the metrics it accepts (all by default): a comparison needs a few
    of the ~70 keys a step logs, and building columns is most of the reading time.
    """
    p = Path(path)
    config = _read_json(p / "config.json")
    manifest = _read_json(p / "run.json")
    if config is None and manifest is not None and isinstance(manifest.get("config"), dict):
        config = manifest["config"]
    fast = _fast_columns(p / "metrics.jsonl", keys)
    if fast is not None:
        steps, cols, logged = fast
    else:
        recs = _records(p / "metrics.jsonl")
        if not any(k.startswith("eval/") for r in recs for k in r):
            recs = recs + _eval_records(p / "eval.jsonl")
        steps, cols, logged = _columns(recs, p / "metrics.jsonl", keys)
    return Run(path=p, name=name or str(p), config=config, manifest=manifest, steps=steps, columns=cols, logged=logged)


def load_runs(paths: Sequence[str | Path], *, keys: Callable[[str], bool] | None = None
              ) -> tuple[list[Run], list[tuple[str, str]]]:
    """Every run under ``paths`` (:func:`find_runs`), read; and the paths left out, with reasons."""
    folders, skipped = find_runs(paths)
    return [load_run(f, keys=keys) for f in folders], skipped

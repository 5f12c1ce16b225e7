"""``run.json``: what a run folder holds, written by every engine and read by ``icsd compare``.

The manifest records the run's config, seed and engine, the versions of the packages
that shaped its numbers, the git revision of the icsd source when it is a checkout,
the hardware, start and end times and the number of completed steps.  It is rewritten
atomically (temporary file in the folder, then rename) at the start, after every step
and at the end, so a reader always sees a complete JSON object, and a run that stopped
early says so (``status`` ``running`` with the steps it completed; ``finished`` once the
engine returned).  A resumed run keeps the first start time and appends a session.

``compare`` groups runs by the manifest's config and refuses to pool runs whose engine
or config differ (:mod:`.compare`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MANIFEST", "SCHEMA", "RunManifest", "read_manifest", "versions", "git_revision", "hardware"]

MANIFEST = "run.json"
#: Schema version of run.json; bumped on an incompatible change.
SCHEMA = 1
#: Distributions whose versions are recorded (those present).
_PACKAGES = ("icsd-audit", "torch", "numpy", "transformers", "trl", "verl", "peft", "accelerate")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """Python and the installed versions of the packages that shape a run's numbers."""
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def git_revision(path: str | Path | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout holding ``path`` (default: this package), else None."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        top = subprocess.run(["git", "-C", str(where), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        if path is None and not (Path(top) / "icsd_audit" / "runs" / "manifest.py").is_file():
            return None  # installed inside some other repository (a venv in a project): not our revision
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty} if commit else None


def hardware() -> dict[str, Any]:
    """Host, CPU count, memory and the accelerators torch sees (torch only when already imported)."""
    import sys

    hw: dict[str, Any] = {"host": platform.node(), "machine": platform.machine(), "system": platform.system(),
                          "cpus": os.cpu_count()}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        hw["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    torch = sys.modules.get("torch")
    if torch is not None:
        hw["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            hw["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return hw


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of a run folder, or None when it has none."""
    p = Path(folder) / MANIFEST
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return data


def _write_atomic(path: Path, data: Mapping[str, Any]) -> None:
    text = json.dumps(data, indent=2, sort_keys=False, default=str, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        from icsd_audit.outputs import umask_mode

        umask_mode(tmp)  # mkstemp's 0600 is not what a plain new file gets
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class RunManifest:
    """Keeps ``<folder>/run.json`` up to date through a run.

    ``start()`` at the beginning, ``step(completed)`` after each step, ``finish()`` at the
    end (``status="finished"``; other statuses, e.g. ``"failed"``, are free text).  The
    config must be JSON-able (a :class:`~icsd_audit.train.config.fields.TrainConfig` ``to_dict()``).
    """

    def __init__(self, folder: str | Path, *, config: Mapping[str, Any], engine: str,
                 seed: int | None = None, total_steps: int | None = None, start_step: int = 0,
                 extra: Mapping[str, Any] | None = None) -> None:
        self.path = Path(folder) / MANIFEST
        self.path.parent.mkdir(parents=True, exist_ok=True)
        previous = None
        with contextlib.suppress(OSError, ValueError):
            previous = read_manifest(folder)
        now = _now()
        session = {"started": now, "ended": None, "start_step": int(start_step), "host": platform.node(),
                   "pid": os.getpid()}
        sessions = list(previous.get("sessions", [])) if previous and start_step > 0 else []
        self.data: dict[str, Any] = {
            "schema": SCHEMA,
            "engine": engine,
            "seed": seed if seed is not None else config.get("seed"),
            "status": "running",
            "started": previous.get("started", now) if previous and start_step > 0 else now,
            "ended": None,
            "completed_steps": int(start_step),
            "total_steps": total_steps if total_steps is not None else config.get("total_steps"),
            "versions": versions(),
            "git": git_revision(),
            "hardware": hardware(),
            "sessions": sessions + [session],
            "config": json.loads(json.dumps(dict(config), default=str)),
            **(dict(extra) if extra else {}),
        }

    def start(self) -> "RunManifest":
        self.data["hardware"] = hardware()  # torch is imported by now: threads and accelerators are known
        self._save()
        return self

    def step(self, completed_steps: int) -> None:
        self.data["completed_steps"] = int(completed_steps)
        self.data["updated"] = _now()
        self._save()

    def finish(self, status: str = "finished") -> None:
        now = _now()
        self.data.update(status=status, ended=now)
        self.data["sessions"][-1]["ended"] = now
        self.data["sessions"][-1]["end_step"] = self.data["completed_steps"]
        self._save()

    def _save(self) -> None:
        _write_atomic(self.path, self.data)

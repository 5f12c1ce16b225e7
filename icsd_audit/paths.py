"""Where icsd keeps what it builds once: the converted models, BM25 indexes, generated games."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """Root of icsd's cache: ``$ICSD_CACHE``, else ``$XDG_CACHE_HOME/icsd``, else ``~/.cache/icsd``."""
    env = os.environ.get("ICSD_CACHE", "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "icsd"

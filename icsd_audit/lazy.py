"""Names a package exports lazily: looked up in their module on first use, so importing the package stays cheap."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that loads each name of ``exports`` (name -> module) on first use."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return getattr_

"""Help pages in the familiar click/GNU style, whatever typer version renders them.

Recent typer releases label every value with its Python annotation (``<str>``,
``<list[Path]>``), give flags a ``<bool>`` type (``--help <bool>``) and write required
arguments as ``{paths}...`` in the usage line. :func:`install` swaps those three
renderings, at the class level, for what users know from click and coreutils:

* ``Usage: icsd audit tcm [OPTIONS] PATHS...`` (optional: ``[PATHS]...``);
* a value's type as ``TEXT``, ``INTEGER``, ``FLOAT``, ``PATH`` (or the metavar);
* flags (``--json``, ``--help``) with no type at all.

:func:`reflow` joins the source line breaks inside a docstring's paragraphs: typer's
rich mode keeps them, which put mid-sentence breaks in ``icsd audit --help``.

Each patch checks that the attribute it replaces exists, so an older typer (which
renders this way already) is left alone.  Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["install", "reflow", "type_label"]

_INSTALLED = False


_LABELS = {"str": "TEXT", "string": "TEXT", "int": "INTEGER", "integer": "INTEGER", "float": "FLOAT",
           "bool": "BOOLEAN", "boolean": "BOOLEAN", "path": "PATH", "file": "PATH", "directory": "PATH"}


def type_label(typer_label: str) -> str:
    """click's name for typer's ``<int>``-style label: INTEGER, FLOAT, TEXT, PATH ...

    ``<list[Path]>`` becomes PATH (the ``...`` of a repeated value is added by the caller).
    """
    t = typer_label.strip().strip("<>")
    while t.startswith("list[") and t.endswith("]"):
        t = t[5:-1]
    return "|".join(_LABELS.get(part.lower(), part.upper()) for part in t.split("|"))


def reflow(doc: str | None) -> str | None:
    """A docstring with each paragraph on one line (paragraphs stay apart; indented or
    bulleted lines keep their own line)."""
    if not doc:
        return doc
    out: list[str] = []
    for para in inspect.cleandoc(doc).split("\n\n"):
        lines = para.split("\n")
        keep = any(ln.startswith(("  ", "- ", "* ", "\b")) for ln in lines[1:])
        out.append(para if keep else " ".join(ln.strip() for ln in lines))
    return "\n\n".join(out)


def install() -> None:
    """Patch typer's parameter rendering once per process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from typer import core

    arg_cls = getattr(core, "TyperArgument", None)
    opt_cls = getattr(core, "TyperOption", None)
    if arg_cls is None or opt_cls is None:
        return

    def arg_name(self: Any) -> str:
        return str(self.metavar or self.name or "").upper()

    if hasattr(arg_cls, "_usage_display_name"):
        def usage_name(self: Any) -> str:
            name = arg_name(self)
            name = name if self.required else f"[{name}]"
            return name + ("..." if self.nargs != 1 else "")

        arg_cls._usage_display_name = usage_name
    if hasattr(arg_cls, "_rich_display_name"):
        arg_cls._rich_display_name = lambda self: self.name or arg_name(self).lower()
    base_type = getattr(core, "_TyperParameter", None)
    typer_type = getattr(base_type, "display_type", None)
    if typer_type is None:
        return

    def display_type(self: Any, ctx: Any) -> str:
        return type_label(typer_type(self, ctx))

    base_type.display_type = display_type  # plain (non-rich) pages read this one too
    if hasattr(arg_cls, "display_type_rich"):
        def arg_type(self: Any, ctx: Any) -> str:
            return display_type(self, ctx) + ("..." if self.nargs != 1 else "")

        arg_cls.display_type_rich = arg_type
    if hasattr(opt_cls, "display_type_rich"):
        def opt_type(self: Any, ctx: Any) -> str | None:
            if getattr(self, "is_flag", False) or getattr(self, "count", False):
                return None
            if self.metavar is not None:
                return self.metavar
            return display_type(self, ctx) + ("..." if self.nargs != 1 else "")

        opt_cls.display_type_rich = opt_type

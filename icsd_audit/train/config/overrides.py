"""``key=value`` overrides of a :class:`~icsd_audit.train.config.fields.TrainConfig` and its field docs."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import fields
from typing import Any

from icsd_audit.alloc.settings import SETTING_HELP
from icsd_audit.train.config.errors import ConfigError
from icsd_audit.train.config.fields import TrainConfig

__all__ = ["field_docs", "parse_override"]


def field_docs() -> dict[str, tuple[str, str, Any]]:
    """Field name -> (type, docstring, default), read from this module's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    for src, dst in TrainConfig.ALLOCATION_FIELDS.items():
        docs.setdefault(src, SETTING_HELP[dst])  # the allocator settings' help is written once, in AllocatorSettings
    defaults = TrainConfig()
    return {f.name: (str(f.type), docs.get(f.name, ""), getattr(defaults, f.name)) for f in fields(TrainConfig)}


def parse_override(text: str) -> tuple[str, Any]:
    """``'key=value'`` -> (key, typed value), typed by the field's default/annotation."""
    if "=" not in text:
        raise ConfigError([f"override {text!r} must look like key=value, e.g. lr=1e-5"])
    key, raw = (s.strip() for s in text.split("=", 1))
    types = {f.name: str(f.type) for f in fields(TrainConfig)}
    if key not in types:
        raise ConfigError([f"unknown field {key!r} in override {text!r}; see `icsd train --list-fields`"])
    t = types[key]
    if raw.lower() in ("none", "null") and "None" in t:
        return key, None
    try:
        if t.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return key, True
            if raw.lower() in ("0", "false", "no", "off"):
                return key, False
            raise ValueError(raw)
        if t.startswith("int"):
            return key, int(raw)
        if t.startswith("float"):
            return key, float(raw)
    except ValueError:
        raise ConfigError([f"override {text!r}: {raw!r} is not a valid {t.split(' ')[0]}"]) from None
    return key, raw

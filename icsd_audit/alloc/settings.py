"""The allocator settings: one frozen object, validated once, whose defaults are SPEC 2-5's.

Every consumer takes or embeds :class:`AllocatorSettings`: :func:`~icsd_audit.alloc.variants.allocate`, the
permutation controls, the padded-batch core of the engine integrations, the training ``Distillation`` and
``TrainConfig``, the audit commands. Its serialisation (:meth:`AllocatorSettings.to_dict`) is the settings part of
SPEC 9's ``allocator`` provenance block, so what a producer deployed and what the audit recomputes with are the same
eight values. The help text of each setting is its field docstring (:data:`SETTING_HELP`), shared by every command.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping


__all__ = ["AllocatorSettings", "SETTING_NAMES", "SETTING_HELP", "DEFAULTS"]


@dataclass(frozen=True)
class AllocatorSettings:
    """How the allocator maps (advantage, ratio, delta) to coefficients; the keys of SPEC 9's ``allocator`` block."""

    allocator: str = "icsd"
    """Allocator: icsd (paper), sdar (trust only), opsd (uniform) or an ablation variant (fisher, sign, influence-only, gaussian, permuted)."""
    trust: str = "laplace"
    """Base trust g: laplace (paper, SPEC 3), sigmoid (SDAR's public code) or uniform."""
    trust_beta: float = 5.0
    """Slope beta of the sigmoid trust g = sigmoid(beta * delta) (SDAR's gate_beta)."""
    trust_eta: float = 0.4
    """Split parameter eta of the Laplace trust map (SPEC 3)."""
    influence_eta: float = 0.5
    """Split parameter eta of the calibrated influence score (SPEC 4)."""
    eps: float = 1e-4
    """Scale floor of the Laplace fits, turn-mass threshold (SPEC 2, 4) and TCM's |u| threshold (SPEC 6)."""
    min_group: int = 8
    """Fewest values a calibration group needs for its own fit; smaller groups fall back to the batch (SPEC 2)."""
    seed: int = 0
    """Seed of the permuted allocator's shuffle (the same for every batch)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every reason no allocation can use these settings, one line each (empty when they are valid)."""
        out: list[str] = []
        for name in ("allocator", "trust"):
            value = getattr(self, name)
            if not isinstance(value, str):
                out.append(f"{name} must be a name, got {value!r}")
            elif value != _DEFAULT_NAMES[name]:  # the defaults are registered (tested): no torch import for them
                problem = _unregistered(name, value)
                if problem:
                    out.append(problem)
        for name in ("trust_beta", "eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
                out.append(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("trust_eta", "influence_eta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < 1:
                out.append(f"{name} must lie in (0, 1), got {v!r}")
        if isinstance(self.min_group, bool) or not isinstance(self.min_group, numbers.Integral) or self.min_group < 1:
            out.append(f"min_group must be an integer >= 1, got {self.min_group!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed < 2**63:
            out.append(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        return out

    def replace(self, **changes: Any) -> "AllocatorSettings":
        """A copy with ``changes`` (``None`` values leave a setting as it is), validated."""
        given = {k: v for k, v in changes.items() if v is not None}
        unknown = sorted(set(given) - set(SETTING_NAMES))
        if unknown:
            raise TypeError(f"unknown allocator setting(s) {', '.join(unknown)}; valid: {', '.join(SETTING_NAMES)}")
        return dataclasses.replace(self, **given) if given else self

    def to_dict(self) -> dict[str, Any]:
        """The eight settings as SPEC 9 names them (the ``allocator`` block without ``alloc_scope``/``ratio_source``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "AllocatorSettings":
        """Settings from a mapping holding (at least) some of the eight keys; other keys are ignored."""
        return cls().replace(**{k: values[k] for k in SETTING_NAMES if k in values})


#: the default allocator and trust names (registered by alloc.scores and alloc.trust)
_DEFAULT_NAMES = {"allocator": "icsd", "trust": "laplace"}


def _unregistered(kind: str, name: str) -> str | None:
    """Why ``name`` is not a registered allocator / trust, or None. Loads the registries (and torch) on first use,
    so that building settings with the default names, as the CLI does for its help, imports no torch."""
    import icsd_audit.alloc.scores  # noqa: F401  (the definitions register the allocators)
    import icsd_audit.alloc.trust  # noqa: F401  (and the trust maps)
    from icsd_audit.alloc.registry import get_allocator, get_trust

    try:
        (get_allocator if kind == "allocator" else get_trust)(name)
    except ValueError as e:
        return str(e)
    return None


def _field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal right below it in the class body)."""
    body = ast.parse(inspect.getsource(AllocatorSettings)).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value
    return docs


#: the settings' names, in SPEC 9 order
SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in fields(AllocatorSettings))
#: the defaults, as an object (read a default as ``DEFAULTS.trust_beta``)
DEFAULTS = AllocatorSettings()
#: setting -> help text, shared by every command that takes the setting
SETTING_HELP: dict[str, str] = _field_docs()

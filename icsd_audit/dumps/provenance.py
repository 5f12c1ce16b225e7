"""The provenance blocks of a dump (SPEC 9): what was deployed, and who wrote it.

Every producer (the built-in loop, TRL, verl, the verl-agent/SDAR drop-in, a user's
:class:`~icsd_audit.dumps.writer.DumpWriter`) builds the two blocks of a shard's
``icsd.dump`` metadata here, so the keys are the same everywhere:

* ``allocator`` (:func:`allocator_block`): the deployed settings ``allocator``, ``trust``,
  ``trust_beta``, ``trust_eta``, ``influence_eta``, ``eps``, ``min_group``,
  ``alloc_scope``, ``ratio_source`` and ``seed``.  A setting the producer cannot know
  is ``null``, never absent, and a number that is not finite is refused: a NaN
  setting cannot have been deployed.
* ``producer`` (:func:`producer_block`): ``name``, ``engine``, ``engine_version``,
  ``icsd_version``, ``rank``, ``world_size`` plus free keys (env, model, seed, ...).

The audit reads them back with :func:`recorded_settings`: the settings that change
coefficients (:data:`COEFFICIENT_KEYS`) of every file, compared file by file, so that
shards deployed differently are never pooled silently.

Imports nothing beyond the standard library (any trainer can call it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["ALLOCATOR_KEYS", "PRODUCER_KEYS", "COEFFICIENT_KEYS", "ENGINES", "ALLOC_SCOPES", "RATIO_SOURCES",
           "allocator_block", "deployed_block", "producer_block", "json_safe", "records_settings", "relevant_keys",
           "recorded_values", "RecordedSettings", "SettingsMismatch", "recorded_settings", "settings_groups"]

#: keys of the ``allocator`` block, in SPEC 9 order; every one is present in a written shard
ALLOCATOR_KEYS = ("allocator", "trust", "trust_beta", "trust_eta", "influence_eta", "eps", "min_group",
                  "alloc_scope", "ratio_source", "seed")
#: keys of the ``producer`` block every shard carries (free keys may follow)
PRODUCER_KEYS = ("name", "engine", "engine_version", "icsd_version", "rank", "world_size")
#: the allocator settings an audit recomputes with (``alloc_scope`` and ``ratio_source`` say how the dumped
#: rows were cut and where their ratio came from; recomputing from those rows does not depend on them)
COEFFICIENT_KEYS = ("allocator", "trust", "trust_beta", "trust_eta", "influence_eta", "eps", "min_group", "seed")
ENGINES = ("builtin", "trl", "verl", "verl-agent", "user")
ALLOC_SCOPES = ("mini-batch", "micro-batch", "global")
#: the named ratio sources; a sentence is allowed where none of them says it
RATIO_SOURCES = ("prepass", "own-forward", "fixed-1")

_STRINGS = ("allocator", "trust", "alloc_scope", "ratio_source")
_FLOATS = ("trust_beta", "trust_eta", "influence_eta", "eps")
_INTS = ("min_group", "seed")


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON types, with every non-finite float replaced by ``None``.

    Numpy and torch scalars become Python numbers, tuples become lists and mapping
    keys strings; what JSON cannot hold (an arbitrary object) is written as its ``str``.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy / torch scalar
        return json_safe(value.item())
    return str(value)


def _setting(key: str, value: Any) -> Any:
    """One allocator setting, checked and converted to its JSON type (``None`` stays ``None``)."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if key in _STRINGS:
        if not isinstance(value, str) or not value:
            raise ValueError(f"allocator setting {key!r} must be a non-empty string or None, got {value!r}")
        if key == "alloc_scope" and value not in ALLOC_SCOPES:
            raise ValueError(f"allocator setting alloc_scope={value!r}: choose one of {', '.join(ALLOC_SCOPES)}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"allocator setting {key!r} must be a number or None, got {value!r}")
    if key in _INTS:
        if float(value) != int(value):
            raise ValueError(f"allocator setting {key!r} must be an integer, got {value!r}")
        return int(value)
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"allocator setting {key!r} is {v}: a deployed setting must be finite")
    return v


def allocator_block(settings: Mapping[str, Any] | Any = None, /, **fields: Any) -> dict[str, Any]:
    """The SPEC 9 ``allocator`` block: every key of :data:`ALLOCATOR_KEYS`, ``None`` where unknown.

    ``settings``: a mapping or a dataclass instance (e.g.
    :class:`~icsd_audit.alloc.options.AllocatorOptions`); ``fields`` add to or replace
    its keys.  Keys beyond SPEC 9's (``lambda``, ...) are kept as free keys after them.
    A non-finite number, a setting of the wrong type or an unknown ``alloc_scope`` is a
    ``ValueError`` naming the key.

    >>> allocator_block(allocator="icsd", trust="sigmoid", trust_beta=5.0)["eps"] is None
    True
    """
    if settings is None:
        given: dict[str, Any] = {}
    elif dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        given = dataclasses.asdict(settings)
    elif isinstance(settings, Mapping):
        given = dict(settings)
    else:
        raise TypeError(f"allocator settings must be a mapping or a dataclass, got {type(settings).__name__}")
    given.update(fields)
    block = {k: _setting(k, given.get(k)) for k in ALLOCATOR_KEYS}
    block.update({str(k): json_safe(v) for k, v in given.items() if k not in ALLOCATOR_KEYS})
    return block


def deployed_block(settings: Any, /, *, alloc_scope: str | None, ratio_source: str | None,
                   **extra: Any) -> dict[str, Any]:
    """The ``allocator`` block of a producer that allocates with ``settings``.

    ``settings``: an :class:`~icsd_audit.alloc.settings.AllocatorSettings` (or a mapping of some of its keys, the
    others then being its defaults), so the block says exactly what was deployed.
    ``alloc_scope`` / ``ratio_source`` say where the producer allocates and where
    its ratio comes from (:data:`ALLOC_SCOPES`, :data:`RATIO_SOURCES` or a sentence);
    ``extra`` are free keys (``lambda``, ...).  Imports torch (through the allocator).
    """
    from icsd_audit.alloc.settings import AllocatorSettings

    if not isinstance(settings, AllocatorSettings):
        if not isinstance(settings, Mapping):
            raise TypeError(f"allocator settings must be AllocatorSettings or a mapping, got {type(settings).__name__}")
        unknown = sorted(set(settings) - set(COEFFICIENT_KEYS))
        if unknown:
            raise ValueError(f"unknown allocator setting(s) {', '.join(map(repr, unknown))}")
        settings = AllocatorSettings.from_mapping(settings)
    values = {k: getattr(settings, k) for k in COEFFICIENT_KEYS}
    return allocator_block(values, alloc_scope=alloc_scope, ratio_source=ratio_source, **extra)


def producer_block(producer: Mapping[str, Any] | str | None = None, /, *, rank: int | None = None,
                   world_size: int | None = None, **fields: Any) -> dict[str, Any]:
    """The SPEC 9 ``producer`` block: :data:`PRODUCER_KEYS` (``None`` where unknown) plus free keys.

    ``producer``: a name or a mapping (``name``, ``engine``, ... and free keys such as
    ``env``, ``model``, ``seed``); ``engine`` defaults to ``user``; ``icsd_version`` is
    this package's unless given.  ``rank`` / ``world_size`` fill the keys the mapping
    leaves unset.  Non-finite numbers in free keys become ``None``.
    """
    from icsd_audit.version import __version__

    given = {"name": producer} if isinstance(producer, str) else dict(producer or {})
    given.update(fields)
    given.setdefault("engine", "user")
    given.setdefault("icsd_version", __version__)
    if given.get("rank") is None:
        given["rank"] = rank
    if given.get("world_size") is None:
        given["world_size"] = world_size
    if given["engine"] not in ENGINES:
        raise ValueError(f"producer engine {given['engine']!r}: choose one of {', '.join(ENGINES)}")
    for key in ("rank", "world_size"):
        v = given[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0):
            raise ValueError(f"producer {key} must be a non-negative integer or None, got {v!r}")
    block = {k: json_safe(given.get(k)) for k in PRODUCER_KEYS}
    block.update({str(k): json_safe(v) for k, v in given.items() if k not in PRODUCER_KEYS})
    return block


# ---------------------------------------------------------------------------------------- reading back


def records_settings(meta: Mapping[str, Any] | None) -> bool:
    """Whether an ``icsd.dump`` blob records the deployed allocator (a non-null ``allocator.allocator``)."""
    block = (meta or {}).get("allocator")
    return isinstance(block, Mapping) and isinstance(block.get("allocator"), str)


def relevant_keys(settings: Mapping[str, Any]) -> tuple[str, ...]:
    """The :data:`COEFFICIENT_KEYS` that change the coefficients of these settings.

    ``trust_beta`` only matters for sigmoid trust and ``trust_eta`` for Laplace trust
    (``opsd`` forces uniform trust: neither), ``influence_eta`` only where a calibrated
    score enters (not ``sdar``, ``opsd``, ``sign``) and ``seed`` only for ``permuted``.
    """
    name, trust = settings.get("allocator"), settings.get("trust")
    keys = ["allocator", "eps", "min_group"]
    if name != "opsd":
        keys.append("trust")
        if trust == "sigmoid":
            keys.append("trust_beta")
        elif trust == "laplace":
            keys.append("trust_eta")
    if name not in ("sdar", "opsd", "sign"):
        keys.append("influence_eta")
    if name == "permuted":
        keys.append("seed")
    return tuple(k for k in COEFFICIENT_KEYS if k in keys)


@dataclass(frozen=True)
class RecordedSettings:
    """The deployed allocator settings shared by a set of dump files.

    ``values`` holds :data:`COEFFICIENT_KEYS` as recorded (``None`` where the producer
    did not know); ``block`` the first file's whole ``allocator`` block; ``files`` the
    files that record it.
    """

    values: Mapping[str, Any]
    block: Mapping[str, Any]
    files: tuple[Path, ...]
    #: files audited with these settings that record none themselves (older or foreign dumps)
    unrecorded: tuple[Path, ...] = ()

    @property
    def source(self) -> Path:
        return self.files[0]

    def label(self) -> str:
        """A short text of the relevant settings, e.g. ``icsd trust=sigmoid trust_beta=5``."""
        parts = [str(self.values.get("allocator"))]
        parts += [f"{k}={self.values[k]:g}" if isinstance(self.values[k], float) else f"{k}={self.values[k]}"
                  for k in relevant_keys(self.values) if k != "allocator"]
        return " ".join(parts)


class SettingsMismatch(ValueError):
    """Dump files deployed with different settings in one audit (one line naming two files and the field)."""

    def __init__(self, first: Path, second: Path, field: str, a: Any, b: Any):
        super().__init__(f"{second}: allocator setting {field!r} is {b!r}, but {first} records {a!r}; files "
                         "deployed with different settings are not pooled (audit them separately, or group "
                         "them with --by settings where the command offers it)")
        self.files, self.field = (first, second), field


def recorded_values(path: Path | str, block: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`COEFFICIENT_KEYS` of a recorded ``allocator`` block, checked as a producer's are.

    A value of the wrong type or not finite (a foreign writer's) is a ``ValueError``
    naming the file.
    """
    try:
        return {k: _setting(k, block.get(k)) for k in COEFFICIENT_KEYS}
    except ValueError as exc:
        raise ValueError(f"{path}: recorded {exc}") from None


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any], ignore: Sequence[str]) -> str | None:
    keys = dict.fromkeys([*relevant_keys(a), *relevant_keys(b)])
    return next((k for k in keys if k not in ignore and a.get(k) != b.get(k)), None)


def settings_groups(paths: Sequence[Path], metas: Sequence[Mapping[str, Any] | None], *,
                    ignore: Sequence[str] = ()) -> list[tuple[RecordedSettings | None, list[Path]]]:
    """Files grouped by their deployed settings (``None``: files that record none), in first-seen order.

    Two files are in one group when no relevant :data:`COEFFICIENT_KEYS` differs
    between them, leaving out the keys in ``ignore`` (settings an audit overrides).
    """
    groups: list[tuple[RecordedSettings | None, list[Path]]] = []
    for path, meta in zip(paths, metas):
        if not records_settings(meta):
            hit = next((g for g in groups if g[0] is None), None)
            if hit is None:
                groups.append((None, [path]))
            else:
                hit[1].append(path)
            continue
        vals = recorded_values(path, meta["allocator"])  # type: ignore[index]
        for i, (rec, files) in enumerate(groups):
            if rec is not None and _first_difference(rec.values, vals, ignore) is None:
                files.append(path)
                break
        else:
            groups.append((RecordedSettings(vals, dict(meta["allocator"]), (path,)), [path]))  # type: ignore[index]
    return [(None if rec is None else dataclasses.replace(rec, files=tuple(files)), files) for rec, files in groups]


def recorded_settings(paths: Sequence[Path], metas: Sequence[Mapping[str, Any] | None], *,
                      ignore: Sequence[str] = ()) -> RecordedSettings | None:
    """The one set of deployed settings of these files, or ``None`` when none records any.

    Raises :class:`SettingsMismatch` (one line naming two files and the field) when
    files differ in a relevant setting not in ``ignore``.  Files that record no settings
    at all take those the others record (listed in ``unrecorded``, for the caller to
    say so): unknown is no disagreement.
    """
    groups = settings_groups(paths, metas, ignore=ignore)
    recorded = [(rec, files) for rec, files in groups if rec is not None]
    unrecorded = next((tuple(files) for rec, files in groups if rec is None), ())
    if not recorded:
        return None
    if len(recorded) > 1:
        (first, files_a), (second, files_b) = recorded[0], recorded[1]
        field = _first_difference(first.values, second.values, ignore) or "allocator"  # type: ignore[union-attr]
        raise SettingsMismatch(files_a[0], files_b[0], field, first.values.get(field),  # type: ignore[union-attr]
                               second.values.get(field))  # type: ignore[union-attr]
    return dataclasses.replace(recorded[0][0], unrecorded=unrecorded)  # type: ignore[arg-type]

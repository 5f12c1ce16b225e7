"""The audit's allocator settings: what the dumps say was deployed, unless the caller overrides it.

Every audit (``icsd audit coeffs|tcm|quadrants|shift|clip|landscape|gradcos|report``
and the library functions behind them) recomputes the deployed side with the
settings recorded in the shards' ``allocator`` block (SPEC 9), and gives the SDAR
baseline the same trust.  A setting the caller gives explicitly replaces the recorded
one, and :attr:`AuditSettings.overrides` holds one line naming what it replaced.
Files deployed with different settings are refused
(:class:`~icsd_audit.dumps.provenance.SettingsMismatch`) unless the differing settings
are overridden, or audited group by group (:func:`settings_groups`).  Dumps that record
no settings (older files, foreign writers) are audited with SPEC's defaults and one
:class:`~icsd_audit.dumps.reader.DumpWarning`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from icsd_audit.alloc.options import AllocatorOptions
from icsd_audit.dumps.provenance import (COEFFICIENT_KEYS, RecordedSettings, recorded_settings, records_settings,
                                         relevant_keys, settings_groups as _groups)
from icsd_audit.dumps.reader import DumpWarning, read_metadata, resolve_paths

__all__ = ["AuditSettings", "audit_settings", "settings_groups", "deployed_options"]

#: allocators whose deployed side is the base of an audit (no influence score: the natural comparison is ICSD)
_BASE_SIDE = ("sdar", "opsd")


@dataclass(frozen=True)
class AuditSettings:
    """The settings an audit applies: the deployed allocator's options and where they came from.

    ``deployed``: the deployed allocator with every setting (recorded, else SPEC's
    default, then the caller's overrides).  ``recorded``: what the dumps record
    (``None``: nothing).  ``overrides``: one line per recorded setting a caller's value
    replaced.  ``defaulted``: the relevant settings taken from SPEC's defaults because
    the dumps do not record them.
    """

    deployed: AllocatorOptions
    recorded: RecordedSettings | None
    overrides: tuple[str, ...] = ()
    defaulted: tuple[str, ...] = ()

    def pair(self, base: str | None = None, compare: str | None = None) -> tuple[AllocatorOptions, AllocatorOptions]:
        """(base, compare) options: the deployed allocator on its side, SDAR (or ICSD) on the other.

        By default ``compare`` is the deployed allocator and ``base`` SDAR with the
        deployed trust; a deployed ``sdar`` (or ``opsd``) is the base and ICSD the
        compare.  Both sides share every setting; ``base`` / ``compare`` name other
        allocators.
        """
        name = self.deployed.allocator
        if compare is None:
            compare = "icsd" if name in _BASE_SIDE else name
        if base is None:
            base = name if name in _BASE_SIDE else "sdar"
        return replace(self.deployed, allocator=base), replace(self.deployed, allocator=compare)


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)


def _resolve(recorded: RecordedSettings | None, overrides: Mapping[str, Any], members: Sequence[tuple[Path, Mapping]],
             flags: Mapping[str, str] | None = None) -> AuditSettings:
    """Recorded values, SPEC's defaults where none is recorded, then the overrides.

    ``members``: (file, metadata) of the files audited together; each distinct recorded
    value an override replaces gets one line naming the first file that records it.
    """
    values = {f.name: getattr(AllocatorOptions(), f.name) for f in fields(AllocatorOptions)}
    defaulted: list[str] = []
    if recorded is not None:
        for k in COEFFICIENT_KEYS:
            if recorded.values.get(k) is not None:
                values[k] = recorded.values[k]
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise ValueError(f"unknown allocator setting(s) {', '.join(unknown)}; valid: {', '.join(values)}")
    values.update(given)
    opts = AllocatorOptions(**values)
    relevant = relevant_keys(values)
    lines = []
    if recorded is not None:
        defaulted = [k for k in relevant if recorded.values.get(k) is None and k not in given]
        for k, v in given.items():
            seen: list[Any] = []
            for path, meta in members:
                block = meta.get("allocator") if records_settings(meta) else None
                was = None if block is None else block.get(k)
                if was is None or was == v or was in seen or not (k in relevant or k in relevant_keys(block)):
                    continue
                seen.append(was)
                flag = (flags or {}).get(k) or "--" + k.replace("_", "-")
                given_text = v if isinstance(v, str) else _fmt(v)  # as typed on a command line
                lines.append(f"{flag} {given_text} overrides the deployed {k} {_fmt(was)} (recorded in {path})")
    return AuditSettings(deployed=opts, recorded=recorded, overrides=tuple(lines), defaulted=tuple(defaulted))


def _metas(paths: Sequence[str | Path]) -> tuple[list[Path], list[dict]]:
    """The input files and their ``icsd.dump`` blobs, as the reader will read them.

    A folder written by several writer sessions (a resumed run) may hold shards the
    reader skips (batches written again later): those are left out here too, which
    needs the reader's look at the batch ids; one session needs only the footers.
    """
    files = resolve_paths(paths)
    metas = [read_metadata(p) for p in files]
    if len({m.get("session") for m in metas if isinstance(m.get("session"), str)}) > 1:
        from icsd_audit.dumps.reader import DumpReader

        reader = DumpReader(files)
        return list(reader.paths), reader.metadata()
    return files, metas


def _warn(files: Sequence[Path], metas: Sequence[Mapping[str, Any]], s: AuditSettings) -> None:
    """At most one line per situation: no settings recorded, some files without, relevant settings unknown.

    Synthetic dumps deployed nothing, so SPEC's defaults need no warning there; files
    without any ``icsd.dump`` blob are already named by the reader's warning.
    """
    if all(m.get("synthetic") is True for m in metas if m):
        return
    with_blob = [p for p, m in zip(files, metas) if m]
    if s.recorded is None:
        if with_blob:
            more = f" and {len(with_blob) - 1} more file(s)" if len(with_blob) > 1 else ""
            warnings.warn(f"{with_blob[0]}{more}: no deployed allocator settings recorded (older or foreign dumps); "
                          f"audited with the defaults ({_options_text(s.deployed)}) unless flags say otherwise",
                          DumpWarning, stacklevel=3)
        return
    rest = [p for p in s.recorded.unrecorded if p in with_blob]
    if rest:
        more = f" and {len(rest) - 1} more file(s)" if len(rest) > 1 else ""
        warnings.warn(f"{rest[0]}{more}: no deployed allocator settings recorded (older or foreign dumps); audited "
                      f"with those recorded in {s.recorded.source} ({_options_text(s.deployed)})", DumpWarning,
                      stacklevel=3)
    if s.defaulted:
        d = s.deployed
        warnings.warn(f"{s.recorded.source}: the dumps do not record {', '.join(s.defaulted)}; audited with the "
                      f"default{'s' if len(s.defaulted) > 1 else ''} "
                      + ", ".join(f"{k}={_fmt(getattr(d, k))}" for k in s.defaulted), DumpWarning, stacklevel=3)


def _options_text(o: AllocatorOptions) -> str:
    return ", ".join(f"{k}={_fmt(getattr(o, k))}" for k in relevant_keys(o.to_dict()))


def audit_settings(paths: Sequence[str | Path], *, flags: Mapping[str, str] | None = None,
                   **overrides: Any) -> AuditSettings:
    """The settings to audit the dumps at ``paths`` with: recorded, unless overridden.

    ``overrides``: settings the caller fixes (``allocator``, ``trust``, ``trust_beta``,
    ``trust_eta``, ``influence_eta``, ``eps``, ``min_group``, ``seed``; ``None``: as
    recorded).  Raises :class:`~icsd_audit.dumps.provenance.SettingsMismatch` when files
    differ in a setting that changes coefficients and is not overridden.  ``flags``
    names the option that set a key where it is not ``--key`` (the override lines say
    it: ``{"allocator": "--compare"}``).  Warns
    (:class:`~icsd_audit.dumps.reader.DumpWarning`) when the dumps record no settings
    or leave a relevant one unknown.

    >>> s = audit_settings(["runs/cpu-demo/dumps"])              # doctest: +SKIP
    >>> base, compare = s.pair()                                 # SDAR vs what was deployed
    """
    files, metas = _metas(paths)
    given = [k for k, v in overrides.items() if v is not None]
    s = _resolve(recorded_settings(files, metas, ignore=given), overrides, list(zip(files, metas)), flags)
    _warn(files, metas, s)
    return s


def settings_groups(paths: Sequence[str | Path], *, flags: Mapping[str, str] | None = None,
                    **overrides: Any) -> list[tuple[AuditSettings, list[Path]]]:
    """The files of ``paths`` grouped by deployed settings (after ``overrides``), each with its settings.

    For ``--by settings``: every group is audited with its own deployed settings.
    """
    files, metas = _metas(paths)
    given = [k for k, v in overrides.items() if v is not None]
    out = []
    for rec, group in _groups(files, metas, ignore=given):
        members = [(f, m) for f, m in zip(files, metas) if f in group]
        s = _resolve(rec, overrides, members, flags)
        _warn(group, [m for _, m in members], s)
        out.append((s, group))
    return out


def deployed_options(paths: Sequence[str | Path], **overrides: Any) -> AllocatorOptions:
    """The deployed allocator's options (:attr:`AuditSettings.deployed` of :func:`audit_settings`)."""
    return audit_settings(paths, **overrides).deployed

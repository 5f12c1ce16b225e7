"""Shared CLI plumbing: one-line errors with exit code 2, a stderr console.

Nothing here imports torch: ``icsd --help`` must start instantly.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

EXIT_BAD_INPUT = 2


def fail(message: str) -> "typer.Exit":
    """Print ``error: message`` on one stderr line and return the exit to raise."""
    first = " ".join(str(message).split())
    print(f"error: {first}", file=sys.stderr)
    return typer.Exit(EXIT_BAD_INPUT)


def os_error_line(exc: OSError) -> str:
    """``FILE: reason`` for an I/O or permission failure (pyarrow's text cut to its first line)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    name = exc.filename if getattr(exc, "filename", None) else None
    if name is not None and exc.strerror:
        other = f" -> {exc.filename2}" if getattr(exc, "filename2", None) else ""
        return f"{name}{other}: {exc.strerror}"
    return first


def handle_errors(fn: F) -> F:
    """Turn bad-input, I/O and permission exceptions into one stderr line and exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, KeyError) as exc:
            raise fail(str(exc) if not isinstance(exc, KeyError) or not exc.args else str(exc.args[0])) from None
        except OSError as exc:  # includes pyarrow's ArrowIOError, FileNotFoundError, PermissionError
            raise fail(os_error_line(exc)) from None

    return wrapper  # type: ignore[return-value]


def audit_settings(paths: Any, *, flags: Any = None, **values: Any) -> Any:
    """The audit's allocator settings: as the dumps record them (SPEC 9), each flag given replacing its value.

    One ``note:`` line on stderr per recorded setting a flag replaces; files deployed with
    different settings are refused (one line naming two files and the field).
    """
    from icsd_audit.audit.settings import audit_settings as resolve

    s = resolve(paths, flags=flags, **values)
    for line in s.overrides:
        print(f"note: {line}", file=sys.stderr)
    return s


def check_output_file(out: Any, paths: Any) -> None:
    """Refuse, before any work, an output file that is an input or cannot be written."""
    from icsd_audit.dumps.reader import resolve_paths
    from icsd_audit.outputs import check_output_file as check

    check(out, _local_files(resolve_paths(paths)) if paths else [])


def check_output_dir(out: Any, paths: Any, owned: Callable[[str], bool]) -> None:
    """Refuse, before any work, an output directory that is or holds an input or cannot be written."""
    from icsd_audit.dumps.reader import resolve_paths
    from icsd_audit.outputs import check_output_dir as check

    check(out, _local_files(resolve_paths(paths)) if paths else [], owned=owned)


def _local_files(files: Any) -> list:
    """The inputs on this machine's file system (objects of a store are never an output's local path)."""
    from pathlib import Path

    return [f for f in files if isinstance(f, Path)]


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def check_backend(backend: str, ray_address: Any) -> None:
    """``--backend`` is local or ray, and ``--ray-address`` comes with ray only: one line before any work."""
    if backend not in ("local", "ray"):
        raise ValueError(f"--backend must be one of local, ray, got {backend!r}")
    if ray_address is not None and backend != "ray":
        raise ValueError("--ray-address needs --backend ray")


def thread_count() -> int:
    """Audit workers (:func:`~icsd_audit.audit.threads.audit_workers`): ``ICSD_THREADS``, else the cores, at most 8."""
    from icsd_audit.audit.threads import audit_workers

    return audit_workers()


def set_threads() -> None:
    """Check ``ICSD_THREADS`` before any work (one line when bad); the library's audit entry points run their
    maths on one torch intra-op thread themselves (:mod:`icsd_audit.audit.threads`)."""
    thread_count()


def without_options(command: F, **fixed: Any) -> F:
    """``command`` with the parameters named in ``fixed`` off its command line and help, called with those values.

    Several commands share one body (``icsd audit tcm | quadrants | shift | clip``); an
    option that only one of them reads (``--clip-eps``) must not appear in the others'
    help pages, where it would do nothing.
    """
    import inspect

    sig = inspect.signature(command)
    unknown = set(fixed) - set(sig.parameters)
    if unknown:
        raise TypeError(f"{command.__name__} has no parameter {', '.join(sorted(unknown))}")

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return command(*args, **kwargs, **fixed)

    wrapper.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in sig.parameters.items() if name not in fixed])
    return wrapper  # type: ignore[return-value]

"""The ``icsd`` command: a thin typer layer over the library.

Each command module registers its commands on the apps of :mod:`.apps` and imports
the library (and torch) only inside its functions, so ``icsd --help`` stays instant.
Importing the command modules here, in the order the help lists them, is what
registers them.  :func:`main` runs the app so that usage
errors (a missing argument, a bad option value) are one ``error:`` line with exit
code 2 like every other error, not a framework box, and warnings (a dump without
provenance metadata, inputs that disagree) are one ``warning:`` line each, printed
once the command has succeeded: a failing command prints its one error line only.
:func:`entry` (the console script and ``python -m icsd_audit.cli``) runs :func:`main`
in a process of its own and then exits without the interpreter's teardown.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
from typing import NoReturn, Sequence

from . import audit_coeffs, audit_verify, synth, audit_stats, audit_strata, audit_signs, audit_gradcos, audit_report, train, sft, compare  # noqa: F401,I001  (registration order = help order)
from . import version  # noqa: F401,I001  (icsd --version, icsd version: after the commands in help order)
from .apps import app, audit_app
from .help_format import reflow

for _typer in (app, audit_app):  # one line per paragraph: no mid-sentence breaks in the command lists
    for _info in _typer.registered_commands:
        if _info.callback is not None:
            _info.callback.__doc__ = reflow(_info.callback.__doc__)

__all__ = ["app", "audit_app", "main", "entry"]


def _click_class(name: str) -> type:
    """The click exception class ``name`` that typer uses (its vendored copy in typer >= 0.20, else click's)."""
    import typer

    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


def _one_line_warnings() -> list[str]:
    """Collect warnings as one-line messages, each distinct message once.

    They are printed (``warning: ...``) when the command succeeds; a failing command
    prints its one error line only.
    """
    import warnings

    seen: list[str] = []

    def keep(message: Warning | str, category: type[Warning], filename: str, lineno: int, file=None, line=None) -> None:
        text = " ".join(str(message).split())
        if text not in seen:
            seen.append(text)

    warnings.showwarning = keep  # type: ignore[assignment]
    warnings.simplefilter("once", UserWarning)
    return seen


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``icsd``; every click usage error becomes one stderr line."""
    import typer

    from .common import os_error_line

    click_exception, usage_error = _click_class("ClickException"), _click_class("UsageError")
    warned = _one_line_warnings()
    try:
        rv = app(args=None if argv is None else list(argv), standalone_mode=False)
    except click_exception as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # typer has printed the help already
            msg = exc.format_message()
            if msg.strip():
                print(msg, file=sys.stderr)
            sys.exit(exc.exit_code)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if isinstance(exc, usage_error) and ctx is not None else ""
        print(f"error: {' '.join(exc.format_message().split())}{hint}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # stdout closed by the reader (| head): nothing more to say
            sys.stderr.close()
            sys.exit(1)
        print(f"error: {os_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    code = rv if isinstance(rv, int) else 0
    if code == 0:
        for text in warned:
            print(f"warning: {text}", file=sys.stderr)
    sys.exit(code)


def entry() -> NoReturn:
    """The console script: :func:`main`, then exit without the interpreter's teardown.

    Tearing down an interpreter that has imported torch (freeing every module and its
    objects) took 0.25-0.45 s on the 2-core dev box, as long as a whole audit's
    allocation; a command that is done has nothing left to free.  So once the
    command has returned or exited, stdout and stderr are flushed, the ``atexit``
    handlers run (logging's flush among them), and the process ends with
    ``os._exit``.  Only when no other thread is alive: a thread still running (an
    unfinished writer) gets the normal exit, which waits for it.  A traceback
    (a bug) also takes the normal path.
    """
    try:
        main()
        code: int | str | None = 0
    except SystemExit as exc:
        code = exc.code
    if threading.active_count() > 1:
        sys.exit(code)
    if isinstance(code, str):  # sys.exit("message"): printed, exit status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    status = 0 if code is None else int(code)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # the reader closed stdout (| head), or it was closed: nothing more to say
        status = status or 1
    with contextlib.suppress(OSError, ValueError):  # nowhere left to report a failure to write stderr
        sys.stderr.flush()
    import atexit

    atexit._run_exitfuncs()
    os._exit(status)

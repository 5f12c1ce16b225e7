"""Helpers shared by the test modules: the CLI in this process, without root's powers, and its one-line errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: float = 300, threads: int = 1) -> subprocess.CompletedProcess[str]:
    """``icsd ARGS`` in this process (the console script's entry point; no second torch import)."""
    import contextlib
    import io

    from icsd_audit.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("ICSD_THREADS")
    os.environ["ICSD_THREADS"] = str(threads)
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
    except SystemExit as exc:
        code = exc.code
    finally:
        if old is None:
            os.environ.pop("ICSD_THREADS", None)
        else:
            os.environ["ICSD_THREADS"] = old
    return subprocess.CompletedProcess(list(args), code if isinstance(code, int) else 1, out.getvalue(), err.getvalue())


def unprivileged(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``icsd ARGS`` without the power to override file permissions (root drops CAP_DAC_*)."""
    cmd = [sys.executable, "-m", "icsd_audit.cli", *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot drop CAP_DAC_OVERRIDE to test permissions")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "ICSD_THREADS": "1"})


def one_line_exit_2(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and "╭" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

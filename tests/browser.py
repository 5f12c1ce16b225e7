"""A headless Chromium page check over the DevTools protocol on a pipe (no selenium, no websocket client).

Why a pipe: ``chromium --remote-debugging-pipe`` reads protocol commands from fd 3 and
writes replies and events to fd 4, each a JSON object ended by a NUL byte, so the
standard library is enough.  Why the protocol and not a script in the page: the
toolkit's pages carry a Content-Security-Policy that forbids every script, and an
expression evaluated through ``Runtime.evaluate`` runs beside the page's policy
without weakening it, so the page is checked exactly as written.

:func:`check_page` loads a file at each window width (``Emulation.setDeviceMetricsOverride``)
and returns what a reader would see: every image's natural width, the console errors
(``console.error``, uncaught exceptions, and the browser's own error log entries such as a
CSP violation or a failed load) and the page's scroll width against the window's.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["chromium_binary", "check_page", "PageCheck"]

# what the page shows, read after the load event (images decoded, layout done)
_PROBE = """(() => {
  const scrolls = el => ['auto', 'scroll', 'hidden', 'clip'].includes(getComputedStyle(el).overflowX);
  // how far right an element reaches: its box, or its content where that spills out of a box that does not scroll
  const reach = el => {
    const r = el.getBoundingClientRect();
    return scrolls(el) ? r.right : Math.max(r.right, r.left + el.scrollWidth);
  };
  const inScroller = el => { for (let p = el.parentElement; p; p = p.parentElement) if (scrolls(p)) return true;
                             return false; };
  return JSON.stringify({
    images: Array.from(document.images).map((im, i) => ({
      index: i, alt: im.alt, complete: im.complete, naturalWidth: im.naturalWidth,
      right: Math.ceil(im.getBoundingClientRect().right)})),
    scrollWidth: document.documentElement.scrollWidth,
    innerWidth: window.innerWidth,
    wide: Array.from(document.body.querySelectorAll('*'))
      .filter(el => reach(el) > window.innerWidth + 0.5 && !inScroller(el))
      .slice(0, 8).map(el => el.tagName.toLowerCase() + (el.className ? '.' + el.className : '')
                       + ' reaches ' + Math.ceil(reach(el)) + ' px')
  });
})()"""


def chromium_binary() -> str | None:
    """Debian's ``chromium`` (or ``chromium-browser``) on PATH, else None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass(frozen=True)
class PageCheck:
    """One page at one window width."""

    width: int
    images: list[dict[str, Any]]
    scroll_width: int
    inner_width: int
    wide: list[str]
    errors: list[str] = field(default_factory=list)


class _Pipe:
    """The browser end of ``--remote-debugging-pipe``: send a command, wait for its reply, keep the events."""

    def __init__(self, binary: str, profile: Path):
        to_child_r, self._w = os.pipe()
        self._r, from_child_w = os.pipe()

        def fds() -> None:  # the protocol's fixed descriptors in the child: 3 = commands in, 4 = replies out
            # copies above 9 first: a pipe end may itself be 3 or 4, and dup2 onto itself keeps close-on-exec
            a, b = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}", "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=fds, close_fds=False)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("chromium did not answer within the time limit")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the debugging pipe (exit status {self.proc.poll()})")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, session: str | None = None, timeout: float = 60.0, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            got = self._read(deadline)
            if got.get("id") == self._id:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self.events.append(got)

    def wait_event(self, method: str, session: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        seen = len(self.events)
        while True:
            for ev in self.events[seen:]:
                if ev.get("method") == method and ev.get("sessionId") == session:
                    return
            seen = len(self.events)
            self.events.append(self._read(deadline))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


def _errors(events: list[dict[str, Any]], session: str) -> list[str]:
    out = []
    for ev in events:
        if ev.get("sessionId") != session:
            continue
        p = ev.get("params", {})
        if ev.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description", "")))
                                                              for a in p.get("args", [])))
        elif ev.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + str(d.get("exception", {}).get("description", d.get("text", ""))))
        elif ev.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            e = p["entry"]
            out.append(f"log ({e.get('source')}): {e.get('text')} {e.get('url', '')}".rstrip())
    return out


def check_page(page: Path, widths: tuple[int, ...] = (1280, 390), *, height: int = 900,
               binary: str | None = None) -> list[PageCheck]:
    """Load ``page`` in headless Chromium once per window width and read what it shows (see module doc)."""
    binary = binary or chromium_binary()
    if binary is None:
        raise FileNotFoundError("no chromium binary on PATH")
    url = Path(page).resolve().as_uri()
    out = []
    with tempfile.TemporaryDirectory(prefix="icsd-chromium-") as profile:
        pipe = _Pipe(binary, Path(profile))
        try:
            for width in widths:
                target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
                session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
                for domain in ("Page", "Runtime", "Log"):
                    pipe.call(f"{domain}.enable", session)
                pipe.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height,
                          deviceScaleFactor=1, mobile=False)
                start = len(pipe.events)
                pipe.call("Page.navigate", session, url=url)
                pipe.wait_event("Page.loadEventFired", session)
                got = pipe.call("Runtime.evaluate", session, expression=_PROBE, returnByValue=True)
                pipe.call("Runtime.evaluate", session, expression="0", returnByValue=True)  # flush pending log events
                if "exceptionDetails" in got:
                    raise RuntimeError(f"the probe failed on {page}: {got['exceptionDetails']}")
                seen = json.loads(got["result"]["value"])
                out.append(PageCheck(width=width, images=seen["images"], scroll_width=int(seen["scrollWidth"]),
                                     inner_width=int(seen["innerWidth"]), wide=seen["wide"],
                                     errors=_errors(pipe.events[start:], session)))
                pipe.call("Target.closeTarget", targetId=target)
        finally:
            pipe.close()
    return out

"""Dumps on object storage: fsspec URLs (``s3://``, ``gs://``, ``hf://``, ``memory://``) beside local paths.

An input or output given as ``SCHEME://...`` goes through fsspec (``s3fs``, ``gcsfs``,
``huggingface_hub``: the ``cloud`` extra); ``file://`` and plain paths stay local paths
with every guarantee of the local code (links, permissions, renames). Credentials and
endpoints come only from the store's own environment and configuration (for S3: the
botocore chain, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` ...); nothing here takes or logs one.

**Commit markers.** An object store has no rename, so a step cannot appear at once by
renaming its folder. A :class:`~icsd_audit.dumps.writer.DumpWriter` writing to a URL puts
each shard of a step straight into the step folder under a name that carries its
writer's session (``part-000003-s<16 hex>-r00001.parquet``: no two writers share a name)
and, last, the step's *commit marker* ``_icsd-commit-s<session>.json`` listing those
shards. The reader takes a session-named shard only when its folder holds its session's
marker listing it (:func:`committed`), on any store and on local disk alike (a bucket
copied to a disk reads the same), and skips the others with one warning: a writer that
dies mid-step leaves shards no reader takes.

**Never replacing.** Each object is created by one PUT of its complete bytes (visible
whole or not at all), after a check that the name is free; on S3 the PUT is also
conditional (``If-None-Match: *``), so the store itself refuses a taken name. On stores
without such a PUT the check and the PUT are two calls, but every shard name carries
its writer's random id (``-s<id>-``: a step shard; ``-w<id>-``: a lone shard), so the
only writer that could race for a name is the one that chose it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = ["is_url", "local_path", "StoreFile", "store_of", "find_objects", "store_object", "list_files", "committed",
           "marker_name", "shard_session", "put_new", "StoreError", "Listing", "CLOUD_HINT"]

_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+)://(?P<rest>.*)", re.S)
#: a shard written into a step folder of an object store: its writer's session in the name
_SESSION_SHARD = re.compile(r".+-s(?P<session>[0-9a-f]{16})-(?:r\d{5}|p\d+)\.parquet")
_MARKER = re.compile(r"_icsd-commit-s(?P<session>[0-9a-f]{16})\.json")
CLOUD_HINT = "install the cloud extra: pip install 'icsd-audit[cloud]'"


class StoreError(OSError):
    """An object store that cannot be reached or listed: a one-line message naming the URL."""

    def __init__(self, url: str, message: str):
        super().__init__(f"{url}: {message}")
        self.url, self.reason = url, message


def is_url(x: str | Path) -> bool:
    """Whether ``x`` names a location by URL (``scheme://``); a ``Path`` never does."""
    return isinstance(x, str) and _URL.fullmatch(x) is not None


def local_path(x: str | Path) -> Path | None:
    """The local path of ``x`` (a path, or a ``file://`` URL); None for any other URL."""
    if isinstance(x, Path):
        return x
    m = _URL.fullmatch(x)
    if m is None:
        return Path(x)
    if m.group("scheme").lower() == "file":
        return Path(m.group("rest") or "/")
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def store_of(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, its path) of ``url``; a missing driver or bad URL is a :class:`StoreError`."""
    try:
        import fsspec
    except ImportError:
        raise StoreError(url, f"reading or writing a URL needs fsspec; {CLOUD_HINT}") from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise StoreError(url, f"no driver for {url.split(':', 1)[0]}:// ({_first_line(exc)}); {CLOUD_HINT}") from None
    except (ValueError, TypeError, OSError) as exc:
        raise StoreError(url, f"not a usable URL ({_first_line(exc)})") from None
    return fs, path.rstrip("/") or path


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


@dataclass(frozen=True, order=True)
class StoreFile:
    """One object of a store, named by its URL (what messages, JSON and sorting use)."""

    url: str
    fs: Any = field(compare=False, hash=False, repr=False)
    path: str = field(compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> str:
        """The URL of the folder holding it (a key, not a location to open)."""
        return self.url.rstrip("/").rsplit("/", 1)[0]

    def open(self, mode: str = "rb") -> Any:
        """A seekable binary file object (for pyarrow, or read line by line)."""
        if mode != "rb":
            raise ValueError(f"{self.url}: a store object is opened for reading only ('rb'), not {mode!r}")
        try:
            return self.fs.open(self.path, "rb")
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StoreError(self.url, f"cannot read this object ({_first_line(exc)})") from None

    def is_file(self) -> bool:
        """Whether the object exists (what ``Path.is_file`` says of a local file)."""
        try:
            return bool(self.fs.isfile(self.path))
        except (OSError, ValueError) as exc:
            raise StoreError(self.url, f"cannot look this object up ({_first_line(exc)})") from None


def store_object(url: str) -> StoreFile:
    """The object named by ``url`` (which need not exist yet)."""
    fs, path = store_of(url)
    return StoreFile(url.rstrip("/"), fs, path)


def _url_of(scheme_url: str, root_path: str, path: str) -> str:
    """The URL of ``path`` (a path of the store of ``scheme_url``, which names ``root_path``)."""
    rel = path[len(root_path):].lstrip("/") if path.startswith(root_path) else None
    if rel is None:  # pragma: no cover - fsspec lists below the root it was given
        raise StoreError(scheme_url, f"listed {path}, which is not below {root_path}")
    return _join(scheme_url, rel) if rel else scheme_url


@dataclass(frozen=True)
class Listing:
    """What :func:`list_files` found: the files to read, staged step folders and uncommitted shards (URLs)."""

    files: list[StoreFile]
    staged: list[str]
    uncommitted: list[str]


def find_objects(url: str) -> tuple[Any, str, bool, list[str]]:
    """(filesystem, its path of ``url``, whether ``url`` is one object, every object path at or below it).

    A URL that names nothing is a :class:`StoreError` (``no such file or directory``), and so
    is a store that cannot be listed.
    """
    fs, root = store_of(url)
    try:
        if fs.isfile(root):
            return fs, root, True, [root]
        listing = fs.find(root, withdirs=False, detail=False)
    except (OSError, ValueError) as exc:  # s3fs turns botocore's errors into OSError subclasses
        raise StoreError(url, f"cannot list this location ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - a driver's own errors (e.g. botocore NoCredentialsError): one line
        raise StoreError(url, f"cannot list this location ({type(exc).__name__}: {_first_line(exc)})") from None
    if not listing:
        raise StoreError(url, "no such file or directory")
    return fs, root, False, sorted(listing)


def list_files(url: str, *, scratch: re.Pattern, staged: re.Pattern) -> Listing:
    """Every committed ``*.parquet`` object at or below ``url``, in sorted order.

    Objects below a hidden scratch folder of an icsd writer are skipped (staged steps
    are reported), session-named shards without their commit marker too
    (:func:`committed`; reported). A URL that names nothing is a :class:`StoreError`.
    """
    fs, root, single, listing = find_objects(url)
    base = url.rstrip("/")
    if single:
        return Listing([StoreFile(base, fs, root)], [], [])
    folders: dict[str, list[str]] = {}
    staged_seen: list[str] = []
    for p in listing:
        rel = p[len(root):].lstrip("/") if p.startswith(root) else p
        parts = rel.split("/")
        hidden = [x for x in parts[:-1] if scratch.fullmatch(x)]
        if hidden:
            if staged.fullmatch(hidden[0]) and hidden[0] not in staged_seen:
                staged_seen.append(hidden[0])
            continue
        folders.setdefault(p.rsplit("/", 1)[0] if "/" in p else "", []).append(p.rsplit("/", 1)[-1])
    out: list[StoreFile] = []
    skipped: list[str] = []
    for folder, names in folders.items():
        keep, left = committed(names, lambda m, folder=folder: _read_marker(fs, f"{folder}/{m}", url))
        out.extend(StoreFile(_url_of(base, root, f"{folder}/{n}"), fs, f"{folder}/{n}") for n in keep
                   if n.endswith(".parquet"))
        skipped.extend(_url_of(base, root, f"{folder}/{n}") for n in left)
    return Listing(sorted(out), [_join(base, x) for x in staged_seen], skipped)


def _read_marker(fs: Any, path: str, url: str) -> list[str]:
    try:
        blob = json.loads(fs.cat_file(path))
        shards = blob["shards"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(url, f"commit marker {path} is not valid ({_first_line(exc)})") from None
    except OSError as exc:
        raise StoreError(url, f"cannot read commit marker {path} ({_first_line(exc)})") from None
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise StoreError(url, f"commit marker {path} is not valid (its 'shards' is not a list of names)")
    return shards


def shard_session(name: str) -> str | None:
    """The writer session in a step shard's name (None for every other name)."""
    m = _SESSION_SHARD.fullmatch(name)
    return m.group("session") if m else None


def marker_name(session: str) -> str:
    return f"_icsd-commit-s{session}.json"


def committed(names: Iterable[str], read_marker: Any) -> tuple[list[str], list[str]]:
    """Split one folder's object names into (taken, uncommitted shards).

    A session-named shard is taken only when its session's marker (``read_marker(name)``
    gives the shard names it lists) is in the folder and lists it; every other name is
    taken as is (markers themselves are not shards and are dropped).
    """
    names = list(names)
    markers = {m.group("session"): n for n in names if (m := _MARKER.fullmatch(n))}
    listed: dict[str, set[str]] = {}
    keep, left = [], []
    for n in names:
        if n in markers.values():
            continue
        session = shard_session(n)
        if session is None:
            keep.append(n)
            continue
        if session in markers and session not in listed:
            listed[session] = set(read_marker(markers[session]))
        (keep if n in listed.get(session, ()) else left).append(n)
    return keep, left


def _protocol(fs: Any) -> str:
    p = fs.protocol
    return p if isinstance(p, str) else p[0]


def put_new(fs: Any, path: str, data: bytes, url: str) -> None:
    """Create the object ``path`` holding ``data`` in one PUT unless the name is taken (FileExistsError)."""
    import errno

    try:
        if fs.exists(path):
            raise FileExistsError(errno.EEXIST, "object exists; a dump writer never replaces an object", url)
        if _protocol(fs) == "s3":  # S3's conditional PUT (If-None-Match: *) refuses a taken name at the store
            fs.pipe_file(path, data, mode="create")
        else:
            fs.pipe_file(path, data)
    except FileExistsError:
        raise
    except OSError as exc:
        raise StoreError(url, f"cannot write this object ({_first_line(exc)})") from None

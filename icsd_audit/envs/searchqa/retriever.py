"""Retrieval for Search-QA: local BM25 (``bm25s``) or a Search-R1 retrieval server.

Both return, per query, the top-``k`` documents as Search-R1's server does:
``{"id": ..., "contents": ...}`` dicts, best first. :func:`format_passages` renders them
the way Search-R1's rollout does (``Doc 1(Title: <first line>) <rest>``, one per line).

* :class:`BM25Retriever` tokenises (lower-case ``\\w+`` runs, bm25s's English stop words,
  no stemming) and scores with bm25s's Lucene BM25, k1 = 0.9 and b = 0.4 (Pyserini's
  defaults, which Search-R1's BM25 server uses). Ties go to the lower passage index.
  Over a user corpus the index is built once, with a progress bar, and cached under
  ``$ICSD_CACHE/searchqa/bm25/<key>`` (key: corpus path, size, mtime and these
  settings); passages are read back from the JSONL by byte offset, so memory holds the
  index, not the texts.
* :class:`ServerRetriever` posts ``{"queries": [...], "topk": k, "return_scores": true}``
  to ``<url>/retrieve`` (``urllib`` only) and reads ``{"result": [[{"document": {...},
  "score": s}, ...], ...]}`` (or the score-less list-of-documents form).

Results are memoised per query (a group's rollouts repeat queries).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import urllib.error
import urllib.request
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from .data import SearchQADataError, iter_corpus

__all__ = ["Retriever", "BM25Retriever", "ServerRetriever", "format_passages", "tokenize", "K1", "B"]

K1, B = 0.9, 0.4
_TOKEN = re.compile(r"\w+")
_INDEX_VERSION = 1


def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


_STOP: frozenset[str] | None = None


def tokenize(text: str) -> list[str]:
    """Lower-case word tokens without English stop words."""
    global _STOP
    if _STOP is None:
        _STOP = _stopwords()
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOP]


def format_passages(docs: Sequence[dict[str, Any]]) -> str:
    """Search-R1's ``_passages2string``: ``Doc i(Title: title) text`` lines."""
    out = []
    for i, d in enumerate(docs, 1):
        title, _, text = str(d.get("contents", "")).partition("\n")
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


class Retriever(Protocol):
    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]: ...


class _Memo:
    def __init__(self, size: int = 8192):
        self._d: OrderedDict[tuple[str, int], list[dict[str, Any]]] = OrderedDict()
        self._size = size

    def get(self, key: tuple[str, int]) -> list[dict[str, Any]] | None:
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
        return hit

    def put(self, key: tuple[str, int], value: list[dict[str, Any]]) -> None:
        self._d[key] = value
        if len(self._d) > self._size:
            self._d.popitem(last=False)


class BM25Retriever:
    """BM25 over passages held in memory (``passages``) or a JSONL corpus file (``from_jsonl``)."""

    def __init__(self, bm25: Any, fetch: Any, num_docs: int):
        self._bm25 = bm25
        self._vocab: dict[str, int] = bm25.vocab_dict
        self._fetch = fetch
        self.num_docs = num_docs
        self._memo = _Memo()

    # ---------------------------------------------------------------- construction
    @staticmethod
    def _new_bm25() -> Any:
        try:
            import bm25s
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError("Search-QA's BM25 needs bm25s: pip install 'icsd-audit[train]' (or pip install bm25s)") from exc
        return bm25s.BM25(k1=K1, b=B, method="lucene")

    @staticmethod
    def _ids(texts, vocab: dict[str, int]) -> list[np.ndarray]:
        setdefault = vocab.setdefault
        return [np.fromiter((setdefault(t, len(vocab)) for t in tokenize(tx)), dtype=np.int32) for tx in texts]

    @classmethod
    def from_passages(cls, passages: Sequence[dict[str, str]]) -> "BM25Retriever":
        """Index in-memory Search-R1 records (``id``, ``contents``); no cache."""
        vocab: dict[str, int] = {}
        ids = cls._ids((p["contents"] for p in passages), vocab)
        bm25 = cls._new_bm25()
        bm25.index((ids, vocab), show_progress=False)
        docs = [dict(p) for p in passages]
        return cls(bm25, lambda i: docs[i], len(docs))

    @classmethod
    def from_jsonl(cls, path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True,
                   chunk: int = 20_000) -> "BM25Retriever":
        """Index a Search-R1 JSONL corpus, or load its cached index (see the module docstring)."""
        path = Path(path).resolve()
        if not path.is_file():
            raise SearchQADataError(path, "no such file")
        st = path.stat()
        key = hashlib.sha256(json.dumps([_INDEX_VERSION, str(path), st.st_size, st.st_mtime_ns, K1, B]).encode())
        folder = Path(cache_dir) if cache_dir is not None else _cache_root() / "searchqa" / "bm25" / key.hexdigest()[:20]
        if (folder / "done.json").is_file():
            return cls._load(folder, path)
        offsets, ids, vocab = [], [], {}
        buf: list[str] = []
        with _progress(progress, st.st_size, f"indexing {path.name}") as advance:
            for off, _id, contents in iter_corpus(path):
                offsets.append(off)
                buf.append(contents)
                if len(buf) >= chunk:
                    ids.extend(cls._ids(buf, vocab))
                    advance(off)
                    buf = []
            ids.extend(cls._ids(buf, vocab))
            advance(st.st_size)
        if not ids:
            raise SearchQADataError(path, "the corpus holds no passages")
        bm25 = cls._new_bm25()
        bm25.index((ids, vocab), show_progress=False)
        del ids
        off_arr = np.asarray(offsets, dtype=np.int64)
        _save_index(folder, bm25, off_arr, path)
        return cls(bm25, _line_reader(path, off_arr), len(off_arr))

    @classmethod
    def _load(cls, folder: Path, path: Path) -> "BM25Retriever":
        import bm25s

        bm25 = bm25s.BM25.load(str(folder / "bm25"), mmap=True)
        offsets = np.load(folder / "offsets.npy")
        return cls(bm25, _line_reader(path, offsets), len(offsets))

    # ---------------------------------------------------------------- search
    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every passage (zeros when no query token is in the vocabulary)."""
        toks = [t for t in tokenize(query) if t in self._vocab]
        if not toks:
            return np.zeros(self.num_docs, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(toks))

    def top(self, query: str, topk: int) -> list[int]:
        """Indices of the ``topk`` best passages with a positive score, best first, ties by index."""
        s = self.scores(query)
        if topk < s.size:
            cand = np.argpartition(-s, topk - 1)[:topk]
            kth = s[cand].min()
            cand = np.flatnonzero(s >= kth)  # every passage tied with the k-th, so ties resolve by index
        else:
            cand = np.arange(s.size)
        cand = cand[s[cand] > 0]
        order = cand[np.lexsort((cand, -s[cand]))][:topk]
        return [int(i) for i in order]

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]:
        out = []
        for q in queries:
            hit = self._memo.get((q, topk))
            if hit is None:
                hit = [self._fetch(i) for i in self.top(q, topk)]
                self._memo.put((q, topk), hit)
            out.append(hit)
        return out


def _cache_root() -> Path:
    from icsd_audit.paths import cache_root

    return cache_root()


class _progress:
    """A rich progress bar over bytes read, on stderr; nothing when disabled."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(TextColumn(f"[bold]{self.label}[/]"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                           console=Console(stderr=True), transient=True)
        self._p.start()
        task = self._p.add_task(self.label, total=self.total)
        return lambda n: self._p.update(task, completed=n)

    def __exit__(self, *exc):
        if self.enabled:
            self._p.stop()
        return False


def _save_index(folder: Path, bm25: Any, offsets: np.ndarray, corpus: Path) -> None:
    """Write the index into a temporary sibling folder, then rename it into place."""
    import shutil
    import tempfile

    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
        bm25.save(str(tmp / "bm25"))
        np.save(tmp / "offsets.npy", offsets)
        (tmp / "done.json").write_text(json.dumps({"corpus": str(corpus), "passages": int(offsets.size), "k1": K1, "b": B}))
        if folder.exists():  # another process finished first: keep its copy
            shutil.rmtree(tmp)
            return
        from icsd_audit.outputs import umask_tree

        umask_tree(tmp)  # mkdtemp's 0700: the cache is an ordinary folder
        tmp.rename(folder)
    except OSError as exc:  # an unwritable cache costs a rebuild next time, not the run
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"warning: could not cache the BM25 index in {folder}: {exc}", file=sys.stderr)


def _line_reader(path: Path, offsets: np.ndarray):
    def fetch(i: int) -> dict[str, Any]:
        with open(path, "rb") as fh:
            fh.seek(int(offsets[i]))
            rec = json.loads(fh.readline())
        return {"id": str(rec["id"]), "contents": rec["contents"]}

    return fetch


class ServerRetriever:
    """A Search-R1 retrieval server (``retrieval_server.py`` or anything with its API)."""

    def __init__(self, url: str, *, timeout: float = 30.0):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = timeout
        self._memo = _Memo()

    def _post(self, queries: list[str], topk: int) -> list[Any]:
        body = json.dumps({"queries": queries, "topk": int(topk), "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                data = json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            raise ConnectionError(f"retrieval server {self.url} answered HTTP {exc.code}: {exc.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise ConnectionError(f"retrieval server {self.url} unreachable: {exc}") from None
        except json.JSONDecodeError:
            raise ValueError(f"retrieval server {self.url} did not answer JSON") from None
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise ValueError(f"retrieval server {self.url}: expected {{'result': [...]}} with one list per query "
                             f"({len(queries)}), got {str(data)[:200]}")
        return result

    def search(self, queries: Sequence[str], topk: int) -> list[list[dict[str, Any]]]:
        todo = [q for q in dict.fromkeys(queries) if self._memo.get((q, topk)) is None]
        if todo:
            for q, hits in zip(todo, self._post(todo, topk)):
                docs = []
                for h in hits:
                    doc = h.get("document", h) if isinstance(h, dict) else None
                    if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                        raise ValueError(f"retrieval server {self.url}: a result lacks document.contents: {str(h)[:200]}")
                    docs.append({"id": str(doc.get("id", "")), "contents": doc["contents"]})
                self._memo.put((q, topk), docs)
        return [self._memo.get((q, topk)) or [] for q in queries]

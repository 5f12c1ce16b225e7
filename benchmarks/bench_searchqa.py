"""Search-QA retrieval: BM25 (bm25s) over a large user corpus: index build, load, queries/s, peak RSS.

    python benchmarks/bench_searchqa.py [--passages 1000000] [--words 100] [--queries 2000] [--dir DIR] [--json]

A synthetic corpus in Search-R1's JSONL format is written first (``"Title"`` line, then
``--words`` words per passage, as wiki-18's 100-word passages; 200k pseudo-words with
Zipf-distributed frequencies, s = 1.07, so posting lists have a realistic long head).
Then, each phase in its own process so that its peak RSS is its own:

* ``build``: :meth:`BM25Retriever.from_jsonl` (stream, tokenise, index, save to the cache);
* ``query``: load the cached index (memory-mapped) and answer ``--queries`` distinct
  queries of 3-6 words drawn from random passages, top-3 each (no memo hits), twice:
  ``any`` words (the Zipf head, which behaves like stop words, included: pessimistic)
  and ``content`` words (those in < 5 % of the passages, as after stop-word removal).

Also reports the built-in KB's setup (generation + index) and its query rate. With
``--dir`` the corpus and index are kept there and reused by later runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _vocab(n: int) -> list[str]:
    cons, vow = "bcdfghjklmnprstvz", "aeiou"
    out, i = [], 0
    while len(out) < n:
        k, w = i, ""
        while True:
            w += cons[k % len(cons)] + vow[(k // len(cons)) % len(vow)]
            k //= len(cons) * len(vow)
            if k == 0:
                break
        out.append(w + "n" if len(w) < 4 else w)
        i += 1
    return out


def write_corpus(path: Path, passages: int, words: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = np.asarray(_vocab(200_000), dtype=object)
    p = 1.0 / np.arange(1, vocab.size + 1) ** 1.07
    p /= p.sum()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for start in range(0, passages, 20_000):
            n = min(20_000, passages - start)
            ids = rng.choice(vocab.size, size=(n, words + 3), p=p)
            lines = []
            for j in range(n):
                w = vocab[ids[j]]
                title = " ".join(w[:3]).title()
                lines.append(json.dumps({"id": str(start + j), "contents": f'"{title}"\n{title} ' + " ".join(w[3:])}))
            fh.write("\n".join(lines) + "\n")
    tmp.replace(path)


def phase_build(corpus: Path, cache: Path) -> dict[str, float]:
    from icsd_audit.envs.searchqa.retriever import BM25Retriever

    t0, c0 = time.perf_counter(), time.process_time()
    r = BM25Retriever.from_jsonl(corpus, cache_dir=cache, progress=sys.stderr.isatty())
    return {"build_s": time.perf_counter() - t0, "build_cpu_s": time.process_time() - c0, "passages": r.num_docs,
            "vocab": len(r._vocab), "build_peak_rss_mib": _rss_mib()}


def phase_query(corpus: Path, cache: Path, n_queries: int) -> dict[str, float]:
    import random

    from icsd_audit.envs.searchqa.retriever import BM25Retriever

    t0 = time.perf_counter()
    r = BM25Retriever.from_jsonl(corpus, cache_dir=cache, progress=False)
    load_s = time.perf_counter() - t0
    indptr, vocab = r._bm25.scores["indptr"], r._vocab
    df = lambda w: int(indptr[vocab[w.lower()] + 1] - indptr[vocab[w.lower()]])  # noqa: E731 - passages holding w
    rng = random.Random(0)
    out: dict[str, float] = {"load_cached_index_s": load_s}
    # "any": words drawn from random passages, the Zipf head included (it acts like stop
    # words, which real text loses to stop-word removal: pessimistic); "content": only words
    # in fewer than 5 % of the passages, like a query after stop-word removal.
    for kind, keep in (("any", lambda w: True), ("content", lambda w: df(w) < 0.05 * r.num_docs)):
        queries: list[str] = []
        while len(queries) < n_queries:
            words = [w for w in r._fetch(rng.randrange(r.num_docs))["contents"].split("\n", 1)[1].split() if keep(w)]
            if len(words) >= 6:
                q = " ".join(rng.sample(words, rng.randint(3, 6)))
                if q not in queries:
                    queries.append(q)
        r.search(queries[:20], 3)  # warm the memory map
        queries = queries[20:]
        t0, c0 = time.perf_counter(), time.process_time()
        hits = r.search(queries, 3)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert all(len(h) == 3 for h in hits)
        out.update({f"{kind}_queries": len(queries), f"{kind}_queries_per_s": len(queries) / dt,
                    f"{kind}_ms_per_query": 1e3 * dt / len(queries),
                    f"{kind}_queries_per_cpu_s": len(queries) / cpu})
    out["query_peak_rss_mib"] = _rss_mib()
    return out


def phase_builtin() -> dict[str, float]:
    t0 = time.perf_counter()
    from icsd_audit.envs.searchqa import builtin_kb, load_data

    data = load_data()
    setup = time.perf_counter() - t0
    qs = [it.question for it in builtin_kb().splits["test"]]
    t0 = time.perf_counter()
    data.retriever.search(qs, 3)
    return {"builtin_setup_s": setup, "builtin_queries_per_s": len(qs) / (time.perf_counter() - t0)}


def _child(*args: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--phase", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passages", type=int, default=1_000_000)
    ap.add_argument("--words", type=int, default=100)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--dir", type=Path, default=None, help="keep corpus and index here (reused when present)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        kind, *rest = args.phase
        res = {"build": lambda: phase_build(Path(rest[0]), Path(rest[1])),
               "query": lambda: phase_query(Path(rest[0]), Path(rest[1]), int(rest[2])),
               "builtin": phase_builtin}[kind]()
        print(json.dumps(res))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-searchqa-") as tmp:
        folder = args.dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        corpus = folder / f"corpus-{args.passages}x{args.words}.jsonl"
        cache = folder / f"index-{args.passages}x{args.words}"
        out: dict[str, float] = {"passages_requested": args.passages, "words": args.words}
        if not corpus.exists():
            t0 = time.perf_counter()
            write_corpus(corpus, args.passages, args.words)
            out["write_corpus_s"] = time.perf_counter() - t0
        out["corpus_mib"] = corpus.stat().st_size / 2**20
        if not (cache / "done.json").exists():
            out.update(_child("build", str(corpus), str(cache)))
        out.update(_child("query", str(corpus), str(cache), str(args.queries)))
        out.update(_child("builtin"))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v:,.3f}" if isinstance(v, float) else f"{k:>24}: {v:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""BM25 product search over the catalogue (``bm25s``), deterministic.

Each product is indexed as its title, attributes, option values, category path and
scrape query. Text is lower-cased, split into ASCII alphanumeric runs, stripped of
English stop words and lightly stemmed (plural ``s``/``es``), for documents and queries
alike. Scores come from ``bm25s`` (Lucene variant, k1 = 1.5, b = 0.75); results are the
documents with a positive score, best first, ties broken by catalogue order, at most
``k`` (WebShop returns 50). Query results are memoised (rollouts repeat queries).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

__all__ = ["tokenize", "product_text", "SearchEngine", "SEARCH_RETURN_N"]

SEARCH_RETURN_N = 50

_TOKEN = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an and are as at be but by for from has have i i'm im if in into is it its me my need "
    "of on or our please price lower than dollars that the their them then there these they "
    "this to want was we were which will with would you your looking find".split()
)


def _stem(tok: str) -> str:
    if len(tok) > 4 and tok.endswith(("ches", "shes", "sses", "xes")):
        return tok[:-2]
    if len(tok) > 3 and tok.endswith("s") and not tok.endswith(("ss", "us", "is")):
        return tok[:-1]
    return tok


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric tokens, stop words removed, plurals folded."""
    return [_stem(t) for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


def product_text(product: dict[str, Any]) -> str:
    """The text a product is indexed under."""
    option_values = [v for values in product["options"].values() for v in values]
    return " ".join(
        [product["title"], *product["attributes"], *option_values, product["product_category"], product["query"]]
    )


class SearchEngine:
    """BM25 over a product list; ``search(query)`` returns product indices."""

    def __init__(self, products: Sequence[dict[str, Any]], *, cache_size: int = 4096):
        try:
            import bm25s
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "The built-in WebShop needs bm25s for search: pip install 'icsd-audit[train]' (or pip install bm25s)"
            ) from exc
        corpus = [tokenize(product_text(p)) for p in products]
        self._bm25 = bm25s.BM25(k1=1.5, b=0.75, method="lucene")
        self._bm25.index(corpus, show_progress=False)
        self._vocab = self._bm25.vocab_dict
        self._num_docs = len(products)
        self._cache: OrderedDict[tuple[str, int], tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every product for ``query`` (zeros when no query token is known)."""
        toks = [t for t in tokenize(query) if t in self._vocab]
        if not toks:
            return np.zeros(self._num_docs, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(toks))

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> tuple[int, ...]:
        """Indices of the top-``k`` products with a positive score, best first."""
        key = (query, k)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        scores = self.scores(query)
        idx = np.flatnonzero(scores > 0)
        order = idx[np.lexsort((idx, -scores[idx]))][:k]
        result = tuple(int(i) for i in order)
        self._cache[key] = result
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return result

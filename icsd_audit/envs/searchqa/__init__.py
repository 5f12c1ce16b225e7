"""Search-QA for multi-turn agents (Search-R1's interface, exact-match reward).

* :class:`SearchQAEnv`: ``<search>``/``<answer>`` episodes over the built-in synthetic
  KB (:mod:`.kb`) or a user's Search-R1 files, with BM25 (bm25s) or a Search-R1
  retrieval server (:mod:`.retriever`).
* :func:`exact_match` / :func:`normalize_answer`: Search-R1's EM (:mod:`.em`).
* :func:`load_data`: questions and retriever, loaded once per process.
"""

from .data import SearchQADataError, read_qa_parquet, write_searchr1
from .em import exact_match, extract_answer, normalize_answer
from .env import PAPER_COLUMNS, SearchQAData, SearchQAEnv, column_name, load_data, parse_reply
from .kb import SUBSETS, KnowledgeBase, QAItem, builtin_kb, generate_kb
from .retriever import BM25Retriever, ServerRetriever, format_passages

__all__ = ["SUCCESS_RULE", "SearchQAEnv", "SearchQAData", "load_data", "parse_reply", "PAPER_COLUMNS", "column_name", "SUBSETS",
           "QAItem", "KnowledgeBase", "builtin_kb", "generate_kb", "exact_match", "normalize_answer", "extract_answer",
           "BM25Retriever", "ServerRetriever", "format_passages", "SearchQADataError", "read_qa_parquet",
           "write_searchr1"]

#: what a won episode is, in words (the run's closing lines and docs quote it)
SUCCESS_RULE = (
    "ended with an answer that exactly matches a gold answer"
)

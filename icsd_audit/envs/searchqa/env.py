"""Search-QA as a multi-turn text environment, with Search-R1's interface.

Each turn the model writes ``<search> query </search>`` or ``<answer> text </answer>``
(reasoning inside ``<think>...</think>`` first, as the prompt asks). How a reply is read,
when it is valid and what an invalid one gets back follow one of two references, the
environment's ``protocol`` (:mod:`.protocol`): ``"search-r1"`` (Search-R1's rollout loop,
the default) or ``"verl-agent"`` (verl-agent's search environment, which SDAR's scripts
run). :meth:`SearchQAEnv.parse_reply` gives the action, ``<search> q </search>`` with
whitespace collapsed (also what a history shows); :meth:`SearchQAEnv.reply_valid` is the
protocol's validity rule, which the trainer's ``format`` rule uses.
:meth:`SearchQAEnv.step` takes that tag form or the bracket form ``search[q]`` /
``answer[a]`` of the other environments:

* ``search[q]``: the top-``topk`` passages (Search-R1: 3) come back as the next
  observation, ``<information>...</information>`` in the protocol's format; reward 0.
  An empty query gets no passages (the references send it to their retriever).
* ``answer[a]``: the episode ends; reward = exact match of ``a`` against the gold
  answers (:mod:`.em`), so ``won`` = ``score`` = EM.
* anything else is invalid: the state is unchanged, the observation is the protocol's
  (Search-R1's "My previous action is invalid. ..." message, or nothing) and
  ``info["valid_action"]`` is False.

The ``max_steps``-th turn is the final-answer turn: an answer is scored as always, a
search is not run (Search-R1's last rollout has ``do_search=False``; verl-agent's
environment is done at ``max_turns`` before it calls the tool), and the episode ends
with reward 0 unless it answered. ``max_steps`` counts every turn, this last one
included (Table A1: 4); Search-R1's ``max_turns`` = T corresponds to ``max_steps`` = T + 1.

Tasks come from :class:`SearchQAData`: the built-in synthetic KB, or a user's Search-R1
files. The ``eval`` split interleaves the subsets round-robin (in
:data:`~.kb.SUBSETS` order, then any other data sources by name), so that the first N
held-out questions that ``icsd eval`` takes are balanced across subsets.
"""

from __future__ import annotations

import numbers
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping, Sequence

from ..base import Observation, ParsedAction, StepResult, step_info
from .data import read_qa_parquet
from .em import exact_match
from .kb import SUBSETS, QAItem, builtin_kb
from .protocol import INVALID_MESSAGE, PROTOCOLS, cut_reply, information, invalid_observation, reply_valid
from .protocol import parse_reply as _parse_reply
from .retriever import BM25Retriever, Retriever, ServerRetriever

#: Search-QA's experts (:mod:`.expert`): the oracle chain and the gold answer, or what retrieval surfaced.
EXPERT_MODES = ("gold", "retrieval")

__all__ = ["EXPERT_MODES", "SearchQAEnv", "SearchQAData", "load_data", "parse_reply", "PAPER_COLUMNS", "INVALID_MESSAGE",
           "START_TEXT", "column_name", "PROTOCOLS"]

#: data_source -> the paper's column name (Table 1 / Table A3).
PAPER_COLUMNS = {"nq": "NQ", "triviaqa": "Triv", "popqa": "Pop", "hotpotqa": "Hotp", "2wikimultihopqa": "2Wk",
                 "musique": "MuS", "bamboogle": "Bam"}
#: The observation before the first search.
START_TEXT = "No search results yet."
_BLOCK = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_CALL = re.compile(r"^\s*(search|answer)\[(.*)\]\s*$", re.DOTALL | re.IGNORECASE)
_SPLIT_ALIASES = {"eval": "test", "test": "test", "train": "train", "dev": "test", "validation": "test"}


def column_name(data_source: str) -> str:
    """The paper's column for a data source (unknown sources keep their name)."""
    return PAPER_COLUMNS.get(data_source, data_source)


def parse_reply(text: str, *, require_think: bool = False, protocol: str = "search-r1") -> ParsedAction:
    """The action of a reply under ``protocol`` (:func:`.protocol.parse_reply`)."""
    return _parse_reply(text, require_think=require_think, protocol=protocol)


@dataclass(frozen=True)
class SearchQAData:
    """Question splits and the retriever shared by every environment instance."""

    splits: Mapping[str, tuple[QAItem, ...]]
    retriever: Retriever
    #: Recorded in dump metadata: where the questions and passages come from.
    info: dict[str, Any] = field(default_factory=dict)

    def tasks(self, split: str) -> tuple[QAItem, ...]:
        key = _SPLIT_ALIASES.get(split, split)
        if key not in self.splits:
            raise ValueError(f"unknown Search-QA split {split!r}; choose 'train' or 'eval' (alias 'test')")
        return self.splits[key]


def _interleave(items: Sequence[QAItem]) -> tuple[QAItem, ...]:
    by: dict[str, list[QAItem]] = {}
    for it in items:
        by.setdefault(it.data_source, []).append(it)
    order = [s for s in SUBSETS if s in by] + sorted(s for s in by if s not in SUBSETS)
    out: list[QAItem] = []
    for k in range(max(len(v) for v in by.values())):
        out.extend(by[s][k] for s in order if k < len(by[s]))
    return tuple(out)


def load_data(corpus: str | None = None, data: str | None = None, retriever_url: str | None = None,
              seed: int = 0) -> SearchQAData:
    """The questions and retriever for one configuration, loaded once per process.

    ``corpus``: a Search-R1 JSONL corpus (BM25 over it); ``data``: ``train.parquet,test.parquet``
    (one file: used for both splits); ``retriever_url``: a Search-R1 retrieval server,
    used instead of BM25. With none of them: the built-in synthetic KB.
    """
    return _load_data(str(corpus) if corpus else None, str(data) if data else None, retriever_url or None, int(seed))


@lru_cache(maxsize=4)
def _load_data(corpus: str | None, data: str | None, retriever_url: str | None, seed: int) -> SearchQAData:
    info: dict[str, Any]
    if data:
        files = [f.strip() for f in data.split(",") if f.strip()]
        if not 1 <= len(files) <= 2:
            raise ValueError(f"searchqa_data={data!r}: give 'train.parquet,test.parquet' (or one file for both splits)")
        train = tuple(read_qa_parquet(files[0]))
        test = tuple(read_qa_parquet(files[-1]))
        splits = {"train": train, "test": _interleave(test)}
        info = {"questions": files}
    else:
        kb = builtin_kb(seed)
        splits = {"train": kb.splits["train"], "test": _interleave(kb.splits["test"])}
        info = {"questions": "builtin", **{f"kb_{k}": v for k, v in kb.info.items()}}
    if retriever_url:
        retriever: Retriever = ServerRetriever(retriever_url)
        info["retriever"] = {"kind": "search-r1-server", "url": retriever_url}
    elif corpus:
        retriever = BM25Retriever.from_jsonl(corpus)
        info["retriever"] = {"kind": "bm25s", "corpus": corpus}
    elif data:
        raise ValueError("searchqa_data is set but no corpus to search: also set searchqa_corpus=corpus.jsonl "
                         "or retriever_url=http://host:port")
    else:
        retriever = BM25Retriever.from_passages(builtin_kb(seed).passages)
        info["retriever"] = {"kind": "bm25s", "corpus": "builtin"}
    info["synthetic"] = not data  # built-in questions are synthetic whatever the retriever
    return SearchQAData(splits=splits, retriever=retriever, info=info)


class SearchQAEnv:
    """Search-QA episodes over :class:`SearchQAData` (see the module docstring).

    Args:
        split: ``"train"`` or ``"eval"`` (``"test"`` is an alias).
        max_steps: turn budget (Table A1: 4).
        seed: seeds the draw of a task when ``reset()`` gets none.
        topk: passages per search (Search-R1: 3).
        data: loaded data; by default :func:`load_data` with ``corpus``, ``data_files``, ``retriever_url``.
        protocol: ``"search-r1"`` or ``"verl-agent"``: how replies are read and judged and
            what comes back (:mod:`.protocol`); the prompt builder follows it too.
        expert: which expert ``--policy expert`` plays: ``"gold"`` or ``"retrieval"`` (:mod:`.expert`).
    """

    name = "searchqa"

    def __init__(self, split: str = "train", *, max_steps: int = 4, seed: int = 0, topk: int = 3,
                 data: SearchQAData | None = None, corpus: str | None = None, data_files: str | None = None,
                 retriever_url: str | None = None, protocol: str = "search-r1", expert: str = "gold"):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol {protocol!r}: choose one of {list(PROTOCOLS)}")
        if expert not in EXPERT_MODES:
            raise ValueError(f"expert {expert!r}: choose one of {list(EXPERT_MODES)}")
        self.protocol = protocol
        self.expert = expert  # which expert --policy expert plays (.expert)
        self.data = data if data is not None else load_data(corpus, data_files, retriever_url)
        self.split = split
        self.tasks: tuple[QAItem, ...] = self.data.tasks(split)
        self.max_steps = int(max_steps)
        self.topk = int(topk)
        self._rng = random.Random(seed)
        self._item: QAItem | None = None
        self._done = True
        self._steps = 0
        self._searches = 0
        self._retrieved: list[tuple[str, tuple[dict[str, Any], ...]]] = []

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def data_info(self) -> dict[str, Any]:
        return dict(self.data.info)

    @property
    def item(self) -> QAItem | None:
        """The current question."""
        return self._item

    @property
    def steps(self) -> int:
        """Turns taken in the current episode."""
        return self._steps

    @property
    def searches(self) -> int:
        """Searches run in the current episode."""
        return self._searches

    @property
    def retrieved(self) -> tuple[tuple[str, tuple[dict[str, Any], ...]], ...]:
        """The current episode's searches that ran: (query, the passages it returned), in order."""
        return tuple(self._retrieved)

    def task_group(self, task: int) -> str:
        """The paper's column name of task ``task``'s subset (for per-subset metrics)."""
        return column_name(self.tasks[task].data_source)

    def parse_reply(self, text: str, *, require_think: bool = False) -> ParsedAction:
        """The reply's action under this environment's protocol."""
        return parse_reply(text, require_think=require_think, protocol=self.protocol)

    def context_reply(self, text: str) -> str:
        """A reply as a growing context keeps it: cut after its first ``</search>``, else ``</answer>``."""
        return cut_reply(text)

    def reply_valid(self, text: str) -> bool:
        """The protocol's validity rule (the trainer's ``format`` rule for Search-QA)."""
        return reply_valid(text, protocol=self.protocol)

    def reset(self, task: int | QAItem | None = None) -> Observation:
        if task is None:
            item = self.tasks[self._rng.randrange(len(self.tasks))]
        elif isinstance(task, QAItem):
            item = task
        elif isinstance(task, numbers.Integral) and not isinstance(task, bool):
            if not 0 <= int(task) < len(self.tasks):
                raise IndexError(f"task index {task} out of range for split {self.split!r} ({len(self.tasks)} tasks)")
            item = self.tasks[int(task)]
        else:
            raise TypeError(f"task must be an int index, a QAItem or None, not {type(task).__name__}")
        self._item, self._done, self._steps, self._searches = item, False, 0, 0
        self._retrieved = []
        return self._obs(START_TEXT)

    def step(self, action: str) -> StepResult:
        if self._done or self._item is None:
            raise RuntimeError("the episode is over; call reset() first")
        self._steps += 1
        final = self._steps >= self.max_steps  # the final-answer turn: a search is not run
        m = _CALL.match(action or "") or _BLOCK.fullmatch((action or "").strip())
        reward, extra = 0.0, {}
        if m is None:
            text, valid = invalid_observation(self.protocol), False
        elif m.group(1).lower() == "search":
            query, valid = " ".join(m.group(2).split()), True
            if final:
                text = ""
            else:
                docs = self.data.retriever.search([query], self.topk)[0] if query else []
                text = information(docs, protocol=self.protocol)
                self._searches += 1
                self._retrieved.append((query, tuple(docs)))
                extra["doc_ids"] = [d["id"] for d in docs]
        else:
            answer = " ".join(m.group(2).split())
            reward = 1.0 if exact_match(answer, self._item.golden_answers) else 0.0
            text, valid, self._done = "", True, True
            extra["answer"] = answer
        truncated = False
        if not self._done and final:
            self._done, truncated = True, True
        info = step_info(won=reward == 1.0, score=reward, valid_action=valid, steps=self._steps, truncated=truncated,
                         data_source=self._item.data_source, **extra)
        return StepResult(self._obs(text), reward, self._done, info)

    def _obs(self, text: str) -> Observation:
        assert self._item is not None
        meta = {"step": self._steps, "data_source": self._item.data_source, "skill_key": self._item.data_source,
                "id": self._item.id, "protocol": self.protocol}
        return Observation(text=text, available_actions=(), instruction=self._item.question, meta=meta)

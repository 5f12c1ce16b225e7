"""The Search-QA experts, in Search-R1's tags: ``gold`` proves the referee, ``retrieval`` measures the retriever.

The environment's ``expert`` setting picks one (``searchqa_expert`` in the trainer's config).

``gold`` (default). For a built-in question (:class:`~.kb.QAItem` with ``hops``) the expert
searches each hop's oracle query (the hop entity's name, whose passage states the fact
the next hop needs; every one is in BM25's top 3, ``tests/envs/test_searchqa.py``), then
answers with the first gold answer, whatever the searches returned: its EM is 1 by
construction, so it checks the rules, prompts and rewards, not retrieval. A user question
has no oracle chain: it searches the question once, then answers.

``retrieval``. The expert says only what it has read, the question and the passages its
searches returned (``SearchQAEnv.retrieved``); the oracle only chooses among what it read:

* a query is the next oracle hop's query when that text occurs in the question or in a
  passage retrieved so far (the bridge entity has surfaced); when it does not (the chain
  broke), or the question has no chain (a user question), the question itself, once;
  after the whole chain, or with nothing left to search, it answers;
* the answer is a gold answer when one occurs, normalised as EM compares
  (:func:`~.em.normalize_answer`, on word boundaries), in a retrieved passage and, for a
  built-in question, every passage of its chain was retrieved (the facts that establish
  it were read: a comparison needs both); failing that, the best candidate it has: the
  title of the last search's top passage (or "unknown" when nothing was retrieved),
  which is right only by chance (one of a comparison's two names, say).

So its EM is the share of questions whose evidence the retriever surfaced within the
turn budget (for a user question: whose answer occurs in the retrieved passages), plus
the lucky guesses: an upper bound for a reader of those passages, below 1 wherever
retrieval, or the budget, falls short (a 4-hop question under Table A1's 4 turns runs 3
searches).

In both modes the last turn of the budget is the final-answer turn, so with ``max_steps``
= T the expert searches at most T - 1 times. Replies are
``<think>...</think><search> q </search>`` or ``<think>...</think><answer> a </answer>``,
valid under both protocols (:mod:`.protocol`).
"""

from __future__ import annotations

from typing import Any

from .em import normalize_answer

__all__ = ["expert_reply", "gold_reply", "retrieval_reply"]


def expert_reply(env: Any) -> str:
    """The reply of ``env``'s expert (``env.expert``) for its current turn (a :class:`~.env.SearchQAEnv` mid-episode)."""
    if env.item is None:
        raise RuntimeError("no running episode; call reset() first")
    return retrieval_reply(env) if getattr(env, "expert", "gold") == "retrieval" else gold_reply(env)


def _search(query: str, why: str) -> str:
    return f"<think>{why}</think><search> {query} </search>"


def _answer(answer: str, why: str) -> str:
    return f"<think>{why}</think><answer> {answer} </answer>"


def gold_reply(env: Any) -> str:
    """The oracle chain's next search, then the first gold answer."""
    item = env.item
    queries = [q for q, _ in item.hops] if item.hops else [item.question]
    turns_left = env.max_steps - env.steps  # this turn included; the last one is the final-answer turn
    if env.searches < len(queries) and turns_left > 1:
        q = queries[env.searches]
        return _search(q, "I do not know this, so I search for it." if not item.hops else
                       f"I need the facts about {q} to go on, so I search for it.")
    answer = item.golden_answers[0]
    return _answer(answer, f"The information I found gives the answer: {answer}.")


def _passage_text(doc: dict[str, Any]) -> str:
    return str(doc.get("contents", doc.get("text", "")))


def _title(doc: dict[str, Any]) -> str:
    """A passage's title: its first line without the quotes Search-R1's corpus puts around it."""
    return _passage_text(doc).split("\n", 1)[0].strip().strip('"').strip()


def _occurs(phrase: str, text: str) -> bool:
    """Whether normalised ``phrase`` occurs in normalised ``text`` as whole words."""
    p = normalize_answer(phrase)
    return bool(p) and f" {p} " in f" {normalize_answer(text)} "


def retrieval_reply(env: Any) -> str:
    """The next search a reader of the retrieved passages can make, or the answer those passages hold."""
    item = env.item
    searched = [q for q, _ in env.retrieved]
    docs = [d for _, found in env.retrieved for d in found]
    read = "\n".join([item.question, *(_passage_text(d) for d in docs)])
    if env.max_steps - env.steps > 1:  # not yet the final-answer turn
        hops = [q for q, _ in item.hops if q not in searched]
        if hops and _occurs(hops[0], read):
            return _search(hops[0], f"The text I have names {hops[0]}; I search for it to go on.")
        if item.question not in searched and (hops or not item.hops):  # the chain broke, or there is none
            return _search(item.question, "I do not know this, so I search for the question.")
    passages = "\n".join(_passage_text(d) for d in docs)
    got = {str(d.get("id")) for d in docs}
    # a built-in question is answerable once every passage of its chain was read (a comparison needs both facts)
    read_chain = all(pid in got for _, pid in item.hops)
    found = next((a for a in item.golden_answers if _occurs(a, passages)), None) if read_chain else None
    if found is not None:
        return _answer(found, f"A passage I retrieved states it: {found}.")
    last = env.retrieved[-1][1] if env.retrieved and env.retrieved[-1][1] else ()
    guess = _title(last[0]) if last else "unknown"
    return _answer(guess, "No passage I retrieved states the answer; my best candidate is the top passage's subject.")

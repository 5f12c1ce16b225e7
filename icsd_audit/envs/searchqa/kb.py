"""The built-in synthetic knowledge base: a seeded entity graph rendered as passages, and
questions over it in the styles of Search-R1's seven QA subsets.

Nothing here is real data. Entities (countries, cities, people, films, novels, songs,
companies) get invented names and are linked by relations (born in, directed, wrote,
recorded, founded, produced, married to, child of, capital of, located in); every entity
becomes one passage in Search-R1's corpus format (``contents`` = ``"Title"`` on the
first line, then the text), stating its relations in plain sentences. Because the names
are invented, a model cannot answer from memory: it has to search.

Questions are generated from the graph, each with the chain of passages that answers
it (``hops``: the oracle query for each hop, which is the hop entity's name, and the
passage that states the fact) and gold answers:

=================  ==========================================================  =======
subset             style imitated                                              hops
=================  ==========================================================  =======
nq                 short lower-case factoid ("who directed the film X")        1
triviaqa           trivia phrasing ("Which singer recorded the 1994 song ...")  1
popqa              PopQA templates ("What is X's occupation?")                 1
hotpotqa           bridge and comparison ("Which film was released first ...")  2
2wikimultihopqa    2Wiki templates ("Who is the spouse of the director of ...")  2-4
musique            chained composition ("... the country where the author ...")  3-4
bamboogle          short compositional ("Who founded the company that ...")    2
=================  ==========================================================  =======

As in Search-R1, the train split holds only ``nq`` and ``hotpotqa`` questions and the
test split all seven (125 each, Bamboogle's size); no question text occurs in both.
The KB is generated in memory on first use (about a second; :func:`builtin_kb`) rather
than shipped: it is a pure function of ``(KB_VERSION, seed)``, so there is no data file
to keep in sync with the generator, and ``python -m icsd_audit.envs.searchqa.data --out
DIR`` writes it in Search-R1's file formats for inspection or for other tools.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["KB_VERSION", "SUBSETS", "TRAIN_SUBSETS", "KnowledgeBase", "QAItem", "builtin_kb", "generate_kb"]

KB_VERSION = 1
#: Search-R1's data_source names of the seven subsets, in the paper's column order.
SUBSETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
#: Search-R1 trains on NQ + HotpotQA only.
TRAIN_SUBSETS = ("nq", "hotpotqa")
TEST_PER_SUBSET = 125
TRAIN_PER_SUBSET = 800


@dataclass(frozen=True)
class QAItem:
    """One question: Search-R1's fields plus the oracle retrieval chain."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    data_source: str
    #: (oracle query, id of the passage that states a needed fact); the last one's passage holds the answer.
    hops: tuple[tuple[str, str], ...] = ()
    #: Id of the passage whose text contains the answer ('' when unknown, e.g. user data).
    answer_passage: str = ""


@dataclass(frozen=True)
class KnowledgeBase:
    """Passages (Search-R1 corpus records) and question splits."""

    passages: tuple[dict[str, str], ...]
    splits: dict[str, tuple[QAItem, ...]]
    info: dict[str, Any]


# ------------------------------------------------------------------------------ vocabulary
_FIRST = ("Maren Ilse Tomas Ansel Petra Corin Liesl Oskar Dagny Emrik Sabine Viktor Alma Ruben Ingrid Felix "
          "Nadia Leon Greta Arvid Selma Matthias Edda Konrad Yara Bastian Livia Henrik Mira Jonas Talia Elias "
          "Runa Kasimir Thea Anton Vera Lucian Ada Nikolai Iris Sorin Cleo Ambrose Nina Silas Wanda Caspar "
          "Elodie Milan Frida Tobias Zora Adrian Linnea Gideon Rosa Valentin Hedda Pascal").split()
_SYL1 = "Tol Var Bren Kas Mor Dal Fen Gar Hol Lun Mar Nor Pel Quin Ros Sel Tav Ulm Vel Wes Yor Zan Ard Bel Cor Dun".split()
_SYL2 = "vi ra le mo ka si do ne ta lu ri ba".split()
_SYL3 = "k n th sen dt mar berg vik holm ford rin wald".split()
_PLACE1 = "Bra Cal Dor Est Fal Gol Hav Ist Jor Kel Lor Mes Nov Orm Pra Rav Sol Tir Umb Val Wyn Zel".split()
_PLACE2 = "sto ve ri na da lo mi ra te ba".split()
_PLACE3 = "va ria burg port mont grad ford dale heim polis".split()
_ADJ = ("Glass Silent Crimson Hollow Northern Paper Iron Velvet Burning Quiet Golden Broken Distant Hidden "
        "Frozen Last Wandering Emerald Scarlet Midnight Forgotten Electric Amber Silver Lonely Painted Sleeping "
        "Copper Restless Winter").split()
_NOUN = ("Orchard Harbor Lantern Meridian Garden Tide Compass Mirror Archive Bridge Cathedral Orchestra Voyage "
         "Horizon Kingdom Letter Island Machine Season River Empire Window Staircase Carousel Observatory "
         "Labyrinth Frontier Sonata Monument Parade").split()
_BOOK1 = "Letters Chronicles Memoirs Tales Secrets Ghosts Keepers Children Daughters Witnesses Songs Heirs".split()
_BOOK2 = "Ash Marrow Thorn Wren Hazel Briar Sable Rook Fern Gale".split()
_BOOK3 = "mere gate wick moor fell combe hollow stead".split()
_SONG = ("Dancing Falling Waiting Running Dreaming Calling Burning Shining Drifting Fading").split()
_SONG2 = ("Rain Lights Stars Hearts Roads Shadows Bells Waves Skies Fires Streets Echoes").split()
_CO1 = "Nordan Vextra Halcyon Brightwell Castellan Ostrava Pellucid Quorra Sundale Tessera Umbral Verity".split()
_CO2 = "Industries Motors Pictures Systems Foods Textiles Aerospace Records Pharmaceuticals Publishing".split()
_LANGS = "Veldic Orsan Calmeric Tirrish Lunvic Ambrean Solvene Dorash Kelvan Zennic".split()
_FILM_GENRES = ("drama", "comedy", "thriller", "documentary", "science fiction", "musical", "western", "horror")
_BOOK_GENRES = ("mystery", "romance", "fantasy", "historical", "crime", "adventure")
_SONG_GENRES = ("pop", "jazz", "folk", "rock", "soul", "electronic")
_OTHER_JOBS = ("physicist", "painter", "architect", "politician", "actor", "chemist", "journalist", "sculptor")


def _unique(rng: random.Random, make, n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = make()
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


# ------------------------------------------------------------------------------ the graph
def _graph(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    taken: set[str] = set()
    place = lambda: rng.choice(_PLACE1) + rng.choice(_PLACE2) + rng.choice(_PLACE3)  # noqa: E731
    countries = [{"name": n, "language": rng.choice(_LANGS)} for n in _unique(rng, place, 30, taken)]
    cities = [{"name": n, "country": i % len(countries)} for i, n in enumerate(_unique(rng, place, 150, taken))]
    for i, c in enumerate(countries):
        c["capital"] = i  # city i lies in country i (i < 30), so every capital is in its country
    surnames = _unique(rng, lambda: rng.choice(_SYL1) + rng.choice(_SYL2) + rng.choice(_SYL3), 900, taken)
    jobs = ["film director"] * 200 + ["novelist"] * 130 + ["singer"] * 110 + ["entrepreneur"] * 150
    jobs += [rng.choice(_OTHER_JOBS) for _ in range(900 - len(jobs))]
    rng.shuffle(jobs)
    people = [{"name": f"{rng.choice(_FIRST)} {s}", "surname": s, "born": rng.randrange(1900, 1990),
               "city": rng.randrange(len(cities)), "job": jobs[i]} for i, s in enumerate(surnames)]
    order = list(range(len(people)))
    rng.shuffle(order)
    for a, b in zip(order[0:400:2], order[1:400:2]):  # 200 married couples
        people[a]["spouse"], people[b]["spouse"] = b, a
    for i in order[400:700]:  # 300 people with a known father, 20-45 years older
        older = [j for j in order[700:] if 20 <= people[i]["born"] - people[j]["born"] <= 45]
        if older:
            people[i]["father"] = rng.choice(older)
    by_job = {j: [i for i, p in enumerate(people) if p["job"] == j] for j in set(jobs)}
    title = lambda: f"The {rng.choice(_ADJ)} {rng.choice(_NOUN)}"  # noqa: E731
    companies = [{"name": n, "founder": f, "founded": people[f]["born"] + rng.randrange(22, 50),
                  "city": rng.randrange(len(cities))}
                 for n, f in zip(_unique(rng, lambda: f"{rng.choice(_CO1)} {rng.choice(_CO2)}", 110, taken),
                                 by_job["entrepreneur"])]
    studios = [i for i, c in enumerate(companies) if c["name"].endswith("Pictures")] or list(range(len(companies)))
    films = []
    for n in _unique(rng, title, 500, taken):
        d = rng.choice(by_job["film director"])
        films.append({"name": n, "director": d, "year": people[d]["born"] + rng.randrange(25, 60),
                      "genre": rng.choice(_FILM_GENRES), "studio": rng.choice(studios)})
    books = []
    for n in _unique(rng, lambda: f"{rng.choice(_BOOK1)} of {rng.choice(_BOOK2)}{rng.choice(_BOOK3)}", 300, taken):
        a = rng.choice(by_job["novelist"])
        books.append({"name": n, "author": a, "year": people[a]["born"] + rng.randrange(20, 70),
                      "genre": rng.choice(_BOOK_GENRES)})
    songs = []
    for n in _unique(rng, lambda: f"{rng.choice(_SONG)} {rng.choice(_SONG2)}", 110, taken):
        s = rng.choice(by_job["singer"])
        songs.append({"name": n, "performer": s, "year": people[s]["born"] + rng.randrange(18, 50),
                      "genre": rng.choice(_SONG_GENRES)})
    for i, c in enumerate(companies):
        people[c["founder"]]["founded"] = i
    return {"country": countries, "city": cities, "person": people, "film": films, "book": books, "song": songs,
            "company": companies}


def _passages(g: dict[str, list[dict[str, Any]]]) -> tuple[list[dict[str, str]], dict[tuple[str, int], str]]:
    """One passage per entity; returns the records and (kind, index) -> passage id."""
    C, Ci, P, F, B, S, Co = (g[k] for k in ("country", "city", "person", "film", "book", "song", "company"))
    demonym = {i: c["name"] + "n" if c["name"][-1] in "aeiou" else c["name"] + "ian" for i, c in enumerate(C)}
    texts: list[tuple[tuple[str, int], str, str]] = []
    for i, c in enumerate(C):
        texts.append((("country", i), c["name"], f"{c['name']} is a country whose capital is {Ci[c['capital']]['name']}. "
                      f"The official language of {c['name']} is {c['language']}."))
    for i, c in enumerate(Ci):
        extra = f" It is the capital of {C[c['country']]['name']}." if i < len(C) else ""
        texts.append((("city", i), c["name"], f"{c['name']} is a city in {C[c['country']]['name']}.{extra}"))
    for i, p in enumerate(P):
        city = Ci[p["city"]]
        t = (f"{p['name']} (born {p['born']} in {city['name']}) is a {demonym[city['country']]} {p['job']}. "
             f"{p['surname']} was born in {city['name']}, {C[city['country']]['name']}, in {p['born']}.")
        if "spouse" in p:
            t += f" {p['surname']} is married to {P[p['spouse']]['name']}."
        if "father" in p:
            t += f" {p['surname']} is the child of {P[p['father']]['name']}."
        if "founded" in p:
            t += f" In {Co[p['founded']]['founded']} {p['surname']} founded {Co[p['founded']]['name']}."
        texts.append((("person", i), p["name"], t))
    for i, f in enumerate(F):
        texts.append((("film", i), f["name"], f"{f['name']} is a {f['year']} {f['genre']} film directed by "
                      f"{P[f['director']]['name']} and produced by {Co[f['studio']]['name']}. It was released in {f['year']}."))
    for i, b in enumerate(B):
        texts.append((("book", i), b["name"], f"{b['name']} is a {b['genre']} novel by {P[b['author']]['name']}, "
                      f"first published in {b['year']}."))
    for i, s in enumerate(S):
        texts.append((("song", i), s["name"], f"\"{s['name']}\" is a {s['year']} {s['genre']} song recorded by "
                      f"{P[s['performer']]['name']}."))
    for i, c in enumerate(Co):
        texts.append((("company", i), c["name"], f"{c['name']} is a company founded in {c['founded']} by "
                      f"{P[c['founder']]['name']}. It is headquartered in {Ci[c['city']]['name']}."))
    records, ids = [], {}
    for pid, (key, title, text) in enumerate(texts):
        records.append({"id": str(pid), "contents": f'"{title}"\n{text}'})
        ids[key] = str(pid)
    return records, ids


# ------------------------------------------------------------------------------ questions
def _questions(g: dict[str, list[dict[str, Any]]], pid: dict[tuple[str, int], str],
               rng: random.Random) -> dict[str, list[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], str]]]:
    """Every candidate question per subset: (question, answers, hops, answer passage id)."""
    C, Ci, P, F, B, S, Co = (g[k] for k in ("country", "city", "person", "film", "book", "song", "company"))
    h = lambda kind, i: (g[kind][i]["name"], pid[(kind, i)])  # noqa: E731 - oracle hop: the entity's name
    out: dict[str, list] = {s: [] for s in SUBSETS}

    def add(subset: str, q: str, answers: list[str], hops: list[tuple[str, str]]) -> None:
        out[subset].append((q, tuple(answers), tuple(hops), hops[-1][1]))

    for i, f in enumerate(F):
        d = f["director"]
        add("nq", f"who directed the film {f['name']}", [P[d]["name"]], [h("film", i)])
        add("nq", f"when was the film {f['name']} released", [str(f["year"])], [h("film", i)])
        add("triviaqa", f"Which film director made the {f['year']} film '{f['name']}'?", [P[d]["name"]], [h("film", i)])
        add("popqa", f"Who was the director of {f['name']}?", [P[d]["name"]], [h("film", i)])
        add("popqa", f"What genre is {f['name']}?", [f["genre"], f"{f['genre']} film"], [h("film", i)])
        c = P[d]["city"]
        add("hotpotqa", f"The director of the film {f['name']} was born in which city?", [Ci[c]["name"]],
            [h("film", i), h("person", d)])
        add("2wikimultihopqa", f"Where was the director of film {f['name']} born?", [Ci[c]["name"]],
            [h("film", i), h("person", d)])
        if "spouse" in P[d]:
            add("2wikimultihopqa", f"Who is the spouse of the director of film {f['name']}?", [P[P[d]["spouse"]]["name"]],
                [h("film", i), h("person", d)])
        st = f["studio"]
        add("hotpotqa", f"In what year was the studio that produced {f['name']} founded?", [str(Co[st]["founded"])],
            [h("film", i), h("company", st)])
        add("bamboogle", f"Who founded the company that produced {f['name']}?", [P[Co[st]["founder"]]["name"]],
            [h("film", i), h("company", st)])
    for i, b in enumerate(B):
        a = b["author"]
        add("nq", f"who wrote the novel {b['name']}", [P[a]["name"]], [h("book", i)])
        add("triviaqa", f"'{b['name']}' is a novel by which author?", [P[a]["name"]], [h("book", i)])
        add("popqa", f"Who is the author of {b['name']}?", [P[a]["name"]], [h("book", i)])
        add("bamboogle", f"What year was the author of {b['name']} born?", [str(P[a]["born"])],
            [h("book", i), h("person", a)])
        city = P[a]["city"]
        country = Ci[city]["country"]
        add("musique", f"What is the capital of the country where the author of {b['name']} was born?",
            [Ci[C[country]["capital"]]["name"]], [h("book", i), h("person", a), h("city", city), h("country", country)])
    for i, s in enumerate(S):
        p = s["performer"]
        add("nq", f"who sang {s['name']}", [P[p]["name"]], [h("song", i)])
        add("triviaqa", f"Which singer recorded the {s['year']} song '{s['name']}'?", [P[p]["name"]], [h("song", i)])
        city = P[p]["city"]
        add("musique", f"In which country was the performer of {s['name']} born?", [C[Ci[city]["country"]]["name"]],
            [h("song", i), h("person", p), h("city", city)])
        if "father" in P[p]:
            add("2wikimultihopqa", f"Who is the father of the performer of song {s['name']}?",
                [P[P[p]["father"]]["name"]], [h("song", i), h("person", p)])
    for i, c in enumerate(Co):
        add("nq", f"where is the headquarters of {c['name']}", [Ci[c["city"]]["name"]], [h("company", i)])
        add("triviaqa", f"Who founded the company {c['name']} in {c['founded']}?", [P[c["founder"]]["name"]],
            [h("company", i)])
        city = c["city"]
        add("musique", f"In which country is the headquarters of the company founded by {P[c['founder']]['name']}?",
            [C[Ci[city]["country"]]["name"]], [h("person", c["founder"]), h("company", i), h("city", city)])
    for i, c in enumerate(C):
        add("nq", f"what is the capital of {c['name']}", [Ci[c["capital"]]["name"]], [h("country", i)])
        add("popqa", f"What is the capital of {c['name']}?", [Ci[c["capital"]]["name"]], [h("country", i)])
    for i, c in enumerate(Ci[len(C):], len(C)):
        add("triviaqa", f"In which country is the city of {c['name']}?", [C[c["country"]]["name"]], [h("city", i)])
        add("popqa", f"In what country is {c['name']}?", [C[c["country"]]["name"]], [h("city", i)])
    for i, p in enumerate(P):
        add("popqa", f"What is {p['name']}'s occupation?", [p["job"]] + (["director"] if p["job"] == "film director" else []),
            [h("person", i)])
        add("popqa", f"In what city was {p['name']} born?", [Ci[p["city"]]["name"]], [h("person", i)])
        if "spouse" in p:
            add("bamboogle", f"What is the birth year of the spouse of {p['name']}?", [str(P[p["spouse"]]["born"])],
                [h("person", i), h("person", p["spouse"])])
    # comparisons: pairs with distinct values; the answer is one of the two names
    for _ in range(900):
        a, b = rng.sample(range(len(F)), 2)
        if F[a]["year"] != F[b]["year"]:
            first = a if F[a]["year"] < F[b]["year"] else b
            other = b if first == a else a
            add("hotpotqa", f"Which film was released first, {F[a]['name']} or {F[b]['name']}?", [F[first]["name"]],
                [h("film", other), h("film", first)])
        x, y = rng.sample(range(len(P)), 2)
        if P[x]["born"] != P[y]["born"]:
            older = x if P[x]["born"] < P[y]["born"] else y
            other = y if older == x else x
            add("hotpotqa", f"Who was born earlier, {P[x]['name']} or {P[y]['name']}?", [P[older]["name"]],
                [h("person", other), h("person", older)])
        a, b = rng.sample(range(len(F)), 2)
        da, db = F[a]["director"], F[b]["director"]
        if P[da]["born"] != P[db]["born"]:
            later = a if P[da]["born"] > P[db]["born"] else b
            other = b if later == a else a
            add("2wikimultihopqa", f"Which film has the director born later, {F[a]['name']} or {F[b]['name']}?",
                [F[later]["name"]], [h("person", F[other]["director"]), h("person", F[later]["director"]),
                                     h("film", other), h("film", later)])
    return out


def generate_kb(seed: int = 0) -> KnowledgeBase:
    """Build the KB for ``seed`` (deterministic; see the module docstring)."""
    rng = random.Random(f"icsd-searchqa-kb-v{KB_VERSION}-{seed}")
    g = _graph(rng)
    passages, pid = _passages(g)
    cands = _questions(g, pid, rng)
    splits: dict[str, list[QAItem]] = {"train": [], "test": []}
    seen: set[str] = set()
    for subset in SUBSETS:
        pool = []
        for q, answers, hops, ans_pid in cands[subset]:
            if q not in seen:  # a comparison pair can repeat; keep each question text once
                seen.add(q)
                pool.append((q, answers, hops, ans_pid))
        rng.shuffle(pool)
        n_train = TRAIN_PER_SUBSET if subset in TRAIN_SUBSETS else 0
        if len(pool) < TEST_PER_SUBSET + n_train:
            raise AssertionError(f"KB generator: subset {subset} has only {len(pool)} questions")  # pragma: no cover
        for split, chunk in (("test", pool[:TEST_PER_SUBSET]), ("train", pool[TEST_PER_SUBSET:TEST_PER_SUBSET + n_train])):
            for q, answers, hops, ans_pid in chunk:
                k = len(splits[split])
                splits[split].append(QAItem(id=f"{split}_{k}", question=q if q.endswith("?") else q + "?",
                                            golden_answers=answers, data_source=subset, hops=hops, answer_passage=ans_pid))
    info = {"name": "icsd synthetic Search-QA KB", "synthetic": True, "version": KB_VERSION, "seed": seed,
            "passages": len(passages), "train": len(splits["train"]), "test": len(splits["test"]),
            "note": "invented entities and facts imitating the seven Search-R1 subsets; not NQ/HotpotQA/... data"}
    return KnowledgeBase(passages=tuple(passages), splits={k: tuple(v) for k, v in splits.items()}, info=info)


@lru_cache(maxsize=2)
def builtin_kb(seed: int = 0) -> KnowledgeBase:
    """The built-in KB, generated once per process."""
    return generate_kb(seed)

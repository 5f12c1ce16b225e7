"""Search-QA: exact match, reply parsing, the environment, the built-in KB, user Search-R1 files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("bm25s")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from icsd_audit.envs import make_env  # noqa: E402
from icsd_audit.envs.searchqa import (  # noqa: E402
    SUBSETS,
    BM25Retriever,
    SearchQADataError,
    SearchQAEnv,
    builtin_kb,
    exact_match,
    format_passages,
    generate_kb,
    load_data,
    normalize_answer,
    parse_reply,
    read_qa_parquet,
    write_searchr1,
)
from icsd_audit.envs.searchqa.env import INVALID_MESSAGE, START_TEXT  # noqa: E402

# ----------------------------------------------------------------------------- exact match


@pytest.mark.parametrize("raw, norm", [
    ("The Beatles", "beatles"),                # article, case
    ("An apple a day", "apple day"),           # every article, as a whole word
    ("theatre", "theatre"),                    # 'the' inside a word stays
    ("Hello,   World!", "hello world"),        # punctuation deleted, spaces collapsed
    ("U.S.A.", "usa"),                         # dots deleted, not turned into spaces
    ("rock-n-roll", "rocknroll"),              # ASCII hyphen is punctuation
    ("1914\u20131918", "1914\u20131918"),      # en dash is not ASCII punctuation: kept (as Search-R1)
    ("\u201cYes\u201d", "\u201cyes\u201d"),    # curly quotes kept (as Search-R1)
    ("Beyonc\u00e9", "beyonc\u00e9"),          # accents kept
    ("\u00c9COLE", "\u00e9cole"),              # Unicode lower-casing
    ("New\u00a0York", "new york"),             # no-break space is whitespace
    ("the  a an", ""),                         # nothing but articles
    ("  Paris  ", "paris"),
])
def test_normalize_answer_hand_worked(raw, norm):
    assert normalize_answer(raw) == norm


def test_exact_match_any_gold_answer():
    assert exact_match("the Paris", ["Lyon", "paris"])
    assert exact_match("Paris.", "PARIS")
    assert not exact_match("Paris, France", ["Paris"])  # exact, not substring
    assert not exact_match("Beyonce", ["Beyonc\u00e9"])  # no accent folding
    assert exact_match("usa", ["U.S.A."]) and exact_match("U S A", ["u s a"])
    assert not exact_match("", ["x"]) and exact_match("", ["The"])  # both normalise to ''


def test_parse_reply_follows_search_r1():
    assert parse_reply("<think>hm</think><search> capital of\n France</search>", require_think=True).action == \
        "<search> capital of France </search>"
    p = parse_reply("<think>ok</think> <answer> Paris </answer> <search>x</search>", require_think=True)
    assert p.valid and p.action == "<answer> Paris </answer>"  # the first block wins
    assert parse_reply("<search>x</search><think>late</think>", require_think=True).reason == "no_think_tag"
    assert parse_reply("<search>x</search>").valid  # think not required
    assert parse_reply("<action>search[x]</action>").reason == "no_action_tag"
    # an empty block is a valid (empty) answer: postprocess_predictions matches it with content ''
    # and execute_predictions gives valid_action 1 (generation.py lines 422-430, 384-388)
    p = parse_reply("<answer>   </answer>")
    assert p.valid and p.action == "<answer>  </answer>"
    assert parse_reply("<search>x</answer>").reason == "no_action_tag"  # tags must pair


# ----------------------------------------------------------------------------- the environment


def test_episode_search_then_answer():
    env = SearchQAEnv("eval", max_steps=4)
    obs = env.reset(0)
    item = env.item
    assert obs.text == START_TEXT and obs.instruction == item.question and obs.available_actions == ()
    assert obs.meta["data_source"] == item.data_source == "nq"
    r = env.step(f"search[{item.hops[0][0]}]")
    assert r.info["valid_action"] and not r.done and r.reward == 0.0
    assert r.observation.text.startswith("<information>Doc 1(Title: ") and r.observation.text.endswith("</information>")
    assert item.hops[0][1] in r.info["doc_ids"] and len(r.info["doc_ids"]) == 3
    r = env.step(parse_reply(f"<think>found it</think><answer>{item.golden_answers[0].upper()}.</answer>").action)
    assert r.done and r.reward == 1.0 and r.info["won"] and r.info["score"] == 1.0 and r.info["valid_action"]
    with pytest.raises(RuntimeError):
        env.step("answer[x]")


def test_invalid_actions_wrong_answers_and_turn_budget():
    env = SearchQAEnv("eval", max_steps=3)
    env.reset(1)
    r = env.step("click[buy now]")
    assert not r.info["valid_action"] and r.observation.text == INVALID_MESSAGE and not r.done
    r = env.step("")
    assert not r.info["valid_action"] and not r.done
    r = env.step("<search>  anything </search>")  # the final-answer turn: the search is not run
    assert r.info["valid_action"] and r.done and r.info["truncated"] and r.reward == 0.0 and not r.info["won"]
    assert r.observation.text == "" and "doc_ids" not in r.info
    env.reset(1)
    r = env.step("answer[certainly not the answer]")
    assert r.done and r.reward == 0.0 and not r.info["won"] and r.info["valid_action"]


def test_eval_split_interleaves_subsets_and_groups_use_paper_columns():
    env = make_env("searchqa", split="eval", max_steps=4)
    assert isinstance(env, SearchQAEnv) and env.num_tasks == 7 * 125
    assert [t.data_source for t in env.tasks[:14]] == list(SUBSETS) * 2
    assert [env.task_group(i) for i in range(7)] == ["NQ", "Triv", "Pop", "Hotp", "2Wk", "MuS", "Bam"]
    train = SearchQAEnv("train")
    assert {t.data_source for t in train.tasks} == {"nq", "hotpotqa"}  # Search-R1 trains on NQ + HotpotQA


# ----------------------------------------------------------------------------- the built-in KB


def test_builtin_kb_is_seeded_labelled_and_split_cleanly():
    kb = builtin_kb()
    again = generate_kb(0)
    assert kb.passages == again.passages and kb.splits == again.splits
    assert generate_kb(1).passages != kb.passages
    assert kb.info["synthetic"] is True
    test, train = kb.splits["test"], kb.splits["train"]
    assert {s: sum(t.data_source == s for t in test) for s in SUBSETS} == {s: 125 for s in SUBSETS}
    assert not {t.question for t in test} & {t.question for t in train}
    assert len({t.question for t in test + train}) == len(test) + len(train)
    assert len({p["id"] for p in kb.passages}) == len(kb.passages)
    # hop counts follow the styles: single-hop for NQ/TriviaQA/PopQA, multi-hop for the rest
    hops = {s: {len(t.hops) for t in test if t.data_source == s} for s in SUBSETS}
    assert hops["nq"] == hops["triviaqa"] == hops["popqa"] == {1}
    assert min(min(hops[s]) for s in ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle")) >= 2
    assert max(hops["musique"]) >= 3


def test_every_builtin_question_is_answerable_by_oracle_queries():
    """Every hop's passage comes back in the top 3 for the hop's oracle query (the entity's
    name), and the answer passage contains a gold answer, for all 2,475 questions."""
    kb = builtin_kb()
    ret = load_data().retriever
    text = {p["id"]: p["contents"] for p in kb.passages}
    n = 0
    for item in kb.splits["train"] + kb.splits["test"]:
        for query, pid in item.hops:
            assert pid in [d["id"] for d in ret.search([query], 3)[0]], (item.question, query)
            n += 1
        body = normalize_answer(text[item.answer_passage])
        assert any(normalize_answer(a) in body for a in item.golden_answers), item
    assert n > 4000


def test_oracle_policy_scores_em_one_through_the_env():
    env = SearchQAEnv("eval", max_steps=5)
    for task in range(0, env.num_tasks, 25):
        env.reset(task)
        item = env.item
        seen = ""
        for query, _ in item.hops:
            seen += env.step(f"search[{query}]").observation.text
        assert any(normalize_answer(a) in normalize_answer(seen) for a in item.golden_answers)
        assert env.step(f"answer[{item.golden_answers[0]}]").reward == 1.0


# ----------------------------------------------------------------------------- user files


def _user_files(tmp: Path) -> tuple[Path, Path, Path]:
    corpus = tmp / "corpus.jsonl"
    docs = [
        {"id": "d0", "contents": '"Zorbland"\nZorbland is a republic whose capital city is Quexville.'},
        {"id": "d1", "contents": '"Quexville"\nQuexville lies on the river Ymm and has 40,000 inhabitants.'},
        {"id": "d2", "contents": '"Ymm"\nThe Ymm is a river of Zorbland, 310 km long.'},
        {"id": "d3", "contents": '"Mount Plaff"\nMount Plaff is the highest peak of Zorbland.'},
    ]
    corpus.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    train, test = tmp / "train.parquet", tmp / "test.parquet"
    pq.write_table(pa.table({"question": ["what is the capital of zorbland?"], "golden_answers": [["Quexville"]],
                             "data_source": ["nq"]}), train)
    # Search-R1's processed layout: answers only under reward_model.ground_truth.target
    pq.write_table(pa.table({
        "id": ["t0", "t1"],
        "question": ["Which river flows through the capital of Zorbland?", "What is the highest peak of Zorbland?"],
        "data_source": ["hotpotqa", "strategyqa"],
        "reward_model": [{"style": "rule", "ground_truth": {"target": ["Ymm", "the Ymm river"]}},
                         {"style": "rule", "ground_truth": {"target": ["Mount Plaff"]}}],
    }), test)
    return corpus, train, test


def test_user_corpus_and_parquet_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path / "cache"))
    corpus, train, test = _user_files(tmp_path)
    data = load_data(str(corpus), f"{train},{test}")
    assert data.info["synthetic"] is False and data.info["retriever"]["kind"] == "bm25s"
    env = SearchQAEnv("eval", data=data)
    assert [t.id for t in env.tasks] == ["t0", "t1"]
    assert [env.task_group(i) for i in range(2)] == ["Hotp", "strategyqa"]  # unknown sources keep their name
    env.reset(0)
    r = env.step("search[capital of Zorbland]")
    assert r.info["doc_ids"][0] == "d0"
    assert r.observation.text.startswith('<information>Doc 1(Title: "Zorbland") Zorbland is a republic')
    assert env.step("search[Quexville river]").info["doc_ids"][0] == "d1"
    assert env.step("answer[The Ymm River]").reward == 1.0
    tr = SearchQAEnv("train", data=data)
    assert tr.num_tasks == 1 and tr.tasks[0].golden_answers == ("Quexville",)
    # the index was cached once; a second load reads it back and ranks the same
    cached = list((tmp_path / "cache" / "searchqa" / "bm25").iterdir())
    assert len(cached) == 1 and (cached[0] / "done.json").is_file()
    again = BM25Retriever.from_jsonl(corpus, progress=False)
    for q in ("capital of Zorbland", "river Ymm length", "highest peak", "nothing matches xyzzy"):
        assert again.search([q], 3) == data.retriever.search([q], 3)
    assert again.search(["nothing matches xyzzy"], 3) == [[]]


def test_bm25_ranks_like_a_hand_computed_lucene_bm25(tmp_path):
    """Scores equal Lucene BM25 (k1 0.9, b 0.4) worked out with plain Python."""
    import math

    from icsd_audit.envs.searchqa.retriever import B, K1, tokenize

    corpus, _, _ = _user_files(tmp_path)
    docs = [json.loads(line)["contents"] for line in corpus.read_text().splitlines()]
    ret = BM25Retriever.from_jsonl(corpus, cache_dir=tmp_path / "idx", progress=False)
    toks = [tokenize(d) for d in docs]
    avg = sum(map(len, toks)) / len(toks)
    query = "Zorbland river capital"
    want = []
    for t in toks:
        s = 0.0
        for q in tokenize(query):
            df = sum(q in u for u in toks)
            tf = t.count(q)
            if tf:
                idf = math.log(1 + (len(toks) - df + 0.5) / (df + 0.5))
                s += idf * tf / (tf + K1 * (1 - B + B * len(t) / avg))
        want.append(s)
    got = ret.scores(query)
    assert got.tolist() == pytest.approx(want, rel=1e-5)
    order = sorted(range(len(want)), key=lambda i: (-want[i], i))[:3]
    assert [d["id"] for d in ret.search([query], 3)[0]] == [f"d{i}" for i in order]


def test_builtin_export_reads_back_as_user_data(tmp_path, monkeypatch):
    monkeypatch.setenv("ICSD_CACHE", str(tmp_path / "cache"))
    corpus, train, test = write_searchr1(builtin_kb(), tmp_path / "kb")
    meta = json.loads(pq.read_schema(test).metadata[b"icsd"])
    assert meta["synthetic"] is True
    assert "reward_model" in pq.read_schema(test).names and "prompt" in pq.read_schema(test).names
    user = load_data(str(corpus), f"{train},{test}")
    builtin = load_data()
    assert [(t.question, t.golden_answers, t.data_source) for t in user.tasks("eval")] == \
        [(t.question, t.golden_answers, t.data_source) for t in builtin.tasks("eval")]
    for q in ("who directed the film", builtin.tasks("eval")[5].question):
        assert user.retriever.search([q], 3) == builtin.retriever.search([q], 3)
    with pytest.raises(FileExistsError):  # never replaces a file
        write_searchr1(builtin_kb(), tmp_path / "kb")


def test_format_passages_is_search_r1s():
    docs = [{"id": "1", "contents": '"T1"\nline one\nline two'}, {"id": "2", "contents": "no title line"}]
    assert format_passages(docs) == 'Doc 1(Title: "T1") line one\nline two\nDoc 2(Title: no title line) \n'


# ----------------------------------------------------------------------------- bad user files


def _err(fn, *args) -> str:
    with pytest.raises(SearchQADataError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_parquet_files_name_file_column_and_row(tmp_path):
    p = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["ok?"], "data_source": ["nq"]}), p)
    assert _err(read_qa_parquet, p) == f"{p}: column 'golden_answers': required column missing (golden_answers, " \
        "or Search-R1's reward_model.ground_truth.target; have: question, data_source)"
    pq.write_table(pa.table({"question": ["ok?", "fine?", ""], "golden_answers": [["a"], ["b"], ["c"]],
                             "data_source": ["nq"] * 3}), p)
    assert _err(read_qa_parquet, p) == f"{p}: column 'question', row 2: expected a non-empty question string, got ''"
    pq.write_table(pa.table({"question": ["ok?", "fine?"], "golden_answers": [["a"], []], "data_source": ["nq"] * 2}), p)
    assert _err(read_qa_parquet, p).startswith(f"{p}: column 'golden_answers', row 1: expected a non-empty list")
    pq.write_table(pa.table({"question": ["ok?"], "golden_answers": [["a"]]}), p)
    assert _err(read_qa_parquet, p).startswith(f"{p}: column 'data_source': required column missing")
    bad = tmp_path / "not.parquet"
    bad.write_text("question,answer\n")
    assert _err(read_qa_parquet, bad).startswith(f"{bad}: not a readable Parquet file")
    assert _err(read_qa_parquet, tmp_path / "missing.parquet") == f"{tmp_path / 'missing.parquet'}: no such file"


def test_bad_corpus_lines_name_file_field_and_line(tmp_path):
    c = tmp_path / "c.jsonl"
    c.write_text('{"id": 0, "contents": "\\"A\\"\\nok"}\n{"id": 1, "text": "x"}\n')
    assert _err(BM25Retriever.from_jsonl, c) == f"{c}: column 'contents', row 2: required field missing (have: id, text)"
    c.write_text('{"id": 0, "contents": "ok"}\n\n{"id": 2, "contents": "ok"\n')
    assert _err(BM25Retriever.from_jsonl, c).startswith(f"{c}, row 3: not a JSON object")
    c.write_text('{"id": 0, "contents": 5}\n')
    assert _err(BM25Retriever.from_jsonl, c) == f"{c}: column 'contents', row 1: expected a string, got int"
    c.write_text("\n")
    assert _err(BM25Retriever.from_jsonl, c) == f"{c}: the corpus holds no passages"


def test_cli_rejects_bad_user_files_with_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    corpus, train, _ = _user_files(tmp_path)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q?"], "golden_answers": [[1]], "data_source": ["nq"]}), bad)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "icsd_audit.cli", "train", "--env", "searchqa", "--model",
                           "tiny-random", "--steps", "1", "--out", str(out), "--set", f"searchqa_corpus={corpus}",
                           "--set", f"searchqa_data={train},{bad}"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "ICSD_CACHE": str(tmp_path / "cache"), "ICSD_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == f"error: {bad}: column 'golden_answers', row 0: expected a non-empty list of answer strings, got [1]"
    assert "Traceback" not in proc.stderr
    assert not (out / "config.json").exists() and not (out / "dumps").exists()


def test_kb_module_writes_search_r1_files(tmp_path, capsys):
    from icsd_audit.envs.searchqa.data import main

    main(["--out", str(tmp_path / "kb")])
    printed = capsys.readouterr().out.split()
    assert [Path(p).name for p in printed] == ["corpus.jsonl", "train.parquet", "test.parquet"]
    lines = (tmp_path / "kb" / "corpus.jsonl").read_text().splitlines()
    assert len(lines) == len(builtin_kb().passages) and json.loads(lines[0]) == builtin_kb().passages[0]
    test = pq.read_table(tmp_path / "kb" / "test.parquet")
    assert test.num_rows == 875 and test.column("data_source").to_pylist()[:1] == ["nq"]
    row = test.slice(0, 1).to_pylist()[0]
    assert row["reward_model"]["ground_truth"]["target"] == row["golden_answers"]
    assert row["prompt"][0]["content"].endswith(f"Question: {row['question']}\n")


def test_unwritable_cache_warns_and_still_searches(tmp_path, monkeypatch, capsys):
    corpus, _, _ = _user_files(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("ICSD_CACHE", str(blocker))
    ret = BM25Retriever.from_jsonl(corpus, progress=False)
    assert "warning: could not cache the BM25 index" in capsys.readouterr().err
    assert ret.search(["capital of Zorbland"], 1)[0][0]["id"] == "d0"
    assert load_data() is load_data(None, None, None, 0)  # one cached load however it is called

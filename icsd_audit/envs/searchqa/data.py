"""Search-R1's file formats: reading user QA files and corpora, writing the built-in KB.

* QA files are Parquet with one question per row: ``question`` (string),
  ``golden_answers`` (list of strings; Search-R1's processed files also carry them as
  ``reward_model.ground_truth.target``, used when ``golden_answers`` is absent) and
  ``data_source`` (the subset: ``nq``, ``hotpotqa``, ...). Other columns (``id``,
  ``prompt``, ``ability``, ``extra_info``) are ignored; ``id`` is kept when present.
* A corpus is JSON Lines, one passage per line: ``{"id": "...", "contents": "\\"Title\\"\\ntext"}``
  (the title is the first line of ``contents``, as in Search-R1's wiki-18 dump).

Bad files raise :class:`SearchQADataError`: one line naming the file, the column and
the row (1-based line number for JSONL, 0-based row index for Parquet, as ``DumpError``
counts rows).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from icsd_audit.dumps.reader import DumpError

from .kb import SUBSETS, KnowledgeBase, QAItem, builtin_kb

__all__ = ["SearchQADataError", "read_qa_parquet", "iter_corpus", "write_searchr1", "SEARCH_R1_PREFIX"]

#: Search-R1's ``make_prefix`` template ('base'), for the ``prompt`` column of written files.
SEARCH_R1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>. Question: {question}\n"
)


class SearchQADataError(DumpError):
    """Bad user data: a one-line message naming the file, the column and the row (as a dump error)."""


def _str_list(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def read_qa_parquet(path: str | Path) -> list[QAItem]:
    """The questions of one Search-R1 QA Parquet file (see the module docstring)."""
    from icsd_audit.parquet_io import read_table

    path = Path(path)
    if not path.is_file():
        raise SearchQADataError(path, "no such file")
    try:
        table = read_table(path)  # page checksums verified where the file has them
    except Exception as exc:  # pyarrow raises several types for non-Parquet input
        raise SearchQADataError(path, f"not a readable Parquet file ({' '.join(str(exc).split())})") from None
    names = table.schema.names
    for col in ("question", "data_source"):
        if col not in names:
            raise SearchQADataError(path, f"required column missing (have: {', '.join(names) or 'none'})", column=col)
    if "golden_answers" in names:
        answer_col, answers = "golden_answers", table.column("golden_answers").to_pylist()
    elif "reward_model" in names:
        answer_col = "reward_model"
        answers = [((rm or {}).get("ground_truth") or {}).get("target") if isinstance(rm, dict) else None
                   for rm in table.column("reward_model").to_pylist()]
    else:
        raise SearchQADataError(path, "required column missing (golden_answers, or Search-R1's "
                                      f"reward_model.ground_truth.target; have: {', '.join(names)})",
                                column="golden_answers")
    questions = table.column("question").to_pylist()
    sources = table.column("data_source").to_pylist()
    ids = table.column("id").to_pylist() if "id" in names else [None] * len(questions)
    if not questions:
        raise SearchQADataError(path, "the file holds no rows")
    items = []
    for r, (q, a, s, i) in enumerate(zip(questions, answers, sources, ids)):
        if not isinstance(q, str) or not q.strip():
            raise SearchQADataError(path, f"expected a non-empty question string, got {q!r}", column="question", row=r)
        gold = _str_list(a)
        if gold is None or not any(g.strip() for g in gold):
            raise SearchQADataError(path, f"expected a non-empty list of answer strings, got {a!r}", column=answer_col,
                                    row=r)
        if not isinstance(s, str) or not s.strip():
            raise SearchQADataError(path, f"expected a data source name such as 'nq', got {s!r}", column="data_source",
                                    row=r)
        items.append(QAItem(id=str(i) if i is not None else f"{path.stem}_{r}", question=q.strip(),
                            golden_answers=tuple(gold), data_source=s.strip()))
    return items


def iter_corpus(path: str | Path) -> Iterator[tuple[int, str, str]]:
    """(byte offset of the line, id, contents) for every passage of a Search-R1 JSONL corpus."""
    path = Path(path)
    if not path.is_file():
        raise SearchQADataError(path, "no such file")
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise SearchQADataError(path, f"not a JSON object ({exc.msg if hasattr(exc, 'msg') else exc})",
                                        row=lineno) from None
            if not isinstance(rec, dict):
                raise SearchQADataError(path, f"expected a JSON object, got {type(rec).__name__}", row=lineno)
            for col in ("id", "contents"):
                if col not in rec:
                    raise SearchQADataError(path, f"required field missing (have: {', '.join(rec) or 'none'})",
                                            column=col, row=lineno)
            contents = rec["contents"]
            if not isinstance(contents, str):
                raise SearchQADataError(path, f"expected a string, got {type(contents).__name__}", column="contents",
                                        row=lineno)
            yield start, str(rec["id"]), contents


def _atomic_write(path: Path, write) -> None:
    if path.exists():
        raise FileExistsError(f"{path} exists; choose another folder (icsd never replaces a file)")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        from icsd_audit.outputs import umask_mode

        umask_mode(tmp)  # mkstemp's 0600 is not what a plain new file gets
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_searchr1(kb: KnowledgeBase, out_dir: str | Path) -> list[Path]:
    """Write ``corpus.jsonl``, ``train.parquet`` and ``test.parquet`` in Search-R1's formats.

    The Parquet files carry Search-R1's processed columns (``data_source``, ``prompt``,
    ``ability``, ``reward_model``, ``extra_info``) plus ``id``, ``question`` and
    ``golden_answers``, and the KB's description (``synthetic: true``) in their schema
    metadata under ``icsd``.
    """
    import pyarrow as pa

    from icsd_audit.parquet_io import write_table

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    _atomic_write(corpus, lambda tmp: Path(tmp).write_text(
        "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in kb.passages), encoding="utf-8"))
    paths = [corpus]
    for split in ("train", "test"):
        items: Sequence[QAItem] = kb.splits[split]
        table = pa.table({
            "id": [it.id for it in items],
            "question": [it.question for it in items],
            "golden_answers": [list(it.golden_answers) for it in items],
            "data_source": [it.data_source for it in items],
            "prompt": [[{"role": "user", "content": SEARCH_R1_PREFIX.format(question=it.question)}] for it in items],
            "ability": ["fact-reasoning"] * len(items),
            "reward_model": [{"style": "rule", "ground_truth": {"target": list(it.golden_answers)}} for it in items],
            "extra_info": [{"split": split, "index": k} for k in range(len(items))],
        })
        table = table.replace_schema_metadata({"icsd": json.dumps({**kb.info, "subsets": list(SUBSETS)})})
        path = out / f"{split}.parquet"
        _atomic_write(path, lambda tmp, t=table: write_table(t, tmp))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """Write the built-in KB as corpus.jsonl, train.parquet and test.parquet (Search-R1 formats)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", required=True, help="Output folder (must not hold those files already).")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = write_searchr1(builtin_kb(args.seed), args.out)
    print("\n".join(str(p) for p in paths))


if __name__ == "__main__":  # pragma: no cover
    main()

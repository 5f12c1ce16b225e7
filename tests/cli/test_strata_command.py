"""``icsd audit strata`` (SPEC 11) on the shipped cpu-demo dumps against a hand computation.

The reference reads the dumps' own deployed ``g``, ``c``, ``delta``, ``u``, ``valid`` and the
covariate columns (float32) with pyarrow, cuts the edges with ``np.quantile`` and assigns
bins and sums token by token in plain Python loops; the audit recomputes the allocation
from the recorded settings (float64), so the two agree to the float32 storage of the dumps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from .test_outputs import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: the cpu-demo run's dumps, which carry the entropy column (examples/cpu-demo/README.md)
DUMPS = EXAMPLES / "cpu-demo" / "dumps"
EPS = 1e-4  # the run records eps = 1e-4


def without_entropy(src: Path, dst: Path) -> Path:
    """A copy of the dumps under ``src`` without the ``entropy`` column (as a run that did not record it writes them)."""
    for f in sorted(src.rglob("*.parquet")):
        t = pq.read_table(f)
        out = dst / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t.drop_columns(["entropy"]).replace_schema_metadata(t.schema.metadata), out)
    return dst


def _columns(dumps: Path = DUMPS, extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    files = sorted(dumps.rglob("*.parquet"))
    cols = ("g", "c", "delta", "u", "valid", "logp", "pos", "batch_id", "traj_id", "turn_id") + extra
    t = pa.concat_tables([pq.read_table(f, columns=list(cols)) for f in files])
    return {k: t.column(k).to_numpy(zero_copy_only=False) for k in cols}


def _hand(x_col: str, k: int | None, dumps: Path = DUMPS, top: float | None = None) -> list[dict[str, float | None]]:
    """Per bin: token share, mass shares and TCM of g and c, by loops over the valid tokens."""
    d = _columns(dumps, ("entropy",) if x_col == "entropy" else ())
    rows = [i for i in range(d["valid"].size) if d["valid"][i]]
    x = [float(d[x_col][i]) for i in rows]
    qs = [1 - top] if top is not None else [j / k for j in range(1, k)]
    edges = sorted(set(np.quantile(np.array(x), qs, method="linear").tolist()))
    nb = len(edges) + 1
    acc = [dict(n=0, g=0.0, c=0.0, tg=0.0, dg=0.0, tc=0.0, dc=0.0) for _ in range(nb)]
    tot_g = tot_c = 0.0
    for i, xi in zip(rows, x):
        b = sum(1 for e in edges if e <= xi)
        g, c, delta, u = (float(d[name][i]) for name in ("g", "c", "delta", "u"))
        a = acc[b]
        a["n"] += 1
        a["g"] += g
        a["c"] += c
        tot_g += g
        tot_c += c
        if delta > 0 and abs(u) > EPS:
            a["dg"] += g
            a["dc"] += c
            if u < 0:
                a["tg"] += g
                a["tc"] += c
    out = []
    for a in acc:
        out.append(dict(n=a["n"], token_share=a["n"] / len(rows), share_base=a["g"] / tot_g,
                        share_compare=a["c"] / tot_c,
                        tcm_base=a["tg"] / a["dg"] if a["dg"] > 0 else None,
                        tcm_compare=a["tc"] / a["dc"] if a["dc"] > 0 else None))
    return out, edges


@pytest.mark.parametrize("by,k,top,dumps", [("logp", 5, None, DUMPS), ("pos", 4, None, DUMPS),
                                            ("entropy", 5, None, DUMPS), ("entropy", None, 0.2, DUMPS)])
def test_strata_json_reproduces_the_hand_computation(by: str, k: int | None, top: float | None, dumps: Path) -> None:
    split = ("--bins", str(k)) if top is None else ("--top", str(top))
    res = cli("audit", "strata", str(dumps), "--by", by, *split, "--json", "--resamples", "200")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    want, edges = _hand(by, k, dumps, top)
    name = f"strata:{by}:K{k}" if top is None else f"strata:{by}:top{top}"
    assert got["by"] == by and got["statistic"] == name and got["edges"] == pytest.approx(edges)
    assert len(got["bins"]) == len(want) == len(edges) + 1
    for gb, wb in zip(got["bins"], want):
        assert set(gb) == {"lo", "hi", "tokens", "token_share", "share", "tcm"}
        assert gb["tokens"] == wb["n"]
        assert gb["token_share"]["estimate"] == pytest.approx(wb["token_share"], abs=1e-12)
        for side in ("base", "compare"):
            assert gb["share"][side]["estimate"] == pytest.approx(wb[f"share_{side}"], abs=1e-6)
            if wb[f"tcm_{side}"] is None:
                assert gb["tcm"][side] == {"estimate": None, "ci_low": None, "ci_high": None}
            else:
                assert gb["tcm"][side]["estimate"] == pytest.approx(wb[f"tcm_{side}"], abs=1e-6)
                assert gb["tcm"][side]["ci_low"] <= gb["tcm"][side]["estimate"] <= gb["tcm"][side]["ci_high"]
        d = gb["share"]["diff"]["estimate"]
        assert d == pytest.approx(wb["share_compare"] - wb["share_base"], abs=1e-6)
        assert set(gb["share"]["diff"]) == {"estimate", "ci_low", "ci_high"}
    # shares are shares
    assert sum(b["share"]["base"]["estimate"] for b in got["bins"]) == pytest.approx(1.0, abs=1e-12)
    assert sum(b["token_share"]["estimate"] for b in got["bins"]) == pytest.approx(1.0, abs=1e-12)


def test_strata_table_says_why_a_bin_has_no_tcm() -> None:
    """The top log-prob fifth of cpu-demo has no active token (hand computation): the table says n/a and why."""
    want, _ = _hand("logp", 5)
    empty = [i for i, b in enumerate(want) if b["tcm_base"] is None]
    res = cli("audit", "strata", str(DUMPS), "--by", "logp", "--bins", "5", "--resamples", "100")
    assert res.returncode == 0, res.stderr
    for i in empty:
        assert f"n/a: TCM of bin {i} " in res.stdout
    assert ("n/a" in res.stdout) == bool(empty)


def test_entropy_on_dumps_without_the_column_is_one_line(tmp_path: Path) -> None:
    plain = without_entropy(DUMPS, tmp_path / "plain")
    res = cli("audit", "strata", str(plain), "--by", "entropy", "--json", "--resamples", "20")
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "'entropy' column" in lines[0] and "3 of 3 input file(s) lack" in lines[0]
    for f in sorted(plain.rglob("*.parquet")):
        assert str(f) in lines[0]


def _with_entropy(src: Path, dst: Path, values: np.ndarray | None = None) -> Path:
    t = pq.read_table(src)
    n = t.num_rows
    h = np.linspace(0.0, 3.0, n).astype(np.float32) if values is None else values.astype(np.float32)
    meta = t.schema.metadata
    t = t.drop_columns([c for c in ("entropy",) if c in t.column_names])
    t = t.append_column("entropy", pa.array(h)).replace_schema_metadata(meta)
    pq.write_table(t, dst)
    return dst


def test_entropy_in_some_files_only_names_the_others(tmp_path: Path) -> None:
    files = sorted(DUMPS.rglob("*.parquet"))
    d = tmp_path / "mixed"
    d.mkdir()
    _with_entropy(files[0], d / "a.parquet")
    pq.write_table(pq.read_table(files[1]).drop_columns(["entropy"]), d / "b.parquet")
    res = cli("audit", "strata", str(d), "--by", "entropy", "--resamples", "20")
    assert res.returncode == 2
    assert "1 of 2 input file(s) lack" in res.stderr and str(d / "b.parquet") in res.stderr
    assert str(d / "a.parquet") not in res.stderr


def test_entropy_nan_names_file_column_and_row(tmp_path: Path) -> None:
    files = sorted(DUMPS.rglob("*.parquet"))
    n = pq.read_metadata(files[0]).num_rows
    h = np.linspace(0.0, 3.0, n)
    h[17] = np.nan
    f = _with_entropy(files[0], tmp_path / "a.parquet", h)
    res = cli("audit", "strata", str(f), "--by", "entropy", "--resamples", "20")
    assert res.returncode == 2 and res.stderr.strip() == f"error: {f}: column 'entropy', row 17: NaN value"


def test_entropy_strata_run_and_top_splits_at_the_quantile(tmp_path: Path) -> None:
    files = sorted(DUMPS.rglob("*.parquet"))
    f = _with_entropy(files[0], tmp_path / "a.parquet")
    res = cli("audit", "strata", str(f), "--by", "entropy", "--top", "0.2", "--json", "--resamples", "50")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    t = pq.read_table(f)
    h = t.column("entropy").to_numpy().astype(np.float64)[t.column("valid").to_numpy(zero_copy_only=False)]
    edge = float(np.quantile(h, 0.8))
    assert got["statistic"] == "strata:entropy:top0.2" and got["edges"] == [edge]
    assert [b["tokens"] for b in got["bins"]] == [int((h < edge).sum()), int((h >= edge).sum())]


def test_bad_options_are_one_line() -> None:
    for args, want in ((("--by", "logp", "--bins", "3", "--top", "0.2"), "give --bins K or --top q, not both"),
                       (("--by", "length"), "--by must be one of entropy, logp, pos, abs_delta"),
                       (("--by", "logp", "--top", "1.5"), "--top"), (("--by", "logp", "--bins", "0"), "--bins")):
        res = cli("audit", "strata", str(DUMPS), *args)
        assert res.returncode == 2 and want in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_negative_entropy_is_refused_by_the_reader(tmp_path: Path) -> None:
    files = sorted(DUMPS.rglob("*.parquet"))
    n = pq.read_metadata(files[0]).num_rows
    h = np.linspace(0.0, 3.0, n)
    h[5] = -0.25
    f = _with_entropy(files[0], tmp_path / "a.parquet", h)
    res = cli("audit", "strata", str(f), "--by", "entropy", "--resamples", "20")
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {f}: column 'entropy', row 5: negative value (an entropy)"


def test_first_pass_reads_each_files_valid_values_in_order(tmp_path):
    """The edges' sample (the covariate of every valid token, input order) against the checked batches' own values,
    with every seventh row marked invalid and the middle file of three storing ``logp`` as float64 (the float32 values
    read before it widened exactly, those after it cast up)."""
    from icsd_audit.audit.strata import collect_covariate
    from icsd_audit.dumps.reader import DumpReader

    files = sorted(DUMPS.rglob("*.parquet"))
    for i, f in enumerate(files):
        t = pq.read_table(f)
        j = t.schema.get_field_index("valid")
        t = t.set_column(j, t.schema.field("valid"), pa.array(np.arange(t.num_rows) % 7 != 3))
        if i == 1:  # float32, then float64 (the values so far widened), then float32 again (cast up)
            j = t.schema.get_field_index("logp")
            t = t.set_column(j, pa.field("logp", pa.float64()), t.column("logp").cast(pa.float64()))
        out = tmp_path / f.relative_to(DUMPS)
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t.replace_schema_metadata(pq.read_table(f).schema.metadata), out)
    reader = DumpReader([tmp_path], columns=[])
    for by, col in (("logp", "logp"), ("abs_delta", "delta"), ("pos", "pos"), ("entropy", "entropy")):
        want = []
        for b in DumpReader([tmp_path], columns=["logp", "entropy"]):
            v = b.tokens.columns[col] if col in b.tokens.columns else getattr(b.tokens, col)
            want.append(np.abs(v) if by == "abs_delta" else v)
        valid = np.concatenate([b.tokens.valid for b in DumpReader([tmp_path], columns=[])])
        assert not valid.all()  # some rows are left out
        ref = np.concatenate(want)[valid].astype(np.float64)
        for workers in (1, 2):
            got = collect_covariate(reader, by, workers=workers)
            assert got.dtype == {"logp": np.float64, "pos": np.int32}.get(by, np.float32)
            assert np.array_equal(got.astype(np.float64), ref), (by, workers)

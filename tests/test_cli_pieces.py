"""``fastanneal cluster --backend dask`` out of core: the checks, the labelling and the
writing run on the Dask workers (``fastanneal._cli_pieces``); the client holds no per-row
array of the log. The pieces it is built from -- mergeable cluster summaries, 64-bit id
keys, the adjusted Rand index from contingency counts -- are tested against their
sequential / in-memory definitions."""
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from fastanneal import _cli_pieces, _cli_stream
from fastanneal._cli_results import (ClusterSummary, adjusted_rand_index,
                                     adjusted_rand_index_from_counts)
from fastanneal.cli import main
from test_stream import make_log


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# --------------------------------------------------------------------------- the pieces
def _summary_inputs(seed, n=1200, K=6):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, K, n)
    cos = np.round(rng.uniform(0.2, 1.0, n), 2)           # many ties across parts
    prob = np.round(rng.uniform(0.3, 1.0, n), 2)
    margin = rng.uniform(0, 1, n)
    ru = (labels + 1) % K
    w = rng.integers(1, 4, n).astype(float)
    pool = [f"{a} {b}" for a in ("pin", "card", "rain", "song", "map") for b in ("now", "help")]
    texts = [None if i % 41 == 0 else pool[rng.integers(len(pool))] for i in range(n)]
    ids = [f"id{i}" for i in range(n)]
    return K, n, (labels, prob, margin, ru, cos, w, texts, ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_summaries_equal_one_pass_in_row_order(seed):
    """Summaries of disjoint row ranges, merged in any order (as the workers' tree does),
    equal the summary of one pass over the rows in order: sizes, central rows and ids,
    representative queries, c-TF-IDF labels, ambiguous rows; weights and cohesion up to
    the order of the additions."""
    K, n, cols = _summary_inputs(seed)
    rng = np.random.default_rng(100 + seed)

    def part(a, b):
        s = ClusterSummary(K, n, n_representatives=3, with_ids=True, n_ambiguous=25)
        s.add(a, *[c[a:b] for c in cols])
        return s
    ref = part(0, n)
    cuts = sorted({0, n, *rng.integers(1, n, 9).tolist()})
    parts = [part(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    rng.shuffle(parts)
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p)
    t, r = merged.table().to_pydict(), ref.table().to_pydict()
    for name in r:
        if name in ("weight", "share", "cohesion"):
            np.testing.assert_allclose(t[name], r[name], rtol=1e-12)
        else:
            assert t[name] == r[name], name
    assert merged.ambiguous_rows(np.arange(K)) == ref.ambiguous_rows(np.arange(K))
    for a, b in zip(merged.terms.per_class, ref.terms.per_class):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([a[k] for k in b], [b[k] for k in b], rtol=1e-12)


def test_merge_refuses_other_labellings():
    a, b = ClusterSummary(3, 10), ClusterSummary(4, 10)
    with pytest.raises(ValueError, match="different"):
        a.merge(b)


def test_ari_from_counts_equals_ari_of_the_labels():
    rng = np.random.default_rng(5)
    for n, ka, kb in ((500, 4, 6), (50, 1, 3), (300, 12, 12)):
        a = rng.integers(0, ka, n)
        b = rng.integers(0, kb, n)
        b[: n // 2] = a[: n // 2]                    # some agreement
        truth = [None if v == 0 else f"t{v}" for v in a]   # strings and missing values
        pairs = {}
        for t, lab in zip(truth, b.tolist()):
            pairs[(t, lab)] = pairs.get((t, lab), 0) + 1
        assert adjusted_rand_index_from_counts(pairs) == pytest.approx(
            adjusted_rand_index(a, b), abs=1e-12)


def test_id_keys_equal_ids_equal_keys():
    """Equal ids give equal keys in every Arrow layout (sliced arrays, large strings,
    dictionary-encoded, binary); integers are their own key; distinct ids of a realistic
    set do not collide."""
    ids = [f"q{i:07d}" for i in range(20000)] + ["", "é", "q0000001"]
    s = pa.array(ids)
    k = _cli_pieces.id_keys(s)
    assert k.dtype == np.uint64
    assert k[-1] == k[1] and k[-3] != k[-2]
    assert np.unique(k[:20000]).shape[0] == 20000
    np.testing.assert_array_equal(_cli_pieces.id_keys(s.slice(5, 100)), k[5:105])
    np.testing.assert_array_equal(_cli_pieces.id_keys(pa.array(ids, pa.large_string())), k)
    np.testing.assert_array_equal(_cli_pieces.id_keys(s.dictionary_encode()), k)
    np.testing.assert_array_equal(
        _cli_pieces.id_keys(pa.array([x.encode() for x in ids], pa.binary())), k)
    np.testing.assert_array_equal(
        _cli_pieces.id_keys(pa.chunked_array([s.slice(0, 7), s.slice(7)])), k)
    ints = pa.array([3, -1, 2 ** 40], pa.int64())
    np.testing.assert_array_equal(_cli_pieces.id_keys(ints).view(np.int64), [3, -1, 2 ** 40])
    f = _cli_pieces.id_keys(pa.array([1.5, 2.5, 1.5]))
    assert f[0] == f[2] != f[1]


# --------------------------------------------------------------------------- the checks
@pytest.fixture(scope="module")
def inproc_client():
    """A cluster whose workers are threads of this process (monkeypatches reach them)."""
    from distributed import Client, LocalCluster
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                           dashboard_address=None,
                           scheduler_kwargs={"dashboard_address": "127.0.0.1:0"})
    with cluster, Client(cluster) as client:
        yield client


class _Args:
    def __init__(self, **kw):
        self.embedding_column = "emb"
        self.weight_column = "count"
        self.id_column = "id"
        self.text_column = "query"
        self.truth_column = None
        self.__dict__.update(kw)


@pytest.mark.dask
def test_check_log_compares_colliding_ids_exactly(tmp_path, inproc_client, monkeypatch):
    """Repeated keys come back from the workers' merge tree; the ids behind them are then
    compared exactly: with every id hashed to the same key a log of unique ids passes, and
    a real repeat is named with both rows, as the in-memory check does."""
    p = tmp_path / "log.parquet"
    make_log(p, n=900, row_group=100)
    args = _Args()
    log = _cli_stream.ParquetLog(p, args)
    live, weight = _cli_pieces.check_log(log, args, inproc_client)
    t = pq.read_table(p)
    assert live == 900 and weight == pytest.approx(float(pc_sum(t, "count")))
    calls = []

    def one_key(col):
        calls.append(len(col))
        return np.zeros(len(col), dtype=np.uint64)
    monkeypatch.setattr(_cli_pieces, "id_keys", one_key)
    assert _cli_pieces.check_log(log, args, inproc_client)[0] == 900    # collisions only
    assert sum(calls) >= 2 * 900                      # keys, then the exact comparison
    ids = t.column("id").to_pylist()
    ids[777] = ids[123]
    pq.write_table(t.set_column(0, "id", pa.array(ids)), p, row_group_size=100)
    log = _cli_stream.ParquetLog(p, args)
    with pytest.raises(_cli_pieces.InputError, match=r"duplicate id 'r000123' in column 'id' "
                       r"\(rows 124 and 778\)"):
        _cli_pieces.check_log(log, args, inproc_client)


def pc_sum(t, name):
    return t.column(name).to_numpy().sum()


# --------------------------------------------------------------------------- the command
def _common(p, *extra):
    """The command on the test log, out of core (a later ``--memory-limit`` in ``extra``
    wins)."""
    return ["cluster", p, "--embedding-column", "emb", "--id-column", "id", "--weight-column",
            "count", "--text-column", "query", "--truth-column", "topic", "--k", 6,
            "--memory-limit", "1K", *extra]


@pytest.mark.dask
def test_out_of_core_on_dask_the_client_reads_no_rows(tmp_path, capsys, monkeypatch):
    """With ``--backend dask`` out of core this process reads no per-row column of the log
    (no ids, weights, texts, truth or embeddings), labels and writes no row itself (the
    worker processes do), and the outputs equal the in-process out-of-core route's: the
    same rows and columns bit for bit, the same cluster table, report rows and ARI."""
    p = tmp_path / "log.parquet"
    X, lab, t = make_log(p, n=2400, row_group=300)
    rc, out_local, err = _run(capsys, *_common(p, "-o", tmp_path / "local.parquet",
                                               "--report", tmp_path / "local.html"))
    assert rc == 0, err

    def barred(*a, **k):
        raise AssertionError("the client read rows of the log")
    for name in ("embeddings", "small_table", "blocks", "write", "_batches", "_tables"):
        monkeypatch.setattr(_cli_stream.ParquetLog, name, barred)
    monkeypatch.setattr(_cli_stream.LogPiece, "batches", barred)   # the workers' own copy
    from distributed import LocalCluster
    # a scheduler of its own, as `dask scheduler` would be: the command's client is not
    # the default client of this process
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None,
                      scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}) as cluster:
        rc, out_dask, err = _run(capsys, *_common(
            p, "-o", tmp_path / "dask.parquet", "--report", tmp_path / "dask.html",
            "--backend", "dask", "--scheduler", cluster.scheduler_address))
    assert rc == 0, err
    assert "8 chunks" in err and "check, label and write" in err, err
    a, b = pq.read_table(tmp_path / "local.parquet"), pq.read_table(tmp_path / "dask.parquet")
    assert a.column_names == b.column_names == t.column_names + [
        "cluster", "probability", "margin", "runner_up"]
    assert b.equals(a)
    assert adjusted_rand_index(lab, b.column("cluster").to_numpy()) == pytest.approx(1.0)
    ca = pacsv.read_csv(tmp_path / "local.clusters.csv")
    cb = pacsv.read_csv(tmp_path / "dask.clusters.csv")
    for name in ca.column_names:
        if name in ("weight", "share", "cohesion"):
            np.testing.assert_allclose(cb.column(name).to_numpy(), ca.column(name).to_numpy(),
                                       rtol=1e-12)
        else:
            assert cb.column(name).to_pylist() == ca.column(name).to_pylist(), name
    ari = [ln for ln in out_local.splitlines() if ln.startswith("ARI")]
    assert ari and ari == [ln for ln in out_dask.splitlines() if ln.startswith("ARI")]
    def ambiguous_table(html):
        i = html.index('<table id="ambiguous"')
        return html[i:html.index("</table>", i)]
    amb = ambiguous_table((tmp_path / "local.html").read_text())
    assert amb.count("<tr") > 10
    assert ambiguous_table((tmp_path / "dask.html").read_text()) == amb
    # no part file or temporary folder is left next to the output
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        ["log.parquet", "local.parquet", "local.clusters.csv", "local.html",
         "dask.parquet", "dask.clusters.csv", "dask.html"])


def _broken(t, what):
    if what == "duplicate id":
        ids = t.column("id").to_pylist()
        ids[2100] = ids[7]
        return t.set_column(0, "id", pa.array(ids)), "duplicate id 'r000007'"
    if what == "missing id":
        ids = t.column("id").to_pylist()
        ids[1500] = None
        return t.set_column(0, "id", pa.array(ids, pa.string())), "missing value at row 1501"
    w = t.column("count").to_numpy().astype(float)
    if what == "negative weight":
        w[1234] = -1.0
        msg = "invalid weight -1.0 at row 1235"
    else:
        w[:] = 0.0
        msg = "sums to zero"
    return t.set_column(2, "count", pa.array(w)), msg


@pytest.mark.dask
def test_out_of_core_on_dask_bad_input_is_the_same_one_line(tmp_path, capsys):
    """Bad ids and weights found by the workers give the in-process route's one-line
    error (exit 2, rows of the whole log) and leave no output behind."""
    from distributed import LocalCluster
    p0 = tmp_path / "ok.parquet"
    _, _, t = make_log(p0, n=2400, row_group=300)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None,
                      scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}) as cluster:
        for what in ("duplicate id", "missing id", "negative weight", "zero weights"):
            bad, msg = _broken(t, what)
            p = tmp_path / f"{what.replace(' ', '_')}.parquet"
            pq.write_table(bad, p, row_group_size=300)
            errs = []
            # in memory (the whole columns checked at once), out of core in this process,
            # out of core on the workers
            for extra in (["--memory-limit", "1G"], [],
                          ["--backend", "dask", "--scheduler", cluster.scheduler_address]):
                out = tmp_path / f"out_{len(extra)}.parquet"
                rc, _, err = _run(capsys, *_common(p, "-o", out, "-q", *extra))
                assert rc == 2 and not out.exists(), (what, err)
                errs.append(err.strip().splitlines()[-1])
            assert errs[0] == errs[1] == errs[2] and msg in errs[0], (what, errs)
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]


def test_out_of_core_in_process_holds_no_column_of_the_whole_log(tmp_path, capsys,
                                                                  monkeypatch):
    """In process too, the out-of-core route checks, labels and writes one row group at a
    time: the whole-log small table is never read, and every check and labelling call sees
    at most one row group's rows; the result equals the in-memory route's partition."""
    p = tmp_path / "log.parquet"
    _, lab, t = make_log(p, n=2400, row_group=300)

    def barred(*a, **k):
        raise AssertionError("the out-of-core route read a whole-log column")
    monkeypatch.setattr(_cli_stream.ParquetLog, "small_table", barred)
    seen = []
    for name in ("weight_vector", "check_ids", "text_list"):
        real = getattr(_cli_pieces, name)

        def spy(table, *a, _real=real, **k):
            seen.append(table.num_rows)
            return _real(table, *a, **k)
        monkeypatch.setattr(_cli_pieces, name, spy)
    rc, out, err = _run(capsys, *_common(p, "-o", tmp_path / "o.parquet"))
    assert rc == 0, err
    assert seen and max(seen) <= 300 and sum(seen) >= 3 * 2400, (len(seen), max(seen))
    o = pq.read_table(tmp_path / "o.parquet")
    assert o.column("id").to_pylist() == t.column("id").to_pylist()
    assert adjusted_rand_index(lab, o.column("cluster").to_numpy()) == pytest.approx(1.0)
    assert "ARI against 'topic': 1.000" in out


def test_tokenizer_cache_is_shared_by_the_term_counts_of_a_process(monkeypatch):
    """Every row group's summary has term counts of its own; the texts they tokenize are
    remembered across them (query logs repeat): a second TermCounts tokenizes nothing it
    has seen, and pickling ships the counts, not the cache."""
    import pickle

    from fastanneal import labels
    calls = []
    real = labels.tokenize
    monkeypatch.setattr(labels, "tokenize", lambda text: calls.append(text) or real(text))
    texts = [f"zq{i} pizza order" for i in range(50)]
    a = labels.TermCounts(2)
    a.add(texts, np.arange(50) % 2)
    assert len(calls) == 50
    b = labels.TermCounts(2)
    b.add(texts, np.arange(50) % 2)
    assert len(calls) == 50 and b.per_class == a.per_class
    c = pickle.loads(pickle.dumps(a))
    assert "_cache" not in pickle.loads(pickle.dumps(a)).__getstate__()
    assert c.per_class == a.per_class
    c.add(texts[:3], [0, 1, 0])
    assert len(calls) == 50


# --------------------------------------------------------------------------- memory
def test_in_memory_log_hands_arrow_decoding_buffers_back(tmp_path, monkeypatch):
    """The in-memory route reads the embeddings into one matrix and the small columns into
    a table; afterwards Arrow's allocator must hand its decoding buffers back (it keeps
    freed pages otherwise, ~0.1 GiB through the fit and the labelling of a 1-million-row
    log: BENCHMARKS.md section 16). Checked with a spy on the pool: the last release comes
    after the last block was decoded, for both reads; and the matrix is the column."""
    p = tmp_path / "log.parquet"
    make_log(p, n=900, row_group=100)
    args = _Args()
    log = _cli_stream.ParquetLog(p, args)
    events = []
    real = pa.default_memory_pool()

    class Pool:
        def release_unused(self):
            events.append("release")
            real.release_unused()

        def __getattr__(self, name):
            return getattr(real, name)
    monkeypatch.setattr(pa, "default_memory_pool", lambda: Pool())
    orig_block = _cli_stream.ParquetLog._block

    def block(self, table, row0):
        events.append("block")
        return orig_block(self, table, row0)
    monkeypatch.setattr(_cli_stream.ParquetLog, "_block", block)
    X = log.embeddings()
    assert events.count("block") >= 9 and events[-1] == "release"
    t = pq.read_table(p)
    np.testing.assert_array_equal(
        X, np.asarray(t.column("emb").combine_chunks().flatten()).reshape(900, -1))
    events.clear()
    small = log.small_table(with_text=True)
    assert events == ["release"]
    assert small.column("query").to_pylist() == t.column("query").to_pylist()


def test_term_counts_share_one_string_per_ngram():
    """The tokenizer's cache holds every distinct n-gram once (interned), shared by the
    cached texts and the per-cluster counts: a query log repeats its words, and a copy per
    text made the cache of 200,000 texts ~2x larger. The counts are those of the texts."""
    from collections import Counter

    from fastanneal.labels import TermCounts, tokenize
    texts = [f"pay {w} bill {i}" for i, w in enumerate(["card", "phone", "card"] * 50)]
    labels = np.arange(len(texts)) % 3
    tc = TermCounts(3)
    tc.add(texts, labels)
    a, b = tc._cache[texts[0]][0], tc._cache[texts[1]][0]     # (grams, distinct bigrams)
    assert a[0] == b[0] == "pay" and a[0] is b[0]              # one object for "pay"
    bi = [g for g in a if g == "pay card"][0]                # texts 0 and 2 share it
    assert bi is [g for g in tc._cache[texts[2]][0] if g == "pay card"][0]
    assert bi is tc._cache[texts[0]][1][0]                   # ... and the bigram list
    for k in range(3):                                        # the counts themselves
        want = Counter()
        for t, lab in zip(texts, labels):
            if lab == k:
                toks = tokenize(t)
                want.update(toks)
                want.update(" ".join(toks[i:i + 2]) for i in range(len(toks) - 1))
        assert tc.per_class[k] == want


def test_pieces_and_paths_travel_without_their_files(tmp_path, monkeypatch):
    """A LogPiece held a pyarrow fragment, which opens its file when pickled again: the Dask
    scheduler (it re-pickles each task) had to see the data, and where it could not the tasks
    failed to serialize and the user's workers shut down. Relative paths (the log, the Dask
    route's Parquet files) were read from the workers' own working directories."""
    import os
    import pickle
    from types import SimpleNamespace

    from fastanneal._parquet import ParquetDataset
    from fastanneal.dask._inputs import _parquet_files
    (tmp_path / "in" / "k=1").mkdir(parents=True)
    X, _, t = make_log(tmp_path / "in" / "k=1" / "a.parquet", n=400, row_group=100)
    monkeypatch.chdir(tmp_path)
    log = SimpleNamespace(data=ParquetDataset("in"), path="in", dim=16, dtype=np.float32,
                          args=SimpleNamespace(embedding_column="emb"))
    piece = _cli_stream.LogPiece(log, 2)
    assert os.path.isabs(piece.path)
    blob = pickle.dumps(piece)
    os.rename("in", "elsewhere")                         # the scheduler cannot see the file
    again = pickle.dumps(pickle.loads(blob))             # what the scheduler does
    os.rename("elsewhere", "in")
    got = pickle.loads(again)
    rows = pa.concat_tables([b for _, b in got.batches(["emb", "id", "k"])])
    assert rows.column("id").to_pylist() == t.column("id").to_pylist()[200:300]
    assert rows.column("k").to_pylist() == [1] * 100     # the hive partition's value
    assert all(os.path.isabs(f) for f in _parquet_files("in"))

"""Logs larger than memory: the in-process Parquet stream (``open_parquet``) that
``MiniBatchAnnealedKMeans`` anneals over, the block-by-block cluster summary, and the
``fastanneal cluster`` routes for Parquet input (in memory without holding the input table;
out of core under ``--memory-limit``)."""
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastanneal
from fastanneal import MiniBatchAnnealedKMeans
from fastanneal._cli_results import ClusterSummary, adjusted_rand_index, label_clusters
from fastanneal._io import TableWriter, write_table
from fastanneal._parquet import open_parquet, prefetched
from fastanneal.cli import main

WORDS = [["pin", "change", "code"], ["flight", "book", "paris"], ["alarm", "wake", "set"],
         ["weather", "rain", "sunny"], ["pizza", "order", "cheese"], ["song", "play", "loud"]]


def make_log(path, n=3000, K=6, D=16, seed=0, row_group=500, dtype=np.float32, sep=6.0,
             nan_row=None):
    """Well-separated blobs with topic-worded (and repeated) queries, string ids, counts;
    ``row_group`` rows per Parquet row group."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(K, D)) * sep
    sizes = np.linspace(2, 1, K)
    lab = rng.choice(K, size=n, p=sizes / sizes.sum())
    X = (centers[lab] + rng.normal(size=(n, D))).astype(dtype)
    if nan_row is not None:
        X[nan_row, 3] = np.nan
    q = [f"{WORDS[k][i % 3]} {WORDS[k][(i // 3) % 3]} {i % 7}" for i, k in enumerate(lab)]
    t = pa.table({"id": [f"r{i:06d}" for i in range(n)], "query": q,
                  "count": rng.integers(1, 9, n).astype(np.int64), "topic": lab,
                  "emb": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), D)})
    pq.write_table(t, path, row_group_size=row_group)
    return X, lab, t


# --------------------------------------------------------------------------- the stream
def test_prefetched_order_errors_and_early_close():
    assert [r for _, r in prefetched(lambda i: i * i, range(7), depth=2)] == \
        [i * i for i in range(7)]

    def boom(i):
        if i == 3:
            raise KeyError("row group 3")
        return i
    got = []
    with pytest.raises(KeyError, match="row group 3"):
        for i, r in prefetched(boom, range(6)):
            got.append(r)
    assert got == [0, 1, 2]
    g = prefetched(lambda i: i, range(100), depth=1)
    next(g)
    g.close()                        # the reader thread stops; nothing hangs


def test_stream_passes_equal_in_memory_moments(tmp_path):
    """A full pass over the row groups gives the moments of the whole array (float64 data:
    only the summation order differs)."""
    p = tmp_path / "x.parquet"
    X, _, t = make_log(p, n=2100, dtype=np.float64, row_group=300)
    w = t.column("count").to_numpy().astype(np.float64)
    s = open_parquet(p, column="emb", weight="count")
    assert (s.n_rows, s.n_features, s.dtype) == (2100, 16, np.float64)
    assert s.total_weight == pytest.approx(w.sum())
    C = X[[0, 500, 1000, 1500, 2000]]
    for T in (0.5, 50.0):
        m = s.moments(C, T, hard_sums=True)
        ref = fastanneal.moments(X, C, T, weights=w)
        np.testing.assert_allclose(m.N, ref.N, rtol=1e-10)
        np.testing.assert_allclose(m.S, ref.S, rtol=1e-10, atol=1e-9)
        assert m.free_energy == pytest.approx(ref.free_energy, rel=1e-10)
    mu = w @ X / w.sum()
    np.testing.assert_allclose(s.mean(), mu, rtol=1e-10)
    Z = X - mu
    np.testing.assert_allclose(s.covariance(mu), (Z * w[:, None]).T @ Z / w.sum(), rtol=1e-9,
                               atol=1e-12)
    assert s.n_distinct_rows(np.random.default_rng(0), 10 ** 6) == 2100
    from fastanneal._sources import InMemorySource
    ev = s.cluster_top_eigenvalues(C, 30, np.random.default_rng(0))
    ref = InMemorySource(X, w, 0).cluster_top_eigenvalues(C, 30, np.random.default_rng(0))
    np.testing.assert_allclose(ev, ref, rtol=1e-6)


def test_epoch_order_decodes_each_row_group_once(tmp_path):
    p = tmp_path / "x.parquet"
    make_log(p, n=2000, row_group=400)
    s = open_parquet(p, column="emb", chunk_rows=100)
    order = s.epoch_order(np.random.default_rng(1))
    assert sorted(order.tolist()) == list(range(len(s.chunks)))
    pieces = [s.chunks[j][0] for j in order]
    runs = [pieces[0]] + [b for a, b in zip(pieces, pieces[1:]) if b != a]
    assert sorted(runs) == list(range(5))         # each row group's chunks are contiguous
    reads = []
    orig = s.data.read
    s.data.read = lambda i, cols: reads.append(i) or orig(i, cols)
    C = np.zeros((3, 16), np.float32)
    for j in order:
        s.batch_moments([int(j)], C, 1.0, 0, None)
    assert sorted(reads) == list(range(5))        # one decode per row group per epoch


def test_minibatch_on_parquet_out_of_core(tmp_path):
    """MiniBatchAnnealedKMeans over open_parquet: the clusters of the truth, labels and ids
    written as Parquet; a path without a scheduler takes the same in-process route."""
    p = tmp_path / "x.parquet"
    X, lab, t = make_log(p, n=3000)
    est = MiniBatchAnnealedKMeans(6, random_state=0).fit(
        open_parquet(p, column="emb", id="id"), labels_path=tmp_path / "labels")
    assert est.n_rows_ == 3000 and est.labels_ is None
    out = pq.read_table(tmp_path / "labels").sort_by("row")
    assert out.column("row").to_pylist() == list(range(3000))
    assert out.column("id").to_pylist() == t.column("id").to_pylist()
    got = out.column("label").to_numpy()
    assert adjusted_rand_index(lab, got) == pytest.approx(1.0)
    np.testing.assert_array_equal(got, est.predict(X))
    # a plain path (column "embedding") without a scheduler: in process, no Dask
    pq.write_table(t.rename_columns(["id", "query", "count", "topic", "embedding"]),
                   tmp_path / "y.parquet", row_group_size=700)
    est2 = MiniBatchAnnealedKMeans(6, random_state=0).fit(str(tmp_path / "y.parquet"))
    assert adjusted_rand_index(lab, est2.predict(X)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="metric"):
        MiniBatchAnnealedKMeans(6, metric="cosine").fit(open_parquet(p, column="emb"))
    with pytest.raises(ValueError, match="not found"):
        open_parquet(p, column="nope")


def test_stream_names_the_bad_row(tmp_path):
    p = tmp_path / "x.parquet"
    make_log(p, n=1000, row_group=200, nan_row=777)
    with pytest.raises(ValueError, match="NaN.*row 777"):
        MiniBatchAnnealedKMeans(3, random_state=0).fit(open_parquet(p, column="emb"))


# --------------------------------------------------------------------------- the summary
def _reference_table(labels, cos, w, texts, K, n_rep):
    """Brute force over all rows at once (the definition)."""
    size = np.bincount(labels, minlength=K)
    central, reps = [], []
    for k in range(K):
        rows = [i for i in np.lexsort((np.arange(len(labels)), -cos)) if labels[i] == k]
        central.append(rows[0] if rows else -1)
        r = []
        for i in rows:
            if texts[i] is not None and texts[i] not in r:
                r.append(texts[i])
            if len(r) == n_rep:
                break
        reps.append(r)
    return size, central, reps


def test_cluster_summary_is_the_same_whatever_the_blocks():
    rng = np.random.default_rng(7)
    n, K = 900, 5
    labels = rng.integers(0, K, n)
    cos = np.round(rng.uniform(0.2, 1.0, n), 2)           # many ties
    prob = np.round(rng.uniform(0.3, 1.0, n), 2)
    margin = rng.uniform(0, 1, n)
    ru = (labels + 1) % K
    w = rng.integers(1, 4, n).astype(float)
    pool = [f"{a} {b}" for a in ("pin", "card", "rain", "song") for b in ("now", "help")]
    texts = [None if i % 37 == 0 else pool[rng.integers(len(pool))] for i in range(n)]
    ids = [f"id{i}" for i in range(n)]
    tables, ambs = [], []
    for cuts in ([0, n], [0, 1, 2, 450, 451, n], sorted({0, n, *rng.integers(1, n, 30)})):
        s = ClusterSummary(K, n, n_representatives=3, with_ids=True, n_ambiguous=20)
        for a, b in zip(cuts[:-1], cuts[1:]):
            s.add(a, labels[a:b], prob[a:b], margin[a:b], ru[a:b], cos[a:b], w[a:b],
                  texts[a:b], ids[a:b])
        tables.append(s.table())
        ambs.append(s.ambiguous_rows(np.arange(K)))
    for t in tables[1:]:                # sums up to the order of float additions
        for name in tables[0].column_names:
            a, b = t.column(name).to_pylist(), tables[0].column(name).to_pylist()
            if name in ("weight", "share", "cohesion"):
                np.testing.assert_allclose(a, b, rtol=1e-12)
            else:
                assert a == b, name
    assert ambs[1] == ambs[0] and ambs[2] == ambs[0]
    # against the definition
    order = np.lexsort((np.arange(K), -np.bincount(labels, weights=w, minlength=K)))
    size, central, reps = _reference_table(labels, cos, w, texts, K, 3)
    t = tables[0].to_pydict()
    assert t["size"] == size[order].tolist()
    assert t["central_row"] == [central[k] + 1 for k in order]
    assert t["central_id"] == [ids[central[k]] for k in order]
    assert t["representative_queries"] == [reps[k] for k in order]
    low, seen = [], set()               # distinct queries (rows without text: each row)
    for i in np.lexsort((np.arange(n), prob)).tolist():
        key = ("row", i) if texts[i] is None else texts[i]
        if key not in seen and len(low) < 20:
            seen.add(key)
            low.append(i)
    assert [a["row"] for a in ambs[0]] == low


def test_summary_text_sample_is_bounded_and_block_independent():
    rng = np.random.default_rng(3)
    n, K = 5000, 3
    labels = rng.integers(0, K, n)
    texts = [f"w{labels[i]} x{i % 11}" for i in range(n)]
    args = (np.ones(n), np.zeros(n), np.full(n, -1), np.ones(n), np.ones(n), texts)
    full = ClusterSummary(K, n, text_sample=10 ** 9)
    a = ClusterSummary(K, n, text_sample=800)
    b = ClusterSummary(K, n, text_sample=800)
    full.add(0, labels, *args)
    a.add(0, labels, *args)
    for s0 in range(0, n, 333):
        b.add(s0, labels[s0:s0 + 333], *[x[s0:s0 + 333] for x in args])
    counted = sum(sum(c.values()) for c in a.terms.per_class)
    assert 0 < counted < 0.3 * sum(sum(c.values()) for c in full.terms.per_class)
    assert a.terms.per_class == b.terms.per_class
    assert [x.split()[0] for x in a.table().column("label").to_pylist()] == \
        [x.split()[0] for x in full.table().column("label").to_pylist()] == ["w0", "w1", "w2"]


def test_table_writer_appends_tables(tmp_path):
    t = pa.table({"a": [1, 2, 3, 4], "s": ["x", "=1+1", None, "y"],
                  "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8.0)), 2)})
    for ext in (".csv", ".parquet", ".jsonl"):
        one, two = tmp_path / f"one{ext}", tmp_path / f"two{ext}"
        write_table(t, one)
        with TableWriter(two) as wr:
            wr.write(t.slice(0, 1))
            wr.write(t.slice(1, 3))
        if ext == ".parquet":
            assert pq.read_table(two).equals(pq.read_table(one))
        else:
            assert two.read_bytes() == one.read_bytes()


# --------------------------------------------------------------------------- the command
def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cluster_out_of_core_matches_in_memory(tmp_path, capsys, monkeypatch):
    """Same log, two routes: in memory (default limit) and out of core (--memory-limit
    below the embeddings): the same rows in the same order with the same columns, the same
    partition and (it follows) the same cluster labels and sizes. The out-of-core route
    never reads the embeddings into one matrix."""
    p = tmp_path / "log.parquet"
    X, lab, t = make_log(p, n=3000)
    common = ["cluster", p, "--embedding-column", "emb", "--id-column", "id", "--weight-column",
              "count", "--k", 6, "--truth-column", "topic", "-q"]
    rc, _, err = _run(capsys, *common, "-o", tmp_path / "mem.parquet", "--report",
                      tmp_path / "mem.html")
    assert rc == 0, err
    from fastanneal import _cli_stream

    def no_matrix(self, st=None):
        raise AssertionError("the out-of-core route read the whole embedding matrix")
    monkeypatch.setattr(_cli_stream.ParquetLog, "embeddings", no_matrix)
    rc, _, err = _run(capsys, *common[:-1], "-o", tmp_path / "ooc.parquet", "--memory-limit",
                      "64K", "--report", tmp_path / "ooc.html")
    assert rc == 0, err
    assert "out of core" in err
    mem, ooc = pq.read_table(tmp_path / "mem.parquet"), pq.read_table(tmp_path / "ooc.parquet")
    assert mem.column_names == ooc.column_names == t.column_names + [
        "cluster", "probability", "margin", "runner_up"]
    assert ooc.column("id").to_pylist() == t.column("id").to_pylist()
    assert ooc.column("emb").equals(t.column("emb"))
    assert adjusted_rand_index(lab, ooc.column("cluster").to_numpy()) == pytest.approx(1.0)
    np.testing.assert_array_equal(ooc.column("cluster").to_numpy(),
                                  mem.column("cluster").to_numpy())
    p_ooc = ooc.column("probability").to_numpy()
    assert np.all((p_ooc > 0) & (p_ooc <= 1))
    cm = pa.csv.read_csv(tmp_path / "mem.clusters.csv")
    co = pa.csv.read_csv(tmp_path / "ooc.clusters.csv")
    for c in ("cluster", "size", "weight", "label", "terms", "central_id", "central_row"):
        assert co.column(c).to_pylist() == cm.column(c).to_pylist(), c
    # the central ids are the ids of the central rows (the id column stays Arrow out of core)
    ids = t.column("id").to_pylist()
    assert co.column("central_id").to_pylist() == [ids[r - 1] for r in
                                                  co.column("central_row").to_pylist()]
    assert "ambiguous" in (tmp_path / "ooc.html").read_text().lower()


def test_labelling_blocks_are_bounded_and_complete(tmp_path):
    """The labelling pass reads the row groups in blocks of at most ``rows`` rows (not whole
    row groups): every row once, in order, embeddings and texts as in the file; a column
    that lives in the folder names (hive partitions) falls back to whole row groups."""
    from types import SimpleNamespace

    from fastanneal._cli_stream import ParquetLog
    p = tmp_path / "log.parquet"
    X, lab, t = make_log(p, n=2000, row_group=700)
    args = SimpleNamespace(embedding_column="emb", weight_column=None, id_column="id",
                           truth_column=None, text_column="query")
    log = ParquetLog(p, args)
    got = list(log.blocks(["query"], rows=256))
    sizes = [x.shape[0] for _, x, _ in got]
    assert max(sizes) <= 256 and sum(sizes) == 2000 and len(got) == 3 + 3 + 3   # groups of 700, 700, 600
    assert [r0 for r0, _, _ in got] == list(np.cumsum([0] + sizes[:-1]))
    np.testing.assert_array_equal(np.concatenate([x for _, x, _ in got]), X)
    assert sum((tb.column("query").to_pylist() for _, _, tb in got), []) == \
        t.column("query").to_pylist()
    # hive partitions: the partition column is not in the files
    root = tmp_path / "hive"
    for k in (0, 1):
        d = root / f"part={k}"
        d.mkdir(parents=True)
        pq.write_table(t.slice(k * 1000, 1000), d / "a.parquet", row_group_size=400)
    args.text_column = "part"
    log = ParquetLog(root, args)
    got = list(log.blocks(["part"], rows=256))
    assert sum(x.shape[0] for _, x, _ in got) == 2000
    np.testing.assert_array_equal(np.concatenate([x for _, x, _ in got]), X)


@pytest.mark.dask
def test_cluster_out_of_core_on_dask_workers(tmp_path, capsys, monkeypatch):
    """``--backend dask`` above ``--memory-limit``: the mini-batch fit runs on the Dask
    workers, which read the row groups themselves (the in-process row-group stream is never
    opened for the fit); this process then labels and writes the output row group by row
    group. Same rows, ids and partition as the in-memory route."""
    p = tmp_path / "log.parquet"
    X, lab, t = make_log(p, n=2400, row_group=300)
    common = ["cluster", p, "--embedding-column", "emb", "--id-column", "id", "--weight-column",
              "count", "--k", 6, "-q"]
    rc, _, err = _run(capsys, *common, "-o", tmp_path / "mem.parquet")
    assert rc == 0, err
    from fastanneal import _cli_stream, _parquet

    def no_matrix(self, st=None):
        raise AssertionError("the out-of-core route read the whole embedding matrix")

    class NoLocalStream:
        def __init__(self, *a, **k):
            raise AssertionError("the Dask route fitted on the in-process row-group stream")
    monkeypatch.setattr(_cli_stream.ParquetLog, "embeddings", no_matrix)
    monkeypatch.setattr(_parquet, "ParquetStream", NoLocalStream)
    rc, _, err = _run(capsys, *common[:-1], "-o", tmp_path / "dask.parquet", "--memory-limit",
                      "1K", "--backend", "dask", "--workers", 1)
    assert rc == 0, err
    assert "read by the Dask workers" in err and "8 chunks" in err, err
    mem = pq.read_table(tmp_path / "mem.parquet")
    dsk = pq.read_table(tmp_path / "dask.parquet")
    assert dsk.column_names == mem.column_names
    assert dsk.column("id").to_pylist() == t.column("id").to_pylist()
    assert adjusted_rand_index(lab, dsk.column("cluster").to_numpy()) == pytest.approx(1.0)
    assert adjusted_rand_index(mem.column("cluster").to_numpy(),
                               dsk.column("cluster").to_numpy()) == pytest.approx(1.0)


def test_in_memory_parquet_route_labels_like_the_library(tmp_path, capsys):
    """The Parquet in-memory route (embeddings decoded row group by row group, output
    written row group by row group) gives the library's labelled clusters."""
    p = tmp_path / "log.parquet"
    X, lab, t = make_log(p, n=1200, row_group=250)
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 6, "-q",
                      "-o", tmp_path / "out.csv", "--metric", "euclidean", "--seed", 3)
    assert rc == 0, err
    est = fastanneal.AnnealedKMeans(6, metric="euclidean", random_state=3).fit(X)
    ref = label_clusters(est, X, np.ones(len(X)), t.column("query").to_pylist())
    out = pa.csv.read_csv(tmp_path / "out.csv")
    np.testing.assert_array_equal(out.column("cluster").to_numpy(), ref.labels)
    ct = pa.csv.read_csv(tmp_path / "out.clusters.csv")
    assert ct.column("label").to_pylist() == ref.clusters.column("label").to_pylist()


@pytest.mark.parametrize("extra,words", [
    (["--k", "3", "--schedule", "critical"], ["critical", "memory"]),
    (["--k", "3", "--memory-limit", "lots"], ["memory-limit", "not a size"]),
    (["--k", "3", "--memory-limit", "1e999"], ["memory-limit", "too large"]),   # a traceback
    (["--k", "3", "--memory-limit", "1.2.3"], ["memory-limit", "not a size"]),
])
def test_out_of_core_refuses_what_it_cannot_do(tmp_path, capsys, extra, words):
    p = tmp_path / "log.parquet"
    make_log(p, n=600)
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "-o",
                      tmp_path / "o.csv", "--memory-limit", "1K", *extra)
    assert rc == 2, err
    assert "Traceback" not in err
    for w in words:
        assert w.lower() in err.lower(), (w, err)
    assert not (tmp_path / "o.csv").exists()


def test_a_log_of_mostly_zero_weights_seeds_out_of_core(tmp_path):
    """100 of 200,000 rows carry weight: the k-means++ draw of 20 K rows of the seeding
    sample carried none ("Probabilities contain NaN" out of core, where the in-memory route
    clustered the log); the weighted rows of the sample seed now."""
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(size=(20000, 8)) + 6 * np.eye(8)[k % 8]
                        for k in range(10)]).astype(np.float32)
    w = (rng.random(len(X)) < 0.0005) * rng.integers(1, 9, len(X)).astype(float)
    p = tmp_path / "sparse.parquet"
    pq.write_table(pa.table({"embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(X.ravel()), 8), "w": w}), p, row_group_size=20000)
    for seed in range(3):
        mb = fastanneal.MiniBatchAnnealedKMeans(5, random_state=seed, n_steps=5).fit(
            fastanneal.open_parquet(p, weight="w"))
        assert np.isfinite(mb.inertia_) and mb.cluster_centers_.shape == (5, 8)


def test_float32_rows_refuse_a_largest_weight_they_cannot_carry_on_every_route(tmp_path):
    """Weights of 1e39 with float32 rows: the Parquet stream fitted centers at the mean
    (ARI 0.52) and the Dask routes gave a false "distinct points (1)" error or a bad fit;
    every route now says what the in-memory route says."""
    import dask.array as da
    rng = np.random.default_rng(1)
    X = np.concatenate([rng.normal(size=(300, 4)) + 8 * k for k in range(3)]).astype(np.float32)
    p = tmp_path / "w.parquet"
    pq.write_table(pa.table({"embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(X.ravel()), 4), "w": np.full(900, 1e39)}), p, row_group_size=300)
    with pytest.raises(ValueError, match="weight column 'w''s largest value is 1e\\+39"):
        fastanneal.MiniBatchAnnealedKMeans(3, random_state=0).fit(
            fastanneal.open_parquet(p, weight="w"))
    Xd, wd = da.from_array(X, chunks=(300, -1)), da.full(900, 1e39, chunks=300)
    for est in (fastanneal.AnnealedKMeans(3, random_state=0, backend="dask"),
                fastanneal.MiniBatchAnnealedKMeans(3, random_state=0)):
        with pytest.raises(ValueError, match="largest value is 1e\\+39: with float32 rows"):
            est.fit(Xd, sample_weight=wd)


def test_out_of_core_k_auto_chooses_on_a_sample(tmp_path, capsys, monkeypatch):
    """``--k auto`` out of core: the phase-transition path runs on a uniform sample of the
    row groups (never the whole embedding matrix), then the mini-batch fit clusters every
    row with the chosen K."""
    from fastanneal import _cli_stream, choose_k
    p = tmp_path / "log.parquet"
    X, lab, t = make_log(p, n=3000, K=5, sep=8.0, row_group=300)

    def no_matrix(self, st=None):
        raise AssertionError("the out-of-core route read the whole embedding matrix")
    monkeypatch.setattr(_cli_stream.ParquetLog, "embeddings", no_matrix)
    monkeypatch.setattr(choose_k, "STREAM_ROWS", 1200)
    seen = []
    real = choose_k.path_on_source

    def spy(source, *a, **k):
        seen.append(source.n_rows)
        return real(source, *a, **k)
    monkeypatch.setattr(choose_k, "path_on_source", spy)
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", "auto",
                      "--k-max", 10, "--truth-column", "topic", "--memory-limit", "1K",
                      "-o", tmp_path / "o.parquet")
    assert rc == 0, err
    assert "out of core" in err and "chose K = 5" in err, err
    assert seen == [1200]                               # the path ran on the sample only
    out = pq.read_table(tmp_path / "o.parquet")
    assert out.num_rows == 3000
    assert adjusted_rand_index(lab, out.column("cluster").to_numpy()) > 0.99


def test_out_of_core_bad_row_is_named(tmp_path, capsys):
    """Both routes name the same row, counted from 1 as the command counts rows (the
    out-of-core route said 612, the in-memory one 613, for row 612 counted from 0)."""
    p = tmp_path / "log.parquet"
    make_log(p, n=1000, row_group=200, nan_row=612)
    for limit in ("1K", "1G"):
        rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 3, "-o",
                          tmp_path / "o.csv", "--memory-limit", limit)
        assert rc == 2 and "NaN" in err and "row 613" in err, (limit, err)
        # the route's reason states the rule it applied (1.5 x the embeddings + 48 B a row)
        assert ("clustering in memory would need about" in err) == (limit == "1K"), err
        assert not (tmp_path / "o.csv").exists()


def test_out_of_core_checkpoint_reuses_the_finished_fit(tmp_path, capsys):
    p = tmp_path / "log.parquet"
    make_log(p, n=1500, row_group=300)
    argv = ["cluster", p, "--embedding-column", "emb", "--k", 4, "--memory-limit", "1K",
            "--checkpoint", tmp_path / "ck", "--seed", 5]
    rc, _, err = _run(capsys, *argv, "-o", tmp_path / "a.csv")
    assert rc == 0, err
    assert "the embeddings are read row group by row group" in err
    rc, _, err = _run(capsys, *argv, "-o", tmp_path / "b.csv")
    assert rc == 0, err
    assert "using the finished fit" in err
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()



def test_out_of_core_annealing_shows_progress(tmp_path, capsys):
    """The out-of-core fit is the long phase of a large log: with --progress its temperature
    steps are drawn (as the in-memory fit's are)."""
    p = tmp_path / "log.parquet"
    make_log(p, n=900, row_group=300)
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 3,
                      "--memory-limit", "1K", "--progress", "--steps", 7, "-o", tmp_path / "o.csv")
    assert rc == 0, err
    assert "7/7" in err, err
    MiniBatchAnnealedKMeans(3, n_steps=5, random_state=0, progress=True).fit(
        open_parquet(p, column="emb"))
    assert "5/5" in capsys.readouterr().err


# --------------------------------------------------------------------------- switched off?
def test_the_rule_reads_row_groups_whole_per_epoch(tmp_path):
    """The mini-batch rule follows the stream's epoch order: the batches of one epoch visit
    each row group's chunks together (a uniform permutation would decode every row group
    again for almost every batch)."""
    from fastanneal._minibatch import StochasticEMRule
    p = tmp_path / "x.parquet"
    make_log(p, n=2000, row_group=400)
    s = open_parquet(p, column="emb", chunk_rows=50)
    rule = StochasticEMRule(s, None, 1, 1, perm_seed=3, total_weight=2000.0)
    n = len(s.chunks)
    pieces = [s.chunks[rule.batch(b)[0]][0] for b in range(n)]
    runs = [pieces[0]] + [b for a, b in zip(pieces, pieces[1:]) if b != a]
    assert sorted(runs) == list(range(5))
    assert sorted(rule.batch(b)[0] for b in range(n)) == list(range(n))


def test_row_groups_are_read_ahead_in_a_thread(tmp_path):
    import threading
    seen = []

    def work(i):
        seen.append(threading.current_thread().name)
        return i
    assert [r for _, r in prefetched(work, range(4))] == [0, 1, 2, 3]
    assert set(seen) == {"fastanneal-prefetch"}
    p = tmp_path / "x.parquet"
    make_log(p, n=1200, row_group=300)
    s = open_parquet(p, column="emb", chunk_rows=100)
    where = []
    orig = s.data.read
    s.data.read = lambda i, cols: where.append((i, threading.current_thread().name)) or \
        orig(i, cols)
    s.prefetch([[3]])                      # chunk 3 lies in row group 1
    s.batch_moments([3], np.zeros((2, 16), np.float32), 1.0, 0, None)
    assert where == [(1, "fastanneal-prefetch_0")]
    s.close()


def test_in_memory_helpers_make_no_copy_of_the_rows():
    """The mean, the distinct-row count, unit rows for cosine and the finite check of the
    embedding column work in row blocks: no temporary as large as X (tracemalloc)."""
    import tracemalloc

    from fastanneal._io import embedding_matrix
    from fastanneal._sources import InMemorySource, row_hashes
    from fastanneal._validation import normalize_rows
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200_000, 32)).astype(np.float32)
    w = np.ones(X.shape[0])
    src = InMemorySource(X, w, 0)
    v = rng.standard_normal(32)
    np.testing.assert_array_equal(row_hashes(X, v, block=777), row_hashes(X, v, block=10 ** 7))
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    assert normalize_rows(U) is U                      # unit already: the same array
    assert not np.shares_memory(normalize_rows(X), X)
    t = pa.table({"e": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), 32)})
    for f in (src.mean, lambda: src.n_distinct_rows(np.random.default_rng(0), 10),
              lambda: normalize_rows(U), lambda: embedding_matrix(t, "e", "t.parquet")):
        tracemalloc.start()
        f()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 0.5 * X.nbytes, (f, peak / X.nbytes)


def test_drop_columns(tmp_path, capsys):
    p = tmp_path / "log.parquet"
    make_log(p, n=600)
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 3, "-q",
                      "--drop-columns", "emb,count", "-o", tmp_path / "o.parquet")
    assert rc == 0, err
    assert pq.read_table(tmp_path / "o.parquet").column_names == [
        "id", "query", "topic", "cluster", "probability", "margin", "runner_up"]
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 3,
                      "--drop-columns", "nope", "-o", tmp_path / "o2.parquet")
    assert rc == 2 and "--drop-columns" in err and "nope" in err, err


def test_out_of_core_read_error_is_one_line(tmp_path, capsys):
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from test_hostile_input import _corrupt_parquet
    src = _corrupt_parquet(tmp_path / "bad.parquet")
    rc, _, err = _run(capsys, "cluster", src, "--embedding-column", "emb", "--k", 2,
                      "--memory-limit", "1K", "-o", tmp_path / "r.csv")
    assert rc == 2 and "Traceback" not in err, err
    assert "bad.parquet" in err and "checksum" in err.lower(), err
    assert not (tmp_path / "r.csv").exists()


def test_labels_path_may_not_touch_the_input(tmp_path):
    """labels_path = the input with overwrite=True replaced the input file by the labels
    folder (the input deleted, then the final pass failed reading it); labels written
    inside an input folder became part of its dataset."""
    p = tmp_path / "log.parquet"
    make_log(p, n=600, row_group=300)
    before = p.read_bytes()
    est = MiniBatchAnnealedKMeans(3, random_state=0, n_steps=3)
    with pytest.raises(ValueError, match="is the input .*holds it or lies inside it"):
        est.fit(open_parquet(p, column="emb"), labels_path=p, overwrite=True)
    assert p.is_file() and p.read_bytes() == before
    d = tmp_path / "ds"
    d.mkdir()
    make_log(d / "a.parquet", n=600, row_group=300)
    for lp in (d / "labels", tmp_path):             # inside the input, or holding it
        with pytest.raises(ValueError, match="holds it or lies inside it"):
            est.fit(open_parquet(d, column="emb"), labels_path=lp, overwrite=True)
    assert sorted(x.name for x in d.iterdir()) == ["a.parquet"]
    # the Dask route: read_parquet_embeddings' arrays (or arrays made from them) and
    # write_labels -- the labels folder replaced the input folder (its embeddings deleted)
    pytest.importorskip("distributed")
    from fastanneal.dask import read_parquet_embeddings, write_labels
    E = read_parquet_embeddings(d, column="emb")
    C = np.zeros((3, E.X.shape[1]))
    for X in (E, E.X, E.X[:100].astype(np.float64), E.X.persist(), str(d)):
        for lp in (d, d / "labels", tmp_path):
            with pytest.raises(ValueError, match="path=.*holds it or lies inside it"):
                write_labels(X, C, lp, overwrite=True)
            if not (X is E or X is E.X):
                continue
            with pytest.raises(ValueError, match="labels_path=.*holds it or lies inside"):
                est.fit(X, labels_path=lp, overwrite=True)
    # a collection whose files cannot be told (here not from the reader at all) stays off
    # every file the reader opened in this process
    import dask.array as dsa
    with pytest.raises(ValueError, match="path=.*holds it or lies inside it"):
        write_labels(dsa.from_array(E.X.compute()), C, d, overwrite=True)
    assert sorted(x.name for x in d.iterdir()) == ["a.parquet"]


def test_labels_keep_the_ids_type_and_refuse_missing_ids(tmp_path):
    """Ids went through NumPy per row group: a null made that row group's int64 ids float64
    (2^60 + i rounded), decimals changed precision per file; the labels folder's files then
    did not share a schema. Now the ids keep the dataset's Arrow type; a null id is refused
    with its row, as the command does."""
    import decimal
    X, _, _ = make_log(tmp_path / "x.parquet", n=2000, row_group=500)
    emb = pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), X.shape[1])
    for ids in (pa.array(np.arange(2000, dtype=np.int64) + 2 ** 60),
                pa.array([decimal.Decimal(i) / 100 for i in range(2000)],
                         type=pa.decimal128(10, 2))):
        p = tmp_path / "ids.parquet"
        pq.write_table(pa.table({"emb": emb, "id": ids}), p, row_group_size=500)
        out = tmp_path / "labels"
        MiniBatchAnnealedKMeans(4, random_state=0, n_steps=3).fit(
            open_parquet(p, column="emb", id="id"), labels_path=out, overwrite=True)
        back = pq.read_table(out)
        assert back["id"].type == ids.type and back["id"].to_pylist() == ids.to_pylist()
    bad = pa.array([None if i == 1234 else i for i in range(2000)], type=pa.int64())
    pq.write_table(pa.table({"emb": emb, "id": bad}), p, row_group_size=500)
    with pytest.raises(ValueError, match="id column 'id' has a missing value at row 1234"):
        MiniBatchAnnealedKMeans(4, random_state=0, n_steps=3).fit(
            open_parquet(p, column="emb", id="id"), labels_path=tmp_path / "l2")


@pytest.mark.parametrize("memory_limit", [None, "1K"])
def test_a_folder_whose_files_differ_in_column_types_reads_in_the_widest(capsys, tmp_path,
                                                                         memory_limit):
    """int32 ids in one file, int64 ids above 2^31 in the next; float32 embeddings, then
    float64: every row is read in the widest type (out of core the write failed after the
    whole fit, in memory the read; float64 embeddings were narrowed to float32)."""
    rng = np.random.default_rng(0)
    X = np.repeat(rng.normal(size=(4, 8)) * 6, 100, axis=0) + rng.normal(size=(400, 8))
    X[:, 0] += 1e-9 * np.arange(400)               # digits float32 cannot hold
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(pa.table({"embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(X[:200].astype(np.float32).ravel()), 8),
        "id": pa.array(np.arange(200, dtype=np.int32))}), d / "a.parquet")
    pq.write_table(pa.table({"embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(X[200:].ravel()), 8),
        "id": pa.array(np.arange(200, 400, dtype=np.int64) + 3_000_000_000)}), d / "b.parquet")
    out = tmp_path / "out.parquet"
    extra = [] if memory_limit is None else ["--memory-limit", memory_limit]
    rc = main(["cluster", str(d), "-o", str(out), "--embedding-column", "embedding",
               "--id-column", "id", "--k", "4", "-q", *extra])
    assert rc == 0, capsys.readouterr().err
    o = pq.read_table(out)
    assert o["id"].to_pylist() == list(range(200)) + list(range(3_000_000_200, 3_000_000_400))
    np.testing.assert_array_equal(np.array(o["embedding"].to_pylist()[200:]), X[200:])


def test_the_chunking_is_part_of_the_checkpoint_key(tmp_path):
    p = tmp_path / "log.parquet"
    make_log(p, n=1200, row_group=600)
    a = open_parquet(p, column="emb", chunk_rows=400).fingerprint()
    assert a == open_parquet(p, column="emb", chunk_rows=400).fingerprint()
    assert a != open_parquet(p, column="emb", chunk_rows=300).fingerprint()


def test_small_row_groups_make_batches_of_about_chunk_rows(tmp_path):
    """64-row row groups made every batch 64 rows (a fit 14x slower than with 4,096-row
    batches, and slightly worse): a batch now takes several chunks."""
    p = tmp_path / "small.parquet"
    make_log(p, n=4096, row_group=64)
    km = MiniBatchAnnealedKMeans(6, random_state=0, n_steps=4).fit(
        open_parquet(p, column="emb", chunk_rows=1024))
    assert km.batch_chunks_ == 16                         # 16 row groups of 64 rows
    big = tmp_path / "big.parquet"
    make_log(big, n=4096, row_group=2048)
    km = MiniBatchAnnealedKMeans(6, random_state=0, n_steps=4).fit(
        open_parquet(big, column="emb", chunk_rows=1024))
    assert km.batch_chunks_ == 1                          # chunks already of chunk_rows


def test_the_labels_folder_gets_the_permissions_of_a_plain_folder(tmp_path):
    import os
    p = tmp_path / "log.parquet"
    make_log(p, n=600, row_group=300)
    out = tmp_path / "labels"
    MiniBatchAnnealedKMeans(3, random_state=0, n_steps=3).fit(
        open_parquet(p, column="emb"), labels_path=out)
    os.mkdir(tmp_path / "plain")
    assert (out.stat().st_mode & 0o777) == ((tmp_path / "plain").stat().st_mode & 0o777)


def test_a_file_without_the_column_is_named_as_missing(tmp_path):
    """A folder where one file lacks the embedding (or weight) column read that file as
    nulls: "has a null embedding in part-2.parquet row group 0, row 2501" for a column
    that is not there."""
    d = tmp_path / "ds"
    d.mkdir()
    make_log(d / "part-0.parquet", n=600, row_group=300)
    t = pq.read_table(d / "part-0.parquet")
    pq.write_table(t.drop_columns(["emb"]), d / "part-1.parquet")
    with pytest.raises(ValueError, match=r"embedding column 'emb' not found in .*part-1"):
        open_parquet(d, column="emb")
    pq.write_table(t.drop_columns(["count"]), d / "part-1.parquet")
    with pytest.raises(ValueError, match=r"weight column 'count' not found in .*part-1"):
        open_parquet(d, column="emb", weight="count")
    assert open_parquet(d, column="emb").n_rows == 1200


def test_a_missing_number_inside_an_embedding_is_named_so(capsys, tmp_path):
    """A null element inside an embedding list was converted to NaN and reported as
    "contains NaN" out of core ("has a missing number" in memory): the file holds no NaN."""
    X = np.random.default_rng(5).normal(size=(40, 4)).tolist()
    X[13][2] = None
    p = tmp_path / "n.parquet"
    pq.write_table(pa.table({"emb": pa.array(X, type=pa.list_(pa.float32()))}), p)
    with pytest.raises(ValueError, match=r"'emb' has a missing number in n.parquet row group "
                                         r"0, row 13"):
        MiniBatchAnnealedKMeans(3, random_state=0).fit(open_parquet(p, column="emb"))
    for extra in ([], ["--memory-limit", "1K"]):
        rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 2,
                          "-o", tmp_path / "r.csv", *extra)
        assert rc == 2 and "missing number" in err and "row 14" in err and "NaN" not in err


@pytest.mark.parametrize("minibatch", [False, True], ids=["full", "minibatch"])
@pytest.mark.parametrize("route", ["open_parquet", "dask"])
def test_inertia_is_exact_on_the_streamed_and_dask_routes(tmp_path, route, minibatch):
    """inertia_ of a full-batch fit over a stream or a Dask array came from the final pass's
    GEMM-form float32 distances: 5.6x the exact J with five rows weighing 1e10, while
    score() (exact) gave J -- now one more pass sums each row's exact distance there too.
    The mini-batch routes' final pass sums them too where it writes labels (2.4e-7 off)."""
    K, D = 7, 16
    rng = np.random.default_rng(777001)
    X = np.concatenate([c + rng.normal(size=(200, D))
                        for c in rng.normal(size=(K, D)) * 1.5]).astype(np.float32)
    w = np.ones(len(X))
    w[rng.choice(len(X), 5, replace=False)] = 1e10
    if route == "open_parquet":
        p = tmp_path / "heavy.parquet"
        pq.write_table(pa.table({"emb": pa.array(list(X), type=pa.list_(pa.float32())),
                                 "w": w}), p, row_group_size=200)
        src = open_parquet(p, column="emb", weight="w")
        km = (fastanneal.MiniBatchAnnealedKMeans(K, random_state=3).fit(
                  src, labels_path=tmp_path / "labels") if minibatch
              else fastanneal.AnnealedKMeans(K, random_state=3).fit_source(src))
    else:
        da = pytest.importorskip("dask.array")
        import dask
        est = (fastanneal.MiniBatchAnnealedKMeans(K, random_state=3, batch_size=400)
               if minibatch else fastanneal.AnnealedKMeans(K, random_state=3))
        with dask.config.set(scheduler="synchronous"):
            km = est.fit(da.from_array(X, chunks=(200, D)),
                         sample_weight=da.from_array(w, chunks=200),
                         **({"labels_path": tmp_path / "labels"} if minibatch else {}))
    C = km.cluster_centers_.astype(np.float64)
    J = float((w * ((X.astype(np.float64)[:, None] - C[None]) ** 2).sum(-1).min(1)).sum())
    # (the mini-batch fit measures its float32 rows from its origin, each rounded once
    # there, as score() does: 8e-9 of J here, where the old GEMM-form sum was 2.4e-7 off)
    tol = 5e-8 if minibatch else 1e-9
    assert km.inertia_ == pytest.approx(J, rel=tol)
    assert -km.score(X, sample_weight=w) == pytest.approx(J, rel=tol)
    assert km.inertia_ == pytest.approx(-km.score(X, sample_weight=w), rel=1e-12)


def test_a_fit_over_a_stream_does_not_depend_on_its_row_groups(tmp_path):
    """A sample of every row drew a permutation of the row groups from the fit's generator
    (unused: every row was taken), so k-means++ drew from another random stream and a
    fit of five row groups ended elsewhere than one of one (max |dC| 2.1 on unit data)."""
    X = np.random.default_rng(0).normal(size=(5000, 8)).astype(np.float32)
    t = pa.table({"embedding": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), 8)})
    mem = fastanneal.AnnealedKMeans(10, random_state=0).fit(X)
    for rows in (5000, 1000, 640):
        p = tmp_path / f"rg{rows}.parquet"
        pq.write_table(t, p, row_group_size=rows)
        km = fastanneal.AnnealedKMeans(10, random_state=0).fit_source(open_parquet(p))
        np.testing.assert_allclose(km.cluster_centers_, mem.cluster_centers_, rtol=0,
                                   atol=1e-5)
        assert km.n_iter_ == mem.n_iter_
    rng = np.random.default_rng(0)
    Xs, _ = open_parquet(tmp_path / "rg1000.parquet").sample(5000, rng)
    np.testing.assert_array_equal(Xs, X)
    assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state


def _emb_table(E, **cols):
    return pa.table({**cols, "embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(E.astype(np.float32).ravel()), E.shape[1])})


def test_a_file_changed_after_open_is_an_error_not_lost_rows(tmp_path):
    """Rows appended between open_parquet and fit got no label, without a word (the row
    groups were the ones read at open); other rewrites failed as 'corrupt file'."""
    import os
    import time
    E = np.random.default_rng(0).normal(size=(30000, 4))
    path = tmp_path / "chg.parquet"
    pq.write_table(_emb_table(E[:20000], qid=np.arange(20000)), path, row_group_size=5000)
    src = open_parquet(str(path), id="qid")
    os.utime(path)                  # a touch (a sync tool) keeps the rows: no change
    assert MiniBatchAnnealedKMeans(4, random_state=0).fit(src).n_rows_ == 20000
    time.sleep(0.01)
    pq.write_table(_emb_table(E, qid=np.arange(30000)), path, row_group_size=5000)
    with pytest.raises(ValueError, match="changed since it was opened"):
        MiniBatchAnnealedKMeans(4, random_state=0).fit(src, labels_path=str(tmp_path / "lab"))
    assert not (tmp_path / "lab").exists()
    n = MiniBatchAnnealedKMeans(4, random_state=0).fit(
        open_parquet(str(path), id="qid"), labels_path=str(tmp_path / "lab")).n_rows_
    assert n == 30000 == pq.read_table(tmp_path / "lab").num_rows


def test_a_sample_of_uneven_row_groups_and_of_few_weighted_rows_seeds_well(tmp_path):
    """Row groups picked uniformly left out one holding half the rows (ARI 0.84 on three
    seeds of four); a log of 100 weighted rows in 100,000 failed 'the seeding sample
    carries no weight' for most seeds. Row groups of very different sizes are picked in
    proportion to their rows, and a sample without weight is drawn from the weighted rows."""
    from sklearn.metrics import adjusted_rand_score
    rng = np.random.default_rng(0)
    means = rng.normal(size=(8, 6)) * 10
    y = np.repeat(np.arange(8), 5000)
    X = means[y] + rng.normal(size=(40000, 6))
    path = tmp_path / "skew.parquet"
    with pq.ParquetWriter(path, _emb_table(X[:1]).schema) as wr:
        wr.write_table(_emb_table(X[:20000]), row_group_size=20000)     # clusters 0-3
        wr.write_table(_emb_table(X[20000:]), row_group_size=100)       # clusters 4-7
    for seed in range(3):
        lab = MiniBatchAnnealedKMeans(8, random_state=seed, init_size=2000).fit(
            open_parquet(str(path)), labels_path=str(tmp_path / f"l{seed}"))
        got = pq.read_table(tmp_path / f"l{seed}").sort_by("row").column("label").to_numpy()
        assert adjusted_rand_score(y, got) > 0.99, seed
    w = np.zeros(20000)
    w[-100:] = 1.0
    wpath = tmp_path / "w.parquet"
    pq.write_table(_emb_table(X[:20000], w=w), wpath, row_group_size=1000)
    for seed in range(4):
        MiniBatchAnnealedKMeans(4, random_state=seed, init_size=2000).fit(
            open_parquet(str(wpath), weight="w"))


def test_stream_inputs_to_inference_and_bad_stream_options_are_named(tmp_path):
    path = tmp_path / "a.parquet"
    E = np.random.default_rng(0).normal(size=(500, 4))
    pq.write_table(_emb_table(E), path)
    mb = MiniBatchAnnealedKMeans(3, random_state=0).fit(open_parquet(str(path)))
    for f in (mb.predict, mb.transform, mb.score):
        for X in (open_parquet(str(path)), str(path)):
            with pytest.raises(ValueError, match="not a Parquet path or open_parquet stream"):
                f(X)
    with pytest.raises(ValueError, match="chunk_rows must be an integer >= 1"):
        open_parquet(str(path), chunk_rows=0)
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        open_parquet(str(path), dtype=np.float16)
    with pytest.raises(ValueError, match="learning_decay must be a number"):
        MiniBatchAnnealedKMeans(3, learning_decay="a").fit(E)


def test_the_probability_temperature_reads_no_rows_after_the_fit(tmp_path, monkeypatch):
    """Out of core, ``probability_temperature_`` comes from the margins of every k-th row
    of the final pass: no second sample of the row groups after the fit (it re-read at least
    eight of them: half a pass over a 16-row-group log, the whole of a smaller one); the
    median margin of those rows is that of every row within sampling error; a fit reused
    from its finished checkpoint gets the same temperature (a first version took the rows
    from the seeding sample, which a resumed fit does not have)."""
    from fastanneal._parquet import ParquetStream
    X, lab, _ = make_log(tmp_path / "log.parquet", n=100_000, K=5, D=4, row_group=12_500,
                         sep=4.0)
    calls = []
    real = ParquetStream.sample
    monkeypatch.setattr(ParquetStream, "sample",
                        lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    km = MiniBatchAnnealedKMeans(5, random_state=0).fit(
        open_parquet(tmp_path / "log.parquet", column="emb"))
    assert len(calls) == 1                          # the seeding sample only
    d = ((X[:, None, :].astype(np.float64) - km.cluster_centers_[None]) ** 2).sum(-1)
    s = np.sort(d, axis=1)
    med = np.median(s[:, 1] - s[:, 0])
    assert km.probability_temperature_ == pytest.approx(0.25 * med, rel=0.05)
    km2 = MiniBatchAnnealedKMeans(5, random_state=0).fit(
        open_parquet(tmp_path / "log.parquet", column="emb"))
    assert km2.probability_temperature_ == km.probability_temperature_   # reproducible
    make_log(tmp_path / "small.parquet", n=3000, K=5, D=4)
    calls.clear()
    kw = dict(random_state=0, checkpoint=tmp_path / "ck")
    a = MiniBatchAnnealedKMeans(5, **kw).fit(open_parquet(tmp_path / "small.parquet",
                                                          column="emb"))
    assert len(calls) == 1                          # a small log too
    b = MiniBatchAnnealedKMeans(5, **kw).fit(open_parquet(tmp_path / "small.parquet",
                                                          column="emb"))
    assert b.checkpoint_info_["finished"]
    assert b.probability_temperature_ == a.probability_temperature_


def test_a_checkpoint_is_not_resumed_on_another_file_of_the_same_size_and_time(tmp_path):
    """The stream's checkpoint key held each file's size and modification time only: a file
    of other rows written to the same size (uncompressed, no statistics: the same footer)
    with the same mtime (cp -p, rsync -t) resumed the other file's annealing silently."""
    import os
    paths = []
    for seed in (1, 2):
        X = np.random.default_rng(seed).normal(size=(2000, 8)).astype(np.float32)
        X[:1000] += 5
        p = tmp_path / f"log{seed}.parquet"
        pq.write_table(_emb_table(X), p, compression="none", write_statistics=False,
                       use_dictionary=False, row_group_size=500)
        os.utime(p, ns=(1_700_000_000_000_000_000,) * 2)
        paths.append(p)
    assert os.path.getsize(paths[0]) == os.path.getsize(paths[1])
    from fastanneal._parquet import file_stamp
    assert file_stamp(paths[0]) != file_stamp(paths[1])
    log = tmp_path / "log.parquet"
    kw = dict(random_state=0, n_steps=6, checkpoint=tmp_path / "ck")
    os.link(paths[0], log)
    MiniBatchAnnealedKMeans(2, **kw).fit(open_parquet(log))
    os.unlink(log)
    os.link(paths[1], log)                      # same size, same mtime, other rows
    b = MiniBatchAnnealedKMeans(2, **kw).fit(open_parquet(log))
    assert b.checkpoint_info_["replaced"] and not b.checkpoint_info_["finished"]
    ref = MiniBatchAnnealedKMeans(2, random_state=0, n_steps=6).fit(
        open_parquet(paths[1]))
    np.testing.assert_array_equal(b.cluster_centers_, ref.cluster_centers_)


def test_out_of_core_command_refuses_a_file_replaced_after_the_fit(tmp_path, capsys,
                                                                   monkeypatch):
    """A log replaced between the fit and the labelling (same layout, other rows) was
    labelled and written from its new rows with the old centers, exit 0 (or, rows
    appended, the new rows dropped); uint64 ids from 2^63 up failed with ArrowInvalid out of
    core (the in-memory route took them)."""
    import os

    from fastanneal import _cli_stream
    p = tmp_path / "log.parquet"
    make_log(p, n=3000)
    make_log(tmp_path / "other.parquet", n=3000, seed=5)
    real = _cli_stream.fit_stream

    def fit_then_replace(*a, **k):
        out = real(*a, **k)
        os.replace(tmp_path / "other.parquet", p)
        return out
    monkeypatch.setattr(_cli_stream, "fit_stream", fit_then_replace)
    rc, _, err = _run(capsys, "cluster", p, "--embedding-column", "emb", "--k", 6,
                      "--memory-limit", "64K", "-o", tmp_path / "out.parquet")
    assert rc != 0 and "changed since it was opened" in err and "rerun the command" in err
    assert not (tmp_path / "out.parquet").exists()
    monkeypatch.setattr(_cli_stream, "fit_stream", real)
    # unsigned ids of the top half of the range, and a repeated one named as such
    X = np.random.default_rng(0).normal(size=(1200, 4)).astype(np.float32)
    ids = np.arange(1200, dtype=np.uint64) + np.uint64(2 ** 63 + 5)
    q = [f"q{i % 7}" for i in range(1200)]
    pq.write_table(_emb_table(X, id=pa.array(ids), query=q), tmp_path / "u.parquet",
                   row_group_size=300)
    rc, _, err = _run(capsys, "cluster", tmp_path / "u.parquet", "--id-column", "id", "--k", 3,
                      "--embedding-column", "embedding",
                      "--memory-limit", "1K", "-o", tmp_path / "u_out.parquet", "-q")
    assert rc == 0, err
    assert pq.read_table(tmp_path / "u_out.parquet").column("id").to_numpy().tolist() == \
        ids.tolist()
    ids[700] = ids[3]
    pq.write_table(_emb_table(X, id=pa.array(ids), query=q), tmp_path / "d.parquet",
                   row_group_size=300)
    rc, _, err = _run(capsys, "cluster", tmp_path / "d.parquet", "--id-column", "id", "--k", 3,
                      "--embedding-column", "embedding",
                      "--memory-limit", "1K", "-o", tmp_path / "d_out.parquet", "-q")
    assert rc != 0 and str(int(ids[3])) in err


def test_review_of_the_session_strided_margins_same_size_rewrites_and_subnormal_weights(
        tmp_path):
    """The final pass's every-k-th-row margins all weighed 0 when the weights sat on every
    third row (stride 3): the probability temperature fell back to the final one (260x too
    small); a same-size rewrite between the stamp's sampled blocks kept the checkpoint key
    (it held no mtime any more) and resumed the old file's fit; a subnormal weight passed
    out of core (refused in memory)."""
    import shutil
    rng = np.random.default_rng(0)
    n = 60_000
    X = (np.repeat(np.eye(5, 8) * 8, n // 5, axis=0) + rng.normal(size=(n, 8))).astype(np.float32)
    w = np.where(np.arange(n) % 3 == 1, 1.0, 0.0)
    pq.write_table(_emb_table(X, count=w), tmp_path / "w.parquet", row_group_size=10_000)
    km = MiniBatchAnnealedKMeans(5, random_state=0).fit(
        open_parquet(tmp_path / "w.parquet", weight="count"))
    d = ((X[:, None, :].astype(np.float64) - km.cluster_centers_[None]) ** 2).sum(-1)
    s = np.sort(d, axis=1)
    med = np.median((s[:, 1] - s[:, 0])[w > 0])
    assert km.probability_temperature_ == pytest.approx(0.25 * med, rel=0.1)
    # a rewrite of the same size that the sampled blocks miss: the mtime still tells it
    A = rng.normal(size=(20_000, 16)).astype(np.float32)
    B = A.copy()
    B[2500:2510] = 0.0
    for name, M in (("a", A), ("b", B)):
        pq.write_table(_emb_table(M), tmp_path / f"{name}.parquet", compression="none",
                       write_statistics=False, use_dictionary=False)
    kw = dict(random_state=0, n_steps=4, checkpoint=tmp_path / "ck")
    log = tmp_path / "log.parquet"
    shutil.copy(tmp_path / "a.parquet", log)
    MiniBatchAnnealedKMeans(4, **kw).fit(open_parquet(log))
    shutil.copy(tmp_path / "b.parquet", log)
    b = MiniBatchAnnealedKMeans(4, **kw).fit(open_parquet(log))
    assert not b.checkpoint_info_["finished"] and b.checkpoint_info_["replaced"]
    w2 = np.ones(2000)
    w2[1234] = 1e-320
    pq.write_table(_emb_table(X[:2000], count=w2), tmp_path / "sub.parquet",
                   row_group_size=500)
    with pytest.raises(ValueError, match="1e-320 at row 1234.*smallest normal"):
        MiniBatchAnnealedKMeans(3, random_state=0).fit(
            open_parquet(tmp_path / "sub.parquet", weight="count"))

"""Dask backend: full batch on a real LocalCluster (2 worker processes) against the in-memory
source, Parquet / DataFrame inputs, chunk errors, mini-batch annealing, partial_fit, the
streaming label writer, pickling, and a worker killed (SIGKILL) mid-fit.

Error measure for "same result": norm-wise relative error ``||a - b|| / ||b||`` over the whole
array, float64 input, tolerance 1e-5 (the chunked sums differ from the in-memory sums only by
float reassociation, ~1e-15 per pass).
"""
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import fastanneal as fa  # noqa: E402
from fastanneal import _sources  # noqa: E402
from fastanneal import MiniBatchAnnealedKMeans  # noqa: E402
from fastanneal.dask import (DaskSource,  # noqa: E402
                             read_parquet_embeddings, resolve_client,
                             write_labels)

pytestmark = pytest.mark.dask

TOL = 1e-5


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    nb = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (nb if nb > 0 else 1.0)


def ari(a, b):
    from sklearn.metrics import adjusted_rand_score
    return adjusted_rand_score(a, b)


from conftest import blobs  # noqa: E402  (shared with test_resume.py)


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, worker_dashboard_address=None,
                                       scheduler_kwargs={"dashboard_address": ":0"})
    c = distributed.Client(cluster, set_as_default=False)
    try:
        yield c
    finally:
        c.close()
        cluster.close()


@pytest.fixture(scope="module")
def data():
    X, y = blobs(6000, 6, 8, seed=11)
    return X, y


def seeds_one_per_blob(X, y, k):
    """One row of each blob: the fit never relocates or merges clusters."""
    return np.stack([X[np.nonzero(y == j)[0][0]] for j in range(k)])


# ------------------------------------------------------------------------------- source
CHUNKINGS = [1000, (700, 1, 0, 2299, 0, 3000), 6000, (0, 3000, 0, 0, 3000)]


@pytest.mark.parametrize("chunks, metric", [
    (CHUNKINGS[0], 0), (CHUNKINGS[1], 0), (CHUNKINGS[2], 0), (CHUNKINGS[3], 0),
    (CHUNKINGS[0], 1), (CHUNKINGS[1], 1)],
    ids=["even", "ragged+empty", "one", "empties", "cosine-even", "cosine-ragged+empty"])
def test_source_matches_in_memory(client, data, chunks, metric):
    X, y = data
    w = np.random.default_rng(3).uniform(0.5, 2.0, X.shape[0])
    Xd = da.from_array(X, chunks=(chunks, -1))
    wd = da.from_array(w, chunks=(Xd.chunks[0],))
    Xm = X if metric == 0 else fa._validation.normalize_rows(X)
    mem = _sources.InMemorySource(Xm, w, metric)
    src = DaskSource(Xd, wd, metric, resolve_client(client))
    try:
        assert (src.n_rows, src.n_features, src.dtype) == (6000, 8, np.float64)
        assert src.total_weight == pytest.approx(w.sum(), rel=1e-12)
        C = seeds_one_per_blob(Xm, y, 6)
        for resp, T, hs in ((0, 2.0, False), (1, 0.5, False), (2, 1.0, True)):
            a, b = src.moments(C, T, resp, None, hard_sums=hs), mem.moments(C, T, resp, None, hs)
            assert rel(a.N, b.N) <= TOL and rel(a.S, b.S) <= TOL
            assert rel([a.free_energy, a.hard_distortion, a.soft_distortion],
                       [b.free_energy, b.hard_distortion, b.soft_distortion]) <= TOL
            assert a.rows == b.rows == 6000
            if hs:
                assert rel(a.hard_sums, b.hard_sums) <= TOL
        logp = np.log(np.arange(1, 7) / 21.0)
        assert rel(src.moments(C, 1.0, 0, logp).S, mem.moments(C, 1.0, 0, logp).S) <= TOL
        assert rel(src.mean(), mem.mean()) <= TOL
        np.testing.assert_array_equal(src.labels(C), mem.assign(C)[0])
        ea = src.cluster_top_eigenvalues(C, 10, np.random.default_rng(5))
        eb = mem.cluster_top_eigenvalues(C, 10, np.random.default_rng(5))
        assert rel(ea, eb) <= TOL
        for n in (50, 6000, 10 ** 6):
            xa, wa = src.sample(n, np.random.default_rng(7))
            xb, wb = mem.sample(n, np.random.default_rng(7))
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(wa, wb)
        from fastanneal.estimator import _n_distinct_rows
        assert src.n_distinct_rows(np.random.default_rng(9), 10 ** 9) == \
            _n_distinct_rows(Xm, np.random.default_rng(9), 10 ** 9)
        Z = Xm - mem.mean()
        assert rel(src.covariance(), (Z * w[:, None]).T @ Z / w.sum()) <= TOL
    finally:
        src.close()


@pytest.mark.parametrize("chunks", CHUNKINGS[:3], ids=["even", "ragged+empty", "one"])
def test_fit_matches_in_memory(client, data, chunks):
    X, y = data
    C0 = seeds_one_per_blob(X, y, 6)
    kw = dict(init=C0, temperature_start=4.0, random_state=0, n_steps=8)
    mem = fa.AnnealedKMeans(6, **kw).fit(X)
    dsk = fa.AnnealedKMeans(6, scheduler=client, **kw).fit(da.from_array(X, chunks=(chunks, -1)))
    assert rel(dsk.cluster_centers_, mem.cluster_centers_) <= TOL
    assert dsk.inertia_ == pytest.approx(mem.inertia_, rel=TOL)
    assert dsk.free_energy_ == pytest.approx(mem.free_energy_, rel=TOL)
    assert dsk.critical_temperature_ == pytest.approx(mem.critical_temperature_, rel=1e-3)
    np.testing.assert_array_equal(dsk.labels_, mem.labels_)
    assert dsk.n_iter_ == mem.n_iter_
    assert rel(dsk.trace_["hard_distortion"], mem.trace_["hard_distortion"]) <= TOL


def test_default_pipeline_matches_in_memory(client, data, monkeypatch):
    """k-means++ seeding from ``source.sample`` and T_start="auto": the Dask fit reaches the
    in-memory partition with the same centers (up to their order). The order too is the
    same when both draw the same numbers from the generator, i.e. when the estimator asks
    the source for ``n_distinct_rows`` and ``covariance`` as it computes them in memory."""
    X, y = data
    calls = set()
    for name in ("n_distinct_rows", "covariance"):
        orig = getattr(DaskSource, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls.add(_name)
            return _orig(self, *a, **k)
        monkeypatch.setattr(DaskSource, name, spy)
    mem = fa.AnnealedKMeans(6, random_state=1, n_steps=8).fit(X)
    dsk = fa.AnnealedKMeans(6, random_state=1, n_steps=8, scheduler=client).fit(
        da.from_array(X, chunks=((700, 0, 2300, 3000), -1)))
    assert ari(dsk.labels_, mem.labels_) == 1.0
    perm = np.argmin(((mem.cluster_centers_[:, None] - dsk.cluster_centers_[None]) ** 2)
                     .sum(-1), axis=1)
    assert sorted(perm) == list(range(6))
    assert rel(dsk.cluster_centers_[perm], mem.cluster_centers_) <= TOL
    assert dsk.temperature_start_ == pytest.approx(mem.temperature_start_, rel=TOL)
    assert dsk.inertia_ == pytest.approx(mem.inertia_, rel=TOL)
    if calls == {"n_distinct_rows", "covariance"}:
        assert rel(dsk.cluster_centers_, mem.cluster_centers_) <= TOL
        assert dsk.critical_temperature_ == pytest.approx(mem.critical_temperature_, rel=TOL)


def test_fitted_attributes_are_numpy_and_pickle(client, data):
    X, y = data
    est = fa.AnnealedKMeans(6, random_state=0, scheduler=client, n_steps=5)
    est.fit(da.from_array(X.astype(np.float32), chunks=(1500, -1)))
    assert est.cluster_centers_.dtype == np.float32
    for name, v in vars(est).items():
        if name.endswith("_") and not name.startswith("_"):
            assert not hasattr(v, "dask"), name
    assert isinstance(est.labels_, np.ndarray) and est.labels_.shape == (6000,)
    assert est.n_features_in_ == 8
    est.scheduler = None          # a live Client is not part of the fitted state
    est2 = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(est2.predict(X[:100].astype(np.float32)), est.labels_[:100])
    assert ari(est.labels_, y) == 1.0


def test_scheduler_address_default_client_and_embedded(client, data):
    X, y = data
    Xd = da.from_array(X, chunks=(2000, -1))
    C0 = seeds_one_per_blob(X, y, 6)
    kw = dict(init=C0, temperature_start=4.0, random_state=0, n_steps=4)
    a = fa.AnnealedKMeans(6, scheduler=client.scheduler.address, **kw).fit(Xd)
    with client.as_current():
        b = fa.AnnealedKMeans(6, **kw).fit(Xd)
    c = fa.AnnealedKMeans(6, **kw).fit(Xd)    # embedded LocalCluster, closed after fit
    assert rel(a.cluster_centers_, b.cluster_centers_) <= TOL
    assert rel(c.cluster_centers_, b.cluster_centers_) <= TOL
    with pytest.raises(ValueError):
        distributed.default_client()


def test_numpy_with_backend_dask(client, data):
    X, y = data
    C0 = seeds_one_per_blob(X, y, 6)
    kw = dict(init=C0, temperature_start=4.0, random_state=0, n_steps=4)
    a = fa.AnnealedKMeans(6, backend="dask", scheduler=client, **kw).fit(X)
    b = fa.AnnealedKMeans(6, **kw).fit(X)
    assert rel(a.cluster_centers_, b.cluster_centers_) <= TOL
    # column chunks are joined; unknown row-chunk sizes are computed
    c = fa.AnnealedKMeans(6, scheduler=client, **kw).fit(da.from_array(X, chunks=(1000, 3)))
    assert rel(c.cluster_centers_, b.cluster_centers_) <= TOL
    Xd = da.from_array(X, chunks=(1000, -1))
    keep = X[:, 0] > -1e9                       # all rows, but Dask cannot know the sizes
    Xu = Xd[da.from_array(keep, chunks=1000)]
    assert np.isnan(Xu.shape[0])
    d = fa.AnnealedKMeans(6, scheduler=client, **kw).fit(Xu)
    assert rel(d.cluster_centers_, b.cluster_centers_) <= TOL


# ------------------------------------------------------------------------------- errors
def test_nan_chunk_names_rows(client, data):
    X, _ = data
    Xb = X.copy()
    Xb[3456, 2] = np.nan
    Xd = da.from_array(Xb, chunks=(1000, -1))
    with pytest.raises(ValueError, match=r"NaN in chunk 3 \(rows 3000-3999\); first at row "
                                         r"3456, column 2"):
        fa.AnnealedKMeans(6, scheduler=client).fit(Xd)
    Xb[3456, 2] = np.inf
    with pytest.raises(ValueError, match=r"infinity in chunk 3 \(rows 3000-3999\)"):
        fa.AnnealedKMeans(6, scheduler=client).fit(da.from_array(Xb, chunks=(1000, -1)))


def test_cosine_zero_row_and_weight_errors(client, data):
    X, _ = data
    Xb = X.copy()
    Xb[1500] = 0.0
    with pytest.raises(ValueError, match=r"all-zero row in chunk 1 \(rows 1000-1999\) "
                                         r"\(row 1500\)"):
        fa.AnnealedKMeans(6, metric="cosine", scheduler=client).fit(
            da.from_array(Xb, chunks=(1000, -1)))
    w = np.ones(6000)
    w[4321] = -1.0
    with pytest.raises(ValueError, match=r"negative weights in chunk 4 .*row 4321"):
        fa.AnnealedKMeans(6, scheduler=client).fit(da.from_array(X, chunks=(1000, -1)),
                                                   sample_weight=w)
    with pytest.raises(ValueError, match="n_samples=6000 should be >= n_clusters=7000"):
        fa.AnnealedKMeans(7000, scheduler=client).fit(da.from_array(X, chunks=(1000, -1)))


def test_nan_chunk_writes_nothing(client, data, tmp_path):
    X, _ = data
    Xb = X.copy()
    Xb[5001, 0] = np.nan
    out = tmp_path / "labels"
    with pytest.raises(ValueError, match=r"chunk 5 \(rows 5000-5999\); first at row 5001"):
        write_labels(da.from_array(Xb, chunks=(1000, -1)), X[:6], out, scheduler=client)
    with pytest.raises(ValueError, match=r"chunk 5 \(rows 5000-5999\)"):
        MiniBatchAnnealedKMeans(6, random_state=0, scheduler=client, n_steps=3).fit(
            da.from_array(Xb, chunks=(1000, -1)), labels_path=out)
    assert list(tmp_path.iterdir()) == []          # no folder, no temporary left behind


# ------------------------------------------------------------------------------- Parquet
def _write_parquet(path, X, kind, weights=None, ids=None, row_group_size=700):
    n, D = X.shape
    flat = pa.array(X.reshape(-1))
    if kind == "fixed":
        emb = pa.FixedSizeListArray.from_arrays(flat, D)
    else:
        emb = pa.ListArray.from_arrays(pa.array(np.arange(0, n * D + 1, D, dtype=np.int32)), flat)
    cols = {"embedding": emb}
    if weights is not None:
        cols["w"] = pa.array(weights)
    if ids is not None:
        cols["doc_id"] = pa.array(ids)
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


@pytest.mark.parametrize("kind", ["fixed", "list"])
def test_read_parquet_embeddings(tmp_path, data, kind):
    X, _ = data
    X32 = X.astype(np.float32)
    w = np.random.default_rng(1).uniform(0.1, 3.0, X.shape[0])
    ids = np.array([f"doc-{i}" for i in range(X.shape[0])], dtype=object)
    folder = tmp_path / "ds"
    folder.mkdir()
    _write_parquet(folder / "a.parquet", X32[:2500], kind, w[:2500], ids[:2500])
    _write_parquet(folder / "b.parquet", X32[2500:], kind, w[2500:], ids[2500:])
    (folder / "_SUCCESS").write_text("")
    Xd, wd, idd = read_parquet_embeddings(folder, weight="w", id="doc_id")
    assert Xd.dtype == np.float32 and Xd.shape == X.shape
    assert Xd.chunks[0][:4] == (700, 700, 700, 400)          # one chunk per row group
    np.testing.assert_array_equal(Xd.compute(), X32)
    np.testing.assert_array_equal(wd.compute(), w)
    assert list(idd.compute()) == list(ids)
    Xd2, wd2, idd2 = read_parquet_embeddings(folder / "a.parquet", rows_per_chunk=1500,
                                             dtype=np.float64)
    assert Xd2.chunks[0] == (1400, 1100) and Xd2.dtype == np.float64
    assert wd2 is None and idd2 is None
    with pytest.raises(ValueError, match=r"column 'vec' not found .*available columns: "
                                         r"\['embedding', 'w', 'doc_id'\]"):
        read_parquet_embeddings(folder, column="vec")
    with pytest.raises(ValueError, match="weight column 'weight' not found"):
        read_parquet_embeddings(folder, weight="weight")
    with pytest.raises(ValueError, match="must be a fixed-size list or a list"):
        read_parquet_embeddings(folder, column="w")
    with pytest.raises(FileNotFoundError):
        read_parquet_embeddings(tmp_path / "nothing-here")


def test_parquet_ragged_list_error(tmp_path):
    emb = pa.array([[1.0, 2.0], [3.0, 4.0], [5.0], [6.0, 7.0]], pa.list_(pa.float32()))
    pq.write_table(pa.table({"embedding": emb}), tmp_path / "r.parquet")
    Xd = read_parquet_embeddings(tmp_path / "r.parquet").X
    with pytest.raises(ValueError, match="embedding of length 1 in r.parquet row group 0, "
                                         "row 2; expected 2"):
        Xd.compute()


def test_fit_from_parquet_and_dataframe(client, data, tmp_path):
    X, y = data
    _write_parquet(tmp_path / "x.parquet", X, "fixed", row_group_size=1000)
    C0 = seeds_one_per_blob(X, y, 6)
    kw = dict(init=C0, temperature_start=4.0, random_state=0, n_steps=4)
    mem = fa.AnnealedKMeans(6, **kw).fit(X)
    a = fa.AnnealedKMeans(6, backend="dask", scheduler=client, **kw).fit(
        str(tmp_path / "x.parquet"))
    assert rel(a.cluster_centers_, mem.cluster_centers_) <= TOL
    dd = pytest.importorskip("dask.dataframe")
    df = dd.read_parquet(str(tmp_path / "x.parquet"))
    b = fa.AnnealedKMeans(6, backend="dask", scheduler=client, **kw).fit(df)
    assert rel(b.cluster_centers_, mem.cluster_centers_) <= TOL
    np.testing.assert_array_equal(b.labels_, mem.labels_)


# ------------------------------------------------------------------------------- mini-batch
@pytest.fixture(scope="module")
def big_blobs():
    return blobs(30000, 8, 16, seed=4, sep=3.0)


def test_minibatch_close_to_full_batch(client, big_blobs, tmp_path):
    X, y = big_blobs
    full = fa.AnnealedKMeans(8, random_state=0).fit(X)
    ids = np.arange(X.shape[0]) * 7 + 3
    mb = MiniBatchAnnealedKMeans(8, random_state=0, scheduler=client, init_size=5000).fit(
        da.from_array(X, chunks=(1500, -1)), ids=da.from_array(ids, chunks=1500),
        labels_path=tmp_path / "labels")
    assert isinstance(mb.cluster_centers_, np.ndarray) and mb.cluster_centers_.shape == (8, 16)
    assert mb.inertia_ <= 1.01 * full.inertia_
    assert mb.n_batches_ >= mb.n_steps_ == 20
    # whole 1,500-row chunks, about 4,096 rows a batch (whatever the cluster), one batch a
    # temperature at least: 20 batches of 3 chunks
    assert mb.batch_chunks_ == 3 and mb.rows_seen_ == mb.n_batches_ * 3 * 1500
    # ``J`` of the final centers: the certificate holds at the final temperature
    W = X.shape[0]
    assert 0 <= mb.inertia_ - mb.free_energy_ <= mb.temperature_ * W * np.log(8) * (1 + 1e-9)
    # streaming writer: every row once, ids preserved, labels == predict
    assert sorted(os.listdir(tmp_path)) == ["labels"]
    tab = pq.read_table(tmp_path / "labels")
    assert len(os.listdir(tmp_path / "labels")) == 20          # one file per chunk
    assert tab.num_rows == X.shape[0]
    tab = tab.sort_by("row")
    np.testing.assert_array_equal(tab.column("row").to_numpy(), np.arange(X.shape[0]))
    np.testing.assert_array_equal(tab.column("id").to_numpy(), ids)
    labels = tab.column("label").to_numpy()
    np.testing.assert_array_equal(labels, mb.predict(X))
    assert ari(labels, full.labels_) >= 0.95
    assert ari(labels, y) >= 0.95
    lazy = mb.predict(da.from_array(X, chunks=(4000, -1)))
    assert hasattr(lazy, "dask")
    np.testing.assert_array_equal(lazy.compute(), labels)
    mb.scheduler = client
    mb2 = pickle.loads(pickle.dumps(mb))
    assert mb2.scheduler is None
    np.testing.assert_array_equal(mb2.cluster_centers_, mb.cluster_centers_)


def test_minibatch_on_dask_does_not_depend_on_the_cluster_size(tmp_path):
    """The default batch is about 4,096 rows of whole chunks whatever the cluster: one and
    three workers give the same fit (the batch was one chunk per worker thread: inertia
    112,624 vs 111,936 and ARI 0.885 between the two labelings); fit_predict returns the
    lazy predict out of core."""
    X = blobs(6000, 8, 16, seed=9)[0].astype(np.float32)
    Xd = da.from_array(X, chunks=(300, -1))
    fits = []
    for n in (1, 3):
        with distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=False,
                                      dashboard_address=None) as cluster, \
                distributed.Client(cluster, set_as_default=False) as c:
            mb = MiniBatchAnnealedKMeans(8, random_state=0, scheduler=c)
            lab = mb.fit_predict(Xd)
            assert hasattr(lab, "dask")
            fits.append((mb.batch_chunks_, mb.inertia_, mb.cluster_centers_, lab.compute()))
    (b1, j1, c1, l1), (b3, j3, c3, l3) = fits
    assert b1 == b3 == round(4096 / 300)
    assert j3 == pytest.approx(j1, rel=1e-9)
    np.testing.assert_allclose(c3, c1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(l3, l1)
    path = tmp_path / "x.parquet"
    _write_parquet(path, X, "list", row_group_size=1000)
    mb = MiniBatchAnnealedKMeans(8, random_state=0, n_steps=4)
    for src in (fa.open_parquet(path), path, str(path)):
        with pytest.raises(ValueError, match="fit_predict keeps no labels for an out-of-core"):
            mb.fit_predict(src)
        assert not hasattr(mb, "cluster_centers_")            # said before fitting
    # a Dask DataFrame with a column named X: its rows, not that column
    dd = pytest.importorskip("dask.dataframe")
    pd = pytest.importorskip("pandas")
    df = dd.from_pandas(pd.DataFrame(X[:, :4], columns=["X", "Y", "Z", "W"]), npartitions=3)
    import dask
    with dask.config.set(scheduler="synchronous"):
        lab = MiniBatchAnnealedKMeans(3, random_state=0, n_steps=4).fit_predict(df)
        assert lab.compute().shape == (6000,)


def test_minibatch_from_parquet_with_ids(client, big_blobs, tmp_path):
    X, y = big_blobs
    X32 = X[:12000].astype(np.float32)
    ids = np.array([f"r{i}" for i in range(X32.shape[0])], dtype=object)
    _write_parquet(tmp_path / "d.parquet", X32, "list", ids=ids, row_group_size=1000)
    mb = MiniBatchAnnealedKMeans(8, random_state=0, scheduler=client, batch_size=2000, n_steps=8,
                           polish_passes=0, init_size=3000).fit(
        read_parquet_embeddings(tmp_path / "d.parquet", id="doc_id"),
        labels_path=tmp_path / "out")
    assert mb.batch_chunks_ == 2 and mb.cluster_centers_.dtype == np.float32
    tab = pq.read_table(tmp_path / "out").sort_by("row")
    assert tab.num_rows == 12000
    assert tab.column("id").to_pylist() == list(ids)
    assert ari(tab.column("label").to_numpy(), y[:12000]) >= 0.95
    with pytest.raises(FileExistsError):
        write_labels(tmp_path / "d.parquet", mb.cluster_centers_, tmp_path / "out",
                     scheduler=client)
    res = write_labels(tmp_path / "d.parquet", mb.cluster_centers_, tmp_path / "out",
                       scheduler=client, overwrite=True)
    assert res["rows"] == 12000 and res["inertia"] == pytest.approx(mb.inertia_, rel=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["d.parquet", "out"]


def test_estimator_minibatch_mode(client, big_blobs):
    """``AnnealedKMeans(batch_size=...).fit`` on a Dask array runs
    :class:`MiniBatchAnnealedKMeans` with the estimator's parameters and sets the fitted
    attributes on it (NumPy); ``labels_`` is None (labels are streamed instead)."""
    X, y = big_blobs
    est = fa.AnnealedKMeans(8, random_state=0, n_steps=10, scheduler=client, batch_size=3000)
    assert est.fit(da.from_array(X, chunks=(1500, -1))) is est
    assert est.cluster_centers_.shape == (8, 16) and est.labels_ is None
    assert est.n_steps_ == 10 and est.cluster_weights_.sum() == pytest.approx(1.0)
    assert ari(est.predict(X), y) >= 0.95
    assert est.score(X) == pytest.approx(-est.inertia_, rel=1e-9)


def test_partial_fit_loop(big_blobs):
    X, y = big_blobs
    est = fa.AnnealedKMeans(8, random_state=0, n_steps=10)
    batches = np.array_split(np.arange(X.shape[0]), 30)
    temps = []
    for b in batches:
        est.partial_fit(X[b])
        temps.append(est.temperature_)
    assert np.all(np.diff(temps[:10]) < 0) and len(set(temps[9:])) == 1
    assert temps[-1] == pytest.approx(est.temperature_start_ * 0.05)
    assert est.n_steps_ == 30 and len(est.trace_) == 30
    assert ari(est.predict(X), y) >= 0.95
    assert est.cluster_weights_.sum() == pytest.approx(1.0)
    # the step-size rule
    running = est._partial_state.running
    assert running.step_size(0) == 1.0
    assert running.step_size(5) == pytest.approx((5 + 1.0) ** -0.6)
    est2 = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(est2.predict(X[:50]), est.predict(X[:50]))
    est2.partial_fit(X[:500])
    assert est2.n_steps_ == 31
    with pytest.raises(ValueError, match="at least n_clusters=8"):
        fa.AnnealedKMeans(8).partial_fit(X[:5])
    with pytest.raises(ValueError, match="learning_decay"):
        fa.AnnealedKMeans(8, learning_decay=0.4).partial_fit(X[:100])


# ------------------------------------------------------------------------------- faults
def test_worker_sigkill_mid_fit(client, monkeypatch):
    X, y = blobs(24000, 6, 16, seed=8)
    Xd = da.from_array(X, chunks=(2000, -1))
    C0 = seeds_one_per_blob(X, y, 6)
    kw = dict(init=C0, temperature_start=8.0, random_state=0, n_steps=8, scheduler=client)
    ref = fa.AnnealedKMeans(6, **kw).fit(Xd)
    pids = client.run(os.getpid)
    victim = sorted(pids.values())[0]
    calls = {"n": 0}
    killed = threading.Event()
    orig = DaskSource.moments

    def killer():
        time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        killed.set()

    def moments(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:       # (the fit makes 6 moments passes: more follow the kill)
            threading.Thread(target=killer, daemon=True).start()
        return orig(self, *a, **k)
    monkeypatch.setattr(DaskSource, "moments", moments)
    est = fa.AnnealedKMeans(6, **kw).fit(Xd)
    assert killed.is_set() and calls["n"] > 5
    client.wait_for_workers(2, timeout=60)
    assert victim not in client.run(os.getpid).values()       # the worker was replaced
    np.testing.assert_array_equal(est.cluster_centers_, ref.cluster_centers_)
    np.testing.assert_array_equal(est.labels_, ref.labels_)
    assert est.inertia_ == ref.inertia_


def test_embedded_cluster_listens_on_loopback_only(monkeypatch):
    """The embedded cluster (no scheduler, no default client) opens no listener reachable
    from the network: its scheduler's HTTP routes bind 127.0.0.1."""
    import distributed
    from fastanneal.dask import _cluster

    def no_default():
        raise ValueError("no default client")
    monkeypatch.setattr(distributed, "default_client", no_default)
    h = _cluster.resolve_client(None)
    try:
        assert h.owned and h.cluster is not None
        port = h.client.scheduler_info()["services"]["dashboard"]
        listeners = []
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(name).read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                local, state = line.split()[1], line.split()[3]
                ip, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:      # LISTEN
                    listeners.append(ip)
        assert listeners, f"nothing listens on port {port}"
        assert set(listeners) <= {"0100007F", "00000000000000000000000001000000"}, listeners
    finally:
        h.close()


def test_chunks_are_persisted_in_one_submission_on_their_planned_workers(client,
                                                                         monkeypatch):
    """``DaskSource`` places each chunk on a planned worker (balanced by rows) with task
    annotations in ONE graph submission: computing each chunk's delayed on its own shipped
    the whole array graph once per chunk (quadratic in the chunks: 18 s for 400 chunks on
    two workers). Every chunk is where it was planned, and a pass is still exact."""
    from fastanneal.dask import DaskSource
    from fastanneal.dask._cluster import ClientHandle
    sizes = [40, 40] + [10] * 118
    X = np.random.default_rng(3).normal(size=(sum(sizes), 6))
    Xd = da.from_array(X, chunks=(tuple(sizes), 6))
    calls = []
    real = client.compute

    def compute(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(client, "compute", compute)
    src = DaskSource(Xd, None, 0, ClientHandle(client))
    try:
        assert len(calls) == 1
        where = src._placement()
        assert where is not None and len(set(where)) == 2
        who = client.who_has(src._chunks)
        assert all(where[i] in who[f.key] for i, f in enumerate(src._chunks))
        C = X[:4].copy()
        got = src.moments(C, 1.0, 0, None, False)
        want = fa.moments(X, C, 1.0)
        np.testing.assert_allclose(got.S, want.S, rtol=1e-10, atol=1e-10)
    finally:
        src.close()


def _record_bits(r):
    """A record (Moments, GradForward / GradMoments, array) as comparable arrays."""
    if isinstance(r, np.ndarray):
        return [r]
    out = []
    for v in vars(r).values():
        if isinstance(v, (np.ndarray, float, int, np.floating, np.integer)):
            out.append(np.asarray(v))
    return out


def _same_bits(a, b):
    ra, rb = _record_bits(a), _record_bits(b)
    assert len(ra) == len(rb) and ra
    for x, y in zip(ra, rb):
        np.testing.assert_array_equal(x, y)


def test_fused_passes_are_the_same_bits_in_fewer_tasks(monkeypatch):
    """With many chunks per worker thread a pass computes each group of SPLIT_EVERY
    consecutive chunks and their merge in one task: the scheduler's per-task cost was the
    pass time of small chunks (BENCHMARKS.md section 7). Every reduction of the source --
    moments (soft, hard with hard sums), the gradient's two passes, mean, covariance,
    objective, the clusters' eigenvalues, distinct rows -- gives the same bits fused,
    unfused, and with some groups unfused (chunks that do not share a worker); a pass
    submits about one task per group instead of one per chunk."""
    from fastanneal.dask import DaskSource
    from fastanneal.dask import _source as S_
    from fastanneal.dask._cluster import ClientHandle
    from fastanneal.gradient import value_and_grad_from_source
    from fastanneal import _grad_kernels as G_
    X = blobs(1000, 5, 4, seed=11)[0]
    X[7] = X[3]                                  # a duplicate for the distinct-rows count
    w = np.random.default_rng(2).uniform(0.5, 2.0, len(X))
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster, set_as_default=False) as c:
        src = DaskSource(da.from_array(X, chunks=(12, -1)), da.from_array(w, chunks=12), 0,
                         ClientHandle(c))
        try:
            n = len(src._chunks)
            groups = -(-n // S_.SPLIT_EVERY)
            assert n == 84 and src._fused == [True] * groups
            C = X[:5] + 0.1

            def run_all():
                lam = src.cluster_top_eigenvalues(C, 30, np.random.default_rng(0))
                return [src.moments(C, 2.0), src.moments(C, 0.0, 2, None, True),
                        value_and_grad_from_source(src, C, 2.0, 0, 0.1,
                                                   G_.PHI_IDENTITY).grad_centers,
                        src.mean(), src.covariance(), np.array(src.objective(C)[0]),
                        np.asarray(lam), np.array(src.n_distinct_rows(
                            np.random.default_rng(0), 10_000))]
            tasks = []
            for name in ("map", "submit"):
                real = getattr(c, name)

                def counted(func, *a, _real=real, _name=name, **k):
                    out = _real(func, *a, **k)
                    tasks.append(len(out) if _name == "map" else 1)
                    return out
                monkeypatch.setattr(c, name, counted)
            fused = run_all()
            tasks.clear()
            src.moments(C, 2.0)
            # the groups, the tree above them (2 + 1), the centers' put
            assert sum(tasks) <= groups + 4, tasks
            src._fused = None
            tasks.clear()
            src.moments(C, 2.0)
            assert sum(tasks) >= n + groups, tasks
            unfused = run_all()
            src._fused = [i % 3 != 0 for i in range(groups)]
            mixed = run_all()
            for a, b, m in zip(fused, unfused, mixed):
                _same_bits(a, b)
                _same_bits(a, m)
            assert int(fused[-1]) == 999
            want = fa.moments(X, C, 2.0, weights=w)
            np.testing.assert_allclose(fused[0].S, want.S, rtol=1e-10, atol=1e-10)
        finally:
            src.close()


def test_fused_groups_are_placed_whole_and_a_fit_is_the_same(client, monkeypatch):
    """On two workers, with enough groups per thread, each group of consecutive chunks is
    placed on one worker (its fused task reads local chunks), the groups balance the rows,
    and a whole fit gives the same bits as with fusing switched off."""
    from fastanneal.dask import DaskSource
    from fastanneal.dask import _source as S_
    from fastanneal.dask._cluster import ClientHandle
    X = blobs(1300, 4, 3, seed=5)[0]
    Xd = da.from_array(X, chunks=(10, -1))
    src = DaskSource(Xd, None, 0, ClientHandle(client))
    try:
        n = len(src._chunks)
        assert n == 130 and src._fused == [True] * 17
        who = client.who_has(src._chunks)
        held = [set(who[f.key]) for f in src._chunks]
        for i in range(0, n, S_.SPLIT_EVERY):
            assert len(set.union(*held[i:i + S_.SPLIT_EVERY])) == 1
        # Dask sees the persisted chunks' real size (it saw 56 bytes a chunk: the memory
        # accounting missed the data, and the scheduler moved chunks as if free, splitting
        # the groups; 8-11 % of the data moved on every fused pass)
        seen = client.nbytes(keys=[f.key for f in src._chunks], summary=False)
        assert X.nbytes <= sum(seen.values()) <= X.nbytes + 200 * n
        per_worker = {}
        for i, h in enumerate(held):
            (wk,) = h
            per_worker[wk] = per_worker.get(wk, 0) + src.chunk_rows[i]
        assert len(per_worker) == 2 and abs(np.subtract(*per_worker.values())) <= 80
    finally:
        src.close()
    fits = []
    for groups in (S_.FUSE_GROUPS_PER_THREAD, 10 ** 9):
        monkeypatch.setattr(S_, "FUSE_GROUPS_PER_THREAD", groups)
        km = fa.AnnealedKMeans(4, backend="dask", scheduler=client, random_state=0).fit(Xd)
        fits.append(km)
    np.testing.assert_array_equal(fits[0].cluster_centers_, fits[1].cluster_centers_)
    np.testing.assert_array_equal(fits[0].labels_, fits[1].labels_)
    assert fits[0].inertia_ == fits[1].inertia_


# ---------------------------------------------------------------- rows far from the origin
def test_rows_far_from_the_origin_give_the_in_memory_partition(client, tmp_path):
    """float32 rows near 3e3 with spread ~0.3: every route measures them from their mean
    (docs/theory.md, "Rows far from the origin"); without it the Dask routes found ARI ~0.3."""
    from sklearn.metrics import adjusted_rand_score
    g = np.random.default_rng(4)
    means = g.normal(size=(4, 5)) * 2.0
    y = np.repeat(np.arange(4), 500)
    X = (means[y] + 0.3 * g.standard_normal((2000, 5)) + 3000.0).astype(np.float32)
    mem = fa.AnnealedKMeans(4, random_state=0).fit(X)
    assert adjusted_rand_score(y, mem.labels_) == 1.0
    full = fa.AnnealedKMeans(4, backend="dask", scheduler=client, random_state=0).fit(
        da.from_array(X, chunks=(300, 5)))
    assert adjusted_rand_score(y, full.labels_) == 1.0
    assert full.inertia_ == pytest.approx(mem.inertia_, rel=1e-4)
    mb = MiniBatchAnnealedKMeans(4, batch_size=600, scheduler=client, random_state=0).fit(
        da.from_array(X, chunks=(300, 5)), labels_path=str(tmp_path / "lab"))
    lab = pq.read_table(tmp_path / "lab").sort_by("row").column("label").to_numpy()
    assert adjusted_rand_score(y, lab) == 1.0
    _write_parquet(tmp_path / "x.parquet", X, "fixed", row_group_size=250)
    st = fa.open_parquet(str(tmp_path / "x.parquet"))
    pm = MiniBatchAnnealedKMeans(4, batch_size=500, random_state=0).fit(st)
    assert adjusted_rand_score(y, pm.predict(X)) == 1.0
    assert pm.cluster_centers_.dtype == np.float32
    # the lazy predict of a Dask array measures rows from the fit's origin too
    np.testing.assert_array_equal(
        np.asarray(mem.predict(da.from_array(X, chunks=(300, 5))).compute()), mem.labels_)
    # one stream, several fits (the second once read its sample in the first's frame)
    pm2 = MiniBatchAnnealedKMeans(4, batch_size=500, random_state=1).fit(st)
    assert adjusted_rand_score(y, pm2.predict(X)) == 1.0
    assert fa.suggest_k(st, k_max=8, random_state=0).best == 4
    st2 = fa.open_parquet(str(tmp_path / "x.parquet"))
    assert fa.suggest_k(st2, k_max=8, random_state=0).best == 4
    fs = fa.AnnealedKMeans(4, random_state=0).fit_source(st2)
    assert adjusted_rand_score(y, fs.predict(X)) == 1.0
    # the public label writers with the fit's centers, in the data's coordinates
    d = ((X.astype(np.float64)[:, None] - mem.cluster_centers_.astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_array_equal(
        fa.dask.predict_labels(da.from_array(X, chunks=(300, 5)), mem.cluster_centers_)
        .compute(), d.argmin(1))
    out = write_labels(da.from_array(X, chunks=(300, 5)), mem.cluster_centers_,
                       str(tmp_path / "wl"), scheduler=client)
    assert out["inertia"] == pytest.approx(d.min(1).sum(), rel=1e-5)
    # a checkpoint of raw-frame centers is not resumed by shifted chunks
    src = fa.AnnealedKMeans(4, backend="dask", scheduler=client)._make_source(
        da.from_array(X, chunks=(300, 5)), None)[0]
    near = fa.AnnealedKMeans(4, backend="dask", scheduler=client)._make_source(
        da.from_array(X - np.float32(3000.0), chunks=(300, 5)), None)[0]
    try:
        assert src.origin is not None and src.fingerprint().endswith(":centered")
        assert near.origin is None and not near.fingerprint().endswith(":centered")
    finally:
        src.close()
        near.close()


def test_dataframe_inputs_and_weight_errors(client):
    import pandas as pd
    dd = pytest.importorskip("dask.dataframe")
    g = np.random.default_rng(5)
    pdf = pd.DataFrame({"x0": g.normal(size=300), "x1": g.normal(size=300),
                        "query": [f"q{i}" for i in range(300)],
                        "impressions": g.integers(1, 5, 300)})
    df = dd.from_pandas(pdf, npartitions=3)
    # a named embedding column that is absent is an error, not the numeric columns
    with pytest.raises(ValueError, match="'embeddings' not found"):
        fa.dask.embeddings_from_dataframe(df, column="embeddings")
    # without an embedding column: the numeric columns (a text column is not one)
    arr = fa.dask.embeddings_from_dataframe(df, weight="impressions")
    assert arr.X.shape == (300, 2)
    # a Dask Series as weights
    m = fa.AnnealedKMeans(2, backend="dask", scheduler=client, random_state=0).fit(
        df[["x0", "x1"]], sample_weight=df["impressions"])
    np.testing.assert_array_equal(m.predict(df[["x0", "x1"]]).compute(),
                                  m.predict(pdf[["x0", "x1"]].to_numpy()))
    # arrays that Dask turned into strings are named as such
    obj = dd.from_pandas(pd.DataFrame({"emb": [np.ones(3) * i for i in range(30)]}),
                         npartitions=2)
    if obj["emb"].dtype != object:          # dask's convert-string (the default here)
        with pytest.raises(ValueError, match="list of numbers"):
            fa.dask.embeddings_from_dataframe(obj, column="emb")
    else:                                   # kept as objects: they are the embeddings
        assert fa.dask.embeddings_from_dataframe(obj, column="emb").X.shape == (30, 3)
    Xd = da.from_array(g.normal(size=(300, 2)), chunks=100)
    w = np.ones(300)
    w[250] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        MiniBatchAnnealedKMeans(2, scheduler=client, random_state=0).fit(
            Xd, sample_weight=da.from_array(w, chunks=100))
    with pytest.raises(ValueError, match="negative"):
        MiniBatchAnnealedKMeans(2, scheduler=client, random_state=0).fit(
            Xd, sample_weight=da.from_array(-np.ones(300), chunks=100))


def test_predict_labels_checks_its_input():
    from fastanneal.dask import predict_labels
    C = np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])       # not unit: normalised for cosine
    X = np.random.default_rng(0).normal(size=(50, 3))
    Xd = da.from_array(X, chunks=20)
    cos = (X / np.linalg.norm(X, axis=1, keepdims=True)) @ (C / np.linalg.norm(
        C, axis=1, keepdims=True)).T
    np.testing.assert_array_equal(predict_labels(Xd, C, "cosine").compute(), cos.argmax(1))
    with pytest.raises(ValueError, match="features"):
        predict_labels(Xd[:, :2], C)
    with pytest.raises(ValueError, match="2-D"):
        predict_labels(Xd[:, 0], C)
    Z = X.copy()
    Z[45] = 0.0
    with pytest.raises(ValueError, match="row 45"):
        predict_labels(da.from_array(Z, chunks=20), C, "cosine").compute()


def test_write_labels_overwrites_a_file_and_zeros_is_the_identity(tmp_path):
    X = np.random.default_rng(1).normal(size=(40, 3))
    target = tmp_path / "labels"
    target.write_text("an old file")
    out = write_labels(da.from_array(X, chunks=15), X[:2], str(target), overwrite=True)
    assert out["rows"] == 40 and target.is_dir()
    assert sorted(os.listdir(tmp_path)) == ["labels"]
    for kw in ({"metric": "cosine"}, {"responsibilities": "entmax15"},
               {"responsibilities": "hard"}):
        m = fa.moments(X, X[:2], 0.5, **kw)
        z = fa.Moments.zeros(2, 3, 0.5) + m
        np.testing.assert_array_equal(z.N, m.N)
        assert z.rows == 40 and z.metric == m.metric


def test_a_corrupt_file_is_named_and_mixed_float_widths_read_as_the_widest(tmp_path):
    """A truncated or empty file in a folder is a ValueError naming it (pyarrow's own
    message named none); a folder of float32 then float64 files reads as float64 (the first
    file's float32 narrowed the second file's values)."""
    rng = np.random.default_rng(2)
    for sub, kinds in (("c", (np.float32, np.float32)), ("m", (np.float32, np.float64)),
                       ("r", (np.float64, np.float32))):
        (tmp_path / sub).mkdir()
        for i, dt in enumerate(kinds):
            X = rng.standard_normal((20, 3)).astype(dt)
            pq.write_table(pa.table({"embedding": pa.array(list(X), type=pa.list_(
                pa.float32() if dt == np.float32 else pa.float64()))}),
                tmp_path / sub / f"p{i}.parquet")
    whole = (tmp_path / "c" / "p1.parquet").read_bytes()
    (tmp_path / "c" / "p1.parquet").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=r"p1.parquet is not a readable Parquet file"):
        read_parquet_embeddings(tmp_path / "c")
    (tmp_path / "c" / "p1.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"p1.parquet is not a readable Parquet file"):
        read_parquet_embeddings(tmp_path / "c")
    assert read_parquet_embeddings(tmp_path / "m").X.dtype == np.float64
    assert read_parquet_embeddings(tmp_path / "r").X.dtype == np.float64


def test_parquet_null_ids_and_a_changed_file_are_errors(tmp_path):
    """A null in the id (or weight) column is an error naming its row (converting it would
    turn the ids into floats: a null id became -2^63 and ids above 2^53 were rounded into
    duplicates), and a file rewritten with fewer rows after ``read_parquet_embeddings``
    opened it is an error, not a fit on fewer rows."""
    X = np.random.default_rng(3).standard_normal((40, 3)).astype(np.float32)
    big = [2 ** 53 + 1 + i for i in range(40)]
    ids = pa.array([None if i == 27 else v for i, v in enumerate(big)], type=pa.int64())
    emb = pa.array(list(X), type=pa.list_(pa.float32()))
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"embedding": emb, "id": ids, "big": pa.array(big)}), path,
                   row_group_size=10)
    arr = read_parquet_embeddings(path, id="id")
    with pytest.raises(ValueError, match=r"column 'id' has a null in n.parquet row group "
                                         r"2, row 27"):
        arr.ids.compute()
    ok = read_parquet_embeddings(path, id="big").ids.compute()
    assert ok.dtype == np.int64 and ok.tolist() == big          # exact above 2^53
    arr = read_parquet_embeddings(path)
    pq.write_table(pa.table({"embedding": emb[:35]}), path, row_group_size=10)
    with pytest.raises(ValueError, match=r"n.parquet changed after read_parquet_embeddings "
                                         r"opened it"):
        arr.X.compute()
    # rewritten with other rows in the same layout (the row counts alone let it through:
    # predict read the new rows silently)
    arr = read_parquet_embeddings(path)
    st = os.stat(path)
    pq.write_table(pa.table({"embedding": pa.array(list(X[::-1]),
                                                   type=pa.list_(pa.float32()))}),
                   path, row_group_size=10)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))          # the same mtime
    with pytest.raises(ValueError, match=r"changed after read_parquet_embeddings"):
        arr.X.compute()
    # an identical copy with another modification time (each machine its own copy, a
    # touch) is the same file
    arr = read_parquet_embeddings(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    assert arr.X.compute().shape == (40, 3)
    from fastanneal.dask._inputs import read_parquet_piece       # (no stamp: row counts)
    short = tmp_path / "short.parquet"
    pq.write_table(pa.table({"embedding": emb[:35]}), short, row_group_size=10)
    with pytest.raises(ValueError, match=r"has 35 rows, but the dataset was opened with 40"):
        read_parquet_piece(str(short), [0, 1, 2, 3], "embedding", 3, np.float32, rows=40)


def test_chunks_that_do_not_hold_their_declared_shape_are_errors(client):
    """A chunk whose data does not have the rows or columns its Dask array declares (a
    wrong from_delayed shape, data changed under the graph) is an error naming the chunk on
    the full-batch, mini-batch and predict routes: rows are never silently dropped."""
    import dask
    X = blobs(300, 3, 4, seed=2)[0]
    assert X.shape == (300, 4)
    same = dask.delayed(lambda a: a, pure=True)
    pieces = [X[:100], X[100:190], X[200:]]               # the middle one holds 90 rows
    lying = da.concatenate([da.from_delayed(same(p), (100, 4), X.dtype) for p in pieces])
    msg = r"X chunk 1 holds 90 rows, but the array declares 100 for it"
    with pytest.raises(ValueError, match=msg):
        fa.AnnealedKMeans(3, random_state=0, scheduler=client).fit(lying)
    with pytest.raises(ValueError, match=msg):
        MiniBatchAnnealedKMeans(3, random_state=0, scheduler=client).fit(lying)
    km = fa.AnnealedKMeans(3, random_state=0).fit(X)
    with pytest.raises(ValueError, match=msg):
        km.predict(lying).compute(scheduler="synchronous")
    cols = [X[:100], X[100:200, :3], X[200:]]
    lying = da.concatenate([da.from_delayed(same(p), (100, 4), X.dtype) for p in cols])
    with pytest.raises(ValueError, match=r"X chunk 1 holds 3 columns, but the array "
                                         r"declares 4"):
        fa.AnnealedKMeans(3, random_state=0, scheduler=client).fit(lying)


def test_paths_and_embedding_arrays_take_the_dask_backend_by_themselves(client, tmp_path):
    """``AnnealedKMeans().fit`` reads a Parquet path or an EmbeddingArrays through Dask
    without ``backend="dask"`` (as the docstring says; it failed converting them to floats)
    and gives that backend's result; another backend refuses them by name."""
    X = blobs(600, 3, 4, seed=5)[0].astype(np.float32)
    path = tmp_path / "e.parquet"
    pq.write_table(pa.table({"embedding": pa.array(list(X), type=pa.list_(pa.float32()))}),
                   path, row_group_size=200)
    arr = read_parquet_embeddings(path)
    ref = fa.AnnealedKMeans(3, random_state=0, backend="dask", scheduler=client).fit(arr)
    for src in (arr, str(path), path, [path]):
        got = fa.AnnealedKMeans(3, random_state=0, scheduler=client).fit(src)
        np.testing.assert_array_equal(got.labels_, ref.labels_)
    for backend in ("cpu", "cuda"):
        with pytest.raises(TypeError, match=r"only the Dask backend reads; got "
                                            rf"backend='{backend}'"):
            fa.AnnealedKMeans(3, backend=backend).fit(path)


def test_a_scheduler_without_workers_is_an_error_not_a_hang(monkeypatch):
    """A scheduler with no workers takes the tasks and never runs them: the fit waits
    ``FASTANNEAL_WORKER_TIMEOUT`` seconds for a first worker, then says so."""
    monkeypatch.setenv("FASTANNEAL_WORKER_TIMEOUT", "1")
    cluster = distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=None)
    c = distributed.Client(cluster, set_as_default=False)
    try:
        X = da.from_array(blobs(200, 2, 3, seed=1)[0], chunks=(50, -1))
        for est in (fa.AnnealedKMeans(2, scheduler=c), MiniBatchAnnealedKMeans(2, scheduler=c)):
            with pytest.raises(RuntimeError, match=r"has no workers \(waited 1 s\): start "
                                                   r"some \(`dask worker"):
                est.fit(X)
    finally:
        c.close()
        cluster.close()


def test_workers_lost_mid_fit_are_an_error_not_a_hang(monkeypatch):
    """Every worker gone while results are awaited (killed, retired): the tasks would wait
    for new workers without end; after ``FASTANNEAL_WORKER_TIMEOUT`` seconds without a
    worker the wait says so. A full-batch pass whose cluster loses its workers between two
    passes fails the same way."""
    from fastanneal.dask._cluster import ClientHandle, ClusterLostError
    monkeypatch.setenv("FASTANNEAL_WORKER_TIMEOUT", "1")
    monkeypatch.setattr(ClientHandle, "POLL", 0.2)
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                       dashboard_address=None)
    c = distributed.Client(cluster, set_as_default=False)
    try:
        h = ClientHandle(c)
        assert h.result(c.submit(int, 3)) == 3 and h.result([c.submit(int, 4)]) == [4]
        src = DaskSource(da.from_array(blobs(400, 2, 3, seed=1)[0], chunks=(100, -1)), None,
                         0, h)
        C = np.zeros((2, 3))
        src.moments(C, 1.0)
        cluster.scale(0)
        deadline = time.time() + 30
        while c.scheduler_info(n_workers=-1)["workers"] and time.time() < deadline:
            time.sleep(0.1)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"has had no workers for 1 s while this fit "
                                               r"waited for results"):
            src.moments(C, 1.0)
        assert time.perf_counter() - t0 < 20
        with pytest.raises(RuntimeError, match="has had no workers"):
            h.result(c.submit(int, 5, pure=False))
        # the tasks cancelled (a scheduler that went away cancels them): said so
        f = c.submit(int, 6, pure=False)
        f.cancel()
        with pytest.raises(ClusterLostError, match="tasks were cancelled or its connection "
                                                   "closed on the Dask cluster"):
            h.result(f)
        # a client that lost its scheduler has no identity left: not a KeyError
        monkeypatch.setattr(c, "scheduler_info", lambda **k: {})
        with pytest.raises(ClusterLostError, match="went away"):
            h.result(c.submit(int, 7, pure=False))
    finally:
        c.close()
        cluster.close()


def test_many_tiny_chunks_are_a_performance_warning():
    """500 chunks of 8 rows made a 4,000-row fit take 89 s against 2.7 s in one chunk: the
    input check says so (and how to rechunk); ordinary chunking says nothing."""
    import warnings
    from fastanneal.dask import as_dask_inputs
    from fastanneal.dask import SmallChunksWarning
    X = np.zeros((4000, 3))
    with pytest.warns(SmallChunksWarning, match=r"500 chunks of 8 rows on average.*rechunk.*"
                                                r"larger row groups"):
        as_dask_inputs(da.from_array(X, chunks=(8, -1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        as_dask_inputs(da.from_array(X, chunks=(100, -1)))      # 40 chunks: fine
        as_dask_inputs(da.from_array(np.zeros((200_000, 3)), chunks=(2000, -1)))


def test_weights_summing_to_infinity_are_named_on_the_dask_route(client):
    """Finite weights whose sum overflows: the full-batch Dask route says so (it said
    "all rows are identical"), as the in-memory and mini-batch routes do."""
    X = blobs(300, 3, 3, seed=4)[0]
    w = np.ones(300)
    w[[5, 200]] = 1e308
    for est in (fa.AnnealedKMeans(3, scheduler=client),
                MiniBatchAnnealedKMeans(3, scheduler=client)):
        with pytest.raises(ValueError, match="sample_weight sums to infinity"):
            est.fit(da.from_array(X, chunks=(100, -1)), sample_weight=da.from_array(w, 100))


def test_minibatch_weight_errors_name_their_row(client):
    """The mini-batch route reads the weights through the chunks' own tasks and names the
    first bad row (it gave only a count)."""
    X = da.from_array(blobs(400, 2, 3, seed=6)[0], chunks=(100, -1))
    for bad, what in ((np.nan, "NaN"), (np.inf, "infinity"), (-1.0, "negative values")):
        w = np.ones(400)
        w[[250, 260]] = bad
        with pytest.raises(ValueError, match=rf"sample_weight contains {what} \(2 rows; the "
                                             r"first is row 250\)"):
            MiniBatchAnnealedKMeans(2, scheduler=client).fit(
                X, sample_weight=da.from_array(w, chunks=100))


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_inference_on_dask_input_is_lazy_and_equals_numpy(metric):
    """transform / predict_proba give lazy Dask arrays (they computed the whole N x K
    result into memory), score reduces chunk by chunk; all equal the NumPy results, and a
    bad row is named as in predict."""
    import dask
    X = blobs(300, 3, 5, seed=8)[0].astype(np.float32)
    X[:, 0] += 1e3                                  # far from the origin: the fit's frame
    w = np.random.default_rng(2).uniform(0.5, 2.0, 300)
    km = fa.AnnealedKMeans(3, metric=metric, random_state=0).fit(X)
    Xd = da.from_array(X, chunks=(70, 3))
    with dask.config.set(scheduler="synchronous"):
        t, p = km.transform(Xd), km.predict_proba(Xd)
        pf = km.predict_proba(Xd, temperature="final")
        assert all(isinstance(a, da.Array) and a.dtype == np.float32 for a in (t, p, pf))
        np.testing.assert_array_equal(t.compute(), km.transform(X))
        np.testing.assert_array_equal(p.compute(), km.predict_proba(X))
        np.testing.assert_array_equal(pf.compute(), km.predict_proba(X, temperature="final"))
        wd = da.from_array(w, chunks=45)
        unknown = wd[wd > 0]                        # NaN chunk sizes (as fit takes them)
        series = pytest.importorskip("dask.dataframe").from_dask_array(wd)
        for sw in (None, w, wd, unknown, series):
            ref = km.score(X, sample_weight=None if sw is None else w)
            assert km.score(Xd, sample_weight=sw) == pytest.approx(ref, rel=1e-12)
        with pytest.raises(ValueError, match="sample_weight has 299 entries for 300 rows"):
            km.score(Xd, sample_weight=wd[1:])
        # every chunk's faults in row order (it named whichever chunk failed first)
        with pytest.raises(ValueError, match=r"negative values \(300 rows; the first is "
                                             r"row 0\)"):
            km.score(Xd, sample_weight=-da.from_array(w, chunks=45))
        with pytest.raises(ValueError, match="sums to zero"):
            km.score(Xd, sample_weight=da.zeros(300, chunks=45))
        with pytest.raises(ValueError, match="sums to infinity"):
            km.score(Xd, sample_weight=da.full(300, 1e308, chunks=45))
        bad = w.copy()
        bad[222] = -1.0
        with pytest.raises(ValueError, match=r"negative values \(1 rows; the first is row "
                                             r"222\)"):
            km.score(Xd, sample_weight=da.from_array(bad, chunks=45))
        Xn = X.copy()
        Xn[123, 2] = np.nan
        for call in (km.transform, km.predict_proba, km.score):
            with pytest.raises(ValueError, match=r"NaN in chunk 1 \(rows 70-139\); first at "
                                                 r"row 123"):
                out = call(da.from_array(Xn, chunks=(70, 3)))
                out.compute() if hasattr(out, "compute") else None


def test_an_adaptive_cluster_scaled_to_zero_starts_its_workers(monkeypatch):
    """A cluster that starts workers only for pending work (adapt(minimum=0)) is not "a
    scheduler without workers": the fit's probe task makes it scale up."""
    monkeypatch.setenv("FASTANNEAL_WORKER_TIMEOUT", "30")
    cluster = distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=None)
    cluster.adapt(minimum=0, maximum=1, interval="100ms")
    c = distributed.Client(cluster, set_as_default=False)
    try:
        X = blobs(200, 2, 3, seed=1)[0]
        km = fa.AnnealedKMeans(2, random_state=0, scheduler=c).fit(
            da.from_array(X, chunks=(50, -1)))
        ref = fa.AnnealedKMeans(2, random_state=0).fit(X)
        assert ari(km.labels_, ref.labels_) == 1.0
    finally:
        c.close()
        cluster.close()


def test_minibatch_errors_name_the_first_bad_chunk(client):
    """Bad values in several chunks: the out-of-core route reports the first of them in
    row order, whichever task failed first in time (a slow first bad chunk included)."""
    import dask
    X = blobs(600, 2, 3, seed=3)[0]
    X[130, 1] = np.nan
    X[530, 0] = np.inf

    def slow(a, delay):
        import time
        time.sleep(delay)
        return a
    parts = [da.from_delayed(dask.delayed(slow, pure=True)(X[a:a + 100], 0.5 if a == 100
                                                           else 0.0), (100, 3), X.dtype)
             for a in range(0, 600, 100)]
    Xd = da.concatenate(parts)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"NaN in chunk 1 \(rows 100-199\); first at "
                                             r"row 130"):
            MiniBatchAnnealedKMeans(2, scheduler=client, random_state=0,
                                    init_size=600).fit(Xd)

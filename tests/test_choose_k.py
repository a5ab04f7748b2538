"""Choosing K from the phase transitions (``fastanneal.suggest_k``,
``AnnealedKMeans(n_clusters="auto")``)."""
import numpy as np
import pyarrow as pa
import pytest
from sklearn.metrics import adjusted_rand_score

import fastanneal
from fastanneal._engine import effective_groups


def blobs(K, D, sep, n=150, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(K, D)) * sep
    X = np.concatenate([c + rng.normal(size=(n, D)) for c in centers])
    return X, np.repeat(np.arange(K), n)


@pytest.mark.parametrize("K,D,sep", [(4, 2, 10), (8, 5, 8), (12, 10, 6), (6, 64, 3)])
def test_suggest_k_finds_the_true_k(K, D, sep):
    X, _ = blobs(K, D, sep)
    s = fastanneal.suggest_k(X, k_max=2 * K, random_state=0)
    assert s.best == K, s.table()[:4]
    i = K - 2
    assert s.width[i] == s.width.max() > 0
    assert s.levels[-1] == K
    # the evidence is consistent: the plateau lies inside the path's temperatures, and the
    # winner's plateau is wider than the runner-up's by a clear margin
    assert s.critical_temperature * 1.02 >= s.t_in[i] > s.t_out[i] > 0
    runner_up = np.sort(s.width)[-2]
    assert s.width[i] > 1.5 * runner_up
    assert s.ranking[0] == K and sorted(s.ranking) == sorted(set(s.ranking))
    rows = s.table()
    assert rows[0]["k"] == K and rows[0]["rank"] == 1
    assert s.supported


def test_no_plateau_on_a_single_high_dimensional_gaussian():
    """An isotropic Gaussian in many dimensions has no natural K: below T_c every half is as
    unstable as the whole and the splits come in a burst. The suggestion says so."""
    X = np.random.default_rng(5).normal(size=(1500, 64))
    s = fastanneal.suggest_k(X, k_max=16, random_state=0)
    assert not s.supported
    assert s.width.max() <= 2.5 * -np.log(0.85)


def test_widths_are_measured_on_the_path():
    """The widths add up the log-temperature steps spent at each effective K: together they
    cover the path from the first split down to where it stopped."""
    X, _ = blobs(5, 3, 10, seed=2)
    s = fastanneal.suggest_k(X, k_max=9, random_state=0)
    tr = s.trace.as_dict()
    T = tr["temperature"]
    assert T[0] >= s.t_in[np.isfinite(s.t_in)].max()
    # the widths are measured on the effective-cluster path: K's width is the log-T span
    # of the path's temperatures with K effective clusters
    Tp, kp = s.path_temperature, s.path_clusters
    for k in (3, 5):
        j = np.nonzero(kp == k)[0]
        if j.size:
            nxt = np.append(Tp[1:], s.t_out[k - 2])[j]
            assert s.width[k - 2] == pytest.approx(np.log(Tp[j] / nxt).sum(), rel=1e-9)
    covered = s.width.sum()
    span = np.log(np.nanmax(s.t_in) / np.nanmin(s.t_out))
    assert covered == pytest.approx(span, rel=1e-9)


def test_effective_groups_merge_close_codevectors():
    C = np.array([[0.0, 0.0], [0.01, 0.0], [5.0, 5.0], [5.0, 5.02], [9.0, 0.0]])
    lab = effective_groups(C, 0.01)
    assert lab.max() + 1 == 3 and lab[0] == lab[1] and lab[2] == lab[3] != lab[4]
    assert effective_groups(C, 1e-8).max() + 1 == 5


def test_auto_estimator_continues_from_the_path():
    X, y = blobs(6, 4, 8, seed=1)
    km = fastanneal.AnnealedKMeans("auto", k_max=12, random_state=0).fit(X)
    assert km.n_clusters_ == 6 == km.cluster_centers_.shape[0]
    assert km.k_suggestion_.best == 6
    assert adjusted_rand_score(y, km.labels_) > 0.99       # two blobs touch at sep 8
    np.testing.assert_array_equal(km.predict(X), km.labels_)
    # the trace starts with the path (one cluster at the top) and ends hard
    d = km.trace_.as_dict()
    assert d["n_distinct"][0] == 1 and d["temperature"][-1] == 0
    assert d["step"][0] == 0 and np.all(np.diff(d["step"][d["step"] >= 0]) >= 0)
    ref = fastanneal.AnnealedKMeans(6, random_state=0).fit(X)
    assert km.inertia_ <= ref.inertia_ * (1 + 1e-9)


def test_auto_on_dask_matches_in_memory():
    da = pytest.importorskip("dask.array")
    X, _ = blobs(5, 3, 10, seed=3)
    a = fastanneal.suggest_k(X, k_max=9, random_state=0)
    b = fastanneal.suggest_k(da.from_array(X, chunks=(200, 3)), k_max=9, random_state=0)
    assert a.best == b.best == 5
    np.testing.assert_allclose(a.width, b.width, rtol=1e-6, atol=1e-9)


def test_bad_k_ranges():
    X, _ = blobs(3, 2, 10, n=20)
    for kw, word in [(dict(k_max=1), "k_max"), (dict(k_max=5, k_min=1), "k_min"),
                     (dict(k_max=3, k_min=4), "k_max"), (dict(k_max=500), "larger")]:
        with pytest.raises(ValueError, match=word):
            fastanneal.suggest_k(X, **kw)
    with pytest.raises(ValueError, match="k_max"):
        fastanneal.AnnealedKMeans("auto").fit(X)
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        fastanneal.AnnealedKMeans("many").fit(X)
    with pytest.raises(ValueError, match="checkpoint"):
        fastanneal.AnnealedKMeans("auto", k_max=5, checkpoint="x").fit(X)


def test_plot_has_both_panels():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    X, _ = blobs(4, 2, 10)
    fig = fastanneal.suggest_k(X, k_max=8, random_state=0).plot()
    assert len(fig.axes) == 2
    assert fig.axes[0].get_xscale() == "log"


def test_cli_k_auto(capsys, tmp_path):
    from test_cli import assert_one_line_error, make_table, run, write_any
    table, X, lab = make_table(n=240, D=8, K=4)
    src = write_any(table, tmp_path / "q.parquet")
    out = tmp_path / "r.parquet"
    argv = ["cluster", src, "-o", out, "--embedding-column", "emb", "--metric", "euclidean",
            "--k", "auto", "--k-max", 8]
    report = []
    try:
        import matplotlib  # noqa: F401
        report = ["--report", tmp_path / "rep.html"]
    except ImportError:
        pass
    rc, stdout, err = run(capsys, *argv, *report)
    assert rc == 0, err
    assert "chose K = 4" in err
    import pyarrow.parquet as pq
    got = pq.read_table(out).column("cluster").to_numpy()
    assert len(np.unique(got)) == 4
    assert adjusted_rand_score(lab, got) == 1.0
    if report:
        html = (tmp_path / "rep.html").read_text()
        assert 'id="choose-k"' in html and "auto: finest natural level" in html
        assert "continued for the chosen K" in html
        # out of core K is chosen on a sample and the mini-batch fit starts afresh: the
        # report says so (it claimed the critical path was continued)
        rc, stdout, err = run(capsys, *argv[:3], tmp_path / "r2.parquet", *argv[4:],
                              "--memory-limit", "1KB", "--report", tmp_path / "rep2.html")
        assert rc == 0, err
        html = (tmp_path / "rep2.html").read_text()
        assert "over mini-batches (out of core)" in html
        assert "continued for the chosen K" not in html
    for extra, word in [(["--k", "auto", "--k-max", "1"], "--k-max"),
                        (["--k", "3", "--k-max", "5"], "--k auto"),
                        (["--k", "auto", "--checkpoint", tmp_path / "ck"], "checkpoint"),
                        (["--k", "many"], "--k"),
                        (["--k", "auto", "--k-max", "500"], "--k-max 500")]:
        rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "x.csv",
                         "--embedding-column", "emb", *extra)
        assert_one_line_error(rc, err, word)
    assert not (tmp_path / "ck").exists() and not (tmp_path / "x.csv").exists()


def test_cli_k_auto_on_small_logs(capsys, tmp_path):
    """``--k auto`` without ``--k-max`` refused every log of fewer than 50 rows ("--k-max
    50 is larger than ...", a flag the user never gave); and with the level "every
    distinct point its own cluster" left out, the note called K = 2 "the widest plateau"
    beside a printed K = 3 ten times wider."""
    from test_cli import make_table, run, write_any
    table, X, _ = make_table(n=20, D=8, K=4)
    src = write_any(table, tmp_path / "small.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "a.csv", "--embedding-column",
                     "emb", "--k", "auto", "--metric", "euclidean")
    assert rc == 0, err
    assert "--k-max: 20 (the rows with weight > 0; the default is 50)" in err
    # 30 rows, 3 distinct points
    rng = np.random.default_rng(0)
    E = (rng.normal(size=(3, 8)) * 5)[np.arange(30) % 3].astype(np.float32)
    import pyarrow as pa
    t3 = pa.table({"query": [f"q {i % 3}" for i in range(30)],
                   "emb": pa.FixedSizeListArray.from_arrays(pa.array(E.ravel()), 8)})
    src3 = write_any(t3, tmp_path / "dup.parquet")
    rc, _, err = run(capsys, "cluster", src3, "-o", tmp_path / "b.csv", "--embedding-column",
                     "emb", "--k", "auto", "--metric", "euclidean")
    assert rc == 2 and "distinct points" in err and "--k-max is the default" in err
    rc, _, err = run(capsys, "cluster", src3, "-o", tmp_path / "b.csv", "--embedding-column",
                     "emb", "--k", "auto", "--k-max", 3, "--metric", "euclidean")
    assert rc == 0, err
    assert "chose K = 2" in err and "3 (" in err and "its own cluster: not a choice" in err
    # the chosen K is not called "not a choice", the reason names distinct points, and the
    # warning says the K range runs into them (it blamed "a burst" of query embeddings)
    assert "2 (" in err and "fewer than two distinct points a cluster)" in err
    assert "every K in 2..3 is at the data's granularity" in err and "burst" not in err
    assert "Too few distinct points to choose K from" in err
    rc, out, err = run(capsys, "suggest-k", src3, "--embedding-column", "emb", "--k-max", 3,
                       "--metric", "euclidean")
    assert rc == 0, err
    assert "(no clustering: every distinct point its own cluster)" in out
    assert "(no clustering: fewer than two distinct points a cluster)" in out
    assert "at the data's granularity" in out and "burst" not in out
    # out of core: the same hint on the default (it was lost there)
    rc, _, err = run(capsys, "cluster", src3, "-o", tmp_path / "c.csv", "--embedding-column",
                     "emb", "--k", "auto", "--metric", "euclidean", "--memory-limit", "1K")
    assert rc == 2 and "distinct points" in err and "--k-max is the default" in err
    # suggest-k takes the same default (it refused the 20-row log: "--k-max 50 is larger")
    rc, out, err = run(capsys, "suggest-k", src, "--embedding-column", "emb",
                       "--metric", "euclidean")
    assert rc == 0, err
    assert "--k-max: 20 (the rows with weight > 0; the default is 50)" in err


def test_suggest_k_names_a_zero_row_from_one_and_max_rows_in_its_errors(capsys, tmp_path):
    from test_cli import make_table, run, write_any
    table, X, _ = make_table(n=20, D=8, K=4)
    E = np.array(X, dtype=np.float32)
    E[5] = 0.0                                        # the 6th row
    t = pa.table({"query": [f"q {i}" for i in range(20)],
                  "emb": pa.FixedSizeListArray.from_arrays(pa.array(E.ravel()), 8)})
    src = write_any(t, tmp_path / "zero.parquet")
    for cmd in (["suggest-k", src, "--embedding-column", "emb", "--k-max", 4],
                ["cluster", src, "-o", tmp_path / "z.csv", "--embedding-column", "emb",
                 "--k", 3]):
        rc, _, err = run(capsys, *cmd)
        assert rc == 2 and "row 6 has an all-zero embedding" in err, err
    Y = np.random.default_rng(0).normal(size=(500, 3))
    with pytest.raises(ValueError, match="k_max=300 is larger than max_rows=200"):
        fastanneal.suggest_k(Y, k_max=300, max_rows=200)


def test_k_of_equal_plateaus_rank_smaller_first_on_every_dtype():
    """Plateaus of one cooling step each differed in their last bits (sums of log(T /
    T_next) in another order), so float32 rows ranked 4, 7, 8 above 2 and float64 rows
    below it; equal widths now tie, and ties go to the smaller K."""
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(5, 3)) * 8
    X = np.concatenate([c + rng.normal(size=(n, 3))
                        for c, n in zip(centers, [40, 30, 20, 60, 25])])
    rankings = [fastanneal.suggest_k(Z, k_max=10, random_state=0).ranking
                for Z in (X, X.astype(np.float32))]
    assert rankings[0] == rankings[1]
    s = fastanneal.suggest_k(X, k_max=10, random_state=0)
    w = dict(zip((int(k) for k in s.ks), s.width))
    ranked = [k for k in s.ranking[1:] if k in w]
    for a, b in zip(ranked, ranked[1:]):              # widths fall; equal ones by K
        assert round(w[a], 9) > round(w[b], 9) or (round(w[a], 9) == round(w[b], 9) and a < b)


def test_a_plateau_as_narrow_as_data_without_clusters_shows_is_flagged(capsys, tmp_path):
    """An elongated Gaussian blob has no clusters, yet its path holds K = 2 for a while and
    ``supported`` is True (so on 49 of 84 runs of study_unimodal.py); the suggestion says
    that its plateau is no wider than data without clusters show, and the command says it
    beside its choice. Separated blobs are not flagged."""
    from fastanneal.choose_k import NO_CLUSTER_WIDTH
    rng = np.random.default_rng(1000)
    G = rng.standard_normal((2000, 2)) * [1.0, 0.6]
    s = fastanneal.suggest_k(G, k_max=20, random_state=0)
    w = float(s.width[int(np.nonzero(s.ks == s.best)[0][0])])
    assert s.supported and s.could_be_unclustered and 0.3 < w <= NO_CLUSTER_WIDTH
    X, _ = blobs(5, 4, 60, seed=2)
    s = fastanneal.suggest_k(X, k_max=10, random_state=0)
    assert s.best == 5 and s.supported and not s.could_be_unclustered
    from test_cli import run, write_any
    import pyarrow as pa
    t = pa.table({"query": [f"q{i}" for i in range(len(G))],
                  "emb": pa.FixedSizeListArray.from_arrays(
                      pa.array(G.astype(np.float32).ravel()), 2)})
    src = write_any(t, tmp_path / "g.parquet")
    rc, _, err = run(capsys, "cluster", src, "-o", tmp_path / "g.csv", "--embedding-column",
                     "emb", "--k", "auto", "--k-max", 20, "--metric", "euclidean")
    assert rc == 0, err
    assert "data without clusters" in err and "check the clusters" in err


def test_k_max_at_the_number_of_rows_does_not_suggest_single_rows():
    """k_max = the number of distinct rows (a user saying "consider everything"): K = n - 1
    held a plateau as wide as its closest pair is close and became the finest natural
    level, suggested over four obvious blobs; a K with fewer than two rows a cluster is no
    clustering and is never suggested."""
    X, _ = blobs(4, 8, 10, n=50, seed=3)
    s = fastanneal.suggest_k(X, k_max=200, random_state=0)
    assert s.best == 4 and s.supported and all(k <= 100 for k in s.levels)
    granular = [k for k in s.ranking if k > 100]          # fewer than 2 rows a cluster
    assert granular and s.ranking[-len(granular):] == granular and granular[-1] == 200
    assert fastanneal.AnnealedKMeans("auto", k_max=200, random_state=0).fit(X).n_clusters_ == 4
    # duplicated rows count once (400 rows, 200 distinct: K = 198, 199 are single rows)
    s2 = fastanneal.suggest_k(np.repeat(X, 2, axis=0), k_max=200, random_state=0)
    assert s2.best == 4 and s2.n_distinct == 200 and s2.n_rows == 400
    granular = [k for k in s2.ranking if k > 100]
    assert granular and s2.ranking[-len(granular):] == granular


def test_plateau_bounds_come_from_the_temperatures_that_held_k():
    """A count seen for one moment while twins separate (8 at T = 0.92, then 7 down to
    0.51, then 8 again from 0.44) set K = 8's "T in" to 0.92: the table printed a bracket
    far wider than the plateau beside it. Every K's bounds now bracket the temperatures
    that held it."""
    rng = np.random.default_rng(0)
    for shape in ((4, 8), (200, 8), (3, 4), (2, 4), (1, 4), (5, 8), (1, 8)):
        rng.normal(size=shape)              # (the draws before the reviewer's 10 rows)
    X = rng.normal(size=(10, 4))
    s = fastanneal.suggest_k(X, k_max=9, metric="euclidean", random_state=0)
    T, k = s.path_temperature, s.path_clusters
    for i, K in enumerate(s.ks):
        if not s.width[i] > 0:
            continue
        held = [j for j in range(len(T) - 1) if k[j] == K and T[j + 1] < T[j]]
        if K == s.k_max and k[-1] == K:
            held.append(len(T) - 1)                   # (k_max: its plateau is predicted)
        assert s.t_in[i] == pytest.approx(max(T[j] for j in held))
        assert np.log(s.t_in[i] / s.t_out[i]) >= s.width[i] * (1 - 1e-12)
    # k_max = the 10 rows: the widest plateau is the level of single rows (never a choice);
    # natural levels are measured against the widest plateau of a clustering (against
    # that one, K = 3 was no level, only the best of a flat ranking)
    s10 = fastanneal.suggest_k(X, k_max=10, metric="euclidean", random_state=0)
    assert s10.trivial_k == 10 and s10.width[-1] == s10.width.max()
    assert s10.best == 3 and s10.levels == [3]


def test_critical_phase_splits_effective_clusters_not_twins():
    """The rule shared by schedule="critical" and suggest_k: twins that have not separated
    yet (closer than sqrt(MERGE T)) are one effective cluster and are not split again; a
    lone codevector on an unstable cluster is. The textbook rule split both twins here."""
    import fastanneal._engine as E
    from fastanneal._sources import InMemorySource
    from fastanneal._trace import Trace
    X, _ = blobs(2, 2, 12, seed=4)
    src = InMemorySource(X, np.ones(X.shape[0]), 0)
    T = 0.5 * 2.0 * float(np.linalg.eigvalsh(np.cov(X.T, bias=True))[-1])   # below T_c
    cfg = E.EngineConfig(n_clusters=8)
    ctx = E.Context(src, cfg, np.random.default_rng(0), 1.0, Trace(), 0.0, 2)
    m = X.mean(axis=0)
    phase = E._CriticalPhase()
    twins = E.AnnealState(centers=np.array([m, m + 1e-3]), temperature=T, T_start=T,
                          T_end=T / 100, scale=1.0, phase="critical",
                          rule_state={"p": np.array([0.5, 0.5])})
    n, lab = phase.split(ctx, twins, T, budget=6)
    assert lab.tolist() == [0, 0] and n == 0 and twins.centers.shape[0] == 2
    lone = E.AnnealState(centers=m[None].copy(), temperature=T, T_start=T, T_end=T / 100,
                         scale=1.0, phase="critical", rule_state={"p": np.ones(1)})
    n, _ = phase.split(ctx, lone, T, budget=6)
    assert n == 1 and lone.centers.shape[0] == 2
    np.testing.assert_allclose(lone.rule_state["p"], [0.5, 0.5])


def test_cli_suggest_k(capsys, tmp_path):
    from test_cli import assert_one_line_error, make_table, run, write_any
    table, X, lab = make_table(n=240, D=8, K=4)
    src = write_any(table, tmp_path / "q.parquet")
    rc, out, err = run(capsys, "suggest-k", src, "--embedding-column", "emb", "--metric",
                       "euclidean", "--k-max", 8)
    assert rc == 0, err
    assert "suggested K = 4" in out
    first = [ln for ln in out.splitlines() if ln.strip().startswith("1 ")][0].split()
    assert first[1] == "4"
    rc, out, _ = run(capsys, "suggest-k", src, "--embedding-column", "emb", "--metric",
                     "euclidean", "--k-max", 8, "-q")
    assert rc == 0 and out.strip() == "4"
    # a K range that leaves out the data's level (4): no clear plateau, and the warning
    # names that possible cause (it asserted a burst of splits below T_c, false here)
    rc, out, err = run(capsys, "suggest-k", src, "--embedding-column", "emb", "--metric",
                       "euclidean", "--k-min", 5, "--k-max", 12)
    assert rc == 0, err
    assert "no clear plateau" in out and "a K range that leaves out" in out
    rc, _, err = run(capsys, "suggest-k", src, "--embedding-column", "emb", "--k-max", 8,
                     "--plot", tmp_path / "k.svg")
    assert rc == 0, err
    import xml.etree.ElementTree as ET
    svg = (tmp_path / "k.svg").read_text(encoding="utf-8")
    ET.fromstring(svg)                                  # well-formed, both panels inside
    assert "phase transitions" in svg and "objective along the path" in svg
    assert "suggested K=4" in svg
    try:
        import matplotlib  # noqa: F401
        rc, _, err = run(capsys, "suggest-k", src, "--embedding-column", "emb", "--k-max", 8,
                         "--plot", tmp_path / "k.png")
        assert rc == 0, err
        assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        pass
    for extra, word in [(["--k-max", "1"], "--k-max"), (["--k-min", "1"], "--k-min"),
                        (["--k-max", "500"], "--k-max 500 is larger than the number of rows"),
                        (["--plot", tmp_path / "k.jpg"], "png")]:
        rc, _, err = run(capsys, "suggest-k", src, "--embedding-column", "emb", *extra)
        assert_one_line_error(rc, err, word)
    # three distinct embeddings: --k-max 5 is refused by the exact distinct-row count
    dup = table.set_column(table.column_names.index("emb"), "emb",
                           pa.FixedSizeListArray.from_arrays(
                               pa.array(np.repeat(X[:3], 80, axis=0).ravel()), X.shape[1]))
    dsrc = write_any(dup, tmp_path / "dup.parquet")
    rc, _, err = run(capsys, "suggest-k", dsrc, "--embedding-column", "emb", "--k-max", 5)
    assert_one_line_error(rc, err, "--k-max 5", "distinct points with non-zero weight (3)")
    rc, _, err = run(capsys, "suggest-k", src, "--embedding-column", "nope")
    assert_one_line_error(rc, err, "'nope' not found")
    rc, _, err = run(capsys, "suggest-k", src)
    assert_one_line_error(rc, err, "--embedding-column")


def test_path_jumps_over_stretches_without_transitions(monkeypatch):
    """Where nothing splits and every cell is stable, the path jumps to just below the
    next predicted transition: far fewer temperatures than cooling step by step, the same
    suggestion, the true K's plateau as wide within two cooling steps."""
    from fastanneal.choose_k import _PathPhase
    X, _ = blobs(6, 32, 3, seed=4)
    a = fastanneal.suggest_k(X, k_max=12, random_state=0)
    monkeypatch.setattr(_PathPhase, "jump", False)
    b = fastanneal.suggest_k(X, k_max=12, random_state=0)
    assert a.best == b.best == 6
    assert len(a.path_temperature) <= 0.6 * len(b.path_temperature), \
        (len(a.path_temperature), len(b.path_temperature))
    assert abs(a.width[6 - 2] - b.width[6 - 2]) <= 2 * -np.log(0.85)
    # a jump lands below the largest 2 lambda_max of the cells it leaves: the next
    # temperature of a plateau step is below every cell's critical temperature there
    Tp = a.path_temperature
    jumps = np.nonzero(Tp[1:] < 0.8 * Tp[:-1])[0]
    assert jumps.size >= 1


def test_path_settles_before_it_jumps(monkeypatch):
    """A35 look-alike, seed 1: at T ~ 6.6 a metastable codevector between two overlapping
    clusters drifts into one of them over several EM rounds. Jumping before it settles
    credits the stretch down to the next transition to K + 1 and splits the true K's
    plateau (the suggestion was 4); holding T until the centers stop moving keeps it."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _known_answers as ka
    from fastanneal.choose_k import _PathPhase
    X = ka.load("a35", 1)[0]
    a = fastanneal.suggest_k(X, k_max=70, random_state=1)
    assert a.best == 35, a.table()[:3]
    monkeypatch.setattr(_PathPhase, "MAX_HOLDS", 0)
    b = fastanneal.suggest_k(X, k_max=70, random_state=1)
    assert b.best != 35 or b.width[35 - 2] < a.width[35 - 2] - 0.1, b.table()[:3]


def test_nested_clusters_suggest_the_finest_level():
    """Two groups apart, each of three clusters: the two-group plateau is the widest (the
    widest-plateau rule answers 2), the six clusters' plateau is a natural level too (at
    least half as wide at distance 30; at distance 60 less than half, but wider than 1 in
    log T); the suggestion is the finest level, with the coarse one listed among the levels
    and not counting against ``supported``."""
    from fastanneal.choose_k import natural_levels
    for far in (30.0, 60.0):
        rng = np.random.default_rng(3)
        tri = np.array([[0.0, 0.0], [6.0, 0.0], [3.0, 5.2]])
        centers = np.concatenate([tri, tri + [far, 0.0]])
        X = np.concatenate([c + rng.normal(size=(150, 2)) for c in centers])
        s = fastanneal.suggest_k(X, k_max=12, random_state=0)
        assert s.width[2 - 2] == s.width.max()          # the coarse level is the widest
        assert s.best == 6 and s.levels == [2, 6], s.table()[:4]
        assert s.ranking[:2] == [6, 2]
        assert s.supported
        assert natural_levels(s.ks, s.width, 0.85) == s.levels
    assert natural_levels([2, 3, 4], [3.0, 1.49, 1.0], 0.85) == [2, 3, 4]
    assert natural_levels([2, 3, 4], [1.0, 0.49, 0.5], 0.85) == [2, 4]
    assert natural_levels([2, 3], [0.3, 0.2], 0.85) == []      # narrower than two steps


def test_suggest_k_out_of_core_on_a_sample(tmp_path):
    """A Parquet path (no backend) is read out of core: the path runs on a uniform sample
    of ``max_rows`` rows drawn from the row groups, and finds the same K as on all rows in
    memory; ``max_rows`` samples an array too."""
    import pyarrow.parquet as pq
    X, _ = blobs(5, 8, 8, n=400, seed=6)
    X = X[np.random.default_rng(0).permutation(len(X))].astype(np.float32)
    p = tmp_path / "emb.parquet"
    pq.write_table(pa.table({"embedding": pa.FixedSizeListArray.from_arrays(
        pa.array(X.ravel()), X.shape[1])}), p, row_group_size=250)
    full = fastanneal.suggest_k(X, k_max=10, random_state=0)
    ooc = fastanneal.suggest_k(p, k_max=10, random_state=0, max_rows=800)
    assert full.best == ooc.best == 5
    assert full.n_rows == 2000 and ooc.n_rows == 800
    stream = fastanneal.open_parquet(p)
    s = fastanneal.suggest_k(stream, k_max=10, random_state=0)
    assert s.best == 5 and s.n_rows == 2000              # fewer rows than the default sample
    a = fastanneal.suggest_k(X, k_max=10, random_state=0, max_rows=600)
    assert a.best == 5 and a.n_rows == 600
    with pytest.raises(ValueError, match="max_rows"):
        fastanneal.suggest_k(X, k_max=10, max_rows=1)
    with pytest.raises(ValueError, match="metric"):
        fastanneal.suggest_k(fastanneal.open_parquet(p), k_max=10, metric="cosine")


def test_k_max_at_the_number_of_rows_is_not_chosen():
    """``k_max`` equal to the number of rows: the last state is one row per cell, whose
    "next split" temperature is rounding noise; its plateau is measured only down to the
    path's floor, so the true K still wins (it chose K = N)."""
    rng = np.random.default_rng(0)
    X = np.concatenate([c + rng.normal(size=(100, 4)) for c in rng.normal(size=(3, 4)) * 10])
    s = fastanneal.suggest_k(X, k_max=X.shape[0], random_state=0)
    assert s.best == 3 and s.supported, s.table()[:3]
    assert s.trivial_k == X.shape[0] and s.ranking[-1] == X.shape[0]
    if s.t_in[-1] > 0:                                    # the path reached K = N
        assert s.t_out[-1] >= 1e-5 * s.temperature_start * (1 - 1e-12)
    s2 = fastanneal.suggest_k(X, k_max=X.shape[0] - 1, random_state=0)
    assert s2.trivial_k is None and s2.best == 3
    # the granularity level as the only K in range: suggested (nothing else is), but never
    # as supported by the data
    X4 = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    s3 = fastanneal.suggest_k(X4, k_min=4, k_max=4, random_state=0)
    assert s3.best == s3.trivial_k == 4 and not s3.supported


def test_auto_k_and_batch_size_do_not_combine():
    """Mini-batch annealing fits a given K: ``n_clusters="auto"`` with ``batch_size`` is
    named as that (it said "n_clusters must be a positive integer; got 'auto'")."""
    X, _ = blobs(3, 40, 4, seed=2)
    with pytest.raises(ValueError, match="does not combine with batch_size"):
        fastanneal.AnnealedKMeans("auto", k_max=5, batch_size=64).fit(X)


def test_path_parameters_are_checked_and_a_short_path_is_said():
    X, _ = blobs(3, 2, 10, n=30)
    for bad in (0.0, 1.0, 1.5, -0.5, float("nan"), "0.85", True):
        with pytest.raises(ValueError, match="cooling must be a number strictly between"):
            fastanneal.suggest_k(X, k_max=6, cooling=bad)
    for bad in (0, -1, 2.5, "10", True):
        with pytest.raises(ValueError, match="max_steps must be a whole number"):
            fastanneal.suggest_k(X, k_max=6, max_steps=bad)
    with pytest.warns(fastanneal.AnnealingWarning, match=r"stopped at 2 clusters after "
                                                         r"max_steps=5 .*before k_max=6"):
        fastanneal.suggest_k(X, k_max=6, max_steps=5, random_state=0)
    with pytest.raises(ValueError, match=r"reached no K in 2\.\.6: max_steps=3 steps were "
                                         r"not enough"):
        fastanneal.suggest_k(X, k_max=6, max_steps=3, random_state=0)


def test_a_path_that_never_splits_names_the_reason():
    """One row carrying nearly all the weight: the path stays at one cluster down to its
    floor; the error says so (it said "raise max_steps", which changes nothing)."""
    X, _ = blobs(3, 2, 10, n=30)
    w = np.ones(X.shape[0])
    w[7] = 1e12
    with pytest.raises(ValueError, match=r"reached no K in 2\.\.6: it stayed at 1 "
                                         r"cluster\(s\) down to 1e-05 x the critical"):
        fastanneal.suggest_k(X, k_max=6, sample_weight=w, random_state=0)


def test_auto_warns_when_no_k_is_supported():
    """The estimator says what the command line says: no clear plateau, K is where the
    widest one happened to be."""
    X = np.random.default_rng(5).normal(size=(600, 32))
    with pytest.warns(fastanneal.AnnealingWarning, match=r"no K in 2\.\.8 is clearly "
                                                         r"supported"):
        est = fastanneal.AnnealedKMeans("auto", k_max=8, random_state=0).fit(X)
    assert not est.k_suggestion_.supported
    X, _ = blobs(3, 2, 10, n=40)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", fastanneal.AnnealingWarning)
        est = fastanneal.AnnealedKMeans("auto", k_max=6, random_state=0).fit(X)
    assert est.n_clusters_ == 3
    with pytest.raises(ValueError, match=r"n_samples=120 should be >= k_max=121"):
        fastanneal.AnnealedKMeans("auto", k_max=121).fit(X)
    from fastanneal.queries import QueryClusters
    with pytest.raises(ValueError, match="needs k_max >= 2 \\(an integer\\); got 2.9"):
        QueryClusters("auto", k_max=2.9).fit([f"q{i}" for i in range(len(X))], X)


def test_a_range_the_path_jumps_over_is_named():
    """Four square blobs split 2 -> 4 at one temperature: k_min = k_max = 3 is never on the
    path, and the error says so and how to widen the range."""
    rng = np.random.default_rng(0)
    sq = np.array([[0, 0], [0, 10], [10, 0], [10, 10]], float)
    X = np.concatenate([c + 0.3 * rng.normal(size=(100, 2)) for c in sq])
    with pytest.raises(ValueError, match=r"reached no K in 3\.\.3: it went from 2 to 4 "
                                         r"clusters at one temperature.*k_min <= 2 or "
                                         r"k_max >= 4"):
        fastanneal.suggest_k(X, k_min=3, k_max=3, random_state=0)


@pytest.mark.parametrize("case", ["three-tight", "five-blobs"])
def test_k_max_equal_to_the_true_k_is_found(case):
    """``k_max`` equal to the K a user suspects: the path used to end as soon as the count
    of effective clusters reached ``k_max``, on a transient of the last splits (4 for 3
    tight clusters while twins separate, back to 3 a few EM rounds later at the same
    temperature), before the true count was measured, and suggested a coarser K
    (``supported`` even True for 4 of 5 blobs). It now ends on an equilibrium at that
    temperature: the same K as with a larger ``k_max``, on the estimator too."""
    from sklearn.datasets import make_blobs
    if case == "three-tight":
        rng = np.random.default_rng(1)
        pts = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
        X = np.concatenate([c + rng.normal(scale=1e-3, size=(100, 2)) for c in pts])
        K = 3
    else:
        X = make_blobs(300, n_features=2, centers=5, cluster_std=0.05,
                       center_box=(-10, 10), random_state=8)[0]
        K = 5
    for k_max in (K, K + 1, K + 3):
        s = fastanneal.suggest_k(X, k_max=k_max, random_state=0)
        assert s.best == K and s.supported, (k_max, s.best, s.path_clusters)
    m = fastanneal.AnnealedKMeans("auto", k_max=K, random_state=0).fit(X)
    assert m.n_clusters_ == K


def test_one_direction_under_cosine_is_identical_rows():
    """Positive multiples of one vector are one point under cosine; their unit rows differ
    in the last bits, and the path ran on a 'critical temperature' of 1e-31 to a
    'supported' K = 2. All routes now say the rows are identical; and the auto fit refused
    all-identical rows asking for a smaller k_max, which does not exist."""
    rng = np.random.default_rng(0)
    v = rng.normal(size=5)
    M = np.outer(rng.uniform(1, 10, 100), v)
    for f in (lambda: fastanneal.suggest_k(M, k_max=3, metric="cosine", random_state=0),
              lambda: fastanneal.AnnealedKMeans("auto", k_max=3, metric="cosine").fit(M),
              lambda: fastanneal.AnnealedKMeans(2, metric="cosine").fit(M),
              lambda: fastanneal.AnnealedKMeans("auto", k_max=2).fit(np.ones((10, 2)))):
        with pytest.raises(ValueError, match="all rows are identical"):
            f()
    # two directions are two points, whatever the lengths
    M2 = np.concatenate([M, np.outer(rng.uniform(1, 10, 100), rng.normal(size=5))])
    assert fastanneal.AnnealedKMeans(2, metric="cosine", random_state=0).fit(M2).inertia_ \
        == pytest.approx(0.0, abs=1e-9)


def test_auto_n_iter_counts_the_path():
    """n_iter_ ("moment passes in total") counted the continuation only: 5 passes for a
    fit whose path made about 50."""
    X, _ = blobs(5, 16, 8, n=400)
    km = fastanneal.AnnealedKMeans("auto", k_max=10, random_state=0).fit(X)
    n_path = km.k_suggestion_.n_passes
    assert n_path > 10 and km.n_iter_ > n_path


def test_suggest_k_sample_errors_name_the_sample_and_backend_typos_are_refused():
    rng = np.random.default_rng(0)
    X, _ = blobs(4, 3, 8, n=250)
    w = np.zeros(len(X))
    w[rng.choice(len(X), 60, replace=False)] = 1.0
    assert fastanneal.suggest_k(X, k_max=20, sample_weight=w, random_state=0).best >= 2
    with pytest.raises(ValueError, match="in the uniform sample of 100 rows the path runs on "
                                         r"\(max_rows; the data has 1,000\)"):
        fastanneal.suggest_k(X, k_max=20, sample_weight=w, random_state=0, max_rows=100)
    with pytest.raises(ValueError, match="backend must be None, 'cpu', 'cuda' or 'dask'"):
        fastanneal.suggest_k(X, k_max=4, backend="gpu")


def test_cosine_rows_in_a_narrow_cone_are_named_not_blurred():
    """float32 unit rows within a few eps of one direction are one direction to the
    rounding of 2 - 2 cos (they fitted to ARI 0.0025 / 0.75 silently, where the float64
    copy and scikit-learn's centered KMeans find the 8 blobs): an error that says so and
    names float64; a few dozen eps: a warning (ARI 0.84); the float64 rows fit."""
    from sklearn.datasets import make_blobs
    from fastanneal._engine import AnnealingWarning
    X, y = make_blobs(4000, n_features=16, centers=8, cluster_std=3, random_state=0)
    with pytest.raises(ValueError, match=r"identical in direction.*float64 rows"):
        fastanneal.AnnealedKMeans(8, metric="cosine", random_state=0).fit(
            (X + 1e4).astype(np.float32))
    with pytest.warns(AnnealingWarning, match=r"nearly one direction.*float64 rows"):
        fastanneal.AnnealedKMeans(8, metric="cosine", random_state=0).fit(
            (X + 3e3).astype(np.float32))
    km = fastanneal.AnnealedKMeans(8, metric="cosine", random_state=0).fit(X + 1e4)
    assert adjusted_rand_score(y, km.labels_) > 0.99
    # one heavy row does not make orthogonal rows one direction (the weighted mean distance
    # to the mean direction is tiny; the rows' own spread is not)
    import warnings
    E = np.eye(3, 8, dtype=np.float32)
    for w in ([1e7, 1, 1], [1e5, 1, 1]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", AnnealingWarning)
            lab = fastanneal.AnnealedKMeans(3, metric="cosine", random_state=0).fit(
                E, sample_weight=w).labels_
        assert len(set(lab)) == 3

"""Rows far from the origin (docs/theory.md, "Rows far from the origin"), and the estimator
contract around it: partial_fit after fit, checkpoints of a mini-batch fit across processes,
parameters the mini-batch route cannot honour, inputs that are not real numbers.

The offset cases are the ones scikit-learn handles by centering: in float32 the GEMM form
``||x||^2 + ||c||^2 - 2 x.c`` of a distance between rows near 1e4 rounds away everything
below ~1e4 * 1e4 * 6e-8 = 6 -- the whole spread of the clusters below. Without the
centering these tests fail (ARI about 0.3, predict disagreeing with the nearest center).
"""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

import fastanneal
from fastanneal import _validation as V


def three_blobs(seed, n=60, d=3, dtype=np.float32, offset=0.0):
    g = np.random.default_rng(seed)
    means = np.zeros((3, d))
    means[1, 0] = means[2, 1] = 6.0
    X = np.concatenate([m + g.standard_normal((n, d)) for m in means]) + offset
    return X.astype(dtype), np.repeat(np.arange(3), n), means + offset


def exact_d2(X, C):
    X = np.asarray(X, np.float64)
    C = np.asarray(C, np.float64)
    return ((X[:, None, :] - C[None, :, :]) ** 2).sum(-1)


@pytest.mark.parametrize("dtype,offset", [(np.float32, 1e4), (np.float32, 1e5),
                                          (np.float64, 1e9)])
def test_rows_far_from_the_origin_fit_as_well_as_near_it(dtype, offset):
    X, y, _ = three_blobs(5, dtype=dtype, offset=offset)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no polish or relocation warnings either
        km = fastanneal.AnnealedKMeans(3, random_state=0).fit(X)
    assert km.cluster_centers_.dtype == dtype
    assert adjusted_rand_score(y, km.labels_) > 0.95        # the blobs touch: a row may cross
    d = exact_d2(X, km.cluster_centers_)
    # the deployed rule is the exact nearest center, and labels_ is what predict says
    np.testing.assert_array_equal(km.predict(X), d.argmin(1))
    np.testing.assert_array_equal(km.labels_, km.predict(X))
    assert km.inertia_ == pytest.approx(d.min(1).sum(), rel=1e-4)
    assert -km.score(X) == pytest.approx(d.min(1).sum(), rel=1e-4)
    np.testing.assert_allclose(km.transform(X) ** 2, d, rtol=1e-3, atol=1e-2)
    P = km.predict_proba(X)
    assert np.isfinite(P).all() and np.allclose(P.sum(1), 1.0, atol=1e-5)
    assert (P.argmax(1) == km.labels_).mean() > 0.99
    # the same partition and spread-relative centers as the data near the origin
    X0 = (X.astype(np.float64) - offset).astype(dtype)
    km0 = fastanneal.AnnealedKMeans(3, random_state=0).fit(X0)
    assert adjusted_rand_score(km0.labels_, km.labels_) == 1.0
    assert km.critical_temperature_ == pytest.approx(km0.critical_temperature_, rel=1e-3)


def test_far_rows_in_the_minibatch_route_suggest_k_and_auto():
    X, y, means = three_blobs(6, n=200, offset=3e4)
    mb = fastanneal.MiniBatchAnnealedKMeans(3, batch_size=128, random_state=0).fit(X)
    assert adjusted_rand_score(y, mb.labels_) == 1.0
    np.testing.assert_array_equal(mb.labels_, mb.predict(X))
    assert fastanneal.suggest_k(X, k_max=6, random_state=0).best == 3
    auto = fastanneal.AnnealedKMeans("auto", k_max=6, random_state=0).fit(X)
    assert auto.n_clusters_ == 3 and adjusted_rand_score(y, auto.labels_) == 1.0
    # an init array is given in the data's coordinates
    km = fastanneal.AnnealedKMeans(3, init=means, random_state=0).fit(X)
    assert np.abs(km.cluster_centers_.astype(np.float64) - means).max() < 0.5
    da = pytest.importorskip("dask.array")
    lazy = km.predict(da.from_array(X, chunks=(100, 3)))
    np.testing.assert_array_equal(np.asarray(lazy.compute()), km.predict(X))


def test_close_distinct_rows_are_separated_not_merged():
    """Three groups of ten equal rows around a point of norm ~2, 1e-9 apart (float64): the
    spread (1e-18) is far below the rounding of the squared norms (4e-16)."""
    g = np.random.default_rng(1)
    p = g.standard_normal(4)
    p *= 2.0 / np.linalg.norm(p)
    X = np.repeat(p + 1e-9 * np.array([[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]), 10, axis=0)
    km = fastanneal.AnnealedKMeans(3, random_state=0).fit(X)
    assert sorted(np.bincount(km.labels_)) == [10, 10, 10]
    mb = fastanneal.MiniBatchAnnealedKMeans(3, batch_size=16, random_state=0).fit(X)
    assert sorted(np.bincount(mb.labels_)) == [10, 10, 10]


def test_functions_keep_their_precision_far_from_the_origin(rng):
    off = 1e4
    X, _, means = three_blobs(int(rng.integers(1 << 30)), n=50, offset=off)
    C = means.astype(np.float32)
    d_ref = exact_d2(X, C)
    np.testing.assert_allclose(fastanneal.pairwise_distances(X, C), d_ref, rtol=1e-4,
                               atol=2e-3)
    T = 4.0
    m = fastanneal.moments(X, C, T)
    z = -d_ref / T
    r = np.exp(z - z.max(1, keepdims=True))
    r /= r.sum(1, keepdims=True)
    np.testing.assert_allclose(m.N, r.sum(0), rtol=1e-4)
    # S in the data's own frame (the shifted rows' sums plus N times the shift)
    np.testing.assert_allclose(m.S, r.T @ X.astype(np.float64), rtol=1e-6)
    np.testing.assert_allclose(m.hard_sums[:, 0] / m.hard_counts,
                               [X[d_ref.argmin(1) == k, 0].astype(np.float64).mean()
                                for k in range(3)], rtol=1e-7)
    lab = fastanneal.responsibilities(X, C, T).argmax(1)
    np.testing.assert_array_equal(lab, d_ref.argmin(1))


def test_the_origin_rule():
    w = np.ones(4)
    near = np.array([[1.0, 0], [-1, 0], [0, 1], [0, -1]])
    for dtype in (np.float32, np.float64):
        Xn = near.astype(dtype)
        assert V.centered_rows(Xn, w)[1] is None            # no copy near the origin
    far = near + 10.0                                       # ||mean||^2 = 200 > spread 1
    Xc, origin = V.centered_rows(far.astype(np.float32), w)
    np.testing.assert_allclose(origin, [10.0, 10.0])
    assert Xc.dtype == np.float32 and np.allclose(Xc, near)
    assert V.centered_rows(far, w)[1] is None               # float64: far below its rounding
    assert V.centered_rows(near + 1e6, w)[1] is not None


def test_partial_fit_after_fit_continues_from_the_fit():
    X, y, _ = three_blobs(7)
    km = fastanneal.AnnealedKMeans(3, random_state=0).fit(X)
    C0 = km.cluster_centers_.copy()
    J0 = -km.score(X)
    batch = X[y == 0][:30]
    km.partial_fit(batch)
    # one batch from one cluster nudges the fit; it does not re-seed from the batch
    assert np.abs(km.cluster_centers_ - C0).max() < 0.5
    assert -km.score(X) < 1.02 * J0
    assert km.labels_.shape == (30,)                        # the batch's, as scikit-learn
    np.testing.assert_array_equal(km.labels_, km.predict(batch))
    with pytest.raises(ValueError, match="features"):
        km.partial_fit(X[:, :2])


def test_minibatch_checkpoint_resumes_in_a_new_process(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np, warnings, fastanneal
        warnings.simplefilter("ignore")
        g = np.random.default_rng(11)
        X = np.vstack([g.standard_normal((100, 4)) + g.standard_normal(4) * 4
                       for _ in range(5)])
        km = fastanneal.AnnealedKMeans(5, random_state=0, batch_size=64,
                                       checkpoint={str(tmp_path / 'ck')!r}).fit(X)
        print(km.checkpoint_info_["resumed_from"], km.cluster_centers_.sum().hex())
    """)
    env = dict(os.environ)
    outs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, check=True).stdout.split() for _ in range(2)]
    assert outs[0][0] == "None"
    assert outs[1][0] != "None"           # resumed from the finished checkpoint
    assert outs[0][1] == outs[1][1]


def test_parameters_the_minibatch_route_cannot_honour_are_refused():
    X, _, _ = three_blobs(8)
    for kw in ({"solver": "gradient"}, {"n_init": 3}):
        with pytest.raises(ValueError, match="batch_size"):
            fastanneal.AnnealedKMeans(3, batch_size=32, **kw).fit(X)
    for kw, what in (({"tol": -1.0}, "tol"), ({"tol": float("nan")}, "tol"),
                     ({"n_epochs": 0}, "n_epochs"), ({"n_epochs": float("nan")}, "n_epochs"),
                     ({"batches_per_step": 0}, "batches_per_step"),
                     ({"init_size": 0}, "init_size"), ({"prefetch": -1}, "prefetch")):
        with pytest.raises(ValueError, match=what):
            fastanneal.MiniBatchAnnealedKMeans(3, **kw).fit(X)
    with pytest.raises(ValueError, match="init"):
        fastanneal.AnnealedKMeans(3, init=lambda X, k: X[:k]).fit(X)


def test_complex_input_is_refused_by_the_functions():
    X = np.ones((4, 2)) + 1j
    C = np.ones((2, 2))
    for call in (lambda: fastanneal.moments(X, C, 1.0),
                 lambda: fastanneal.responsibilities(X, C, 1.0),
                 lambda: fastanneal.pairwise_distances(X, C),
                 lambda: fastanneal.moments(C, X[:2], 1.0)):
        with pytest.raises(ValueError, match="complex"):
            call()


def test_a_source_far_from_the_origin_that_cannot_shift_is_warned_about():
    from fastanneal._sources import InMemorySource
    X, _, _ = three_blobs(9, offset=1e4)
    src = InMemorySource(X, np.ones(len(X)), 0)           # built by hand: no origin
    with pytest.warns(fastanneal.AnnealingWarning, match="far from the origin"):
        try:
            fastanneal.AnnealedKMeans(3, random_state=0).fit_source(src)
        except ValueError:
            pass                # the rounding may also leave "all rows identical"
    X0, _, _ = three_blobs(9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastanneal.AnnealedKMeans(3, random_state=0).fit_source(
            InMemorySource(X0, np.ones(len(X0)), 0))


def test_coincident_centers_are_a_clear_error_naming_the_cause():
    """The last guard of a fit: centers that still coincide say why (data with fewer
    distinguishable points than K), as a ValueError the command reports as a usage error."""
    from types import SimpleNamespace
    km = fastanneal.AnnealedKMeans(3)
    C = np.array([[0.0, 1.0], [0.0, 1.0], [2.0, 0.0]])
    res = SimpleNamespace(converged=True, relocations=0, centers=C)
    with pytest.raises(ValueError, match="fewer than 3 points that can be told apart"):
        km._check_run(res, None, 3)
    ok = SimpleNamespace(converged=True, relocations=0, centers=C[1:])
    km._check_run(ok, {"hard_distortion": [2.0, 1.5]}, 2)
    assert ok.hard_objective_final == 1.5


def test_an_output_that_became_a_folder_fails_the_set_before_any_file_is_replaced(tmp_path):
    from fastanneal._io import OutputSet
    a, b = tmp_path / "a.csv", tmp_path / "b.html"
    a.write_text("old a")
    b.mkdir()                                  # the second target turned into a folder
    with pytest.raises(OSError, match="folder"):
        with OutputSet() as outs:
            for final in (a, b):
                with open(outs.temp_for(final), "w") as f:
                    f.write("new")
            outs.commit()
    assert a.read_text() == "old a"            # the first output was not replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.html"]   # no temps


def test_the_command_restores_the_sigterm_handler(tmp_path):
    import signal
    from fastanneal import cli

    def mine(signum, frame):
        pass
    before = signal.signal(signal.SIGTERM, mine)
    try:
        rc = cli.main(["cluster", str(tmp_path / "missing.parquet"), "-o",
                       str(tmp_path / "o.csv"), "--k", "2", "-q"])
        assert rc == 2
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("minibatch", [False, True])
def test_float32_rows_after_a_float64_fit_far_from_the_origin(minibatch):
    """A float64 fit of rows offset by ~4e6 needs no origin in float64; float32 rows
    predicted with it got 47 % of their labels from the float32 rounding of |x|^2 (and
    score 2.3x too low), while transform and predict_proba were right."""
    from sklearn.datasets import make_blobs
    from fastanneal import AnnealedKMeans, MiniBatchAnnealedKMeans
    X, _ = make_blobs(2000, centers=6, n_features=2, cluster_std=200.0,
                      center_box=(-3000, 3000), random_state=0)
    Xo = X + [5e5, 4.2e6]
    est = (MiniBatchAnnealedKMeans if minibatch else AnnealedKMeans)(6, random_state=0).fit(Xo)
    X32 = Xo.astype(np.float32)
    d = ((X32.astype(np.float64)[:, None] - est.cluster_centers_[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(est.predict(X32), d.argmin(1))
    np.testing.assert_array_equal(est.predict_proba(X32).argmax(1), d.argmin(1))
    # (the float32 rows measured from the centers' mean: rounded once there, ~1e-8)
    assert -est.score(X32) == pytest.approx(d.min(1).sum(), rel=1e-7)
    assert est.predict_proba(X32).dtype == np.float32
    # ... and on a Dask array of them (score was 2.3x off there too)
    import dask
    import dask.array as da
    Xd = da.from_array(X32, chunks=700)
    with dask.config.set(scheduler="synchronous"):
        assert -float(est.score(Xd)) == pytest.approx(d.min(1).sum(), rel=1e-7)
        np.testing.assert_array_equal(est.predict(Xd).compute(), d.argmin(1))
        np.testing.assert_array_equal(est.transform(Xd).compute().argmin(1), d.argmin(1))

"""Core CPU kernels against the independent float64 reference (``tests/reference.py``) and
the oracles of docs/theory.md (sections 1-2, 4).

Error measure used throughout ("norm-wise relative error"): for a computed array ``a`` and the
reference ``b``, ``err = ||a - b||_2 / ||b||_2`` over all entries of the array (``||a||_2``
when ``b`` is all zero). The scalar energies of a record are checked together as one vector
``e = (D, T*H, F, J)`` -- they share the unit of a squared distance, and a free energy that
happens to be near 0 is not divided by itself -- as ``||e - e_ref|| / max(||e_ref||, W*m)``
with ``m`` the median reference distance: the kernel's GEMM-form distances carry an absolute
error of order ``eps * (||x||^2 + ||c||^2)``, so a record of a few rows sitting right on their
centers (J ~ 0) has no meaningful relative error below the data's own distance scale.
``min_margin`` is a difference of two distances, so its error is measured relative to the
largest reference distance.
Tolerances: ``1e-5`` for float32 input, ``1e-12`` for float64 input.

float32 comparisons use temperatures of at least ``0.3 x`` the median distance: the kernel
computes float32 distances (GEMM form), whose absolute error ``~1e-7 * scale`` becomes a
relative error ``~1e-7 * scale / T`` in ``exp(-d / T)``; at colder T a 1e-5 agreement with
the float64 reference is not what float32 can promise (float64 is tested down to 1e-2).
"""
import functools
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

import fastanneal as fa
from fastanneal import Moments, _config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference as ref  # noqa: E402

TOL = {np.float32: 1e-5, np.float64: 1e-12}
T_MULTS = {np.float32: (0.3, 1.0, 10.0, 1e3), np.float64: (1e-2, 0.1, 1.0, 10.0, 1e3)}
DTYPES = (np.float32, np.float64)
RESPS = ("softmax", "entmax15", "hard")
METRICS = ("euclidean", "cosine")


# ----------------------------------------------------------------------------- helpers
def rel_err(a, b):
    """Norm-wise relative error ``||a - b||_2 / ||b||_2`` (absolute when ``b == 0``)."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    assert a.shape == b.shape, (a.shape, b.shape)
    nb = np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    return diff / nb if nb > 0 else diff


def make_data(rng, n=120, D=5, K=6, dtype=np.float64, metric="euclidean"):
    """Gaussian blobs (off the origin) and centers near, but not at, the blob means; both in
    ``dtype`` (mixed dtypes have their own test)."""
    means = rng.normal(size=(K, D)) * 2.0 + (3.0 if metric == "euclidean" else 0.5)
    lab = rng.integers(0, K, n)
    X = means[lab] + 0.7 * rng.normal(size=(n, D))
    C = means + 0.5 * rng.normal(size=(K, D))
    return X.astype(dtype), C.astype(dtype)


def scale_of(X, C, metric="euclidean"):
    return float(np.median(ref.distances(X, C, metric)))


def record_dict(m):
    return {f: getattr(m, f) for f in ref.FIELDS}


def energies(r, T):
    g = r.get if isinstance(r, dict) else functools.partial(getattr, r)
    return np.array([g("soft_distortion"), T * g("entropy"), g("free_energy"),
                     g("hard_distortion")])


def record_errors(got, want, T, dist):
    """Norm-wise errors of every field of ``got`` (Moments or dict) against ``want`` (dict).

    ``dist`` is the reference distance matrix of the data (its scale normalises the energies
    and ``min_margin``, see the module docstring)."""
    dist = np.asarray(dist, dtype=np.float64)
    dmax = float(dist.max())
    g = got if isinstance(got, dict) else record_dict(got)
    errs = {f: rel_err(g[f], want[f]) for f in ("N", "S", "hard_counts", "weight",
                                                 "margin_sum")}
    if want.get("hard_sums") is not None:
        errs["hard_sums"] = rel_err(g["hard_sums"], want["hard_sums"])
    eb = energies(want, T)
    floor = want["weight"] * float(np.median(dist))
    errs["energies"] = (np.linalg.norm(energies(g, T) - eb)
                        / max(np.linalg.norm(eb), floor, 1e-300))
    a, b = g["min_margin"], want["min_margin"]
    if math.isinf(b) or math.isinf(a):
        errs["min_margin"] = 0.0 if a == b else math.inf
    else:
        errs["min_margin"] = abs(a - b) / dmax
    return errs


def assert_record_close(got, want, T, tol, dist, what=""):
    errs = record_errors(got, want, T, dist)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{what}: norm-wise relative errors above {tol:g}: {bad}"
    g = got if isinstance(got, dict) else record_dict(got)
    assert g["rows"] == want["rows"]


def assert_finite_record(m):
    for f in ref.FIELDS:
        v = getattr(m, f)
        if f == "min_margin":
            assert not np.isnan(v), f
            continue
        if v is None:
            continue
        assert np.all(np.isfinite(v)), f"{f} = {v}"


@pytest.fixture
def config(monkeypatch):
    """Set block size / sparse fraction / entmax sort limit for one test."""
    def set_(block=None, sparse=None, sort_max=None):
        if block is not None:
            monkeypatch.setattr(_config, "CPU_BLOCK_ROWS", block)
        if sparse is not None:
            monkeypatch.setattr(_config, "SPARSE_FRACTION", sparse)
        if sort_max is not None:
            monkeypatch.setattr(_config, "ENTMAX_SORT_MAX", sort_max)
    return set_


def random_log_prior(rng, K):
    p = rng.dirichlet(np.ones(K))
    return np.log(p)


# ----------------------------------------------------------------------------- distances
@pytest.mark.parametrize("block", [7, 512, 10 ** 6])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pairwise_distances_match_reference(rng, config, dtype, metric, block):
    config(block=block)
    for n in (1, 6, 7, 8, 53):
        X, C = make_data(rng, n=n, dtype=dtype, metric=metric)
        got = fa.pairwise_distances(X, C, metric=metric)
        assert got.dtype == dtype and got.shape == (n, C.shape[0])
        want = ref.distances(X, C, metric)
        assert rel_err(got, want) <= TOL[dtype], (n, rel_err(got, want))
        assert (got >= 0).all()


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_assign_matches_reference(rng, dtype, metric):
    X, C = make_data(rng, n=200, dtype=dtype, metric=metric)
    labels, dmin, margin = fa.assign(X, C, metric=metric)
    d = ref.distances(X, C, metric)
    want_lab = ref.hard_labels(d)
    ds = np.sort(d, axis=1)
    # a label may only differ where the two best distances tie within the dtype's error
    differ = labels != want_lab
    assert np.all(ds[differ, 1] - ds[differ, 0] <= TOL[dtype] * d.max())
    assert rel_err(dmin, ds[:, 0]) <= TOL[dtype]
    assert np.max(np.abs(margin - (ds[:, 1] - ds[:, 0]))) <= TOL[dtype] * d.max()


@pytest.mark.parametrize("prior", [False, True])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_label_rows_match_reference(rng, config, dtype, metric, prior):
    """The fused labelling pass: the nearest center, margin and runner-up of ``assign`` and
    the nearest center's softmax probability (with a prior) of a float64 NumPy evaluation,
    over four decades of temperature; row blocks smaller than the data (block=7)."""
    from fastanneal._moments import label_rows
    config(block=7)
    X, C = make_data(rng, n=150, dtype=dtype, metric=metric)
    K = C.shape[0]
    lp = random_log_prior(rng, K) if prior else None
    s = scale_of(X, C, metric)
    d = ref.distances(X, C, metric)
    ds = np.sort(d, axis=1)
    lab0, _, mar0, sec0 = fa.assign(X, C, metric=metric, return_second=True)
    for mult in (0.01, 0.1, 1.0, 10.0):
        T = mult * s
        lab, dmin, mar, sec, p = label_rows(X, C, T, lp, metric)
        np.testing.assert_array_equal(lab, lab0)
        np.testing.assert_array_equal(sec, sec0)
        np.testing.assert_array_equal(mar, mar0)
        assert rel_err(dmin, ds[:, 0]) <= TOL[dtype]
        P = ref.softmax(d, T, lp)
        want = P[np.arange(len(lab)), lab]
        # float32 distances carry ~1e-6 relative error, amplified by d / T in the logits
        tol = 1e-12 if dtype == np.float64 else 2e-5 * max(1.0, d.max() / T)
        assert np.max(np.abs(p - want)) <= tol, (mult, np.max(np.abs(p - want)))
    with pytest.raises(ValueError, match="T must be"):
        label_rows(X, C, 0.0)
    with pytest.raises(ValueError, match="log_prior"):
        label_rows(X, C, 1.0, np.zeros(K + 1))


# ----------------------------------------------------------------------------- responsibilities
@pytest.mark.parametrize("prior", [False, True])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind", RESPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_responsibilities_match_reference(rng, config, dtype, kind, metric, prior):
    config(block=7)
    X, C = make_data(rng, n=60, dtype=dtype, metric=metric)
    K = C.shape[0]
    lp = random_log_prior(rng, K) if prior else None
    s = scale_of(X, C, metric)
    for mult in T_MULTS[dtype]:
        T = mult * s
        got = fa.responsibilities(X, C, T, metric=metric, kind=kind, log_prior=lp)
        assert got.dtype == dtype and got.shape == (60, K)
        want = ref.responsibilities(X, C, T, metric=metric, kind=kind,
                                    log_prior=None if kind == "hard" else lp)
        e = rel_err(got, want)
        assert e <= TOL[dtype], f"T = {mult} x scale: error {e:.3g}"
        assert np.max(np.abs(got.sum(axis=1, dtype=np.float64) - 1.0)) <= 10 * TOL[dtype]
        assert (got >= 0).all()


def test_responsibilities_prior_with_zero_mass_cluster(rng):
    X, C = make_data(rng, n=40)
    lp = random_log_prior(rng, C.shape[0])
    lp[2] = -np.inf
    T = scale_of(X, C)
    for kind in ("softmax", "entmax15"):
        got = fa.responsibilities(X, C, T, kind=kind, log_prior=lp)
        assert np.all(got[:, 2] == 0.0)
        assert rel_err(got, ref.responsibilities(X, C, T, kind=kind, log_prior=lp)) <= 1e-12
        m = fa.moments(X, C, T, responsibilities=kind, log_prior=lp)
        assert m.N[2] == 0.0
        assert_record_close(m, ref.moments(X, C, T, responsibilities=kind, log_prior=lp),
                            T, 1e-12, ref.sqeuclidean(X, C), kind)


# ----------------------------------------------------------------------------- moments
@pytest.mark.parametrize("opts", ["plain", "weights", "prior", "weights+prior"])
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("resp", RESPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_moments_match_reference(rng, dtype, resp, metric, opts):
    n = 150
    X, C = make_data(rng, n=n, dtype=dtype, metric=metric)
    K = C.shape[0]
    w = rng.uniform(0.1, 3.0, n) if "weights" in opts else None
    lp = random_log_prior(rng, K) if "prior" in opts else None
    s = scale_of(X, C, metric)
    dist = ref.distances(X, C, metric)
    for mult in T_MULTS[dtype]:
        T = mult * s
        m = fa.moments(X, C, T, weights=w, metric=metric, responsibilities=resp,
                       log_prior=lp)
        assert m.temperature == T and m.responsibilities == resp and m.metric == metric
        assert m.S.dtype == np.float64 and m.N.dtype == np.float64
        want = ref.moments(X, C, T, weights=w, metric=metric, responsibilities=resp,
                           log_prior=lp)
        assert_record_close(m, want, T, TOL[dtype], dist, f"T = {mult} x scale")
        assert 0 < m.nnz <= n * K


@pytest.mark.parametrize("resp", RESPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_moments_blocks_and_accumulation_paths(rng, config, dtype, resp):
    """Ragged blocks (7 rows), one block for everything, dense vs sparse accumulation."""
    K = 6
    lp = random_log_prior(rng, K)
    for n in (1, 6, 7, 8, 50, 301):
        X, C = make_data(rng, n=n, K=K, dtype=dtype)
        w = rng.uniform(0.0, 2.0, n)
        T = scale_of(X, C) * (0.3 if dtype == np.float32 else 0.05)
        want = ref.moments(X, C, T, weights=w, responsibilities=resp, log_prior=lp)
        dist = ref.sqeuclidean(X, C)
        got = {}
        for block in (7, 10 ** 6):
            for sparse in (0.0, 1.0):
                config(block=block, sparse=sparse)
                m = fa.moments(X, C, T, weights=w, responsibilities=resp, log_prior=lp)
                assert_record_close(m, want, T, TOL[dtype], dist,
                                    f"n={n} block={block} sparse={sparse}")
                got[block, sparse] = m
        base = got[7, 0.0]
        for key, m in got.items():
            assert_record_close(m, record_dict(base), T, TOL[dtype], dist, f"{key} vs dense")
            assert m.nnz == base.nnz


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_moments_row_sums_at_large_D_match_reference(rng, config, dtype, metric):
    """The soft sums of a block too dense for the float64 sparse path take the row-by-row
    path in the rows' dtype at ``D >= ROW_SUMS_MIN_D`` with at most ``ROW_SUMS_MAX_NNZ``
    kept entries a row, else one GEMM: small K (every row <= 12 entries), large K at a
    temperature keeping a few entries a row (row path) and at a hot one (GEMM). Each
    against the float64 reference; the kept entries a row say which path ran."""
    from fastanneal import _kernels
    assert _kernels.ROW_SUMS_MIN_D <= 96 and _kernels.ROW_SUMS_MAX_NNZ == 12
    config(sparse=0.0)                       # the float64 sparse path never runs
    for K, mult, lo, hi in ((10, 10.0, 9, 10), (40, None, 3, 10), (40, 1e3, 39, 40)):
        X, C = make_data(rng, n=700, D=96, K=K, dtype=dtype, metric=metric)
        s = scale_of(X, C, metric)
        if mult is None:                     # bisect log T to keep 3-10 entries a row
            a, b = -12.0, 3.0
            for _ in range(40):
                mult = 10.0 ** (0.5 * (a + b))
                kept = fa.moments(X, C, mult * s, metric=metric).nnz / X.shape[0]
                if lo <= kept <= hi:
                    break
                a, b = (a, 0.5 * (a + b)) if kept > hi else (0.5 * (a + b), b)
        want = ref.moments(X, C, mult * s, metric=metric)
        m = fa.moments(X, C, mult * s, metric=metric)
        assert lo <= m.nnz / m.rows <= hi, (K, mult, m.nnz / m.rows)
        assert_record_close(m, want, mult * s, TOL[dtype], ref.distances(X, C, metric),
                            f"K={K} T={mult} x scale")


@pytest.mark.parametrize("resp", ["softmax", "entmax15"])
def test_entmax_sort_and_bisect_paths_in_kernel(rng, config, resp):
    """K = 80 at a hot T: > 48 entmax candidates (the bisection path); force each path."""
    X, C = make_data(rng, n=70, K=80, D=4)
    T = 5.0 * scale_of(X, C)
    while np.min((ref.responsibilities(X, C, T, kind="entmax15") > 0).sum(axis=1)) <= 48:
        T *= 2.0                                          # make the case really large
    want = ref.moments(X, C, T, responsibilities=resp)
    wantR = ref.responsibilities(X, C, T, kind=resp)
    dist = ref.sqeuclidean(X, C)
    for sort_max in (0, 48, 10 ** 6):
        for block in (7, 10 ** 6):
            config(block=block, sort_max=sort_max)
            m = fa.moments(X, C, T, responsibilities=resp)
            assert_record_close(m, want, T, 1e-12, dist, f"sort_max={sort_max}")
            R = fa.responsibilities(X, C, T, kind=resp)
            assert rel_err(R, wantR) <= 1e-12


@pytest.mark.parametrize("resp", RESPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_cluster(rng, config, dtype, resp):
    config(block=7)
    X, _ = make_data(rng, n=30, dtype=dtype)
    C = X[:1] + dtype(0.1)
    w = rng.uniform(0.5, 2.0, 30)
    T = scale_of(X, C)
    m = fa.moments(X, C, T, weights=w, responsibilities=resp)
    want = ref.moments(X, C, T, weights=w, responsibilities=resp)
    assert_record_close(m, want, T, TOL[dtype], ref.sqeuclidean(X, C), "K = 1")
    assert m.min_margin == math.inf and m.margin_sum == 0.0
    assert np.allclose(m.N, w.sum(), rtol=TOL[dtype])
    assert m.entropy == 0.0
    # K = 1: T W log K = 0, so the certificate forces F == J (exactly, as documented)
    assert m.hard_distortion == m.free_energy
    R = fa.responsibilities(X, C, T, kind=resp)
    assert np.all(R == 1.0)


def test_empty_block_is_the_zero_record(rng):
    X, C = make_data(rng, n=10)
    for resp in RESPS:
        m = fa.moments(X[:0], C, 1.0, responsibilities=resp)
        z = Moments.zeros(C.shape[0], C.shape[1], 1.0, responsibilities=resp)
        for f in ref.FIELDS + ("nnz",):
            assert np.array_equal(getattr(m, f), getattr(z, f)), f


# ----------------------------------------------------------------------------- dtype, threads
@pytest.mark.parametrize("dtype, out", [(np.float32, np.float32), (np.float64, np.float64),
                                        (np.int64, np.float64), (np.float16, np.float64)])
def test_output_dtypes(rng, dtype, out):
    X = (rng.normal(size=(9, 3)) * 4).astype(dtype)
    X[:, 0] = 3                                  # no all-zero row (cosine) after the cast
    C = rng.normal(size=(4, 3)).astype(out)      # mixed dtypes: test_mixed_precision_inputs
    for metric in METRICS:
        assert fa.pairwise_distances(X, C, metric=metric).dtype == out
        for kind in RESPS:
            assert fa.responsibilities(X, C, 2.0, metric=metric, kind=kind).dtype == out
    assert fa.moments(X, C, 2.0).S.dtype == np.float64


@pytest.mark.parametrize("xdt, cdt", [(np.float32, np.float64), (np.float64, np.float32),
                                      (np.float32, np.int64)])
def test_mixed_precision_inputs(rng, xdt, cdt):
    """X and centers of different dtypes: the computation runs in X's dtype (as ``moments``
    already does), every entry point accepts them."""
    X, C = make_data(rng, n=40, dtype=xdt)
    C = (C * 3).astype(cdt)
    T = scale_of(X, C)
    d = fa.pairwise_distances(X, C)
    assert d.dtype == xdt and rel_err(d, ref.sqeuclidean(X, C)) <= 1e-5
    R = fa.responsibilities(X, C, T)
    assert R.dtype == xdt and rel_err(R, ref.responsibilities(X, C, T)) <= 1e-5
    labels, dmin, margin = fa.assign(X, C)
    assert rel_err(dmin, ref.sqeuclidean(X, C).min(axis=1)) <= 1e-5
    m = fa.moments(X, C, T)
    assert_record_close(m, ref.moments(X, C, T), T, 1e-5, ref.sqeuclidean(X, C), "mixed")


def test_bitwise_reproducible_at_fixed_thread_count(rng):
    X, C = make_data(rng, n=3000)
    for dtype in DTYPES:
        for resp in RESPS:
            a = fa.moments(X.astype(dtype), C, 3.0, responsibilities=resp)
            b = fa.moments(X.astype(dtype), C, 3.0, responsibilities=resp)
            for f in ref.FIELDS + ("nnz",):
                assert np.array_equal(getattr(a, f), getattr(b, f)), (dtype, resp, f)


_THREAD_SCRIPT = textwrap.dedent("""
    import sys
    import numba
    import numpy as np
    import fastanneal as fa
    d = np.load(sys.argv[1])
    out = {"threads": numba.get_num_threads()}
    for dt in ("f32", "f64"):
        for resp in ("softmax", "entmax15", "hard"):
            m = fa.moments(d["X" + dt], d["C"], float(d["T"]), weights=d["w"],
                           responsibilities=resp)
            for f in ("N", "S", "soft_distortion", "entropy", "free_energy",
                      "hard_distortion", "hard_counts", "hard_sums", "weight", "rows",
                      "margin_sum", "min_margin", "nnz"):
                out[f"{dt}_{resp}_{f}"] = getattr(m, f)
    np.savez(sys.argv[2], **out)
""")


def _moments_in_subprocess(tmp_path, threads):
    # every pass split over the threads, however small (fastanneal/_pool.py)
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), FASTANNEAL_PARALLEL_MIN_WORK="0")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / f"out{threads}.npz"
    res = subprocess.run([sys.executable, "-c", _THREAD_SCRIPT, str(tmp_path / "in.npz"),
                          str(out)], env=env, cwd=root, timeout=300,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.load(out)
    assert int(got["threads"]) == threads
    return got


def test_no_drift_with_thread_count(rng, tmp_path, monkeypatch):
    """NUMBA_NUM_THREADS=1 and =3 (subprocesses; 3 whatever the core count, so the row ranges
    always differ) vs the default thread count (here).

    Only the association of the sums changes: float64 input agrees to 1e-12 norm-wise; float32
    input also changes which rows share a float32 GEMM block, so it agrees to 1e-5.
    """
    X, C = make_data(rng, n=3000)
    w = rng.uniform(0.0, 2.0, 3000)
    T = scale_of(X, C)
    monkeypatch.setattr(_config, "PARALLEL_MIN_WORK", 0)
    np.savez(tmp_path / "in.npz", Xf32=X.astype(np.float32), Xf64=X, C=C, w=w, T=T)
    runs = {1: _moments_in_subprocess(tmp_path, 1), 3: _moments_in_subprocess(tmp_path, 3)}
    dist = ref.sqeuclidean(X, C)
    for dt, Xd in (("f32", X.astype(np.float32)), ("f64", X)):
        tol = 1e-5 if dt == "f32" else 1e-12
        for resp in RESPS:
            m = fa.moments(Xd, C, T, weights=w, responsibilities=resp)
            for threads, run in runs.items():
                other = {f: run[f"{dt}_{resp}_{f}"][()] for f in ref.FIELDS}
                assert_record_close(m, other, T, tol, dist, f"{dt} {resp} {threads} vs "
                                    f"{numba.get_num_threads()} threads")
                assert m.nnz == int(run[f"{dt}_{resp}_nnz"])
            one = {f: runs[1][f"{dt}_{resp}_{f}"][()] for f in ref.FIELDS}
            three = {f: runs[3][f"{dt}_{resp}_{f}"][()] for f in ref.FIELDS}
            assert_record_close(three, one, T, tol, dist, f"{dt} {resp} 3 vs 1 threads")


# ----------------------------------------------------------------------- theory oracles
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_certificate_over_twelve_decades(rng, dtype, metric):
    """0 <= J - F <= T W log K for T from 1e-4 to 1e4 times the median distance, no NaN/inf."""
    X, C = make_data(rng, n=200, K=7, dtype=dtype, metric=metric)
    w = rng.uniform(0.0, 3.0, 200)
    s = scale_of(X, C, metric)
    for T in s * np.logspace(-4, 4, 17):
        m = fa.moments(X, C, T, weights=w, metric=metric)
        assert_finite_record(m)
        gap = m.hard_distortion - m.free_energy
        # the lower bound is exact (documented); the upper one gets a few ulps of slack
        slack = 1e-14 * (abs(m.hard_distortion) + T * m.weight)
        assert 0.0 <= gap <= T * m.weight * math.log(7) + slack, (T / s, gap)
        o = m.objectives()
        assert math.isfinite(o["entropy"]) and 0.0 <= o["entropy"] <= math.log(7) + 1e-12
        R = fa.responsibilities(X, C, T, metric=metric)
        assert np.all(np.isfinite(R))


def test_softmax_certificate_lower_bound_is_exact():
    """The docstring of ``fastanneal.moments`` promises ``0 <= J - F`` *exactly*. Here the
    distance is exact (d = 15 from integer coordinates), the second center is far, so
    mathematically F = J; with T = 0.11328125, fl(fl(d / T) * T) = 15.000000000000002 > d."""
    X = np.array([[3.0, 2.0, 1.0, 1.0]])
    C = np.array([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]])
    T = 0.11328125
    for K in (1, 2):
        m = fa.moments(X, C[:K], T)
        assert m.hard_distortion == 15.0
        assert m.hard_distortion - m.free_energy >= 0.0, (K, m.free_energy)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_entmax_certificate_over_twelve_decades(rng, dtype, metric):
    """0 <= J - F <= (4/3) T W (1 - K^-1/2) with the Tsallis-1.5 entropy."""
    K = 7
    X, C = make_data(rng, n=200, K=K, dtype=dtype, metric=metric)
    w = rng.uniform(0.0, 3.0, 200)
    s = scale_of(X, C, metric)
    for T in s * np.logspace(-4, 4, 17):
        m = fa.moments(X, C, T, weights=w, metric=metric, responsibilities="entmax15")
        assert_finite_record(m)
        gap = m.hard_distortion - m.free_energy
        bound = (4.0 / 3.0) * T * m.weight * (1.0 - K ** -0.5)
        # rounding slack: a few ulps of J (the bound itself is exact mathematics)
        slack = 1e-14 * (abs(m.hard_distortion) + T * m.weight)
        assert -slack <= gap <= bound + slack, (T / s, gap, bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_free_energy_equals_distortion_minus_T_entropy(rng, dtype):
    """F = D - T H for softmax (no prior) and entmax15 (by definition of F^ent)."""
    X, C = make_data(rng, n=100, dtype=dtype)
    w = rng.uniform(0.0, 2.0, 100)
    s = scale_of(X, C)
    for resp in ("softmax", "entmax15"):
        for T in s * np.logspace(-3, 3, 7):
            m = fa.moments(X, C, T, weights=w, responsibilities=resp)
            lhs = m.free_energy
            rhs = m.soft_distortion - T * m.entropy
            assert abs(lhs - rhs) <= 1e-12 * (abs(m.soft_distortion) + T * abs(m.entropy)), \
                (resp, T / s, lhs, rhs)


def test_softmax_soft_to_hard_bound(rng):
    """docs/theory.md 4.1: 1 - r_i,c(i) <= (K - 1) exp(-Delta_i / T)."""
    X, C = make_data(rng, n=300, K=5)
    K = C.shape[0]
    d = ref.sqeuclidean(X, C)
    lab = ref.hard_labels(d)
    ds = np.sort(d, axis=1)
    delta = ds[:, 1] - ds[:, 0]
    s = scale_of(X, C)
    for T in s * np.array([1e-3, 1e-2, 0.05, 0.2, 1.0, 10.0]):
        R = fa.responsibilities(X, C, T)
        lhs = 1.0 - R[np.arange(300), lab]
        bound = (K - 1) * np.exp(-delta / T)
        assert np.all(lhs <= bound * (1 + 1e-9) + 1e-15), T / s


def test_entmax_equals_hard_labels_below_half_min_margin(rng, config):
    """docs/theory.md 4.2: T <= Delta_min / 2  =>  entmax responsibilities are exactly the hard labels;
    just above, the point(s) at the minimum margin are no longer one-hot."""
    X, C = make_data(rng, n=250, K=5)
    w = rng.uniform(0.5, 2.0, 250)
    d = ref.sqeuclidean(X, C)
    lab = ref.hard_labels(d)
    ds = np.sort(d, axis=1)
    delta = ds[:, 1] - ds[:, 0]
    dmin = delta.min()
    onehot = np.zeros_like(d)
    onehot[np.arange(250), lab] = 1.0
    T = dmin / 2 * (1 - 1e-9)
    R = fa.responsibilities(X, C, T, kind="entmax15")
    assert np.array_equal(R, onehot)
    assert np.array_equal(R, fa.responsibilities(X, C, T, kind="hard"))
    config(sparse=1.0)           # the sparse path adds w * x row by row, as the hard sums do
    m = fa.moments(X, C, T, weights=w, responsibilities="entmax15")
    assert np.array_equal(m.N, m.hard_counts)
    assert np.array_equal(m.S, m.hard_sums)
    assert m.entropy == 0.0
    assert m.soft_distortion == m.hard_distortion == m.free_energy
    # just above Delta_min / 2 the closest call gets a second non-zero entry
    R = fa.responsibilities(X, C, dmin / 2 * (1 + 1e-4), kind="entmax15")
    i = np.argmin(delta)
    assert np.count_nonzero(R[i]) == 2
    assert np.array_equal(R[delta > 2 * dmin], onehot[delta > 2 * dmin])


def test_entmax_sort_equals_bisection(rng):
    cases = [
        rng.normal(size=(200, 7)) * 3,
        rng.normal(size=(50, 40)) * 0.5,
        rng.uniform(0, 0.1, size=(5, 2000)),                 # huge K, huge support
        rng.normal(size=(5, 2000)) * 3,                      # huge K, small support
        rng.integers(0, 4, size=(30, 2000)) * 0.5,           # huge K, many ties
        rng.integers(0, 3, size=(100, 9)).astype(float),     # ties in the support
        np.zeros((3, 2000)),                                 # all tied
        np.array([[0.0, 0.0, -2.0, -2.0, -7.5], [1.0, 1.0, 1.0, -1.0, -1.0]]),
    ]
    for Z in cases:
        a = fa.entmax15(Z, method="sort")
        b = fa.entmax15(Z, method="bisect")
        want = ref.entmax15(Z)
        assert np.max(np.abs(a - b)) <= 1e-12, Z.shape
        assert np.max(np.abs(a - want)) <= 1e-12, Z.shape
        assert np.max(np.abs(ref.entmax15_bisect(Z) - want)) <= 1e-12
        assert np.max(np.abs(a.sum(axis=1) - 1.0)) <= 1e-12
    z = rng.normal(size=6)
    assert fa.entmax15(z).shape == (6,)
    assert np.max(np.abs(fa.entmax15(z) - ref.entmax15(z))) <= 1e-12


def test_entmax_gap_two_one_hot_rule(rng):
    """One-hot iff the top-two logit gap is >= 2."""
    K = 6
    for _ in range(300):
        z = rng.normal(size=K) * 2
        top = np.argmax(z)
        gap = rng.uniform(0.0, 4.0)
        if abs(gap - 2.0) < 1e-9:
            continue
        others = np.delete(np.arange(K), top)
        z[others] = np.minimum(z[others], z[top] - gap)   # second best now exactly below
        z[others[0]] = z[top] - gap
        true_gap = z[top] - np.max(z[others])
        for method in ("sort", "bisect"):
            p = fa.entmax15(z, method=method)
            if true_gap >= 2.0:
                assert np.count_nonzero(p) == 1 and p[top] == 1.0, (true_gap, p)
            else:
                assert np.count_nonzero(p) >= 2, (true_gap, p)
    # exactly 2 (integer logits: the gap is exact)
    for method in ("sort", "bisect"):
        p = fa.entmax15(np.array([5.0, 3.0, 1.0, 3.0]), method=method)
        assert np.array_equal(p, [1.0, 0.0, 0.0, 0.0])


def test_entmax_two_entry_closed_form(rng):
    """h = gap/2 < 1:  p = ((sqrt(2 - h^2) +- h) / 2)^2."""
    for _ in range(100):
        h = rng.uniform(0.0, 0.999)
        a = rng.normal() * 5
        K = int(rng.integers(2, 8))
        z = np.full(K, a - 2 * h - 10.0)      # everything else far below the pair
        z[0], z[1] = a, a - 2 * h
        h_true = (z[0] - z[1]) / 2
        r = math.sqrt(2 - h_true ** 2)
        for method in ("sort", "bisect"):
            p = fa.entmax15(z, method=method)
            assert abs(p[0] - ((r + h_true) / 2) ** 2) <= 1e-12
            assert abs(p[1] - ((r - h_true) / 2) ** 2) <= 1e-12
            assert np.all(p[2:] == 0.0)


# ----------------------------------------------------------------------------- weights
@pytest.mark.parametrize("resp", RESPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_equal_repetition(rng, config, dtype, resp):
    config(block=7)
    X, C = make_data(rng, n=80, dtype=dtype)
    w = rng.integers(1, 4, 80)
    T = scale_of(X, C) * 0.5
    lp = random_log_prior(rng, C.shape[0])
    a = fa.moments(X, C, T, weights=w, responsibilities=resp, log_prior=lp)
    b = fa.moments(np.repeat(X, w, axis=0), C, T, responsibilities=resp, log_prior=lp)
    wa = record_dict(a)
    wa["rows"] = int(w.sum())
    assert_record_close(wa, record_dict(b), T, TOL[dtype], ref.sqeuclidean(X, C),
                        "weights vs repetition")
    # a scalar weight is a constant weight
    c = fa.moments(X, C, T, weights=2.5, responsibilities=resp)
    d = fa.moments(X, C, T, weights=np.full(80, 2.5), responsibilities=resp)
    for f in ref.FIELDS:
        assert np.array_equal(getattr(c, f), getattr(d, f)), f


@pytest.mark.parametrize("resp", RESPS)
def test_zero_weight_rows_equal_absent_rows(rng, resp):
    """Weight 0 = repeated 0 times: the record must not see the row at all. The zero-weight
    row sits half-way between two centers (margin 0 up to rounding)."""
    X, C = make_data(rng, n=40, K=4)
    C[1] = C[0] + np.array([2.0, 0.0, 0.0, 0.0, 0.0])
    tie = (C[0] + C[1]) / 2
    Xw = np.vstack([X, tie[None, :]])
    w = np.append(np.ones(40), 0.0)
    T = scale_of(X, C)
    a = fa.moments(Xw, C, T, weights=w, responsibilities=resp)
    b = fa.moments(X, C, T, responsibilities=resp)
    ra = record_dict(a)
    ra["rows"] = 40
    assert_record_close(ra, record_dict(b), T, 1e-12, ref.sqeuclidean(X, C),
                        "zero-weight row vs no row")


# ----------------------------------------------------------------------------- merge, finalize
def _splits(rng, n, parts):
    cuts = np.sort(rng.integers(0, n + 1, parts - 1))
    cuts = np.concatenate([[0], cuts, [0, n]])          # includes an empty block
    cuts.sort()
    return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]


@pytest.mark.parametrize("resp", RESPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_of_splits_equals_whole(rng, dtype, resp):
    X, C = make_data(rng, n=157, dtype=dtype)
    w = rng.uniform(0.0, 2.0, 157)
    T = scale_of(X, C) * 0.7
    whole = fa.moments(X, C, T, weights=w, responsibilities=resp)
    dist = ref.sqeuclidean(X, C)
    for parts in (1, 2, 5, 12):
        recs = [fa.moments(X[a:b], C, T, weights=w[a:b], responsibilities=resp)
                for a, b in _splits(rng, 157, parts)]
        assert any(r.rows == 0 for r in recs)
        for merged in (functools.reduce(Moments.merge, recs), sum(recs),
                       sum(recs[::-1], Moments.zeros(C.shape[0], C.shape[1], T, resp))):
            assert_record_close(merged, record_dict(whole), T, TOL[dtype], dist,
                                f"{parts} parts")
            assert merged.nnz == whole.nnz and merged.rows == whole.rows


def test_zeros_is_the_identity(rng):
    X, C = make_data(rng, n=30)
    for resp in RESPS:
        for metric in METRICS:
            m = fa.moments(X, C, 1.3, responsibilities=resp, metric=metric)
            z = Moments.zeros(C.shape[0], C.shape[1], 1.3, responsibilities=resp,
                              metric=metric)
            for r in (m + z, z + m, m.merge(z), sum([m])):
                for f in ref.FIELDS + ("nnz", "temperature", "responsibilities", "metric"):
                    assert np.array_equal(getattr(r, f), getattr(m, f)), f
    z = Moments.zeros(3, 2, 1.0, hard_sums=False)
    assert z.hard_sums is None
    m = fa.moments(X[:, :2], C[:3, :2], 1.0)
    assert (m + z).hard_sums is None


def test_merging_incompatible_records_raises(rng):
    X, C = make_data(rng, n=20)
    m = fa.moments(X, C, 1.0)
    bad = [fa.moments(X, C, 2.0),
           fa.moments(X, C, 1.0, responsibilities="entmax15"),
           fa.moments(X, C, 1.0, metric="cosine"),
           fa.moments(X, C[:-1], 1.0),
           fa.moments(X[:, :-1], C[:, :-1], 1.0)]
    for b in bad:
        with pytest.raises(ValueError, match="cannot merge"):
            m.merge(b)
        with pytest.raises(ValueError, match="cannot merge"):
            b + m
    with pytest.raises(TypeError):
        m + 1
    with pytest.raises(TypeError):
        m + np.ones(3)


def test_finalize(rng):
    X, C = make_data(rng, n=100, K=4)
    C[3] = 1e4                                       # nobody near: an empty cluster
    T = scale_of(X, C[:3], "euclidean") * 0.5
    m = fa.moments(X, C, T)
    assert m.N[3] == 0.0 and m.hard_counts[3] == 0.0
    up = m.finalize(previous_centers=C)
    assert np.array_equal(up.empty, [False, False, False, True])
    assert np.allclose(up.centers[:3], m.S[:3] / m.N[:3, None], rtol=1e-15, atol=0)
    assert np.array_equal(up.centers[3], C[3])
    want = ref.moments(X, C, T)
    assert rel_err(up.centers[:3], want["S"][:3] / want["N"][:3, None]) <= 1e-12
    up = m.finalize()
    assert np.all(np.isnan(up.centers[3])) and np.all(np.isfinite(up.centers[:3]))
    up = m.finalize(previous_centers=C, hard=True)
    assert np.allclose(up.centers[:3], m.hard_sums[:3] / m.hard_counts[:3, None],
                       rtol=1e-15, atol=0)
    assert np.array_equal(up.centers[3], C[3]) and up.empty[3]
    o = up.objectives
    assert o["entropy"] == m.entropy / m.weight and o["weight"] == m.weight
    assert o["certificate_gap"] == m.hard_distortion - m.free_energy
    assert o["certificate_bound"] == T * m.weight * math.log(4)
    with pytest.raises(ValueError, match="hard sums"):
        fa.moments(X, C, T, hard_sums=False).finalize(hard=True)
    # cosine: the update is projected back on the sphere
    mc = fa.moments(X, C[:3], 0.5, metric="cosine")
    uc = mc.finalize()
    assert np.allclose(np.linalg.norm(uc.centers, axis=1), 1.0, rtol=1e-14)
    S = mc.S / mc.N[:, None]
    assert rel_err(uc.centers, S / np.linalg.norm(S, axis=1, keepdims=True)) <= 1e-14


# ----------------------------------------------------------------------------- bad input
def _bad_inputs():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(10, 4))
    C = rng.normal(size=(3, 4))
    Xnan = X.copy()
    Xnan[2, 1] = np.nan
    Xinf = X.copy()
    Xinf[4, 0] = np.inf
    Cnan = C.copy()
    Cnan[1, 1] = np.nan
    Xzero = X.copy()
    Xzero[3] = 0.0
    Czero = C.copy()
    Czero[2] = 0.0
    w = np.ones(10)
    wneg = w.copy()
    wneg[5] = -1.0
    wnan = w.copy()
    wnan[6] = np.nan
    mo, re, pd, asg = fa.moments, fa.responsibilities, fa.pairwise_distances, fa.assign
    cases = {
        "X NaN": (lambda: mo(Xnan, C, 1.0), ValueError, r"X contains NaN .*row 2"),
        "X inf": (lambda: mo(Xinf, C, 1.0), ValueError, r"X contains infinity .*row 4"),
        "centers NaN": (lambda: mo(X, Cnan, 1.0), ValueError, "centers contains NaN"),
        "X 1-D": (lambda: mo(X[0], C, 1.0), ValueError, "X must be 2-D"),
        "X 3-D": (lambda: mo(X[None], C, 1.0), ValueError, "X must be 2-D"),
        "centers 1-D": (lambda: mo(X, C[0], 1.0), ValueError, "centers must be 2-D"),
        "centers wrong D": (lambda: mo(X, C[:, :3], 1.0), ValueError,
                            "centers have 3 features but X has 4"),
        "no centers": (lambda: mo(X, C[:0], 1.0), ValueError, "centers has 0 samples"),
        "X 0 features": (lambda: mo(X[:, :0], C[:, :0], 1.0), ValueError, "0 features"),
        "X object": (lambda: mo(np.array([[1, "a"]], dtype=object), C[:, :2], 1.0),
                     ValueError, "dtype object"),
        "negative weight": (lambda: mo(X, C, 1.0, weights=wneg), ValueError,
                            r"negative weights .*row 5"),
        "NaN weight": (lambda: mo(X, C, 1.0, weights=wnan), ValueError,
                       r"weights contains NaN .*row 6"),
        "weights wrong length": (lambda: mo(X, C, 1.0, weights=w[:9]), ValueError,
                                 r"weights must have shape \(10,\)"),
        "T = 0": (lambda: mo(X, C, 0.0), ValueError, "temperature T must be finite and > 0"),
        "T < 0": (lambda: mo(X, C, -1.0), ValueError, "temperature T must be finite and > 0"),
        "T NaN": (lambda: mo(X, C, float("nan")), ValueError, "temperature T"),
        "T inf": (lambda: mo(X, C, float("inf")), ValueError, "temperature T"),
        "T < 0 hard": (lambda: mo(X, C, -1.0, responsibilities="hard"), ValueError,
                       "temperature T"),
        "T string": (lambda: mo(X, C, "1.0"), TypeError, "temperature T must be a real"),
        "T None": (lambda: mo(X, C, None), TypeError, "temperature T must be a real"),
        "T bool": (lambda: mo(X, C, True), TypeError, "temperature T must be a real"),
        "inf weight": (lambda: mo(X, C, 1.0, weights=np.where(w > 0, np.inf, w)), ValueError,
                       "weights contains NaN or infinity"),
        "weights 2-D": (lambda: mo(X, C, 1.0, weights=np.ones((10, 1))), ValueError,
                        "weights must have shape"),
        "log_prior +inf": (lambda: mo(X, C, 1.0, log_prior=[0.0, np.inf, 0.0]), ValueError,
                           r"log_prior contains NaN or \+inf"),
        "metric": (lambda: mo(X, C, 1.0, metric="manhattan"), ValueError,
                   "metric must be one of .*'manhattan'"),
        "responsibilities": (lambda: mo(X, C, 1.0, responsibilities="sparsemax"), ValueError,
                             "responsibilities must be one of .*'sparsemax'"),
        "cosine zero row": (lambda: mo(Xzero, C, 1.0, metric="cosine"), ValueError,
                            r"X has all-zero rows \(first at row 3\)"),
        "cosine zero center": (lambda: mo(X, Czero, 1.0, metric="cosine"), ValueError,
                               r"centers has all-zero rows \(first at row 2\)"),
        "log_prior shape": (lambda: mo(X, C, 1.0, log_prior=np.zeros(4)), ValueError,
                            r"log_prior must have shape \(3,\)"),
        "log_prior NaN": (lambda: mo(X, C, 1.0, log_prior=[0.0, np.nan, 0.0]), ValueError,
                          "log_prior contains NaN"),
        "log_prior all -inf": (lambda: mo(X, C, 1.0, log_prior=np.full(3, -np.inf)),
                               ValueError, "log_prior"),
        "resp X NaN": (lambda: re(Xnan, C, 1.0), ValueError, "X contains NaN"),
        "resp centers wrong D": (lambda: re(X, C[:, :3], 1.0), ValueError,
                                 "centers have 3 features but X has 4"),
        "resp T": (lambda: re(X, C, 0.0), ValueError, "temperature T"),
        "resp kind": (lambda: re(X, C, 1.0, kind="argmax"), ValueError,
                      "must be one of 'softmax', 'entmax15', 'hard'; got 'argmax'"),
        "resp metric": (lambda: re(X, C, 1.0, metric="l1"), ValueError, "metric must be one"),
        "resp cosine zero row": (lambda: re(Xzero, C, 1.0, metric="cosine"), ValueError,
                                 "all-zero rows"),
        "resp log_prior shape": (lambda: re(X, C, 1.0, log_prior=np.zeros(5)), ValueError,
                                 "log_prior must have shape"),
        "resp log_prior NaN": (lambda: re(X, C, 1.0, log_prior=[0.0, np.nan, 0.0]),
                               ValueError, "log_prior contains NaN"),
        "dist X inf": (lambda: pd(Xinf, C), ValueError, "X contains infinity"),
        "dist wrong D": (lambda: pd(X, C[:, :2]), ValueError, "centers have 2 features"),
        "dist metric": (lambda: pd(X, C, metric="hamming"), ValueError, "metric must be one"),
        "dist cosine zero row": (lambda: pd(Xzero, C, metric="cosine"), ValueError,
                                 "all-zero rows"),
        "assign X NaN": (lambda: asg(Xnan, C), ValueError, "X contains NaN"),
        "assign wrong D": (lambda: asg(X, C[:, :1]), ValueError, "centers have 1 features"),
        "entmax NaN": (lambda: fa.entmax15([0.0, np.nan]), ValueError, "Z contains NaN"),
        "entmax method": (lambda: fa.entmax15([0.0, 1.0], method="newton"), ValueError,
                          "method must be 'sort' or 'bisect'"),
        "entmax 3-D": (lambda: fa.entmax15(np.zeros((2, 2, 2))), ValueError, "1-D or 2-D"),
    }
    return cases


_BAD = _bad_inputs()


@pytest.mark.parametrize("name", list(_BAD))
def test_bad_input_names_the_problem(name):
    fn, exc, match = _BAD[name]
    with pytest.raises(exc, match=match):
        fn()


def test_valid_edge_inputs_are_accepted(rng):
    X, C = make_data(rng, n=10)
    m = fa.moments(X, C, 0.0, responsibilities="hard")       # T = 0 is fine for hard
    assert_record_close(m, ref.moments(X, C, 0.0, responsibilities="hard"), 0.0, 1e-12,
                        ref.sqeuclidean(X, C), "hard T = 0")
    assert np.array_equal(fa.responsibilities(X, C, 0.0, kind="hard"),
                          ref.responsibilities(X, C, 0.0, kind="hard"))
    for T in (np.float32(1.5), np.float64(1.5), 2):
        fa.moments(X, C, T)
    fa.moments(X.tolist(), C.tolist(), 1.0)                  # lists are arrays
    fa.moments(np.asfortranarray(X), C, 1.0)                 # any memory layout
    fa.moments(X[::2], C, 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_one_hot_shortcut_at_the_drop_threshold(rng, dtype):
    """Rows whose second-best logit sits just above / just below the drop threshold
    ``log eps`` take the one-hot shortcut or the general path; both must agree with the
    float64 reference (all K exponentials, nothing dropped)."""
    log_eps = math.log(2.0 ** (-24 if dtype == np.float32 else -53))
    T = 0.01
    C = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    # points on the segment c0-c1 at a: margin = (1 - a)^2 - a^2 = 1 - 2a; margin / T = g
    gs = -log_eps * np.array([1 - 1e-3, 1 - 1e-7, 1 + 1e-7, 1 + 1e-3, 0.5, 2.0, 5.0])
    gs = np.concatenate([gs, rng.uniform(0.1, 80.0, 40)])
    a = (1.0 - gs * T) / 2.0
    X = np.zeros((len(a), 3))
    X[:, 0] = a
    X[:, 1:] = 1e-3 * rng.standard_normal((len(a), 2))
    X, C = X.astype(dtype), C.astype(dtype)
    w = rng.uniform(0.5, 2.0, len(a))
    m = fa.moments(X, C, T, weights=w)
    want = ref.moments(X, C, T, weights=w)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert_record_close(m, want, T, tol, ref.sqeuclidean(X, C), "threshold rows")
    R = fa.responsibilities(X, C, T)
    Rref = ref.responsibilities(X, C, T)
    assert np.abs(R - Rref).max() <= (1e-13 if dtype == np.float64 else 1e-5)   # d / T rounding
    one_hot = (R == 1.0).all(axis=1) | ((R == 0.0).sum(1) == 2)
    assert one_hot[gs > -log_eps * 1.01].all()
    assert 0.0 <= m.hard_distortion - m.free_energy <= T * m.weight * math.log(3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad, metric", [(None, "euclidean"), (None, "cosine"),
                                         (np.nan, "euclidean"), (np.inf, "euclidean"),
                                         (-np.inf, "cosine"), (np.nan, "cosine"),
                                         ("huge", "euclidean"), ("tiny", "euclidean"),
                                         ("zero", "euclidean")])
def test_moments_input_check_in_one_pass(rng, dtype, bad, metric, monkeypatch):
    """``fa.moments`` checks X from its squared row norms (one pass): the element-wise checks
    of X run only when that pass finds something, and then raise exactly what they raised
    before (compared with ``check_finite`` / ``check_range`` called directly); clean X never
    reaches them, all-zero X only the range check (which accepts it)."""
    from fastanneal import _validation
    X = rng.standard_normal((300, 7)).astype(dtype)
    if bad == "huge":
        X[123] *= np.sqrt(_validation._SQ_MAX[np.dtype(dtype)])
    elif bad == "tiny":
        X *= np.sqrt(_validation._SQ_MIN[np.dtype(dtype)]) / 1e3
    elif bad == "zero":
        X[:] = 0.0
    elif bad is not None:
        X[123, 4] = bad
    C = rng.standard_normal((3, 7)).astype(dtype)
    want = None
    try:
        _validation.check_finite(X, "X")
        if metric == "euclidean":
            _validation.check_range(X, "X")
    except ValueError as e:
        want = str(e)
    on_X = []
    for fn in ("check_finite", "check_range"):
        real = getattr(_validation, fn)

        def spy(A, name="X", *a, _real=real, _fn=fn, **k):
            if name == "X":
                on_X.append(_fn)
            return _real(A, name, *a, **k)
        monkeypatch.setattr(_validation, fn, spy)
    if want is None:
        fa.moments(X, C, 1.0, metric=metric)
        assert on_X == ([] if bad is None else ["check_range"]), on_X
        return
    assert bad is not None
    with pytest.raises(ValueError) as err:
        fa.moments(X, C, 1.0, metric=metric)
    assert str(err.value) == want


def test_soft_sums_path_choice():
    """Which sum a soft block takes (``_kernels.soft_sums_path``): float64 row sums when
    sparse; row sums in the rows' dtype at D >= 64 with <= 12 kept entries a row (where the
    skinny GEMM is slow: K = 15, D = 384 measured 280 vs 120-220 us a 512-row block); the
    GEMM otherwise (dense large K, or small D where the per-entry loop loses)."""
    from fastanneal import _kernels as K_
    path = K_.soft_sums_path
    assert path(60, 512, 15, 384, 0.125) == K_.SUMS_SPARSE          # < 1/8 of m K
    assert path(512 * 10, 512, 15, 384, 0.125) == K_.SUMS_ROWS      # K = 15, 10 a row
    assert path(512 * 15, 512, 15, 384, 0.125) == K_.SUMS_GEMM      # dense K = 15
    assert path(512 * 10, 512, 15, 32, 0.125) == K_.SUMS_GEMM       # small D
    assert path(512 * 30, 512, 256, 384, 0.125) == K_.SUMS_SPARSE   # 30 of 256 a row
    assert path(512 * 40, 512, 256, 384, 0.125) == K_.SUMS_GEMM     # 40 of 256 a row
    assert path(512 * 64, 512, 64, 384, 0.125) == K_.SUMS_GEMM      # dense K = 64


@pytest.mark.parametrize("dtype,bound", [(np.float64, 2e-15), (np.float32, 1.5e-8)])
def test_softmax_exp_accuracy_follows_the_rows_precision(dtype, bound):
    """The kernel's exp (Cody-Waite + Taylor) against math.exp over the logits it sees,
    z in [-36, 0]: float64 rows get the degree-13 polynomial (< 2e-15 relative: a few
    units of float64's rounding), float32 rows the degree-7 one (below float32's rounding 6e-8, in which their
    responsibilities are stored); e^0 = 1 exactly in both. Read through a two-column block:
    the row's first entry is the largest logit (z = 0), the second ``z``, so the written
    responsibility is ``e^z / (1 + e^z)``, compared in float64 before the block's rounding
    (after the call the kernel's scratch holds ``e^z`` as mantissa ``P`` times power of
    two ``PB``, for the entries at or above the drop threshold ``Z >= log_eps``)."""
    from fastanneal import _kernels as K_
    z = np.concatenate([-np.linspace(0.0, 36.0, 4001), -np.geomspace(1e-9, 1.0, 200)])
    n = z.size
    T = 1.0
    G = np.zeros((n, 2), dtype)             # distances: d = -z T (the first column d = 0)
    G[:, 1] = (-z * T).astype(dtype)
    zq = -np.asarray(G[:, 1], dtype=np.float64) / T      # the logits after the rounding of d
    rows = np.arange(n, dtype=np.int64)
    log_eps = K_.LOG_EPS32 if dtype == np.float32 else K_.LOG_EPS64
    got = np.empty(n)
    Z, KF, P, PB = (np.empty(2) for _ in range(4))
    out = np.zeros((n, 7))
    for i in range(n):          # row by row: P * PB is the row's e^z after each call
        K_._softmax_rows(G, rows[i:i + 1], 1, np.zeros(1), np.ones(n), np.zeros(2), False,
                         T, log_eps, Z, KF, P, PB, np.zeros(2), out)
        assert P[0] * PB[0] == 1.0 and Z[0] == 0.0          # e^0, exactly
        got[i] = P[1] * PB[1] if Z[1] >= log_eps else 0.0
    want = np.exp(zq)
    keep = zq >= log_eps                     # below the drop threshold the entry is zero
    assert np.all(got[~keep] == 0.0)
    rel = np.abs(got[keep] - want[keep]) / want[keep]
    assert rel.max() < bound, rel.max()
    if dtype == np.float32:      # the cheaper polynomial is really in use (not degree 13)
        assert rel.max() > 1e-12


def test_vectorised_sums_do_not_depend_on_where_the_heap_put_a_scratch_vector():
    """Reproducibility: every kernel compiled with re-association (``fastmath``) lets LLVM
    vectorise its float64 sums. A loop that both sums and stores into a scratch vector is
    vectorised behind a run-time check that the vectors lie apart (256 bytes in the IR of
    these kernels on this machine), with
    the sequential loop -- rounded differently -- as fallback: the result then depended on
    where the allocator put the scratch vector (``temperature_start_`` changed in its last
    bit in about one process in ten). No sum of these kernels may be fed by such a check:
    their LLVM IR (compiled afresh, uncached) has no float64 phi with a ``vector.memcheck``
    predecessor."""
    import re

    import numba

    from fastanneal import _kernels as K_
    rng = np.random.default_rng(0)
    X32 = rng.standard_normal((50, 6)).astype(np.float32)
    X64 = X32.astype(np.float64)
    K = 7
    G = rng.random((4, K)).astype(np.float32)
    calls = {
        "_softmax_rows": (G, np.arange(4), 4, np.zeros(4), np.ones(4), np.zeros(K), False,
                          1.0, -16.6, np.empty(K), np.empty(K), np.empty(K), np.empty(K),
                          np.zeros(K), np.zeros((4, 8))),
        "_matvec_ranges": (X64, np.ones(50), np.zeros(50, np.int64), np.zeros((1, 6)),
                           np.ones((1, 6)), np.zeros((1, 2, 6)), 0, 1),
        "_pair_distances": (X32, X32[:3].copy(), np.arange(5), np.zeros(5, np.int64), 5, 1,
                            np.zeros(5)),
        "_sqnorm_ranges": (X32, np.zeros(50), 1, 0, 1),
        "_sqnorm": (X32, 3),
    }
    found = set()
    for name in dir(K_):
        f = getattr(K_, name)
        if isinstance(f, numba.core.registry.CPUDispatcher) and f.targetoptions.get("fastmath"):
            found.add(name)
    assert found == set(calls), found       # a new fastmath kernel: add its call here

    def other_dtype(a):                     # the signature of the rows' other precision
        if isinstance(a, np.ndarray) and a.dtype.kind == "f":
            return a.astype(np.float64 if a.dtype == np.float32 else np.float32)
        return a
    phi = re.compile(r"= phi( [a-z]+)* double ")   # (a phi may carry fast-math flags)
    for name, args in calls.items():
        f = getattr(K_, name)
        fresh = numba.njit(fastmath=f.targetoptions["fastmath"], nogil=True)(f.py_func)
        fresh(*args)
        if name in ("_softmax_rows", "_matvec_ranges", "_pair_distances", "_sqnorm_ranges"):
            # the rows' float32 and float64 signatures (G / X; the scratch stays float64)
            args2 = list(args)
            args2[0] = other_dtype(args[0])
            if name == "_pair_distances":
                args2[1] = other_dtype(args[1])
            fresh(*args2)
        assert len(fresh.signatures) >= (1 if name == "_sqnorm" else 2), name
        ir = "\n".join(fresh.inspect_llvm(sig) for sig in fresh.signatures)
        fed = [line for line in ir.splitlines() if phi.search(line) and "memcheck" in line]
        assert not fed, (name, fed[:3])
        assert re.search(r"fadd reassoc", ir), name     # (and the sums are re-associated)


# ----------------------------------------------------------------- inputs at the edges
def test_a_temperature_too_small_for_the_distances_is_named():
    """``d / T`` overflowing float64 made every logit ``-inf - (-inf)``: a ZeroDivisionError
    inside the softmax kernel, zero mass from entmax (T passed ``check_temperature``)."""
    X = np.array([[0.5, 1e5], [0.5, -1e5]])
    C = np.array([[0.0, 0.0], [1.0, 0.0]])
    for call in (lambda: fa.moments(X, C, 1e-300),
                 lambda: fa.moments(X, C, 1e-300, responsibilities="entmax15"),
                 lambda: fa.responsibilities(X, C, 1e-300),
                 lambda: fa.value_and_grad(X, C, 1e-300)):
        with pytest.raises(ValueError, match=r"T=1e-300 is too small for this data: squared "
                                             r"distances up to about 1e\+10"):
            call()
    # just inside the range: the exact one-hot answer (a tie: both rows split evenly)
    m = fa.moments(X, C, 1e-290)
    np.testing.assert_allclose(m.N, [1.0, 1.0])
    np.testing.assert_allclose(
        fa.moments(X, C, 1e-290, responsibilities="entmax15").N, [1.0, 1.0])
    # rows with a clear runner-up take the one-hot shortcut (always right): not refused;
    # entmax, a prior and the gradient have no shortcut (entmax returned zero mass)
    rng = np.random.default_rng(0)
    Y = rng.normal(size=(100, 4)) * 1e3
    want = fa.moments(Y, Y[:3], 1e-200).N
    np.testing.assert_array_equal(fa.moments(Y, Y[:3], 1e-305).N, want)
    np.testing.assert_array_equal(fa.moments(Y, Y[:3], 1e-305, responsibilities="hard").N,
                                  want)
    for kw in (dict(responsibilities="entmax15"), dict(log_prior=np.log([0.2, 0.3, 0.5]))):
        with pytest.raises(ValueError, match="too small for this data"):
            fa.moments(Y, Y[:3], 1e-305, **kw)
    # a margin below the rounding of d2 in the rows' dtype is a tie for the kernels (a
    # first version measured it in float64: the float32 row passed and crashed the kernel)
    Z = np.array([[0.0, 1e-4], [3.0, 1.0]], np.float32)
    with pytest.raises(ValueError, match="too small for this data"):
        fa.moments(Z, np.array([[14000.0, 0.0], [0.0, 14000.0]]), 1e-300)


def test_big_endian_float32_stays_float32():
    rng = np.random.default_rng(11)
    X = rng.standard_normal((40, 3)).astype(">f4")
    C = X[:3].astype(np.float64)
    assert fa.pairwise_distances(X, C).dtype == np.float32
    assert fa.responsibilities(X, C, 1.0).dtype == np.float32
    est = fa.AnnealedKMeans(3, random_state=0).fit(X.astype(np.float32))
    for out in (est.predict_proba(X), est.transform(X)):
        assert out.dtype == np.float32
    np.testing.assert_array_equal(est.predict(X), est.predict(X.astype(np.float32)))


def test_errors_at_the_edges_name_the_problem():
    X = np.random.default_rng(2).standard_normal((50, 3))
    with pytest.raises(ValueError, match=r"multiply it by about 1e310"):
        fa.moments(np.full((2, 2), 1e-310), [[0.0, 0.0]], 1.0)
    with pytest.raises(ValueError, match="weights holds complex numbers"):
        fa.moments(X, X[:2], 1.0, weights=np.ones(50, complex))
    est = fa.AnnealedKMeans(2, random_state=0).fit(X)
    with pytest.raises(ValueError, match="temperature must be None, 'final' or a number"):
        est.predict_proba(X, temperature=True)


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_transform_is_exact_near_the_centers(metric, dtype):
    """``transform`` took the square root of GEMM-form distances: a float32 row on its
    center was 5e-4 away from it (the rounding ~3e-7 |x|^2, square-rooted); each row's two
    nearest are now summed element by element, as scikit-learn's are exact there."""
    rng = np.random.default_rng(0)
    X = (rng.normal(size=(300, 8)) * 3 + 2).astype(dtype)
    est = fa.AnnealedKMeans(3, metric=metric, random_state=0).fit(X)
    C = est.cluster_centers_
    assert est.transform(C).dtype == dtype
    np.testing.assert_array_equal(np.diag(est.transform(C)), 0.0)
    X64, C64 = X.astype(np.float64), C.astype(np.float64)
    if metric == "cosine":
        X64 = X64 / np.linalg.norm(X64, axis=1, keepdims=True)
        C64 = C64 / np.linalg.norm(C64, axis=1, keepdims=True)
    ref = np.sqrt(((X64[:, None] - C64[None]) ** 2).sum(-1))
    got = est.transform(X)
    near = np.sort(ref, axis=1)[:, :2]
    # the two nearest: to the dtype's rounding of the distance itself; the rest: of |x|^2
    eps = np.finfo(dtype).eps
    np.testing.assert_allclose(np.sort(got, axis=1)[:, :2], near, rtol=8 * eps,
                               atol=1e-12)
    scale = float(np.max(np.sum(X64 ** 2, axis=1)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=np.sqrt(16 * eps * scale))


def test_weighted_distances_that_overflow_are_an_error_and_a_0d_temperature_is_a_number():
    """Rows and weights each in range, their products not: inf / NaN objectives with only
    a RuntimeWarning before. A 0-d array temperature was a TypeError (np.float64 was not)."""
    import fastanneal as fa
    X = np.array([[0.0], [1e60]])
    C = np.array([[0.0], [1.0]])
    with pytest.raises(ValueError, match="objectives overflow float64"):
        fa.moments(X, C, 1.0, weights=[1.0, 1e200])
    a = fa.moments(X[:1], C, np.array(1.0))
    b = fa.moments(X[:1], C, 1.0)
    np.testing.assert_array_equal(a.N, b.N)

"""The kernels' threads (``fastanneal/_pool.py``): serial Numba kernels over row ranges, range 0
in the calling thread and the others on a pool of Python threads; small passes stay in the
calling thread.

Tolerances: the row ranges change only the association of the sums, so float64 records agree
to 1e-12 (relative to the largest entry) between one and several ranges; per-row outputs
(labels, distances, responsibilities) are written by the same code whichever thread runs a row
and must be identical.
"""
import threading
import time

import numba
import numpy as np
import pytest

import fastanneal as fa
from fastanneal import _config, _kernels, _pool
from fastanneal._moments import compute_moments
from fastanneal._seeding import kmeans_plusplus
from fastanneal._sources import InMemorySource

FIELDS = ("N", "S", "hard_counts", "hard_sums", "soft_distortion", "entropy", "free_energy",
          "hard_distortion", "weight", "margin_sum", "min_margin")


@pytest.fixture
def spy(monkeypatch):
    """Record the number of ranges of every ``_pool.run`` call and the threads that ran
    them, still running them."""
    calls = []
    real = _pool.run

    def run(fn, args, nch):
        names = set()

        def tracked(*a):
            names.add(threading.current_thread().name)
            return fn(*a)
        real(tracked, args, nch)
        calls.append((nch, names))
    monkeypatch.setattr(_pool, "run", run)
    return calls


def _close(a, b, what, tol=1e-12):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-300)
    assert float(np.max(np.abs(a - b), initial=0.0)) <= tol * scale, what


def _data(seed, n=5000, K=12, D=6):
    rng = np.random.default_rng(seed)
    M = rng.standard_normal((K, D)) * 3.0
    X = M[rng.integers(0, K, n)] + rng.standard_normal((n, D))
    return X, rng.uniform(0.5, 2.0, n), M + 0.3 * rng.standard_normal((K, D))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two Numba threads")
def test_ranges_on_pool_threads_equal_one_range(monkeypatch, spy):
    X, w, C = _data(11)
    K = C.shape[0]
    old = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        results = {}
        for mode, min_work in (("serial", 1 << 62), ("threads", 0)):
            monkeypatch.setattr(_config, "PARALLEL_MIN_WORK", min_work)
            spy.clear()
            r = {}
            for resp in (0, 1, 2):
                r["m", resp] = compute_moments(X, w, C, 0.7, 0, resp, None, True)
            src = InMemorySource(X, w, 0)
            r["pruned"] = [src.moments(C * s, T) for s, T in ((1.0, 0.05), (1.01, 0.02))]
            # hard passes with hard sums (their pruned rows go to the hard sums only, the
            # soft sums are copied from them after the ranges are added up)
            r["pruned"] += [src.moments(C * s, 0.0, 2, None, True) for s in (1.0, 1.001)]
            assert src._bounds.pruned > 0
            r["assign"] = fa.assign(X, C, return_second=True)
            r["resp"] = fa.responsibilities(X, C, 0.3)
            r["dist"] = fa.pairwise_distances(X, C)
            r["kpp"] = kmeans_plusplus(X, w, K, np.random.default_rng(0))
            r["matvec"] = _kernels.cluster_cov_matvec_kernel(
                X, w, r["assign"][0], C, np.ones((K, X.shape[1])), 2)
            for resp in ("softmax", "entmax15"):
                r["grad", resp] = fa.value_and_grad(X, C, 0.5, lam=0.5, phi="log", weights=w,
                                                    responsibilities=resp)
            r["calls"] = list(spy)
            results[mode] = r
        serial, threads = results["serial"], results["threads"]
        # the serial mode never used the pool; the threaded one split every pass in two and
        # ran second ranges on a pool thread (not always: a range no pool thread has started
        # when the caller is done with its own is run by the caller)
        assert all(n == 1 for n, _ in serial["calls"]) and len(serial["calls"]) > 0
        assert len(threads["calls"]) >= len(serial["calls"])
        assert all(n == 2 for n, _ in threads["calls"])
        assert any(any(t.startswith("fastanneal") for t in names)
                   for _, names in threads["calls"])
        for resp in (0, 1, 2):
            a, b = threads["m", resp], serial["m", resp]
            for f in FIELDS:
                _close(getattr(a, f), getattr(b, f), (resp, f))
            assert a.rows == b.rows and a.nnz == b.nnz
        for a, b in zip(threads["pruned"], serial["pruned"]):
            for f in FIELDS:
                _close(getattr(a, f), getattr(b, f), ("pruned", f))
        for a, b in zip(threads["assign"], serial["assign"]):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(threads["resp"], serial["resp"])
        np.testing.assert_array_equal(threads["dist"], serial["dist"])
        np.testing.assert_array_equal(threads["kpp"], serial["kpp"])
        _close(threads["matvec"], serial["matvec"], "matvec")
        for resp in ("softmax", "entmax15"):
            # the gradient passes sum over a fixed number of row ranges whatever the thread
            # count (_grad_kernels.grad_ranges): bit for bit, not to rounding -- the gradient
            # solver's Adam steps amplify a last-bit difference about tenfold every ten steps
            a, b = threads["grad", resp], serial["grad", resp]
            assert a.value == b.value, resp
            np.testing.assert_array_equal(a.grad_centers, b.grad_centers)
            np.testing.assert_array_equal(a.grad_X, b.grad_X)
    finally:
        numba.set_num_threads(old)


def test_small_passes_stay_in_the_calling_thread(monkeypatch, spy):
    """Below ``PARALLEL_MIN_WORK`` no pool thread runs (the wake-up would cost more than
    the second core gains); above it the rows are split over the threads."""
    X, w, C = _data(12, n=800)
    monkeypatch.setattr(_config, "PARALLEL_MIN_WORK", 1 << 19)
    fa.AnnealedKMeans(12, random_state=0).fit(X)
    assert spy and all(n == 1 for n, _ in spy)
    assert all(names == {threading.current_thread().name} for _, names in spy)
    if numba.get_num_threads() >= 2:
        spy.clear()
        monkeypatch.setattr(_config, "PARALLEL_MIN_WORK", 0)
        compute_moments(X, w, C, 0.5)
        assert spy[-1][0] == numba.get_num_threads()


def test_run_waits_for_every_range_then_raises():
    """An error in one range is raised only after the other ranges have finished (none may
    still write into the caller's arrays), in the calling thread."""
    done = []

    def body(out, t0, t1):
        for t in range(t0, t1):
            if t == 1:
                raise ValueError("range one failed")
            time.sleep(0.05)
            out[t] = t + 1
            done.append(t)

    out = np.zeros(4)
    with pytest.raises(ValueError, match="range one failed"):
        _pool.run(body, (out,), 4)
    assert sorted(done) == [0, 2, 3]
    np.testing.assert_array_equal(out, [1, 0, 3, 4])


def test_ranges_no_thread_has_started_run_in_the_caller():
    """With the pool's only thread busy, ``run`` does the second range itself instead of
    waiting for that thread (a sleeping or descheduled thread never delays a pass)."""
    release = threading.Event()
    pool = _pool._executor(1)
    # occupy every pool thread (one per range beyond the first, as run(.., 2) will use)
    blockers = [pool.submit(release.wait, 30) for _ in range(_pool._pool_size)]
    try:
        out = np.zeros(2)
        ran = {}

        def body(a, t0, t1):
            for t in range(t0, t1):
                a[t] = t + 1
                ran[t] = threading.current_thread().name

        done = threading.Event()

        def call():
            _pool.run(body, (out,), 2)
            done.set()
        th = threading.Thread(target=call, name="caller")
        th.start()
        assert done.wait(10), "run waited for a pool thread that never started its range"
        np.testing.assert_array_equal(out, [1, 2])
        assert ran == {0: "caller", 1: "caller"}
    finally:
        release.set()
        for b in blockers:
            b.result()


def test_concurrent_callers_share_the_pool(monkeypatch):
    """Two user threads fitting at once (as two Dask worker threads do) share the pool and
    get exactly the results of the same fits run one after the other."""
    monkeypatch.setattr(_config, "PARALLEL_MIN_WORK", 0)      # every pass split
    data = [_data(21 + i, n=3000)[0] for i in range(2)]
    solo = [fa.AnnealedKMeans(12, random_state=i).fit(X).cluster_centers_ for i, X in
            enumerate(data)]
    got = [None, None]
    errors = []

    def fit(i):
        try:
            got[i] = fa.AnnealedKMeans(12, random_state=i).fit(data[i]).cluster_centers_
        except BaseException as e:     # noqa: B902 -- reported by the assertion below
            errors.append(e)
    threads = [threading.Thread(target=fit, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and all(not th.is_alive() for th in threads)
    for a, b in zip(got, solo):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two Numba threads")
@pytest.mark.parametrize("n, threaded", [(2250, False), (12000, True)])
def test_light_passes_stay_in_the_calling_thread_below_their_threshold(spy, n, threaded):
    """The one-multiply-add passes (Lanczos matvec, k-means++ step, the input check's row
    norms) count a quarter of their rows x D (``light=True``): at 2,250 x 384 (measured
    slower handed to two threads) they run in the calling thread while a moments pass of
    the same shape is split; from ~1M elements / 4 they split too."""
    rng = np.random.default_rng(4)
    X = rng.standard_normal((n, 384)).astype(np.float32)
    w = np.ones(n)
    labels = rng.integers(0, 3, n)
    mu = rng.standard_normal((3, 384))
    _kernels.cluster_cov_matvec_kernel(X, w, labels, mu, mu, 2)
    xsq = np.einsum("ij,ij->i", X, X, dtype=np.float64)
    Cc = X[:4].astype(np.float64)
    _kernels.kpp_candidates_kernel(X, xsq, np.ascontiguousarray(Cc, dtype=np.float32),
                                   (Cc * Cc).sum(1), w, np.full(n, np.inf), np.empty((4, n)),
                                   _config.CPU_BLOCK_ROWS, 2)
    _kernels.row_sqnorms_kernel(X, np.empty(n), 2)
    light = [c[0] for c in spy]
    spy.clear()
    compute_moments(X, w, X[:3], 1.0, 0, 0, None, False)
    assert light == ([2, 2, 2] if threaded else [1, 1, 1])
    assert spy[0][0] == 2                               # the moments pass of that shape splits


def test_run_groups_covers_every_range_once_and_grad_ranges_follow_the_shape():
    seen = []
    lock = threading.Lock()

    def fn(tag, t0, t1):
        with lock:
            seen.extend(range(t0, t1))
    for nch, nthreads in ((3, 2), (1, 4), (16, 2), (5, 5), (7, 1)):
        seen.clear()
        _pool.run_groups(fn, ("x",), nch, nthreads)
        assert sorted(seen) == list(range(nch)), (nch, nthreads)
    from fastanneal import _grad_kernels as G
    assert G.grad_ranges(10_000, 256, 20, 64) == G.GRAD_RANGES           # shape only
    assert G.grad_ranges(300, 256, 20, 64) == 2                          # no more than blocks
    big = G.grad_ranges(10 ** 6, 256, 10_000, 1024)                      # the memory cap
    assert big == max(1, G.GRAD_ACC_BYTES // (8 * 10_000 * 1024))


def test_fits_and_public_passes_run_with_blas_pinned_to_one_thread(monkeypatch):
    """The kernels bring their own threads; NumPy products between the passes woke
    OpenBLAS's threads, which spin ~0.1 s after each product and took a core from the next
    pass (a 200,000 x 384 pass at K = 64: 210 ms instead of 156 after one GEMV). A fit,
    suggest_k and the public passes now keep BLAS at one thread throughout (and restore the
    caller's setting)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from fastanneal import _validation

    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    seen = []
    real_mean = _validation.rows_mean
    monkeypatch.setattr(_validation, "rows_mean",
                        lambda *a, **k: seen.append(blas_threads()) or real_mean(*a, **k))
    X = np.random.default_rng(0).normal(size=(600, 4)) + 3.0
    with threadpool_limits(2, user_api="blas"):
        fa.moments(X, X[:3], 1.0)                       # (its far-from-origin test: a mean)
        fa.AnnealedKMeans(3, random_state=0).fit(X)
        fa.suggest_k(X, 4, random_state=0)
        assert set(blas_threads()) == {2}               # restored
    assert seen and all(t == [1] * len(t) for t in seen), seen

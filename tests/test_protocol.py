"""Conformance of every moment source with :class:`fastanneal._protocol.MomentSource`.

The same checks run on each source: in memory (float32 and float64 rows), Dask
(:class:`~fastanneal.dask.DaskSource` on a LocalCluster of 2 processes x 1 thread, ragged row
chunks with an empty one), the out-of-core :class:`~fastanneal.dask.DaskBatchStream` and
:class:`~fastanneal.cuda.CudaSource` on the numba-cuda simulator (set up by conftest.py;
skipped when ``fastanneal.cuda.is_available()`` is False).

Expected values are independent float64 NumPy: ``tests/reference.py`` for the moments,
``numpy.average`` / explicit products for the mean and covariance, ``numpy.linalg.eigvalsh``
for the cluster eigenvalues, and :func:`fastanneal.value_and_grad` on the rows for
:func:`fastanneal.gradient.value_and_grad_from_source`. Tolerances are relative to each
quantity's natural scale (``assert_allclose`` with ``atol = rtol * scale``): 1e-10 for
float64 rows, 1e-5 for float32 rows (distances are float32 GEMM results). Data: fixed seeds.

Then: the gradient solver on the Dask and CUDA backends reaches the in-memory result, and a
user-defined source that lacks methods is rejected with a TypeError naming them.
"""
import math
import sys
import warnings

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

import fastanneal as fa
import reference as ref
from fastanneal import _config
from fastanneal import _grad_kernels as G_
from fastanneal._protocol import MomentSource, check_source
from fastanneal._sources import InMemorySource
from fastanneal.gradient import value_and_grad_from_source

from conftest import count_library_products, require_cuda, require_library_products

#: "cuda-streamed": rows kept in host memory and streamed through the GPU in chunks of 20
#: (three per pass), the pass's products by the library path (NumPy standing in for cuBLAS
#: under the simulator)
KINDS = ["memory-f64", "memory-f32", "dask", "dask-stream", "cuda", "cuda-streamed"]
RESP_NAMES = ["softmax", "entmax15", "hard"]


def blobs(n, k, d, seed, sep=2.5):
    g = np.random.default_rng(seed)
    centers = g.normal(0.0, sep, (k, d))
    y = g.integers(0, k, n)
    return centers[y] + g.normal(0.0, 1.0, (n, d)), y


class Data:
    """The rows of one source kind (the simulator is slow: 48 rows for CUDA)."""

    def __init__(self, kind):
        small = kind.startswith("cuda")
        n, self.K, D = (48, 3, 4) if small else (1200, 5, 8)
        X, y = blobs(n, self.K, D, seed=11)
        self.w = np.random.default_rng(12).uniform(0.5, 2.0, n)
        self.y = y
        self.dtype = np.float32 if kind.endswith("f32") else np.float64
        self.X = X.astype(self.dtype)
        X64 = self.X.astype(np.float64)
        self.C = np.stack([np.average(X64[y == k], axis=0, weights=self.w[y == k])
                           for k in range(self.K)])
        # centers off the cluster means (non-zero gradients, mixed responsibilities)
        self.C0 = self.C + np.random.default_rng(3).normal(0.0, 0.7, self.C.shape)
        self.tol = 1e-5 if self.dtype == np.float32 else 1e-10


def ragged_chunks(n):
    a, b = n // 4, n // 3
    return (a, 0, b, n - a - b)


def make_source(kind, X, w, request):
    if kind.startswith("memory"):
        return InMemorySource(np.ascontiguousarray(X), np.asarray(w, dtype=np.float64), 0)
    if kind.startswith("cuda"):
        from fastanneal import cuda
        require_cuda()
        request.getfixturevalue("cuda_tuning")
        if kind == "cuda-streamed":
            require_library_products()
            request.getfixturevalue("monkeypatch").setattr(_config, "CUDA_CHUNK_ROWS", 20,
                                                           raising=False)
            src = cuda.CudaSource(np.ascontiguousarray(X), np.asarray(w, dtype=np.float64), 0,
                                  products="cublas", resident=False)
            assert not src.resident and src.products.startswith("cublas")
            return src
        return cuda.CudaSource(np.ascontiguousarray(X), np.asarray(w, dtype=np.float64), 0)
    da = pytest.importorskip("dask.array")
    client = request.getfixturevalue("client")
    chunks = ragged_chunks(X.shape[0])
    Xd = da.from_array(X, chunks=(chunks, -1))
    wd = da.from_array(np.asarray(w, dtype=np.float64), chunks=(chunks,))
    from fastanneal.dask import DaskSource, open_batch_stream, resolve_client
    if kind == "dask":
        return DaskSource(Xd, wd, 0, resolve_client(client))
    return open_batch_stream(Xd, wd, None, 0, client)


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("dask.array")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, worker_dashboard_address=None,
                                       scheduler_kwargs={"dashboard_address": ":0"})
    c = distributed.Client(cluster, set_as_default=False)
    try:
        yield c
    finally:
        c.close()
        cluster.close()


@pytest.fixture
def cuda_tuning(monkeypatch):
    """Small launches for the simulator (every CUDA thread is a Python thread): 8 threads
    per block, 64 rows per block; a short GIL switch interval."""
    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(_config, "CUDA_ROWS_PER_BLOCK", 64)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def data(kind):
    return Data(kind)


@pytest.fixture
def src(kind, data, request):
    s = make_source(kind, data.X, data.w, request)
    try:
        yield s
    finally:
        s.close()


def close(got, want, tol, scale=None, what=""):
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    if scale is None:
        scale = float(np.max(np.abs(want))) if want.size else 1.0
    assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


# ============================================================================ protocol
def test_is_a_moment_source(src, data, kind):
    assert isinstance(src, MomentSource)
    assert check_source(src) is src
    assert src.n_rows == data.X.shape[0] and src.n_features == data.X.shape[1]
    assert np.dtype(src.dtype) == data.dtype
    assert src.metric == 0
    assert src.total_weight == pytest.approx(data.w.sum(), rel=1e-12)


@pytest.mark.parametrize("resp, T, hard_sums, prior", [
    (0, 8.0, False, False), (0, 2.0, True, False), (0, 4.0, False, True),
    (1, 4.0, False, False), (2, 1.0, True, False)],
    ids=["softmax-hot", "softmax-cold-hardsums", "softmax-prior", "entmax15", "hard"])
def test_moments_match_reference(src, data, resp, T, hard_sums, prior):
    X64 = data.X.astype(np.float64)
    K = data.K
    logp = np.log(np.arange(1.0, K + 1) / (K * (K + 1) / 2)) if prior else None
    m = src.moments(data.C0, T, resp, logp, hard_sums=hard_sums)
    r = ref.moments(X64, data.C0, T, data.w, "euclidean", RESP_NAMES[resp], logp)
    tol = data.tol
    W = data.w.sum()
    d_scale = abs(r["soft_distortion"]) + abs(r["hard_distortion"]) + T * W * math.log(K)
    close(m.N, r["N"], tol, W, "N")
    close(m.S, r["S"], tol, None, "S")
    close(m.soft_distortion, r["soft_distortion"], tol, d_scale, "soft_distortion")
    close(m.hard_distortion, r["hard_distortion"], tol, d_scale, "hard_distortion")
    close(m.free_energy, r["free_energy"], tol, d_scale, "free_energy")
    close(m.entropy, r["entropy"], tol, W * math.log(K), "entropy")
    close(m.hard_counts, r["hard_counts"], tol, W, "hard_counts")
    close(m.margin_sum, r["margin_sum"], tol, W, "margin_sum")
    close(m.min_margin, r["min_margin"], tol, None, "min_margin")
    close(m.weight, W, 1e-12, None, "weight")
    assert m.rows == data.X.shape[0]
    assert m.responsibilities == RESP_NAMES[resp]
    if hard_sums:
        close(m.hard_sums, r["hard_sums"], tol, None, "hard_sums")
    else:
        assert m.hard_sums is None


def test_mean_and_covariance(src, data):
    X64 = data.X.astype(np.float64)
    w = data.w
    mean = np.average(X64, axis=0, weights=w)
    got = src.mean()
    assert got.shape == (X64.shape[1],) and got.dtype == np.float64
    close(got, mean, 1e-10, None, "mean")
    Z = X64 - mean
    cov = (Z * w[:, None]).T @ Z / w.sum()
    got = src.covariance(mean)
    assert got.shape == cov.shape
    close(got, cov, 1e-10, None, "covariance")
    # about another point: the argument is used, not recomputed
    other = mean + 1.0
    Z = X64 - other
    close(src.covariance(other), (Z * w[:, None]).T @ Z / w.sum(), 1e-10, None, "cov(other)")


def _scatter(X64, w, labels, C):
    """Per cluster: the weighted scatter about the center, divided by the cluster weight."""
    out = []
    for k in range(C.shape[0]):
        sel = labels == k
        Z = X64[sel] - C[k]
        out.append((Z * w[sel, None]).T @ Z / w[sel].sum())
    return out


def test_cluster_top_eigenvalues(src, data, kind):
    X64 = data.X.astype(np.float64)
    C = data.C
    labels = np.argmin(ref.sqeuclidean(X64, C), axis=1)
    got_labels = src.labels(C)
    if kind == "dask-stream":
        assert got_labels is None            # out of core: labels are streamed instead
    else:
        assert_array_equal(got_labels, labels)
    M = _scatter(X64, data.w, labels, C)
    want = np.array([np.linalg.eigvalsh(Mk)[-1] for Mk in M])
    lam = src.cluster_top_eigenvalues(C, 30, np.random.default_rng(4))
    assert lam.shape == (data.K,)
    assert_allclose(lam, want, rtol=1e-6)
    lam2, V = src.cluster_top_eigenvalues(C, 30, np.random.default_rng(4), return_vectors=True)
    assert_allclose(lam2, want, rtol=1e-6)
    assert_allclose(np.linalg.norm(V, axis=1), 1.0, rtol=1e-9)
    for k in range(data.K):
        assert np.linalg.norm(M[k] @ V[k] - want[k] * V[k]) <= 1e-5 * want[k]
    # the cells of C, the covariances about given points (the cells' means: re-allocation)
    means = np.stack([np.average(X64[labels == k], axis=0, weights=data.w[labels == k])
                      for k in range(data.K)]) + 0.01
    Mm = [(X64[labels == k] - means[k]).T @ ((X64[labels == k] - means[k])
                                             * data.w[labels == k, None])
          / data.w[labels == k].sum() for k in range(data.K)]
    want_m = np.array([np.linalg.eigvalsh(Mk)[-1] for Mk in Mm])
    lam_m, Vm = src.cluster_top_eigenvalues(C, 30, np.random.default_rng(4),
                                            return_vectors=True, means=means)
    assert_allclose(lam_m, want_m, rtol=1e-6)
    for k in range(data.K):
        assert np.linalg.norm(Mm[k] @ Vm[k] - want_m[k] * Vm[k]) <= 1e-5 * want_m[k]
    with pytest.raises(ValueError, match="means"):
        src.cluster_top_eigenvalues(C, 30, np.random.default_rng(4), means=means[:-1])
    # one cluster (all rows) about the mean: the top eigenvalue of the covariance
    mean = np.average(X64, axis=0, weights=data.w)
    Z = X64 - mean
    cov = (Z * data.w[:, None]).T @ Z / data.w.sum()
    lam1 = src.cluster_top_eigenvalues(mean[None, :], 30, np.random.default_rng(5))
    assert_allclose(lam1, [np.linalg.eigvalsh(cov)[-1]], rtol=1e-6)


def test_sample_returns_rows_of_X(src, data):
    X, w = data.X, data.w
    index = {row.tobytes(): i for i, row in enumerate(X)}
    assert len(index) == X.shape[0]                      # the rows are distinct
    n_rows = X.shape[0]
    for n, seed in ((20 if n_rows < 100 else 50, 6), ((4 * n_rows) // 5, 7)):
        rows, ws = src.sample(n, np.random.default_rng(seed))
        assert rows.shape == (n, X.shape[1]), f"sample({n}) gave {rows.shape[0]} rows"
        assert rows.dtype == X.dtype and ws.shape == (n,)
        idx = np.array([index[np.ascontiguousarray(r).tobytes()] for r in rows])
        assert len(set(idx.tolist())) == n                # without replacement
        assert np.all(np.diff(idx) > 0)                   # in row order
        assert_array_equal(ws, w[idx])
    a, _ = src.sample(20, np.random.default_rng(1))
    b, _ = src.sample(20, np.random.default_rng(2))
    assert not np.array_equal(a, b)                       # the generator decides
    # n >= n_rows: every row, in order
    allr, wa = src.sample(n_rows + 5, np.random.default_rng(8))
    assert_array_equal(allr, X)
    assert_array_equal(wa, w)


def test_n_distinct_rows_with_duplicates(kind, data, request):
    n_unique = 20 if kind.startswith("cuda") else 150
    base = data.X[:n_unique]
    g = np.random.default_rng(9)
    idx = np.concatenate([np.arange(n_unique), g.choice(n_unique, 2 * n_unique)])
    g.shuffle(idx)
    extra = data.X[n_unique:n_unique + 4]                 # distinct rows of weight 0
    X = np.ascontiguousarray(np.concatenate([base[idx], extra]))
    w = np.concatenate([g.uniform(0.5, 2.0, len(idx)), np.zeros(4)])
    s = make_source(kind, X, w, request)
    try:
        assert s.n_distinct_rows(np.random.default_rng(10), 10 ** 9) == n_unique
    finally:
        s.close()


def test_fingerprint(kind, data, request):
    X, w = data.X[:60], data.w[:60]
    X2 = X.copy()
    X2[7, 2] += 0.5
    w2 = w.copy()
    w2[3] *= 2.0
    keys = []
    for Xi, wi in ((X, w), (X.copy(), w.copy()), (X2, w), (X, w2)):
        s = make_source(kind, Xi, wi, request)
        try:
            keys.append(s.fingerprint())
        finally:
            s.close()
    assert all(isinstance(k, str) and k for k in keys)
    assert keys[0] == keys[1]                 # equal data: equal keys
    assert keys[2] != keys[0]                 # one value differs
    assert keys[3] != keys[0]                 # one weight differs


@pytest.mark.parametrize("resp, phi, kw", [
    (0, "identity", {}), (1, "identity", {}), (0, "hinge", {"margin": 60.0}),
    (0, "log", {"eps": 1e-3})], ids=["softmax", "entmax15", "hinge", "log"])
def test_value_and_grad_from_source(src, data, resp, phi, kw):
    T, lam = 8.0, 0.3
    want = fa.value_and_grad(data.X, data.C0, T, lam=lam, weights=data.w, phi=phi,
                             responsibilities=RESP_NAMES[resp], **kw)
    pc = {"identity": G_.PHI_IDENTITY, "log": G_.PHI_LOG, "hinge": G_.PHI_HINGE}[phi]
    got = value_and_grad_from_source(src, data.C0, T, resp, lam, pc, kw.get("margin", 0.0),
                                     kw.get("eps", 0.0))
    tol = 1e-8 if data.dtype == np.float64 else 1e-5
    assert got.grad_X is None
    assert abs(want.separation_grad_norm) > 1e-3      # the check is not vacuous
    scale = abs(want.compactness) + lam * abs(want.separation)
    close(got.value, want.value, tol, scale, "value")
    close(got.grad_centers, want.grad_centers, tol, None, "grad_centers")
    close(got.compactness, want.compactness, tol, None, "compactness")
    close(got.separation, want.separation, tol, None, "separation")
    close(got.separation_grad_norm, want.separation_grad_norm, tol, None, "sep grad norm")
    close(got.entropy, want.entropy, tol, math.log(data.K), "entropy")
    assert_array_equal(got.empty, want.empty)


def test_gradient_forward_keeps_what_the_moments_drop(src, data):
    """A center that every row weighs between e^-600 and the drop threshold of its best
    (2^-53 for float64 rows, 2^-24 for float32): the moments drop all its entries (N = 0),
    the gradient's forward pass keeps them, as the backward pass does (a truncated forward
    pass divided by N = 0: ZeroDivisionError in the solver, and gradients off by the
    dropped mass)."""
    T, lam = 8.0, 0.3
    drop = 53 * math.log(2) if data.dtype == np.float64 else 24 * math.log(2)
    X64 = data.X.astype(np.float64)
    d0 = ((X64[:, None, :] - data.C0[None]) ** 2).sum(-1).min(axis=1)
    u = np.ones(X64.shape[1]) / np.sqrt(X64.shape[1])
    for R in np.geomspace(2.0, 200.0, 60):
        far = X64.mean(axis=0) + R * u
        gap = (((X64 - far) ** 2).sum(-1) - d0) / T
        if gap.min() > drop + 2.0:
            break
    assert drop < gap.min() and gap.max() < 600.0      # the case the test is about
    C = np.vstack([data.C0, far])
    assert src.moments(C, T, 0, None, hard_sums=False).N[-1] == 0.0
    f = src.grad_forward(C, T, 0)
    assert 0.0 < f.N[-1] < 1e-6 * f.N.sum()
    want = fa.value_and_grad(data.X, C, T, lam=lam, weights=data.w)
    got = value_and_grad_from_source(src, C, T, 0, lam, G_.PHI_IDENTITY)
    tol = 1e-8 if data.dtype == np.float64 else 1e-5
    assert not want.empty.any() and not got.empty.any()
    close(got.value, want.value, tol, abs(want.compactness) + lam * abs(want.separation),
          "value")
    close(got.grad_centers, want.grad_centers, tol, None, "grad_centers")
    close(got.separation_grad_norm, want.separation_grad_norm, tol, None, "sep grad norm")


# ============================================================================ gradient fits
def test_gradient_solver_on_dask_matches_in_memory(client):
    da = pytest.importorskip("dask.array")
    d = Data("dask")
    kw = dict(solver="gradient", random_state=0, n_steps=6, gradient_steps=4)
    mem = fa.AnnealedKMeans(d.K, **kw).fit(d.X)
    dsk = fa.AnnealedKMeans(d.K, backend="dask", scheduler=client, **kw).fit(
        da.from_array(d.X, chunks=(ragged_chunks(d.X.shape[0]), -1)))
    assert_allclose(dsk.cluster_centers_, mem.cluster_centers_, rtol=1e-8,
                    atol=1e-8 * np.abs(mem.cluster_centers_).max())
    assert_array_equal(dsk.labels_, mem.labels_)
    assert dsk.inertia_ == pytest.approx(mem.inertia_, rel=1e-8)
    assert len(dsk.trace_) == len(mem.trace_)
    g_mem = np.asarray(mem.trace_["grad_norm"], dtype=float)
    assert np.isfinite(g_mem[:-1]).all() and (g_mem[:-1] > 0).all()    # the solver ran
    assert_allclose(dsk.trace_["grad_norm"], g_mem, rtol=1e-6)


def test_gradient_solver_on_cuda_matches_in_memory(request):
    require_cuda()
    request.getfixturevalue("cuda_tuning")
    d = Data("cuda")
    kw = dict(solver="gradient", random_state=0, n_steps=3, gradient_steps=2)
    mem = fa.AnnealedKMeans(d.K, **kw).fit(d.X)
    gpu = fa.AnnealedKMeans(d.K, backend="cuda", **kw).fit(d.X)
    assert_allclose(gpu.cluster_centers_, mem.cluster_centers_, rtol=1e-8,
                    atol=1e-8 * np.abs(mem.cluster_centers_).max())
    assert_array_equal(gpu.labels_, mem.labels_)
    assert gpu.inertia_ == pytest.approx(mem.inertia_, rel=1e-8)
    g_mem = np.asarray(mem.trace_["grad_norm"], dtype=float)
    assert np.isfinite(g_mem[:-1]).all() and (g_mem[:-1] > 0).all()
    assert_allclose(gpu.trace_["grad_norm"], g_mem, rtol=1e-6)


def test_default_fit_streamed_through_the_gpu_matches_in_memory(request, monkeypatch):
    """A default fit with ``backend="cuda"`` whose rows do not "fit" the device
    (``CUDA_RESIDENT_FRACTION = 0``: streamed from host memory in chunks of 20 rows) and
    whose products go through the library path gives the in-memory fit's partition."""
    require_library_products()
    request.getfixturevalue("cuda_tuning")
    monkeypatch.setattr(_config, "CUDA_RESIDENT_FRACTION", 0.0, raising=False)
    monkeypatch.setattr(_config, "CUDA_CHUNK_ROWS", 20, raising=False)
    monkeypatch.setattr(_config, "CUDA_PRODUCTS", "cublas")
    d = Data("cuda")
    mem = fa.AnnealedKMeans(d.K, random_state=0).fit(d.X, sample_weight=d.w)
    calls = count_library_products(monkeypatch)
    from fastanneal.cuda import CudaSource
    made = []
    real_init = CudaSource.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)
    monkeypatch.setattr(CudaSource, "__init__", spy)
    gpu = fa.AnnealedKMeans(d.K, backend="cuda", random_state=0).fit(d.X, sample_weight=d.w)
    assert made and all(not s.resident and s.products.startswith("cublas") for s in made)
    assert calls["distances"] > 0                       # the passes used the library products
    assert_array_equal(gpu.labels_, mem.labels_)
    assert_allclose(gpu.cluster_centers_, mem.cluster_centers_, rtol=1e-8,
                    atol=1e-8 * np.abs(mem.cluster_centers_).max())
    assert gpu.inertia_ == pytest.approx(mem.inertia_, rel=1e-8)
    assert len(gpu.trace_) == len(mem.trace_)


# ============================================================================ user sources
ALL_MEMBERS = ["n_rows", "n_features", "dtype", "total_weight", "metric", "moments",
               "grad_moments", "mean", "covariance", "cluster_top_eigenvalues", "sample",
               "n_distinct_rows", "labels", "fingerprint", "close"]


class PartialSource:
    """Has the attributes and two methods only."""

    def __init__(self, X):
        self.n_rows, self.n_features = X.shape
        self.dtype = X.dtype
        self.total_weight = float(X.shape[0])
        self.metric = 0

    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        raise AssertionError("must not be called")

    def mean(self):
        raise AssertionError("must not be called")


MISSING = [n for n in ALL_MEMBERS if n not in ("n_rows", "n_features", "dtype",
                                               "total_weight", "metric", "moments", "mean")]


class DelegatingSource:
    """A complete user-defined source: every member delegates to an InMemorySource."""

    def __init__(self, X, w):
        self._s = InMemorySource(X, w, 0)
        self.n_rows, self.n_features = X.shape
        self.dtype = X.dtype
        self.total_weight = self._s.total_weight
        self.metric = 0
        self.calls = set()

    def _call(self, name, *a, **k):
        self.calls.add(name)
        return getattr(self._s, name)(*a, **k)

    def moments(self, *a, **k):
        return self._call("moments", *a, **k)

    def grad_moments(self, *a, **k):
        return self._call("grad_moments", *a, **k)

    def mean(self):
        return self._call("mean")

    def covariance(self, mean):
        return self._call("covariance", mean)

    def cluster_top_eigenvalues(self, *a, **k):
        return self._call("cluster_top_eigenvalues", *a, **k)

    def sample(self, n, rng):
        return self._call("sample", n, rng)

    def n_distinct_rows(self, rng, cap):
        return self._call("n_distinct_rows", rng, cap)

    def labels(self, centers):
        return self._call("labels", centers)

    def fingerprint(self):
        return self._call("fingerprint")

    def close(self):
        return self._call("close")


def test_incomplete_user_source_is_rejected():
    X, _ = blobs(200, 3, 4, seed=2)
    obj = PartialSource(X)
    assert not isinstance(obj, MomentSource)
    with pytest.raises(TypeError) as e:
        check_source(obj)
    msg = str(e.value)
    assert "PartialSource" in msg
    listed = msg.split("missing: ")[1].split(")")[0].split(", ")
    assert listed == MISSING
    with pytest.raises(TypeError, match="missing: " + ", ".join(MISSING)):
        fa.AnnealedKMeans(3, random_state=0).fit_source(obj)
    with pytest.raises(TypeError, match=r"missing: n_rows, n_features, dtype, total_weight, "
                                        r"metric, moments, grad_moments"):
        check_source(object())


def test_complete_user_source_fits_like_an_array():
    X, _ = blobs(600, 4, 6, seed=2)
    w = np.ones(X.shape[0])
    user = DelegatingSource(X, w)
    assert isinstance(user, MomentSource) and check_source(user) is user
    a = fa.AnnealedKMeans(4, random_state=0, n_steps=6).fit_source(user, in_memory=True)
    b = fa.AnnealedKMeans(4, random_state=0, n_steps=6).fit(X)
    assert_array_equal(a.cluster_centers_, b.cluster_centers_)
    assert_array_equal(a.labels_, b.labels_)
    assert {"moments", "mean", "sample", "labels"} <= user.calls
    g = DelegatingSource(X, w)
    c = fa.AnnealedKMeans(4, random_state=0, n_steps=4, solver="gradient",
                          gradient_steps=3).fit_source(g, in_memory=True)
    d = fa.AnnealedKMeans(4, random_state=0, n_steps=4, solver="gradient",
                          gradient_steps=3).fit(X)
    assert "grad_moments" in g.calls
    assert_array_equal(c.cluster_centers_, d.cluster_centers_)


def test_user_source_without_grad_forward_survives_a_dropped_center():
    """A source written before ``grad_forward``: the forward sums come from its moments,
    which drop every entry of a far center (N = 0); the backward pass treats that cluster
    as empty instead of dividing by N = 0 (ZeroDivisionError before)."""
    rng = np.random.default_rng(13)
    X = rng.normal(size=(200, 2))
    init = np.array([[0.0, 0.0], [30.0, 0.0]])
    user = DelegatingSource(X, np.ones(len(X)))
    assert not hasattr(user, "grad_forward")
    assert user.moments(init, 2.0, 0, None).N[1] == 0.0
    got = value_and_grad_from_source(user, init, 2.0, 0, 0.1, G_.PHI_IDENTITY)
    assert np.isfinite(got.grad_centers).all() and got.empty[1] and not got.empty[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        km = fa.AnnealedKMeans(2, init=init, solver="gradient", temperature_start=2.0,
                               random_state=0).fit_source(DelegatingSource(X, np.ones(len(X))),
                                                          in_memory=True)
    assert np.isfinite(km.cluster_centers_).all() and len(np.unique(km.labels_)) == 2


class FirstProtocolSource(DelegatingSource):
    """A user source written against the first protocol: ``cluster_top_eigenvalues``
    without the ``means`` keyword."""

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False):
        return self._call("cluster_top_eigenvalues", centers, n_iter, rng, return_vectors)


def test_reallocation_runs_on_a_source_without_means():
    """The re-allocation asks for covariances about the cells' means; a source that does
    not take ``means=`` gets the first protocol's call (about the centers) instead of a
    TypeError, and the fit still moves codevectors."""
    X, _ = blobs(1500, 5, 6, seed=1)
    user = FirstProtocolSource(X, np.ones(X.shape[0]))
    km = fa.AnnealedKMeans(8, random_state=0, n_steps=8).fit_source(user, in_memory=True)
    assert "cluster_top_eigenvalues" in user.calls
    assert km.cluster_centers_.shape == (8, X.shape[1]) and np.isfinite(km.inertia_)


def test_keyword_support_of_a_source_is_looked_up_once(monkeypatch):
    """``_engine._takes`` (asked at every step of a phase-transition schedule whether a
    source's ``cluster_top_eigenvalues`` takes ``tol=`` / ``start=`` / ``means=``) reads the
    signature once per function and keyword, for every bound method of it."""
    import inspect
    from fastanneal import _engine

    class Old:
        def cluster_top_eigenvalues(self, centers, n_iter, rng):
            return None

    class New:
        def cluster_top_eigenvalues(self, centers, n_iter, rng, **kw):
            return None
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda f: (calls.append(f), real(f))[1])
    _engine._takes_cached.cache_clear()
    for _ in range(5):
        assert _engine._takes(Old().cluster_top_eigenvalues, "tol") is False
        assert _engine._takes(New().cluster_top_eigenvalues, "tol") is True
    assert len(calls) == 2


def test_fit_source_refuses_a_metric_other_than_the_estimators():
    """A cosine estimator on a Euclidean source projected the centers to the sphere while
    the source measured Euclidean distances: centers of norm 0.45-0.78, labels_ and
    predict disagreeing on 14 % of the rows."""
    from fastanneal._sources import InMemorySource
    X = np.random.default_rng(0).normal(size=(300, 4))
    src = InMemorySource(np.ascontiguousarray(X), np.ones(300), 0)
    with pytest.raises(ValueError, match="source's metric .euclidean. is not the estimator's"):
        fa.AnnealedKMeans(3, metric="cosine", random_state=0).fit_source(src)
    src.metric = "cosine"
    with pytest.raises(ValueError, match="must be 0 .Euclidean. or 1"):
        fa.AnnealedKMeans(3, random_state=0).fit_source(src)


def test_a_user_source_that_breaks_the_protocol_is_named(tmp_path):
    """A user's source is checked as its results come back (CheckedSource): a wrong shape
    was a NumPy broadcast error deep in the engine, a NaN objective read 'all rows are
    identical', a covariance of the wrong shape silently gave another T_c."""
    from fastanneal._protocol import SourceError
    from fastanneal._sources import InMemorySource
    X = np.random.default_rng(0).normal(size=(300, 4))

    class User:                       # a user's source: the in-memory one, re-exported
        def __init__(self, **bad):
            self._s = InMemorySource(np.ascontiguousarray(X), np.ones(300), 0)
            self._bad = bad

        def __getattr__(self, name):
            if name in self._bad:
                return self._bad[name]
            return getattr(self._s, name)
    fa.AnnealedKMeans(3, random_state=0).fit_source(User())            # conforms: fits
    cases = [
        (dict(covariance=lambda mean: np.eye(2)), "covariance returned the covariance of "
                                                   "shape .2, 2.; expected .4, 4."),
        (dict(mean=lambda: np.full(4, np.nan)), "mean returned the mean with non-finite"),
        (dict(total_weight=float("nan")), "total_weight is nan"),
        (dict(n_features=3), "mean returned the mean of shape .4,.; expected .3,."),
    ]
    good = User()
    from dataclasses import replace

    def wrong_S(C, T, *a, **k):
        m = good.moments(C, T, *a, **k)
        return replace(m, S=m.S[:, :2])
    nan_eigs = lambda C, *a, **k: (                                        # noqa: E731
        (np.full(len(C), np.nan), np.zeros(np.shape(C))) if k.get("return_vectors")
        else np.full(len(C), np.nan))
    cases += [(dict(moments=wrong_S),
               r"moments returned S of shape .\d+, 2.; expected .\d+, 4."),
              (dict(cluster_top_eigenvalues=nan_eigs),
               "cluster_top_eigenvalues returned eigenvalues with non-finite")]
    for bad, msg in cases:
        with pytest.raises(SourceError, match="User." + msg):
            fa.AnnealedKMeans(3, random_state=0).fit_source(User(**bad))
    with pytest.raises(SourceError, match="User.fingerprint returned int; expected a str"):
        fa.AnnealedKMeans(3, random_state=0, checkpoint=tmp_path / "ck").fit_source(
            User(fingerprint=lambda: 5))


def test_the_warning_and_error_classes_the_docs_name_are_public():
    """The docs tell users to filter CheckpointWarning and to catch SourceError; both were
    importable only from private modules."""
    import fastanneal
    from fastanneal._checkpoint import CheckpointWarning
    from fastanneal._protocol import SourceError
    assert fastanneal.CheckpointWarning is CheckpointWarning
    assert fastanneal.SourceError is SourceError
    assert {"CheckpointWarning", "SourceError"} <= set(fastanneal.__all__)

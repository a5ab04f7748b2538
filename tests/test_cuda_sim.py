"""CUDA moments kernels (fastanneal.cuda) on the numba-cuda simulator.

conftest.py sets NUMBA_ENABLE_CUDASIM=1 unless FASTANNEAL_REAL_CUDA=1 (then the same tests
run on a real GPU). Every result is compared with the CPU kernels (``fastanneal.moments``)
AND with an independent float64 NumPy reference written below (explicit differences, no
GEMM form, no truncation, entmax-1.5 threshold by sorting). Inputs are random draws seeded
from each test's name and parametrization (the ``rng`` fixture below; it prints its seed), the
same on every run; ``FASTANNEAL_SEED_SALT=<text>`` draws another fixed set.

Block sizes are patched tiny (8 threads per block, 5 rows per block, chunks of 13 rows) so
that every kernel runs several blocks, ragged last blocks, several chunks, several center
tiles (K = 19 > 16 centers per GEMM tile) and several feature tiles (D = 18), in seconds.

Tolerances (relative to each quantity's natural scale, see ``assert_moments_close``):
float64 data 1e-9; float32 data 1e-4 (the distances are float32 GEMM results, so
responsibilities move by about ``eps32 * ||x||^2 / T``).
"""
import math
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

import fastanneal
from fastanneal import _config
from fastanneal._sources import InMemorySource

from conftest import count_library_products, require_library_products

REPO = Path(__file__).resolve().parents[1]
RTOL = {np.float32: 1e-4, np.float64: 1e-9}
LOG_EPS = {np.float32: math.log(2.0 ** -24), np.float64: math.log(2.0 ** -53)}


@pytest.fixture(autouse=True)
def tiny_blocks(monkeypatch):
    """Tiny CUDA launch parameters, and a short GIL switch interval: the simulator runs
    every CUDA thread as a Python thread and polls them at each __syncthreads."""
    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(_config, "CUDA_ROWS_PER_BLOCK", 5)
    monkeypatch.setattr(_config, "CUDA_CHUNK_ROWS", 13, raising=False)
    # several dense-accumulation GEMMs per chunk on the library-product path
    monkeypatch.setattr(_config, "CUDA_BLAS_ACCUM_ROWS", 4, raising=False)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name with its parametrization (``zlib.crc32``;
    overrides conftest's fresh-entropy ``rng`` in this file), so that each test draws the
    same data on every run and a failure reproduces. ``FASTANNEAL_SEED_SALT=<text>`` is
    mixed into the name to draw another fixed set (to look for data-dependent failures)."""
    name = request.node.name
    salt = os.environ.get("FASTANNEAL_SEED_SALT", "")
    seed = zlib.crc32(f"{name}#{salt}".encode() if salt else name.encode())
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed = {seed} (crc32 of {name!r}, salt {salt!r})")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def gpu():
    from fastanneal import cuda as fc
    return fc


# ----------------------------------------------------------------------------- reference
def entmax15_sort(V):
    """Rows of ``V`` (already halved and shifted, max 0): ``[v - tau]_+^2`` with the exact
    threshold by sorting (docs/theory.md section 4.2)."""
    P = np.zeros_like(V)
    for i, v in enumerate(V):
        s = np.sort(v)[::-1]
        rho = np.arange(1, len(s) + 1)
        M = np.cumsum(s) / rho
        Ssq = rho * (np.cumsum(s * s) / rho - M * M)
        tau = M - np.sqrt(np.maximum(0.0, (1.0 - Ssq) / rho))
        tau_star = tau[np.nonzero(tau <= s)[0][-1]]
        P[i] = np.maximum(v - tau_star, 0.0) ** 2
    return P


def reference(X, C, T, w, metric="euclidean", resp="softmax", log_prior=None):
    """float64 moments of rows ``X`` (already cast to the kernel's dtype, unit rows for
    cosine) and centers ``C`` (same)."""
    X = np.asarray(X, np.float64)
    C = np.asarray(C, np.float64)
    w = np.asarray(w, np.float64)
    n, K = X.shape[0], C.shape[0]
    if metric == "cosine":
        d = 2.0 - 2.0 * (X @ C.T)
    else:
        diff = X[:, None, :] - C[None, :, :]
        d = (diff ** 2).sum(-1)
    ds = np.sort(d, axis=1)
    d1 = ds[:, 0]
    lab = np.argmin(d, axis=1)
    out = {}
    logp = np.zeros(K) if log_prior is None else np.asarray(log_prior, np.float64)
    if resp == "hard":
        R = np.zeros((n, K))
        R[np.arange(n), lab] = 1.0
        soft, ent, free = d1, np.zeros(n), d1
        nnz = n
    else:
        Z = -d / T + logp
        zmax = Z.max(axis=1, keepdims=True)
        if resp == "softmax":
            E = np.exp(Z - zmax)
            s = E.sum(axis=1)
            R = E / s[:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                ent = -np.where(R > 0, R * np.log(R), 0.0).sum(axis=1)
            soft = (R * d).sum(axis=1)
            free = -T * (zmax[:, 0] + np.log(s))
            nnz = None          # depends on the dtype's drop rule; checked separately
        else:
            P = entmax15_sort(0.5 * (Z - zmax))
            R = P / P.sum(axis=1, keepdims=True)
            soft = (R * d).sum(axis=1)
            ent = (4.0 / 3.0) * (1.0 - (R ** 1.5).sum(axis=1))
            free = soft - T * ent
            nnz = int((R > 0).sum())
    out["R"] = R
    out["N"] = w @ R
    out["S"] = (R * w[:, None]).T @ X
    out["soft_distortion"] = w @ soft
    out["entropy"] = w @ ent
    out["free_energy"] = w @ free
    out["hard_distortion"] = w @ d1
    out["hard_counts"] = np.bincount(lab, weights=w, minlength=K)
    out["hard_sums"] = np.stack([(w[lab == k, None] * X[lab == k]).sum(0) for k in range(K)])
    out["weight"] = w.sum()
    out["rows"] = n
    if K > 1:
        marg = ds[:, 1] - ds[:, 0]
        out["margin_sum"] = w @ np.exp(-marg / T) if T > 0 else 0.0
        # zero-weight rows are absent rows (weights equal repetition): not in the minimum
        out["min_margin"] = marg[w > 0].min() if (w > 0).any() else math.inf
    else:
        marg = np.full(n, math.inf)
        out["margin_sum"] = 0.0
        out["min_margin"] = math.inf
    out["margins"] = marg       # every row's d_(2) - d_(1), zero-weight rows included
    out["nnz"] = nnz
    out["Z"] = None if resp == "hard" else Z - zmax
    return out


def assert_moments_close(got, ref, rtol, T, K, label=""):
    """Every field of a Moments record against the reference dict (or another record),
    each within ``rtol`` times its natural scale."""
    def get(r, name):
        return r[name] if isinstance(r, dict) else getattr(r, name)
    W = get(ref, "weight")
    J = get(ref, "hard_distortion")
    dscale = J / W if W > 0 else 1.0
    checks = {
        "N": W, "S": np.abs(get(ref, "S")).max(), "hard_counts": W,
        "hard_sums": np.abs(get(ref, "hard_sums")).max(),
        "soft_distortion": J, "hard_distortion": J, "entropy": W,
        "free_energy": J + T * W * math.log(K), "weight": W, "margin_sum": W,
    }
    for name, scale in checks.items():
        np.testing.assert_allclose(get(got, name), get(ref, name), rtol=rtol,
                                   atol=rtol * scale, err_msg=f"{label}: {name}")
    assert got.rows == get(ref, "rows")
    mm_ref = get(ref, "min_margin")
    if math.isinf(mm_ref):
        assert math.isinf(got.min_margin)
    else:
        assert abs(got.min_margin - mm_ref) <= rtol * dscale, (label, got.min_margin, mm_ref)


def softmax_nnz(ref, dtype, slack):
    """Entries kept by the drop rule ``z - zmax >= log eps``, and how many are within
    ``slack`` of the threshold (their fate may differ under float32 rounding)."""
    Z = ref["Z"]
    le = LOG_EPS[dtype]
    return int((Z >= le).sum()), int((np.abs(Z - le) < slack).sum())


def data(rng, n, D, K, dtype, weights=True):
    X = rng.standard_normal((n, D)).astype(dtype)
    C = (X[rng.choice(n, K, replace=False)] + 0.3 * rng.standard_normal((K, D))).astype(dtype)
    w = rng.uniform(0.2, 3.0, n) if weights else np.ones(n)
    if weights:
        w[rng.integers(n)] = 0.0
    return X, C, w


def typical_scale(X, C):
    d = ((X.astype(np.float64)[:, None] - C.astype(np.float64)[None]) ** 2).sum(-1)
    return float(np.median(d)), float(np.median(np.diff(np.sort(d, 1)[:, :2], axis=1)))


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("temp", ["high", "low"])
@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_softmax_matches_cpu_and_reference(gpu, rng, monkeypatch, dtype, temp, path):
    # n = 23: two chunks (13 + 10 rows), ragged row blocks of 5, ragged GEMM tiles of 8
    # rows; K = 19 > 16 centers per tile and > 8 threads; D = 18 > 16 features per tile.
    monkeypatch.setattr(_config, "CUDA_SPARSE_FRACTION", -1.0 if path == "dense" else 2.0,
                        raising=False)
    X, C, w = data(rng, 23, 18, 19, dtype)
    med, gap = typical_scale(X, C)
    T = 3.0 * med if temp == "high" else 0.02 * med
    got = gpu.cuda_moments(X, C, T, weights=w)
    ref = reference(X, C, T, w)
    cpu = fastanneal.moments(X, C, T, weights=w)
    rtol = RTOL[dtype]
    assert_moments_close(got, ref, rtol, T, 19, "vs reference")
    assert_moments_close(got, cpu, rtol, T, 19, "vs cpu")
    kept, borderline = softmax_nnz(ref, dtype, slack=1e-3 if dtype == np.float32 else 1e-9)
    assert abs(got.nnz - kept) <= borderline
    assert abs(got.nnz - cpu.nnz) <= borderline
    if temp == "high":
        assert got.nnz == 23 * 19                     # dense: nothing dropped
    else:
        assert got.nnz < 23 * 19 / 2                  # really sparse at low T
    # certificate of docs/theory.md section 2 holds on the GPU record
    assert -1e-6 * abs(got.hard_distortion) <= got.hard_distortion - got.free_energy
    assert got.hard_distortion - got.free_energy <= T * got.weight * math.log(19) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_entmax_supports_one_and_all(gpu, rng, dtype):
    X, C, w = data(rng, 17, 5, 7, dtype)
    med, _ = typical_scale(X, C)
    rtol = RTOL[dtype]
    ref_lab = reference(X, C, 1.0, w, resp="hard")
    # T below half the smallest margin: every support has size 1 (docs/theory.md section 4.2).
    # Smallest over ALL rows: nnz counts the supports of zero-weight rows too (their
    # responsibilities are computed, only their weight is 0), while min_margin leaves them
    # out; with min_margin a zero-weight row of smaller margin could keep 2 centers.
    T_cold = 0.4 * ref_lab["margins"].min()
    # T far above the spread of every row: every support is all K centers
    T_hot = 1e3 * med
    results = {}
    for T, nnz in ((T_cold, 17), (T_hot, 17 * 7)):
        got = gpu.cuda_moments(X, C, T, weights=w, responsibilities="entmax15")
        ref = reference(X, C, T, w, resp="entmax15")
        cpu = fastanneal.moments(X, C, T, weights=w, responsibilities="entmax15")
        assert got.nnz == nnz == ref["nnz"] == cpu.nnz
        assert_moments_close(got, ref, rtol, T, 7, f"T={T} vs reference")
        assert_moments_close(got, cpu, rtol, T, 7, f"T={T} vs cpu")
        results[T] = got
    # support 1: exactly the hard partition (N holds w rounded to the dtype)
    np.testing.assert_allclose(results[T_cold].N, ref_lab["hard_counts"], rtol=1e-6, atol=0)
    np.testing.assert_allclose(results[T_cold].entropy, 0.0, atol=1e-12)


def test_entmax_intermediate_with_log_prior(gpu, rng):
    X, C, w = data(rng, 19, 6, 9, np.float64)
    med, gap = typical_scale(X, C)
    logp = np.log(rng.dirichlet(np.ones(9)))
    T = 0.3 * med
    got = gpu.cuda_moments(X, C, T, weights=w, responsibilities="entmax15", log_prior=logp)
    ref = reference(X, C, T, w, resp="entmax15", log_prior=logp)
    cpu = fastanneal.moments(X, C, T, weights=w, responsibilities="entmax15", log_prior=logp)
    assert 19 < got.nnz < 19 * 9                      # partial supports
    assert got.nnz == ref["nnz"] == cpu.nnz
    assert_moments_close(got, ref, 1e-9, T, 9, "vs reference")
    assert_moments_close(got, cpu, 1e-9, T, 9, "vs cpu")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_log_prior(gpu, rng, dtype):
    X, C, w = data(rng, 21, 7, 6, dtype)
    med, _ = typical_scale(X, C)
    logp = np.log(rng.dirichlet(np.ones(6)))
    logp[2] = -np.inf                                  # a center of zero mass
    T = 0.5 * med
    got = gpu.cuda_moments(X, C, T, weights=w, log_prior=logp)
    ref = reference(X, C, T, w, log_prior=logp)
    cpu = fastanneal.moments(X, C, T, weights=w, log_prior=logp)
    assert got.N[2] == 0.0 and np.all(got.S[2] == 0.0)
    assert_moments_close(got, ref, RTOL[dtype], T, 6, "vs reference")
    assert_moments_close(got, cpu, RTOL[dtype], T, 6, "vs cpu")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hard_and_margins(gpu, rng, dtype):
    X, C, w = data(rng, 22, 6, 5, dtype)
    med, gap = typical_scale(X, C)
    for T in (0.0, gap):
        got = gpu.cuda_moments(X, C, T, weights=w, responsibilities="hard")
        ref = reference(X, C, T, w, resp="hard")
        cpu = fastanneal.moments(X, C, T, weights=w, responsibilities="hard")
        assert got.nnz == 22 == cpu.nnz
        assert_moments_close(got, ref, RTOL[dtype], T, 5, f"T={T} vs reference")
        assert_moments_close(got, cpu, RTOL[dtype], T, 5, f"T={T} vs cpu")
        np.testing.assert_allclose(got.N, ref["hard_counts"], rtol=1e-6, atol=0)
        assert got.entropy == 0.0
    assert got.margin_sum > 0


def test_ties_go_to_the_first_center(gpu, rng):
    """Duplicated centers (in different threads: 1 and 2; in the same thread: 3 and 11 with
    8 threads) tie exactly: the label is the first index, as on the CPU, margins are 0."""
    X, C, w = data(rng, 15, 4, 12, np.float32)
    C[2] = C[1]
    C[11] = C[3]
    X[:4] = C[[1, 3, 1, 3]] + 0.01
    got = gpu.cuda_moments(X, C, 1.0, weights=w, responsibilities="hard")
    cpu = fastanneal.moments(X, C, 1.0, weights=w, responsibilities="hard")
    np.testing.assert_array_equal(got.hard_counts, cpu.hard_counts)
    assert got.hard_counts[2] == 0 and got.hard_counts[11] == 0
    assert got.hard_counts[1] > 0 and got.hard_counts[3] > 0
    assert got.min_margin == 0.0
    lab, _, marg = gpu.CudaSource(X, w, 0).assign(C)
    np.testing.assert_array_equal(lab[:4], [1, 3, 1, 3])
    assert np.all(marg[:4] == 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cosine(gpu, rng, dtype):
    X, C, w = data(rng, 20, 9, 6, dtype)
    Xu = (X / np.linalg.norm(X, axis=1, keepdims=True)).astype(dtype)
    Cu = (C / np.linalg.norm(C, axis=1, keepdims=True)).astype(dtype)
    for resp, T in (("softmax", 0.05), ("entmax15", 0.2)):
        got = gpu.cuda_moments(X, C, T, weights=w, metric="cosine", responsibilities=resp)
        ref = reference(Xu, Cu, T, w, metric="cosine", resp=resp)
        cpu = fastanneal.moments(X, C, T, weights=w, metric="cosine", responsibilities=resp)
        assert got.metric == "cosine"
        assert_moments_close(got, ref, RTOL[dtype], T, 6, f"{resp} vs reference")
        assert_moments_close(got, cpu, RTOL[dtype], T, 6, f"{resp} vs cpu")


def test_single_center_and_unit_weights(gpu, rng):
    X, C, w = data(rng, 12, 4, 1, np.float64, weights=False)
    got = gpu.cuda_moments(X, C, 0.7)
    ref = reference(X, C, 0.7, w)
    assert got.min_margin == math.inf and got.margin_sum == 0.0 and got.nnz == 12
    assert_moments_close(got, ref, 1e-9, 0.7, 1, "K=1")
    np.testing.assert_allclose(got.entropy, 0.0, atol=1e-12)


def test_launch_parameters_do_not_change_results(gpu, rng, monkeypatch):
    """Sparse path with tiny blocks == dense path with 16 threads, 48 rows per block (the
    float64 flush every 3 row tiles is left with a remainder: 25 rows = 2 tiles) and one
    chunk."""
    X, C, w = data(rng, 25, 6, 5, np.float64)
    T = 0.5 * typical_scale(X, C)[0]
    monkeypatch.setattr(_config, "CUDA_SPARSE_FRACTION", 2.0, raising=False)
    a = gpu.cuda_moments(X, C, T, weights=w)
    monkeypatch.setattr(_config, "CUDA_SPARSE_FRACTION", -1.0, raising=False)
    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 16)
    monkeypatch.setattr(_config, "CUDA_ROWS_PER_BLOCK", 48)
    monkeypatch.setattr(_config, "CUDA_CHUNK_ROWS", 10 ** 6, raising=False)
    b = gpu.cuda_moments(X, C, T, weights=w)
    assert_moments_close(a, b, 1e-12, T, 5, "launch parameters")
    assert a.nnz == b.nnz
    # the row kernels' own thread count (more threads than centers: idle lanes)
    monkeypatch.setattr(_config, "CUDA_ROW_THREADS", 32, raising=False)
    from fastanneal.cuda import source
    assert source._row_threads(8) == 32 and source._row_threads(16) == 32
    c = gpu.cuda_moments(X, C, T, weights=w)
    assert_moments_close(a, c, 1e-12, T, 5, "row threads")
    for x, y in zip(gpu.CudaSource(X, w, 0).assign(C), fastanneal.assign(X, C)):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


def test_source_interface(gpu, rng):
    n, D, K = 26, 5, 4
    X = rng.standard_normal((n, D)) * np.array([3.0, 1.0, 1.0, 0.5, 1.0])
    w = rng.uniform(0.5, 2.0, n)
    C = X[rng.choice(n, K, replace=False)] + 0.1
    src = gpu.CudaSource(X, w, 0)
    cpu = InMemorySource(X, w, 0)
    assert (src.n_rows, src.n_features, src.dtype, src.metric) == (n, D, np.float64, 0)
    assert src.total_weight == pytest.approx(w.sum(), rel=1e-15)
    # moments through the interface (hard_sums off by default)
    m = src.moments(C, 2.0, 1)
    assert m.hard_sums is None and m.responsibilities == "entmax15"
    ref = reference(X, C, 2.0, w, resp="entmax15")
    np.testing.assert_allclose(m.N, ref["N"], rtol=1e-9, atol=1e-9 * w.sum())
    np.testing.assert_allclose(m.S, ref["S"], rtol=1e-9, atol=1e-9 * np.abs(ref["S"]).max())
    # assign: labels, nearest distance and margin
    lab, dmin, marg = src.assign(C)
    d = ((X[:, None] - C[None]) ** 2).sum(-1)
    ds = np.sort(d, axis=1)
    np.testing.assert_array_equal(lab, d.argmin(1))
    np.testing.assert_allclose(dmin, ds[:, 0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(marg, ds[:, 1] - ds[:, 0], rtol=1e-9, atol=1e-9)
    assert lab.dtype == np.int64
    # mean
    np.testing.assert_allclose(src.mean(), w @ X / w.sum(), rtol=1e-12, atol=1e-14)
    # sample: real rows with their weights, without replacement
    rows, ws = src.sample(7, np.random.default_rng(5))
    idx = [int(np.flatnonzero((X == r).all(1))[0]) for r in rows]
    assert len(set(idx)) == 7
    np.testing.assert_array_equal(ws, w[idx])
    full, wf = src.sample(n + 3, rng)
    np.testing.assert_array_equal(full, X)
    # top eigenvalue of each hard cluster's covariance (1/W_k) and of the whole data
    for cent in (C, (w @ X / w.sum())[None]):
        seed = int(rng.integers(2 ** 31))
        got = src.cluster_top_eigenvalues(cent, 15, np.random.default_rng(seed))
        want_cpu = cpu.cluster_top_eigenvalues(cent, 15, np.random.default_rng(seed))
        np.testing.assert_allclose(got, want_cpu, rtol=1e-9)
        labs = np.zeros(n, int) if len(cent) == 1 else d.argmin(1)
        for k in range(len(cent)):
            sel = labs == k
            if sel.sum() < 2:
                continue
            diff = X[sel] - cent[k]
            cov = (w[sel, None] * diff).T @ diff / w[sel].sum()
            assert got[k] == pytest.approx(np.linalg.eigvalsh(cov)[-1], rel=2e-2)


def test_float32_source_and_empty(gpu, rng):
    X = rng.standard_normal((9, 3)).astype(np.float32)
    src = gpu.CudaSource(X, np.ones(9), 0)
    assert src.dtype == np.float32
    lab, dmin, _ = src.assign(X[:2])
    assert lab[0] == 0 and lab[1] == 1 and dmin[0] == pytest.approx(0.0, abs=1e-5)
    empty = gpu.CudaSource(np.zeros((0, 3), np.float32), np.zeros(0), 0)
    m = empty.moments(X[:2], 1.0, 0, hard_sums=True)
    assert m.rows == 0 and m.weight == 0.0 and m.hard_sums.shape == (2, 3)


def test_validation(gpu, rng):
    X = rng.standard_normal((5, 3))
    with pytest.raises(ValueError, match="metric"):
        gpu.cuda_moments(X, X[:2], 1.0, metric="manhattan")
    with pytest.raises(ValueError, match="temperature"):
        gpu.cuda_moments(X, X[:2], 0.0)
    with pytest.raises(ValueError, match="responsibilities"):
        gpu.cuda_moments(X, X[:2], 1.0, responsibilities="sparsemax")
    with pytest.raises(ValueError, match="log_prior"):
        gpu.cuda_moments(X, X[:2], 1.0, log_prior=[0.0])
    with pytest.raises(ValueError, match="features"):
        gpu.cuda_moments(X, X[:2, :2], 1.0)
    with pytest.raises(ValueError, match="w must have shape"):
        gpu.CudaSource(X, np.ones(4), 0)


def test_clear_error_without_gpu(gpu, monkeypatch):
    from fastanneal.cuda import source
    monkeypatch.setattr(source, "is_available", lambda: False)
    X = np.ones((3, 2))
    with pytest.raises(RuntimeError, match=r"no usable CUDA GPU.*backend='cpu'"):
        gpu.CudaSource(X, np.ones(3), 0)
    with pytest.raises(RuntimeError, match="install numba-cuda and a driver"):
        gpu.cuda_moments(X, X[:1], 1.0)


def test_import_is_lazy_and_availability_without_simulator():
    """``import fastanneal`` / ``fastanneal.cuda`` import no numba.cuda; without a GPU
    and without the simulator, is_available() is False and construction fails clearly."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import fastanneal, fastanneal.cuda
        assert "numba.cuda" not in sys.modules, "numba.cuda imported at import time"
        from numba import cuda
        if cuda.is_available():          # a real GPU here: nothing more to check
            print("GPU")
            raise SystemExit(0)
        assert fastanneal.cuda.is_available() is False
        try:
            fastanneal.cuda.CudaSource(np.ones((2, 2)), np.ones(2), 0)
        except RuntimeError as e:
            assert "no usable CUDA GPU" in str(e), e
            print("OK")
        else:
            raise AssertionError("no error")
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() in ("OK", "GPU")


def test_kernels_compile_for_a_real_gpu():
    """The simulator runs the kernels as Python, so it cannot catch typing errors: lower
    every kernel, float32 and float64, to NVVM IR for compute capability 9.0 with the real
    numba.cuda compiler front end (no driver needed; NVVM itself is not run)."""
    code = textwrap.dedent("""
        from numba import types as t
        import numba.cuda.dispatcher as disp
        from numba.cuda import compiler
        class Dev:
            compute_capability = (9, 0)
        disp.get_current_device = lambda: Dev()   # device functions ask for the current cc
        from fastanneal.cuda import _kernels as K
        f64, i64, i32, b1 = t.float64, t.int64, t.int32, t.boolean
        def A(dt, nd):
            return t.Array(dt, nd, "C")
        for dt in (t.float32, t.float64):
            sigs = {
                "distance_kernel": (A(dt, 2), A(f64, 1), i64, i64, A(dt, 2), A(f64, 1), i64,
                                    A(dt, 2)),
                "rows_kernel": (A(dt, 2), i64, A(f64, 1), i64, A(f64, 1), b1, f64, i64, f64,
                                i64, A(i32, 1), A(f64, 1), A(f64, 1), A(f64, 1)),
                "accum_dense_kernel": (A(dt, 2), A(dt, 2), i64, i64, i64, i64, A(f64, 2),
                                       A(f64, 1)),
                "accum_sparse_kernel": (A(dt, 2), A(dt, 2), i64, i64, i64, A(f64, 2),
                                        A(f64, 1)),
                "scatter_rows_kernel": (A(dt, 2), i64, i64, A(i32, 1), i64, A(f64, 1), i64,
                                        i64, A(f64, 2)),
                "argmin_kernel": (A(dt, 2), i64, i64, i64, A(i64, 1), A(f64, 1), A(f64, 1)),
                "rowdot_kernel": (A(dt, 2), i64, A(i64, 1), b1, A(f64, 2), A(f64, 2),
                                  A(f64, 1), i64, A(f64, 1)),
                "gather_rows_kernel": (A(dt, 2), A(i64, 1), A(dt, 2)),
                "distance_epilogue_kernel": (A(dt, 2), i64, A(f64, 1), i64, A(f64, 1), i64),
            }
            for name, sig in sigs.items():
                cres = compiler.compile_cuda(getattr(K, name).py_func, t.void, sig,
                                             cc=(9, 0))
                assert "define" in cres.library.get_llvm_str(), name
        print("compiled", len(sigs) * 2)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "compiled 18"


def test_gpu_check_script_logic(tmp_path):
    """benchmarks/gpu_check.py --tiny runs every section end to end, for both product paths
    (on the simulator here, where NumPy stands in for cuBLAS; the GEMM floor, faiss-gpu,
    cuML and CuPy are absent and are reported, not fatal)."""
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" /
                                                  "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "gpu_check.json"
    rc = mod.main(["--tiny", "--repeats", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["status"] == "PASS", res.get("errors")
    assert set(res["correctness"]) == {"numba", "cublas"}
    assert res["correctness"]["cublas"]["products"].startswith("cublas")
    for rep in res["correctness"].values():
        cases = rep["cases"]
        assert [c["responsibilities"] for c in cases] == ["softmax", "softmax", "entmax15",
                                                          "hard"]
        assert all(c["pass"] for c in cases)
        assert cases[0]["nnz_fraction"] == 1.0 and cases[1]["nnz_fraction"] < 1.0
        for c in cases:   # the GPU is as close to float64 as the CPU's float32 kernel
            assert c["err_gpu_vs_f64"]["N"] <= max(4 * c["err_cpu32_vs_f64"]["N"], 1e-5)
    assert [t["products"].split()[0] for t in res["timing"]] == ["numba", "cublas"]
    sweep = res["timing"][0]["row_kernel_sweep"]
    assert [(r["row_threads"], r["rows_per_block"]) for r in sweep] == [(None, None), (8, 5),
                                                                         (16, 5)]
    assert [r["row_launch"] for r in sweep] == [[2, 8], [5, 8], [5, 16]]
    assert all(r["dense"] > 0 and r["lowT"] > 0 for r in sweep)
    assert "row_kernel_sweep" not in res["timing"][1]
    for timing in res["timing"]:
        assert set(timing["modes"]) == {"softmax_dense_highT", "softmax_lowT", "entmax15"}
        for rec in timing["modes"].values():
            assert rec["seconds"] > 0
            assert set(rec["stages_one_chunk"]) >= {"distances", "responsibilities",
                                                    "accumulate_dense", "accumulate_sparse"}
    (peer,) = res["peers"]
    assert peer["fastanneal"]["sse"] > 0 and peer["fastanneal"]["passes"] > 0
    assert "unavailable" in peer["faiss_gpu"] and "unavailable" in peer["cuml"]
    assert "unavailable" in peer["cupy_lloyd"] and "unavailable" in res["k20000"]["cupy_lloyd"]
    big = res["k20000"]
    assert big["seconds"] > 0 and len(big["seconds_per_pass"]) == 25 and big["sse"] > 0
    assert len(big["row_kernel_sweep"]) == 3
    assert peer["fastanneal"]["first_fit_seconds"] > 0 and "fit_K2" in res["profiles"]


# ----------------------------------------------------------------------------- library products
# The pass's two products through a library GEMM (cuBLAS by CuPy on a GPU; under the
# simulator NumPy stands in for it on the same device buffers): the distance epilogue, the
# row kernel and the accumulation around them must give what the numba.cuda products give.
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["softmax-high", "softmax-low", "softmax-low-sparse",
                                  "entmax15", "hard", "cosine", "prior"])
def test_library_products_match_the_kernels_and_reference(gpu, rng, monkeypatch, dtype,
                                                          case):
    require_library_products()
    monkeypatch.setattr(_config, "CUDA_SPARSE_FRACTION",
                        2.0 if case.endswith("sparse") else -1.0, raising=False)
    n, D, K = 23, 18, 19
    X, C, w = data(rng, n, D, K, dtype)
    med, gap = typical_scale(X, C)
    resp = {"entmax15": "entmax15", "hard": "hard"}.get(case, "softmax")
    metric = "cosine" if case == "cosine" else "euclidean"
    T = {"softmax-high": 3.0 * med, "entmax15": 0.3 * med, "cosine": 0.05,
         "prior": 0.5 * med}.get(case, 0.02 * med)
    logp = np.log(rng.dirichlet(np.ones(K))) if case == "prior" else None
    kw = dict(weights=w, metric=metric, responsibilities=resp, log_prior=logp)
    calls = count_library_products(monkeypatch)
    kern = gpu.cuda_moments(X, C, T, products="numba", **kw)
    assert calls == {"distances": 0, "accumulate": 0}
    got = gpu.cuda_moments(X, C, T, products="cublas", **kw)
    assert calls["distances"] == 2                      # two chunks of 13 + 10 rows
    # the dense accumulation through the library unless the chunks went sparse
    assert (calls["accumulate"] == 0) == case.endswith("sparse")
    if metric == "cosine":
        Xr = (X / np.linalg.norm(X, axis=1, keepdims=True)).astype(dtype)
        Cr = (C / np.linalg.norm(C, axis=1, keepdims=True)).astype(dtype)
    else:
        Xr, Cr = X, C
    ref = reference(Xr, Cr, T, w, metric=metric, resp=resp, log_prior=logp)
    rtol = RTOL[dtype]
    assert_moments_close(got, ref, rtol, T, K, "library products vs reference")
    assert_moments_close(got, kern, rtol, T, K, "library vs numba.cuda products")
    np.testing.assert_allclose(got.hard_sums, ref["hard_sums"], rtol=rtol,
                               atol=rtol * np.abs(ref["hard_sums"]).max())
    if resp != "softmax":
        assert got.nnz == kern.nnz == ref["nnz"]
    else:
        kept, borderline = softmax_nnz(ref, dtype, slack=1e-3 if dtype == np.float32 else 1e-9)
        assert abs(got.nnz - kept) <= borderline
    if case == "softmax-high":
        assert got.nnz == n * K                       # nothing dropped at high T


def test_library_products_source_interface(gpu, rng, monkeypatch):
    """assign (distances through the library product) and the pass agree with the kernels'
    source on the same rows; the source says which products it uses and why."""
    require_library_products()
    calls = count_library_products(monkeypatch)
    X, C, w = data(rng, 29, 7, 6, np.float64)
    lib = gpu.CudaSource(X, w, 0, products="cublas")
    ker = gpu.CudaSource(X, w, 0, products="numba")
    assert lib.products.startswith("cublas")
    assert lib.products_reason in ("cuBLAS through CuPy",
                                   "cuBLAS stand-in: NumPy under the numba-cuda simulator")
    assert ker.products == "numba" and "asked for" in ker.products_reason
    for a, b in zip(lib.assign(C), ker.assign(C)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert calls["distances"] == 3                      # assign: 3 chunks, by the library
    T = typical_scale(X, C)[0]
    assert_moments_close(lib.moments(C, T, 0, hard_sums=True),
                         ker.moments(C, T, 0, hard_sums=True), 1e-12, T, 6, "source")
    # a second pass with another K reallocates the chunk buffers and their views
    C2 = np.concatenate([C, C[:2] + 0.5])
    assert_moments_close(lib.moments(C2, T, 0, hard_sums=True),
                         reference(X, C2, T, w), 1e-9, T, 8, "new K")


def test_products_selection_without_cupy(gpu, monkeypatch):
    """Where CuPy (or a GPU for it) is absent, "auto" falls back to the numba.cuda
    products and says why; "cublas" fails naming what to install; a bad mode is refused.
    (Run as on a real GPU: the simulator switch is turned off for the selection.)"""
    import builtins

    from fastanneal.cuda import _blas
    monkeypatch.setattr(_blas, "_simulator", lambda: False)
    real_import = builtins.__import__

    def no_cupy(name, *a, **k):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    prod, why = _blas.select("auto")
    assert prod is None and "CuPy is not usable" in why and "cupy-cuda12x" in why
    with pytest.raises(RuntimeError, match=r"cuBLAS products were asked for.*cupy-cuda12x"):
        _blas.select("cublas")
    assert _blas.select("numba") == (None, "numba.cuda products (asked for)")
    with pytest.raises(ValueError, match="CUDA products must be one of"):
        _blas.select("cutlass")
    monkeypatch.setattr(_config, "CUDA_PRODUCTS", "auto")
    src = gpu.CudaSource(np.ones((3, 2)), np.ones(3), 0)
    assert src.products == "numba" and "CuPy is not usable" in src.products_reason


def numpy_plays_cupy():
    """The selection tests let NumPy play CuPy on the simulator's host-backed device arrays;
    with FASTANNEAL_REAL_CUDA=1 (never in CI) real device arrays have no host ndarray, so
    they skip there, and the real CuPy selection is exercised by the library-product
    tests instead."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("FASTANNEAL_REAL_CUDA=1: NumPy can play CuPy only on the simulator's "
                    "host-backed arrays (the real CuPy selection runs in the library tests)")


def test_products_selection_checks_the_library_before_using_it(gpu, monkeypatch):
    """On a GPU, "auto" takes cuBLAS only after one tiny product through it is right: a
    library that imports but computes wrong numbers (or fails) leaves the numba.cuda
    products in charge, with the reason; "cublas" then fails naming it. (The simulator's
    NumPy stand-in plays CuPy here.)"""
    numpy_plays_cupy()
    from fastanneal.cuda import _blas
    monkeypatch.setattr(_blas, "_simulator", lambda: False)
    monkeypatch.setattr(_blas, "CupyProducts", _blas.SimulatedProducts)
    prod, why = _blas.select("auto")
    assert isinstance(prod, _blas.SimulatedProducts) and why == "cuBLAS through CuPy"

    class Wrong(_blas.SimulatedProducts):
        def distances(self, Xv, Cv, Gv):
            Gv[:] = 0.0
    monkeypatch.setattr(_blas, "CupyProducts", Wrong)
    prod, why = _blas.select("auto")
    assert prod is None and "a 3 x 2 product gave" in why
    with pytest.raises(RuntimeError, match="cuBLAS products were asked for.*3 x 2 product"):
        _blas.select("cublas")

    class NoAccumulate(_blas.SimulatedProducts):       # e.g. CuPy without NVRTC
        def accumulate(self, *a):
            raise RuntimeError("nvrtc: libnvrtc.so.12 not found")
    monkeypatch.setattr(_blas, "CupyProducts", NoAccumulate)
    prod, why = _blas.select("auto")
    assert prod is None and "libnvrtc" in why


def test_rows_stay_on_the_host_when_they_do_not_fit(gpu, rng, monkeypatch):
    """``resident=None`` copies the rows to the device only when they take at most
    ``CUDA_RESIDENT_FRACTION`` of its free memory; a streamed source gives the resident
    source's results (chunks of 13 rows: two staging buffers, each reused), empty too."""
    from fastanneal.cuda import source
    X, C, w = data(rng, 41, 6, 5, np.float32)
    monkeypatch.setattr(source, "_free_bytes", lambda: 2.0 * (X.nbytes + 16 * 41))
    assert gpu.CudaSource(X, w, 0).resident is True
    monkeypatch.setattr(source, "_free_bytes", lambda: 1.5 * (X.nbytes + 16 * 41))
    streamed = gpu.CudaSource(X, w, 0)
    assert streamed.resident is False and streamed._X is None
    resident = gpu.CudaSource(X, w, 0, resident=True)
    T = typical_scale(X, C)[0]
    for rc in (0, 1, 2):
        assert_moments_close(streamed.moments(C, T, rc, None, True),
                             resident.moments(C, T, rc, None, True), 1e-12, T, 5, f"resp {rc}")
        if rc == 0:
            stage = streamed._stage
        assert streamed._stage is stage                  # staging buffers kept across passes
    for a, b in zip(streamed.assign(C), resident.assign(C)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(streamed.mean(), resident.mean(), rtol=1e-13)
    lam_s = streamed.cluster_top_eigenvalues(C, 10, np.random.default_rng(1))
    lam_r = resident.cluster_top_eigenvalues(C, 10, np.random.default_rng(1))
    np.testing.assert_allclose(lam_s, lam_r, rtol=1e-12)
    empty = gpu.CudaSource(np.zeros((0, 6), np.float32), np.zeros(0), 0, resident=False)
    assert empty.moments(C, 1.0, 0).rows == 0


def test_parquet_stream_reduces_its_blocks_on_the_gpu(gpu, tmp_path, monkeypatch):
    """``open_parquet(..., device="cuda")``: every full pass and every mini-batch is reduced
    by the GPU (row groups decoded on the CPU, streamed through the device in chunks of
    13 rows, products by the library path), and a mini-batch fit over it equals the CPU
    stream's fit; a bad device is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastanneal import MiniBatchAnnealedKMeans
    from fastanneal._parquet import open_parquet
    require_library_products()
    monkeypatch.setattr(_config, "CUDA_PRODUCTS", "cublas")
    rng = np.random.default_rng(4)
    n, D, K = 60, 5, 3
    centers = rng.normal(size=(K, D)) * 6
    X = (centers[rng.integers(0, K, n)] + rng.normal(size=(n, D))).astype(np.float32)
    cnt = rng.integers(1, 5, n).astype(np.int64)
    p = tmp_path / "log.parquet"
    pq.write_table(pa.table({"count": cnt, "emb": pa.FixedSizeListArray.from_arrays(
        pa.array(X.ravel()), D)}), p, row_group_size=25)
    cpu = open_parquet(p, column="emb", weight="count", chunk_rows=16)
    dev = open_parquet(p, column="emb", weight="count", chunk_rows=16, device="cuda")
    lib_calls = count_library_products(monkeypatch)
    calls = []
    real = gpu.CudaBlocks.moments
    monkeypatch.setattr(gpu.CudaBlocks, "moments",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    C = X[:K].astype(np.float64) + 0.5
    T = float(np.median(((X[:, None] - C[None]) ** 2).sum(-1)))
    for rc in (0, 2):
        assert_moments_close(dev.moments(C, T, rc, None, True),
                             cpu.moments(C, T, rc, None, True), 1e-4, T, K, f"full, resp {rc}")
    assert len(calls) == 2 * 3                           # three row groups, two passes
    assert lib_calls["distances"] >= 2 * 3                # through the library products
    mb = dev.batch_moments([0, 3], C, T, 0, None)      # 16 + 9 rows of two row groups
    mc = cpu.batch_moments([0, 3], C, T, 0, None)
    assert mb.rows == mc.rows == 25 and mb.hard_sums is None
    for f in ("N", "S", "free_energy", "hard_distortion", "entropy"):
        np.testing.assert_allclose(getattr(mb, f), getattr(mc, f), rtol=1e-4,
                                   atol=1e-4 * np.abs(getattr(mc, f)).max(), err_msg=f)
    kw = dict(random_state=0, n_steps=4)
    a = MiniBatchAnnealedKMeans(K, **kw).fit(cpu)
    before = len(calls)
    b = MiniBatchAnnealedKMeans(K, **kw).fit(dev)
    assert len(calls) > before + 3                     # the fit's passes ran on the GPU
    np.testing.assert_array_equal(a.predict(X), b.predict(X))
    np.testing.assert_allclose(b.cluster_centers_, a.cluster_centers_, rtol=1e-4, atol=1e-4)
    assert dev._gpu is None                              # the fit closed the stream
    # a block engine keeps its buffers from block to block while K stays
    eng = gpu.CudaBlocks(D, np.float32, 0)
    eng.moments(X[:20], np.ones(20), C, T)
    kept = eng._src._buffers[1]
    eng.moments(X[20:30], np.ones(10), C, T)
    assert eng._src._buffers[1] is kept
    with pytest.raises(ValueError, match=r"w must have shape \(10,\)"):
        eng.moments(X[20:30], np.ones(9), C, T)
    eng.close()
    with pytest.raises(ValueError, match="device must be"):
        open_parquet(p, column="emb", device="gpu")
    from fastanneal.cuda import source
    monkeypatch.setattr(source, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        open_parquet(p, column="emb", device="cuda")


def test_command_runs_on_the_gpu_in_memory_and_out_of_core(gpu, tmp_path, capsys,
                                                           monkeypatch):
    """``fastanneal cluster --backend cuda``: in memory the fit runs on a CudaSource, out of
    core (``--memory-limit`` below the embeddings) each batch is reduced by CudaBlocks; both
    write the partition of ``--backend cpu``. Without a usable GPU the command says so
    before it reads anything (exit 2)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastanneal.cli import main
    rng = np.random.default_rng(11)
    n, D, K = 60, 4, 3
    centers = rng.normal(size=(K, D)) * 8
    lab = rng.integers(0, K, n)
    X = (centers[lab] + rng.normal(size=(n, D))).astype(np.float32)
    p = tmp_path / "log.parquet"
    pq.write_table(pa.table({"query": [f"q{k} {i}" for i, k in enumerate(lab)],
                             "emb": pa.FixedSizeListArray.from_arrays(pa.array(X.ravel()), D)}),
                   p, row_group_size=25)
    made = []
    real_src, real_blk = gpu.CudaSource.__init__, gpu.CudaBlocks.moments
    monkeypatch.setattr(gpu.CudaSource, "__init__",
                        lambda self, *a, **k: made.append("source") or real_src(self, *a, **k))
    monkeypatch.setattr(gpu.CudaBlocks, "moments",
                        lambda self, *a, **k: made.append("block") or real_blk(self, *a, **k))

    def run(name, *extra):
        out = tmp_path / f"{name}.parquet"
        rc = main([str(a) for a in ("cluster", p, "--embedding-column", "emb", "--k", K,
                                    "--metric", "euclidean", "-q", "-o", out,
                                    *extra)])
        err = capsys.readouterr().err
        assert rc == 0, err
        return pq.read_table(out).column("cluster").to_numpy(), err

    cpu, _ = run("cpu")
    assert not made
    mem, _ = run("gpu_mem", "--backend", "cuda")
    assert "source" in made and "block" not in made
    made.clear()
    ooc, _ = run("gpu_ooc", "--backend", "cuda", "--memory-limit", "1K")
    assert "block" in made                              # the out-of-core route, on the GPU
    np.testing.assert_array_equal(mem, cpu)
    from fastanneal._cli_results import adjusted_rand_index
    assert adjusted_rand_index(cpu, ooc) == pytest.approx(1.0)
    # a products setting that cannot be honoured: said before reading, as a usage error
    monkeypatch.setattr(_config, "CUDA_PRODUCTS", "cutlass")
    rc = main(["cluster", str(p), "--embedding-column", "emb", "--k", "3", "-q",
               "-o", str(tmp_path / "none.parquet"), "--backend", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "--backend cuda: CUDA products must be one of" in err
    assert "FASTANNEAL_CUDA_PRODUCTS" in err
    monkeypatch.setattr(_config, "CUDA_PRODUCTS", "auto")
    monkeypatch.setattr(gpu, "is_available", lambda: False)
    rc = main(["cluster", str(p), "--embedding-column", "emb", "--k", "3", "-q",
               "-o", str(tmp_path / "none.parquet"), "--backend", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "--backend cuda: no usable CUDA GPU" in err
    assert not (tmp_path / "none.parquet").exists()


def test_distance_epilogue_grid_puts_rows_on_x(gpu, rng, monkeypatch):
    """The epilogue after a library product is launched with the chunk's rows on grid.x
    (grid.y allows only 65,535 blocks, a limit the simulator does not enforce): checked
    on the launch configuration itself."""
    require_library_products()
    from fastanneal.cuda import _kernels as K_
    grids = []
    real = K_.distance_epilogue_kernel

    class Spy:
        def __getitem__(self, cfg):
            grids.append(cfg)
            return real[cfg]
    monkeypatch.setattr(K_, "distance_epilogue_kernel", Spy())
    X, C, w = data(rng, 23, 5, 19, np.float64)
    gpu.cuda_moments(X, C, 1.0, weights=w, products="cublas")
    # chunks of 13 and 10 rows; 19 centers: (ceil(m / 16), ceil(19 / 16)) blocks of 16 x 16
    assert grids == [((1, 2), (16, 16)), ((1, 2), (16, 16))]
    monkeypatch.setattr(_config, "CUDA_CHUNK_ROWS", 40, raising=False)
    grids.clear()
    gpu.cuda_moments(np.tile(X, (2, 1))[:40], C[:3], 1.0, products="cublas")
    assert grids == [((3, 1), (16, 16))]


def test_row_kernel_launch_rule(monkeypatch):
    """The row kernels' launch: a warp per row below K = 2048, one thread per 32 centers
    from there (at most 256), 2 rows per block; on a GPU the rows per block shrink for short
    chunks (large K) so that the grid keeps ``ROW_BLOCKS_PER_SM`` blocks per
    multiprocessor; explicit settings win (the shrink still applies to them)."""
    from fastanneal.cuda import _blas, source
    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 256)
    monkeypatch.setattr(_config, "CUDA_ROWS_PER_BLOCK", 64)
    monkeypatch.setattr(_blas, "_simulator", lambda: False)
    monkeypatch.setattr(source, "_sm_count", lambda: 132)
    per_grid = source.ROW_BLOCKS_PER_SM * 132
    assert source._row_launch(65536, 256, 256) == (2, 32)
    assert source._row_launch(65536, 256, 1024) == (2, 32)
    assert source._row_launch(65536, 256, 2048) == (2, 64)
    assert source._row_launch(65536, 256, 5000) == (2, 128)
    assert source._row_launch(6710, 256, 20000) == (1, 256)
    assert source._row_launch(per_grid - 1, 256, 3) == (1, 32)
    assert source._row_launch(3, 128, 20000) == (1, 128)     # never above threads per block
    monkeypatch.setattr(_config, "CUDA_ROW_THREADS", 128)
    monkeypatch.setattr(_config, "CUDA_ROW_BLOCK_ROWS", 8)
    assert source._row_launch(65536, 256, 20000) == (8, 128)
    monkeypatch.setattr(_config, "CUDA_ROW_BLOCK_ROWS", 64)
    assert source._row_launch(65536, 256, 256) == (15, 128)
    # under the simulator no shrink (tests keep several rows per block on tiny chunks)
    monkeypatch.setattr(_blas, "_simulator", lambda: True)
    monkeypatch.setattr(_config, "CUDA_ROW_THREADS", None)
    monkeypatch.setattr(_config, "CUDA_ROW_BLOCK_ROWS", None)
    monkeypatch.setattr(_config, "CUDA_THREADS_PER_BLOCK", 8)
    monkeypatch.setattr(_config, "CUDA_ROWS_PER_BLOCK", 5)
    assert source._row_launch(13, 8, 7) == (2, 8)


def test_library_check_runs_once_per_library_and_device(gpu, monkeypatch):
    """The tiny checked product that "auto" / "cublas" selection runs before trusting the
    library runs once per process, library and device; its verdict, failure included, is
    kept (a source made per Parquet batch does not launch it again)."""
    numpy_plays_cupy()
    from fastanneal.cuda import _blas
    monkeypatch.setattr(_blas, "_simulator", lambda: False)
    monkeypatch.setattr(_blas, "_SMOKED", {})
    runs = []

    class Counted(_blas.SimulatedProducts):
        def distances(self, Xv, Cv, Gv):
            runs.append(1)
            return super().distances(Xv, Cv, Gv)
    monkeypatch.setattr(_blas, "CupyProducts", Counted)
    for _ in range(3):
        prod, why = _blas.select("auto")
        assert isinstance(prod, Counted) and why == "cuBLAS through CuPy"
    assert len(runs) == 1

    class Wrong(_blas.SimulatedProducts):
        def distances(self, Xv, Cv, Gv):
            runs.append(1)
            Gv[:] = 0.0
    monkeypatch.setattr(_blas, "CupyProducts", Wrong)
    for _ in range(2):
        assert _blas.select("auto")[0] is None
        with pytest.raises(RuntimeError, match="3 x 2 product"):
            _blas.select("cublas")
    assert len(runs) == 2


@pytest.mark.parametrize("resident", [True, False])
def test_library_products_covariance_on_the_device(gpu, rng, monkeypatch, resident):
    """With the library products the whole-data covariance (the critical temperature's
    matrix) is one float64 GEMM per block of centered rows on the device, resident or
    streamed; it equals the host's ``exact_covariance`` (float64, weights included)."""
    require_library_products()
    from fastanneal._sources import exact_covariance
    from fastanneal.cuda import _blas
    calls = []
    real = _blas.CupyProducts.scatter

    def spy(self, *a, **k):
        calls.append(a[0].shape[0])
        return real(self, *a, **k)
    for cls in (_blas.CupyProducts, _blas.SimulatedProducts):
        monkeypatch.setattr(cls, "scatter", spy)
    X, C, w = data(rng, 41, 6, 3, np.float32)
    X += 50.0                                   # far from the origin: centering matters
    mean = np.average(X.astype(np.float64), axis=0, weights=w)
    src = gpu.CudaSource(X, w, 0, products="cublas", resident=resident)
    got = src.covariance(mean)
    ref = exact_covariance(X, w, mean)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12 * np.abs(ref).max())
    assert sum(calls) == 41 and len(calls) == 4          # chunks of 13 rows
    calls.clear()
    assert gpu.CudaSource(X, w, 0, products="numba").covariance(mean) is not None
    assert calls == []                                    # the kernels' source: on the host


def test_library_scratch_follows_the_accumulation_rows(gpu, rng, monkeypatch):
    """The dense accumulation's scratch (its row of ones) is sized from
    ``CUDA_BLAS_ACCUM_ROWS``: raising the setting between passes of one source reallocates
    it (the setting is read at every call) and the pass stays right."""
    require_library_products()
    monkeypatch.setattr(_config, "CUDA_SPARSE_FRACTION", -1.0, raising=False)
    monkeypatch.setattr(_config, "CUDA_CHUNK_ROWS", 40, raising=False)
    X, C, w = data(rng, 40, 5, 3, np.float64)
    T = 3.0 * typical_scale(X, C)[0]
    src = gpu.CudaSource(X, w, 0, products="cublas")
    ref = gpu.CudaSource(X, w, 0, products="numba").moments(C, T, 0, hard_sums=True)
    for rows in (4, 16, 64):
        monkeypatch.setattr(_config, "CUDA_BLAS_ACCUM_ROWS", rows)
        got = src.moments(C, T, 0, hard_sums=True)
        assert_moments_close(got, ref, 1e-12, T, 3, f"accum rows {rows}")


def test_device_covariance_falls_back_to_the_host_when_it_does_not_fit(gpu, rng,
                                                                      monkeypatch):
    """Out of device memory for the float64 blocks (CuPy raises a MemoryError): the host
    computes the covariance, and the library's pool is released either way."""
    require_library_products()
    from fastanneal._sources import exact_covariance
    from fastanneal.cuda import _blas
    released = []

    def oom(self, *a, **k):
        raise MemoryError("out of memory to allocate 1 bytes")
    for cls in (_blas.CupyProducts, _blas.SimulatedProducts):
        monkeypatch.setattr(cls, "scatter", oom)
        monkeypatch.setattr(cls, "release", lambda self: released.append(1))
    X, C, w = data(rng, 30, 4, 2, np.float64)
    mean = np.average(X, axis=0, weights=w)
    src = gpu.CudaSource(X, w, 0, products="cublas")
    np.testing.assert_allclose(src.covariance(mean), exact_covariance(X, w, mean),
                               rtol=1e-12)
    assert released == [1]


@pytest.mark.parametrize("metric", [0, 1])
def test_objective_is_exact_with_rows_weighing_1e10(gpu, rng, metric):
    """A fit's final pass on the device: its J (inertia_) came from the float32 GEMM form,
    22x too large with rows weighing 1e10 sitting on their centers; now each row's
    distance to its center is summed in float64 on the host copy, with the hard counts."""
    K, D = 4, 8
    C = (rng.normal(size=(K, D)) * 3).astype(np.float32)
    X = np.concatenate([c + rng.normal(size=(60, D)).astype(np.float32) for c in C])
    X[:K] = C                                            # heavy rows on the centers
    w = np.ones(len(X))
    w[:K] = 1e10
    Xs, Cs = X, C
    if metric == 1:              # (a source holds prepared rows: unit rows for cosine)
        Xs = (X / np.linalg.norm(X, axis=1, keepdims=True)).astype(np.float32)
        Cs = C / np.linalg.norm(C, axis=1, keepdims=True)
    U, V = Xs.astype(np.float64), Cs.astype(np.float64)
    if metric == 1:
        U = U / np.linalg.norm(U, axis=1, keepdims=True)
        V = V / np.linalg.norm(V, axis=1, keepdims=True)
    d = ((U[:, None] - V[None]) ** 2).sum(-1)
    lab = d.argmin(1)
    J, counts = gpu.CudaSource(Xs, w, metric).objective(Cs)
    assert J == pytest.approx(float(w @ d.min(1)), rel=1e-9, abs=1e-6)
    np.testing.assert_allclose(counts, np.bincount(lab, weights=w, minlength=K), rtol=1e-12)
    if metric == 0:              # (through a fit once: the simulator is slow)
        km = fastanneal.AnnealedKMeans(K, backend="cuda", random_state=0,
                                       n_steps=3).fit(X, sample_weight=w)
        assert km.inertia_ == pytest.approx(-km.score(X, sample_weight=w), rel=1e-9)


def test_a_checkpoint_resumes_on_the_other_backend(gpu, tmp_path):
    """The backend is not part of a checkpoint's key (docs/guide/resume.md): the CUDA
    source's fingerprint carried a "cuda:" prefix, so a CPU rerun replaced the finished
    GPU file without a word (and the reverse)."""
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(size=(20, 4)) + 8 * np.eye(4)[k] for k in range(3)])
    for first, second in (("cuda", "cpu"), ("cpu", "cuda")):
        kw = dict(n_steps=3, random_state=0, checkpoint=tmp_path / f"ck_{first}")
        a = fastanneal.AnnealedKMeans(3, backend=first, **kw).fit(X)
        b = fastanneal.AnnealedKMeans(3, backend=second, **kw).fit(X)
        assert b.checkpoint_info_["finished"] is True
        np.testing.assert_array_equal(b.cluster_centers_, a.cluster_centers_)


def test_cuda_moments_refuses_what_moments_refuses(gpu):
    X = np.random.default_rng(1).normal(size=(20, 3))
    with pytest.raises(ValueError, match="no cluster has mass"):
        gpu.cuda_moments(X, X[:3], 1.0, log_prior=np.full(3, -np.inf))
    with pytest.raises(ValueError, match="weights sum to infinity"):
        gpu.cuda_moments(X, X[:3], 1.0, weights=np.full(20, 1e308))
    with pytest.raises(ValueError, match="too small for this data"):
        gpu.cuda_moments(np.array([[0.5, 1e5], [0.5, -1e5]]), np.array([[0.0, 0.0],
                                                                          [1.0, 0.0]]), 1e-300)


def test_backend_cuda_is_not_dropped_by_the_cpu_only_routes():
    """``batch_size=`` and ``partial_fit`` run on the CPU: with ``backend="cuda"`` they
    fitted there without a word (no GPU needed, none used)."""
    X = np.random.default_rng(0).normal(size=(40, 3))
    with pytest.raises(ValueError, match="backend='cuda' runs full-batch fits"):
        fastanneal.AnnealedKMeans(3, backend="cuda", batch_size=10).fit(X)
    with pytest.raises(ValueError, match="partial_fit runs on the CPU"):
        fastanneal.AnnealedKMeans(3, backend="cuda", random_state=0).partial_fit(X)

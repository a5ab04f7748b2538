"""Moment sources: where the data lives. The annealing engine only talks to the
:class:`~fastanneal._protocol.MomentSource` protocol; this module has the in-memory source and
the Lanczos iteration every source uses for the critical temperatures.

CPU (this module), CUDA (:mod:`fastanneal.cuda`) and Dask (:mod:`fastanneal.dask`) sources
differ only in how they produce and add :class:`~fastanneal.Moments` records.
"""
import hashlib

import numba
import numpy as np

from . import _kernels as K_
from ._moments import assign, compute_moments


def power_iteration_eigs(matvec, mu, wk, n_iter, rng, return_vectors=False):
    """Top eigenvalue of each cluster covariance (1/W_k), for all clusters at once.

    ``matvec(mu, V)`` returns ``sum_{i in k} w_i (x_i - mu_k)((x_i - mu_k).v_k)`` for one
    vector per cluster (an additive moment: every source can provide it). The iteration is
    Lanczos with full re-orthogonalisation, one Krylov basis per cluster, at most
    ``n_iter`` matvecs: unlike the plain power iteration it does not stall near
    ``lambda_2`` when the spectral gap is small or the start vector is nearly orthogonal
    to the top eigenvector. With ``return_vectors`` also the unit top Ritz vectors (K, D).
    """
    from scipy.linalg import eigh_tridiagonal
    K, D = mu.shape
    m = int(max(1, min(n_iter, D)))
    wsafe = np.where(wk > 0, wk, 1.0)
    Q = np.zeros((m + 1, K, D))
    v = rng.standard_normal((K, D))
    v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
    Q[0] = v
    alpha = np.zeros((m, K))
    beta = np.zeros((m, K))
    lam = np.zeros(K)
    Y = np.zeros((K, m))
    steps = 0

    def ritz(j):
        lam_j = np.zeros(K)
        for k in range(K):
            a = alpha[:j + 1, k]
            if j == 0:
                lam_j[k] = a[0]
                Y[k, 0] = 1.0
                continue
            ev, vec = eigh_tridiagonal(a, beta[:j, k])
            lam_j[k] = ev[-1]
            Y[k, :j + 1] = vec[:, -1]
        return lam_j

    def ritz_values(j):
        """The top Ritz values of all clusters in one stacked ``eigvalsh`` (the convergence
        checks: one LAPACK call instead of K; the final values and vectors come from
        :func:`ritz`)."""
        n = j + 1
        if n == 1:
            return alpha[0].copy()
        T = np.zeros((K, n, n))
        d = np.arange(n)
        T[:, d, d] = alpha[:n].T
        T[:, d[:-1], d[1:]] = beta[:j].T
        T[:, d[1:], d[:-1]] = beta[:j].T
        return np.linalg.eigvalsh(T)[:, -1]

    for j in range(m):
        U = matvec(mu, Q[j]) / wsafe[:, None]
        alpha[j] = np.einsum("kd,kd->k", Q[j], U)
        # full re-orthogonalisation against the basis so far (twice is enough)
        for _ in range(2):
            coef = np.einsum("jkd,kd->jk", Q[:j + 1], U)
            U -= np.einsum("jk,jkd->kd", coef, Q[:j + 1])
        b = np.linalg.norm(U, axis=1)
        beta[j] = b
        steps = j + 1
        ok = b > 1e-10 * np.maximum(np.abs(alpha[j]), 1e-300)
        Q[j + 1][ok] = U[ok] / b[ok, None]
        if (j + 1) % 5 == 0 or j == m - 1 or not ok.any():
            new = ritz_values(j)
            done = np.all(np.abs(new - lam) <= 1e-9 * np.maximum(np.abs(new), 1e-300))
            lam = new
            if done or not ok.any():
                break
    lam = ritz(steps - 1)                 # final values and Ritz vectors, cluster by cluster
    lam = np.where(wk > 0, np.maximum(lam, 0.0), 0.0)
    if not return_vectors:
        return lam
    V = np.einsum("kj,jkd->kd", Y[:, :steps], Q[:steps])
    V /= np.maximum(np.linalg.norm(V, axis=1, keepdims=True), 1e-300)
    return lam, V


class InMemorySource:
    """Rows held in one NumPy array (validated, C-contiguous, unit rows for cosine)."""

    def __init__(self, X, w, metric):
        self.X = X
        self.w = w
        self.metric = metric
        self.n_rows, self.n_features = X.shape
        self.dtype = X.dtype
        self.total_weight = float(w.sum())

    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        return compute_moments(self.X, self.w, centers, T, self.metric, resp, log_prior,
                               hard_sums)

    def grad_moments(self, centers, T, resp, globals_):
        from .gradient import backward_moments
        return backward_moments(self.X, self.w, centers, T, self.metric, resp, globals_)

    def covariance(self, mean):
        return exact_covariance(self.X, self.w, mean)

    def n_distinct_rows(self, rng, cap):
        return n_distinct_rows(self.X, self.w, rng)

    def labels(self, centers):
        return self.assign(centers)[0]

    def fingerprint(self):
        return data_fingerprint(self.X, self.w, self.metric)

    def close(self):
        pass

    def sample(self, n, rng):
        if n >= self.n_rows:
            return self.X, self.w
        idx = np.sort(rng.choice(self.n_rows, size=n, replace=False))
        return self.X[idx], self.w[idx]

    def mean(self):
        return (self.w @ self.X.astype(np.float64, copy=False)) / self.total_weight

    def assign(self, centers):
        return assign(self.X, centers, self.metric, _prepared=True)

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False):
        centers = np.asarray(centers, dtype=np.float64)
        if centers.shape[0] == 1:
            labels = np.zeros(self.n_rows, dtype=np.int64)
        else:
            labels = self.assign(centers)[0]
        wk = np.bincount(labels, weights=self.w, minlength=centers.shape[0])
        nth = numba.get_num_threads()

        def matvec(mu, V):
            return K_.cluster_cov_matvec_kernel(self.X, self.w, labels, mu, V, nth)
        return power_iteration_eigs(matvec, centers, wk, n_iter, rng, return_vectors)


#: Largest D for which sources form the exact D x D covariance (else Lanczos).
COVARIANCE_MAX_D = 2048


def exact_covariance(X, w, mean, block=16384):
    """``sum w (x - mean)(x - mean)^T / W`` by float64 GEMMs over row blocks (None when
    ``D > COVARIANCE_MAX_D``)."""
    D = X.shape[1]
    if D > COVARIANCE_MAX_D:
        return None
    Cov = np.zeros((D, D))
    for b in range(0, X.shape[0], block):
        Z = X[b:b + block].astype(np.float64) - mean
        Cov += (Z * w[b:b + block, None]).T @ Z
    return Cov / w.sum()


def row_hashes(X, v):
    """64-bit hashes of the rows of ``X`` that are equal exactly for equal rows (integer
    arithmetic on the bytes: no rounding, unlike a projection ``X @ v``, which BLAS may
    round differently for equal rows at different positions). ``v`` (float64, (D,), drawn
    at random) gives the odd multipliers; ``-0.0`` counts as ``0.0``."""
    if X.shape[0] == 0:
        return np.zeros(0, dtype=np.uint64)
    X = np.ascontiguousarray(X) + X.dtype.type(0)         # -0.0 -> 0.0
    b = X.view(np.uint8).reshape(X.shape[0], -1)
    pad = (-b.shape[1]) % 8
    if pad:
        b = np.concatenate([b, np.zeros((b.shape[0], pad), np.uint8)], axis=1)
    words = np.ascontiguousarray(b).view(np.uint64)
    mult = np.resize(np.asarray(v, dtype=np.float64).view(np.uint64), words.shape[1]) | 1
    h = np.zeros(X.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(words.shape[1]):
            h = (h ^ words[:, j]) * mult[j]
            h ^= h >> np.uint64(29)
    return h


def n_distinct_rows(X, w, rng):
    """Number of distinct rows with non-zero weight (exact 64-bit row hashes)."""
    v = rng.standard_normal(X.shape[1])
    return len(np.unique(row_hashes(X[w > 0], v)))


def data_fingerprint(X, w, metric):
    """sha256 of the rows, the weights and the metric (checkpoint key of in-memory data)."""
    h = hashlib.sha256()
    h.update(f"{X.dtype}{X.shape}{metric}".encode())
    h.update(np.ascontiguousarray(X).data)
    h.update(np.ascontiguousarray(w, dtype=np.float64).data)
    return h.hexdigest()

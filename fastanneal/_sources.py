"""Moment sources: where the data lives. The annealing engine only talks to this interface.

A source provides, for the whole dataset it holds:

* ``n_rows``, ``n_features``, ``dtype``, ``total_weight``, ``metric`` (0 euclidean, 1 cosine);
* ``moments(centers, T, resp, log_prior=None, hard_sums=False) -> Moments`` -- one full pass;
* ``sample(n, rng) -> (rows, weights)`` -- an in-memory sample for seeding (k-means++);
* ``mean() -> (D,)`` -- the weighted mean (cosine: of the unit rows);
* ``cluster_top_eigenvalues(centers, n_iter, rng, return_vectors=False) -> (K,)`` --
  ``lambda_max`` of the weighted covariance (1/W_k) of each cluster of the hard partition
  induced by ``centers`` (``centers`` of shape (1, D) at the mean gives the data's own
  ``lambda_max``); with ``return_vectors`` also the top eigenvectors ``(lam, V)``;
* ``assign(centers) -> (labels, d_min, margin)`` -- only sources that hold the rows in memory.

CPU (this module), CUDA (:mod:`fastanneal.cuda`) and Dask (:mod:`fastanneal.dask`) sources
differ only in how they produce and add :class:`~fastanneal.Moments` records.
"""
import numba
import numpy as np

from . import _kernels as K_
from ._moments import assign, compute_moments


def power_iteration_eigs(matvec, mu, wk, n_iter, rng, return_vectors=False):
    """Top eigenvalue of each cluster covariance by power iteration on ``matvec(mu, V)``
    (which returns ``sum_{i in k} w_i (x_i - mu_k)((x_i - mu_k).v_k)``); shared by sources.
    With ``return_vectors`` also the unit top eigenvectors (K, D)."""
    K, D = mu.shape
    V = rng.standard_normal((K, D))
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    lam = np.zeros(K)
    for _ in range(max(1, n_iter)):
        U = matvec(mu, V)
        # Rayleigh quotient v.Cv (error ~ (lambda_2/lambda_1)^(2k), vs ^k for ||Cv||)
        rq = np.einsum("ij,ij->i", V, U)
        new = np.where(wk > 0, rq / np.where(wk > 0, wk, 1.0), 0.0)
        norms = np.linalg.norm(U, axis=1)
        ok = norms > 0
        V[ok] = U[ok] / norms[ok, None]
        done = np.all(np.abs(new - lam) <= 1e-7 * np.maximum(np.abs(new), 1e-300))
        lam = new
        if done:
            break
    return (lam, V) if return_vectors else lam


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

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


def power_iteration_eigs(matvec, mu, wk, n_iter, rng, return_vectors=False, tol=None,
                         start=None):
    """Top eigenvalue of each cluster covariance (1/W_k), for all clusters at once.

    ``matvec(mu, V)`` returns ``sum_{i in k} w_i (x_i - mu_k)((x_i - mu_k).v_k)`` for one
    vector per cluster (an additive moment: every source can provide it). The iteration is
    Lanczos with full re-orthogonalisation, one Krylov basis per cluster, at most
    ``n_iter`` matvecs: unlike the plain power iteration it does not stall near
    ``lambda_2`` when the spectral gap is small or the start vector is nearly orthogonal
    to the top eigenvector. With ``return_vectors`` also the unit top Ritz vectors (K, D).

    ``tol`` (default 1e-9): the iteration stops once no top Ritz value changed by more than
    ``tol`` (relative) between two checks (every 5 matvecs; every 2 when ``tol >= 1e-6``).
    ``start`` (K, D): start vectors (e.g. the Ritz vectors of a nearby earlier call: a warm
    start), mixed with a random part so that no start is orthogonal to the top eigenvector;
    rows of zeros start at random.
    """
    K, D = mu.shape
    m = int(max(1, min(n_iter, D)))
    wsafe = np.where(wk > 0, wk, 1.0)
    Q = np.zeros((m + 1, K, D))
    v = rng.standard_normal((K, D))
    v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
    if start is not None:
        start = np.asarray(start, dtype=np.float64)
        if start.shape != (K, D):
            raise ValueError(f"start must have shape {(K, D)}; got {start.shape}")
        n0 = np.linalg.norm(start, axis=1, keepdims=True)
        warm = n0[:, 0] > 0
        v[warm] = start[warm] / n0[warm] + WARM_NOISE * v[warm]
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
    tol = 1e-9 if tol is None else float(tol)
    every = 2 if tol >= 1e-6 else 5
    Q[0] = v
    alpha = np.zeros((m, K))
    beta = np.zeros((m, K))
    lam = np.zeros(K)
    Y = np.zeros((K, m))
    steps = 0

    def ritz(j):
        """Top Ritz values and their vectors' Lanczos coefficients (into ``Y``), all
        clusters in one stacked ``eigh`` of the (K, j+1, j+1) tridiagonal matrices; the
        sign is fixed so that a vector has a non-negative component along its start."""
        n = j + 1
        if n == 1:
            Y[:, 0] = 1.0
            return alpha[0].copy()
        ev, vec = np.linalg.eigh(_tridiagonals(alpha, beta, j))
        top = vec[:, :, -1]
        top *= np.where(top[:, :1] < 0.0, -1.0, 1.0)
        Y[:, :n] = top
        return ev[:, -1]

    def ritz_values(j):
        """The top Ritz values of all clusters (the convergence checks; the final values
        and vectors come from :func:`ritz`)."""
        if j == 0:
            return alpha[0].copy()
        return np.linalg.eigvalsh(_tridiagonals(alpha, beta, j))[:, -1]

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
        if (j + 1) % every == 0 or j == m - 1 or not ok.any():
            new = ritz_values(j)
            done = np.all(np.abs(new - lam) <= tol * np.maximum(np.abs(new), 1e-300))
            lam = new
            if done or not ok.any():
                break
    lam = ritz(steps - 1) if return_vectors else ritz_values(steps - 1)
    lam = np.where(wk > 0, np.maximum(lam, 0.0), 0.0)
    if not return_vectors:
        return lam
    V = np.einsum("kj,jkd->kd", Y[:, :steps], Q[:steps])
    V /= np.maximum(np.linalg.norm(V, axis=1, keepdims=True), 1e-300)
    return lam, V


def _tridiagonals(alpha, beta, j):
    """The Lanczos tridiagonal matrices of all clusters after step ``j``: (K, j+1, j+1)."""
    n = j + 1
    K = alpha.shape[1]
    T = np.zeros((K, n, n))
    d = np.arange(n)
    T[:, d, d] = alpha[:n].T
    T[:, d[:-1], d[1:]] = beta[:j].T
    T[:, d[1:], d[:-1]] = beta[:j].T
    return T


#: Weight of the random part of a warm Lanczos start (:func:`power_iteration_eigs`).
WARM_NOISE = 0.1


class RowBounds:
    """Per-row distance bounds between passes (Hamerly): the nearest center ``lab``, an
    upper bound ``ub`` of the distance to it and a lower bound ``lb`` of the distance to
    every other center (Euclidean, not squared), valid for the centers ``C`` of the pass
    that made them. 24 bytes per row, never N x K."""

    def __init__(self, n):
        self.lab = np.full(n, -1, dtype=np.int64)
        self.ub = np.zeros(n)
        self.lb = np.zeros(n)
        self.C = None
        self.pruned = 0            # rows pruned by the last pass
        self.own_distances = 0     # own distances it computed for the prune test

    def reset(self):
        self.lab[:] = -1
        self.C = None


def pruned_moments(X, w, C, T, metric, resp, log_prior, hard_sums, bounds, block=None):
    """:func:`~fastanneal._moments.compute_moments` with ``bounds`` (:class:`RowBounds`,
    updated in place): rows provably one-hot at ``T`` cost one distance instead of K.
    Equal to the unpruned pass up to rounding: a pruned row contributes exactly what the
    full path gives a one-hot row (its other responsibilities are below the drop threshold
    ``exp(log_eps)`` there too), with its own distance computed directly instead of by the
    GEMM form; its margin terms are bounds (``min_margin`` a lower bound, ``margin_sum`` an
    upper bound, each pruned term below ``eps`` for a soft pass)."""
    from . import _config
    from ._moments import _METRIC_NAMES, _RESP_NAMES, Moments, blas_single_thread, log_eps_for
    C = np.ascontiguousarray(C, dtype=X.dtype)
    K, D = C.shape
    csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
    if bounds.C is None or bounds.C.shape != C.shape:
        bounds.reset()
        drift = np.zeros(K)
    else:
        drift = np.sqrt(((C.astype(np.float64) - bounds.C) ** 2).sum(axis=1))
    coff = (csq - 1.0) if metric == 1 else np.zeros(K)
    use_prior = log_prior is not None
    logp = (np.ascontiguousarray(log_prior, dtype=np.float64) if use_prior
            else np.zeros(K))
    log_eps = log_eps_for(X.dtype)
    T = float(T)
    if resp == 0:
        gap = (1e-9 - log_eps) * T * (1.0 + 1e-9)
    elif resp == 1:
        gap = 2.0 * T * (1.0 + 1e-9)
    else:
        gap = 0.0
    # rounding of a GEMM-form squared distance: (D + 4) units in the last place of the
    # largest squared norm involved, widened 4x
    eps = float(np.finfo(X.dtype).eps)
    xmax = 2.0 if metric == 1 else float(getattr(bounds, "xsq_max", 0.0))
    slack = 4.0 * (D + 4) * eps * (xmax + float(csq.max(initial=0.0)) + 1e-300)
    block = int(block or _config.CPU_BLOCK_ROWS)
    with blas_single_thread():
        N, S, sc, HN, HS, mn, pruned, owned = K_.pruned_moments_kernel(
            X, w, C, csq, coff, logp, use_prior, T, metric, resp, block, bool(hard_sums),
            log_eps, float(_config.SPARSE_FRACTION), K_.entmax_sort_max(resp),
            int(numba.get_num_threads()), gap, slack, bounds.lab, bounds.ub, bounds.lb,
            drift)
    bounds.C = C.astype(np.float64)
    bounds.pruned = int(pruned)
    bounds.own_distances = int(owned)
    return Moments(
        N=N, S=S, soft_distortion=sc[K_.S_SOFT_DIST], entropy=sc[K_.S_ENTROPY],
        free_energy=sc[K_.S_FREE], hard_distortion=sc[K_.S_HARD], hard_counts=HN,
        hard_sums=HS if hard_sums else None, weight=sc[K_.S_WEIGHT], rows=int(sc[K_.S_ROWS]),
        margin_sum=sc[K_.S_MARGIN], min_margin=float(mn), nnz=int(sc[K_.S_NNZ]),
        temperature=T, responsibilities=_RESP_NAMES[resp], metric=_METRIC_NAMES[metric])


class InMemorySource:
    """Rows held in one NumPy array (validated, C-contiguous, unit rows for cosine).

    Passes keep per-row distance bounds (:class:`RowBounds`) and skip the distances of rows
    that are provably one-hot (``_config.PRUNE``); :meth:`reset_bounds` forgets them (the
    engine calls it when it saves a checkpoint, so that a resumed fit takes exactly the
    same passes as an uninterrupted one)."""

    def __init__(self, X, w, metric):
        self.X = X
        # read-only weights (straight from Arrow) are another type to Numba: every kernel
        # would compile a second time on a first run for them (a copy of n floats)
        self.w = w if getattr(w, "flags", None) is None or w.flags.writeable else w.copy()
        self.metric = metric
        self.n_rows, self.n_features = X.shape
        self.dtype = X.dtype
        self.total_weight = float(w.sum())
        self._bounds = None

    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        from . import _config
        if _config.PRUNE and self.n_rows:
            if self._bounds is None:
                self._bounds = RowBounds(self.n_rows)
                if self.metric != 1:
                    self._bounds.xsq_max = float(np.einsum(
                        "ij,ij->i", self.X, self.X, dtype=np.float64).max())
            return pruned_moments(self.X, self.w, centers, T, self.metric, resp, log_prior,
                                  hard_sums, self._bounds)
        return compute_moments(self.X, self.w, centers, T, self.metric, resp, log_prior,
                               hard_sums)

    def reset_bounds(self):
        if self._bounds is not None:
            self._bounds.reset()

    def grad_forward(self, centers, T, resp):
        from .gradient import forward_moments
        return forward_moments(self.X, self.w, centers, T, self.metric, resp)

    def grad_moments(self, centers, T, resp, globals_):
        from .gradient import backward_moments
        return backward_moments(self.X, self.w, centers, T, self.metric, resp, globals_)

    def covariance(self, mean):
        # above LANCZOS_D features Lanczos on the rows is the cheaper exact route (no D x D
        # product: 10 vs 14 ms at 2,250 x 384, 41 vs 117 ms at 4,096 x 1,024)
        if self.n_features > LANCZOS_D:
            return None
        return exact_covariance(self.X, self.w, mean)

    def n_distinct_rows(self, rng, cap):
        return n_distinct_rows(self.X, self.w, rng, cap)

    def labels(self, centers):
        return self.assign(centers)[0]

    def objective(self, centers):
        """``(J, hard_counts)`` at ``centers``, each row's distance summed in float64."""
        from ._moments import nearest_objective_counts
        return nearest_objective_counts(self.X, self.w, centers, self.metric)[1:]

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
        return weighted_mean(self.X, self.w)

    def assign(self, centers):
        return assign(self.X, centers, self.metric, _prepared=True)

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False,
                                means=None, tol=None, start=None):
        centers = np.asarray(centers, dtype=np.float64)
        if centers.shape[0] == 1:
            labels = np.zeros(self.n_rows, dtype=np.int64)
        else:
            labels = self.assign(centers)[0]
        wk = np.bincount(labels, weights=self.w, minlength=centers.shape[0])
        nth = numba.get_num_threads()

        def matvec(mu, V):
            return K_.cluster_cov_matvec_kernel(self.X, self.w, labels, mu, V, nth)
        return power_iteration_eigs(matvec, _about(centers, means), wk, n_iter, rng,
                                    return_vectors, tol=tol, start=start)


def _about(centers, means):
    """The points the cluster covariances are taken about: ``means`` (K, D) when given
    (the cells are still those of ``centers``), else the centers."""
    if means is None:
        return centers
    means = np.asarray(means, dtype=np.float64)
    if means.shape != centers.shape:
        raise ValueError(f"means must have the centers' shape {centers.shape}; got "
                         f"{means.shape}")
    return np.ascontiguousarray(means)


#: Seed of the start vectors of the whole-data top eigenvalue (``critical_temperature_``):
#: its own generator, so computing T_c does not move the fit's random stream.
EIG_SEED = 0x7C
#: Largest D for which sources form the exact D x D covariance (else Lanczos).
COVARIANCE_MAX_D = 2048
#: Above this D an in-memory source leaves the critical temperature to Lanczos on its rows
#: (converged to 1e-9; cheaper than the D x D product there).
LANCZOS_D = 256


def exact_covariance(X, w, mean, block=16384):
    """``sum w (x - mean)(x - mean)^T / W`` (float64; None when ``D > COVARIANCE_MAX_D``)."""
    if X.shape[1] > COVARIANCE_MAX_D:
        return None
    return scatter_matrix(X, w, mean, block) / w.sum()


def scatter_matrix(X, w, mean, block=16384):
    """``sum w (x - mean)(x - mean)^T`` (D x D, float64) over row blocks: the centered
    float64 rows scaled by ``sqrt(w)`` (weights are validated non-negative), so that each
    block is one ``Z^T Z`` (NumPy runs it as a symmetric rank-k update, half the flops of
    a general GEMM). Additive over row sets."""
    D = X.shape[1]
    out = np.zeros((D, D))
    sw = np.sqrt(np.maximum(w, 0.0))
    mean = np.asarray(mean, dtype=np.float64)
    for b in range(0, X.shape[0], block):
        Z = X[b:b + block] - mean                      # float64 rows
        Z *= sw[b:b + block, None]
        out += Z.T @ Z
    return out


def top_eigenvalue(A):
    """Largest eigenvalue of the symmetric matrix ``A`` (float64): ``eigvalsh`` for small
    ``A``, else implicitly restarted Lanczos (ARPACK, converged to machine precision) from a
    fixed start vector -- a few matrix-vector products instead of the full ``O(D^3)``
    eigendecomposition (1 ms instead of 7 ms at D = 384)."""
    A = np.asarray(A, dtype=np.float64)
    D = A.shape[0]
    if D <= 64:
        return float(np.linalg.eigvalsh(A)[-1])
    from scipy.sparse.linalg import ArpackNoConvergence, eigsh
    v0 = np.random.default_rng(EIG_SEED).standard_normal(D)    # not the fit's stream
    try:
        return float(eigsh(A, k=1, which="LA", return_eigenvectors=False, tol=0.0,
                           v0=v0)[0])
    except ArpackNoConvergence:
        return float(np.linalg.eigvalsh(A)[-1])


def weighted_mean(X, w, block=16384):
    """``sum w x / W`` accumulated in float64 over row blocks (no float64 copy of ``X``)."""
    acc = np.zeros(X.shape[1])
    for b in range(0, X.shape[0], block):
        acc += w[b:b + block] @ X[b:b + block].astype(np.float64)
    return acc / w.sum()


def row_hashes(X, v, block=65536):
    """64-bit hashes of the rows of ``X`` that are equal exactly for equal rows (integer
    arithmetic on the bytes: no rounding, unlike a projection ``X @ v``, which BLAS may
    round differently for equal rows at different positions). ``v`` (float64, (D,), drawn
    at random) gives the odd multipliers; ``-0.0`` counts as ``0.0``."""
    if X.shape[0] > block:          # in row blocks: no copy of the whole of X
        return np.concatenate([row_hashes(X[b:b + block], v, block)
                               for b in range(0, X.shape[0], block)])
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


def n_distinct_rows(X, w, rng, cap=None):
    """Number of distinct rows with non-zero weight (exact 64-bit row hashes). With ``cap``
    the count may stop early: when the first ``4 cap`` rows of non-zero weight already hold
    ``cap`` distinct rows, their count (at least ``cap``) is returned without hashing the
    rest (one draw from ``rng`` either way)."""
    v = rng.standard_normal(X.shape[1])
    w = np.asarray(w)
    if cap is not None and X.shape[0] > 4 * int(cap):
        head = np.flatnonzero(w > 0)[:4 * int(cap)]
        nd = _n_distinct_exact(X[head])
        if nd >= int(cap):
            return nd
    return len(np.unique(row_hashes(X, v)[w > 0]))


def _n_distinct_exact(X):
    """Distinct rows of a small block, compared byte for byte (one sort of the rows as
    opaque records; ``-0.0`` counts as ``0.0``). The column-by-column hash of
    :func:`row_hashes` costs one NumPy call per 8 bytes of a row: 5 ms for 64 rows of 1,024
    float64 features, against ~0.1 ms here."""
    X = np.ascontiguousarray(X) + X.dtype.type(0)
    if X.shape[0] == 0:
        return 0
    rec = X.view(np.dtype((np.void, X.dtype.itemsize * X.shape[1]))).ravel()
    return int(np.unique(rec).shape[0])


def data_fingerprint(X, w, metric):
    """sha256 of the rows, the weights and the metric (checkpoint key of in-memory data)."""
    h = hashlib.sha256()
    h.update(f"{X.dtype}{X.shape}{metric}".encode())
    h.update(np.ascontiguousarray(X).data)
    h.update(np.ascontiguousarray(w, dtype=np.float64).data)
    return h.hexdigest()

"""Plain float64 NumPy reference for the core kernels (docs/theory.md sections 1-2, 4).

Deliberately independent of the package: nothing here imports ``fastanneal``, distances are
direct differences (not the GEMM form), softmax is computed in the log domain over *all*
entries (no truncation), and entmax-1.5 is the sort algorithm of docs/theory.md section 4.2 written
with vectorized NumPy (plus an independent bisection on tau for cross-checks).

Every function takes any float input, computes in float64 and returns float64.
"""
import math

import numpy as np


# ----------------------------------------------------------------------------- distances
def unit_rows(X):
    X = np.asarray(X, dtype=np.float64)
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def sqeuclidean(X, C):
    """``d_ik = ||x_i - c_k||^2`` from explicit differences."""
    X = np.asarray(X, dtype=np.float64)
    C = np.asarray(C, dtype=np.float64)
    diff = X[:, None, :] - C[None, :, :]
    return np.einsum("ikj,ikj->ik", diff, diff)


def cosine(X, C):
    """``d_ik = 2 - 2 cos(x_i, c_k)`` (the squared distance of the unit vectors)."""
    return 2.0 - 2.0 * (unit_rows(X) @ unit_rows(C).T)


def distances(X, C, metric="euclidean"):
    if metric in ("euclidean", "sqeuclidean"):
        return sqeuclidean(X, C)
    if metric == "cosine":
        return cosine(X, C)
    raise ValueError(metric)


# ----------------------------------------------------------------------------- softmax
def logsumexp(Z, axis=-1):
    Z = np.asarray(Z, dtype=np.float64)
    m = np.max(Z, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(Z - m), axis=axis, keepdims=True)) + m
    return np.squeeze(out, axis=axis)


def softmax_logits(d, T, log_prior=None):
    Z = -np.asarray(d, dtype=np.float64) / float(T)
    if log_prior is not None:
        Z = Z + np.asarray(log_prior, dtype=np.float64)[None, :]
    return Z


def softmax(d, T, log_prior=None):
    """Log-domain softmax responsibilities ``exp(z - LSE z)``, ``z = -d/T + log p``."""
    Z = softmax_logits(d, T, log_prior)
    return np.exp(Z - logsumexp(Z, axis=1)[:, None])


# ----------------------------------------------------------------------------- entmax-1.5
def entmax15_tau(Z):
    """Threshold tau (of the halved, max-shifted logits) per row by sorting (vectorized)."""
    Z = np.atleast_2d(np.asarray(Z, dtype=np.float64))
    n, K = Z.shape
    V = (Z - Z.max(axis=1, keepdims=True)) / 2.0
    Vs = -np.sort(-V, axis=1)                         # descending
    rho = np.arange(1, K + 1, dtype=np.float64)[None, :]
    with np.errstate(invalid="ignore"):               # -inf logits (zero prior mass): tau
        M = np.cumsum(Vs, axis=1) / rho               # is NaN there, never in the support
        Ssq = np.cumsum(Vs * Vs, axis=1) / rho
        S = rho * (Ssq - M * M)
        tau = M - np.sqrt(np.clip((1.0 - S) / rho, 0.0, None))
        support = np.sum(tau <= Vs, axis=1)           # rho* (>= 1 always)
    return V, tau[np.arange(n), support - 1]


def entmax15(Z):
    """``[z/2 - tau]_+^2`` per row (docs/theory.md section 4.2), exact up to rounding."""
    Z = np.asarray(Z, dtype=np.float64)
    one_d = Z.ndim == 1
    V, tau = entmax15_tau(np.atleast_2d(Z))
    P = np.clip(V - tau[:, None], 0.0, None) ** 2
    return P[0] if one_d else P


def entmax15_bisect(Z, iters=200):
    """Independent bisection on tau of ``sum [v - tau]_+^2 = 1`` (vectorized over rows),
    finished by the closed form on the support found. For cross-checks only."""
    Z = np.atleast_2d(np.asarray(Z, dtype=np.float64))
    V = (Z - Z.max(axis=1, keepdims=True)) / 2.0
    lo = np.full(V.shape[0], -1.0)
    hi = np.zeros(V.shape[0])
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        f = np.sum(np.clip(V - mid[:, None], 0.0, None) ** 2, axis=1)
        big = f >= 1.0
        lo = np.where(big, mid, lo)
        hi = np.where(big, hi, mid)
    sup = V > lo[:, None]
    rho = sup.sum(axis=1)
    s1 = np.where(sup, V, 0.0).sum(axis=1)
    s2 = np.where(sup, V * V, 0.0).sum(axis=1)
    Mm = s1 / rho
    tau = Mm - np.sqrt(np.clip(Mm * Mm - (s2 - 1.0) / rho, 0.0, None))
    return np.clip(V - tau[:, None], 0.0, None) ** 2


def tsallis15(P):
    """Tsallis-1.5 entropy ``(4/3)(1 - sum p^1.5)`` per row."""
    P = np.asarray(P, dtype=np.float64)
    return (4.0 / 3.0) * (1.0 - np.sum(P ** 1.5, axis=1))


def shannon(P):
    P = np.asarray(P, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(P > 0, P * np.log(np.where(P > 0, P, 1.0)), 0.0)
    return -np.sum(t, axis=1)


# ----------------------------------------------------------------------------- assignment
def hard_labels(d):
    return np.argmin(np.asarray(d, dtype=np.float64), axis=1)


def responsibilities(X, C, T, metric="euclidean", kind="softmax", log_prior=None):
    d = distances(X, C, metric)
    if kind == "softmax":
        return softmax(d, T, log_prior)
    if kind == "entmax15":
        return entmax15(softmax_logits(d, T, log_prior))
    if kind == "hard":
        R = np.zeros_like(d)
        R[np.arange(d.shape[0]), hard_labels(d)] = 1.0
        return R
    raise ValueError(kind)


# ----------------------------------------------------------------------------- moments
FIELDS = ("N", "S", "soft_distortion", "entropy", "free_energy", "hard_distortion",
          "hard_counts", "hard_sums", "weight", "rows", "margin_sum", "min_margin")


def moments(X, C, T, weights=None, metric="euclidean", responsibilities="softmax",
            log_prior=None):
    """Every field of the Moments record (except ``nnz``) as a dict of float64 values.

    For the cosine metric the rows are unit-normalized first, and ``S`` / ``hard_sums`` are
    sums of the unit rows (the data the cosine model lives on).
    """
    X = np.asarray(X, dtype=np.float64)
    C = np.asarray(C, dtype=np.float64)
    n = X.shape[0]
    K, D = C.shape
    if metric == "cosine":
        X = unit_rows(X) if n else X
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    d = distances(X, C, metric) if n else np.zeros((0, K))
    T = float(T)
    kind = responsibilities
    if n:
        lab = hard_labels(d)
        dmin = d[np.arange(n), lab]
        ds = np.sort(d, axis=1)
        marg = ds[:, 1] - ds[:, 0] if K > 1 else np.full(n, np.inf)
    else:
        lab = np.zeros(0, dtype=np.int64)
        dmin = np.zeros(0)
        marg = np.zeros(0)
    if kind == "softmax":
        Z = softmax_logits(d, T, log_prior)
        lse = logsumexp(Z, axis=1) if n else np.zeros(0)
        R = np.exp(Z - lse[:, None])
        H = shannon(R)
        F = -T * lse
    elif kind == "entmax15":
        R = entmax15(softmax_logits(d, T, log_prior)) if n else np.zeros((0, K))
        H = tsallis15(R)
        F = np.sum(R * d, axis=1) - T * H
    elif kind == "hard":
        R = np.zeros((n, K))
        R[np.arange(n), lab] = 1.0
        H = np.zeros(n)
        F = dmin
    else:
        raise ValueError(kind)
    WR = w[:, None] * R
    hard_counts = np.zeros(K)
    np.add.at(hard_counts, lab, w)
    hard_sums = np.zeros((K, D))
    np.add.at(hard_sums, lab, w[:, None] * X)
    if K > 1 and n:
        if T > 0:
            margin_sum = float(np.sum(w * np.exp(-marg / T)))
        else:
            margin_sum = float(np.sum(w * (marg == 0)))
        min_margin = float(np.min(marg))
    else:
        margin_sum = 0.0
        min_margin = math.inf
    return {
        "N": WR.sum(axis=0),
        "S": WR.T @ X,
        "soft_distortion": float(np.sum(WR * d)),
        "entropy": float(np.sum(w * H)),
        "free_energy": float(np.sum(w * F)),
        "hard_distortion": float(np.sum(w * dmin)),
        "hard_counts": hard_counts,
        "hard_sums": hard_sums,
        "weight": float(np.sum(w)),
        "rows": n,
        "margin_sum": margin_sum,
        "min_margin": min_margin,
    }

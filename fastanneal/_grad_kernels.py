"""Numba kernels of the separation objective and its exact gradient (docs/theory.md section 5).

Everything here is private; :func:`fastanneal.gradient.value_and_grad` validates input and
wraps these.

Layout (the same as :mod:`fastanneal._kernels`): one contiguous row range per thread (static,
so a fixed thread count gives bit-identical results run to run), walked in blocks of
``block`` rows; per-thread float64 accumulators reduced serially at the end. Every block is
copied to a float64 buffer first, so float32 input is computed and accumulated in float64;
only the rows of ``dL/dX`` are written back in the input dtype. No buffer larger than
``block x 3K`` per thread exists: never an ``N x K`` matrix.

Two passes:

1. :func:`grad_forward_kernel` -- soft counts ``N_k = sum w r_ik``, sums
   ``S_k = sum w r_ik x_i`` and ``sum w H_i``.
2. :func:`grad_backward_kernel` -- the same responsibilities again, then per row
   ``t_ik = r_ik dL/dr_ik``, ``g_ik = dL/dz_ik`` through the softmax / entmax-1.5 Jacobian,
   the rows of ``dL/dX`` and per-thread sums ``sum_i g_ik x_i``, ``sum_i g_ik`` for ``dL/dC``.

Both passes call the same row routine (:func:`_row_probs`: softmax without truncation of
small entries but those below ``2^-968``, or entmax-1.5 with the shared exact thresholds of :mod:`fastanneal._kernels`),
so the responsibilities of pass 2 are bit-identical to those behind ``N`` and ``S``.

The row ranges run on fastanneal's threads (``fastanneal/_pool.py``: serial kernels, range 0
in the calling thread); BLAS (``np.dot``) runs inside them: the caller pins it to one thread.
Unlike the moments passes, the number of row ranges here does not follow the thread count
(:func:`grad_ranges`): the gradient solver's Adam steps amplify a change in the last bit of
a sum about tenfold every ten steps, so a per-thread association of the sums made its fits
depend on the thread count (up to 10 % of the labels); with a fixed association the
gradient sums are bit-identical for any number of threads (a fit can still differ: its start
temperature and scale come from the moment passes, whose ranges follow the threads). The
price: at most ``GRAD_RANGES`` threads share a pass, fewer at very large ``K x D`` (the memory
cap of :func:`grad_ranges`; K = 5,000, D = 1,024: 3 on the backward pass).
"""
import math

import numba
import numpy as np
from numba import njit

from . import _pool
from ._kernels import (METRIC_COSINE, PAD, RESP_ENTMAX15, entmax15_support_probs,
                       pad_rows, row_ranges)

PHI_IDENTITY = 0
PHI_LOG = 1
PHI_HINGE = 2


@njit(cache=True, nogil=True)
def _load_block(X, b0, m, Xb, xsq):
    """Copy rows ``b0 .. b0+m`` of ``X`` into the float64 buffer ``Xb``; squared norms."""
    D = X.shape[1]
    for i in range(m):
        s = 0.0
        for j in range(D):
            v = np.float64(X[b0 + i, j])
            Xb[i, j] = v
            s += v * v
        xsq[i] = s


@njit(cache=True, nogil=True)
def _fill_distances(P, xsq, csq, metric, K, m, G):
    """``G[i, k] = d_ik`` from the dot products ``P[i, k] = x_i . c_k``.

    Euclidean: GEMM form clamped at 0 (the clamp only removes rounding). Cosine: exactly
    ``2 - 2 x.c`` for the vectors as given (no clamp: the objective is this bilinear form).
    """
    for i in range(m):
        for k in range(K):
            if metric == METRIC_COSINE:
                G[i, k] = 2.0 - 2.0 * P[i, k]
            else:
                d = xsq[i] + csq[k] - 2.0 * P[i, k]
                G[i, k] = d if d > 0.0 else 0.0


#: Softmax responsibilities below this (2^-968: 54 bits above the smallest normal float64)
#: are dropped by the gradient passes (see :func:`_row_probs`).
R_MIN = 2.0 ** -968


@njit(cache=True, nogil=True)
def _row_probs(G, i, T, resp, cand, cidx, sort_max):
    """Replace the distance row ``G[i]`` by the responsibilities ``r_i`` (unweighted) of the
    logits ``-G[i] / T``; return the row's entropy (Shannon for softmax, Tsallis-1.5 for
    entmax-1.5, as in :class:`fastanneal.Moments`).

    Softmax keeps every entry of at least ``R_MIN = 2^-968`` (the ordinary moments drop
    everything below ``2^-53`` of the row's largest): the loss is differentiated exactly,
    not the sparsified moments, but for entries so small that their sums would be
    subnormal (a few significant bits). Entmax-1.5 (docs/theory.md section 4.2):
    with ``z' = (z - max z) / 2`` only ``z' > -1`` can be in the support.
    """
    K = G.shape[1]
    zmax = -np.inf
    for k in range(K):
        z = -G[i, k] / T
        if z > zmax:
            zmax = z
    if sort_max is not None and resp == RESP_ENTMAX15:
        # (sort_max None: a softmax caller; Numba prunes this branch and the entmax
        # chain is not compiled, see _kernels.entmax_sort_max)
        n = np.int64(0)         # (not the literal 0: a second compile of the callee)
        for k in range(K):
            zp = 0.5 * (-G[i, k] / T - zmax)
            if zp > -1.0:
                cand[n] = zp
                cidx[n] = k
                n += 1
        psum = entmax15_support_probs(cand, n, sort_max)
        for k in range(K):
            G[i, k] = 0.0
        p15 = 0.0
        for j in range(n):
            p = cand[j] / psum
            G[i, cidx[j]] = p
            p15 += p * math.sqrt(p)
        return (4.0 / 3.0) * (1.0 - p15)
    s = 0.0
    sez = 0.0
    for k in range(K):
        z = -G[i, k] / T - zmax
        e = math.exp(z)
        s += e
        if e > 0.0:
            sez += e * z        # (z = -inf at extreme T: 0 * -inf would be NaN)
        G[i, k] = e
    for k in range(K):
        r = G[i, k] / s
        # a responsibility too small to sum with full precision is dropped (both passes
        # call this routine, so they see the same ones): a center that only such entries
        # reach had its soft centroid S_k / N_k from subnormal sums, a few bits of it,
        # and the separation gradient through it exploded (572 instead of ~0)
        G[i, k] = r if r >= R_MIN else 0.0
    return math.log(s) - sez / s


#: Row ranges of the gradient passes, whatever the number of threads (each range its own
#: partial sums, added in range order) ...
GRAD_RANGES = 16
#: ... fewer when their per-range sums would take more than this many bytes in all (one
#: range at least, whatever it takes; the ranges also bound the threads of a pass)
GRAD_ACC_BYTES = 1 << 28


def grad_ranges(n, block, rows_per_range, D):
    """Number of row ranges of a gradient pass over ``n`` rows: ``GRAD_RANGES`` (no more
    than there are blocks, at least one), fewer when ``rows_per_range`` accumulator rows of
    ``D`` float64 per range would exceed ``GRAD_ACC_BYTES``. A function of the data's shape
    only, never of the thread count."""
    cap = max(1, GRAD_ACC_BYTES // max(1, 8 * rows_per_range * D))
    return row_ranges(n, block, min(GRAD_RANGES, cap))


def grad_forward_kernel(X, w, Ct, csq, T, metric, resp, block, sort_max, nth):
    """Pass 1: ``(N, S, sum_i w_i H_i)`` of all rows of ``X``.

    ``Ct`` is the C-contiguous float64 ``C.T`` (D x K), ``csq`` the squared center norms;
    ``nth`` the number of threads.
    """
    n, D = X.shape
    K = Ct.shape[1]
    nch = grad_ranges(n, block, K + pad_rows(D), D)
    accN = np.zeros((nch, K + PAD))          # padded per range: see _kernels.PAD
    accS = np.zeros((nch, K + pad_rows(D), D))
    accH = np.zeros((nch, PAD))
    _pool.run_groups(_grad_forward_ranges, (X, w, Ct, csq, T, metric, resp, block, sort_max,
                                            accN, accS, accH), nch,
                     _pool.threads_for(nth, n * (K + D)))
    return accN[:, :K].sum(axis=0), accS[:, :K].sum(axis=0), float(accH[:, 0].sum())


@njit(cache=True, nogil=True)
def _grad_forward_ranges(X, w, Ct, csq, T, metric, resp, block, sort_max, accN, accS, accH,
                         t0, t1):
    """Row ranges ``t0:t1`` (of ``accN.shape[0]``) of :func:`grad_forward_kernel`."""
    n, D = X.shape
    K = Ct.shape[1]
    nch = accN.shape[0]
    Xb = np.empty((block, D))        # scratch of this call's ranges (one allocation)
    xsq = np.empty(block)
    P = np.empty((block, K))
    G = np.empty((block, K))
    Sb = np.empty((K, D))
    cand = np.empty(K)
    cidx = np.empty(K, np.int64)
    for t in range(t0, t1):
        r0 = t * n // nch
        r1 = (t + 1) * n // nch
        for b0 in range(r0, r1, block):
            m = min(b0 + block, r1) - b0
            _load_block(X, b0, m, Xb, xsq)
            np.dot(Xb[:m], Ct, P[:m])
            _fill_distances(P, xsq, csq, metric, K, m, G)
            for i in range(m):
                wi = w[b0 + i]
                accH[t, 0] += wi * _row_probs(G, i, T, resp, cand, cidx, sort_max)
                for k in range(K):
                    wr = wi * G[i, k]
                    G[i, k] = wr
                    accN[t, k] += wr
            np.dot(G[:m].T, Xb[:m], Sb)
            for k in range(K):
                for j in range(D):
                    accS[t, k, j] += Sb[k, j]


def grad_backward_kernel(X, w, B, Bt, csq, musq, gmu, N, invW, lam, T, metric, resp, block,
                         sort_max, nth, gX):
    """Pass 2: write ``dL/dX`` into ``gX`` (input dtype) and return
    ``(sum_i w_i sum_k r_ik ||x_i - mu_k||^2, A, a)``.

    ``B`` stacks ``[C; mu; dLsep/dmu]`` (3K x D, float64), ``Bt`` is its C-contiguous
    transpose; ``musq_k = ||mu_k||^2``, ``gmu_k = (dLsep/dmu_k) . mu_k``; ``N`` the soft
    counts of pass 1; ``invW = 1 / sum w``. ``A`` (2K x D) holds ``sum_i g_ik x_i`` for the
    full loss (rows ``:K``) and for ``L_sep`` alone (rows ``K:``); ``a`` (2K) the matching
    ``sum_i g_ik``, with ``g_ik = dL/dz_ik``.

    Per row, with ``rho_ik = w_i r_ik / N_k`` (at most 1, so no overflow for tiny ``N_k``)
    and ``e_ik = (dLsep/dmu_k) . (x_i - mu_k)``:
    ``t_ik = r_ik dL/dr_ik = w_i r_ik ||x_i - mu_k||^2 / W - lam rho_ik e_ik``;
    softmax ``g_ik = t_ik - r_ik sum_j t_ij``; entmax-1.5 (``s = sqrt(r)``)
    ``g_ik = t_ik / s_ik - s_ik (sum_j t_ij / s_ij) / sum_j s_ij``.
    ``dL/dx_i = 2 w_i/W (x_i - sum_k r_ik mu_k) - lam sum_k rho_ik dLsep/dmu_k
    + (2/T) sum_k g_ik c_k`` (Euclidean adds ``-(2/T) (sum_k g_ik) x_i``, zero up to rounding).
    """
    n, D = X.shape
    K2 = 2 * (B.shape[0] // 3)
    nch = grad_ranges(n, block, K2 + pad_rows(D), D)
    accA = np.zeros((nch, K2 + pad_rows(D), D))     # padded per range: see PAD
    acca = np.zeros((nch, K2 + PAD))
    accC = np.zeros((nch, PAD))
    _pool.run_groups(_grad_backward_ranges, (X, w, B, Bt, csq, musq, gmu, N, invW, lam, T,
                                             metric, resp, block, sort_max, gX, accA, acca,
                                             accC), nch,
                     _pool.threads_for(nth, n * (B.shape[0] + D)))
    return float(accC[:, 0].sum()), accA[:, :K2].sum(axis=0), acca[:, :K2].sum(axis=0)


@njit(cache=True, nogil=True)
def _grad_backward_ranges(X, w, B, Bt, csq, musq, gmu, N, invW, lam, T, metric, resp, block,
                          sort_max, gX, accA, acca, accC, t0, t1):
    """Row ranges ``t0:t1`` (of ``accA.shape[0]``) of :func:`grad_backward_kernel`."""
    n, D = X.shape
    K3 = B.shape[0]
    K = K3 // 3
    K2 = 2 * K
    nch = accA.shape[0]
    cosine = metric == METRIC_COSINE
    entmax = resp == RESP_ENTMAX15
    twoT = 2.0 / T
    want_gx = gX.shape[0] == n and n > 0    # a 0-row gX: sums only (the solver's pass)
    Xb = np.empty((block, D))        # scratch of this call's ranges (one allocation)
    xsq = np.empty(block)
    P = np.empty((block, K3))
    G = np.empty((block, K))
    Cf = np.empty((block, K3))
    GG = np.empty((block, K2))
    diag = np.empty(block)
    out = np.empty((block, D))
    Ab = np.empty((K2, D))
    ta = np.empty(K)
    tb = np.empty(K)
    cand = np.empty(K)
    cidx = np.empty(K, np.int64)
    for t in range(t0, t1):
        r0 = t * n // nch
        r1 = (t + 1) * n // nch
        for b0 in range(r0, r1, block):
            m = min(b0 + block, r1) - b0
            _load_block(X, b0, m, Xb, xsq)
            np.dot(Xb[:m], Bt, P[:m])
            _fill_distances(P, xsq, csq, metric, K, m, G)
            for i in range(m):
                wi = w[b0 + i]
                _row_probs(G, i, T, resp, cand, cidx, sort_max)
                sa = 0.0
                sb = 0.0
                for k in range(K):
                    r = G[i, k]
                    wr = wi * r
                    rho = wr / N[k] if wr > 0.0 and N[k] > 0.0 else 0.0
                    q = xsq[i] + musq[k] - 2.0 * P[i, K + k]
                    if q < 0.0:
                        q = 0.0
                    e = P[i, K2 + k] - gmu[k]
                    accC[t, 0] += wr * q
                    ta[k] = wr * q * invW - lam * rho * e
                    tb[k] = rho * e
                    sa += ta[k]
                    sb += tb[k]
                    Cf[i, K + k] = -2.0 * wr * invW
                    Cf[i, K2 + k] = -lam * rho
                if entmax:
                    ss = 0.0
                    sa = 0.0
                    sb = 0.0
                    for k in range(K):
                        r = G[i, k]
                        if r > 0.0:
                            s = math.sqrt(r)
                            ss += s
                            ta[k] /= s
                            tb[k] /= s
                            sa += ta[k]
                            sb += tb[k]
                        else:
                            ta[k] = 0.0
                            tb[k] = 0.0
                    sa /= ss
                    sb /= ss
                    for k in range(K):
                        r = G[i, k]
                        s = math.sqrt(r) if r > 0.0 else 0.0
                        GG[i, k] = ta[k] - s * sa
                        GG[i, K + k] = tb[k] - s * sb
                else:
                    for k in range(K):
                        r = G[i, k]
                        GG[i, k] = ta[k] - r * sa
                        GG[i, K + k] = tb[k] - r * sb
                gsum = 0.0
                for k in range(K):
                    g = GG[i, k]
                    gsum += g
                    Cf[i, k] = twoT * g
                dg = 2.0 * wi * invW
                if not cosine:
                    dg -= twoT * gsum
                diag[i] = dg
            if want_gx:
                np.dot(Cf[:m], B, out[:m])
                for i in range(m):
                    for j in range(D):
                        gX[b0 + i, j] = out[i, j] + diag[i] * Xb[i, j]
            np.dot(GG[:m].T, Xb[:m], Ab)
            for k in range(K2):
                for j in range(D):
                    accA[t, k, j] += Ab[k, j]
                s = 0.0
                for i in range(m):
                    s += GG[i, k]
                acca[t, k] += s


def separation_kernel(mu, active, phi, margin, eps):
    """``(sum_{k<l} phi(s_kl), dLsep/dmu)`` over pairs of active clusters, without the
    ``2/(K(K-1))`` factor, ``s_kl = ||mu_k - mu_l||^2`` from exact differences (no GEMM
    cancellation when centroids nearly coincide). ``phi``: identity ``s``, log
    ``log(s + eps)``, hinge ``-max(0, margin - s)`` (derivative 0 at ``s == margin``).
    Returns the derivative as ``sum_l phi'(s_kl) 2 (mu_k - mu_l)`` (K x D)."""
    K, D = mu.shape
    nch = max(1, min(K, _pool.threads_for(numba.get_num_threads(), K * K * D)))
    grad = np.zeros((K, D))
    part = np.zeros(K)
    _pool.run(_separation_ranges, (mu, active, phi, margin, eps, grad, part, nch), nch)
    return sum(part.tolist()), grad      # left to right, as the serial loop it replaces


@njit(cache=True, nogil=True)
def _separation_ranges(mu, active, phi, margin, eps, grad, part, nch, t0, t1):
    """Clusters ``t * K // nch`` to ``(t + 1) * K // nch`` for ``t`` in ``t0:t1`` (``nch``
    ranges in all; each writes its own rows of ``grad`` and entries of ``part``)."""
    K, D = mu.shape
    for t in range(t0, t1):
        for k in range(t * K // nch, (t + 1) * K // nch):
            if not active[k]:
                continue
            for l in range(K):
                if l != k and active[l]:
                    s = 0.0
                    for j in range(D):
                        v = mu[k, j] - mu[l, j]
                        s += v * v
                    if phi == PHI_LOG:
                        f = math.log(s + eps)
                        fp = 1.0 / (s + eps)
                    elif phi == PHI_HINGE:
                        if s < margin:
                            f = s - margin
                            fp = 1.0
                        else:
                            f = 0.0
                            fp = 0.0
                    else:
                        f = s
                        fp = 1.0
                    if l > k:
                        part[k] += f
                    if fp != 0.0:
                        for j in range(D):
                            grad[k, j] += 2.0 * fp * (mu[k, j] - mu[l, j])

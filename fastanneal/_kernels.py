"""Numba CPU kernels: distances, responsibilities and fused block moments.

Everything here is private; :mod:`fastanneal._moments` validates input and wraps these.

Design (see ``docs/benchmarking.md`` for why):

* Rows are split into one contiguous range per thread (static schedule, so a fixed thread
  count gives bit-identical results run to run). Each thread walks its range in blocks of
  ``block`` rows and owns private ``K x D`` float64 accumulators, reduced serially at the end.
  The kernels themselves are serial Numba functions over the ranges they are given; the
  Python drivers of the same names run the ranges on fastanneal's threads
  (``fastanneal/_pool.py``), or the whole pass in the calling thread when it is small.
* Per block, distances come from one single-threaded GEMM ``X_b C^T`` (GEMM form
  ``||x||^2 - 2 x.c + ||c||^2``, clamped at 0), responsibilities are computed row by row in
  the log domain and written over the distance buffer, and ``S_k += R_b^T X_b`` is a second
  GEMM when the block is dense, or a row-wise scatter of the non-zero entries when sparse.
  No buffer larger than ``block x K`` per thread ever exists.
* BLAS must run single-threaded inside the parallel region (the caller limits it): nested
  threading doubles the time on two cores.
"""
import math

import numba
import numpy as np
from numba import njit

from . import _config, _pool

METRIC_EUCLIDEAN = 0
METRIC_COSINE = 1

RESP_SOFTMAX = 0
RESP_ENTMAX15 = 1
RESP_HARD = 2

# Slots of the per-record scalar vector (all additive sums over rows, float64).
S_SOFT_DIST = 0   # sum_i w_i sum_k r_ik d_ik
S_ENTROPY = 1     # sum_i w_i H_i  (Shannon for softmax, Tsallis-1.5 for entmax15, 0 for hard)
S_FREE = 2        # sum_i w_i F_i  (softmax: -T LSE_i; entmax15: sum r d - T H_i; hard: d_min)
S_HARD = 3        # J = sum_i w_i min_k d_ik
S_WEIGHT = 4      # W = sum_i w_i
S_ROWS = 5        # number of rows
S_MARGIN = 6      # sum_i w_i exp(-Delta_i / T)
S_NNZ = 7         # number of non-zero responsibilities kept
N_SCALARS = 8

LOG_EPS32 = math.log(2.0 ** -24)
LOG_EPS64 = math.log(2.0 ** -53)
#: Padding (float64 entries: one 64-byte cache line) after each thread's row of a per-thread
#: accumulator, so that no two threads update the same cache line (an update per row of a
#: shared line bounced it between the cores: ~30 % of a small pruned pass).
PAD = 8


@njit(cache=True, nogil=True)
def pad_rows(D):
    """Rows of ``D`` float64 entries that make up one ``PAD`` (the padding of a per-thread
    ``(rows, D)`` accumulator)."""
    return (PAD + D - 1) // D


# ----------------------------------------------------------------------------- helpers
def row_ranges(n, block, nth):
    """:func:`n_row_ranges` for the Python drivers (no Numba call)."""
    return max(1, min((n + block - 1) // block, nth))


@njit(cache=True, nogil=True)
def n_row_ranges(n, block, nth):
    """Number of static row ranges of a parallel pass: one per thread, no more than there
    are row blocks, at least one (an empty input still gives its zero record)."""
    nch = (n + block - 1) // block
    if nch > nth:
        nch = nth
    if nch < 1:
        nch = 1
    return nch


@njit(cache=True, nogil=True)
def entmax15_support_probs(cand, n, sort_max):
    """Turn the halved, shifted logits ``cand[:n]`` (the entries that can be in the support)
    into unnormalised entmax-1.5 weights ``[z - tau]_+^2`` in place; returns their sum.
    ``tau`` by sorting for ``n <= sort_max``, else by bisection (docs/theory.md section 4.2)."""
    if n <= sort_max:
        tau = entmax15_tau_sort(cand, n)
    else:
        tau = entmax15_tau_bisect(cand, n)
    psum = 0.0
    for j in range(n):
        t = cand[j] - tau
        p = t * t if t > 0.0 else 0.0
        cand[j] = p
        psum += p
    return psum


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sqnorm(Xb, i):
    """``||Xb[i]||^2`` in float64; re-association lets the sum vectorise (a sequential
    float64 sum over D costs up to a third of the distance GEMM at D = 64)."""
    s = 0.0
    for j in range(Xb.shape[1]):
        v = np.float64(Xb[i, j])
        s += v * v
    return s


@njit(cache=True, nogil=True, inline="always")
def _block_distances(Xb, Ct, csq, metric, G):
    """Fill ``G[:m]`` with squared distances of the rows ``Xb`` to the centers.

    ``Ct`` is ``C.T``; ``csq`` the float64 squared norms of the centers.
    """
    m = Xb.shape[0]
    K = Ct.shape[1]
    D = Xb.shape[1]
    np.dot(Xb, Ct, G)
    for i in range(m):
        if metric == METRIC_COSINE:
            for k in range(K):
                d = 2.0 - 2.0 * np.float64(G[i, k])
                G[i, k] = d if d > 0.0 else 0.0
        else:
            xs = _sqnorm(Xb, i)
            for k in range(K):
                d = xs + csq[k] - 2.0 * np.float64(G[i, k])
                G[i, k] = d if d > 0.0 else 0.0


@njit(cache=True, nogil=True)
def _sorted_descending(v, n):
    """A copy of ``v[:n]`` in descending order (Shell sort, Ciura's gaps: a few lines that
    compile in a fraction of the ~2 s Numba's ``np.sort`` takes; the values, not the order
    of equal ones, are what the caller uses)."""
    s = v[:n].copy()
    for gap in (701, 301, 132, 57, 23, 10, 4, 1):
        for i in range(gap, n):
            x = s[i]
            j = i
            while j >= gap and s[j - gap] < x:
                s[j] = s[j - gap]
                j -= gap
            s[j] = x
    return s


@njit(cache=True, nogil=True)
def entmax15_tau_sort(v, n):
    """Exact entmax-1.5 threshold of the first ``n`` entries of ``v`` (already halved and
    shifted so that max = 0) by sorting (docs/theory.md section 4.2)."""
    s = _sorted_descending(v, n)
    cs = 0.0
    cs2 = 0.0
    count = 0
    tau_star = 0.0
    for r in range(n):
        cs += s[r]
        cs2 += s[r] * s[r]
        rho = r + 1.0
        M = cs / rho
        S = rho * (cs2 / rho - M * M)
        q = (1.0 - S) / rho
        tau = M - math.sqrt(q if q > 0.0 else 0.0)
        if tau <= s[r]:
            count += 1
            tau_star = tau
    return tau_star


@njit(cache=True, nogil=True)
def entmax15_tau_bisect(v, n):
    """Exact entmax-1.5 threshold by bisection on tau (no sort): bisect until the support is
    fixed inside the bracket, then solve the quadratic on that support in closed form."""
    lo = -1.0
    hi = -1.0 / math.sqrt(n) if n > 0 else 0.0
    if hi < lo:
        hi = lo
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        f = 0.0
        for j in range(n):
            t = v[j] - mid
            if t > 0.0:
                f += t * t
        if f >= 1.0:
            lo = mid
        else:
            hi = mid
        # support sizes at both ends of the bracket
        clo = 0
        chi = 0
        for j in range(n):
            if v[j] > lo:
                clo += 1
            if v[j] > hi:
                chi += 1
        if clo == chi or hi - lo < 1e-15:
            break
    # closed form on the support {v > lo}
    rho = 0.0
    s1 = 0.0
    s2 = 0.0
    for j in range(n):
        if v[j] > lo:
            rho += 1.0
            s1 += v[j]
            s2 += v[j] * v[j]
    M = s1 / rho
    q = M * M - (s2 - 1.0) / rho
    return M - math.sqrt(q if q > 0.0 else 0.0)


_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238        # fdlibm split of log(2)
_LN2_LO = 1.9082149292705877e-10
_MAGIC = 6755399441055744.0         # 2^52 + 2^51: adding it puts round(x) in the low bits
_MAGIC_BITS = 0x4338000000000000


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def _softmax_rows(G, rows, ns, zmaxs, wb, logp, use_prior, T, log_eps, Z, KF, P, PB, Nacc,
                  out):
    """Softmax of the soft rows ``rows[:ns]`` of the distance block ``G`` (logits
    ``log p_k - d_k / T - zmax <= 0``, ``zmax = zmaxs[q]``), written back as ``w * r_ik``
    (weights ``wb``) and added to the soft counts ``Nacc``; fills the row's soft distance,
    entropy, free energy and support size into ``out`` (columns ``R_*``; ``R_D1`` is read).

    ``exp`` is a branch-free Cody-Waite reduction with a Taylor polynomial, ``2^k``
    assembled through integer views of the scratch vectors (``Z`` logits, ``KF`` exponents,
    ``P`` mantissas, ``PB`` powers of two: four separate allocations of K float64 -- rows of
    one 2-D scratch array ran 1.3x slower, the loops no longer vectorised as well), so every
    loop vectorises (``np.exp`` does not inside Numba). The polynomial's degree follows the
    rows' precision (``log_eps``): 13 for float64 (relative error < 2e-15 on [-36, 0]), 7
    for float32 (< 1e-8, below float32's rounding 6e-8, in which the responsibilities are
    stored; 1.3x faster). ``e^0 = 1`` exactly at either degree, so every row's sum is >= 1
    and ``F <= J`` stays exact. Entries with ``z < log_eps`` are exact zeros. Only
    re-association flags are set: no ``nnan``/``ninf``.

    One call per block, not per row: every array a Numba function is handed costs an atomic
    reference-count increment and decrement per call, which at small K cost more than the
    row's arithmetic (~200 ns a row before this loop moved in here)."""
    K = G.shape[1]
    invT = 1.0 / T
    KFi = KF.view(np.int64)
    PBi = PB.view(np.int64)
    hi = log_eps < -20.0                # float64 rows (log 2^-53); float32: log 2^-24
    for q in range(ns):
        i = rows[q]
        zmax = zmaxs[q]
        for k in range(K):
            z = -np.float64(G[i, k]) * invT - zmax
            if use_prior:
                z += logp[k]
            Z[k] = z
            zc = z if z > -60.0 else -60.0
            kf = np.floor(zc * _LOG2E + 0.5)
            r = (zc - kf * _LN2_HI) - kf * _LN2_LO
            if hi:
                p = 1.0 / 6227020800.0
                p = p * r + 1.0 / 479001600.0
                p = p * r + 1.0 / 39916800.0
                p = p * r + 1.0 / 3628800.0
                p = p * r + 1.0 / 362880.0
                p = p * r + 1.0 / 40320.0
                p = p * r + 1.0 / 5040.0
            else:
                p = 1.0 / 5040.0
            p = p * r + 1.0 / 720.0
            p = p * r + 1.0 / 120.0
            p = p * r + 1.0 / 24.0
            p = p * r + 1.0 / 6.0
            p = p * r + 0.5
            p = p * r + 1.0
            p = p * r + 1.0
            P[k] = p
            KF[k] = kf + _MAGIC
        for k in range(K):
            PBi[k] = (KFi[k] - _MAGIC_BITS + 1023) << 52
        # PB (the bits just written, as float64) is 2^kf
        # the sums in a loop that only reads: a loop that also stores into a scratch vector
        # is vectorised behind a run-time check that the vectors lie apart, and falls back
        # to the sequential (differently rounded) sum when the heap placed them within 256
        # bytes of each other -- results then depended on where the allocator put them
        s = 0.0
        sed = 0.0
        sez = 0.0
        nnz = 0
        for k in range(K):
            z = Z[k]
            keep = z >= log_eps
            e = P[k] * PB[k] if keep else 0.0
            nnz += 1 if keep else 0
            s += e
            sed += e * np.float64(G[i, k])
            sez += e * z if keep else 0.0          # z may be -inf (log p_k = -inf)
        sc = wb[i] / s
        for k in range(K):
            # (e once more: storing it above is what brought the run-time check in)
            r = (P[k] * PB[k] if Z[k] >= log_eps else 0.0) * sc
            G[i, k] = r
            Nacc[k] += r
        d1 = out[i, R_D1]
        out[i, R_SOFT] = sed / s
        out[i, R_ENT] = math.log(s) - sez / s
        # without a prior -T * zmax is d1 exactly: keeps F <= J exact for K = 1
        out[i, R_FREE] = (d1 if not use_prior else -T * zmax) - T * math.log(s)
        out[i, R_NNZ] = nnz


@njit(cache=True, nogil=True, inline="always")
def _entmax_row(G, i, logp, use_prior, T, w, cand, cidx, sort_max, Nacc, zmax):
    """entmax-1.5 of the distance row ``G[i]``, written back as ``w * r_ik`` and added to
    ``Nacc``; returns ``(soft_dist, entropy, free, nnz)``. z' = (z - zmax) / 2; only
    z' > -1 can be in the support. ``n`` starts as np.int64(0), not 0: a literal start
    makes Numba compile the callee a second time for the argument type Literal[int](0)
    (seen in the compile log: ~4 s of a cold start)."""
    K = G.shape[1]
    nnz = 0
    n = np.int64(0)
    for k in range(K):
        z = -np.float64(G[i, k]) / T
        if use_prior:
            z += logp[k]
        zp = 0.5 * (z - zmax)
        if zp > -1.0:
            cand[n] = zp
            cidx[n] = k
            n += 1
    psum = entmax15_support_probs(cand, n, sort_max)
    soft = 0.0
    p15 = 0.0
    for j in range(n):
        p = cand[j] / psum
        cand[j] = p
        soft += p * np.float64(G[i, cidx[j]])
        p15 += p * math.sqrt(p)
    for k in range(K):
        G[i, k] = 0.0
    for j in range(n):
        if cand[j] > 0.0:
            G[i, cidx[j]] = w * cand[j]
            Nacc[cidx[j]] += w * cand[j]
            nnz += 1
    ent = (4.0 / 3.0) * (1.0 - p15)
    free = soft - T * ent
    return soft, ent, free, nnz


#: A block of a pruned pass gathers its unpruned rows into a copy only when at least this
#: fraction of its rows prunes; else every row of the block takes the full path (at the
#: soft temperatures of an annealing few rows prune, and the copy cost more than it saved).
PRUNE_MIN_BLOCK_FRACTION = 0.25

#: A soft block too dense for the float64 row-by-row sums (``sparse_fraction``) still sums
#: row by row, into block sums in the rows' dtype, when the rows are this wide and keep at
#: most this many entries each on average; else one GEMM (measured, one thread, 512 rows x
#: 384: K = 8 / 15 / 24 / 32 at 40 % density 70 / 124 / 194 / 317 us vs the GEMM's 191 /
#: 280 / 250 / 321; at small D the per-entry loop overhead loses to the GEMM).
ROW_SUMS_MIN_D = 64
ROW_SUMS_MAX_NNZ = 12

#: columns of the per-row results of :func:`_block_responsibilities`
R_SOFT, R_ENT, R_FREE, R_D1, R_D2, R_KMIN, R_NNZ = 0, 1, 2, 3, 4, 5, 6


@njit(cache=True, nogil=True, inline="always")
def _row_scratch(K, block):
    """Scratch of :func:`_block_responsibilities`, made once per row range:
    ``(cand, cidx, S, soft_rows, zmaxs, out)``, ``S`` the four K-vectors of
    :func:`_softmax_rows` (separate allocations: see there)."""
    S = (np.empty(K), np.empty(K), np.empty(K), np.empty(K))
    return (np.empty(K), np.empty(K, np.int64), S, np.empty(block, np.int64),
            np.empty(block), np.empty((block, 7)))


@njit(cache=True, nogil=True)
def _block_responsibilities(G, m, wb, logp, use_prior, T, resp, log_eps, sort_max, Nacc,
                            cand, cidx, S, soft_rows, zmaxs, out):
    """Turn the distance rows ``G[:m]`` into weighted responsibilities ``wb[r] * r_r`` in
    place, adding them to the soft counts ``Nacc``; ``out[r]`` gets the row's
    ``(soft_dist, entropy, free, d1, d2, kmin, nnz)`` (columns ``R_*``, unweighted) for the
    caller to accumulate in row order. Hard and one-hot rows are done here; the soft
    softmax rows are gathered and done in one call of :func:`_softmax_rows`."""
    K = G.shape[1]
    ns = np.int64(0)            # (not the literal 0: see _entmax_row's n)
    for r in range(m):
        w = wb[r]
        d1 = np.inf
        d2 = np.inf
        kmin = np.int64(0)          # (not the literal 0: see _entmax_row's n)
        zmax = -np.inf
        for k in range(K):
            d = np.float64(G[r, k])
            if d < d1:
                d2 = d1
                d1 = d
                kmin = k
            elif d < d2:
                d2 = d
            if resp != RESP_HARD and use_prior:
                z = logp[k] - d / T
                if z > zmax:
                    zmax = z
        if not use_prior and resp != RESP_HARD:
            zmax = -d1 / T
        out[r, R_D1] = d1
        out[r, R_D2] = d2
        out[r, R_KMIN] = kmin
        if resp == RESP_HARD or (resp == RESP_SOFTMAX and not use_prior and
                                 (d2 - d1) - 4e-16 * d2 > (1e-9 - log_eps) * T):
            # hard, or a softmax row whose every other logit is below log_eps (the drop
            # threshold) with room for the rounding of z: exactly one-hot, as the general
            # path would find after K exponentials. Common at low T; K = 1 lands here too.
            # (hard: the caller accumulates the single entry; G is left as is)
            if resp != RESP_HARD:
                for k in range(K):
                    G[r, k] = 0.0
                G[r, kmin] = w
            Nacc[kmin] += w
            out[r, R_SOFT] = d1
            out[r, R_ENT] = 0.0
            out[r, R_FREE] = d1
            out[r, R_NNZ] = 1
        elif resp == RESP_SOFTMAX:
            soft_rows[ns] = r
            zmaxs[ns] = zmax
            ns += 1
        elif sort_max is not None:
            # entmax-1.5: typed only where sort_max is an integer (entmax_sort_max), so a
            # softmax or hard pass never compiles the entmax chain (about 1 s cold)
            soft, ent, free, nnz = _entmax_row(G, r, logp, use_prior, T, w, cand, cidx,
                                               sort_max, Nacc, zmax)
            out[r, R_SOFT] = soft
            out[r, R_ENT] = ent
            out[r, R_FREE] = free
            out[r, R_NNZ] = nnz
    if ns > 0:
        _softmax_rows(G, soft_rows, ns, zmaxs, wb, logp, use_prior, T, log_eps, S[0], S[1],
                      S[2], S[3], Nacc, out)


def entmax_sort_max(resp):
    """The ``sort_max`` argument of the kernels for the rule ``resp``: the configured
    ``ENTMAX_SORT_MAX`` for entmax-1.5, else None (Numba prunes the entmax branch for a
    None argument: the kernels of softmax and hard passes do not contain it)."""
    return int(_config.ENTMAX_SORT_MAX) if resp == RESP_ENTMAX15 else None


#: how :func:`_accumulate_block` sums a soft block (:func:`soft_sums_path`)
SUMS_SPARSE, SUMS_ROWS, SUMS_GEMM = 0, 1, 2


@njit(cache=True, nogil=True)
def soft_sums_path(blk_nnz, m, K, D, sparse_fraction):
    """How a soft block of ``m`` rows with ``blk_nnz`` kept entries sums ``r_ik x_i``:
    row by row in float64 when sparse (``sparse_fraction``), row by row into block sums in
    the rows' dtype when the rows are wide and keep few entries each
    (``ROW_SUMS_MIN_D``, ``ROW_SUMS_MAX_NNZ``), else one GEMM."""
    if blk_nnz <= sparse_fraction * m * K:
        return SUMS_SPARSE
    if D >= ROW_SUMS_MIN_D and blk_nnz <= ROW_SUMS_MAX_NNZ * m:
        return SUMS_ROWS
    return SUMS_GEMM


@njit(cache=True, nogil=True)
def _accumulate_block(Xb, Gb, m, wb, rowres, T, resp, hard_sums, sparse_fraction, sc, HN, S, HS,
                      Sb, mn):
    """Add a block's rows to one range's accumulators, in row order: the scalars ``sc``
    (soft and hard distortion, entropy, free energy, weight, rows, kept entries, margin
    terms) from the per-row results ``rowres`` of :func:`_block_responsibilities`, the hard
    counts ``HN`` and sums ``HS``, and the soft sums ``S`` from the responsibilities in
    ``Gb`` (row by row where they are sparse, else one GEMM into ``Sb``). Returns the
    smallest margin, ``mn`` included."""
    K = Gb.shape[1]
    D = Xb.shape[1]
    # (not the literal 0: a call with a Literal[int] argument compiles the callee again)
    blk_nnz = np.int64(0)
    for r in range(m):
        wi = wb[r]
        d1 = rowres[r, R_D1]
        d2 = rowres[r, R_D2]
        kmin = np.int64(rowres[r, R_KMIN])
        blk_nnz += np.int64(rowres[r, R_NNZ])
        sc[S_SOFT_DIST] += wi * rowres[r, R_SOFT]
        sc[S_ENTROPY] += wi * rowres[r, R_ENT]
        sc[S_FREE] += wi * rowres[r, R_FREE]
        sc[S_HARD] += wi * d1
        sc[S_WEIGHT] += wi
        sc[S_ROWS] += 1.0
        if K > 1 and wi > 0.0:
            marg = d2 - d1
            if marg < mn:
                mn = marg
            if T > 0.0:
                sc[S_MARGIN] += wi * math.exp(-marg / T)
        HN[kmin] += wi
        if hard_sums:
            for j in range(D):
                HS[kmin, j] += wi * np.float64(Xb[r, j])
        if resp == RESP_HARD and not hard_sums:
            # (with hard sums the soft sums are the same numbers: copied at the end)
            for j in range(D):
                S[kmin, j] += wi * np.float64(Xb[r, j])
    sc[S_NNZ] += blk_nnz
    if resp == RESP_HARD:
        return mn
    path = soft_sums_path(blk_nnz, m, K, D, sparse_fraction)
    if path == SUMS_SPARSE:
        for r in range(m):
            for k in range(K):
                v = np.float64(Gb[r, k])
                if v != 0.0:
                    for j in range(D):
                        S[k, j] += v * np.float64(Xb[r, j])
        return mn
    if path == SUMS_ROWS:
        # few kept entries per row at large D (small K): row by row into the block's sums
        # in the rows' dtype, like the GEMM, which at K < ~24 runs at a fraction of its
        # speed (K = 15, D = 384, 512 rows: 280 us vs 120-220 us at 40-90 % density)
        for k in range(K):
            for j in range(D):
                Sb[k, j] = 0.0
        for r in range(m):
            for k in range(K):
                v = Gb[r, k]
                if v != 0.0:
                    for j in range(D):
                        Sb[k, j] += v * Xb[r, j]
    else:
        np.dot(Gb.T, Xb, Sb)
    for k in range(K):
        for j in range(D):
            S[k, j] += Sb[k, j]
    return mn



# ----------------------------------------------------------------------------- kernels
def _range_accumulators(nch, K, D, HK):
    """Zeroed per-thread accumulators of a moments pass (``nch`` row ranges; ``HK`` rows of
    hard sums): ``(N, S, hard N, hard S, scalars, min margin)``, each thread's row padded by
    a cache line (see ``PAD``); :func:`_reduce_ranges` reads the unpadded part. (Plain
    NumPy, as :func:`_reduce_ranges`: a few microseconds per pass, and two Numba functions
    fewer to compile on a first run: 0.7 s.)"""
    pk = (PAD + D - 1) // D                     # pad_rows(D)
    return (np.zeros((nch, K + PAD)), np.zeros((nch, K + pk, D)), np.zeros((nch, K + PAD)),
            np.zeros((nch, HK + pk, D)), np.zeros((nch, N_SCALARS + PAD)),
            np.full((nch, PAD), np.inf))


def _reduce_ranges(accN, accS, accHN, accHS, accSc, accMin, resp, hard_sums):
    """Sum the per-thread accumulators in range order (bit-identical run to run: NumPy adds
    the rows of an axis-0 reduction one after the other): ``(N, S, scalars, hard_counts,
    hard_S, min_margin)``. One range: views of its row, no copy."""
    K = accN.shape[1] - PAD
    HK = K if hard_sums else 0
    if accN.shape[0] == 1:
        N, S, HN, HS = accN[0, :K], accS[0, :K], accHN[0, :K], accHS[0, :HK]
        sc, mn = accSc[0, :N_SCALARS], float(accMin[0, 0])
    else:
        N, S = accN[:, :K].sum(axis=0), accS[:, :K].sum(axis=0)
        HN, HS = accHN[:, :K].sum(axis=0), accHS[:, :HK].sum(axis=0)
        sc, mn = accSc[:, :N_SCALARS].sum(axis=0), float(accMin[:, 0].min())
    if resp == RESP_HARD and hard_sums:
        S = HS.copy()           # (with hard sums the soft sums are these numbers)
    return N, S, sc, HN, HS, mn


def moments_kernel(X, w, C, csq, logp, use_prior, T, metric, resp, block, hard_sums,
                   log_eps, sparse_fraction, sort_max, nth):
    """Fused moments of all rows of ``X``.

    Returns ``(N, S, scalars, hard_counts, hard_S, min_margin)``; ``hard_S`` is ``(0, D)``
    when ``hard_sums`` is False. ``nth`` is the number of threads (``_pool.threads_for``
    decides whether the pass is worth more than the calling thread).
    """
    n, D = X.shape
    K = C.shape[0]
    nch = row_ranges(n, block, _pool.threads_for(nth, n * (K + D)))
    args = (X, w, C, csq, logp, use_prior, T, metric, resp, block, hard_sums, log_eps,
            sparse_fraction, sort_max)
    accs = _range_accumulators(nch, K, D, K if hard_sums else 0)
    # (one range: the same kernel in this thread; no serial wrapper, whose compile would
    # optimise the whole pass a second time: about 1.5 s of a cold first call)
    _pool.run(_moments_ranges, args + accs, nch)
    return _reduce_ranges(*accs, resp, hard_sums)


@njit(cache=True, nogil=True)
def _moments_ranges(X, w, C, csq, logp, use_prior, T, metric, resp, block, hard_sums,
                    log_eps, sparse_fraction, sort_max, accN, accS, accHN, accHS, accSc,
                    accMin, t0, t1):
    """Row ranges ``t0:t1`` (of ``accMin.shape[0]``) of :func:`moments_kernel`, each into
    its own row of the per-range accumulators."""
    n, D = X.shape
    K = C.shape[0]
    nch = accMin.shape[0]
    Ct = C.T
    G = np.empty((block, K), X.dtype)
    Sb = np.empty((K, D), X.dtype)
    cand, cidx, S, soft_rows, zmaxs, rowres = _row_scratch(K, block)
    for t in range(t0, t1):
        r0 = t * n // nch
        r1 = (t + 1) * n // nch
        for b0 in range(r0, r1, block):
            b1 = min(b0 + block, r1)
            m = b1 - b0
            Xb = X[b0:b1]
            Gb = G[:m]
            _block_distances(Xb, Ct, csq, metric, Gb)
            _block_responsibilities(Gb, m, w[b0:b1], logp, use_prior, T, resp, log_eps,
                                    sort_max, accN[t], cand, cidx, S, soft_rows, zmaxs,
                                    rowres)
            accMin[t, 0] = _accumulate_block(Xb, Gb, m, w[b0:b1], rowres, T, resp, hard_sums,
                                             sparse_fraction, accSc[t], accHN[t], accS[t],
                                             accHS[t], Sb, accMin[t, 0])


@njit(cache=True, nogil=True)
def _responsibilities_rows(X, C, csq, logp, use_prior, T, metric, resp, block, log_eps,
                            sort_max, out):
    """Write the (unweighted) responsibilities of every row into ``out`` (n x K)."""
    n = X.shape[0]
    K = C.shape[0]
    nb = (n + block - 1) // block
    Ct = C.T
    dummy = np.zeros(K)
    ones = np.ones(block)
    cand, cidx, S, soft_rows, zmaxs, rowres = _row_scratch(K, block)
    for b in range(nb):
        b0 = b * block
        b1 = min(b0 + block, n)
        Gb = out[b0:b1]
        _block_distances(X[b0:b1], Ct, csq, metric, Gb)
        _block_responsibilities(Gb, b1 - b0, ones, logp, use_prior, T, resp, log_eps,
                                sort_max, dummy, cand, cidx, S, soft_rows, zmaxs, rowres)
        if resp == RESP_HARD:
            for i in range(b1 - b0):
                for k in range(K):
                    Gb[i, k] = 0.0
                Gb[i, np.int64(rowres[i, R_KMIN])] = 1.0


@njit(cache=True, nogil=True)
def _distances_rows(X, C, csq, metric, block, out):
    """Squared distances of every row to every center into ``out`` (n x K)."""
    n = X.shape[0]
    nb = (n + block - 1) // block
    Ct = C.T
    for b in range(nb):
        b0 = b * block
        b1 = min(b0 + block, n)
        _block_distances(X[b0:b1], Ct, csq, metric, out[b0:b1])


@njit(cache=True, nogil=True, inline="always")
def _two_nearest(G, i):
    """``(d_1, d_2, k_1, k_2)``: the two smallest entries of the distance row ``G[i]`` and
    their columns (``k_2 = -1``, ``d_2 = inf`` for one column)."""
    d1 = np.inf
    d2 = np.inf
    kmin = -1
    k2 = -1
    for k in range(G.shape[1]):
        d = np.float64(G[i, k])
        if d < d1:
            d2 = d1
            k2 = kmin
            d1 = d
            kmin = k
        elif d < d2:
            d2 = d
            k2 = k
    return d1, d2, kmin, k2


@njit(cache=True, nogil=True)
def _assign_rows(X, C, csq, metric, block, labels, dmin, margin, second):
    """Nearest center, its squared distance, the second-best margin and the second-nearest
    center (-1 for K = 1) of every row."""
    n = X.shape[0]
    K = C.shape[0]
    nb = (n + block - 1) // block
    Ct = C.T
    for b in range(nb):
        b0 = b * block
        b1 = min(b0 + block, n)
        m = b1 - b0
        G = np.empty((m, K), X.dtype)
        _block_distances(X[b0:b1], Ct, csq, metric, G)
        for i in range(m):
            d1, d2, kmin, k2 = _two_nearest(G, i)
            labels[b0 + i] = max(kmin, 0)
            dmin[b0 + i] = d1
            margin[b0 + i] = d2 - d1
            second[b0 + i] = k2


@njit(cache=True, nogil=True)
def _label_rows(X, C, csq, metric, block, logp, invT, labels, dmin, margin, second, prob):
    """:func:`assign_kernel` and, from the same distances, the probability of the nearest
    center under ``softmax_k(logp_k - d_k * invT)`` (the labelling pass: one GEMM per block
    instead of one for the labels and one for the probabilities). Terms more than 40 below
    the largest logit are skipped (each below ``e^-40`` of the largest: the probability is
    exact to that relative error)."""
    n = X.shape[0]
    K = C.shape[0]
    nb = (n + block - 1) // block
    Ct = C.T
    for b in range(nb):
        b0 = b * block
        b1 = min(b0 + block, n)
        m = b1 - b0
        G = np.empty((m, K), X.dtype)
        _block_distances(X[b0:b1], Ct, csq, metric, G)
        for i in range(m):
            d1, d2, kmin, k2 = _two_nearest(G, i)
            zmax = -np.inf
            for k in range(K):
                z = logp[k] - np.float64(G[i, k]) * invT
                if z > zmax:
                    zmax = z
            a = max(kmin, 0)
            s = 0.0
            for k in range(K):
                z = logp[k] - np.float64(G[i, k]) * invT - zmax
                if z > -40.0:
                    s += math.exp(z)
            za = logp[a] - d1 * invT - zmax
            labels[b0 + i] = a
            dmin[b0 + i] = d1
            margin[b0 + i] = d2 - d1
            second[b0 + i] = k2
            prob[b0 + i] = math.exp(za) / s if s > 0.0 else 1.0


@njit(cache=True, nogil=True)
def entmax15_rows(Z, method_bisect, out):
    """entmax-1.5 of every row of the float64 matrix ``Z`` (serial; for tests and small K)."""
    n, K = Z.shape
    v = np.empty(K)
    idx = np.empty(K, np.int64)
    for i in range(n):
        zmax = -np.inf
        for k in range(K):
            if Z[i, k] > zmax:
                zmax = Z[i, k]
        m = 0
        for k in range(K):
            zp = 0.5 * (Z[i, k] - zmax)
            if zp > -1.0:
                v[m] = zp
                idx[m] = k
                m += 1
        if method_bisect:
            tau = entmax15_tau_bisect(v, m)
        else:
            tau = entmax15_tau_sort(v, m)
        for k in range(K):
            out[i, k] = 0.0
        for j in range(m):
            t = v[j] - tau
            if t > 0.0:
                out[i, idx[j]] = t * t


def cluster_cov_matvec_kernel(X, w, labels, mu, V, nth):
    """``out_k = sum_{i: labels_i = k} w_i (x_i - mu_k) ((x_i - mu_k) . v_k)`` (K x D, float64).

    One power-iteration step for the top eigenvector of every cluster's (unnormalised)
    covariance at once; with all labels 0 and ``mu`` the mean, of the whole data.
    """
    n, D = X.shape
    K = mu.shape[0]
    nch = max(1, min(_pool.threads_for(nth, n * D, light=True), n))
    acc = np.zeros((nch, K + pad_rows(D), D))               # padded: see PAD
    _pool.run(_matvec_ranges, (X, w, labels, mu, V, acc), nch)
    return acc[0, :K].copy() if nch == 1 else acc[:, :K].sum(axis=0)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _matvec_ranges(X, w, labels, mu, V, acc, t0, t1):
    """Row ranges ``t0:t1`` (of ``acc.shape[0]``) of :func:`cluster_cov_matvec_kernel`.
    Re-association lets the dot product vectorise (a sequential float64 sum made this
    memory-light pass latency-bound: 2-3x slower); no ``nnan``/``ninf``."""
    n, D = X.shape
    nch = acc.shape[0]
    for t in range(t0, t1):
        r0 = t * n // nch
        r1 = (t + 1) * n // nch
        for i in range(r0, r1):
            k = labels[i]
            s = 0.0
            # (a loop that only reads: storing x - mu into a scratch vector here made the
            # vectorised sum depend on a run-time check of where the heap put that vector,
            # with a sequential fallback rounded differently: the auto start temperature
            # changed in its last bit in about one process in ten)
            for j in range(D):
                s += (np.float64(X[i, j]) - mu[k, j]) * V[k, j]
            s *= w[i]
            for j in range(D):
                acc[t, k, j] += s * (np.float64(X[i, j]) - mu[k, j])


def row_sqnorms_kernel(X, out, nth):
    """Squared norms of the rows of ``X`` in float64 into ``out`` (n,): one light pass,
    the input checks of :func:`fastanneal.moments` (a NaN or inf makes its row's entry
    non-finite; the largest entry bounds every squared distance)."""
    n = X.shape[0]
    nch = max(1, min(_pool.threads_for(nth, n * X.shape[1], light=True), n))
    _pool.run(_sqnorm_ranges, (X, out, nch), nch)


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _sqnorm_ranges(X, out, nch, t0, t1):
    """Row ranges ``t0:t1`` (of ``nch``) of :func:`row_sqnorms_kernel` (:func:`_sqnorm` per
    row: re-association only, no ``nnan``/``ninf``: a NaN or inf must reach ``out``)."""
    n = X.shape[0]
    for t in range(t0, t1):
        for i in range(t * n // nch, (t + 1) * n // nch):
            out[i] = _sqnorm(X, i)


def kpp_candidates_kernel(X, xsq, Cc, csq, w, closest, out, block, nth):
    """One greedy k-means++ step, fused: for each candidate center (row ``j`` of ``Cc``,
    C-contiguous in the dtype of ``X``) write ``out[j, i] = min(closest[i], ||x_i -
    c_j||^2)`` and return the potentials ``sum_i w_i out[j, i]`` (float64). Per row block one
    small GEMM and one epilogue, instead of a float64 copy of ``X`` and five full-length
    temporaries per step. ``closest`` may hold ``inf`` (first step)."""
    n, D = X.shape
    m = Cc.shape[0]
    nch = row_ranges(n, block, _pool.threads_for(nth, n * (m + D), light=True))
    acc = np.zeros((nch, m + PAD))                          # padded: see PAD
    _pool.run(_kpp_ranges, (X, xsq, Cc, csq, w, closest, out, block, acc), nch)
    return acc[0, :m].copy() if nch == 1 else acc[:, :m].sum(axis=0)


@njit(cache=True, nogil=True)
def _kpp_ranges(X, xsq, Cc, csq, w, closest, out, block, acc, t0, t1):
    """Row ranges ``t0:t1`` (of ``acc.shape[0]``) of :func:`kpp_candidates_kernel`. (The
    candidates' transpose is taken here: a layout-F operand, as in the other kernels' GEMM,
    shares their compiled ``np.dot``; from Python a single candidate's would be typed C.)"""
    n = X.shape[0]
    m = Cc.shape[0]
    CcT = Cc.T
    nch = acc.shape[0]
    G = np.empty((block, m), X.dtype)
    for t in range(t0, t1):
        r0 = t * n // nch
        r1 = (t + 1) * n // nch
        for b0 in range(r0, r1, block):
            b1 = min(b0 + block, r1)
            Gb = G[:b1 - b0]
            np.dot(X[b0:b1], CcT, Gb)
            for ii in range(b1 - b0):
                i = b0 + ii
                ci = closest[i]
                wi = w[i]
                for j in range(m):
                    d = xsq[i] - 2.0 * np.float64(Gb[ii, j]) + csq[j]
                    d = d if d > 0.0 else 0.0
                    v = d if d < ci else ci
                    out[j, i] = v
                    acc[t, j] += wi * v


# ----------------------------------------------------------------------------- row drivers
# Same signatures as the serial kernels above; the rows are split over the threads when the
# pass is worth it (``_pool.threads_for``), each range writing its own rows of the outputs.
def _row_split(X, K, block):
    n = X.shape[0]
    return n, row_ranges(n, block, _pool.threads_for(_threads(), n * (K + X.shape[1])))


def _threads():
    return numba.get_num_threads()


def responsibilities_kernel(X, C, csq, logp, use_prior, T, metric, resp, block, log_eps,
                            sort_max, out):
    """Write the (unweighted) responsibilities of every row into ``out`` (n x K)."""
    n, nch = _row_split(X, C.shape[0], block)
    _pool.run_rows(_responsibilities_rows, n, nch, lambda a, b: (
        X[a:b], C, csq, logp, use_prior, T, metric, resp, block, log_eps, sort_max, out[a:b]))


def distances_kernel(X, C, csq, metric, block, out):
    """Squared distances of every row to every center into ``out`` (n x K)."""
    n, nch = _row_split(X, C.shape[0], block)
    _pool.run_rows(_distances_rows, n, nch,
                   lambda a, b: (X[a:b], C, csq, metric, block, out[a:b]))


def assign_kernel(X, C, csq, metric, block, labels, dmin, margin, second):
    """Nearest center, its squared distance, the second-best margin and the second-nearest
    center (-1 for K = 1) of every row."""
    n, nch = _row_split(X, C.shape[0], block)
    _pool.run_rows(_assign_rows, n, nch, lambda a, b: (
        X[a:b], C, csq, metric, block, labels[a:b], dmin[a:b], margin[a:b], second[a:b]))


def labelled_distances_kernel(X, C, labels, second, metric, out):
    """``out[i]``: the squared distance of row ``i`` to the nearer of its centers
    ``labels[i]`` and ``second[i]`` (the two nearest of the labelling pass; ``second[i] <
    0``: none), each summed element by element in float64 (Euclidean ``sum_j (x_j -
    c_j)^2``; cosine ``2 - 2 cos(x, c)`` from float64 sums, clipped at 0) -- without the
    cancellation of the GEMM form ``|x|^2 + |c|^2 - 2 x.c``, whose float32 rounding (~1e-7
    |x|^2) a row sitting on its own center keeps as its distance, and a heavy weight
    multiplies (and which can also swap two near-tied centers). For the objective a user
    reads (``inertia_``, ``score``)."""
    n = X.shape[0]
    nch = _pool.threads_for(_threads(), n * X.shape[1], light=True)
    _pool.run_rows(_labelled_distance_rows, n, max(1, min(nch, n)), lambda a, b: (
        X[a:b], C, labels[a:b], second[a:b], metric, out[a:b]))


@njit(cache=True, nogil=True, inline="always")
def _row_center_distance(X, i, C, a, metric):
    D = X.shape[1]
    if metric == METRIC_COSINE:
        s = 0.0
        nx = 0.0
        nc = 0.0
        for j in range(D):
            x = np.float64(X[i, j])
            c = np.float64(C[a, j])
            s += x * c
            nx += x * x
            nc += c * c
        d = 2.0 - 2.0 * s / math.sqrt(nx * nc) if nx > 0.0 and nc > 0.0 else 2.0
    else:
        d = 0.0
        for j in range(D):
            t = np.float64(X[i, j]) - np.float64(C[a, j])
            d += t * t
    return d if d > 0.0 else 0.0


@njit(cache=True, nogil=True)
def _labelled_distance_rows(X, C, labels, second, metric, out):
    for i in range(X.shape[0]):
        d = _row_center_distance(X, i, C, labels[i], metric)
        b = second[i]
        if b >= 0:
            d2 = _row_center_distance(X, i, C, b, metric)
            if d2 < d:
                d = d2
        out[i] = d


def label_kernel(X, C, csq, metric, block, logp, invT, labels, dmin, margin, second, prob):
    """:func:`_label_rows` (the labelling pass) over every row."""
    n, nch = _row_split(X, C.shape[0], block)
    _pool.run_rows(_label_rows, n, nch, lambda a, b: (
        X[a:b], C, csq, metric, block, logp, invT, labels[a:b], dmin[a:b], margin[a:b],
        second[a:b], prob[a:b]))


# ----------------------------------------------------------------------------- pruning
#: At most this many far-moved centers get exact distances in a pruned pass.
MAX_MOVERS = 8


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _pair_distances(X, C, rows, cols, n, metric, out):
    """``out[q]``: the kernel's squared distance of row ``rows[q]`` of ``X`` to center
    ``cols[q]`` (cosine: ``2 - 2 x.c``, clipped at 0), ``q < n``, in float64. One call per
    block of pairs with re-association, so that the sums vectorise: the per-row scalar sum
    (four interleaved partial sums, inlined) cost 2.3x as much at D = 384 and made a pass
    of pruned rows as slow as an unpruned one at K = 15; a call per row would cost more
    than the sum at small D."""
    D = X.shape[1]
    for q in range(n):
        i = rows[q]
        a = cols[q]
        s = 0.0
        if metric == METRIC_COSINE:
            for j in range(D):
                s += np.float64(X[i, j]) * np.float64(C[a, j])
            s = 2.0 - 2.0 * s
        else:
            for j in range(D):
                t = np.float64(X[i, j]) - np.float64(C[a, j])
                s += t * t
        out[q] = s if s > 0.0 else 0.0


def pruned_moments_kernel(X, w, C, csq, coff, logp, use_prior, T, metric, resp, block,
                          hard_sums, log_eps, sparse_fraction, sort_max, nth, gap, slack, lab,
                          ub, lb, drift):
    """:func:`moments_kernel` with per-row bounds (``lab``, ``ub``, ``lb``, updated in
    place; ``drift[k]``: how far center ``k`` moved since the bounds were made). Same
    return values plus the number of rows pruned and of own distances computed for the
    prune test (rows that cannot prune even with a lower bound of it skip it)."""
    n, D = X.shape
    K = C.shape[0]
    nch = row_ranges(n, block, _pool.threads_for(nth, n * (K + D)))
    accs = _range_accumulators(nch, K, D, K if hard_sums else 0)
    accP = np.zeros((nch, 2), np.int64)
    _pool.run(_pruned_ranges, (X, w, C, csq, coff, logp, use_prior, T, metric, resp, block,
                               hard_sums, log_eps, sparse_fraction, sort_max, gap, slack, lab,
                               ub, lb, drift) + accs + (accP,), nch)
    N, S, sc, HN, HS, mn = _reduce_ranges(*accs, resp, hard_sums)
    return N, S, sc, HN, HS, mn, int(accP[:, 0].sum()), int(accP[:, 1].sum())


@njit(cache=True, nogil=True)
def _pruned_ranges(X, w, C, csq, coff, logp, use_prior, T, metric, resp, block, hard_sums,
                   log_eps, sparse_fraction, sort_max, gap, slack, lab, ub, lb, drift, accN_r,
                   accS_r, accHN_r, accHS_r, accSc_r, accMin, accP, t0, t1):
    """Row ranges ``t0:t1`` (of ``accMin.shape[0]``) of :func:`pruned_moments_kernel`,
    each into its own row of the per-range accumulators (``accP[t]``: rows pruned, own
    distances computed). Moments with per-row distance bounds (Hamerly): a row whose every
    other center is provably beyond the drop threshold contributes one-hot, at the cost of
    one distance to its own center; the other rows are gathered into blocks and take the
    full path (GEMM distances, log-domain responsibilities), which also refreshes their
    bounds. A block where fewer than :data:`PRUNE_MIN_BLOCK_FRACTION` of the rows prune
    sends all its rows down the full path (no gathered copy). ``accMin[t, 0]`` gets a
    lower bound of the range's smallest margin.

    Bounds are Euclidean distances: ``ub[i] >= ||x_i - c_lab||``, ``lb[i] <= ||x_i - c_k||``
    for every ``k != lab``. After the centers moved, the own distance is recomputed (D
    flops) and the lower bound stays valid as ``lb`` minus the largest move of the other
    centers -- except the few ``movers`` that moved much further than the rest (a
    re-allocation jump), whose distances are computed exactly instead (``dnm``: the largest
    move of the others, ``dnm2`` the second largest, ``top_nm`` whose move ``dnm`` is).
    ``coff[k]`` is what the kernel's
    distance misses of the Euclidean one (cosine: ``||c_k||^2 - 1``), ``maxoff`` its
    maximum; ``slack`` a bound on the GEMM-form rounding of a squared distance.

    One dispatcher for the serial and the threaded pass (a serial wrapper around it, or a
    per-range function under it, would optimise the whole pass again at compile time:
    1.5-1.8 s each of a cold first fit).
    """
    n, D = X.shape
    K = C.shape[0]
    nch = accMin.shape[0]
    Ct = C.T
    movers, dnm, dnm2, top_nm, dall, dall2, top_all, maxoff, maxlogp = _pruned_plan(
        coff, logp, drift)
    G = np.empty((block, K), X.dtype)
    Xg = np.empty((block, D), X.dtype)
    Sb = np.empty((K, D), X.dtype)
    idx = np.empty(block, np.int64)
    cand, cidx, S, soft_rows, zmaxs, rowres = _row_scratch(K, block)
    wg = np.empty(block)
    # the block's prunable rows: own distance, bounds (scan first, then decide)
    pq = np.empty(block, np.int64)
    pd1 = np.empty(block)
    pue = np.empty(block)
    plo = np.empty(block)
    rstat = np.empty(block, np.int8)
    # candidates of the block (own distance computed) and their far movers' pairs
    qrow = np.empty(block, np.int64)
    qcol = np.empty(block, np.int64)
    qd = np.empty(block)
    qlo = np.empty(block)
    qneed = np.empty(block)
    que = np.empty(block)
    qok = np.empty(block, np.bool_)
    qp0 = np.empty(block, np.int64)
    qp1 = np.empty(block, np.int64)
    prow = np.empty(block * MAX_MOVERS, np.int64)
    pcol = np.empty(block * MAX_MOVERS, np.int64)
    pdist = np.empty(block * MAX_MOVERS)
    soft_bound = resp != RESP_HARD and T > 0.0 and gap > 0.0
    e_gap = math.exp(-gap / T) if soft_bound else 0.0
    for t in range(t0, t1):
        r0 = t * n // nch
        r1 = (t + 1) * n // nch
        accN = accN_r[t]
        accS = accS_r[t]
        accHN = accHN_r[t]
        accHS = accHS_r[t]
        accSc = accSc_r[t]
        mn = accMin[t, 0]
        pruned = 0
        owned = 0               # own distances computed for the prune test
        for b0 in range(r0, r1, block):
            b1 = min(b0 + block, r1)
            # 1. rows whose lower bound of the other centers' distances may prune: their
            #    own distances, in one vectorised call (``_pair_distances``; the per-row
            #    scalar sum was most of a pruned row's cost at large D)
            nq = 0
            for i in range(b0, b1):
                rstat[i - b0] = 0               # 0: full path, 1: pruned
                a = lab[i]
                if a < 0:
                    continue
                need = gap + maxoff - coff[a] + slack
                if use_prior and resp != RESP_HARD:
                    need += T * (maxlogp - logp[a])
                # lower bound of the distance to every other center that is not a mover
                lo = lb[i] - (dnm2 if a == top_nm else dnm)
                if not lo > 0.0:            # (a NaN bound takes the full path, unmeasured)
                    continue
                # a lower bound of the own distance without computing it (the last exact
                # one, ub minus its rounding widening, minus the center's move): a row that
                # cannot prune even with it skips the own distance (at soft temperatures
                # most rows, and that distance was most of the cost of a pruned pass over an
                # unpruned one)
                lo_own = ub[i] * ub[i] - 2.0 * slack
                lo_own = (math.sqrt(lo_own) if lo_own > 0.0 else 0.0) - drift[a]
                if lo_own > 0.0 and lo * lo - lo_own * lo_own <= need:
                    continue
                qrow[nq] = i
                qcol[nq] = a
                qlo[nq] = lo
                qneed[nq] = need
                nq += 1
            _pair_distances(X, C, qrow, qcol, nq, metric, qd)
            owned += nq
            # 2. the test with the own distance; where the centers' moves are uneven, the
            #    few far movers' distances, exactly (also in one call)
            npair = 0
            for q in range(nq):
                i = qrow[q]
                a = qcol[q]
                need = qneed[q]
                lo = qlo[q]
                ue = qd[q] + coff[a]            # the kernel's formula: cosine 2 - 2 x.c
                ue = math.sqrt(ue) if ue > 0.0 else 0.0
                que[q] = ue
                qp0[q] = npair
                qp1[q] = npair
                qok[q] = False
                if lo * lo - ue * ue <= need:
                    continue
                # with every center's move subtracted the row may prune already (common
                # near convergence, where the largest moves are tiny but uneven)
                lo_all = lb[i] - (dall2 if a == top_all else dall)
                if lo_all > 0.0 and lo_all * lo_all - ue * ue > need:
                    qlo[q] = lo_all
                    qok[q] = True
                    continue
                for t2 in range(movers.shape[0]):
                    k = movers[t2]
                    if k != a:
                        prow[npair] = i
                        pcol[npair] = k
                        npair += 1
                qp1[q] = npair
                qok[q] = True                   # unless a mover is nearer (below)
            _pair_distances(X, C, prow, pcol, npair, metric, pdist)
            npr = 0
            for q in range(nq):
                if not qok[q]:
                    continue
                lo = qlo[q]
                for t2 in range(qp0[q], qp1[q]):
                    k = pcol[t2]
                    dk = pdist[t2] + coff[k] - slack
                    dk = math.sqrt(dk) if dk > 0.0 else 0.0
                    if dk < lo:
                        lo = dk
                ue = que[q]
                if lo * lo - ue * ue > qneed[q]:
                    i = qrow[q]
                    rstat[i - b0] = 1
                    pq[npr] = i
                    pd1[npr] = qd[q]
                    pue[npr] = ue
                    plo[npr] = lo
                    npr += 1
            m = np.int64(0)        # (not the literal 0: see _accumulate_block)
            for i in range(b0, b1):
                if rstat[i - b0] == 0:
                    idx[m] = i
                    m += 1
            if npr > 0 and PRUNE_MIN_BLOCK_FRACTION * (b1 - b0) > npr:
                # too few prunable rows to pay for gathering the others into a copy: the whole
                # block takes the full path (exact; it refreshes the bounds of every row)
                m = np.int64(0)
                for i in range(b0, b1):
                    idx[m] = i
                    m += 1
                npr = 0
            for q in range(npr):
                i = pq[q]
                a = lab[i]
                wi = w[i]
                d1 = pd1[q]
                ue = pue[q]
                lo = plo[q]
                pruned += 1
                ub[i] = ue
                lb[i] = lo
                mlb = lo * lo - maxoff - d1
                if K > 1 and wi > 0.0:
                    if mlb < mn:
                        mn = mlb
                    if T > 0.0:
                        # a soft pass prunes only margins above ``gap``: its term is below
                        # e_gap (an upper bound, one exp per pass instead of one per row:
                        # that exp was half of a pruned row's cost)
                        accSc[S_MARGIN] += wi * (e_gap if soft_bound else math.exp(-mlb / T))
                accN[a] += wi
                accHN[a] += wi
                if hard_sums:
                    for j in range(D):
                        accHS[a, j] += wi * np.float64(X[i, j])
                if not (hard_sums and resp == RESP_HARD):
                    # (a hard pass with hard sums copies its soft sums from them at the end)
                    for j in range(D):
                        accS[a, j] += wi * np.float64(X[i, j])
                free = d1
                if use_prior and resp == RESP_SOFTMAX:
                    free = d1 - T * logp[a]        # -T * zmax, zmax = logp_a - d1/T
                accSc[S_SOFT_DIST] += wi * d1
                accSc[S_FREE] += wi * free
                accSc[S_HARD] += wi * d1
                accSc[S_WEIGHT] += wi
                accSc[S_ROWS] += 1.0
                accSc[S_NNZ] += 1.0
            if m == 0:
                continue
            if m == b1 - b0:
                Xb = X[b0:b1]           # no row of the block pruned: no gathered copy
            else:
                for r in range(m):
                    for j in range(D):
                        Xg[r, j] = X[idx[r], j]
                Xb = Xg[:m]
            Gb = G[:m]
            _block_distances(Xb, Ct, csq, metric, Gb)
            for r in range(m):
                wg[r] = w[idx[r]]
            _block_responsibilities(Gb, m, wg, logp, use_prior, T, resp, log_eps, sort_max, accN,
                                    cand, cidx, S, soft_rows, zmaxs, rowres)
            mn = _accumulate_block(Xb, Gb, m, wg, rowres, T, resp, hard_sums, sparse_fraction,
                                   accSc, accHN, accS, accHS, Sb, mn)
            for r in range(m):
                # fresh bounds: Euclidean distances, widened by the rounding slack
                i = idx[r]
                kmin = np.int64(rowres[r, R_KMIN])
                d1 = rowres[r, R_D1]
                d2 = rowres[r, R_D2]
                lab[i] = kmin
                ue = d1 + coff[kmin] + slack
                ub[i] = math.sqrt(ue) if ue > 0.0 else 0.0
                le = d2 - maxoff - slack
                if le == np.inf:
                    lb[i] = np.inf
                else:
                    lb[i] = math.sqrt(le) if le > 0.0 else 0.0
        accMin[t, 0] = mn
        accP[t, 0] = pruned
        accP[t, 1] = owned


@njit(cache=True, nogil=True, inline="always")
def _pruned_plan(coff, logp, drift):
    """What a pruned pass needs of the centers' moves: ``(movers, dnm, dnm2, top_nm, dall,
    dall2, top_all, maxoff, maxlogp)`` (see :func:`_pruned_ranges`)."""
    K = drift.shape[0]
    # movers: the leading centers by drift, up to the last big gap (4x) among the 8 largest
    # (a partial selection of the top MAX_MOVERS + 2: no sort to compile)
    top = min(K, MAX_MOVERS + 2)
    order = np.empty(top, np.int64)
    taken = np.zeros(K, np.bool_)
    for j in range(top):
        best = -1
        for k in range(K):
            if not taken[k] and (best < 0 or drift[k] > drift[best]):
                best = k
        order[j] = best
        taken[best] = True
    m = 0
    for j in range(1, min(MAX_MOVERS, K - 1) + 1):
        if drift[order[j - 1]] > 4.0 * drift[order[j]] + 1e-300:
            m = j
    movers = order[:m].copy()
    dnm = drift[order[m]] if m < top else 0.0
    dnm2 = drift[order[m + 1]] if m + 1 < top else 0.0
    top_nm = order[m] if m < top else -1
    maxoff = -np.inf
    for k in range(K):
        if coff[k] > maxoff:
            maxoff = coff[k]
    maxlogp = -np.inf
    for k in range(K):
        if logp[k] > maxlogp:
            maxlogp = logp[k]
    dall = drift[order[0]] if top > 0 else 0.0          # the largest move of all centers
    dall2 = drift[order[1]] if top > 1 else 0.0
    top_all = order[0] if top > 0 else -1
    return movers, dnm, dnm2, top_nm, dall, dall2, top_all, maxoff, maxlogp



"""numba.cuda kernels: GEMM-form distances, responsibilities and block moments on the GPU.

Private; :mod:`fastanneal.cuda.source` drives them. Importing this module imports
``numba.cuda`` (only :mod:`fastanneal.cuda.source` does, and only when a GPU is used).

One moments pass walks the rows in chunks (``m`` rows; never ``N x K`` on the device) and,
per chunk, launches:

1. :func:`distance_kernel` -- the tile ``d_ik = ||x_i||^2 - 2 x_i.c_k + ||c_k||^2``
   (clamped at 0; cosine ``2 - 2 x_i.c_k``) of the chunk into the ``m x K`` buffer ``G``
   (input dtype, like the CPU kernel). A classic shared-memory tiled GEMM: a block of
   ``bx x by`` threads computes a ``8 by x 8 bx`` tile, ``TILE_D`` features deep per step,
   each thread an 8 x 8 register micro-tile accumulated in the input dtype (the CPU uses
   sgemm for float32 too).
2. :func:`rows_kernel` -- one thread block per row at a time (rows per block and threads per
   row from ``fastanneal.cuda.source._row_launch``: a warp per row below K = 2048, one
   thread per 32 centers above, at most 256): block-wide tree reductions in shared memory
   find ``d_(1)``, ``d_(2)``, the nearest center and ``max z``; then softmax in the log domain (entries with
   ``exp(z - zmax) < eps`` dropped, as on the CPU), entmax-1.5 with the exact threshold (the
   CPU's bisection on tau, one block reduction per step, then the closed form on the
   support) or hard. ``G`` is overwritten with ``w_i r_ik``; per-row scalars (soft
   distortion, entropy, free energy, J, margins, nnz) are summed in float64 per block and
   added with one float64 atomic per block.
3. Either :func:`accum_dense_kernel` -- ``S += G^T X`` as a second tiled GEMM (4 x 4
   micro-tiles) over a split of the rows (products in the input dtype for
   ``CUDA_ROWS_PER_BLOCK`` rows, then added to float64 registers; one float64 atomic per
   output and split at the end; ``N`` rides along) -- or, when the chunk's non-zero fraction
   is small, :func:`accum_sparse_kernel`: each block compacts a row's non-zeros in shared
   memory and adds ``r x_i`` to ``S`` with float64 atomics (runs of the same center are
   summed in registers first).
4. :func:`scatter_rows_kernel` for the hard sums (``sum w x_i`` per nearest center; float64
   atomics, runs of the same label summed in registers) -- also used for the weighted mean
   and the covariance matvec of the power iteration.

**What bounds the speed.** The two products, ``X C^T`` and ``G^T X``: ``4 N K D`` flops per
pass, run as SIMT fp32 FMAs on the CUDA cores (Numba exposes no tensor cores), fed from
shared memory. Measured on an H200 (``benchmarks/gpu_check.sh``; N = 10^6, D = 384,
float32): the distance GEMM runs at 13.5-14.8 TFLOP/s and ``G^T X`` at 7-8 TFLOP/s, against
49 TFLOP/s for cuBLAS sgemm (no TF32) on the same shape, so a dense softmax pass costs
12-16x one cuBLAS ``X @ C.T`` (K = 1024: 0.19 s vs 16 ms), a low-temperature one (sparse
scatter instead of ``G^T X``) 6-11x, entmax15 9-18x. Per 65536-row chunk at K = 1024 the
distances take 3.5 ms, the row kernel 2.1 ms (softmax) to 5 ms (entmax bisection: one block
reduction, ``log2(threads)`` ``__syncthreads``, per step), ``G^T X`` 6.7 ms, the sparse
scatter 0.9 ms at 0.3 % non-zeros (it is bound by float64 atomics, ``nnz * D`` of them, and
costs 9x ``G^T X`` on a fully dense chunk, hence the sparse-fraction switch). Memory traffic
is minor (``G`` is written once and read three times per chunk). Closing the gap to the
GEMM floor takes library GEMMs for the two products: :mod:`fastanneal.cuda._blas` runs them
through cuBLAS (CuPy) and :func:`distance_epilogue_kernel` turns the product into distances;
the row kernel stays. Measured on an H200 with those and the row launch of
``source._row_launch``: a pass is 3.3-8.1x one GEMM (K = 1024, per chunk: distances 1.5 ms,
row kernel 1.0 ms, accumulation 1.3 ms; BENCHMARKS.md §8).

Accumulators (``N``, ``S``, hard sums, scalars) are float64 everywhere; within a GEMM tile
the products are summed in the input dtype over at most ``CUDA_ROWS_PER_BLOCK`` rows (or
the ``D`` features of one dot product, as in sgemm) before entering float64. The kernels
are module-level and compiled once per argument types (float32 / float64 data).
"""
import math

import numpy as np
from numba import cuda, float64, int32, uint32, uint64

from .._kernels import (N_SCALARS, RESP_ENTMAX15, RESP_HARD, RESP_SOFTMAX,  # noqa: F401
                        S_ENTROPY, S_FREE, S_HARD, S_MARGIN, S_NNZ, S_ROWS, S_SOFT_DIST,
                        S_WEIGHT, METRIC_COSINE)

#: Distance GEMM: each thread computes a ``MICRO_D x MICRO_D`` register micro-tile; shared
#: tiles are ``TILE_D`` features deep. (Measured on an H200, 65536 x 384 rows against 1024
#: centers: 4x4/16 with signed indices 6.0 TFLOP/s, 4x4 unsigned 11.1, 8x8/8 unsigned 14.6.)
MICRO_D = 8
TILE_D = 8
_MMD = MICRO_D * MICRO_D
#: ``G^T X`` GEMM: ``MICRO_A x MICRO_A`` micro-tiles, ``TILE_A`` rows deep. It also keeps a
#: float64 copy of its accumulators; an 8 x 8 variant measured no faster on an H200.
MICRO_A = 4
TILE_A = 16
_MMA = MICRO_A * MICRO_A

#: Number of float64 slots of the row kernels' shared reduction buffer (times threads).
ROW_SLOTS = 4


def gemm_block_shape(threads):
    """``(bx, by)`` of a GEMM block with ``threads`` (a power of two >= 8) threads."""
    bx = 1 << ((int(threads).bit_length()) // 2)   # 8 -> 4, 16 -> 4, 32 -> 8, 256 -> 16
    by = threads // bx
    return bx, by


def distance_shared_bytes(bx, by, itemsize):
    """Dynamic shared memory of :func:`distance_kernel`."""
    return TILE_D * (MICRO_D * by + 1 + MICRO_D * bx + 1) * itemsize


def accum_shared_bytes(bx, by, itemsize):
    """Dynamic shared memory of :func:`accum_dense_kernel`."""
    return TILE_A * (MICRO_A * by + 1 + MICRO_A * bx) * itemsize


# ----------------------------------------------------------------------------- helpers
@cuda.jit(device=True, inline="always")
def _block_rows(rows_per_block, m):
    """Rows ``[i0, i1)`` of this 1-D block: ``rows_per_block`` rows from ``blockIdx.x *
    rows_per_block``, cut at ``m``."""
    i0 = cuda.blockIdx.x * rows_per_block
    i1 = i0 + rows_per_block
    if i1 > m:
        i1 = m
    return i0, i1


@cuda.jit(device=True)
def _tree_sum(buf, nslot, nt, tid):
    """Sum ``buf[q * nt + t]`` over ``t`` into ``buf[q * nt]`` for ``q < nslot``.

    ``nt`` is a power of two. Starts and ends with ``__syncthreads``; the caller reads the
    results and must synchronize again before writing ``buf``.
    """
    cuda.syncthreads()
    s = nt // 2
    while s > 0:
        if tid < s:
            for q in range(nslot):
                buf[q * nt + tid] += buf[q * nt + tid + s]
        cuda.syncthreads()
        s //= 2


@cuda.jit(device=True, inline="always")
def _block_sum4(buf, nt, tid, a, b, c, d):
    """Block-wide sums of the per-thread values ``a, b, c, d`` (through slots 0..3 of
    ``buf``). Synchronizes before returning: ``buf`` may be written again at once."""
    buf[tid] = a
    buf[nt + tid] = b
    buf[2 * nt + tid] = c
    buf[3 * nt + tid] = d
    _tree_sum(buf, 4, nt, tid)
    a = buf[0]
    b = buf[nt]
    c = buf[2 * nt]
    d = buf[3 * nt]
    cuda.syncthreads()
    return a, b, c, d


@cuda.jit(device=True)
def _tree_min2(buf, nt, tid):
    """Reduce (d1, d2, k, zmax) in slots 0..3 of ``buf``: the two smallest distances (as a
    multiset), the smallest index attaining ``d1``, and the maximum of slot 3."""
    cuda.syncthreads()
    s = nt // 2
    while s > 0:
        if tid < s:
            o = tid + s
            a1 = buf[tid]
            a2 = buf[nt + tid]
            ak = buf[2 * nt + tid]
            b1 = buf[o]
            b2 = buf[nt + o]
            bk = buf[2 * nt + o]
            hi1 = a1 if a1 > b1 else b1
            lo2 = a2 if a2 < b2 else b2
            buf[nt + tid] = hi1 if hi1 < lo2 else lo2
            if b1 < a1 or (b1 == a1 and bk < ak):
                buf[tid] = b1
                buf[2 * nt + tid] = bk
            if buf[3 * nt + o] > buf[3 * nt + tid]:
                buf[3 * nt + tid] = buf[3 * nt + o]
        cuda.syncthreads()
        s //= 2


@cuda.jit(device=True)
def _row_min2(G, i, logp, use_prior, T, want_z, buf, nt, tid):
    """Block-wide ``(d1, d2, kmin, zmax)`` of row ``i`` of the distance buffer ``G``
    (``zmax`` of ``z = -d / T (+ log p)`` only when ``want_z``)."""
    K = G.shape[1]
    d1 = math.inf
    d2 = math.inf
    kk = float64(K)
    zmax = -math.inf
    for k in range(tid, K, nt):
        d = float64(G[i, k])
        if d < d1:
            d2 = d1
            d1 = d
            kk = float64(k)
        elif d < d2:
            d2 = d
        if want_z:
            z = -d / T
            if use_prior:
                z += logp[k]
            if z > zmax:
                zmax = z
    buf[tid] = d1
    buf[nt + tid] = d2
    buf[2 * nt + tid] = kk
    buf[3 * nt + tid] = zmax
    _tree_min2(buf, nt, tid)
    d1 = buf[0]
    d2 = buf[nt]
    kmin = int32(buf[2 * nt])
    zmax = buf[3 * nt]
    cuda.syncthreads()
    return d1, d2, kmin, zmax


@cuda.jit(device=True)
def _entmax_v(G, i, k, logp, use_prior, T, zmax):
    """Halved, shifted logit ``(z - zmax) / 2`` of entry ``k`` (the CPU's operation order)."""
    z = -float64(G[i, k]) / T
    if use_prior:
        z += logp[k]
    return 0.5 * (z - zmax)


@cuda.jit(device=True, inline="always")
def _gemm_thread(micro):
    """This thread's place in a 2-D GEMM block of ``(bx, by)`` threads, each computing a
    ``micro x micro`` register micro-tile: ``(tx, ty, bx, by, nt, tid, BR, BC, row0, col0)``
    with the block's ``BR x BC = (micro by) x (micro bx)`` output tile at ``(row0, col0)``
    (``blockIdx.y``, ``blockIdx.x``)."""
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    bx = cuda.blockDim.x
    by = cuda.blockDim.y
    nt = bx * by
    tid = ty * bx + tx
    BR = micro * by
    BC = micro * bx
    return tx, ty, bx, by, nt, tid, BR, BC, cuda.blockIdx.y * BR, cuda.blockIdx.x * BC


@cuda.jit(device=True, inline="always")
def _micro_gemm(sh, PA, OB, PB, ty, tx, by, bx, depth, micro, av, bv, acc):
    """One shared-memory tile step of a register-tiled GEMM: for ``kk < depth``,
    ``acc[a * micro + b] += A[kk, ty + a by] * B[kk, tx + b bx]`` (``a, b < micro``) with
    ``A[kk, r] = sh[kk PA + r]`` and ``B[kk, c] = sh[OB + kk PB + c]``; ``av``/``bv`` are
    the thread's ``micro`` register operands.

    ``depth`` and ``micro`` are the callers' module constants (``TILE_D``/``MICRO_D``,
    ``TILE_A``/``MICRO_A``). ``inline="always"`` splices this body into the kernel's Numba
    IR before typing, so the kernel's LLVM is that of the loop written in place: the trip
    counts are constants there, the loops unroll fully and ``acc``/``av``/``bv`` stay in
    registers (same PTX as the former hand-written copies).
    """
    for kk in range(depth):
        ba = uint32(kk * PA + ty)
        bb = uint32(OB + kk * PB + tx)
        for a in range(micro):
            av[a] = sh[ba + uint32(a * by)]
        for b in range(micro):
            bv[b] = sh[bb + uint32(b * bx)]
        for a in range(micro):
            for b in range(micro):
                acc[a * micro + b] += av[a] * bv[b]


@cuda.jit(device=True, inline="always")
def _entmax_t(G, i, k, logp, use_prior, T, zmax, tau):
    """``v - tau`` of entry ``k`` if it is a candidate (``v > -1``, see :func:`_entmax_v`),
    else 0: the entry is in the support at threshold ``tau`` iff the result is > 0."""
    v = _entmax_v(G, i, k, logp, use_prior, T, zmax)
    if v > -1.0:
        return v - tau
    return 0.0


# ----------------------------------------------------------------------------- kernels
@cuda.jit
def distance_kernel(X, xsq, r0, m, C, csq, metric, G):
    """``G[i, k] = d(X[r0 + i], C[k])`` for ``i < m`` (GEMM form, clamped at 0).

    Grid ``(ceil(K / (MICRO_D bx)), ceil(m / (MICRO_D by)))``, block ``(bx, by)``, dynamic
    shared memory :func:`distance_shared_bytes`. ``xsq``/``csq``: float64 squared norms of
    rows/centers. Indices are cast to unsigned (all are >= 0) so that Numba emits no
    negative-index wraparound: that alone nearly doubles the speed.
    """
    sh = cuda.shared.array(0, dtype=X.dtype)
    tx, ty, bx, by, nt, tid, BM, BN, row0, col0 = _gemm_thread(MICRO_D)
    PA = BM + 1            # padded strides: the transposing stores avoid bank conflicts
    PB = BN + 1
    OB = TILE_D * PA
    D = X.shape[1]
    K = C.shape[0]
    acc = cuda.local.array(_MMD, dtype=X.dtype)
    av = cuda.local.array(MICRO_D, dtype=X.dtype)
    bv = cuda.local.array(MICRO_D, dtype=X.dtype)
    for q in range(_MMD):
        acc[q] = 0
    for d0 in range(0, D, TILE_D):
        for idx in range(tid, TILE_D * BM, nt):
            r = idx // TILE_D
            kk = idx - r * TILE_D
            v = 0.0
            if row0 + r < m and d0 + kk < D:
                v = X[uint64(r0 + row0 + r), uint64(d0 + kk)]
            sh[uint32(kk * PA + r)] = v
        for idx in range(tid, TILE_D * BN, nt):
            c = idx // TILE_D
            kk = idx - c * TILE_D
            v = 0.0
            if col0 + c < K and d0 + kk < D:
                v = C[uint64(col0 + c), uint64(d0 + kk)]
            sh[uint32(OB + kk * PB + c)] = v
        cuda.syncthreads()
        _micro_gemm(sh, PA, OB, PB, ty, tx, by, bx, TILE_D, MICRO_D, av, bv, acc)
        cuda.syncthreads()
    for a in range(MICRO_D):
        row = row0 + ty + a * by
        if row < m:
            xs = xsq[r0 + row]
            for b in range(MICRO_D):
                col = col0 + tx + b * bx
                if col < K:
                    g = float64(acc[a * MICRO_D + b])
                    if metric == METRIC_COSINE:
                        d = 2.0 - 2.0 * g
                    else:
                        d = xs + csq[col] - 2.0 * g
                    G[row, col] = d if d > 0.0 else 0.0


@cuda.jit
def rows_kernel(G, m, w, r0, logp, use_prior, T, resp, log_eps, rows_per_block, labels,
                HN, scal, mn):
    """Responsibilities of rows ``i < m`` of ``G`` in place (``G[i] <- w_i r_i``) and the
    per-row statistics.

    Grid ``ceil(m / rows_per_block)``, 1-D blocks of ``nt`` (a power of two) threads,
    dynamic shared memory ``ROW_SLOTS * nt`` float64. Writes ``labels[i]`` (nearest
    center), adds ``w_i`` to ``HN[label]``, the block's scalar sums to ``scal`` (slots of
    :mod:`fastanneal._kernels`) and its smallest margin to ``mn[0]`` (float64 atomics).
    """
    buf = cuda.shared.array(0, dtype=float64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    K = G.shape[1]
    i0, i1 = _block_rows(rows_per_block, m)
    a_soft = 0.0
    a_ent = 0.0
    a_free = 0.0
    a_hard = 0.0
    a_w = 0.0
    a_marg = 0.0
    a_nnz = 0.0
    a_min = math.inf
    for i in range(i0, i1):
        wi = w[r0 + i]
        d1, d2, kmin, zmax = _row_min2(G, i, logp, use_prior, T, resp != RESP_HARD, buf,
                                       nt, tid)
        if resp == RESP_HARD:
            for k in range(tid, K, nt):
                G[i, k] = wi if k == kmin else 0.0
            soft = d1
            ent = 0.0
            free = d1
            nnz = 1.0
        elif resp == RESP_SOFTMAX:
            s = 0.0
            sed = 0.0
            sez = 0.0
            cnt = 0.0
            for k in range(tid, K, nt):
                d = float64(G[i, k])
                z = -d / T - zmax
                if use_prior:
                    z += logp[k]
                if z < log_eps:
                    G[i, k] = 0.0
                else:
                    e = math.exp(z)
                    G[i, k] = e
                    s += e
                    sed += e * d
                    sez += e * z
                    cnt += 1.0
            s, sed, sez, nnz = _block_sum4(buf, nt, tid, s, sed, sez, cnt)
            scale = wi / s
            for k in range(tid, K, nt):
                G[i, k] = G[i, k] * scale
            soft = sed / s
            ent = math.log(s) - sez / s
            free = -T * (zmax + math.log(s))
        else:
            # entmax-1.5: v = (z - zmax) / 2, candidates v > -1; bisection on tau as in
            # fastanneal._kernels.entmax15_tau_bisect, with the support counts carried along.
            n = 0.0
            for k in range(tid, K, nt):
                if _entmax_v(G, i, k, logp, use_prior, T, zmax) > -1.0:
                    n += 1.0
            buf[tid] = n
            _tree_sum(buf, 1, nt, tid)
            n = buf[0]
            cuda.syncthreads()
            lo = -1.0
            hi = -1.0 / math.sqrt(n)
            if hi < lo:
                hi = lo
            c = 0.0
            for k in range(tid, K, nt):
                if _entmax_v(G, i, k, logp, use_prior, T, zmax) > hi:
                    c += 1.0
            buf[tid] = c
            _tree_sum(buf, 1, nt, tid)
            c_hi = buf[0]
            cuda.syncthreads()
            c_lo = n
            for _ in range(200):
                mid = 0.5 * (lo + hi)
                f = 0.0
                c = 0.0
                for k in range(tid, K, nt):
                    t = _entmax_t(G, i, k, logp, use_prior, T, zmax, mid)
                    if t > 0.0:
                        f += t * t
                        c += 1.0
                buf[tid] = f
                buf[nt + tid] = c
                _tree_sum(buf, 2, nt, tid)
                f = buf[0]
                c = buf[nt]
                cuda.syncthreads()
                if f >= 1.0:
                    lo = mid
                    c_lo = c
                else:
                    hi = mid
                    c_hi = c
                if c_lo == c_hi or hi - lo < 1e-15:
                    break
            rho = 0.0
            s1 = 0.0
            s2 = 0.0
            for k in range(tid, K, nt):
                v = _entmax_v(G, i, k, logp, use_prior, T, zmax)
                if v > -1.0 and v > lo:
                    rho += 1.0
                    s1 += v
                    s2 += v * v
            buf[tid] = rho
            buf[nt + tid] = s1
            buf[2 * nt + tid] = s2
            _tree_sum(buf, 3, nt, tid)
            rho = buf[0]
            s1 = buf[nt]
            s2 = buf[2 * nt]
            cuda.syncthreads()
            M = s1 / rho
            q = M * M - (s2 - 1.0) / rho
            tau = M - math.sqrt(q if q > 0.0 else 0.0)
            psum = 0.0
            spd = 0.0
            sp15 = 0.0
            cnt = 0.0
            for k in range(tid, K, nt):
                t = _entmax_t(G, i, k, logp, use_prior, T, zmax, tau)
                if t > 0.0:
                    p = t * t
                    psum += p
                    spd += p * float64(G[i, k])
                    sp15 += p * math.sqrt(p)
                    cnt += 1.0
            psum, spd, sp15, nnz = _block_sum4(buf, nt, tid, psum, spd, sp15, cnt)
            for k in range(tid, K, nt):
                t = _entmax_t(G, i, k, logp, use_prior, T, zmax, tau)
                p = 0.0
                if t > 0.0:
                    p = t * t
                G[i, k] = wi * (p / psum)
            soft = spd / psum
            ent = (4.0 / 3.0) * (1.0 - sp15 / (psum * math.sqrt(psum)))
            free = soft - T * ent
        if tid == 0:
            labels[i] = kmin
            cuda.atomic.add(HN, kmin, wi)
            a_soft += wi * soft
            a_ent += wi * ent
            a_free += wi * free
            a_hard += wi * d1
            a_w += wi
            a_nnz += nnz
            if K > 1 and wi > 0.0:       # zero-weight rows are absent rows (as on the CPU)
                marg = d2 - d1
                if marg < a_min:
                    a_min = marg
                if T > 0.0:
                    a_marg += wi * math.exp(-marg / T)
    if tid == 0 and i1 > i0:
        cuda.atomic.add(scal, S_SOFT_DIST, a_soft)
        cuda.atomic.add(scal, S_ENTROPY, a_ent)
        cuda.atomic.add(scal, S_FREE, a_free)
        cuda.atomic.add(scal, S_HARD, a_hard)
        cuda.atomic.add(scal, S_WEIGHT, a_w)
        cuda.atomic.add(scal, S_ROWS, float64(i1 - i0))
        cuda.atomic.add(scal, S_MARGIN, a_marg)
        cuda.atomic.add(scal, S_NNZ, a_nnz)
        cuda.atomic.min(mn, 0, a_min)


@cuda.jit
def accum_dense_kernel(G, X, r0, m, rows_per_split, flush_tiles, S, N):
    """``S += G[:m]^T X[r0:r0+m]`` and ``N += column sums of G[:m]`` (float64 atomics).

    Grid ``(ceil(D / (MICRO_A bx)), ceil(K / (MICRO_A by)), splits)``, block ``(bx, by)``,
    dynamic shared memory :func:`accum_shared_bytes`; block ``(., ., z)`` sums rows
    ``[z * rows_per_split, (z + 1) * rows_per_split)``. Products are summed in the input
    dtype over ``flush_tiles * TILE_A`` rows, then in float64.
    """
    sh = cuda.shared.array(0, dtype=X.dtype)
    # BK centers (from k0) by BD features (from j0) per tile
    tx, ty, bx, by, nt, tid, BK, BD, k0, j0 = _gemm_thread(MICRO_A)
    PK = BK + 1
    OX = TILE_A * PK
    K = G.shape[1]
    D = X.shape[1]
    i_start = cuda.blockIdx.z * rows_per_split
    i_end = i_start + rows_per_split
    if i_end > m:
        i_end = m
    acc = cuda.local.array(_MMA, dtype=X.dtype)
    acc64 = cuda.local.array(_MMA, dtype=float64)
    av = cuda.local.array(MICRO_A, dtype=X.dtype)
    bv = cuda.local.array(MICRO_A, dtype=X.dtype)
    for q in range(_MMA):
        acc[q] = 0
        acc64[q] = 0.0
    do_n = cuda.blockIdx.x == 0 and tid < BK      # BK <= nt since bx >= MICRO_A
    nacc = 0.0
    tiles = 0
    # (row, column) of this thread's first element in the G and X tiles, and the step of
    # nt elements, split once: no integer division by the runtime tile widths in the loop
    # (64-bit division there cost more than the FMAs)
    g_r0 = tid // BK
    g_c0 = tid - g_r0 * BK
    g_dr = nt // BK
    g_dc = nt - g_dr * BK
    x_r0 = tid // BD
    x_c0 = tid - x_r0 * BD
    x_dr = nt // BD
    x_dc = nt - x_dr * BD
    for ib in range(i_start, i_end, TILE_A):
        rr = g_r0
        c = g_c0
        while rr < TILE_A:
            v = 0.0
            if ib + rr < i_end and k0 + c < K:
                v = G[uint64(ib + rr), uint64(k0 + c)]
            sh[uint32(rr * PK + c)] = v
            rr += g_dr
            c += g_dc
            if c >= BK:
                c -= BK
                rr += 1
        rr = x_r0
        c = x_c0
        while rr < TILE_A:
            v = 0.0
            if ib + rr < i_end and j0 + c < D:
                v = X[uint64(r0 + ib + rr), uint64(j0 + c)]
            sh[uint32(OX + rr * BD + c)] = v
            rr += x_dr
            c += x_dc
            if c >= BD:
                c -= BD
                rr += 1
        cuda.syncthreads()
        if do_n:
            for rr in range(TILE_A):
                nacc += float64(sh[uint32(rr * PK + tid)])
        _micro_gemm(sh, PK, OX, BD, ty, tx, by, bx, TILE_A, MICRO_A, av, bv, acc)
        cuda.syncthreads()
        tiles += 1
        if tiles == flush_tiles:
            tiles = 0
            for q in range(_MMA):
                acc64[q] += float64(acc[q])
                acc[q] = 0
    for a in range(MICRO_A):
        k = k0 + ty + a * by
        if k < K:
            for b in range(MICRO_A):
                j = j0 + tx + b * bx
                if j < D:
                    cuda.atomic.add(S, (k, j), acc64[a * MICRO_A + b]
                                    + float64(acc[a * MICRO_A + b]))
    if do_n and k0 + tid < K:
        cuda.atomic.add(N, k0 + tid, nacc)


@cuda.jit
def accum_sparse_kernel(G, X, r0, m, rows_per_block, S, N):
    """``S[k] += G[i, k] X[r0 + i]`` and ``N[k] += G[i, k]`` over the non-zeros of rows
    ``i < m`` (float64 atomics).

    Grid ``(ceil(m / rows_per_block), ceil(D / nt))``, 1-D blocks of ``nt`` threads,
    dynamic shared memory ``2 * nt`` float64. Thread ``t`` owns feature ``j``; each row's
    non-zeros are compacted ``nt`` centers at a time into shared memory.
    """
    lst = cuda.shared.array(0, dtype=float64)
    cnt = cuda.shared.array(1, dtype=int32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    K = G.shape[1]
    D = X.shape[1]
    j = cuda.blockIdx.y * nt + tid
    i0, i1 = _block_rows(rows_per_block, m)
    do_n = cuda.blockIdx.y == 0 and tid == 0
    kcur = -1
    acc = 0.0
    for i in range(i0, i1):
        xij = 0.0
        if j < D:
            xij = float64(X[r0 + i, j])
        for kb in range(0, K, nt):
            if tid == 0:
                cnt[0] = 0
            cuda.syncthreads()
            k = kb + tid
            if k < K:
                r = float64(G[i, k])
                if r != 0.0:
                    p = cuda.atomic.add(cnt, 0, 1)
                    lst[p] = float64(k)
                    lst[nt + p] = r
            cuda.syncthreads()
            ne = cnt[0]
            for e in range(ne):
                ke = int32(lst[e])
                re = lst[nt + e]
                if j < D:
                    if ke != kcur:
                        if kcur >= 0:
                            cuda.atomic.add(S, (kcur, j), acc)
                        kcur = ke
                        acc = 0.0
                    acc += re * xij
                if do_n:
                    cuda.atomic.add(N, ke, re)
            cuda.syncthreads()
    if j < D and kcur >= 0:
        cuda.atomic.add(S, (kcur, j), acc)


@cuda.jit
def scatter_rows_kernel(X, r0, m, labels, lofs, wts, wofs, rows_per_block, out):
    """``out[labels[lofs + i]] += wts[wofs + i] * X[r0 + i]`` for ``i < m`` (float64 atomics;
    ``lofs < 0`` means every label is 0).

    Grid ``(ceil(m / rows_per_block), ceil(D / nt))``, 1-D blocks; thread ``t`` owns one
    feature and sums runs of equal labels in a register before each atomic.
    """
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    D = X.shape[1]
    j = cuda.blockIdx.y * nt + tid
    if j >= D:
        return
    i0, i1 = _block_rows(rows_per_block, m)
    kcur = -1
    acc = 0.0
    for i in range(i0, i1):
        k = 0
        if lofs >= 0:
            k = int32(labels[lofs + i])
        if k != kcur:
            if kcur >= 0:
                cuda.atomic.add(out, (kcur, j), acc)
            kcur = k
            acc = 0.0
        acc += wts[wofs + i] * float64(X[r0 + i, j])
    if kcur >= 0:
        cuda.atomic.add(out, (kcur, j), acc)


@cuda.jit
def argmin_kernel(G, m, rows_per_block, r0, labels, dmin, margin):
    """Nearest center, its distance and the margin ``d_(2) - d_(1)`` of rows ``i < m`` of
    the distance buffer, written at ``r0 + i``. Blocks as :func:`rows_kernel`."""
    buf = cuda.shared.array(0, dtype=float64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    i0, i1 = _block_rows(rows_per_block, m)
    for i in range(i0, i1):
        d1, d2, kmin, _z = _row_min2(G, i, G[0], False, 1.0, False, buf, nt, tid)
        if tid == 0:
            labels[r0 + i] = kmin
            dmin[r0 + i] = d1
            margin[r0 + i] = d2 - d1


@cuda.jit
def rowdot_kernel(X, n, labels, use_labels, mu, V, w, rows_per_block, out):
    """``out[i] = w_i (x_i - mu_k) . V_k`` with ``k = labels[i]`` (``k = 0`` for every row
    when not ``use_labels``). Blocks as :func:`rows_kernel`."""
    buf = cuda.shared.array(0, dtype=float64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    D = X.shape[1]
    i0, i1 = _block_rows(rows_per_block, n)
    for i in range(i0, i1):
        k = 0
        if use_labels:
            k = int32(labels[i])
        s = 0.0
        for j in range(tid, D, nt):
            s += (float64(X[i, j]) - mu[k, j]) * V[k, j]
        buf[tid] = s
        _tree_sum(buf, 1, nt, tid)
        if tid == 0:
            out[i] = w[i] * buf[0]
        cuda.syncthreads()


@cuda.jit
def gather_rows_kernel(X, idx, out):
    """``out[a] = X[idx[a]]``; grid over the entries of ``out``."""
    t = cuda.grid(1)
    D = X.shape[1]
    if t < out.shape[0] * D:
        a = t // D
        j = t - a * D
        out[a, j] = X[idx[a], j]


@cuda.jit
def distance_epilogue_kernel(G, m, xsq, r0, csq, metric):
    """Turn the products ``G[i, k] = x_i . c_k`` (rows ``i < m``, written by a library GEMM)
    into squared distances in place: ``||x_i||^2 + ||c_k||^2 - 2 x_i . c_k`` (``xsq[r0 +
    i]``, ``csq[k]`` float64), or ``2 - 2 x_i . c_k`` for cosine, clamped at 0 -- the same
    arithmetic as the end of :func:`distance_kernel` (and the CPU kernel). 2-D grid over
    ``(m, K)`` (rows on x: grid.x allows 2^31 - 1 blocks, grid.y only 65,535); one entry
    per thread."""
    i, k = cuda.grid(2)
    if i < m and k < G.shape[1]:
        g = float64(G[i, k])
        if metric == METRIC_COSINE:
            d = 2.0 - 2.0 * g
        else:
            d = xsq[r0 + i] + csq[k] - 2.0 * g
        G[i, k] = d if d > 0.0 else 0.0

"""The CUDA moment source: rows held on the GPU (or streamed through it from host memory),
moments computed by numba.cuda kernels around cuBLAS products (:mod:`._blas`).

Importing this module does not import ``numba.cuda``; constructing a :class:`CudaSource`
(or calling :func:`cuda_moments`) does, and raises a clear :class:`RuntimeError` when no
usable GPU (nor the numba-cuda simulator, ``NUMBA_ENABLE_CUDASIM=1``) is present.

Tunables are read from :mod:`fastanneal._config` at every call:
``CUDA_THREADS_PER_BLOCK`` (rounded down to a power of two in [8, 1024]; the GEMM kernels
use at most 256 of them), ``CUDA_ROWS_PER_BLOCK``, and, when present, ``CUDA_CHUNK_ROWS``
(rows per device pass, default 65536) and ``CUDA_SPARSE_FRACTION`` (a chunk whose non-zero
responsibilities are at most this fraction of ``rows * K`` is accumulated by the sparse
scatter instead of the dense ``G^T X`` GEMM; default 0.08: on an H200 the scatter of a
fully dense chunk took 8-9x the dense GEMM, so the crossover is near 0.11).
"""
import numpy as np

from .. import _config
from . import _blas
from .._kernels import (N_SCALARS, S_ENTROPY, S_FREE, S_HARD, S_MARGIN, S_NNZ, S_ROWS,
                        S_SOFT_DIST, S_WEIGHT)
from .._moments import _METRIC_NAMES, _RESP_NAMES, Moments, _unshift, log_eps_for
from .._sources import _about, power_iteration_eigs

DEFAULT_CHUNK_ROWS = 65536
DEFAULT_SPARSE_FRACTION = 0.08
#: Cap on the ``chunk x K`` responsibility buffer (bytes); the chunk shrinks for large K.
MAX_BUFFER_BYTES = 1 << 29
#: the row kernels' launch (:func:`_row_launch`), from the row-kernel sweep on an H200
#: (1M x 384 at K = 256 and 1024, 1M x 256 at K = 20,000): a warp per row below K = 2048
#: (3x and 2x faster than the 256 threads of before at K = 256 and 1024), one thread per 32
#: centers above (at most 256: 1.4x faster than a warp at K = 20,000), 2 rows per block,
#: and at least 32 blocks per multiprocessor (the rows per block shrink for short chunks)
ROW_THREADS = 32
ROW_ENTRIES_PER_THREAD = 32
ROW_BLOCK_ROWS = 2
ROW_BLOCKS_PER_SM = 32

_NO_GPU = ("fastanneal.cuda: no usable CUDA GPU ({why}): install numba-cuda and a driver, "
           "or run on the CPU (backend='cpu'; open_parquet: device='cpu')")


def _numpy_compat():
    """numba-cuda <= 0.30 registers ``np.row_stack``, which NumPy 2.5 removed: without the
    alias the first kernel compile fails with AttributeError (seen on the H200 machine with
    NumPy 2.5.2). Restoring the removed alias (to ``np.vstack``, what it always was) is the
    smallest fix; it is done only when the attribute is missing."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def is_available():
    """True when numba.cuda can run kernels here (a GPU with a driver, or the simulator)."""
    _numpy_compat()
    try:
        from numba import cuda
    except Exception:           # numba-cuda missing or broken
        return False
    try:
        return bool(cuda.is_available())
    except Exception:
        return False


def _require_cuda():
    """The kernels module, or a RuntimeError naming what is missing."""
    if not is_available():
        try:
            import numba.cuda  # noqa: F401
            why = "numba.cuda.is_available() is False: no GPU or no driver was found"
        except Exception as exc:  # pragma: no cover - depends on the installation
            why = f"numba.cuda cannot be imported: {exc}"
        raise RuntimeError(_NO_GPU.format(why=why))
    from . import _kernels
    return _kernels


def _pow2_threads(v):
    """``v`` rounded down to a power of two in [8, 1024]."""
    return 1 << max(3, min(10, int(v).bit_length() - 1))


def _launch_params(kern):
    """(threads per row block, rows per block, (bx, by) of the GEMM blocks), from _config."""
    tpb = _pow2_threads(_config.CUDA_THREADS_PER_BLOCK)
    rows = max(1, int(_config.CUDA_ROWS_PER_BLOCK))
    return tpb, rows, kern.gemm_block_shape(min(tpb, 256))


def _row_threads(tpb, K=0):
    """Threads per row of the row-reduction kernels (responsibilities, nearest centers) for
    ``K`` centers: ``_config.CUDA_ROW_THREADS`` when set, else about one thread per
    ``ROW_ENTRIES_PER_THREAD`` centers, from one warp to 256 threads (at most ``tpb``, the
    threads per block). Tuned on a GPU with ``benchmarks/gpu_check.py``'s row-kernel sweep."""
    rt = getattr(_config, "CUDA_ROW_THREADS", None)
    if rt is not None:
        return _pow2_threads(rt)
    want = _pow2_threads(max(1, K // ROW_ENTRIES_PER_THREAD))
    return min(tpb, max(ROW_THREADS, min(256, want)))


def _row_launch(m, tpb, K=0):
    """``(rows per block, threads per row)`` of the row kernels for a chunk of ``m`` rows
    and ``K`` centers: ``_config.CUDA_ROW_BLOCK_ROWS`` rows per block (None:
    ``ROW_BLOCK_ROWS``, at most ``CUDA_ROWS_PER_BLOCK``). On a GPU, fewer when the chunk is
    short (large K), so that the grid keeps ``ROW_BLOCKS_PER_SM`` blocks per
    multiprocessor."""
    rt = _row_threads(tpb, K)
    R = getattr(_config, "CUDA_ROW_BLOCK_ROWS", None)
    R = (min(ROW_BLOCK_ROWS, int(_config.CUDA_ROWS_PER_BLOCK)) if R is None else int(R))
    if not _blas._simulator():
        R = min(R, m // (ROW_BLOCKS_PER_SM * _sm_count()))
    return max(1, R), rt


def _cdiv(a, b):
    return -(-a // b)


def _sm_count():
    from numba import cuda
    try:
        return max(1, int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    except Exception:           # the simulator's device has no attributes
        return 1


def _free_bytes():
    """Free device memory in bytes (inf under the simulator)."""
    from numba import cuda
    try:
        return float(cuda.current_context().get_memory_info().free)
    except Exception:           # pragma: no cover - depends on the driver
        return float("inf")


class _Chunk:
    """Rows ``[r0, r0 + m)`` on the device: ``X`` holds them from row ``off`` (the whole
    resident array with ``off = r0``, or a staging buffer with ``off = 0``); ``xsq`` and
    ``w`` are indexed like ``X``; ``Xv`` is the library products' view of ``X``."""
    __slots__ = ("r0", "m", "X", "Xv", "xsq", "w", "off")

    def __init__(self, r0, m, X, Xv, xsq, w, off):
        self.r0, self.m, self.X, self.Xv, self.xsq, self.w, self.off = r0, m, X, Xv, xsq, w, off

    def rows(self):
        """``X`` cut to the chunk's rows (a device view)."""
        return self.X[self.off:self.off + self.m]


class _Stager:
    """Two pinned host buffers and two device buffers of ``rows`` rows: chunk ``i`` is
    copied into pinned buffer ``i % 2`` on the host and uploaded asynchronously (legacy
    default stream, the one the kernels and CuPy use) into device buffer ``i % 2``; an
    event per buffer says when its last upload finished, so that the host never overwrites
    a pinned buffer still being read."""

    def __init__(self, cuda, rows, D, dtype, prod):
        self.rows = rows
        self.stream = cuda.default_stream()
        self.pinned = [cuda.pinned_array((rows, D), dtype=dtype) for _ in range(2)]
        self.dev = [cuda.device_array((rows, D), dtype=dtype) for _ in range(2)]
        self.view = [prod.view(d) if prod is not None else None for d in self.dev]
        self.done = [None, None]
        self._cuda = cuda

    def load(self, slot, X, r0, m):
        if self.done[slot] is not None:
            self.done[slot].synchronize()
        np.copyto(self.pinned[slot][:m], X[r0:r0 + m])
        self.dev[slot][:m].copy_to_device(self.pinned[slot][:m], stream=self.stream)
        ev = self._cuda.event()
        ev.record(self.stream)
        self.done[slot] = ev


class CudaSource:
    """Moment source whose rows live on the GPU (see :mod:`fastanneal._sources`).

    Parameters
    ----------
    X : ndarray (n, D)
        C-contiguous float32 or float64 (unit rows for cosine). Copied to the device once
        when it fits (``resident``), else streamed from this array in every pass (it must
        not change while the source is in use).
    w : ndarray (n,)
        float64 non-negative weights.
    metric : int
        0 euclidean, 1 cosine.
    resident : bool or None, default=None
        True: copy the rows to the GPU once (every pass then moves only centers and
        results); False: keep them in host memory and stream them through the GPU chunk by
        chunk in every pass (two pinned host buffers and two device buffers of one chunk
        each; the host copy of the next chunk runs while the GPU works on this one, its
        upload is queued behind that work), for data that does not fit the GPU. None:
        resident when the rows take at most ``fastanneal._config.CUDA_RESIDENT_FRACTION``
        (default 0.5) of the free device memory. ``.resident`` says which.
    products : {"auto", "cublas", "numba"} or None, default=None
        Who computes the pass's two matrix products (``X C^T`` and the dense ``R^T X``):
        cuBLAS through CuPy, or the numba.cuda kernels; None reads
        ``fastanneal._config.CUDA_PRODUCTS`` (default ``"auto"``: cuBLAS when CuPy is
        installed and a tiny product and accumulation through it check out, else the
        numba.cuda kernels; under the simulator always the kernels). ``.products`` says
        which one runs and ``.products_reason`` why (:mod:`fastanneal.cuda._blas`).

    Raises
    ------
    RuntimeError
        When no usable CUDA GPU (or the simulator) is present.
    """

    def __init__(self, X, w, metric, products=None, resident=None):
        self._k = _require_cuda()
        from numba import cuda

        self._cuda = cuda
        self._prod, self.products_reason = _blas.select(products)
        self.products = self._prod.name if self._prod is not None else "numba"
        X = np.asarray(X)
        if X.ndim != 2 or X.dtype not in (np.float32, np.float64):
            raise ValueError(f"X must be a 2-D float32/float64 array; got {X.dtype} with "
                             f"shape {X.shape}")
        if metric not in (0, 1):
            raise ValueError(f"metric must be 0 (euclidean) or 1 (cosine); got {metric!r}")
        self.metric = int(metric)
        self.n_features = X.shape[1]
        self.dtype = X.dtype
        self._buffers = None
        self._stage = None
        self._X = self._Xv = None
        self._set_rows(X, w)
        if resident is None:
            resident = self._X_host.nbytes + 16 * self.n_rows <= (
                float(getattr(_config, "CUDA_RESIDENT_FRACTION", 0.5)) * _free_bytes())
        self.resident = bool(resident)
        if self.n_rows and self.resident:
            self._X = cuda.to_device(self._X_host)
            self._Xv = self._prod.view(self._X) if self._prod is not None else None

    # ------------------------------------------------------------------ helpers
    def _chunk_rows(self, K, BM):
        c = int(getattr(_config, "CUDA_CHUNK_ROWS", DEFAULT_CHUNK_ROWS))
        c = min(c, max(BM, MAX_BUFFER_BYTES // (K * self.dtype.itemsize)))
        c = min(c, 65535 * BM, self.n_rows)     # grid.y limit of the distance kernel
        return max(1, c)

    def _chunks(self, chunk):
        """The rows as :class:`_Chunk` s of at most ``chunk`` rows, in order. Streamed
        sources upload chunk ``i + 1`` once the caller has launched its work on chunk
        ``i`` (the host copy then overlaps that work)."""
        n = self.n_rows
        starts = range(0, n, chunk)
        if self.resident:
            for r0 in starts:
                yield _Chunk(r0, min(chunk, n - r0), self._X, self._Xv, self._xsq, self._w, r0)
            return
        if self._stage is None or self._stage.rows < chunk:
            self._stage = None
            self._stage = _Stager(self._cuda, chunk, self.n_features, self.dtype, self._prod)
        st = self._stage
        X = self._X_host
        st.load(0, X, 0, min(chunk, n))
        for i, r0 in enumerate(starts):
            m = min(chunk, n - r0)
            s = i % 2
            yield _Chunk(r0, m, st.dev[s], st.view[s], self._xsq[r0:r0 + m],
                         self._w[r0:r0 + m], 0)
            nxt = r0 + chunk
            if nxt < n:
                st.load(1 - s, X, nxt, min(chunk, n - nxt))

    def _stage_rows(self):
        return max(1, min(int(getattr(_config, "CUDA_CHUNK_ROWS", DEFAULT_CHUNK_ROWS)),
                          self.n_rows))

    def _chunk_buffers(self, chunk, K):
        """The distance/responsibility buffer (at least ``chunk x K``) and the chunk's labels,
        reused while ``K`` stays and they are large enough (the kernels use the first ``m``
        rows); with library products also their view of the buffer and the flat scratch of
        the dense accumulation (:func:`._blas.scratch_elements`)."""
        b = self._buffers
        if (b is None or b[0][1] != K or b[0][0] < chunk
                or (b[4] is not None
                    and b[4].size < _blas.scratch_elements(chunk, K, self.n_features))):
            self._buffers = None        # free the old ones first
            cuda = self._cuda
            G = cuda.device_array((chunk, K), dtype=self.dtype)
            Gv = Sblk = None
            if self._prod is not None:
                Gv = self._prod.view(G)
                Sblk = self._prod.view(cuda.device_array(
                    _blas.scratch_elements(chunk, K, self.n_features), dtype=self.dtype))
            self._buffers = ((chunk, K), G, cuda.device_array(chunk, dtype=np.int32), Gv,
                             Sblk)
        return self._buffers[1], self._buffers[2]

    def _centers(self, centers):
        C = np.ascontiguousarray(centers, dtype=self.dtype)
        if C.ndim != 2 or C.shape[1] != self.n_features or C.shape[0] < 1:
            raise ValueError(f"centers must have shape (K >= 1, {self.n_features}); "
                             f"got {C.shape}")
        csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
        return C, csq

    def _launch_distances(self, kern, G, ch, dC, dcsq, bx, by, Cv=None):
        K = dC.shape[0]
        m = ch.m
        if self._prod is not None:
            # the product by cuBLAS into the chunk buffer, then the distance epilogue
            self._prod.distances(ch.Xv[ch.off:ch.off + m], Cv, self._buffers[3][:m])
            kern.distance_epilogue_kernel[(_cdiv(m, 16), _cdiv(K, 16)), (16, 16)](
                G, m, ch.xsq, ch.off, dcsq, self.metric)
            return
        grid = (_cdiv(K, kern.MICRO_D * bx), _cdiv(m, kern.MICRO_D * by))
        shm = kern.distance_shared_bytes(bx, by, self.dtype.itemsize)
        kern.distance_kernel[grid, (bx, by), 0, shm](ch.X, ch.xsq, ch.off, m, dC, dcsq,
                                                     self.metric, G)

    def _launch_rows(self, kern, G, ch, tpb, dlogp, use_prior, T, resp, labels, dHN,
                     dscal, dmn):
        R, tpb = _row_launch(ch.m, tpb, G.shape[1])
        kern.rows_kernel[_cdiv(ch.m, R), tpb, 0, kern.ROW_SLOTS * tpb * 8](
            G, ch.m, ch.w, ch.off, dlogp, use_prior, T, resp, float(log_eps_for(self.dtype)),
            R, labels, dHN, dscal, dmn)

    def _launch_dense(self, kern, G, ch, R, bx, by, dS, dN, Sv=None, Nv=None):
        K, D = dS.shape
        m, r0 = ch.m, ch.off
        if self._prod is not None:
            self._prod.accumulate(self._buffers[3][:m], ch.Xv[r0:r0 + m], self._buffers[4],
                                  Sv, Nv)
            return
        flush_tiles = max(1, R // kern.TILE_A)
        BD = kern.MICRO_A * bx
        BK = kern.MICRO_A * by
        tiles = _cdiv(D, BD) * _cdiv(K, BK)
        # enough row splits for ~8 blocks per multiprocessor; each split adds its K x D
        # partial sums with float64 atomics
        splits = max(1, min(_cdiv(8 * _sm_count(), tiles), _cdiv(m, kern.TILE_A * flush_tiles)))
        per = _cdiv(_cdiv(m, splits), kern.TILE_A) * kern.TILE_A
        splits = _cdiv(m, per)
        shm = kern.accum_shared_bytes(bx, by, self.dtype.itemsize)
        kern.accum_dense_kernel[(_cdiv(D, BD), _cdiv(K, BK), splits), (bx, by), 0, shm](
            G, ch.X, r0, m, per, flush_tiles, dS, dN)

    def _launch_sparse(self, kern, G, ch, tpb, R, dS, dN):
        D = dS.shape[1]
        kern.accum_sparse_kernel[(_cdiv(ch.m, R), _cdiv(D, tpb)), tpb, 0, 2 * tpb * 8](
            G, ch.X, ch.off, ch.m, R, dS, dN)

    # ------------------------------------------------------------------ interface
    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        """One pass over all rows: the :class:`~fastanneal.Moments` of the data (NumPy)."""
        kern = self._k
        cuda = self._cuda
        C, csq = self._centers(centers)
        K, D = C.shape
        T = float(T)
        resp = int(resp)
        hard_sums = bool(hard_sums)
        if self.n_rows == 0:
            return Moments.zeros(K, D, T, _RESP_NAMES[resp], _METRIC_NAMES[self.metric],
                                 hard_sums)
        use_prior = log_prior is not None
        logp = (np.ascontiguousarray(log_prior, dtype=np.float64) if use_prior
                else np.zeros(K))
        tpb, R, (bx, by) = _launch_params(kern)
        chunk = self._chunk_rows(K, kern.MICRO_D * by)
        frac = float(getattr(_config, "CUDA_SPARSE_FRACTION", DEFAULT_SPARSE_FRACTION))

        dC = cuda.to_device(C)
        dcsq = cuda.to_device(csq)
        dlogp = cuda.to_device(logp)
        dN = cuda.to_device(np.zeros(K))
        dS = cuda.to_device(np.zeros((K, D)))
        dHN = cuda.to_device(np.zeros(K))
        dHS = cuda.to_device(np.zeros((K, D))) if hard_sums else None
        dscal = cuda.to_device(np.zeros(N_SCALARS))
        dmn = cuda.to_device(np.full(1, np.inf))
        G, labels = self._chunk_buffers(chunk, K)
        prod = self._prod
        Cv = prod.view(dC) if prod is not None else None
        Sv = prod.view(dS) if prod is not None else None
        Nv = prod.view(dN) if prod is not None else None

        nnz_before = 0.0
        for ch in self._chunks(chunk):
            m = ch.m
            self._launch_distances(kern, G, ch, dC, dcsq, bx, by, Cv)
            self._launch_rows(kern, G, ch, tpb, dlogp, use_prior, T, resp, labels, dHN,
                              dscal, dmn)
            nnz_now = float(dscal.copy_to_host()[S_NNZ])     # (syncs once per chunk)
            nnz = nnz_now - nnz_before
            nnz_before = nnz_now
            if nnz <= frac * m * K:
                self._launch_sparse(kern, G, ch, tpb, R, dS, dN)
            else:
                self._launch_dense(kern, G, ch, R, bx, by, dS, dN, Sv, Nv)
            if hard_sums:
                kern.scatter_rows_kernel[(_cdiv(m, R), _cdiv(D, tpb)), tpb](
                    ch.X, ch.off, m, labels, 0, ch.w, ch.off, R, dHS)
        sc = dscal.copy_to_host()
        return Moments(
            N=dN.copy_to_host(), S=dS.copy_to_host(), soft_distortion=float(sc[S_SOFT_DIST]),
            entropy=float(sc[S_ENTROPY]), free_energy=float(sc[S_FREE]),
            hard_distortion=float(sc[S_HARD]), hard_counts=dHN.copy_to_host(),
            hard_sums=dHS.copy_to_host() if hard_sums else None, weight=float(sc[S_WEIGHT]),
            rows=int(sc[S_ROWS]), margin_sum=float(sc[S_MARGIN]),
            min_margin=float(dmn.copy_to_host()[0]), nnz=int(sc[S_NNZ]), temperature=T,
            responsibilities=_RESP_NAMES[resp], metric=_METRIC_NAMES[self.metric])

    def _assign_device(self, centers):
        kern = self._k
        cuda = self._cuda
        C, csq = self._centers(centers)
        K = C.shape[0]
        tpb, R, (bx, by) = _launch_params(kern)
        chunk = self._chunk_rows(K, kern.MICRO_D * by)
        dC = cuda.to_device(C)
        dcsq = cuda.to_device(csq)
        labels = cuda.device_array(self.n_rows, dtype=np.int64)
        dmin = cuda.device_array(self.n_rows, dtype=np.float64)
        margin = cuda.device_array(self.n_rows, dtype=np.float64)
        G, _ = self._chunk_buffers(chunk, K)
        Cv = self._prod.view(dC) if self._prod is not None else None
        for ch in self._chunks(chunk):
            self._launch_distances(kern, G, ch, dC, dcsq, bx, by, Cv)
            Rr, rt = _row_launch(ch.m, tpb, K)
            kern.argmin_kernel[_cdiv(ch.m, Rr), rt, 0, kern.ROW_SLOTS * rt * 8](
                G, ch.m, Rr, ch.r0, labels, dmin, margin)
        return labels, dmin, margin

    def assign(self, centers):
        """``(labels, d_min, margin)`` of every row (NumPy; ``margin = d_(2) - d_(1)``)."""
        if self.n_rows == 0:
            return (np.empty(0, np.int64), np.empty(0), np.empty(0))
        labels, dmin, margin = self._assign_device(centers)
        return labels.copy_to_host(), dmin.copy_to_host(), margin.copy_to_host()

    def _weighted_row_sums(self, labels, use_labels, wts, K):
        """``out[k] = sum_{labels_i = k} wts_i x_i`` (K x D, float64) on the device."""
        kern = self._k
        tpb, R, _ = _launch_params(kern)
        out = self._cuda.to_device(np.zeros((K, self.n_features)))
        for ch in self._chunks(self._stage_rows()):
            kern.scatter_rows_kernel[(_cdiv(ch.m, R), _cdiv(self.n_features, tpb)), tpb](
                ch.X, ch.off, ch.m, labels, ch.r0 if use_labels else -1, wts, ch.r0, R, out)
        return out.copy_to_host()

    def mean(self):
        """Weighted mean of the rows (float64)."""
        if self.n_rows == 0:
            return np.full(self.n_features, np.nan)
        dummy = self._cuda.to_device(np.zeros(1, dtype=np.int64))
        return self._weighted_row_sums(dummy, False, self._w, 1)[0] / self.total_weight

    def sample(self, n, rng):
        """``(rows, weights)``: ``n`` rows drawn without replacement (all rows if n >= n_rows)."""
        if n >= self.n_rows:
            if self.n_rows == 0:
                return np.empty((0, self.n_features), self.dtype), self._w_host
            return self._X_host.copy(), self._w_host
        idx = np.sort(rng.choice(self.n_rows, size=n, replace=False))
        # (from the host array the source was built from: the same rows, no device round
        # trip, and the same for resident and streamed sources)
        return np.ascontiguousarray(self._X_host[idx]), self._w_host[idx]

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False,
                                means=None, tol=None, start=None):
        """``lambda_max`` of each hard cluster's weighted covariance (1/W_k), by power
        iteration with a device matvec (:func:`~fastanneal._sources.power_iteration_eigs`)."""
        kern = self._k
        cuda = self._cuda
        centers = np.asarray(centers, dtype=np.float64)
        K = centers.shape[0]
        if self.n_rows == 0:
            lam = np.zeros(K)
            return (lam, np.zeros((K, centers.shape[1]))) if return_vectors else lam
        if K == 1:
            use_labels = False
            dlabels = cuda.to_device(np.zeros(1, dtype=np.int64))
            labels = np.zeros(self.n_rows, dtype=np.int64)
        else:
            use_labels = True
            dlabels = self._assign_device(centers)[0]
            labels = dlabels.copy_to_host()
        wk = np.bincount(labels, weights=self._w_host, minlength=K)
        tpb, R, _ = _launch_params(kern)
        s = cuda.device_array(self.n_rows, dtype=np.float64)

        def matvec(mu, V):
            dmu = cuda.to_device(np.ascontiguousarray(mu, dtype=np.float64))
            dV = cuda.to_device(np.ascontiguousarray(V, dtype=np.float64))
            for ch in self._chunks(self._stage_rows()):
                a, b = ch.r0, ch.r0 + ch.m
                kern.rowdot_kernel[_cdiv(ch.m, R), tpb, 0, tpb * 8](
                    ch.rows(), ch.m, dlabels[a:b] if use_labels else dlabels, use_labels,
                    dmu, dV, self._w[a:b], R, s[a:b])
            sx = self._weighted_row_sums(dlabels, use_labels, s, K)
            ssum = np.bincount(labels, weights=s.copy_to_host(), minlength=K)
            return sx - mu * ssum[:, None]
        return power_iteration_eigs(matvec, _about(centers, means), wk, n_iter, rng,
                                    return_vectors, tol=tol, start=start)


    # ------------------------------------------------------------------ host-side passes
    # Passes that run once per fit, or whose CUDA kernel does not exist yet, use the host
    # array the source was built from (no copy): the covariance for T_c without the library
    # products, the distinct-row
    # count, the checkpoint key and the gradient's two passes (they keep every
    # responsibility, which the device moments pass does not; device kernels for them are
    # future work).
    def grad_forward(self, centers, T, resp):
        from ..gradient import forward_moments
        return forward_moments(self._X_host, self._w_host, centers, T, self.metric, resp)

    def grad_moments(self, centers, T, resp, globals_):
        from ..gradient import backward_moments
        return backward_moments(self._X_host, self._w_host, centers, T, self.metric, resp,
                                globals_)

    def covariance(self, mean):
        """The weighted covariance about ``mean`` (D x D float64, for the critical
        temperature): on the device when the library products are in use (a float64 GEMM of
        the centered rows per block), else on the host."""
        from .._sources import COVARIANCE_MAX_D, exact_covariance
        if self._prod is None or self.n_rows == 0 or self.n_features > COVARIANCE_MAX_D:
            return exact_covariance(self._X_host, self._w_host, mean)
        D = self.n_features
        mean = np.asarray(mean, dtype=np.float64)
        try:
            dout = self._cuda.to_device(np.zeros((D, D)))
            out = self._prod.view(dout)
            for ch in self._chunks(self._stage_rows()):
                self._prod.scatter(ch.Xv[ch.off:ch.off + ch.m],
                                   self._prod.view(ch.w)[ch.off:ch.off + ch.m], mean, out)
            return dout.copy_to_host() / self.total_weight
        except MemoryError:
            # the float64 blocks did not fit beside the rows (CuPy's OutOfMemoryError is a
            # MemoryError): the host computes it
            return exact_covariance(self._X_host, self._w_host, mean)
        finally:
            self._prod.release()

    def n_distinct_rows(self, rng, cap):
        from .._sources import n_distinct_rows
        return n_distinct_rows(self._X_host, self._w_host, rng, cap)

    def objective(self, centers):
        """``(J, hard_counts)`` at ``centers``: the labels from the device, each row's
        distance to its center summed in float64 on the host copy of the rows (O(n D),
        no K term on the CPU; ``inertia_`` as ``score`` computes it)."""
        from .. import _kernels as K_
        labels = np.ascontiguousarray(self.labels(centers), dtype=np.int64)
        C = np.ascontiguousarray(centers, dtype=np.float64)
        d = np.empty(labels.shape[0])
        if labels.shape[0]:
            K_.labelled_distances_kernel(self._X_host, C, labels,
                                         np.full_like(labels, -1),
                                         int(self.metric), d)
        w = np.asarray(self._w_host, dtype=np.float64)
        return float(w @ d), np.bincount(labels, weights=w,
                                         minlength=C.shape[0]).astype(np.float64)

    def labels(self, centers):
        return self.assign(centers)[0]

    def fingerprint(self):
        from .._sources import data_fingerprint
        # the in-memory source's fingerprint: a checkpoint written on one backend resumes
        # on the other (docs/guide/resume.md: the backend does not change the result)
        return data_fingerprint(self._X_host, self._w_host, self.metric)

    def close(self):
        self._X = self._w = self._xsq = self._Xv = None
        self._buffers = self._stage = None

    def _set_rows(self, X, w):
        """The host rows ``(X, w)`` of this source (C-contiguous, this source's dtype; the
        caller's array when it already is: host-side passes and streaming read it), their
        weights and squared norms uploaded; the staging and chunk buffers are kept, so
        :class:`CudaBlocks` calls it once per block."""
        X = np.ascontiguousarray(X, dtype=self.dtype)
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"X must have shape (n, {self.n_features}); got {X.shape}")
        w = np.ascontiguousarray(w, dtype=np.float64)
        if w.shape != (X.shape[0],):
            raise ValueError(f"w must have shape ({X.shape[0]},); got {w.shape}")
        self._X_host, self._w_host = X, w
        self.n_rows = X.shape[0]
        self.total_weight = float(w.sum())
        self._w = self._xsq = None
        if self.n_rows:
            self._w = self._cuda.to_device(w)
            self._xsq = self._cuda.to_device(np.einsum("ij,ij->i", X, X, dtype=np.float64))


class CudaBlocks:
    """Moments of host row blocks on the GPU, block after block, with one set of device
    buffers: the out-of-core route's per-block pass (``open_parquet(..., device="cuda")``
    decodes a row group on the CPU and reduces it here). Each block's rows are streamed
    through the GPU as in :class:`CudaSource` with ``resident=False``; ``products`` as
    there.

    ``moments(X, w, C, T, resp, log_prior, hard_sums)`` (``resp``: 0 softmax, 1 entmax15,
    2 hard, as every source's ``moments``) returns the block's
    :class:`~fastanneal.Moments` (NumPy), the contract of every backend: blocks add up.
    """

    def __init__(self, n_features, dtype, metric, products=None):
        self._src = CudaSource(np.zeros((0, int(n_features)), dtype=dtype), np.zeros(0),
                               metric, products=products, resident=False)
        self.products = self._src.products
        self.products_reason = self._src.products_reason

    def moments(self, X, w, centers, T, resp=0, log_prior=None, hard_sums=False):
        self._src._set_rows(X, w)
        return self._src.moments(centers, T, resp, log_prior, hard_sums)

    def close(self):
        self._src.close()


def cuda_moments(X, centers, T, weights=None, metric="euclidean", responsibilities="softmax",
                 log_prior=None, hard_sums=True, products=None):
    """Moments of the rows ``X`` on the GPU: the CUDA twin of :func:`fastanneal.moments`.

    Same parameters, validation and result (a :class:`~fastanneal.Moments` of NumPy arrays)
    as :func:`fastanneal.moments`; ``X`` is copied to the device for this one call (hold the
    data with :class:`CudaSource` to keep it there across calls). ``products`` as for
    :class:`CudaSource`.

    Raises
    ------
    RuntimeError
        When no usable CUDA GPU (or the numba-cuda simulator) is present.
    """
    _require_cuda()
    from .._moments import checked_moments_args
    X, C, mc, shift, rc, T, w, log_prior = checked_moments_args(
        X, centers, T, weights, metric, responsibilities, log_prior)
    return _unshift(CudaSource(X, w, mc, products).moments(C, T, rc, log_prior, hard_sums),
                    shift)


__all__ = ["CudaBlocks", "CudaSource", "cuda_moments", "is_available"]

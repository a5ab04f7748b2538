"""The two matrix products of a CUDA moments pass through a library GEMM (cuBLAS, by CuPy).

A pass has two products per chunk of rows: the distances' ``X C^T`` and the dense
accumulation ``R^T X`` (the rest of the pass: :mod:`fastanneal.cuda._kernels`). The numba.cuda
kernels compute both with SIMT FMAs (7-15 TFLOP/s on an H200, against ~49 for cuBLAS sgemm
without TF32; a whole pass through this module measured 3.3-8.1x one GEMM there, BENCHMARKS
§8); :class:`CupyProducts` hands them to cuBLAS through CuPy and leaves the rest
of the pass (distance epilogue, responsibilities, sparse accumulation, hard sums) to the
numba.cuda kernels, which read and write the same device buffers (CuPy views them through
``__cuda_array_interface__``; no copies). Both libraries launch on the legacy default
stream, so the kernels and the GEMMs run in launch order.

Why CuPy: it is the maintained Python binding of cuBLAS that accepts Numba's device arrays
without a copy, ships as a wheel per CUDA major version (``cupy-cuda12x``), and exposes
``matmul(..., out=)``, so no per-chunk allocation is needed. The ``cuda`` extra installs it
(``cupy-cuda12x``); without it the pass uses the numba.cuda products.

Precision: the products run in the rows' dtype (float32 sgemm without TF32, unless the
user sets ``CUPY_TF32=1``); the dense accumulation is summed by cuBLAS over at most
``CUDA_BLAS_ACCUM_ROWS`` rows (default 16384) and then added into the float64
accumulators, as the CPU sums 512-row blocks in float32 GEMMs; the column sums ``N`` are a
product with a row of ones, added in float64 the same way (on an H200 a CuPy reduction over
the rows axis took longer than the GEMM beside it).

:class:`SimulatedProducts` does the same two products with NumPy on the arrays behind the
numba-cuda simulator's device arrays, so that the orchestration and the epilogue kernel are
tested without a GPU; it is used only under ``NUMBA_ENABLE_CUDASIM=1``.
"""
import contextlib

import numpy as np

from .. import _config

DEFAULT_ACCUM_ROWS = 16384
MODES = ("auto", "cublas", "numba")


def accum_rows():
    """Rows per dense-accumulation GEMM (``_config.CUDA_BLAS_ACCUM_ROWS``)."""
    return max(1, int(getattr(_config, "CUDA_BLAS_ACCUM_ROWS", DEFAULT_ACCUM_ROWS)))


def _simulator():
    from numba import config
    return bool(getattr(config, "ENABLE_CUDASIM", 0))


class CupyProducts:
    """cuBLAS products on Numba device arrays, through CuPy views (no copies)."""

    name = "cublas"

    def __init__(self):
        import cupy
        self.cp = cupy
        # the legacy default stream, the one the numba.cuda kernels run on: the products
        # stay in order with them even when the caller made another CuPy stream current
        self.stream = cupy.cuda.Stream.null

    def view(self, dev):
        """A CuPy array over the memory of a Numba device array (or a slice of one)."""
        return self.cp.asarray(dev)

    def distances(self, Xv, Cv, Gv):
        """``Gv[:] = Xv @ Cv.T`` (all CuPy views, the rows' dtype)."""
        with self.stream:
            self.cp.matmul(Xv, Cv.T, out=Gv)

    def accumulate(self, Gv, Xv, Sblk, S, N):
        """``S += Gv^T Xv`` and ``N += column sums of Gv`` (``S``, ``N`` float64; ``Sblk``
        a flat scratch in the rows' dtype of at least ``scratch_elements(m, K, D)``
        elements), ``accum_rows()`` rows per GEMM, whose sums in the rows' dtype are then
        added in float64. The column sums are a product with a row of ones too (on an H200 a
        CuPy reduction over the rows axis took longer than the GEMM beside it); they are
        therefore float32 sums over up to ``accum_rows()`` rows for float32 data (measured
        error relative to the total weight 7e-10 at high T, against 5e-12 for a float64
        sum; the CPU and the numba.cuda kernels sum ``N`` in float64)."""
        cp = self.cp
        step = accum_rows()
        m, K = Gv.shape
        D = Xv.shape[1]
        n_off, o_off = _scratch_offsets(K, D)
        blk = Sblk[:K * D].reshape(K, D)
        nblk = Sblk[n_off:n_off + K].reshape(1, K)
        ones = Sblk[o_off:o_off + min(m, step)]
        with self.stream:
            ones.fill(1)
            for a in range(0, m, step):
                g = Gv[a:a + step]
                cp.matmul(g.T, Xv[a:a + step], out=blk)
                cp.add(S, blk, out=S)
                cp.matmul(ones[:g.shape[0]].reshape(1, -1), g, out=nblk)
                cp.add(N, nblk[0], out=N)

    def scatter(self, Xv, wv, mean, out):
        """``out += sum w (x - mean)(x - mean)^T`` over the rows ``Xv`` with weights ``wv``
        (``out`` D x D float64; the centered rows in float64, one ``Z^T Z`` per
        ``accum_rows()`` rows, as the host's ``scatter_matrix``)."""
        cp = self.cp
        step = accum_rows()
        with self.stream:
            mu = cp.asarray(mean, dtype=cp.float64)
            for a in range(0, Xv.shape[0], step):
                Z = Xv[a:a + step].astype(cp.float64)
                Z -= mu
                Z *= cp.sqrt(cp.maximum(wv[a:a + step], 0.0))[:, None]
                out += Z.T @ Z

    def release(self):
        """Hand the library's cached temporaries back to the device (CuPy keeps freed blocks
        in its pool, out of reach of Numba's allocations)."""
        self.cp.get_default_memory_pool().free_all_blocks()


def _scratch_offsets(K, D):
    """Offsets of the ``N`` block and of the row of ones in the accumulation scratch (each
    rounded up to 64 elements, so that every region starts aligned)."""
    n_off = -(-K * D // 64) * 64
    return n_off, -(-(n_off + K) // 64) * 64


def scratch_elements(chunk, K, D):
    """Elements of the scratch that :meth:`CupyProducts.accumulate` needs for chunks of at
    most ``chunk`` rows (with the current ``accum_rows()``)."""
    return _scratch_offsets(K, D)[1] + max(1, min(chunk, accum_rows()))


class SimulatedProducts(CupyProducts):
    """The same products with NumPy on the simulator's device arrays (tests only)."""

    name = "cublas (simulated)"

    def __init__(self):
        self.cp = np
        self.stream = contextlib.nullcontext()

    def view(self, dev):
        return dev._ary            # the ndarray behind a FakeCUDAArray (slices share it)

    def release(self):
        pass


def _smoke(prod):
    """Both operations of ``prod`` once on tiny Numba device arrays, checked against NumPy:
    catches a CuPy that imports but cannot run here (driver / CUDA version mismatch, no
    interoperability, no NVRTC for the element-wise kernels ``accumulate`` compiles)
    before a fit depends on it."""
    from numba import cuda
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    b = np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32)
    da, db = cuda.to_device(a), cuda.to_device(b)
    dg = cuda.device_array((3, 2), dtype=np.float32)
    prod.distances(prod.view(da), prod.view(db), prod.view(dg))
    got = dg.copy_to_host()
    if not np.allclose(got, a @ b.T, rtol=1e-6, atol=1e-6):
        raise RuntimeError(f"a 3 x 2 product gave {got.tolist()}, not {(a @ b.T).tolist()}")
    dS, dN = cuda.to_device(np.ones((2, 2))), cuda.to_device(np.ones(2))
    dSb = cuda.device_array(scratch_elements(3, 2, 2), dtype=np.float32)
    prod.accumulate(prod.view(dg), prod.view(da), prod.view(dSb), prod.view(dS),
                    prod.view(dN))
    g = a @ b.T
    S, N = dS.copy_to_host(), dN.copy_to_host()
    if not (np.allclose(S, 1.0 + g.T @ a, rtol=1e-6) and np.allclose(N, 1.0 + g.sum(0),
                                                                      rtol=1e-6)):
        raise RuntimeError(f"a 3-row accumulation gave S = {S.tolist()}, N = {N.tolist()}")


_SMOKED = {}


def _smoke_once(prod):
    """:func:`_smoke` once per process, library class and device: its verdict (pass, or
    the error it raised) is kept, so that a source made per batch does not launch it
    again."""
    from numba import cuda
    try:
        dev = int(cuda.get_current_device().id)
    except Exception:             # pragma: no cover - depends on the driver
        dev = -1
    key = (type(prod), dev)
    if key not in _SMOKED:
        try:
            _smoke(prod)
            _SMOKED[key] = None
        except Exception as exc:
            _SMOKED[key] = (type(exc), exc.args)      # not the frames of its traceback
    if _SMOKED[key] is not None:
        cls, args = _SMOKED[key]
        try:
            err = cls(*args)
        except Exception:                                # an exception type with odd args
            err = RuntimeError(*args)
        raise err


def select(mode=None):
    """``(products or None, reason)`` for ``mode`` (default ``_config.CUDA_PRODUCTS``):

    - ``"numba"``: None (the numba.cuda products);
    - ``"cublas"``: cuBLAS through CuPy; a RuntimeError naming what is missing when CuPy
      cannot be imported (under the simulator: :class:`SimulatedProducts`);
    - ``"auto"``: cuBLAS when CuPy imports on a real GPU and a tiny product through it is
      right (:func:`_smoke`), else None with the reason.
    """
    mode = getattr(_config, "CUDA_PRODUCTS", "auto") if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"CUDA products must be one of {MODES}; got {mode!r} (from "
                         f"fastanneal._config.CUDA_PRODUCTS / FASTANNEAL_CUDA_PRODUCTS or "
                         f"products=)")
    if mode == "numba":
        return None, "numba.cuda products (asked for)"
    if _simulator():
        if mode == "cublas":
            return SimulatedProducts(), "cuBLAS stand-in: NumPy under the numba-cuda simulator"
        return None, "numba.cuda products: the simulator has no cuBLAS"
    try:
        prod = CupyProducts()
        _smoke_once(prod)
    except Exception as exc:      # ImportError, or CuPy's own errors (no CUDA runtime)
        why = (f"CuPy is not usable here ({type(exc).__name__}: {exc}); install "
               f"cupy-cuda12x (or the wheel for your CUDA major version)")
        if mode == "cublas":
            raise RuntimeError(f"fastanneal.cuda: cuBLAS products were asked for, but {why}")
        return None, f"numba.cuda products: {why}"
    return prod, "cuBLAS through CuPy"

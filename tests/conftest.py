"""Shared test setup.

The CUDA tests run on the numba-cuda simulator unless FASTANNEAL_REAL_CUDA=1 is set (on a
machine with a GPU). The variable must be set before anything imports numba.cuda.
"""
import os
import zlib
from pathlib import Path

if os.environ.get("FASTANNEAL_REAL_CUDA") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _serialise_simulator_shared_arrays():
    """numba-cuda's simulator creates a static ``cuda.shared.array`` lazily per block with an
    unlocked check-then-insert (``FakeCUDAShared.array``): two simulated threads can race and
    each get a private copy, so a shared counter is not shared (seen as a rare IndexError in
    ``accum_sparse_kernel``). Real GPUs allocate static shared memory before launch; this
    makes the simulator do the equivalent by serialising the lazy allocation."""
    import threading
    try:
        from numba.cuda.simulator import kernelapi
    except ImportError:
        return
    import sys
    import traceback
    cls = kernelapi.FakeCUDAShared
    if getattr(cls, "_fastanneal_locked", False):
        return
    original = cls.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:        # dynamic shared memory: no race
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        # same key as the simulator: the kernel source line that asks for the array
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    cls.array = array
    cls._fastanneal_locked = True


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    _serialise_simulator_shared_arrays()

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "clinc150.parquet"


def require_library_products():
    """The library-product path (cuBLAS by CuPy) of the CUDA tests: on the simulator NumPy
    stands in for cuBLAS, so it always runs; on a real GPU (FASTANNEAL_REAL_CUDA=1) without
    a usable CuPy the test skips, naming why (the GPU machine's image decides)."""
    require_cuda()
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    from fastanneal.cuda import _blas
    try:
        _blas.select("cublas")
    except RuntimeError as exc:
        # only with FASTANNEAL_REAL_CUDA=1: the GPU machine's image has no usable CuPy; the
        # numba.cuda products are still tested there by every other CUDA test
        pytest.skip(f"FASTANNEAL_REAL_CUDA=1 without a usable CuPy: {exc}")


def count_library_products(monkeypatch):
    """Count the calls of the library-product path (the simulator's NumPy stand-in for
    cuBLAS): ``{"distances": n, "accumulate": n}``, so that a test can tell the path ran
    (results alone are the same either way). Real-GPU runs count CuPy's calls."""
    from fastanneal.cuda import _blas
    calls = {"distances": 0, "accumulate": 0}
    for cls in (_blas.SimulatedProducts, _blas.CupyProducts):
        for name in calls:
            real = getattr(cls, name)

            def counted(self, *a, _real=real, _name=name, **k):
                calls[_name] += 1
                return _real(self, *a, **k)
            monkeypatch.setattr(cls, name, counted)
    return calls


def require_cuda():
    """CUDA tests run on the simulator (numba-cuda is in the test extra), so an unavailable
    backend is a broken install and fails the test; only with FASTANNEAL_REAL_CUDA=1 on a
    machine without a GPU is it a skip (the variable asks for real hardware)."""
    from fastanneal import cuda
    if cuda.is_available():
        return
    if os.environ.get("FASTANNEAL_REAL_CUDA") == "1":
        pytest.skip("FASTANNEAL_REAL_CUDA=1 but no CUDA device is visible")
    pytest.fail("fastanneal.cuda.is_available() is False although the numba-cuda simulator "
                "is enabled: install the test extra (numba-cuda==0.30.4)")


def pytest_addoption(parser):
    parser.addoption("--fresh-seeds", action="store_true",
                     help="draw a fresh seed for every test that uses the rng fixture (and "
                          "random hypothesis examples); the seeds are printed. Default: the "
                          "seed derives from the test id, so every run checks the same cases")


def pytest_configure(config):
    try:
        from hypothesis import settings
    except ImportError:  # pragma: no cover
        return
    settings.register_profile("reproducible", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile("explore" if config.getoption("--fresh-seeds") else "reproducible")


@pytest.fixture
def rng(request):
    """A generator per test, seeded from the test id (crc32 of the node id, so a clean
    checkout always runs the same cases); ``--fresh-seeds`` draws a fresh seed instead. The
    seed is printed (shown with the output of a failing test)."""
    if request.config.getoption("--fresh-seeds"):
        seed = int(np.random.SeedSequence().entropy % (2 ** 32))
    else:
        seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed = {seed}")
    return np.random.default_rng(seed)


def blobs(n, k, d, seed, sep=6.0, dtype=np.float64):
    """``n`` rows around ``k`` Gaussian centers (spread ``sep``) in ``d`` dimensions, unit
    noise; returns ``(X, labels)``. Shared by the Dask and resume tests."""
    g = np.random.default_rng(seed)
    centers = g.normal(0.0, sep, (k, d))
    y = g.integers(0, k, n)
    X = centers[y] + g.normal(0.0, 1.0, (n, d))
    return X.astype(dtype), y

"""GPU variant of the moments kernels (numba.cuda; ``pip install numba-cuda``).

``import fastanneal.cuda`` is cheap and does not import ``numba.cuda``; constructing a
:class:`CudaSource` or calling :func:`cuda_moments` does, and raises a clear
``RuntimeError`` when no usable GPU is present. Tests run the kernels on the numba-cuda
simulator (``NUMBA_ENABLE_CUDASIM=1``).
"""
from .source import CudaBlocks, CudaSource, cuda_moments, is_available

__all__ = ["CudaBlocks", "CudaSource", "cuda_moments", "is_available"]

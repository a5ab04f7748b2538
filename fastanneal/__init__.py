"""fastanneal: annealed soft k-means for dense embeddings, Numba-compiled and CPU-first."""
__version__ = "0.1.0"

from ._moments import (Moments, assign, entmax15, moments, pairwise_distances,  # noqa: F401
                       responsibilities)

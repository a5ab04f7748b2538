"""fastanneal: annealed soft k-means for dense embeddings, Numba-compiled and CPU-first."""
__version__ = "0.1.0"

from ._moments import (Moments, assign, entmax15, moments, pairwise_distances,  # noqa: F401
                       responsibilities)
from .estimator import AnnealedKMeans, AnnealingWarning  # noqa: F401,E402
from .schedules import (ConstantSchedule, CriticalSchedule, GeometricSchedule,  # noqa: F401,E402
                        LinearSchedule, Schedule)

"""fastanneal: annealed soft k-means for dense embeddings, Numba-compiled and CPU-first.

Public names: :func:`moments` (the moments contract), :class:`Moments`,
:func:`value_and_grad`, :class:`AnnealedKMeans`, :class:`MiniBatchAnnealedKMeans`, the schedules, and the helpers
:func:`responsibilities`, :func:`pairwise_distances`, :func:`assign`, :func:`entmax15`.
Heavy modules (the estimator pulls in scikit-learn) load on first use, so that
``import fastanneal`` stays fast.
"""
__version__ = "0.1.0"

from ._moments import (Moments, assign, entmax15, moments, pairwise_distances,  # noqa: F401
                       responsibilities)

_LAZY = {
    "AnnealedKMeans": ("estimator", "AnnealedKMeans"),
    "MiniBatchAnnealedKMeans": ("estimator", "MiniBatchAnnealedKMeans"),
    "AnnealingWarning": ("_engine", "AnnealingWarning"),
    "CheckpointWarning": ("_checkpoint", "CheckpointWarning"),
    "SourceError": ("_protocol", "SourceError"),
    "Schedule": ("schedules", "Schedule"),
    "ConstantSchedule": ("schedules", "ConstantSchedule"),
    "GeometricSchedule": ("schedules", "GeometricSchedule"),
    "LinearSchedule": ("schedules", "LinearSchedule"),
    "CriticalSchedule": ("schedules", "CriticalSchedule"),
    "AdaptiveSchedule": ("adaptive", "AdaptiveSchedule"),
    "value_and_grad": ("gradient", "value_and_grad"),
    "Loss": ("gradient", "Loss"),
    "suggest_k": ("choose_k", "suggest_k"),
    "KSuggestion": ("choose_k", "KSuggestion"),
    "QueryClusters": ("queries", "QueryClusters"),
    "open_parquet": ("_parquet", "open_parquet"),
}

__all__ = ["Moments", "assign", "entmax15", "moments", "pairwise_distances",
           "responsibilities", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{mod}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastanneal' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

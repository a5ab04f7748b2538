"""The moment-source protocol: what the annealing engine needs from where the data lives.

Every backend -- rows in memory (:class:`fastanneal._sources.InMemorySource`), on a GPU
(:class:`fastanneal.cuda.CudaSource`), persisted on a Dask cluster
(:class:`fastanneal.dask.DaskSource`) -- implements all of it; the engine and the estimators
call these methods and nothing else (no capability probing). Each method is a full pass
that a backend computes as a sum of per-block records (:class:`~fastanneal.Moments`,
:class:`~fastanneal.gradient.GradMoments`, arrays) merged associatively.

To add a backend: implement the attributes and methods below over your storage, map the
CPU kernels (or your own kernels with the same contract) over your blocks and add the
records; ``tests/test_protocol.py`` runs the same conformance checks on every source.
"""
from typing import Optional, Protocol, Tuple, runtime_checkable

import numpy as np


@runtime_checkable
class MomentSource(Protocol):
    """The data of one fit, as the engine sees it.

    Attributes: ``n_rows``, ``n_features``, ``dtype`` (float32/float64), ``total_weight``
    (``W = sum w``), ``metric`` (0 euclidean, 1 cosine: rows are unit vectors).
    """
    n_rows: int
    n_features: int
    dtype: np.dtype
    total_weight: float
    metric: int

    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        """One pass: the merged :class:`~fastanneal.Moments` of all rows at ``(centers, T)``
        (``resp``: 0 softmax, 1 entmax15, 2 hard)."""

    def grad_moments(self, centers, T, resp, globals_):
        """One backward pass of the gradient (:class:`~fastanneal.gradient.GradMoments`),
        given the forward pass's globals (:class:`~fastanneal.gradient.GradGlobals`)."""

    # Optional: ``grad_forward(centers, T, resp)``, the gradient's forward pass
    # (:class:`~fastanneal.gradient.GradForward`: soft counts and sums with every
    # responsibility kept). Every built-in source has it; a source without it gets the
    # forward sums from ``moments``, whose dropped entries make the gradient that of the
    # truncated responsibilities (:func:`fastanneal.gradient.value_and_grad_from_source`).

    def mean(self) -> np.ndarray:
        """Weighted mean of the rows (float64, (D,))."""

    def covariance(self, mean) -> Optional[np.ndarray]:
        """Weighted covariance ``sum w (x - mean)(x - mean)^T / W`` (D x D, float64), or None
        when D is too large to form it (the engine then uses Lanczos)."""

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False,
                                means=None, tol=None,
                                start=None) -> Tuple[np.ndarray, np.ndarray]:
        """``lambda_max`` of the weighted covariance (1/W_k) of each cluster of the hard
        partition induced by ``centers``, about ``means`` (K, D) when given (else about
        the centers); with ``return_vectors`` ``(lam, V)``. ``tol`` and ``start`` (K, D)
        are the convergence tolerance and warm-start vectors of the Lanczos iteration
        (:func:`fastanneal._sources.power_iteration_eigs`); sources written before these
        keywords existed still work (the engine passes them only to sources that take
        them)."""

    def sample(self, n, rng) -> Tuple[np.ndarray, np.ndarray]:
        """``(rows, weights)``: ``n`` rows without replacement, in row order (seeding)."""

    def n_distinct_rows(self, rng, cap) -> int:
        """Distinct rows with non-zero weight (counted at least up to ``cap``)."""

    def labels(self, centers) -> Optional[np.ndarray]:
        """Hard labels of all rows (None where the rows are too many to gather)."""

    def fingerprint(self) -> str:
        """A key of the data (and weights) for checkpoints: equal keys mean equal data."""

    def close(self) -> None:
        """Release what the source holds (persisted chunks, device memory, a cluster)."""


def check_source(source):
    """Raise ``TypeError`` naming what a user-supplied source lacks."""
    if not isinstance(source, MomentSource):
        missing = [n for n in ("n_rows", "n_features", "dtype", "total_weight", "metric",
                               "moments", "grad_moments", "mean", "covariance",
                               "cluster_top_eigenvalues", "sample", "n_distinct_rows",
                               "labels", "fingerprint", "close") if not hasattr(source, n)]
        raise TypeError(f"{type(source).__name__} is not a moment source (missing: "
                        f"{', '.join(missing)}); see fastanneal._protocol.MomentSource")
    return source

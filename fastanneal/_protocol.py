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
import functools
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


_NAMES = ("n_rows", "n_features", "dtype", "total_weight", "metric", "moments",
          "grad_moments", "mean", "covariance", "cluster_top_eigenvalues", "sample",
          "n_distinct_rows", "labels", "fingerprint", "close")


def check_source(source):
    """Raise ``TypeError`` naming what a user-supplied source lacks."""
    if not isinstance(source, MomentSource):
        missing = [n for n in _NAMES if getattr(source, n, None) is None]
        raise TypeError(f"{type(source).__name__} is not a moment source (missing: "
                        f"{', '.join(missing) or 'a method of the protocol'}); see "
                        "fastanneal._protocol.MomentSource")
    return source


class SourceError(ValueError):
    """What a user-written moment source returned is not what the protocol says."""


def _bad(src, what, msg):
    raise SourceError(f"{type(src).__name__}.{what} {msg} (see "
                      "fastanneal._protocol.MomentSource)")


def _array(src, what, a, shape, name):
    a = np.asarray(a)
    if a.shape != shape:
        _bad(src, what, f"returned {name} of shape {a.shape}; expected {shape}")
    if a.dtype.kind not in "fiu" or not np.isfinite(a).all():
        _bad(src, what, f"returned {name} with non-finite or non-numeric values")
    return a


def _check_moments(src, m, args, kw):
    K, D = np.shape(args[0])
    if not all(hasattr(m, f) for f in ("N", "S", "weight", "hard_distortion")):
        _bad(src, "moments", f"returned {type(m).__name__}; expected fastanneal.Moments")
    _array(src, "moments", m.N, (K,), "N")
    _array(src, "moments", m.S, (K, D), "S")
    for f in ("weight", "hard_distortion", "free_energy"):
        v = getattr(m, f, 0.0)
        if not (isinstance(v, (int, float, np.number)) and np.isfinite(v)):
            _bad(src, "moments", f"returned {f} = {v!r}; expected a finite number")
    hard = kw.get("hard_sums", args[4] if len(args) > 4 else False)
    if hard:
        _array(src, "moments", m.hard_counts, (K,), "hard_counts")
        _array(src, "moments", m.hard_sums, (K, D), "hard_sums")
    return m


def _check_covariance(src, c, args, kw):
    if c is None:
        return c
    D = int(src.n_features)
    return _array(src, "covariance", c, (D, D), "the covariance")


def _check_eigs(src, r, args, kw):
    K, D = np.shape(args[0])
    vectors = kw.get("return_vectors", args[3] if len(args) > 3 else False)
    lam = r[0] if vectors else r
    _array(src, "cluster_top_eigenvalues", lam, (K,), "eigenvalues")
    if vectors:
        _array(src, "cluster_top_eigenvalues", r[1], (K, D), "eigenvectors")
    return r


def _check_mean(src, mu, args, kw):
    return _array(src, "mean", mu, (int(src.n_features),), "the mean")


_CHECKS = {"moments": _check_moments, "covariance": _check_covariance,
           "cluster_top_eigenvalues": _check_eigs, "mean": _check_mean}


class CheckedSource:
    """A user-written moment source whose results are checked against the protocol as
    they come back (shapes, finite values), naming the method: a wrong shape failed as a
    NumPy broadcast error deep in the engine, a NaN objective read as "all rows are
    identical", a wrong covariance shape silently gave another critical temperature.
    Everything else passes through (signatures too: :func:`functools.wraps`)."""

    def __init__(self, source):
        object.__setattr__(self, "_src", source)
        n = getattr(source, "n_features", None)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            _bad(source, "n_features", f"is {n!r}; expected a positive integer")
        if np.dtype(getattr(source, "dtype", np.float64)) not in (np.float32, np.float64):
            _bad(source, "dtype", f"is {source.dtype!r}; expected float32 or float64")
        w = getattr(source, "total_weight", None)
        if not (isinstance(w, (int, float, np.number)) and np.isfinite(w) and w > 0):
            _bad(source, "total_weight", f"is {w!r}; expected a finite number > 0")

    def __getattr__(self, name):
        v = getattr(self._src, name)
        check = _CHECKS.get(name)
        if check is None or not callable(v):
            if name == "fingerprint" and callable(v):
                @functools.wraps(v)
                def fingerprint():
                    key = v()
                    if not isinstance(key, str):
                        _bad(self._src, "fingerprint", f"returned {type(key).__name__}; "
                             "expected a str")
                    return key
                return fingerprint
            return v

        @functools.wraps(v)
        def checked(*args, **kw):
            return check(self._src, v(*args, **kw), args, kw)
        return checked

    def __setattr__(self, name, value):
        setattr(self._src, name, value)

"""The moments contract: additive per-block statistics of annealed soft k-means.

Every backend (CPU here, Dask and CUDA elsewhere) produces :class:`Moments` records for
blocks of rows and adds them with :meth:`Moments.merge` (or ``+``); :meth:`Moments.finalize`
turns the total into new centers and objectives.
"""
import functools
import math
import threading
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import numba
import numpy as np

from . import _config
from . import _kernels as K_
from ._validation import (as_float_matrix, as_weights, check_range, check_rows,
                          centered_rows, check_temperature, check_temperature_for, metric_code,
                          normalize_rows, resp_code)

_RESP_NAMES = {0: "softmax", 1: "entmax15", 2: "hard"}
_METRIC_NAMES = {0: "euclidean", 1: "cosine"}

_blas_lock = threading.Lock()
_blas_libs = None


class _BlasOneThread:
    """Pin the loaded BLAS libraries to one thread, restore their thread counts on exit.

    ``threadpoolctl``'s ``limit`` re-reads every library's state on each entry (about
    0.1 ms: comparable to a whole moments pass on a few thousand rows); the libraries'
    controllers are found once and their thread counts read and set directly here.
    """

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = []
        for lib in _blas_libs:
            n = lib.get_num_threads()
            if n != 1:
                lib.set_num_threads(1)
                self.prev.append((lib, n))
        return self

    def __exit__(self, *exc):
        for lib, n in self.prev:
            lib.set_num_threads(n)
        return False


def blas_single_thread():
    """Context manager that pins BLAS to one thread while the parallel kernels call it.

    OpenBLAS called from Numba's worker threads with its own threads enabled oversubscribes
    the cores (about 2x slower on two cores, measured in ``benchmarks/bench_kernels.py``).
    """
    global _blas_libs
    if _blas_libs is None:
        with _blas_lock:
            if _blas_libs is None:
                # Numba's np.dot calls scipy's BLAS, which is loaded lazily: load it before
                # the controller takes its snapshot of the loaded libraries, or it is missed.
                import scipy.linalg.cython_blas  # noqa: F401
                from threadpoolctl import ThreadpoolController
                ctl = ThreadpoolController().select(user_api="blas")
                _blas_libs = [lib for lib in ctl.lib_controllers
                              if lib.get_num_threads() is not None]
    return _BlasOneThread()


def pinned_blas(fn):
    """Run ``fn`` with BLAS pinned to one thread (:func:`blas_single_thread`): the
    kernels bring their own threads, and OpenBLAS's threads, once woken by a NumPy product
    between the passes (a mean, the centers' distances), spin for ~0.1 s after it, taking a
    core from the next pass (a 200,000 x 384 pass at K = 64 took 210 ms instead of 156 after
    one GEMV; a default fit at K = 256 ran 6-8 % longer)."""
    @functools.wraps(fn)
    def pinned(*args, **kwargs):
        with blas_single_thread():
            return fn(*args, **kwargs)
    return pinned


def log_eps_for(dtype):
    return K_.LOG_EPS32 if np.dtype(dtype) == np.float32 else K_.LOG_EPS64


class Update(NamedTuple):
    """Result of :meth:`Moments.finalize`."""
    centers: np.ndarray     #: new centers ``S_k / N_k`` (cosine: projected on the sphere)
    empty: np.ndarray       #: bool mask of clusters with ``N_k == 0`` (kept at old center)
    objectives: dict        #: free energy, J, entropy per unit weight, certificate, ...


@dataclass
class Moments:
    """Additive statistics of a block of rows at one temperature.

    All sums run over the rows of the block, weighted by ``w``. Records of disjoint blocks
    combine with :meth:`merge` (or ``+``); :meth:`finalize` turns a record into new centers
    and objectives.

    Attributes
    ----------
    N : (K,) float64 array
        Soft counts ``sum w r_ik``.
    S : (K, D) float64 array
        Soft sums ``sum w r_ik x_i``.
    soft_distortion : float
        ``sum w sum_k r_ik d_ik``.
    entropy : float
        ``sum w H_i`` (Shannon for softmax, Tsallis-1.5 for entmax15).
    free_energy : float
        ``sum w F_i``; softmax ``F_i = -T LSE_k(log p_k - d_ik / T)``; entmax15
        ``F_i = sum_k r_ik d_ik - T H_i`` (Tsallis), without a prior term: with a
        ``log_prior`` the prior shapes ``r`` but is not in ``F``, and ``J - F >= 0`` need
        not hold (it holds without one).
    hard_distortion : float
        ``J = sum w min_k d_ik``.
    hard_counts : (K,) float64 array
        Weight of the rows nearest to each center.
    hard_sums : (K, D) float64 array or None
        ``sum w x_i`` over those rows (None when not requested).
    weight : float
        ``W = sum w``.
    rows : int
        The number of rows.
    margin_sum : float
        ``sum w exp(-Delta_i / T)``, ``Delta_i`` the second-best margin.
    min_margin : float
        ``min_i Delta_i`` (inf for an empty block or K = 1).
    nnz : int
        Non-zero responsibilities kept.
    temperature : float
        The temperature ``T`` of the record.
    responsibilities : {"softmax", "entmax15", "hard"}
    metric : {"euclidean", "cosine"}
    """
    N: np.ndarray
    S: np.ndarray
    soft_distortion: float
    entropy: float
    free_energy: float
    hard_distortion: float
    hard_counts: np.ndarray
    hard_sums: Optional[np.ndarray]
    weight: float
    rows: int
    margin_sum: float
    min_margin: float
    nnz: int
    temperature: float
    responsibilities: str = "softmax"
    metric: str = "euclidean"

    # ------------------------------------------------------------------ construction
    @classmethod
    def zeros(cls, n_clusters, n_features, temperature, responsibilities="softmax",
              metric="euclidean", hard_sums=True):
        """The identity of :meth:`merge` (the record of an empty block)."""
        K, D = int(n_clusters), int(n_features)
        return cls(N=np.zeros(K), S=np.zeros((K, D)), soft_distortion=0.0, entropy=0.0,
                   free_energy=0.0, hard_distortion=0.0, hard_counts=np.zeros(K),
                   hard_sums=np.zeros((K, D)) if hard_sums else None, weight=0.0, rows=0,
                   margin_sum=0.0, min_margin=math.inf, nnz=0,
                   temperature=float(temperature), responsibilities=responsibilities,
                   metric=metric)

    @property
    def n_clusters(self):
        return self.N.shape[0]

    # ------------------------------------------------------------------ algebra
    def merge(self, other):
        """Sum of two records (associative and commutative up to float reassociation)."""
        if not isinstance(other, Moments):
            return NotImplemented
        if self.S.shape != other.S.shape:
            raise ValueError(f"cannot merge moments of shapes {self.S.shape} and {other.S.shape}")
        # the record of no rows (``zeros``) is the identity, whatever it was labelled with
        if other._empty():
            return self._with_hard_sums(other.hard_sums is not None)
        if self._empty():
            return other._with_hard_sums(self.hard_sums is not None)
        if (self.temperature != other.temperature
                or self.responsibilities != other.responsibilities
                or self.metric != other.metric):
            raise ValueError("cannot merge moments computed at different temperatures, "
                             "responsibilities or metrics: "
                             f"({self.temperature}, {self.responsibilities}, {self.metric}) vs "
                             f"({other.temperature}, {other.responsibilities}, {other.metric})")
        if self.hard_sums is None or other.hard_sums is None:
            hs = None
        else:
            hs = self.hard_sums + other.hard_sums
        return Moments(
            N=self.N + other.N, S=self.S + other.S,
            soft_distortion=self.soft_distortion + other.soft_distortion,
            entropy=self.entropy + other.entropy,
            free_energy=self.free_energy + other.free_energy,
            hard_distortion=self.hard_distortion + other.hard_distortion,
            hard_counts=self.hard_counts + other.hard_counts, hard_sums=hs,
            weight=self.weight + other.weight, rows=self.rows + other.rows,
            margin_sum=self.margin_sum + other.margin_sum,
            min_margin=min(self.min_margin, other.min_margin), nnz=self.nnz + other.nnz,
            temperature=self.temperature, responsibilities=self.responsibilities,
            metric=self.metric)

    __add__ = merge

    def _empty(self):
        return self.rows == 0 and self.weight == 0.0 and not self.N.any()

    def _with_hard_sums(self, keep):
        """A copy (arrays too), without ``hard_sums`` unless ``keep``."""
        hs = self.hard_sums.copy() if keep and self.hard_sums is not None else None
        return replace(self, N=self.N.copy(), S=self.S.copy(),
                       hard_counts=self.hard_counts.copy(), hard_sums=hs)

    def __radd__(self, other):
        if isinstance(other, (int, float)) and other == 0:   # sum([...]) starts at 0
            return self
        return NotImplemented

    # ------------------------------------------------------------------ results
    def objectives(self):
        """Objectives of the record as a dict of floats."""
        K = self.n_clusters
        T = self.temperature
        W = self.weight
        gap = self.hard_distortion - self.free_energy
        if self.responsibilities == "entmax15":
            bound = (4.0 / 3.0) * T * W * (1.0 - K ** -0.5)
        elif self.responsibilities == "hard":
            bound = 0.0
        else:
            bound = T * W * math.log(K)
        return {
            "temperature": T,
            "free_energy": self.free_energy,
            "hard_distortion": self.hard_distortion,
            "soft_distortion": self.soft_distortion,
            "entropy": self.entropy / W if W > 0 else 0.0,
            "certificate_gap": gap,
            "certificate_bound": bound,
            "hardening_gap": self.soft_distortion - self.hard_distortion,
            "weight": W,
            "rows": self.rows,
            "margin_sum": self.margin_sum,
            "min_margin": self.min_margin,
        }

    def finalize(self, previous_centers=None, hard=False, min_mass=0.0):
        """New centers (``S/N``, or the hard sums for ``hard=True``) and objectives.

        Clusters with mass ``N_k <= min_mass * W`` keep their previous center (NaN when none
        is given) and are flagged in ``empty``; relocating them is the engine's decision,
        not the record's. The engine uses ``min_mass = 2^-24`` for every dtype, so that a
        cluster fed only by float32-negligible tails is empty in float32 and float64 alike.
        """
        if hard:
            if self.hard_sums is None:
                raise ValueError("these moments were computed without hard sums")
            N, S = self.hard_counts, self.hard_sums
        else:
            N, S = self.N, self.S
        empty = ~(N > min_mass * self.weight) | ~(N > 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            centers = S / N[:, None]
        if self.metric == "cosine":
            norms = np.linalg.norm(centers, axis=1)
            ok = ~empty & (norms > 0)
            centers[ok] /= norms[ok, None]
            empty |= ~(norms > 0)
        if empty.any():
            if previous_centers is not None:
                centers[empty] = np.asarray(previous_centers, dtype=np.float64)[empty]
            else:
                centers[empty] = np.nan
        return Update(centers=centers, empty=empty, objectives=self.objectives())


# ---------------------------------------------------------------------- computation
def compute_moments(X, w, C, T, metric=0, resp=0, log_prior=None, hard_sums=True,
                    block=None):
    """Fast path without validation: ``X`` C-contiguous float32/float64 (unit rows for
    cosine), ``w`` float64, ``C`` any float (cast to X's dtype)."""
    C = np.ascontiguousarray(C, dtype=X.dtype)
    csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
    use_prior = log_prior is not None
    logp = (np.ascontiguousarray(log_prior, dtype=np.float64) if use_prior
            else np.zeros(C.shape[0]))
    block = int(block or _config.CPU_BLOCK_ROWS)
    with blas_single_thread():
        N, S, sc, HN, HS, mn = K_.moments_kernel(
            X, w, C, csq, logp, use_prior, float(T), metric, resp, block, bool(hard_sums),
            log_eps_for(X.dtype), float(_config.SPARSE_FRACTION), K_.entmax_sort_max(resp),
            int(numba.get_num_threads()))
    return Moments(
        N=N, S=S, soft_distortion=sc[K_.S_SOFT_DIST], entropy=sc[K_.S_ENTROPY],
        free_energy=sc[K_.S_FREE], hard_distortion=sc[K_.S_HARD], hard_counts=HN,
        hard_sums=HS if hard_sums else None, weight=sc[K_.S_WEIGHT], rows=int(sc[K_.S_ROWS]),
        margin_sum=sc[K_.S_MARGIN], min_margin=float(mn), nnz=int(sc[K_.S_NNZ]),
        temperature=float(T), responsibilities=_RESP_NAMES[resp], metric=_METRIC_NAMES[metric])


def _prepare(X, centers, metric):
    # X in one pass (its squared row norms: finite, in range; the cosine normalisation reuses
    # them) instead of three (measured at 200,000 x 384 float32: the checks were 0.6 of one
    # GEMM X @ C.T with K = 64, BENCHMARKS 6)
    X = as_float_matrix(X, "X", finite=False)
    mc = metric_code(metric)
    sq = check_rows(X, "X", check_scale=mc != 1)
    # centers in float64 until they are in the rows' frame: float32 rows far from the
    # origin would otherwise get centers rounded at their own magnitude before the shift
    # (1e-3 at 1e4), an error no centering can take back
    C = as_float_matrix(centers, "centers", dtype=np.float64, allow_empty=False)
    if C.shape[1] != X.shape[1]:
        raise ValueError(f"centers have {C.shape[1]} features but X has {X.shape[1]}")
    if mc == 1:
        X = normalize_rows(X, "X", sqnorms=sq)       # unit rows: in range by construction
        C = normalize_rows(C, "centers")
    shift = None
    # a bound of the prepared rows' norms, from the same pass (check_temperature_for took
    # X.max() and X.min(): two more passes, 0.6 of a GEMM at K = 64)
    xnorm = 1.0 if mc == 1 else (math.sqrt(float(sq.max())) if sq.size else 0.0)
    if mc == 0 and X.shape[0]:
        # rows far from the origin relative to their spread: measured from their mean (a
        # copy), so that the GEMM-form distances keep their precision (docs/theory.md,
        # "Rows far from the origin"); distances, responsibilities and labels are the same
        X, shift = centered_rows(X, sqnorms=sq)
        if shift is not None:
            C = C - shift
            xnorm *= 2.0            # |x - mean| <= |x| + |mean| <= 2 max |x|
    if X.dtype != np.float64:
        big = float(np.abs(C).max())
        if big > float(np.finfo(X.dtype).max):
            raise ValueError(f"centers hold values up to {big:.3g}, beyond the range of X's "
                             f"dtype {X.dtype}; rescale the data or pass X as float64")
        C = np.ascontiguousarray(C, dtype=X.dtype)
    check_range(C, "centers", too_small=X.shape[0] == 0)   # (rows in range: see check_range)
    return X, C, mc, shift, xnorm


def _unshift(m, shift):
    """Moments computed on rows measured from ``shift``, back in the rows' own frame: every
    weighted sum of rows gains its weight times ``shift`` (the rest is translation
    invariant)."""
    if shift is None:
        return m
    m.S = m.S + m.N[:, None] * shift
    if m.hard_sums is not None:
        m.hard_sums = m.hard_sums + m.hard_counts[:, None] * shift
    return m


@pinned_blas
def moments(X_block, centers, T, weights=None, metric="euclidean", responsibilities="softmax",
            log_prior=None, hard_sums=True):
    """Moments of a block of rows given centers and temperature ``T``.

    Parameters
    ----------
    X_block : array (n, D)
        float32 or float64 (float32 stays float32; other dtypes become float64).
    centers : array (K, D)
    T : float > 0
        The temperature in ``softmax(-d / T)``; ``d`` the squared Euclidean distance
        (cosine: rows and centers unit-normalized, ``d = 2 - 2 cos``). 0 is allowed with
        ``responsibilities="hard"``.
    weights : (n,) array or None, default=None
        Non-negative sample weights (weights equal repetition).
    metric : {"euclidean", "cosine"}, default="euclidean"
    responsibilities : {"softmax", "entmax15", "hard"}, default="softmax"
        ``"hard"``: the nearest center.
    log_prior : (K,) array or None, default=None
        Log cluster masses ``log p_k`` for mass-constrained (deterministic annealing)
        responsibilities ``r_ik ~ p_k exp(-d_ik / T)``.
    hard_sums : bool, default=True
        Also accumulate ``sum w x_i`` per nearest center (one extra ``N x D`` pass).

    Returns
    -------
    Moments
        Additive record; ``merge`` / ``+`` combine records of disjoint blocks.

    Notes
    -----
    Sparsity: a softmax entry is dropped when ``exp(z_ik - max_k z_ik) < eps`` (``eps`` the unit
    round-off of the input dtype, 2^-24 for float32, 2^-53 for float64). Each dropped entry is
    below ``eps`` times the row's largest responsibility, so per row the dropped mass is at most
    ``(K - 1) eps``: in all, at most ``(K - 1) eps W`` of mass -- an absolute error, relative to
    the total weight ``W``, not to each ``N_k`` (a cluster that only dropped entries reach has
    ``N_k = 0`` where the exact sum is ~1e-16). Entmax-1.5 zeros are exact. Without
    ``log_prior`` the free energy keeps its certificate ``0 <= J - F <= T W log K`` exactly
    (with a prior: ``T sum_k J_k log p_k <= J - F <= 0`` for softmax, ``docs/theory.md`` §2;
    the record's ``objectives()["certificate_bound"]`` is the bound without a prior).
    """
    X, C, mc, shift, rc, T, w, log_prior = checked_moments_args(
        X_block, centers, T, weights, metric, responsibilities, log_prior)
    m = _unshift(compute_moments(X, w, C, T, mc, rc, log_prior, hard_sums), shift)
    if not (math.isfinite(m.hard_distortion) and math.isfinite(m.free_energy)):
        # rows and weights each in range, their products not (weights ~1e200 times squared
        # distances ~1e120): inf / NaN objectives, only a RuntimeWarning before
        raise ValueError(f"the objectives overflow float64 (largest weight "
                         f"{float(w.max()):.3g}, T = {T:.3g}): they are sums of weight x "
                         "squared distance, and the free energy holds T W log K; rescale the "
                         "weights (only their ratios matter) or the temperature")
    return m


def checked_moments_args(X_block, centers, T, weights, metric, responsibilities, log_prior):
    """The arguments of :func:`moments` (and ``cuda_moments``) checked and prepared:
    ``(X, C, metric_code, shift, resp_code, T, w, log_prior)``."""
    X, C, mc, shift, xnorm = _prepare(X_block, centers, metric)
    if C.shape[0] < 1:
        raise ValueError("at least one center is required")
    rc = resp_code(responsibilities)
    T = check_temperature(T, allow_zero=(rc == 2))
    w = as_weights(weights, X.shape[0], "weights")
    with np.errstate(over="ignore"):
        W = float(w.sum())
    if not math.isfinite(W):
        raise ValueError(f"weights sum to infinity (largest weight {float(w.max()):.3g}): "
                         "the moments are sums weighted by them; rescale the weights")
    log_prior = _check_log_prior(log_prior, C.shape[0])
    if rc != 2:                          # (hard assignments never divide by T)
        check_temperature_for(T, X, C, mc, ties_only=rc == 0 and log_prior is None,
                              x_norm=xnorm)
    return X, C, mc, shift, rc, T, w, log_prior


def _check_log_prior(log_prior, K):
    if log_prior is None:
        return None
    log_prior = np.asarray(log_prior, dtype=np.float64)
    if log_prior.shape != (K,):
        raise ValueError(f"log_prior must have shape ({K},); got {log_prior.shape}")
    if np.isnan(log_prior).any() or (log_prior == np.inf).any():
        raise ValueError("log_prior contains NaN or +inf")
    if not np.isfinite(log_prior).any():
        raise ValueError("log_prior is -inf for every cluster: no cluster has mass")
    return np.ascontiguousarray(log_prior)


def responsibilities(X, centers, T, metric="euclidean", kind="softmax", log_prior=None):
    """Responsibilities ``r_ik`` of every row (n x K; float32 rows give float32, any other
    dtype float64); rows sum to 1.

    Parameters
    ----------
    X : array (n, D)
    centers : array (K, D)
    T : float > 0
        The temperature in ``softmax(-d / T)`` (0 is allowed with ``kind="hard"``).
    metric : {"euclidean", "cosine"}, default="euclidean"
    kind : {"softmax", "entmax15", "hard"}, default="softmax"
    log_prior : (K,) array or None, default=None
        Log cluster masses ``log p_k`` (mass-constrained responsibilities).

    Returns
    -------
    (n, K) array
    """
    X, C, mc, _, xnorm = _prepare(X, centers, metric)
    rc = resp_code(kind)
    T = check_temperature(T, allow_zero=(rc == 2))
    csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
    log_prior = _check_log_prior(log_prior, C.shape[0])
    if rc != 2:
        check_temperature_for(T, X, C, mc, ties_only=rc == 0 and log_prior is None,
                              x_norm=xnorm)
    use_prior = log_prior is not None
    logp = log_prior if use_prior else np.zeros(C.shape[0])
    out = np.empty((X.shape[0], C.shape[0]), dtype=X.dtype)
    with blas_single_thread():
        K_.responsibilities_kernel(X, C, csq, logp, use_prior, max(T, 1e-300), mc, rc,
                                   int(_config.CPU_BLOCK_ROWS), log_eps_for(X.dtype),
                                   K_.entmax_sort_max(rc), out)
    return out


def pairwise_distances(X, centers, metric="euclidean"):
    """Squared distances (n x K) in GEMM form, clamped at 0 (cosine: ``2 - 2 cos``).

    Parameters
    ----------
    X : array (n, D)
    centers : array (K, D)
    metric : {"euclidean", "cosine"}, default="euclidean"

    Returns
    -------
    (n, K) array of the input dtype
    """
    X, C, mc = _prepare(X, centers, metric)[:3]
    csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
    out = np.empty((X.shape[0], C.shape[0]), dtype=X.dtype)
    with blas_single_thread():
        K_.distances_kernel(X, C, csq, mc, int(_config.CPU_BLOCK_ROWS), out)
    return out


def label_rows(X, centers, T, log_prior=None, metric="euclidean"):
    """The labelling pass in one distance computation per row block: ``(labels, d_min,
    margin, second, probability)`` -- :func:`assign` with ``return_second`` and the
    probability of the nearest center under ``softmax_k(log_prior_k - d_k / T)`` (what
    ``responsibilities(X, centers, T, log_prior=log_prior)[i, labels[i]]`` gives, to a
    relative ``1e-12``, without the n x K matrix or a second pass)."""
    X, C, mc = _prepare(X, centers, metric)[:3]
    T = float(T)
    if not (math.isfinite(T) and T > 0):
        raise ValueError(f"T must be finite and > 0; got {T!r}")
    n, K = X.shape[0], C.shape[0]
    lp = np.zeros(K) if log_prior is None else np.ascontiguousarray(log_prior,
                                                                   dtype=np.float64)
    if lp.shape != (K,):
        raise ValueError(f"log_prior must have shape ({K},); got {lp.shape}")
    csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
    labels = np.empty(n, dtype=np.int64)
    dmin = np.empty(n, dtype=np.float64)
    margin = np.empty(n, dtype=np.float64)
    second = np.empty(n, dtype=np.int64)
    prob = np.empty(n, dtype=np.float64)
    with blas_single_thread():
        K_.label_kernel(X, C, csq, mc, int(_config.CPU_BLOCK_ROWS), lp, 1.0 / T, labels,
                        dmin, margin, second, prob)
    return labels, dmin, margin, second, prob


def assign(X, centers, metric="euclidean", _prepared=False, return_second=False):
    """Hard assignment: ``(labels, d_min, margin)`` with ``margin = d_(2) - d_(1)``; with
    ``return_second`` also the second-nearest center of every row (-1 for K = 1).

    Parameters
    ----------
    X : array (n, D)
    centers : array (K, D)
    metric : {"euclidean", "cosine"}, default="euclidean"
    return_second : bool, default=False

    Returns
    -------
    labels : (n,) int64 array
        The nearest center of every row.
    d_min : (n,) float64 array
        The squared distance to it, in the GEMM form ``|x|^2 + |c|^2 - 2 x.c`` (absolute
        rounding of about the dtype's epsilon times ``|x|^2``; :func:`nearest_distances`
        sums it element by element).
    margin : (n,) float64 array
        ``d_(2) - d_(1)``, the gap to the second-nearest center.
    second : (n,) int64 array
        Only with ``return_second=True``.
    """
    if _prepared:
        C = np.ascontiguousarray(centers, dtype=X.dtype)
        mc = metric if isinstance(metric, int) else metric_code(metric)
    else:
        X, C, mc = _prepare(X, centers, metric)[:3]
    n = X.shape[0]
    csq = np.einsum("ij,ij->i", C, C, dtype=np.float64)
    labels = np.empty(n, dtype=np.int64)
    dmin = np.empty(n, dtype=np.float64)
    margin = np.empty(n, dtype=np.float64)
    second = np.empty(n, dtype=np.int64)
    with blas_single_thread():
        K_.assign_kernel(X, C, csq, mc, int(_config.CPU_BLOCK_ROWS), labels, dmin, margin,
                         second)
    if return_second:
        return labels, dmin, margin, second
    return labels, dmin, margin


def nearest_objective(X, w, centers, metric):
    """``(labels, J)``: the labelling pass's nearest centers and ``J = sum_i w_i min_k
    d(x_i, c_k)`` with each row's distance to the nearer of its two nearest centers summed
    element by element in float64 (:func:`~fastanneal._kernels.labelled_distances_kernel`):
    the objective a user reads (``inertia_``, ``score``), exact to float64 rounding of the
    stored values. The pass's GEMM-form distances carry a float32 residue of ~1e-7
    |x|^2 on every row: a heavy row sitting on its own center (weight ratios of 1e8 and
    more) made ``inertia_`` several times too large. ``X`` prepared (the fit's frame;
    cosine rows need not be unit: the distance is ``2 - 2 cos``)."""
    labels, d = nearest_distances(X, centers, metric)
    return labels, float(np.asarray(w, dtype=np.float64) @ d)


def nearest_objective_counts(X, w, centers, metric, return_margin=False):
    """``(labels, J, hard_counts)``: :func:`nearest_objective` and the weight of the rows
    nearest to each center (the final pass of a fit; a source's ``objective``); with
    ``return_margin`` also every row's margin ``d_(2) - d_(1)`` (as :func:`assign`)."""
    out = nearest_distances(X, centers, metric, return_margin=return_margin)
    labels, d = out[:2]
    w = np.asarray(w, dtype=np.float64)
    K = np.asarray(centers).shape[0]
    return (labels, float(w @ d),
            np.bincount(labels, weights=w, minlength=K).astype(np.float64)) + out[2:]


def nearest_distances(X, centers, metric, return_margin=False):
    """``(labels, d)``: the labelling pass's nearest centers and each row's distance to the
    nearer of its two nearest centers summed element by element in float64 (see
    :func:`nearest_objective`); with ``return_margin`` also the pass's margins."""
    mc = metric if isinstance(metric, int) else metric_code(metric)
    labels, _, margin, second = assign(X, centers, mc, _prepared=True, return_second=True)
    n = X.shape[0]
    d = np.empty(n, dtype=np.float64)
    if n:
        C = np.ascontiguousarray(centers, dtype=np.float64)
        K_.labelled_distances_kernel(X, C, labels, second, mc, d)
    return (labels, d, margin) if return_margin else (labels, d)


def exact_nearest_distances(X, centers, D2, metric):
    """``D2`` (n x K squared distances in GEMM form) with each row's two smallest entries
    replaced by the distances summed element by element in float64 (see
    :func:`nearest_objective`): the GEMM form's rounding (~1e-7 |x|^2 in float32) is an
    absolute error, so it is the small distances -- a row on or near its center -- that it
    spoils; ``sqrt`` makes it visible (``transform``: 5e-4 instead of 0). In place; returns
    ``D2``."""
    n, K = D2.shape
    if n == 0 or K == 0:
        return D2
    mc = metric if isinstance(metric, int) else metric_code(metric)
    X = np.ascontiguousarray(X)
    C = np.ascontiguousarray(centers, dtype=np.float64)
    rows = np.arange(n)
    # the two smallest by two vectorised argmins (np.argpartition over the n x K array
    # took twice the distances' own time and an n x K index array)
    first = np.ascontiguousarray(D2.argmin(axis=1), dtype=np.int64)
    if K > 1:
        D2[rows, first] = np.inf            # (overwritten with the exact value below)
        second = np.ascontiguousarray(D2.argmin(axis=1), dtype=np.int64)
    none = np.full(n, -1, dtype=np.int64)
    d = np.empty(n, dtype=np.float64)
    for idx in (first, second) if K > 1 else (first,):      # (second: set where K > 1)
        K_.labelled_distances_kernel(X, C, idx, none, mc, d)
        D2[rows, idx] = d
    return D2


def entmax15(Z, method="sort"):
    """entmax-1.5 of each row of ``Z`` (logits; docs/theory.md section 4.2): ``[z/2 - tau]_+^2``.

    ``method="sort"`` finds the exact threshold by sorting the candidates, ``"bisect"`` by
    bisection on tau with a closed-form finish (no sort); both are exact.

    Parameters
    ----------
    Z : array (K,) or (n, K)
        Finite logits.
    method : {"sort", "bisect"}, default="sort"

    Returns
    -------
    float64 array of the shape of ``Z``
        Each row is a probability vector (sparse: exact zeros).
    """
    Z = np.asarray(Z, dtype=np.float64)
    one_d = Z.ndim == 1
    Z = np.ascontiguousarray(np.atleast_2d(Z))
    if Z.ndim != 2:
        raise ValueError(f"Z must be 1-D or 2-D; got shape {Z.shape}")
    if not np.isfinite(Z).all():
        raise ValueError("Z contains NaN or infinity")
    if method not in ("sort", "bisect"):
        raise ValueError(f"method must be 'sort' or 'bisect'; got {method!r}")
    out = np.empty_like(Z)
    K_.entmax15_rows(Z, method == "bisect", out)
    return out[0] if one_d else out

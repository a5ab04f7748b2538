"""Seeding in one place: k-means++, the data scale, the critical temperature ``T_c`` and the
start temperature of a fit, for every estimator and backend (they only need a moment
source). See ``docs/theory.md`` section 3 for the critical temperatures."""
import math
import warnings
from typing import NamedTuple

import numpy as np

from ._validation import check_range

from ._engine import AnnealingWarning, _project, _takes


def kmeans_plusplus(X, w, K, rng, n_local_trials=None):
    """Greedy k-means++ seeding (weighted), as in scikit-learn: returns (K, D) float64.

    Each step draws ``n_local_trials`` candidates with probability proportional to
    ``w_i min_c d(x_i, c)`` and keeps the one that lowers the potential most; the candidate
    distances are computed by one fused Numba pass over ``X`` (blocked GEMM in the dtype of
    ``X``, float64 epilogue: :func:`fastanneal._kernels.kpp_candidates_kernel`).
    """
    import numba
    from . import _config
    from ._kernels import kpp_candidates_kernel
    from ._moments import blas_single_thread
    n = X.shape[0]
    X = np.ascontiguousarray(X)
    if X.dtype not in (np.float32, np.float64):
        X = X.astype(np.float64)
    w = np.ascontiguousarray(w, dtype=np.float64)
    xsq = np.einsum("ij,ij->i", X, X, dtype=np.float64)
    nth = int(numba.get_num_threads())
    block = int(_config.CPU_BLOCK_ROWS)

    def step(Cc, closest, out):
        Cx = np.ascontiguousarray(Cc, dtype=X.dtype)
        with blas_single_thread():
            return kpp_candidates_kernel(X, xsq, Cx, np.einsum("ij,ij->i", Cc, Cc), w,
                                         closest, out, block, nth)

    if n_local_trials is None:
        n_local_trials = 2 + int(math.log(K))
    if not w.sum() > 0:
        raise ValueError("the rows drawn for k-means++ seeding carry no weight (give more "
                         "rows a weight > 0)")
    p = w / w.sum()
    first = rng.choice(n, p=p)
    centers = np.empty((K, X.shape[1]))
    centers[0] = X[first]
    buf = np.empty((n_local_trials, n))
    closest = np.full(n, np.inf)
    C1 = centers[:1].copy()
    pots = step(C1, closest, buf[:1])
    closest = buf[0].copy()
    pot = float(pots[0])
    for c in range(1, K):
        if pot <= 0:
            # all remaining mass sits on chosen points: pick among the rest uniformly
            cand = rng.choice(n, size=n_local_trials)
        else:
            r = rng.random(n_local_trials) * pot
            cand = np.searchsorted(np.cumsum(w * closest), r)
            cand = np.minimum(cand, n - 1)
        Cc = np.ascontiguousarray(X[cand], dtype=np.float64)
        pots = step(Cc, closest, buf)
        best = int(np.argmin(pots))
        pot = float(pots[best])
        closest, buf[best] = buf[best].copy(), closest
        centers[c] = Cc[best]
    return centers


class DataStats(NamedTuple):
    mean: np.ndarray        #: weighted mean (cosine: of the unit rows)
    mean_c: np.ndarray      #: the mean as a center (cosine: projected on the sphere)
    scale: float            #: mean squared distance to the mean (trace of the covariance)


def data_stats(source):
    """Mean and scale of the data of ``source`` (one hard moments pass at the mean)."""
    mean = source.mean()
    mean_c = _project(mean[None, :], source.metric)[0] if source.metric == 1 else mean
    m0 = source.moments(mean[None, :], 1.0, 2, None, hard_sums=False)
    scale = float(m0.hard_distortion / source.total_weight)
    if not np.isfinite(mean).all():
        # (fit() validated its rows: there, only the weighted sums can overflow)
        raise ValueError("the weighted mean of the rows is not finite: weight x row overflows "
                         "float64 -- rescale the weights (divide them by a constant: only "
                         "their ratios matter) or the rows -- or, for a source whose rows "
                         "fit() did not validate, the rows hold NaN or infinity")
    if not math.isfinite(scale):
        # finite rows, finite weights, their products not (weights ~1e300 times squared
        # distances ~1e10): read as "NaN rows" or "all rows are identical" before
        raise ValueError(f"the weighted spread of the rows overflows float64 (the sum of "
                         f"weight x squared distance to the mean is {float(m0.hard_distortion)!r}): "
                         "rescale the weights (divide them by a constant: only their ratios "
                         "matter) or the rows")
    return DataStats(mean, mean_c, scale)


#: cosine rows whose mean distance to their mean direction is at most this many eps of
#: their dtype are one direction to the rounding of ``2 - 2 cos`` (:func:`rows_coincide`) ...
COSINE_ONE_DIRECTION_EPS = 8.0
#: ... and up to this many eps, a narrow cone: a warning (:func:`warn_narrow_cone`)
COSINE_NARROW_CONE_EPS = 1000.0


def _cone_scale(source, stats):
    """The mean cosine distance of the rows to their mean direction, for the one-direction
    tests: the weighted one (``stats.scale``), but where the source holds its rows in memory,
    the larger of it and the unweighted one over the rows of weight > 0 -- one heavy row
    made orthogonal rows 'one direction' (weights 1e7, 1, 1 on three unit axes)."""
    X = getattr(source, "X", None)
    if X is None:
        X = getattr(source, "_X_host", None)
    w = getattr(source, "w", None)
    if w is None:
        w = getattr(source, "_w_host", None)
    if X is None or w is None or not getattr(X, "ndim", 0) == 2 or X.shape[0] == 0:
        return stats.scale
    live = np.asarray(w) > 0
    Xl = X[live] if not live.all() else X
    if Xl.shape[0] == 0:
        return stats.scale
    from ._validation import rows_mean
    m = rows_mean(np.ascontiguousarray(Xl))
    nm = float(np.sqrt(m @ m))
    if not nm > 0:
        return max(stats.scale, 1.0)
    u = (m / nm).astype(Xl.dtype)
    cos = np.asarray(Xl @ u, dtype=np.float64)
    return max(stats.scale, float(np.mean(2.0 - 2.0 * cos)))


def rows_coincide(source, stats):
    """Why more than one cluster is undefined on these rows, or None: no spread at all,
    or -- cosine -- unit rows whose mean distance ``2 - 2 cos`` to their mean direction is
    within :data:`COSINE_ONE_DIRECTION_EPS` eps of 0, i.e. at the rounding of the distances
    themselves (positive multiples of one vector measured 0.2-2.5 eps: a 'critical
    temperature' of 1e-31 and a 'supported' K = 2 on one direction)."""
    if not stats.scale > 0:
        return "all rows are identical: more than one cluster is undefined"
    if source.metric == 1:
        dt = np.dtype(getattr(source, "dtype", np.float64))
        eps = float(np.finfo(dt).eps)
        if stats.scale <= COSINE_ONE_DIRECTION_EPS * eps and \
                _cone_scale(source, stats) <= COSINE_ONE_DIRECTION_EPS * eps:
            return ("all rows are identical in direction, to the rounding of their cosine "
                    f"distances: their mean distance to the mean direction is {stats.scale:.2g}"
                    f", {stats.scale / eps:.1f} eps of {dt.name}; more than one cluster is "
                    "undefined" + (" in float32 (float64 rows, X.astype(np.float64), resolve "
                                   "finer spreads)" if dt == np.float32 else ""))
    return None


def warn_narrow_cone(source, stats, stacklevel=3):
    """An AnnealingWarning for cosine rows in a narrow cone: their distances to each other
    are a few hundred eps or less, and the rounding of ``2 - 2 cos`` blurs the clusters (a
    test set at 30 eps of float32: ARI 0.84 in float32, 1.000 in float64)."""
    if source.metric != 1 or not stats.scale > 0:
        return
    dt = np.dtype(getattr(source, "dtype", np.float64))
    eps = float(np.finfo(dt).eps)
    if stats.scale <= COSINE_NARROW_CONE_EPS * eps and \
            _cone_scale(source, stats) <= COSINE_NARROW_CONE_EPS * eps:
        from ._engine import AnnealingWarning
        warnings.warn(
            f"the rows point in nearly one direction: their mean cosine distance to the mean "
            f"direction, {stats.scale:.2g}, is only {stats.scale / eps:.0f} eps of {dt.name}, "
            "and the rounding of the distances blurs the clusters"
            + ("; cluster float64 rows (X.astype(np.float64))" if dt == np.float32 else
               "; consider metric='euclidean' on the rows with their mean subtracted"),
            AnnealingWarning, stacklevel=stacklevel)


def check_n_clusters(source, K, rng, name="n_clusters"):
    """``ValueError`` when ``K`` exceeds the rows or the distinct rows, or the rows are all
    identical (draws one random vector from ``rng``). ``name``: the parameter to name."""
    if source.n_rows < K:
        raise ValueError(f"n_samples={source.n_rows} should be >= {name}={K}")
    if K > 1:
        nd = source.n_distinct_rows(rng, K)
        if nd < K:
            raise ValueError(f"{name}={K} is larger than the number of distinct points "
                             f"with non-zero weight ({nd})")


def critical_temperature(source, mean, rng, n_iter=100):
    """``T_c = 2 lambda_max(C)``: exact (the D x D covariance and its top eigenvalue) where
    the source can form the covariance, else Lanczos on additive covariance-vector
    products."""
    from ._sources import EIG_SEED, top_eigenvalue
    cov = source.covariance(mean)
    if cov is not None:
        return 2.0 * max(top_eigenvalue(cov), 0.0)
    # Lanczos from its own start vector (T_c does not draw from the fit's random stream),
    # stopped when the Ritz value changes by < 1e-6 between checks (its error is then about
    # 1e-8: the attribute and the warnings need far less)
    own = np.random.default_rng(EIG_SEED)
    top = source.cluster_top_eigenvalues
    kw = {"tol": TC_LANCZOS_TOL} if _takes(top, "tol") else {}
    return 2.0 * float(top(mean[None, :], n_iter, own, **kw)[0])


def initial_centers(init, source, K, rng, mean_c, sample_rows=200_000, kpp_rows=None):
    """Seeds: ``"k-means++"`` (on all rows up to ``sample_rows``, else on a sample of
    ``max(100 K, 20000)`` rows, or of ``kpp_rows`` rows when given), ``"random"`` rows,
    ``"mean"`` (K copies: the engine separates coincident centers) or a (K, D) array."""
    if isinstance(init, str):
        if init == "k-means++":
            n = source.n_rows if source.n_rows <= sample_rows else max(100 * K, 20_000)
            if kpp_rows is not None:
                n = max(K, min(n, int(kpp_rows)))
            Xs, ws = source.sample(min(source.n_rows, n), rng)
            if (ws > 0).sum() < K and n < source.n_rows:
                # a draw of rows that carry (almost) no weight -- a log where most rows
                # weigh 0 -- has nothing to seed from (k-means++ divided 0 by 0): all the
                # rows (a mini-batch fit's seeding sample), or a larger draw of them
                Xb, wb = source.sample(source.n_rows if source.n_rows <= sample_rows else
                                       max(n, 100 * K, 20_000), rng)
                if (wb > 0).sum() > (ws > 0).sum():
                    Xs, ws = Xb, wb
                W, Xa = getattr(source, "w", None), getattr(source, "X", None)
                if (ws > 0).sum() < K and W is not None and Xa is not None:
                    # rows in memory: the weighted ones themselves (up to sample_rows)
                    pos = np.flatnonzero(np.asarray(W) > 0)
                    if pos.size > (ws > 0).sum():
                        if pos.size > sample_rows:
                            pos = np.sort(rng.choice(pos, sample_rows, replace=False))
                        Xs, ws = Xa[pos], np.asarray(W)[pos]
            return kmeans_plusplus(Xs, ws, K, rng)
        if init == "random":
            Xs, ws = source.sample(min(source.n_rows, max(100 * K, 20_000)), rng)
            p = ws / ws.sum()
            idx = rng.choice(Xs.shape[0], size=K, replace=False,
                             p=p if (p > 0).sum() >= K else None)
            return Xs[idx].astype(np.float64)
        if init == "mean":
            return np.repeat(mean_c[None, :], K, axis=0)
        raise ValueError(f"init must be 'k-means++', 'random', 'mean' or an array; got {init!r}")
    if callable(init) or not np.issubdtype(np.asarray(init).dtype, np.number):
        raise ValueError(f"init must be 'k-means++', 'random', 'mean' or a (K, D) array of "
                         f"numbers; got {init!r}")
    C = np.asarray(init, dtype=np.float64)
    if C.shape != (K, source.n_features):
        raise ValueError(f"init array must have shape ({K}, {source.n_features}); got {C.shape}")
    if not np.isfinite(C).all():
        raise ValueError("init array contains NaN or infinity")
    check_range(C, "init array")
    return C.copy()


#: Stopping tolerance of the Lanczos behind ``critical_temperature_`` where the source
#: does not form the covariance.
TC_LANCZOS_TOL = 1e-6
#: Relative precision of the per-cluster ``lambda_max`` behind ``temperature_start="auto"``.
AUTO_START_TOL = 1e-3


def auto_start(source, C, rng, fraction):
    """``fraction * min_k 2 lambda_max(C_k)`` over the non-empty clusters of the partition
    induced by the seeds ``C`` (cluster means as centers); None when undefined."""
    mh = source.moments(C, 1.0, 2, None, hard_sums=True)
    # the non-empty cells' means: an empty cell keeps its seed as its "mean", which can
    # coincide with another cell's (init="mean": K copies of the mean), and then rounding
    # decided how the rows were shared between the copies
    live = mh.hard_counts > 0
    means = mh.finalize(previous_centers=C, hard=True).centers[live]
    if not means.shape[0]:
        return None
    top = source.cluster_top_eigenvalues
    # a start temperature needs lambda_max to about 1e-3, not to 1e-9: Lanczos stops there
    # (sources written against the first protocol take no ``tol=``: 15 steps)
    lam = top(means, 15, rng, tol=AUTO_START_TOL) if _takes(top, "tol") else top(means, 15, rng)
    # a cell that is one point (one row, or rows equal to rounding) has lambda = 0 exactly;
    # computed, it is rounding noise of the order of (eps |c_k|)^2 -- under cosine the
    # projected mean is a few ulps off the row -- and a start temperature of that noise
    # would mean no annealing at all: such cells do not count
    pos2 = np.einsum("ij,ij->i", means, means)
    noise = 16.0 * float(np.finfo(source.dtype).eps) ** 2 * pos2
    cand = lam[lam > noise]
    if cand.size == 0:
        return None
    return float(fraction * 2.0 * cand.min())


def start_temperature(temperature_start, source, C, rng, K, T_c, scale, fraction,
                      critical=False, stacklevel=4):
    """``T_start`` of a fit: ``"auto"`` (:func:`auto_start`, ``0.05 scale`` as fallback),
    ``"critical"`` / the critical schedule (``1.02 T_c``) or a number (with a warning when it
    is above ``T_c``)."""
    ts = temperature_start
    if isinstance(ts, str) and (ts == "critical" or (critical and ts == "auto")):
        return 1.02 * T_c if T_c > 0 else scale
    if isinstance(ts, str) and ts == "auto":
        T0 = auto_start(source, C, rng, fraction) if K > 1 else None
        if T0 is None or not T0 > 0:
            T0 = 0.05 * scale if scale > 0 else 1.0
        return T0
    T0 = float(ts)
    if T0 > T_c > 0 and K > 1 and not critical:
        warnings.warn(f"temperature_start={T0:.4g} is above the critical temperature "
                      f"T_c={T_c:.4g}: all centers are pulled to the mean and clusters merge "
                      "until T falls below T_c", AnnealingWarning, stacklevel=stacklevel)
    return T0

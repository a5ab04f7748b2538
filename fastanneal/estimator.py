"""``AnnealedKMeans``: a scikit-learn estimator for annealed soft k-means."""
import math
import numbers
import time
import warnings

import numpy as np
from sklearn.base import BaseEstimator, ClusterMixin, TransformerMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from ._engine import (AnnealingWarning, EngineConfig, anneal, anneal_critical,
                      min_center_distance)
from ._gradient_solver import anneal_gradient
from ._moments import assign as _assign
from ._sources import InMemorySource
from ._trace import Trace
from ._validation import metric_code, normalize_rows, resp_code
from .schedules import CriticalSchedule, make_schedule

__all__ = ["AnnealedKMeans", "AnnealingWarning"]


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
        CcT = np.ascontiguousarray(Cc.T, dtype=X.dtype)
        with blas_single_thread():
            return kpp_candidates_kernel(X, xsq, CcT, np.einsum("ij,ij->i", Cc, Cc), w,
                                         closest, out, block, nth)

    if n_local_trials is None:
        n_local_trials = 2 + int(math.log(K))
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


def _top_eigenvalue(source, Xmem, w, mean, rng):
    """lambda_max of the weighted covariance (1/W). In memory with D <= 2048: the exact
    covariance by float64 GEMMs over row blocks and ``eigvalsh`` (fast, no iteration);
    otherwise power iteration on additive moments through the source."""
    if Xmem is None and hasattr(source, "covariance") and source.n_features <= 2048:
        return float(max(np.linalg.eigvalsh(source.covariance(mean))[-1], 0.0))
    if Xmem is not None and Xmem.shape[1] <= 2048:
        D = Xmem.shape[1]
        Cov = np.zeros((D, D))
        for b in range(0, Xmem.shape[0], 16384):
            Z = Xmem[b:b + 16384].astype(np.float64) - mean
            Cov += (Z * w[b:b + 16384, None]).T @ Z
        Cov /= w.sum()
        return float(max(np.linalg.eigvalsh(Cov)[-1], 0.0))
    return float(source.cluster_top_eigenvalues(mean[None, :], 100, rng)[0])


def _n_distinct_rows(X, rng, cap):
    """Number of distinct rows, counted up to ``cap`` (hash by a random projection)."""
    v = rng.standard_normal(X.shape[1])
    h = X.astype(np.float64, copy=False) @ v
    return len(np.unique(h))


class AnnealedKMeans(ClusterMixin, TransformerMixin, BaseEstimator):
    """Annealed soft k-means (deterministic annealing) with a hard, Lloyd-polished result.

    Each point gets soft responsibilities ``r_ik = softmax_k(log p_k - d_ik / T)`` (``d`` the
    squared Euclidean distance; for ``metric="cosine"`` unit vectors and ``d = 2 - 2 cos``);
    the temperature ``T`` is lowered along a schedule, soft Lloyd (EM) runs at each
    temperature, and a final Lloyd polish at ``T = 0`` gives the deployed hard partition.

    Parameters
    ----------
    n_clusters : int, default=8
    metric : {"euclidean", "cosine"}, default="euclidean"
    responsibilities : {"softmax", "entmax15"}, default="softmax"
        ``entmax15`` gives sparse responsibilities that are exactly hard once
        ``T <= Delta_min / 2``.
    schedule : {"geometric", "linear", "constant", "critical", "adaptive"} or Schedule
        ``"critical"`` is deterministic annealing from just above ``T_c = 2 lambda_max(C)``
        with all centers at the mean (clusters split at their critical temperatures).
    n_steps : int, default=20
        Temperatures of the geometric / linear / constant schedules.
    init : {"k-means++", "mean", "random"} or array (K, D), default="k-means++"
    n_init : int, default=1
        Independent runs; the one with the lowest final inertia is kept.
    temperature_start : "auto", "critical" or float, default="auto"
        ``"auto"``: ``auto_start_fraction`` times the smallest critical temperature
        ``2 lambda_max(C_k)`` among the clusters of the initial partition (clusters of at
        least 2 points): every initial cluster is then already below its own splitting point
        and no two seeds are hot enough to merge. ``"critical"``: ``1.02 * T_c``.
    temperature_end_ratio : float, default=0.05
        ``T_end = ratio * T_start``.
    auto_start_fraction : float, default=0.5
    max_iter : int, default=4
        Soft-Lloyd iterations per temperature (stops earlier when centers move < tol).
    tol : float, default=1e-4
        Relative to the mean feature variance of the data (as scikit-learn).
    mass_constrained : bool or "auto", default="auto"
        Responsibilities weighted by cluster masses ``p_k`` (deterministic annealing):
        coincident centers act as one cluster instead of splitting its points. "auto": on for
        the critical schedule (where all centers start coincident), off otherwise (measured on
        CLINC150 with ``benchmarks/bench_quality.py``: the auto start temperature already keeps
        seeds apart, and plain responsibilities reached a lower final J).
    polish : bool, default=True
        Lloyd refinement at ``T = 0`` after annealing.
    max_polish_iter : int, default=300
    backend : {"cpu", "cuda", "dask"} or None, default=None
        None: ``"dask"`` for Dask collections, else ``"cpu"``.
    scheduler : str, distributed.Client or None
        Dask backend only: a scheduler address (``"tcp://..."``) or a Client. None uses the
        current default client, else starts an embedded LocalCluster and closes it after fit.
    random_state : int, RandomState, Generator or None
    diagnostics : {"summary", "full"}, default="summary"
        ``"summary"``: one trace record per temperature; ``"full"``: one per iteration.
        The hard objective ``J`` comes with every moments pass at no extra cost, so both
        record it.
    verbose : int, default=0
    progress : bool, default=False
        Show a tqdm progress bar over temperature steps (needs ``fastanneal[progress]``).
    solver : {"lloyd", "gradient"}, default="lloyd"
        ``"gradient"``: Adam on the centers for ``L = L_comp - separation_weight * L_sep``
        (:func:`fastanneal.value_and_grad`), ``gradient_steps`` steps per temperature,
        gradient norms in ``trace_["grad_norm"]``; rows must be in memory.
    learning_rate : float, default=0.05
        Adam step per coordinate is ``learning_rate * sqrt(scale / D)`` (scale = mean squared
        distance to the mean).
    adam_betas : (float, float), default=(0.9, 0.999)
    gradient_steps : int, default=10
    separation_weight : float, default=0.1
        ``lambda`` in ``L = L_comp - lambda * L_sep``.
    phi : {"identity", "log", "hinge"}, default="identity"
        Separation transform; ``phi_margin`` (hinge) and ``phi_eps`` (log) in units of scale.
    phi_margin, phi_eps : float or None
    batch_size : int or None, default=None
        Set: out-of-core mini-batch annealing over Dask chunks (stochastic EM, step size
        ``(t + learning_offset) ** -learning_decay``); ``labels_`` is then None (use
        ``predict`` or :func:`fastanneal.dask.write_labels`).
    learning_decay : float in (0.5, 1], default=0.6
    learning_offset : float >= 1, default=1.0
    anchor_weight : float, default=0.0
        Adds ``anchor_weight * F_T / W`` to the loss: the pure loss lets centers drift away
        from the data in Euclidean space (see ``benchmarks/bench_regimes.py``); 1.0 helped.

    Attributes
    ----------
    cluster_centers_ : (K, D) array, dtype of X
    labels_ : (n,) int64, ``== predict(X)`` (final hard E-step)
    inertia_ : float, ``J = sum w min_k d``
    free_energy_ : float, ``F_T`` at the final annealing temperature
    soft_distortion_ : float, expected distortion of the soft rule at the final temperature
    hardening_gap_ : float, ``soft_distortion_ - J`` of the same centers
        These three are measured by the last annealing pass, i.e. at the centers that pass
        started from (one soft-Lloyd update before the annealed centers, and before the
        polish); ``benchmarks/study_hardening.py`` recomputes them at the returned centers
        (difference on digits at ``temperature_end_ratio=0.8``: 0.07 % of the gap).
    temperature_ : float, final annealing temperature
    temperature_start_ : float
    critical_temperature_ : float, ``T_c = 2 lambda_max(C)``
    cluster_weights_ : (K,) array, mass of each cluster (sums to 1)
    n_iter_ : int, moment passes in total (annealing + polish)
    trace_ : Trace (``.as_dict()``, ``.to_arrow()``)
    n_features_in_ : int
    """

    def __init__(self, n_clusters=8, *, metric="euclidean", responsibilities="softmax",
                 schedule="geometric", n_steps=20, init="k-means++", n_init=1,
                 temperature_start="auto", temperature_end_ratio=0.05,
                 auto_start_fraction=0.5, max_iter=4, tol=1e-4, mass_constrained="auto",
                 polish=True, max_polish_iter=300, backend=None, scheduler=None,
                 random_state=None,
                 diagnostics="summary", verbose=0, progress=False, solver="lloyd",
                 learning_rate=0.05, adam_betas=(0.9, 0.999), gradient_steps=10,
                 separation_weight=0.1, phi="identity", phi_margin=None, phi_eps=None,
                 anchor_weight=0.0, batch_size=None, learning_decay=0.6,
                 learning_offset=1.0):
        self.n_clusters = n_clusters
        self.metric = metric
        self.responsibilities = responsibilities
        self.schedule = schedule
        self.n_steps = n_steps
        self.init = init
        self.n_init = n_init
        self.temperature_start = temperature_start
        self.temperature_end_ratio = temperature_end_ratio
        self.auto_start_fraction = auto_start_fraction
        self.max_iter = max_iter
        self.tol = tol
        self.mass_constrained = mass_constrained
        self.polish = polish
        self.max_polish_iter = max_polish_iter
        self.backend = backend
        self.scheduler = scheduler
        self.random_state = random_state
        self.diagnostics = diagnostics
        self.verbose = verbose
        self.progress = progress
        self.solver = solver
        self.learning_rate = learning_rate
        self.adam_betas = adam_betas
        self.gradient_steps = gradient_steps
        self.separation_weight = separation_weight
        self.phi = phi
        self.phi_margin = phi_margin
        self.phi_eps = phi_eps
        self.anchor_weight = anchor_weight
        self.batch_size = batch_size
        self.learning_decay = learning_decay
        self.learning_offset = learning_offset

    # ------------------------------------------------------------------ validation
    def _check_params(self, n_samples):
        K = self.n_clusters
        if not isinstance(K, numbers.Integral) or isinstance(K, bool) or K < 1:
            raise ValueError(f"n_clusters must be a positive integer; got {K!r}")
        if n_samples < K:
            raise ValueError(f"n_samples={n_samples} should be >= n_clusters={K}")
        metric_code(self.metric)
        rc = resp_code(self.responsibilities)
        if rc == 2:
            raise ValueError("responsibilities must be 'softmax' or 'entmax15' for fitting")
        for name in ("n_init", "max_iter", "n_steps", "max_polish_iter"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if not (isinstance(self.tol, numbers.Real) and self.tol >= 0):
            raise ValueError(f"tol must be a non-negative number; got {self.tol!r}")
        r = self.temperature_end_ratio
        if not (isinstance(r, numbers.Real) and 0 < r <= 1):
            raise ValueError(f"temperature_end_ratio must be in (0, 1]; got {r!r}")
        f = self.auto_start_fraction
        if not (isinstance(f, numbers.Real) and 0 < f):
            raise ValueError(f"auto_start_fraction must be > 0; got {f!r}")
        ts = self.temperature_start
        if isinstance(ts, str):
            if ts not in ("auto", "critical"):
                raise ValueError("temperature_start must be 'auto', 'critical' or a positive "
                                 f"number; got {ts!r}")
        elif not (isinstance(ts, numbers.Real) and math.isfinite(ts) and ts > 0):
            raise ValueError(f"temperature_start must be 'auto', 'critical' or a positive "
                             f"number; got {ts!r}")
        if not (isinstance(self.mass_constrained, bool) or self.mass_constrained == "auto"):
            raise ValueError(f"mass_constrained must be True, False or 'auto'; got "
                             f"{self.mass_constrained!r}")
        if self.diagnostics not in ("summary", "full"):
            raise ValueError(f"diagnostics must be 'summary' or 'full'; got {self.diagnostics!r}")
        bs = self.batch_size
        if bs is not None and (not isinstance(bs, numbers.Integral) or isinstance(bs, bool)
                               or bs < 1):
            raise ValueError(f"batch_size must be None or a positive integer; got {bs!r}")
        if not (isinstance(self.learning_decay, numbers.Real)
                and 0.5 < self.learning_decay <= 1):
            raise ValueError(f"learning_decay must be in (0.5, 1]; got {self.learning_decay!r}")
        if not (isinstance(self.learning_offset, numbers.Real) and self.learning_offset >= 1):
            raise ValueError(f"learning_offset must be >= 1; got {self.learning_offset!r}")
        if self.solver not in ("lloyd", "gradient"):
            raise ValueError(f"solver must be 'lloyd' or 'gradient'; got {self.solver!r}")
        if self.solver == "gradient":
            if self.schedule == "critical" or isinstance(self.schedule, CriticalSchedule):
                raise ValueError("solver='gradient' does not run the critical schedule "
                                 "(its cluster splitting is soft Lloyd); use another schedule")
            if self.mass_constrained is True:
                raise ValueError("solver='gradient' has no mass-constrained prior; use "
                                 "mass_constrained=False or 'auto'")
            if not isinstance(self.gradient_steps, numbers.Integral) or self.gradient_steps < 1:
                raise ValueError(f"gradient_steps must be a positive integer; got "
                                 f"{self.gradient_steps!r}")
        if self.backend not in (None, "cpu", "cuda", "dask"):
            raise ValueError(f"backend must be None, 'cpu', 'cuda' or 'dask'; got {self.backend!r}")
        return rc

    def _rng(self):
        rs = self.random_state
        if isinstance(rs, np.random.Generator):
            return rs
        if isinstance(rs, np.random.RandomState):
            return np.random.default_rng(rs.randint(2 ** 31))
        return np.random.default_rng(rs)

    def _validate_X(self, X, reset):
        X = validate_data(self, X, reset=reset, dtype=[np.float64, np.float32], order="C",
                          accept_sparse=False)
        if metric_code(self.metric) == 1:
            X = normalize_rows(X)
        return X

    @staticmethod
    def _validate_weights(sample_weight, n):
        if sample_weight is None:
            return np.ones(n)
        w = np.asarray(sample_weight, dtype=np.float64)
        if w.ndim == 0:
            w = np.full(n, float(w))
        if w.shape != (n,):
            raise ValueError(f"sample_weight.shape == {w.shape}, expected ({n},)!")
        if not np.isfinite(w).all():
            raise ValueError("sample_weight contains NaN or infinity")
        if (w < 0).any():
            raise ValueError("sample_weight contains negative values")
        if not w.sum() > 0:
            raise ValueError("sample_weight sums to zero: no row carries weight")
        return np.ascontiguousarray(w)

    # ------------------------------------------------------------------ fit
    def _make_source(self, X, sample_weight):
        backend = self.backend
        is_dask = hasattr(X, "__dask_graph__")
        if backend == "dask" or (backend is None and is_dask):
            from .dask import make_dask_source  # noqa: WPS433 (optional heavy import)
            return make_dask_source(self, X, sample_weight)
        X = self._validate_X(X, reset=True)
        w = self._validate_weights(sample_weight, X.shape[0])
        if backend == "cuda":
            from .cuda import CudaSource
            return CudaSource(X, w, metric_code(self.metric)), X, w
        return InMemorySource(X, w, metric_code(self.metric)), X, w

    def fit(self, X, y=None, sample_weight=None):
        """Anneal from hot to hard; returns self.

        ``X``: array (n, D); a Dask array / DataFrame, Parquet path or
        :class:`fastanneal.dask.EmbeddingArrays` with the Dask backend. With ``batch_size``
        set, out-of-core mini-batch annealing (:class:`fastanneal.dask.MiniBatchAnnealer`).
        """
        self.__dict__.pop("_partial_state", None)
        if self.batch_size is not None:
            from .dask import fit_minibatch_into
            return fit_minibatch_into(self, X, sample_weight)
        t0 = time.perf_counter()
        source, Xmem, w = self._make_source(X, sample_weight)
        try:
            return self._fit_source(source, Xmem, w, t0)
        finally:
            if hasattr(source, "close"):
                source.close()

    def partial_fit(self, X, y=None, sample_weight=None):
        """One stochastic-EM annealing update on the batch ``X`` (one temperature step per
        call; the temperature holds at its end value after ``n_steps`` calls). The first call
        seeds (k-means++) and sets the start temperature and scale from its batch."""
        from .dask import partial_fit_update, start_partial_fit
        first = not hasattr(self, "_partial_state")
        X = self._validate_X(X, reset=first)
        w = self._validate_weights(sample_weight, X.shape[0])
        if first:
            self._check_params(X.shape[0])
            self._partial_state = start_partial_fit(self, X, w)
        partial_fit_update(self._partial_state, X, w).apply_to(self)
        return self

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else dict(self.__dict__)
        state = dict(state)
        sched = state.get("scheduler")
        if sched is not None and not isinstance(sched, str):
            state["scheduler"] = None       # a live distributed.Client does not pickle
        return state

    def _fit_source(self, source, Xmem, w, t0):
        rc = self._check_params(source.n_rows)
        K = int(self.n_clusters)
        rng = self._rng()
        metric = source.metric
        mean = source.mean()
        if metric == 1:
            mean_c = mean / max(np.linalg.norm(mean), 1e-300)
        else:
            mean_c = mean
        # data scale: mean squared distance to the mean (trace of the covariance)
        m0 = source.moments(mean[None, :], 1.0, 2, None, hard_sums=False)
        scale = m0.hard_distortion / source.total_weight
        if K > 1 and (Xmem is not None or hasattr(source, "n_distinct_rows")):
            nd = (_n_distinct_rows(Xmem[w > 0], rng, K) if Xmem is not None
                  else source.n_distinct_rows(rng, K))
            if nd < K:
                raise ValueError(f"n_clusters={K} is larger than the number of distinct "
                                 f"points with non-zero weight ({nd})")
        if not scale > 0 and K > 1:
            raise ValueError("all rows are identical: more than one cluster is undefined")
        self.critical_temperature_ = 2.0 * _top_eigenvalue(source, Xmem, w, mean, rng)

        best = None
        for run in range(int(self.n_init)):
            res = self._fit_once(source, Xmem, w, K, rc, rng, mean_c, scale, t0)
            if best is None or res[0].hard_objective_final < best[0].hard_objective_final:
                best = res
        result, trace, T0 = best
        C = result.centers
        # final hard E-step so that labels_ == predict(X)
        if Xmem is not None:
            labels, dmin, _ = _assign(Xmem, C, metric, _prepared=True)
            self.labels_ = labels
            self.inertia_ = float(w @ dmin)
            counts = np.bincount(labels, weights=w, minlength=K)
        else:
            self.labels_ = source.labels(C) if hasattr(source, "labels") else None
            mh = source.moments(C, 1.0, 2, None, hard_sums=False)
            self.inertia_ = float(mh.hard_distortion)
            counts = mh.hard_counts
        dtype = source.dtype
        self.cluster_centers_ = C.astype(dtype)
        self.cluster_weights_ = counts / counts.sum()
        self.temperature_ = float(result.temperature)
        self.temperature_start_ = float(T0)
        self.free_energy_ = float(result.free_energy)
        self.soft_distortion_ = float(result.soft_objective)
        self.hardening_gap_ = float(result.soft_objective - result.hard_objective)
        self.n_iter_ = int(result.n_iter)
        self.n_steps_ = int(result.n_steps)
        self.n_relocations_ = int(result.relocations)
        self.trace_ = trace
        return self

    def _initial_centers(self, source, Xmem, w, K, rng, mean_c):
        init = self.init
        if isinstance(init, str):
            if init == "k-means++":
                if Xmem is not None and source.n_rows <= 200_000:
                    Xs, ws = Xmem, w
                else:
                    Xs, ws = source.sample(min(source.n_rows, max(100 * K, 20_000)), rng)
                return kmeans_plusplus(Xs, ws, K, rng)
            if init == "random":
                Xs, ws = source.sample(min(source.n_rows, max(100 * K, 20_000)), rng)
                p = ws / ws.sum()
                idx = rng.choice(Xs.shape[0], size=K, replace=False, p=p if (p > 0).sum() >= K
                                 else None)
                return Xs[idx].astype(np.float64)
            if init == "mean":
                return np.repeat(mean_c[None, :], K, axis=0)
            raise ValueError(f"init must be 'k-means++', 'random', 'mean' or an array; got {init!r}")
        C = np.asarray(init, dtype=np.float64)
        if C.shape != (K, source.n_features):
            raise ValueError(f"init array must have shape ({K}, {source.n_features}); got {C.shape}")
        if not np.isfinite(C).all():
            raise ValueError("init array contains NaN or infinity")
        return C.copy()

    def _auto_start(self, source, C, rng):
        """``auto_start_fraction * min_k 2 lambda_max(C_k)`` over clusters of >= 2 points of
        the partition induced by the seeds (cluster means as centers)."""
        mh = source.moments(C, 1.0, 2, None, hard_sums=True)
        upd = mh.finalize(previous_centers=C, hard=True)
        means = upd.centers
        lam = source.cluster_top_eigenvalues(means, 15, rng)
        ok = mh.hard_counts > 0
        cand = lam[ok & (lam > 0)]
        if cand.size == 0:
            return None
        return float(self.auto_start_fraction * 2.0 * cand.min())

    def _fit_once(self, source, Xmem, w, K, rc, rng, mean_c, scale, t0):
        schedule = make_schedule(self.schedule, int(self.n_steps))
        ts = self.temperature_start
        T_c = self.critical_temperature_
        critical = isinstance(schedule, CriticalSchedule) or ts == "critical"
        if critical:
            C = np.repeat(mean_c[None, :], K, axis=0)
            T0 = 1.02 * T_c if T_c > 0 else scale
        else:
            C = self._initial_centers(source, Xmem, w, K, rng, mean_c)
            if ts == "auto":
                T0 = self._auto_start(source, C, rng) if K > 1 else None
                if T0 is None or not T0 > 0:
                    T0 = 0.05 * scale if scale > 0 else 1.0
            else:
                T0 = float(ts)
                if T0 > T_c > 0 and K > 1:
                    warnings.warn(
                        f"temperature_start={T0:.4g} is above the critical temperature "
                        f"T_c={T_c:.4g}: all centers are pulled to the mean and clusters merge "
                        "until T falls below T_c", AnnealingWarning, stacklevel=3)
        if isinstance(ts, numbers.Real) and critical:
            T0 = float(ts)
        T_end = float(self.temperature_end_ratio) * T0
        if isinstance(schedule, CriticalSchedule) and ts == "auto":
            T_end = max(T_end, 0.0)
        mc = self.mass_constrained
        mc = critical if isinstance(mc, str) and mc == "auto" else bool(mc)
        if self.solver == "gradient":
            mc = False                      # value_and_grad has no log-prior
        self._mass_constrained = mc
        cfg = EngineConfig(n_clusters=K, resp=rc, mass_constrained=mc,
                           max_iter=int(self.max_iter), tol=float(self.tol),
                           polish=bool(self.polish), max_polish_iter=int(self.max_polish_iter),
                           diagnostics=self.diagnostics, verbose=int(self.verbose))
        bar = None
        if self.progress:
            bar = _progress_bar(schedule)
            cfg.progress = lambda step, T, rec: (bar.update(1), bar.set_postfix(
                T=f"{T:.3g}", J=f"{rec['hard_distortion']:.5g}"))
        trace = Trace()
        try:
            with warnings.catch_warnings():
                if self.solver == "gradient":
                    gsrc = source
                    if not hasattr(source, "X"):
                        if Xmem is None:
                            raise ValueError("solver='gradient' needs the rows in memory "
                                             "(backend 'cpu' or 'cuda', not 'dask')")
                        gsrc = InMemorySource(Xmem, w, source.metric)
                    result = anneal_gradient(
                        gsrc, C, schedule, T0, T_end, cfg, rng, scale, trace, t0,
                        learning_rate=self.learning_rate, betas=self.adam_betas,
                        steps_per_temperature=int(self.gradient_steps),
                        separation_weight=self.separation_weight, phi=self.phi,
                        margin=self.phi_margin, eps=self.phi_eps,
                        anchor_weight=self.anchor_weight)
                elif isinstance(schedule, CriticalSchedule):
                    result = anneal_critical(source, C[0], schedule, T0, T_end, cfg, rng,
                                             scale, trace, t0)
                else:
                    result = anneal(source, C, schedule, T0, T_end, cfg, rng, scale, trace,
                                    t0)
        finally:
            if bar is not None:
                bar.close()
        if not result.converged:
            warnings.warn(f"Lloyd polish did not converge in {self.max_polish_iter} iterations",
                          AnnealingWarning, stacklevel=3)
        if result.relocations:
            warnings.warn(f"{result.relocations} empty cluster(s) were relocated during the fit",
                          AnnealingWarning, stacklevel=3)
        dmin, _ = min_center_distance(result.centers)
        if K > 1 and not dmin > 0:
            raise RuntimeError("coincident centers survived the fit; please report this")
        result.hard_objective_final = float(trace["hard_distortion"][-1])
        return result, trace, T0

    # ------------------------------------------------------------------ inference
    def _check_X(self, X):
        check_is_fitted(self, "cluster_centers_")
        X = self._validate_X(X, reset=False)
        return X

    def predict(self, X):
        """Nearest center (the deployed hard rule)."""
        X = self._check_X(X)
        return _assign(X, self.cluster_centers_, metric_code(self.metric), _prepared=True)[0]

    def fit_predict(self, X, y=None, sample_weight=None):
        return self.fit(X, sample_weight=sample_weight).labels_

    def predict_proba(self, X, temperature=None):
        """Soft responsibilities at ``temperature`` (default: the final annealing T), with the
        fitted cluster masses as prior when ``mass_constrained``."""
        X = self._check_X(X)
        T = self.temperature_ if temperature is None else float(temperature)
        if not (math.isfinite(T) and T > 0):
            raise ValueError(f"temperature must be finite and > 0; got {temperature!r}")
        from ._moments import responsibilities as _resp
        logp = None
        if getattr(self, "_mass_constrained", False) and self.responsibilities == "softmax":
            logp = np.log(np.maximum(self.cluster_weights_, 1e-300))
        C = self.cluster_centers_
        return _resp(X, C, T, metric=self.metric, kind=self.responsibilities, log_prior=logp)

    def transform(self, X):
        """Distances to the centers (Euclidean, as scikit-learn; cosine: ``sqrt(2 - 2 cos)``)."""
        X = self._check_X(X)
        from ._moments import pairwise_distances
        return np.sqrt(pairwise_distances(X, self.cluster_centers_,
                                          metric="euclidean" if self.metric != "cosine"
                                          else "cosine"))

    def score(self, X, y=None, sample_weight=None):
        """Opposite of the hard objective ``J`` on X."""
        X = self._check_X(X)
        w = self._validate_weights(sample_weight, X.shape[0])
        _, dmin, _ = _assign(X, self.cluster_centers_, metric_code(self.metric), _prepared=True)
        return -float(w @ dmin)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        return tags


def _progress_bar(schedule):
    try:
        from tqdm.auto import tqdm
    except ImportError as e:  # pragma: no cover - optional extra
        raise ImportError("progress=True needs tqdm: pip install 'fastanneal[progress]'") from e
    return tqdm(total=getattr(schedule, "n_steps", None), desc="annealing", unit="T")

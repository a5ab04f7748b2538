"""The estimators: :class:`AnnealedKMeans` (full-batch annealing on any backend) and
:class:`MiniBatchAnnealedKMeans` (stochastic-EM annealing over batches, in process for NumPy
input, out of core over Dask chunks or Parquet row groups). Both share
:class:`_BaseAnnealedKMeans` (validation, inference) and run the one engine loop of
:mod:`fastanneal._engine`; seeding lives in :mod:`fastanneal._seeding`."""
import copy
import functools
import math
import numbers
import os
import sys
import time
import warnings

import numpy as np
from sklearn.base import (BaseEstimator, ClassNamePrefixFeaturesOutMixin, ClusterMixin,
                          TransformerMixin)
from sklearn.utils.validation import check_is_fitted, validate_data

from . import _engine as E
from ._engine import AnnealingWarning, EngineConfig, min_center_distance
from ._minibatch import (MINIBATCH_SCHEDULES, ArrayStream, RunningMoments, StochasticEMRule,
                         check_learning)
from ._moments import assign as _assign
from ._moments import nearest_objective, nearest_objective_counts, pinned_blas
from ._protocol import check_source
from ._seeding import (check_n_clusters, critical_temperature, data_stats, initial_centers,
                       kmeans_plusplus, rows_coincide, start_temperature, warn_narrow_cone)
from ._sources import InMemorySource
from ._sources import n_distinct_rows as _n_distinct_rows_exact
from ._trace import Trace
from ._validation import (centered_rows, check_normal_weights, check_range, far_from_origin,
                          float_dtype_of, metric_code, normalize_rows, resp_code, shifted_rows)
from .schedules import CriticalSchedule, make_schedule

__all__ = ["AnnealedKMeans", "MiniBatchAnnealedKMeans", "AnnealingWarning", "kmeans_plusplus"]


#: ``probability_temperature_ = PROBABILITY_MARGIN_FRACTION * median margin``: measured on
#: CLINC150 and its ten domains by ``benchmarks/study_calibration.py``.
PROBABILITY_MARGIN_FRACTION = 0.25
#: Rows for that median where the fit's final pass does not see every row in memory:
#: out of core (open_parquet), every k-th row of the final pass, about this many (up to
#: twice); Dask and CUDA, this many drawn after the fit from its random stream.
PROBABILITY_SAMPLE = 20_000
#: In memory the final pass's margins of every row are used, up to this many rows (above,
#: this many drawn from them: the weighted median sorts them).
PROBABILITY_ALL_ROWS = 1_000_000


def probability_temperature(X, w, centers, metric, fraction=PROBABILITY_MARGIN_FRACTION,
                            fallback=None):
    """``fraction`` times the weighted median margin ``d_(2) - d_(1)`` of the rows ``X``
    (weights ``w``) to ``centers``: the temperature of :meth:`AnnealedKMeans.predict_proba`.
    ``fallback`` when there is no positive margin (K = 1, all rows on borders)."""
    from ._moments import assign as _assign_public
    K = np.asarray(centers).shape[0]
    margin = _assign_public(X, centers, metric)[2] if K > 1 and X.shape[0] else None
    return margin_temperature(margin, w, fraction, fallback)


def margin_temperature(margin, w, fraction=PROBABILITY_MARGIN_FRACTION, fallback=None):
    """:func:`probability_temperature` from the rows' margins (None: no margin)."""
    w = np.asarray(w, dtype=np.float64)
    if margin is not None and len(margin):
        m = np.asarray(margin, dtype=np.float64)
        ok = np.isfinite(m) & (w > 0)
        if ok.any():
            m, ww = m[ok], w[ok]
            order = np.argsort(m, kind="stable")
            cw = np.cumsum(ww[order])
            med = float(m[order][np.searchsorted(cw, 0.5 * cw[-1])])
            if med > 0:
                return fraction * med
    if fallback is None or not (math.isfinite(fallback) and fallback > 0):
        raise ValueError("no positive margin to choose the probability temperature from")
    return float(fallback)


def _sample_with_weight(source, n, rng):
    """``source.sample(n, rng)``, drawn again from the rows of weight > 0 where the drawn
    row groups carry no weight (a log of a few weighted rows) and the source can."""
    Xs, ws = source.sample(n, rng)
    if not np.asarray(ws).sum() > 0 and hasattr(source, "sample_weighted"):
        Xs, ws = source.sample_weighted(n, rng)
    return Xs, ws


def _n_distinct_rows(X, rng, cap):
    """Number of distinct rows (all weights positive; see :func:`_sources.n_distinct_rows`)."""
    return _n_distinct_rows_exact(X, np.ones(X.shape[0]), rng)


def _distance_rows(X, C, metric):
    """:meth:`AnnealedKMeans.transform` of prepared rows (module level: Dask ships it)."""
    from ._moments import exact_nearest_distances, pairwise_distances
    metric = "cosine" if metric == "cosine" else "euclidean"
    D2 = pairwise_distances(X, C, metric=metric)
    # a row on its center is at distance 0, not at the square root of the GEMM form's
    # rounding (5e-4 for float32 rows of norm ~10): each row's two nearest exactly
    return np.sqrt(exact_nearest_distances(X, C, D2, metric))


def _proba_rows(X, C, T, metric, kind, log_prior):
    """:meth:`AnnealedKMeans.predict_proba` of prepared rows."""
    from ._moments import responsibilities
    return responsibilities(X, C, T, metric=metric, kind=kind, log_prior=log_prior)


def _nearest_rows(X, C, metric):
    """The squared distance to the nearest center of each prepared row, (m, 1) float64,
    summed element by element in float64 (``score`` on Dask input: the same numbers as
    on NumPy input, :func:`~fastanneal._moments.nearest_objective`)."""
    if not X.shape[0]:
        return np.zeros((0, 1))
    from ._moments import nearest_distances
    return nearest_distances(X, C, metric_code(metric))[1][:, None]


def _real(v):
    """A real number that is not a bool (``True`` is not a temperature)."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _positive_int(est, name):
    v = getattr(est, name)
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive integer; got {v!r}")
    return int(v)


class _BaseAnnealedKMeans(ClassNamePrefixFeaturesOutMixin, ClusterMixin, TransformerMixin,
                          BaseEstimator):
    """What both estimators share: parameter checks, the random generator, input
    validation, the checkpoint, the fitted attributes and inference."""

    @property
    def _n_features_out(self):
        """``transform``'s columns, one per cluster (``get_feature_names_out`` names them
        ``annealedkmeans0``, ...; ``set_output`` works)."""
        return self.cluster_centers_.shape[0]

    # ------------------------------------------------------------------ validation
    def _check_common(self, n_samples=None):
        K = self.n_clusters
        if isinstance(K, str) and K == "auto" and hasattr(self, "k_max"):
            km, kn = self.k_max, self.k_min
            for name, v in (("k_max", km), ("k_min", kn)):
                if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 2:
                    raise ValueError(f"n_clusters='auto' needs {name} >= 2 (an integer); "
                                     f"got {v!r}")
            if km < kn:
                raise ValueError(f"k_max={km} must be >= k_min={kn}")
            K = km
        elif not isinstance(K, numbers.Integral) or isinstance(K, bool) or K < 1:
            extra = " or 'auto'" if hasattr(self, "k_max") else ""
            raise ValueError(f"n_clusters must be a positive integer{extra}; got {K!r}")
        if n_samples is not None and n_samples < K:
            name = "k_max" if K is not self.n_clusters else "n_clusters"
            raise ValueError(f"n_samples={n_samples} should be >= {name}={K}")
        metric_code(self.metric)
        rc = resp_code(self.responsibilities)
        if rc == 2:
            raise ValueError("responsibilities must be 'softmax' or 'entmax15' for fitting")
        _positive_int(self, "n_steps")
        # (a temperature, or a factor of one, must leave T and 1/T finite: see
        # check_temperature; T_end = ratio * T_start is checked once T_start is known:
        # _end_temperature)
        r = self.temperature_end_ratio
        if not (_real(r) and 1e-300 <= r <= 1):
            raise ValueError(f"temperature_end_ratio must be in (0, 1] (at least 1e-300); got "
                             f"{r!r}")
        f = self.auto_start_fraction
        if not (_real(f) and 0 < f < math.inf):
            raise ValueError(f"auto_start_fraction must be > 0 (and finite); got {f!r}")
        ts = self.temperature_start
        if isinstance(ts, str):
            if ts not in ("auto", "critical"):
                raise ValueError("temperature_start must be 'auto', 'critical' or a positive "
                                 f"number; got {ts!r}")
        elif not (_real(ts) and math.isfinite(ts) and ts >= np.finfo(np.float64).tiny):
            raise ValueError(f"temperature_start must be 'auto', 'critical' or a positive "
                             f"number (a normal float64); got {ts!r}")
        for name in ("polish", "reallocate", "stop_when_hard", "progress"):
            v = getattr(self, name, False)
            if not (isinstance(v, (bool, np.bool_))
                    or (isinstance(v, numbers.Integral) and v in (0, 1))):
                raise ValueError(f"{name} must be True or False; got {v!r}")
        ck = self.checkpoint
        if ck is not None and not isinstance(ck, (str, os.PathLike)):
            raise ValueError(f"checkpoint must be None or a path (a folder or a .npz file); "
                             f"got {ck!r}")
        if not (isinstance(self.mass_constrained, bool) or self.mass_constrained == "auto"):
            raise ValueError(f"mass_constrained must be True, False or 'auto'; got "
                             f"{self.mass_constrained!r}")
        check_learning(self.learning_decay, self.learning_offset) \
            if hasattr(self, "learning_decay") else None
        return rc

    #: the private state a fit leaves beside its ``..._`` attributes
    _FIT_STATE = ("_partial_state", "_origin", "_scale", "_rows_seen", "_mass_constrained",
                  "_run_schedule", "_fitted_with")

    #: the parameters inference or partial_fit read: set_params after fit must not change a
    #: fitted model (``responsibilities``: predict_proba at a given temperature, partial_fit)
    _INFERENCE_PARAMS = ("metric", "responsibilities")

    def _forget_fit(self):
        """A new fit starts unfitted: nothing of an earlier fit survives it (``k_suggestion_``
        after a refit with an integer K, ``checkpoint_info_`` after one without a
        checkpoint), and a refit that fails leaves no old centers beside its new
        ``n_features_in_`` (``predict`` then says the estimator is not fitted)."""
        for k in [k for k in self.__dict__ if (k.endswith("_") and not k.startswith("__"))
                  or k in self._FIT_STATE]:
            del self.__dict__[k]
        self._fitted_with = {p: getattr(self, p, None) for p in self._INFERENCE_PARAMS}

    def _check_unchanged(self, params=("metric",)):
        """ValueError when ``set_params`` changed one of ``params`` (of
        ``_INFERENCE_PARAMS``) after the fit (predict read the new metric: cosine rows
        against Euclidean centers); a model fitted before this check existed passes."""
        rec = self.__dict__.get("_fitted_with")
        if not rec:
            return
        for p, v in rec.items():
            if p not in params:
                continue
            now = getattr(self, p, None)
            if now != v:
                raise ValueError(f"{p} was {v!r} when this model was fitted and is {now!r} "
                                 "now (set_params after fit): fit again, or set it back")

    def _rng(self):
        rs = self.random_state
        if isinstance(rs, np.random.Generator):
            return rs
        if isinstance(rs, np.random.RandomState):
            return np.random.default_rng(rs.randint(2 ** 31))
        try:                # what numpy takes: ints >= 0, SeedSequence, BitGenerator, ...
            return np.random.default_rng(rs)
        except (TypeError, ValueError):
            raise ValueError("random_state must be None, an integer >= 0, a "
                             f"numpy.random.Generator or RandomState; got {rs!r}") from None

    def _validate_X(self, X, reset):
        if not reset:
            self._check_unchanged()
        dt = getattr(X, "dtype", None)
        if isinstance(dt, np.dtype) and not dt.isnative and float_dtype_of(dt) == np.float32:
            X = np.asarray(X, dtype=np.float32)     # big-endian float32 stays float32
        X = validate_data(self, X, reset=reset, dtype=[np.float64, np.float32], order="C",
                          accept_sparse=False)
        if metric_code(self.metric) == 1:
            X = normalize_rows(X)
        check_range(X, "X")
        return X

    @staticmethod
    def _validate_weights(sample_weight, n, allow_zero=False, dtype=None):
        """Checked float64 weights; ``allow_zero``: all-zero weights are valid (a
        ``partial_fit`` batch after the first: rows that carry no weight); ``dtype``: the
        rows' dtype (float32 rows carry weights in ``FLOAT32_WEIGHT_RANGE`` only)."""
        if sample_weight is None:
            return np.ones(n)
        w = np.asarray(sample_weight)
        if w.dtype.kind == "c":
            raise ValueError("sample_weight holds complex numbers; expected real numbers")
        w = np.asarray(w, dtype=np.float64)
        if w.ndim == 0:
            w = np.full(n, float(w))
        if w.shape != (n,):
            raise ValueError(f"sample_weight.shape == {w.shape}, expected ({n},)!")
        if not np.isfinite(w).all():
            raise ValueError(f"sample_weight contains NaN or infinity (first at row "
                             f"{int(np.argmax(~np.isfinite(w)))})")
        if (w < 0).any():
            raise ValueError(f"sample_weight contains negative values (first at row "
                             f"{int(np.argmax(w < 0))})")
        check_normal_weights(w)
        with np.errstate(over="ignore"):
            total = w.sum()
        if not total > 0 and not (allow_zero and n > 0 and total == 0):
            raise ValueError("sample_weight sums to zero: no row carries weight")
        if not math.isfinite(total):
            raise ValueError(f"sample_weight sums to infinity (largest weight "
                             f"{float(w.max()):.3g}): rescale the weights (only their "
                             "ratios matter)")
        if dtype is not None:
            from ._validation import check_weight_range
            check_weight_range(w, dtype)
        return np.ascontiguousarray(w)

    def _fit_params(self):
        """The parameters that decide a fit's result (the checkpoint key)."""
        skip = {"verbose", "progress", "scheduler", "checkpoint", "backend", "prefetch"}
        out = {}
        for k, v in self.get_params(deep=False).items():
            if k in skip:
                continue
            if isinstance(v, np.ndarray):
                v = v.tolist()
            elif isinstance(v, (np.random.Generator, np.random.RandomState)):
                v = repr(v)        # a live generator: no reproducible key, best effort
            elif k == "schedule" and not isinstance(v, str):
                # a schedule object by its class and settings, the same in every process
                # (the default repr of a plain protocol object holds its memory address:
                # a new process never found its checkpoint)
                from .schedules import schedule_key
                v = schedule_key(v)
            out[k] = v
        return dict(out, estimator=type(self).__name__)

    def _make_checkpoint(self, source, K, run=None, required=("T0",)):
        if self.checkpoint is None:
            return None
        from ._checkpoint import Checkpoint, params_key, resolve_path
        path = resolve_path(self.checkpoint)
        if run is not None:
            path = path.with_name(f"{path.stem}.run{run}{path.suffix}")
        key = params_key(source.fingerprint(), dict(self._fit_params(), run=run))
        # ``required``: the values a resumed fit reads back from the file's extra (a file
        # edited by hand without them is a bad file: a warning and a fresh start)
        return Checkpoint(path, key, K, source.n_features, required_extra=required)

    def _centered(self, X, w):
        """``(rows, origin)``: Euclidean rows far from the origin relative to their spread
        are fitted as a centered copy, measured from their weighted mean ``origin``
        (``docs/theory.md``, "Rows far from the origin"); ``origin`` is None otherwise."""
        if metric_code(self.metric) != 0:
            return X, None
        return centered_rows(X, w)

    # ------------------------------------------------------------------ inference
    def _check_X(self, X):
        check_is_fitted(self, "cluster_centers_")
        if _out_of_core_input(X):
            # (scikit-learn's "Expected 2D array, got scalar array" before)
            raise ValueError("predict, transform, score and predict_proba take rows (a NumPy "
                             "or Dask array), not a Parquet path or open_parquet stream: "
                             "fit(..., labels_path=...) writes every row's label out of "
                             "core, or read the rows (fastanneal.dask.read_parquet_embeddings "
                             "gives a Dask array)")
        return self._validate_X(X, reset=False)

    def _frame_centers(self):
        """``(centers, origin)``: ``cluster_centers_`` measured from the fit's origin (rows
        far from the origin were fitted centered: ``docs/theory.md``, "Rows far from the
        origin"; float64) and that origin -- or ``(cluster_centers_, None)``."""
        origin = getattr(self, "_origin", None)
        if origin is None:
            return self.cluster_centers_, None
        return self.cluster_centers_.astype(np.float64) - origin, origin

    def _frame_for(self, dtype):
        """:meth:`_frame_centers` for rows of ``dtype``: a fit without an origin (its rows
        were near enough the origin for ITS dtype) measures rows of a coarser dtype from
        the centers' mean when they are far for that dtype (float32 rows after a float64
        fit of rows offset by 4e6 got half their labels from float32 rounding of
        |x|^2)."""
        C, origin = self._frame_centers()
        if origin is None and np.dtype(dtype) != np.dtype(C.dtype) \
                and metric_code(self.metric) == 0:
            from .dask._minibatch import _centers_origin
            C64 = np.asarray(C, dtype=np.float64)
            o = _centers_origin(C64, 0, np.dtype(dtype))
            if o is not None:
                return C64 - o, o
        return C, origin

    def _dask_frame(self, X):
        """:meth:`_frame_for` the rows of the Dask collection ``X``."""
        self._check_unchanged()
        return self._frame_for(float_dtype_of(getattr(X, "dtype", np.float64)))

    def _in_frame(self, X):
        """``(X, centers)`` measured from the fit's origin (:meth:`_frame_for`): the same
        distances, computed without the rounding of large norms."""
        C, origin = self._frame_for(X.dtype)
        return (X if origin is None else shifted_rows(X, origin)), C

    @pinned_blas
    def predict(self, X):
        """Nearest center (the deployed hard rule). Dask arrays give a lazy Dask array."""
        if hasattr(X, "__dask_graph__"):
            from .dask import predict_labels
            check_is_fitted(self, "cluster_centers_")
            C, origin = self._dask_frame(X)
            return predict_labels(X, C, self.metric, origin=origin)
        X, C = self._in_frame(self._check_X(X))
        return _assign(X, C, metric_code(self.metric), _prepared=True)[0]

    def fit_predict(self, X, y=None, sample_weight=None):
        """Fit on ``X`` (with ``sample_weight``) and return ``labels_``; out of core, where
        the fit keeps no labels (``labels_`` is None), the lazy :meth:`predict` of a Dask
        array (or of an :class:`~fastanneal.dask.EmbeddingArrays`' rows) with the fitted
        centers; a Parquet path is an error after the fit (its labels are written by
        ``fit(..., labels_path=...)``)."""
        rows = X
        inputs = sys.modules.get("fastanneal.dask._inputs")      # (loaded by any Dask input)
        if inputs is not None and isinstance(X, inputs.EmbeddingArrays):
            rows = X.X
        lazy = hasattr(rows, "__dask_graph__")
        minibatch = (isinstance(self, MiniBatchAnnealedKMeans)
                     or bool(getattr(self, "batch_size", None)))
        if not lazy and minibatch and _out_of_core_input(X):
            # said before an out-of-core fit that may take hours, not after it
            raise ValueError("fit_predict keeps no labels for an out-of-core input (a Parquet "
                             "path or open_parquet): MiniBatchAnnealedKMeans(...).fit(X, "
                             "labels_path=...) writes them")
        self.fit(X, sample_weight=sample_weight)
        if self.labels_ is not None:
            return self.labels_
        if lazy:
            return self.predict(rows)
        raise ValueError("fit_predict keeps no labels for an out-of-core input: the model is "
                         "fitted; write the labels with fit(X, labels_path=...) or predict "
                         "on a Dask array of the rows")

    @pinned_blas
    def predict_proba(self, X, temperature=None):
        """Soft cluster probabilities of the rows of ``X``, (n, K), rows summing to 1.

        ``temperature=None`` (default): the probability of a mixture of the fitted clusters,
        ``softmax_k(log w_k - d_ik / T_p)`` with the cluster masses ``w_k`` as prior, at the
        temperature ``T_p = probability_temperature_`` chosen from the data after the fit
        (a fixed fraction of the median margin ``d_(2) - d_(1)``; see ``docs/theory.md``,
        "Probabilities that mean something"). At the final annealing temperature the soft
        rule is nearly hard (about 1.0 on every row) and says nothing about which rows are
        ambiguous; at ``T_p`` the row with the median margin gets about 0.98 (1 / (1 + e^-4)) against its
        runner-up, and rows on a border between clusters get about 0.5. The masses weigh
        in: a border row next to a much larger cluster can be most probable there although
        :meth:`predict` (the nearest center) names the other, so ``argmax`` of this and
        ``predict`` may differ on such rows.
        ``temperature="final"`` or a number: the fit's own rule (``responsibilities``, with
        the masses as prior when ``mass_constrained``) at the final annealing temperature or
        at that temperature.
        """
        from ._moments import responsibilities as _resp
        if hasattr(X, "__dask_graph__"):
            check_is_fitted(self, "cluster_centers_")
            T, kind, logp = self._probability_rule(temperature)
            C, origin = self._dask_frame(X)
            return self._dask_rows(X, C, origin, functools.partial(
                _proba_rows, T=T, metric=self.metric, kind=kind, log_prior=logp))
        X, C = self._in_frame(self._check_X(X))
        T, kind, logp = self._probability_rule(temperature)
        return _resp(X, C, T, metric=self.metric, kind=kind, log_prior=logp)

    def _dask_rows(self, X, C, origin, fn):
        """A lazy (n, K) Dask array of ``fn(rows, C)`` per row chunk of the Dask input ``X``
        (rows validated like a fit's and measured from ``origin``; the rows' dtype)."""
        from .dask import map_rows
        dt = float_dtype_of(getattr(X, "dtype", np.float64))
        return map_rows(X, np.asarray(C, dtype=np.float64), self.metric, origin, fn, dt)

    def _probability_rule(self, temperature):
        """``(T, kind, log_prior)`` of :meth:`predict_proba` (see there)."""
        if temperature is None and hasattr(self, "probability_temperature_"):
            logp = np.log(np.maximum(self.cluster_weights_, 1e-300))
            return self.probability_temperature_, "softmax", logp
        self._check_unchanged(("responsibilities",))      # the fit's own rule from here on
        if temperature is None or (isinstance(temperature, str) and temperature == "final"):
            T = self.temperature_
        else:
            try:
                if isinstance(temperature, (bool, np.bool_)):
                    raise TypeError
                T = float(temperature)
            except (TypeError, ValueError):
                raise ValueError(f"temperature must be None, 'final' or a number > 0; got "
                                 f"{temperature!r}") from None
        if not (math.isfinite(T) and T > 0):
            raise ValueError(f"temperature must be finite and > 0; got {temperature!r}")
        logp = None
        if getattr(self, "_mass_constrained", False) and self.responsibilities == "softmax":
            logp = np.log(np.maximum(self.cluster_weights_, 1e-300))
        return T, self.responsibilities, logp

    def _set_probability_temperature(self, source, rng, centers, margin=None, margin_w=None):
        """``probability_temperature_`` from the margins the final pass gave (``margin``:
        of every row in memory, weights ``source.w``; of every k-th row out of core, weights
        ``margin_w``; no extra pass), else from a sample of the fitted rows (after the fit;
        ``centers`` in the source's frame)."""
        T = float(self.temperature_)
        # no positive margin (K = 1, all rows on borders) and no positive final temperature
        # (rows without spread: the critical schedule's T_c is 0): any T gives the same
        # probabilities there (one cluster, or rows with equal distances)
        fallback = T if math.isfinite(T) and T > 0 else 1.0
        if margin is not None:
            w = source.w if margin_w is None else margin_w
            if len(margin) > PROBABILITY_ALL_ROWS:
                # (the weighted median sorts: 3.7 s at 10^7 rows; a million drawn with
                # replacement from the margins at hand, no pass, fix it to ~1e-3)
                idx = rng.integers(0, len(margin), PROBABILITY_ALL_ROWS)
                margin, w = np.asarray(margin)[idx], np.asarray(w)[idx]
            self.probability_temperature_ = margin_temperature(
                margin if np.asarray(centers).shape[0] > 1 else None, w,
                fallback=fallback)
            return
        Xs, ws = _sample_with_weight(source, min(PROBABILITY_SAMPLE, source.n_rows), rng)
        self.probability_temperature_ = probability_temperature(
            Xs, ws, centers, self.metric, fallback=fallback)

    def _set_centers(self, C, origin, dtype):
        """``cluster_centers_`` (the data's frame, ``dtype``) from the fit's centers ``C``
        (measured from ``origin``); returns them in the fit's frame as the inference methods
        see them (float64), for the final labels and statistics: ``labels_ ==
        predict(X)``."""
        self._origin = origin
        self.cluster_centers_ = (C if origin is None
                                 else np.asarray(C, np.float64) + origin).astype(dtype)
        return self._frame_centers()[0]

    @pinned_blas
    def transform(self, X):
        """Distances to the centers (Euclidean, as scikit-learn; cosine: ``sqrt(2 - 2 cos)``).
        Dask arrays give a lazy Dask array (one task per row chunk)."""
        fn = functools.partial(_distance_rows, metric=self.metric)
        if hasattr(X, "__dask_graph__"):
            check_is_fitted(self, "cluster_centers_")
            C, origin = self._dask_frame(X)
            return self._dask_rows(X, C, origin, fn)
        X, C = self._in_frame(self._check_X(X))
        return fn(X, C)

    @pinned_blas
    def score(self, X, y=None, sample_weight=None):
        """Opposite of the hard objective ``J`` on X (for a Dask array computed chunk by
        chunk, with the weights as a Dask or NumPy array)."""
        if hasattr(X, "__dask_graph__"):
            check_is_fitted(self, "cluster_centers_")
            C, origin = self._dask_frame(X)
            from .dask import map_rows
            d = map_rows(X, np.asarray(C, dtype=np.float64), self.metric, origin,
                         functools.partial(_nearest_rows, metric=self.metric), np.float64,
                         cols=1)[:, 0]
            if sample_weight is not None:
                from .dask._inputs import _as_aligned
                w = sample_weight
                if not hasattr(w, "__dask_graph__"):
                    w = self._validate_weights(w, d.shape[0])
                # a Dask Series, or an array of unknown chunk sizes (as fit takes them)
                w = _as_aligned(w, d.chunks[0], "sample_weight")
                import dask
                from .dask._chunks import raise_bad_weights, weight_stats
                # every chunk's faults, reported in row order (a check inside each chunk
                # named whichever chunk failed first: "the first is row 2800" for rows
                # that were all negative)
                row0 = np.concatenate([[0], np.cumsum(w.chunks[0])]).astype(np.int64)
                stats = [dask.delayed(weight_stats)(b, i, int(row0[i]))
                         for i, b in enumerate(w.to_delayed().ravel())]
                total, stats = dask.compute((d * w.astype(np.float64)).sum(), stats)
                raise_bad_weights(stats)
                W = sum(st["sum"] for st in stats)
                if not W > 0:                                   # as for NumPy weights
                    raise ValueError("sample_weight sums to zero: no row carries weight")
                if not math.isfinite(W):
                    raise ValueError("sample_weight sums to infinity: rescale the weights "
                                     "(only their ratios matter)")
                return -float(total)
            return -float(d.sum().compute())
        X = self._check_X(X)
        w = self._validate_weights(sample_weight, X.shape[0])
        X, C = self._in_frame(X)
        return -nearest_objective(X, w, C, metric_code(self.metric))[1]

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else dict(self.__dict__)
        state = dict(state)
        sched = state.get("scheduler")
        if sched is not None and not isinstance(sched, str):
            state["scheduler"] = None       # a live distributed.Client does not pickle
        return state

    # ------------------------------------------------------------------ partial_fit
    @pinned_blas
    def partial_fit(self, X, y=None, sample_weight=None):
        """One stochastic-EM annealing update on the batch ``X`` (one temperature step per
        call; the temperature holds at its end value after ``n_steps`` calls). The first call
        on an unfitted estimator seeds (k-means++) and sets the start temperature and scale
        from its batch; on a fitted one (after ``fit``) it continues from the fitted centers
        at the final temperature, the fit counting as the rows it saw (as scikit-learn's
        ``MiniBatchKMeans.partial_fit`` continues from ``fit``). The schedule must be
        "geometric", "linear" or "constant" (one temperature a call: the critical and
        adaptive schedules decide their next temperature from full passes). A batch whose
        rows all weigh zero leaves a started fit as it is (scikit-learn's
        ``MiniBatchKMeans`` refuses it); it cannot start one. After ``fit``, ``n_iter_``
        and ``n_steps_`` count on from the fit's; what describes the fit's annealing
        (``free_energy_``, ``soft_distortion_``, ``hardening_gap_``, ``hardened_step_``,
        ``settled_step_``, ``schedule_``, ``n_reallocations_`` and the mini-batch route's
        counts of rows and batches) still describes that fit."""
        if getattr(self, "backend", None) == "cuda":
            raise ValueError("partial_fit runs on the CPU; backend='cuda' applies to fit "
                             "(leave backend unset for partial_fit)")
        first = not hasattr(self, "_partial_state")
        fitted = first and hasattr(self, "cluster_centers_")
        if first and getattr(self, "checkpoint", None) is not None:
            from ._checkpoint import CheckpointWarning
            warnings.warn("checkpoint= saves the annealing of fit(); partial_fit writes no "
                          "checkpoint (pickle the estimator between batches to resume: it "
                          "continues exactly)", CheckpointWarning, stacklevel=2)
        if first and not fitted:
            self._fitted_with = {p: getattr(self, p, None) for p in self._INFERENCE_PARAMS}
        else:
            self._check_unchanged(self._INFERENCE_PARAMS)
        X = self._validate_X(X, reset=first and not fitted)
        model_dtype = getattr(getattr(self, "cluster_centers_", None), "dtype", None)
        if not (first and not fitted) and model_dtype is not None and X.dtype != model_dtype:
            # a continuing batch in the model's dtype, checked there: a float64 batch of
            # values ~1e25 made a float32 model's centers ~1e23 (then ZeroDivisionError in
            # the kernel on the next batch)
            X = np.ascontiguousarray(X, dtype=model_dtype)
            check_range(X, "X", where=f"(in the {model_dtype} of the model's first batch)")
        # a batch whose rows all weigh zero carries nothing: once the fit has started it
        # leaves the state as it is (labels_ and inertia_ describe the batch)
        w = self._validate_weights(sample_weight, X.shape[0], allow_zero=not first or fitted,
                                   dtype=X.dtype)
        if not w.sum() > 0:
            Xf, Cf = self._in_frame(X)
            self.labels_, self.inertia_ = nearest_objective(Xf, w, Cf,
                                                            metric_code(self.metric))
            return self
        if fitted:
            self._partial_state = _PartialFit.from_fitted(self, X)
        elif first:
            self._partial_state = _PartialFit(self, X, w)
        self._partial_state.update(X, w)
        self._partial_state.apply_to(self)
        # predict_proba's temperature from this batch (the latest rows the centers saw);
        # labels_ and inertia_ describe this batch, as scikit-learn's partial_fit
        Xf, Cf = self._in_frame(X)
        self.probability_temperature_ = probability_temperature(
            Xf, w, Cf, self.metric, fallback=self.temperature_)
        self.labels_, self.inertia_ = nearest_objective(Xf, w, Cf, metric_code(self.metric))
        return self


class AnnealedKMeans(_BaseAnnealedKMeans):
    """Annealed soft k-means (deterministic annealing) with a hard, Lloyd-polished result.

    Each point gets soft responsibilities ``r_ik = softmax_k(log p_k - d_ik / T)`` (``d`` the
    squared Euclidean distance; for ``metric="cosine"`` unit vectors and ``d = 2 - 2 cos``);
    the temperature ``T`` is lowered along a schedule, soft Lloyd (EM) runs at each
    temperature, and a final Lloyd polish at ``T = 0`` gives the deployed hard partition.

    Parameters
    ----------
    n_clusters : int or "auto", default=8
        ``"auto"``: K chosen in ``k_min..k_max`` from the phase transitions (the finest
        natural level: a plateau of the number of effective clusters in log T; see
        :func:`fastanneal.suggest_k`), then the fit continues from that state;
        ``n_clusters_`` and ``k_suggestion_`` say what was chosen and why. The path is
        its own schedule: ``init``, ``n_init``, ``schedule``, ``n_steps``,
        ``temperature_start`` and ``mass_constrained`` do not apply there. A K above the
        number of distinct rows (of weight > 0) is an error, not a warning as in
        scikit-learn's KMeans: the fit would hold coincident centers.
    k_max : int or None, default=None
        The most clusters ``n_clusters="auto"`` considers (required there; the path's cost
        grows with it).
    k_min : int, default=2
        The fewest clusters ``n_clusters="auto"`` considers.
    metric : {"euclidean", "cosine"}, default="euclidean"
    responsibilities : {"softmax", "entmax15"}, default="softmax"
        ``entmax15`` gives sparse responsibilities that are exactly hard once
        ``T <= Delta_min / 2``.
    schedule : {"geometric", "linear", "constant", "critical", "adaptive"} or Schedule
        ``"critical"`` is deterministic annealing from just above ``T_c = 2 lambda_max(C)``
        with all centers at the mean (clusters split at their critical temperatures).
    n_steps : int, default=20
        Temperatures of the geometric / linear / constant schedules; the step budget of
        ``"adaptive"``.
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
        ``"summary"``: one trace record per temperature; ``"full"``: one per iteration
        (the critical phase of ``schedule="critical"`` records once per temperature either
        way).
        The hard objective ``J`` comes with every moments pass at no extra cost, so both
        record it.
    verbose : int, default=0
        1: one line per temperature step (T, F, J, entropy, distinct centers) and per
        phase on stderr.
    progress : bool, default=False
        Show a tqdm progress bar over temperature steps (needs ``fastanneal[progress]``).
    solver : {"lloyd", "gradient"}, default="lloyd"
        ``"gradient"``: Adam on the centers for ``L = L_comp - separation_weight * L_sep``
        (:func:`fastanneal.value_and_grad`), ``gradient_steps`` steps per temperature,
        gradient norms in ``trace_["grad_norm"]``; on every backend.
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
        Set: mini-batch annealing (stochastic EM, step size
        ``(t + learning_offset) ** -learning_decay``) by :class:`MiniBatchAnnealedKMeans`:
        in process for NumPy input, over Dask chunks otherwise (``labels_`` is then None:
        use ``predict`` or :func:`fastanneal.dask.write_labels`).
    learning_decay : float in (0.5, 1], default=0.6
    learning_offset : float >= 1, default=1.0
    checkpoint : str, path or None, default=None
        Save the annealing state at every temperature step to ``PATH`` (a ``.npz`` file, or
        a folder that gets ``anneal.npz``; written atomically) and resume from it: a fit
        killed at any point and rerun with the same data and parameters continues where the
        last step ended and returns the same centers as an uninterrupted fit. The file holds
        a key of the data and parameters; a file for another fit is replaced, an unreadable
        or inconsistent one is named in a :class:`~fastanneal._checkpoint.CheckpointWarning`
        and ignored. After the fit it holds the finished state (a rerun only recomputes the
        labels). With ``n_init > 1`` each run has its own file (``anneal.run0.npz``, ...).
    reallocate : bool, default=True
        After the polish, phase-transition re-allocation moves (``docs/theory.md``
        section 6.7): cut a cell that holds more than one cluster along its top principal
        direction and merge a redundant codevector into its neighbour, wherever the exact
        gain of the cut exceeds the exact cost of the merge (many disjoint moves at once);
        keep the moves when ``J`` decreases. Needs ``polish=True``. ``n_reallocations_``
        counts the moves.
    stop_when_hard : bool, default=True
        End the schedule at the first temperature whose last pass found every row's
        responsibilities exactly one-hot (every other logit below the drop threshold) with
        the centers at a fixed point: from there each colder temperature would be one Lloyd
        pass that changes nothing, so the polish takes over (``docs/theory.md`` section
        6.8). ``hardened_step_`` says where. The schedule also ends once it has settled:
        a step that changed ``J`` by at most 3e-5 (relative) with the rows nearly decided
        (mean entropy <= 0.05 nats) and every codevector resolving a cell of its own; the
        colder steps would only harden the last boundary rows (section 6.9,
        ``settled_step_``; measured by ``benchmarks/study_settle.py``). ``False`` runs every
        temperature. Only the soft-Lloyd solver without mass priors, with ``polish=True``;
        never where the schedule's next temperature is hotter (a custom schedule that cools
        and later re-heats should pass ``False``: the early end assumes it keeps cooling).
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
    probability_temperature_ : float
        The temperature of :meth:`predict_proba`: 0.25 times the weighted median margin
        ``d_(2) - d_(1)`` of the fitted rows (in memory: every row, from the final
        labelling pass, or a million drawn from them above that; Dask, out of core,
        CUDA: a sample of up to 20,000).
    temperature_start_ : float
    critical_temperature_ : float, ``T_c = 2 lambda_max(C)``
    cluster_weights_ : (K,) array, mass of each cluster (sums to 1)
    n_iter_ : int, moment passes in total (annealing + polish)
    n_clusters_ : int, the K of the result (the chosen one with ``n_clusters="auto"``)
    k_suggestion_ : KSuggestion, only with ``n_clusters="auto"``
    n_reallocations_ : int, re-allocation moves kept after the polish
    hardened_step_ : int or None
        The annealing step after which the schedule was hard (``stop_when_hard``): its
        responsibilities one-hot, its centers a Lloyd fixed point; the colder temperatures
        were left to the polish. None: every temperature of the schedule ran (or the
        solver, a mass prior or ``stop_when_hard=False`` does not stop early). On
        well-separated data this is often step 0: the annealing had nothing to do, and the
        fit is the seeds, Lloyd and the re-allocation moves.
    settled_step_ : int or None
        The annealing step after which the schedule had settled (``stop_when_hard``,
        ``docs/theory.md`` section 6.9): that step changed ``J`` by at most 3e-5 relative,
        with the rows nearly decided; the colder temperatures were left to the polish.
        None where the schedule hardened first, ran every temperature, or cannot stop early.
    checkpoint_info_ : dict, only with ``checkpoint``: path, finished, resumed_from,
        temperature (None once the annealing is over) and phase ("anneal", "critical",
        "polish", "reallocate", "done") of the state the fit continued from; replaced: the
        file held the state of another fit (other data or parameters), now overwritten
    trace_ : Trace (``.as_dict()``, ``.to_arrow()``)
    schedule_ : Schedule or None
        The schedule that ran (of the kept run with ``n_init``), with its state (e.g.
        ``AdaptiveSchedule.history_``): a copy, the ``schedule`` parameter is left as it
        was; None for ``n_clusters="auto"``.
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
                 learning_offset=1.0, checkpoint=None, reallocate=True, k_max=None,
                 k_min=2, stop_when_hard=True):
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
        self.checkpoint = checkpoint
        self.reallocate = reallocate
        self.k_max = k_max
        self.k_min = k_min
        self.stop_when_hard = stop_when_hard

    # ------------------------------------------------------------------ validation
    def _check_params(self, n_samples):
        rc = self._check_common(n_samples)
        # (parameters a named schedule does not read: said, not silently ignored)
        if isinstance(self.schedule, str) and self.schedule == "critical" and \
                self.n_steps != 20:
            warnings.warn(f"n_steps={self.n_steps!r} is not used by schedule='critical' (it "
                          "cools until its clusters have split)", UserWarning, stacklevel=4)
        if isinstance(self.schedule, str) and self.schedule == "adaptive" and \
                self.temperature_end_ratio != 0.05:
            warnings.warn(f"temperature_end_ratio={self.temperature_end_ratio!r} is not used "
                          "by schedule='adaptive' (it ends by its entropy rule)", UserWarning,
                          stacklevel=4)
        for name in ("n_init", "max_iter", "max_polish_iter"):
            _positive_int(self, name)
        if not (isinstance(self.tol, numbers.Real) and self.tol >= 0):
            raise ValueError(f"tol must be a non-negative number; got {self.tol!r}")
        if self.diagnostics not in ("summary", "full"):
            raise ValueError(f"diagnostics must be 'summary' or 'full'; got {self.diagnostics!r}")
        bs = self.batch_size
        if bs is not None and (not isinstance(bs, numbers.Integral) or isinstance(bs, bool)
                               or bs < 1):
            raise ValueError(f"batch_size must be None or a positive integer; got {bs!r}")
        if self.solver not in ("lloyd", "gradient"):
            raise ValueError(f"solver must be 'lloyd' or 'gradient'; got {self.solver!r}")
        if self.solver == "gradient":
            if self.schedule == "critical" or isinstance(self.schedule, CriticalSchedule):
                raise ValueError("solver='gradient' does not run the critical schedule "
                                 "(its cluster splitting is soft Lloyd); use another schedule")
            if self.mass_constrained is True:
                raise ValueError("solver='gradient' has no mass-constrained prior; use "
                                 "mass_constrained=False or 'auto'")
            gs = self.gradient_steps
            if not isinstance(gs, numbers.Integral) or isinstance(gs, bool) or gs < 1:
                raise ValueError(f"gradient_steps must be a positive integer; got {gs!r}")
            # the solver's numbers, named by their parameter before any pass over the data
            for name, lo, none_ok in (("learning_rate", "> 0", False),
                                      ("separation_weight", None, False),
                                      ("phi_margin", "> 0", True), ("phi_eps", "> 0", True),
                                      ("anchor_weight", None, False)):
                v = getattr(self, name)
                if v is None and none_ok:
                    continue
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or \
                        not math.isfinite(float(v)) or (lo and not float(v) > 0):
                    raise ValueError(f"{name} must be a finite number{' ' + lo if lo else ''}"
                                     f"; got {v!r}")
        if self.backend not in (None, "cpu", "cuda", "dask"):
            raise ValueError(f"backend must be None, 'cpu', 'cuda' or 'dask'; got {self.backend!r}")
        return rc

    # ------------------------------------------------------------------ fit
    def _make_source(self, X, sample_weight):
        """``(source, in_memory)`` for the backend: Dask for Dask collections / Parquet
        paths (or ``backend="dask"``), CUDA for ``backend="cuda"``, else in memory."""
        backend = self.backend
        is_dask = hasattr(X, "__dask_graph__")
        paths = isinstance(X, (str, os.PathLike)) or (
            isinstance(X, (list, tuple)) and len(X) > 0
            and all(isinstance(p, os.PathLike) or (isinstance(p, str) and (
                p.endswith(".parquet") or os.path.exists(p))) for p in X))
        lazy = paths or type(X).__name__ == "EmbeddingArrays"
        if lazy and backend not in (None, "dask"):
            what = "a path" if paths else "an EmbeddingArrays"
            raise TypeError(f"X is {what}, which only the Dask backend reads; got "
                            f"backend={backend!r} "
                            "(use backend='dask' or None, or load the rows into an array)")
        if backend == "dask" or (backend is None and (is_dask or lazy)):
            from .dask import make_dask_source  # noqa: WPS433 (optional heavy import)
            return make_dask_source(self, X, sample_weight)[0], False
        X = self._validate_X(X, reset=True)
        w = self._validate_weights(sample_weight, X.shape[0], dtype=X.dtype)
        X, origin = self._centered(X, w)
        if backend == "cuda":
            from .cuda import CudaSource
            source = CudaSource(X, w, metric_code(self.metric))
        else:
            source = InMemorySource(X, w, metric_code(self.metric))
        source.origin = origin
        return source, True

    @pinned_blas
    def fit(self, X, y=None, sample_weight=None):
        """Anneal from hot to hard; returns self.

        ``X``: array (n, D); a Dask array / DataFrame, Parquet path or
        :class:`fastanneal.dask.EmbeddingArrays` with the Dask backend. With ``batch_size``
        set, mini-batch annealing (:class:`MiniBatchAnnealedKMeans`).
        """
        self._forget_fit()
        with E.verbose_logging(self.verbose):
            if self.batch_size is not None:
                return self._fit_minibatch(X, sample_weight)
            t0 = time.perf_counter()
            source, in_memory = self._make_source(X, sample_weight)
            try:
                return self.fit_source(source, in_memory=in_memory, _t0=t0)
            finally:
                source.close()

    def _fit_minibatch(self, X, sample_weight):
        self._check_params(None)
        if isinstance(self.n_clusters, str):
            raise ValueError(f"n_clusters={self.n_clusters!r} does not combine with batch_size "
                             "(mini-batch annealing fits a given K): choose K with "
                             "fastanneal.suggest_k on a sample of the rows, then fit with "
                             "that K")
        if self.backend == "cuda":
            raise ValueError("backend='cuda' runs full-batch fits; mini-batch annealing "
                             "(batch_size=) runs on the CPU or on Dask: set batch_size=None "
                             "for the GPU, or leave backend unset")
        if self.solver != "lloyd" or int(self.n_init) != 1:
            raise ValueError(f"batch_size (mini-batch annealing) runs one stochastic-EM fit: "
                             f"solver='lloyd' and n_init=1 only; got solver={self.solver!r}, "
                             f"n_init={self.n_init!r}")
        mc = self.mass_constrained
        mb = MiniBatchAnnealedKMeans(
            self.n_clusters, metric=self.metric, responsibilities=self.responsibilities,
            schedule=self.schedule, n_steps=self.n_steps, init=self.init,
            temperature_start=self.temperature_start,
            temperature_end_ratio=self.temperature_end_ratio,
            auto_start_fraction=self.auto_start_fraction,
            mass_constrained=False if mc == "auto" else bool(mc), batch_size=self.batch_size,
            learning_decay=self.learning_decay, learning_offset=self.learning_offset,
            polish_passes=1 if self.polish else 0, scheduler=self.scheduler,
            random_state=self.random_state, tol=self.tol, verbose=self.verbose,
            checkpoint=self.checkpoint, reallocate=self.reallocate, progress=self.progress)
        mb.fit(X, sample_weight=sample_weight)
        for name in ("cluster_centers_", "cluster_weights_", "inertia_", "free_energy_",
                     "soft_distortion_", "hardening_gap_", "temperature_",
                     "temperature_start_", "critical_temperature_", "n_steps_", "n_iter_",
                     "n_relocations_", "trace_", "n_features_in_", "_mass_constrained",
                     "labels_", "probability_temperature_", "_origin", "_scale",
                     "_rows_seen", "feature_names_in_", "schedule_", "hardened_step_",
                     "settled_step_"):
            if hasattr(mb, name):
                setattr(self, name, getattr(mb, name))
        self.n_clusters_ = int(self.n_clusters)
        self.n_reallocations_ = 0           # (the moves refine the seeds on the sample only)
        if hasattr(mb, "checkpoint_info_"):
            self.checkpoint_info_ = mb.checkpoint_info_
        self.hardened_step_ = None          # the stochastic rule runs every temperature
        self.settled_step_ = None
        return self

    @pinned_blas
    def fit_source(self, source, *, in_memory=False, _t0=None):
        """Fit on a moment source (:class:`~fastanneal._protocol.MomentSource`): any backend,
        including your own. ``in_memory``: the rows are cheap to read (k-means++ on all of
        them up to 200,000 rows; labels gathered)."""
        if _t0 is None:                 # (called directly; fit() has forgotten already)
            self._forget_fit()
        t0 = time.perf_counter() if _t0 is None else _t0
        check_source(source)
        if not type(source).__module__.startswith("fastanneal"):
            # a user-written source: its results are checked as they come back
            from ._protocol import CheckedSource
            source = CheckedSource(source)
        rc = self._check_params(source.n_rows)
        sm = getattr(source, "metric", None)
        if isinstance(sm, (bool, np.bool_)) or sm not in (0, 1):
            raise ValueError(f"the source's metric must be 0 (Euclidean) or 1 (cosine: unit "
                             f"rows); got {sm!r}")
        if int(sm) != metric_code(self.metric):
            raise ValueError(f"the source's metric ({'cosine' if sm == 1 else 'euclidean'}) "
                             f"is not the estimator's metric={self.metric!r}: the fit would "
                             "measure the rows with one and project the centers with the "
                             "other")
        # rows measured from an origin (the in-memory route centers rows far from it)
        origin = getattr(source, "origin", None)
        auto = isinstance(self.n_clusters, str)
        K = int(self.k_max) if auto else int(self.n_clusters)
        rng = self._rng()
        W = float(source.total_weight)
        if not (math.isfinite(W) and W > 0):
            raise ValueError(f"the source's weights sum to {W!r}: weights must be finite and "
                             ">= 0, with a positive sum (fit_source does not validate a "
                             "source's rows and weights: fit() does)")
        stats = data_stats(source)      # (a mean or spread that is not finite: named there)
        if origin is None and _far(source, stats):
            if hasattr(source, "set_origin"):
                # a stream (open_parquet, ...): measured from the mean from now on
                source.set_origin(stats.mean)
                origin = np.asarray(stats.mean, dtype=np.float64)
                stats = data_stats(source)
            else:
                warnings.warn(
                    "the rows lie far from the origin compared with their spread: their "
                    "squared distances lose precision to rounding (docs/theory.md, \"Rows far "
                    "from the origin\"); subtract the rows' mean first (fit() does this for "
                    "arrays)", AnnealingWarning, stacklevel=2)
        # (identical rows first: "k_max=2 is larger than the number of distinct points (1)"
        # asked for a smaller k_max, which does not exist)
        why = rows_coincide(source, stats) if K > 1 else None
        if why:
            raise ValueError(why)
        if K > 1:
            warn_narrow_cone(source, stats, stacklevel=4)
        check_n_clusters(source, K, rng, name="k_max" if auto else "n_clusters")
        self.n_features_in_ = source.n_features
        self.critical_temperature_ = critical_temperature(source, stats.mean, rng)
        if auto:
            result, trace, T0 = self._fit_auto(source, rc, rng, stats, t0)
            K = int(self.n_clusters_)
            self.schedule_ = None             # (the phase-transition path: no schedule)
        else:
            best = None
            n_init = int(self.n_init)
            if n_init > 1 and hasattr(self.init, "__array__"):
                # (as scikit-learn's KMeans: every run would start from the same centers)
                warnings.warn(f"Explicit initial center position passed: performing only one "
                              f"init in {type(self).__name__} instead of n_init={n_init}",
                              RuntimeWarning, stacklevel=2)
                n_init = 1
            for run in range(n_init):
                res = self._fit_once(source, in_memory, K, rc, rng, stats, t0,
                                     run if n_init > 1 else None) + (self._run_schedule,)
                if best is None or res[0].hard_objective_final < best[0].hard_objective_final:
                    best = res
            result, trace, T0, self.schedule_ = best
            del self._run_schedule
            self.n_clusters_ = K
        C = self._set_centers(result.centers, origin, source.dtype)
        self._scale, self._rows_seen = float(stats.scale), int(source.n_rows)
        reset = getattr(source, "reset_bounds", None)
        if reset is not None:
            reset()         # the final statistics by the full path: the same numbers whether
            #                 the polish ran here or a finished checkpoint was reused
        # the final hard E-step: labels_ == predict(X), and J from each row's distance to
        # the nearer of its two nearest centers summed in float64 (= -score(X); the
        # moments pass's GEMM-form distances keep a float32 residue on every row, which a
        # heavy weight multiplies), with the hard weight of each cluster
        margin = None
        if in_memory and isinstance(source, InMemorySource):
            labels, inertia, counts, margin = nearest_objective_counts(
                source.X, source.w, C, source.metric, return_margin=True)
        else:
            labels = source.labels(C) if in_memory or source.n_rows <= 50_000_000 else None
            if hasattr(source, "objective"):    # Dask, streams, CUDA: one pass for both
                inertia, counts = source.objective(C)
            else:                               # a user's source: its moments pass
                mh = source.moments(C, 1.0, 2, None, hard_sums=False)
                inertia, counts = float(mh.hard_distortion), mh.hard_counts
        empty = int(np.sum(~(counts > 0)))
        if K > 1 and empty and self.polish:
            # (after the polish, whose relocations fill every cluster they can; without it
            # a soft fit's cluster may hold mass but no nearest row). A warning, not an
            # error: heavy-tailed weights can also defeat the relocations (they split the
            # heaviest cluster, which may be one heavy row)
            warnings.warn(
                f"n_clusters={K}: {empty} fitted cluster(s) hold no row of weight > 0 -- the "
                f"data may hold fewer than {K} points that can be told apart at its "
                "floating-point precision (rows that differ only in their last bits, e.g. "
                "positive multiples of one vector under the cosine metric), or a few heavy "
                "rows kept the relocations from filling them; a smaller n_clusters avoids "
                "it", AnnealingWarning, stacklevel=3)
        self.labels_ = labels
        self.inertia_ = float(inertia)
        self.cluster_weights_ = counts / counts.sum()
        self.temperature_ = float(result.temperature)
        self.temperature_start_ = float(T0)
        self.free_energy_ = float(result.free_energy)
        self.soft_distortion_ = float(result.soft_objective)
        self.hardening_gap_ = float(result.soft_objective - result.hard_objective)
        self.n_iter_ = int(result.n_iter)
        self.n_steps_ = int(result.n_steps)
        self.n_relocations_ = int(result.relocations)
        self.n_reallocations_ = int(result.reallocations)
        self.hardened_step_ = result.hardened_step
        self.settled_step_ = result.settled_step
        self.trace_ = trace
        self._set_probability_temperature(source, rng, C, margin)
        return self

    def _fit_auto(self, source, rc, rng, stats, t0):
        """``n_clusters="auto"``: follow the phase transitions up to ``k_max`` effective
        clusters, rank K by plateau width (:mod:`fastanneal.choose_k`), then continue the
        annealing from the path's coldest state with the chosen K (no refit from scratch):
        the same critical phase down to ``T_end``, the polish and the re-allocation moves."""
        from .choose_k import _merged, path_on_source
        if self.solver == "gradient":
            raise ValueError("n_clusters='auto' runs the Lloyd solver; use solver='lloyd'")
        if self.checkpoint is not None:
            raise ValueError("n_clusters='auto' does not write checkpoints yet; fit the "
                             "suggested K (k_suggestion_.best) with checkpoint=")
        if rc != 0:
            raise ValueError("n_clusters='auto' uses softmax responsibilities")
        sug = path_on_source(source, int(self.k_max), int(self.k_min), rng,
                             checked=(stats, self.critical_temperature_))
        K = int(sug.best)
        self.k_suggestion_ = sug
        self.n_clusters_ = K
        if not sug.supported:
            warnings.warn(f"n_clusters='auto': no K in {int(self.k_min)}..{int(self.k_max)} is "
                          f"clearly supported by the data (no wide plateau on the annealing "
                          f"path); fitting the suggested K = {K} anyway. See "
                          "k_suggestion_.table()", AnnealingWarning, stacklevel=4)
        snap = sug.snapshots[K]
        C, p = _merged(snap, source.metric)
        T0 = sug.temperature_start
        T_end = _end_temperature(self.temperature_end_ratio, T0)
        self._mass_constrained = True
        cfg = self._engine_config(K, 0, True)
        trace = Trace()
        trace._rows = [dict(r) for r in sug.trace._rows if r["step"] <= snap["step"]]
        # n_iter_ counts the path's passes too (the continuation alone understated a fit's
        # work about 12x: "18 temperature steps, 5 passes")
        st = E.AnnealState(centers=C, temperature=float(snap["T"]), T_start=T0, T_end=T_end,
                           scale=stats.scale, phase="critical",
                           rule_state={"p": p / p.sum()}, step=int(snap["step"]) + 1,
                           n_iter=int(sug.n_passes))
        st.phase_step0 = st.step
        crit = E._CriticalPhase(0.85, 200)
        result = E.run(source, st, None, cfg, rng, trace, t0, critical=crit)
        self._check_run(result, trace, K)
        return result, trace, T0

    def _fit_once(self, source, in_memory, K, rc, rng, stats, t0, run):
        # a copy of a schedule object: fitting does not write into the parameter (the
        # fitted one, with its state, is schedule_)
        schedule = _copied(make_schedule(self.schedule, int(self.n_steps)))
        self._run_schedule = schedule
        ts = self.temperature_start
        T_c = self.critical_temperature_
        transitions = isinstance(schedule, CriticalSchedule)
        from_mean = transitions or ts == "critical"
        mc = self.mass_constrained
        mc = from_mean if isinstance(mc, str) and mc == "auto" else bool(mc)
        if self.solver == "gradient":
            mc = False                      # value_and_grad has no log-prior
        self._mass_constrained = mc
        cfg = self._engine_config(K, rc, mc)
        ckpt = self._make_checkpoint(source, K, run)
        st = ckpt.load() if ckpt is not None else None
        trace = Trace()
        if ckpt is not None:
            self.checkpoint_info_ = {"path": str(ckpt.path), "finished": False,
                                     "resumed_from": None, "temperature": None,
                                     "phase": None, "replaced": ckpt.replaced}
        if st is not None:
            trace._rows = list(st.trace_rows)
            rng.bit_generator.state = st.rng_state
            T0 = float(st.extra["T0"])
            self.checkpoint_info_.update(finished=st.phase == "done", resumed_from=st.step,
                                         temperature=st.temperature, phase=st.phase)
        else:
            if from_mean:
                C = np.repeat(stats.mean_c[None, :], K, axis=0)
            else:
                init = _init_in_frame(self.init, getattr(source, "origin", None))
                C = initial_centers(init, source, K, rng, stats.mean_c,
                                    200_000 if in_memory else 0)
            T0 = start_temperature(ts, source, C, rng, K, T_c, stats.scale,
                                   self.auto_start_fraction, critical=from_mean, stacklevel=5)
            T_end = _end_temperature(self.temperature_end_ratio, T0)
            if transitions:
                st = E.critical_state(C[0], T0, T_end, stats.scale)
            else:
                st = E.AnnealState(centers=C, temperature=T0, T_start=T0, T_end=T_end,
                                   scale=stats.scale, log_masses=E._initial_log_masses(cfg))
        rule = crit = None
        if self.solver == "gradient":
            from ._gradient_solver import AdamRule
            rule = AdamRule(cfg, stats.scale, source.n_features,
                            learning_rate=self.learning_rate, betas=self.adam_betas,
                            steps_per_temperature=int(self.gradient_steps),
                            separation_weight=self.separation_weight, phi=self.phi,
                            margin=self.phi_margin, eps=self.phi_eps,
                            anchor_weight=self.anchor_weight)
        if transitions:
            crit = E._CriticalPhase(schedule.cooling, schedule.max_steps)
        hook = None
        if ckpt is not None:
            ckpt.trace = trace
            ckpt.extra = {"T0": T0}
            hook = ckpt.save
        bar = _attach_progress(cfg, schedule, self.progress)
        try:
            result = E.run(source, st, schedule, cfg, rng, trace, t0, rule=rule,
                           critical=crit, hook=hook)
            early = result.hardened_step if result.hardened_step is not None \
                else result.settled_step
            if bar is not None and early is not None and bar.total:
                # the colder steps were left to the polish: the bar ends full, saying so
                bar.set_postfix_str(f"{'hard' if result.hardened_step is not None else 'settled'}"
                                    f" from step {early}")
                bar.update(max(bar.total - bar.n, 0))
        finally:
            if bar is not None:
                bar.close()
        if ckpt is not None:
            ckpt.save(st)
        self._check_run(result, trace, K)
        return result, trace, T0

    def _engine_config(self, K, rc, mass_constrained):
        return EngineConfig(n_clusters=K, resp=rc, mass_constrained=mass_constrained,
                            max_iter=int(self.max_iter), tol=float(self.tol),
                            polish=bool(self.polish),
                            max_polish_iter=int(self.max_polish_iter),
                            diagnostics=self.diagnostics, verbose=int(self.verbose),
                            reallocate=bool(self.reallocate) and bool(self.polish),
                            stop_when_hard=bool(self.stop_when_hard) and bool(self.polish))

    def _check_run(self, result, trace, K):
        """What every fit reports after the engine ran: polish convergence and relocations
        (warnings), no coincident centers, the final hard objective."""
        if not result.converged:
            warnings.warn(f"Lloyd polish did not converge in {self.max_polish_iter} iterations",
                          AnnealingWarning, stacklevel=4)
        if result.relocations:
            warnings.warn(f"{result.relocations} empty cluster(s) were relocated during the fit",
                          AnnealingWarning, stacklevel=4)
        dmin, _ = min_center_distance(result.centers)
        if K > 1 and not dmin > 0:
            raise ValueError(
                f"n_clusters={K}: two fitted centers coincide -- the data holds fewer than {K} "
                "points that can be told apart at its floating-point precision (rows that "
                "differ only in their last bits, e.g. positive multiples of one vector under "
                "the cosine metric); choose a smaller n_clusters")
        result.hard_objective_final = float(trace["hard_distortion"][-1])


def _copied(schedule):
    """A shallow copy of a schedule object (scikit-learn: fitting does not change
    parameters; one object shared by estimators fitted in threads kept one state): what
    ``start`` sets lands on the copy, while a lock, a generator or a caller's list it holds
    stay shared (a deep copy broke schedules holding a lock or a generator). A name, or an
    object that cannot be copied, as it is."""
    if isinstance(schedule, str):
        return schedule
    try:
        return copy.copy(schedule)
    except Exception:                   # (an object that refuses copying runs itself)
        return schedule


def _end_temperature(ratio, T_start):
    """``T_end = ratio * T_start``, a ``ValueError`` naming the ratio where it is not a normal
    float64 (data at a tiny scale with a tiny ratio: the schedules would reach T = 0)."""
    T_start = float(T_start)
    T_end = float(ratio) * T_start
    tiny = float(np.finfo(np.float64).tiny)
    if T_start > 0 and not T_end >= tiny:       # (T_start = 0: rows without any spread)
        raise ValueError(f"temperature_end_ratio={ratio!r} times the start temperature "
                         f"{T_start:.3g} is {T_end:.3g}, below the smallest normal float64 "
                         f"({tiny:.3g}); use a ratio of at least {tiny / T_start:.3g} (or "
                         "rescale the data)")
    return T_end


def _schedule_temperature(schedule, t, T_start, T_end, n_steps):
    """Temperature of update ``t`` of ``partial_fit`` (held at ``T_end`` after ``n_steps``)."""
    if schedule == "constant" or n_steps <= 1:
        return float(T_start)
    j = min(t, n_steps - 1) / (n_steps - 1)
    if schedule == "linear":
        return float(T_start * (1.0 - j) + T_end * j)
    return float(T_start * (T_end / T_start) ** j)


def _far(source, stats):
    """Whether a source's Euclidean rows (mean, scale from :func:`data_stats`) lie far from
    the origin (``docs/theory.md``, "Rows far from the origin"); a scale lost to rounding
    counts as far."""
    if getattr(source, "metric", 0) != 0:
        return False
    mean = np.asarray(stats.mean, dtype=np.float64)
    return far_from_origin(mean, float(stats.scale) + float(mean @ mean), source.dtype)


def _init_in_frame(init, origin):
    """An ``init`` array (the data's coordinates) measured from the fit's ``origin``; strings
    and arrays of the wrong shape pass unchanged (the seeding names the problem)."""
    if origin is None or isinstance(init, str):
        return init
    A = np.asarray(init)
    if A.ndim != 2 or A.shape[1] != origin.shape[0] or not np.issubdtype(A.dtype, np.number):
        return init
    return A.astype(np.float64) - origin


def _check_distinct(full, Xs, ws, K, metric):
    """``K`` must not exceed the distinct rows of the data (exact). The seeding sample
    answers in the usual case; only when it holds fewer than ``K`` distinct rows does the
    whole data (one capped pass of row hashes) decide. Own generator for the hash
    multipliers: the fit's random stream is not touched."""
    if K < 2:
        return
    hrng = np.random.default_rng(0x5EED)
    if InMemorySource(Xs, ws, metric).n_distinct_rows(hrng, K) >= K:
        return
    check_n_clusters(full, K, hrng)


#: With re-allocation, k-means++ seeds a mini-batch fit from this many rows per cluster
#: of the seeding sample (k-means++ is one pass over its rows per center; the moves on the
#: whole sample then repair what a smaller draw missed).
KPP_ROWS_PER_CLUSTER = 20
#: Lloyd passes (at most) of each Lloyd run that refines those seeds on the sample: the
#: stochastic EM anneals from them, so they need not be converged.
SEED_LLOYD_PASSES = 20


def _check_labels_path(labels_path, X, name="labels_path"):
    """``labels_path`` must not be the input, hold it or lie inside it: with
    ``overwrite=True`` the labels folder replaced the input file (deleted, then the final
    pass failed reading it), and label files inside an input folder became part of its
    dataset."""
    from ._parquet import ParquetStream
    if isinstance(X, ParquetStream):
        inputs = [getattr(X.data, "path", None)]
    elif isinstance(X, (str, os.PathLike)):
        inputs = [X]
    elif isinstance(X, (list, tuple)) and X and all(isinstance(p, (str, os.PathLike))
                                                     for p in X):
        inputs = list(X)
    elif hasattr(X, "__dask_graph__") or type(X).__name__ == "EmbeddingArrays":
        # a Dask array read by read_parquet_embeddings (or made from one): its files; a
        # collection whose files cannot be told (a rebuilt graph) is kept off every file
        # read_parquet_embeddings opened in this process
        from .dask._inputs import every_parquet_input, parquet_inputs_of
        inputs = parquet_inputs_of(X) or every_parquet_input()
    else:
        return
    from ._io import path_inside, same_file
    for p in inputs:
        if p is None:
            continue
        if (same_file(labels_path, p) or path_inside(p, labels_path)
                or path_inside(labels_path, p)):
            raise ValueError(f"{name}={os.fspath(labels_path)!r} is the input {p!r}, "
                             "holds it or lies inside it: give another folder")


def _seeding_weights(ws):
    """The weights a mini-batch fit seeds with: 1 for every row of the sample that carries
    weight. The seeds come from where the rows are, not from their weights: a uniform
    sample of heavy-tailed weights (query counts) is ruled by the few heavy rows it
    happened to draw, and seeds fitted to it serve those rows instead of the clusters of
    the data. The weighted objective is what the stochastic EM then anneals, over all
    rows."""
    return (np.asarray(ws) > 0).astype(np.float64)


def _seed_from_sample(est, Xs, ws, K, metric, rng, origin=None, refine_init=True):
    """Seeds, ``T_start``, ``T_end``, ``T_c`` and the scale of a mini-batch fit from an
    in-memory sample (validated rows; unit rows for cosine; measured from ``origin``).
    ``refine_init=False``: an ``init`` array is used as given (``partial_fit``'s first
    batch is no sample of the data to refine it on)."""
    src = InMemorySource(Xs, ws, metric)
    if not src.total_weight > 0:
        raise ValueError("the seeding sample carries no weight")
    stats = data_stats(src)
    if K > 1 and rows_coincide(src, stats):
        live = int((np.asarray(ws) > 0).sum())
        if not refine_init:         # partial_fit: its first batch, used as given
            raise ValueError("all rows of the first partial_fit batch that carry weight are "
                             f"identical ({live} of its {len(ws):,} rows weigh > 0): more "
                             "than one cluster is undefined on it (start with a batch that "
                             "holds the clusters' variety)")
        raise ValueError("all rows of the seeding sample that carry weight are identical "
                         f"({live} of its {len(ws):,} rows weigh > 0): more than one cluster "
                         "is undefined on it (a larger init_size samples more of the "
                         "weighted rows)")
    if K > 1:
        warn_narrow_cone(src, stats, stacklevel=5)
    T_c = critical_temperature(src, stats.mean, rng)
    # seeds given as an array are refined like k-means++ ones (as AnnealedKMeans re-allocates
    # from any start): a poor init ended 70 % higher than the same init's full fit
    realloc = (getattr(est, "reallocate", False) and K > 1
               and (refine_init or isinstance(est.init, str)))
    kpp_small = realloc and isinstance(est.init, str)
    C = initial_centers(_init_in_frame(est.init, origin), src, K, rng, stats.mean_c,
                        sample_rows=Xs.shape[0],
                        kpp_rows=KPP_ROWS_PER_CLUSTER * K if kpp_small else None)
    C = E._project(C, metric)
    if realloc:
        C = _reallocated_seeds(src, C, rng, stats.scale)
    T0 = start_temperature(est.temperature_start, src, C, rng, K, T_c, stats.scale,
                           est.auto_start_fraction, stacklevel=5)
    return (C, float(T0), _end_temperature(est.temperature_end_ratio, T0), float(T_c),
            stats.scale)


def _reallocated_seeds(src, C, rng, scale):
    """Seeds of a mini-batch fit refined on the in-memory seeding sample: Lloyd and the
    engine's phase-transition re-allocation moves (``docs/theory.md`` section 6.7), so
    that the stochastic EM starts with one codevector per cluster of the sample."""
    cfg = EngineConfig(n_clusters=C.shape[0], mass_constrained=False, reallocate=True,
                       max_polish_iter=SEED_LLOYD_PASSES)
    st = E.AnnealState(centers=C, temperature=None, T_start=0.0, T_end=0.0, scale=scale,
                       phase="polish")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AnnealingWarning)
        return E.run(src, st, None, cfg, rng, Trace()).centers


class _PartialFit:
    """State of ``partial_fit``: seeds from the first batch, one stochastic-EM update per
    call (the running moments of :class:`~fastanneal._minibatch.RunningMoments`)."""

    def __init__(self, est, X, w):
        K = est.n_clusters
        if isinstance(K, str) and K == "auto":
            raise ValueError("partial_fit needs a given n_clusters: 'auto' chooses K from "
                             "the phase transitions of full passes (fit); choose K with "
                             "fastanneal.suggest_k on a sample, then partial_fit with it")
        if not isinstance(K, numbers.Integral) or isinstance(K, bool) or K < 1:
            raise ValueError(f"n_clusters must be a positive integer; got {K!r}")
        if X.shape[0] < K:
            raise ValueError(f"the first partial_fit batch has {X.shape[0]} rows; at least "
                             f"n_clusters={K} are needed to seed the centers")
        sched = est.schedule
        if not (isinstance(sched, str) and sched in ("geometric", "linear", "constant")):
            raise ValueError("partial_fit supports the schedules 'geometric', 'linear', "
                             f"'constant'; got {sched!r}")
        est._check_common()
        check_learning(est.learning_decay, est.learning_offset)
        self.metric = metric_code(est.metric)
        self.rng = est._rng()
        # the first batch's mean is the origin of every batch (rows far from it: centered)
        Xc, self.origin = est._centered(X, w)
        self.C, self.T_start, self.T_end, self.T_c, self.scale = _seed_from_sample(
            est, Xc, w, int(K), self.metric, self.rng, self.origin, refine_init=False)
        mc = est.mass_constrained
        self._setup(est, sched, False if mc == "auto" else bool(mc), X.dtype)

    def _setup(self, est, schedule, mass_constrained, dtype):
        rc = est._check_common()
        kd, t0 = check_learning(est.learning_decay, est.learning_offset)
        self.mass_constrained = mass_constrained
        self.running = RunningMoments(self.metric, self.mass_constrained, rc, kd, t0,
                                      self.scale)
        self.schedule, self.n_steps, self.resp = schedule, int(est.n_steps), rc
        self.dtype = dtype
        self.trace = Trace()
        self.t0 = time.perf_counter()
        self.relocations = 0
        self.temperature = math.nan

    @classmethod
    def from_fitted(cls, est, X):
        """The state that continues a fitted estimator: its centers (in its frame), its
        final temperature held constant, the running moments its cluster weights, counted
        as the rows the fit saw in batches of ``X``'s rows (the first update's step size is
        that of the update after them, not 1)."""
        self = cls.__new__(cls)
        self.metric = metric_code(est.metric)
        self.rng = est._rng()
        C, self.origin = est._frame_centers()
        self.C = np.asarray(C, dtype=np.float64)
        T = float(est.temperature_)
        self.T_start = self.T_end = T
        self.T_c = float(getattr(est, "critical_temperature_", math.nan))
        self.scale = float(getattr(est, "_scale", 0.0)) or float(
            np.mean(np.sum((self.C - self.C.mean(axis=0)) ** 2, axis=1))) or 1.0
        # (the fitted model's dtype: a float32 batch after a float64 fit is upcast, the
        # model is not rounded to float32 -- as partial_fit(X64) then partial_fit(X32))
        self._setup(est, "constant", bool(getattr(est, "_mass_constrained", False)),
                    est.cluster_centers_.dtype)
        p = np.asarray(est.cluster_weights_, dtype=np.float64)
        rows = int(getattr(est, "_rows_seen", 0) or X.shape[0])
        t = max(1, int(round(rows / max(X.shape[0], 1))))
        self.running.load_state_dict({
            "t": t, "rows_seen": 0,
            "weight_seen": 0.0, "N": p.copy(), "S": p[:, None] * self.C})
        # the counters go on from the fit's (they were set to t, which is the step size's
        # count, not the fit's steps: 22 passes read 16 after one update)
        self.counts0 = (t, int(getattr(est, "n_steps_", 0)), int(getattr(est, "n_iter_", 0)))
        return self

    def update(self, X, w):
        from ._moments import compute_moments
        if X.shape[1] != self.C.shape[1]:
            raise ValueError(f"X has {X.shape[1]} features; the fit has {self.C.shape[1]}")
        if self.origin is not None:
            X = shifted_rows(X, self.origin)
        K = self.C.shape[0]
        T = _schedule_temperature(self.schedule, self.running.t, self.T_start, self.T_end,
                                  self.n_steps)
        logp = self.running.log_prior(K)
        m = compute_moments(X, w, self.C, T, self.metric, self.resp, logp, hard_sums=False)
        self.C, rel = self.running.update(m, self.C, self.rng)
        self.relocations += rel
        # duplicates (an init with repeated rows, a collapse at a high temperature) never
        # separate by themselves: nudged apart as in the engine's loop, their running sums
        # moved with them
        self.C, dup, dmin, _ = E.separate_coincident(self.C, self.running.delta, self.rng,
                                                     self.metric)
        if len(dup):
            self.running.S[dup] = self.C[dup] * self.running.N[dup, None]
        self.temperature = T
        E._record(self.trace, self.running.t - 1, self.running.t, T, m, self.C,
                  self.running.last_shift, rel, len(dup), K, self.t0, dmin, logp=logp)

    def apply_to(self, est):
        est._set_centers(self.C, self.origin, self.dtype)
        est._scale = self.scale
        est._rows_seen = int(self.running.rows_seen)
        N = self.running.N if self.running.N is not None else np.ones(self.C.shape[0])
        est.cluster_weights_ = N / N.sum()
        est.temperature_ = float(self.temperature)
        est.temperature_start_ = float(self.T_start)
        est.critical_temperature_ = float(self.T_c)
        t0, steps0, iters0 = getattr(self, "counts0", (0, 0, 0))
        done = int(self.running.t) - t0
        est.n_steps_, est.n_iter_ = steps0 + done, iters0 + done
        est.n_relocations_ = int(self.relocations)
        est.trace_ = self.trace
        est._mass_constrained = self.mass_constrained


def _out_of_core_input(X):
    """A Parquet path (or list of paths) or an :func:`fastanneal.open_parquet` stream: input
    a mini-batch fit reads out of core, without keeping labels."""
    if isinstance(X, (str, os.PathLike)):
        return True
    if isinstance(X, (list, tuple)) and X and isinstance(X[0], (str, os.PathLike)):
        return True
    return type(X).__module__ == "fastanneal._parquet"


#: Rows of a mini-batch update when ``batch_size`` is None (whole chunks out of core).
DEFAULT_BATCH_ROWS = 4096


class MiniBatchAnnealedKMeans(_BaseAnnealedKMeans):
    """Annealed soft k-means by stochastic EM over mini-batches (scikit-learn's
    ``MiniBatchKMeans`` is the model): in process for NumPy input, out of core for Dask
    arrays / DataFrames, Parquet paths and :class:`fastanneal.dask.EmbeddingArrays`.

    Each update reads the next batch of chunks (row ranges of ``batch_size`` rows for NumPy
    input; whole Dask chunks / Parquet row groups otherwise, in a random order per epoch),
    computes their moments at the current temperature (on the Dask workers for Dask input)
    and updates the running moments with the step size ``(t + learning_offset) **
    -learning_decay`` (``docs/theory.md`` section 6). The schedule lowers the temperature
    every ``batches_per_step`` updates; then ``polish_passes`` full Lloyd passes (T = 0) and
    a final pass compute ``J``, the free energy at the final temperature, the cluster
    weights and the labels (NumPy input: ``labels_``; otherwise written to ``labels_path``
    when given). Memory stays bounded by a few batches, whatever the size of the data.

    Parameters
    ----------
    n_clusters, metric, responsibilities, n_steps, init, temperature_start, temperature_end_ratio, auto_start_fraction, random_state, tol, verbose, checkpoint
        As :class:`AnnealedKMeans` (``schedule`` one of "geometric", "linear", "constant",
        "adaptive" for ``fit``; ``partial_fit``, one temperature a call, takes the first
        three; ``mass_constrained`` a bool). Seeding (k-means++, ``T_start="auto"``,
        ``T_c``) uses an in-memory sample of ``init_size`` rows (from random chunks), its
        rows unweighted (heavy-tailed weights would let a few sampled rows take the seeds;
        the weighted objective is annealed over all rows: ``docs/theory.md`` section 6.3).
    init_size : int or None
        Rows of the seeding sample; default ``max(100 * n_clusters, 20_000)``, at most a
        quarter of the rows (at least ``20 * n_clusters``): on data that small the
        mini-batch route would otherwise seed on nearly all of it, a full-batch fit.
    batch_size : int or None
        Rows per update (rounded to whole chunks for Dask input, at least one); default
        4096 rows (``DEFAULT_BATCH_ROWS``), whatever the cluster: the fit does not depend
        on the number of workers. On a cluster with chunks of that size or larger a batch
        is one chunk, reduced by one worker while the next is read; to keep ``w`` workers
        busy, pass ``batch_size = w x`` the chunk rows (the result then depends on that
        batch size, not on the cluster).
    batches_per_step : int or None
        Updates per temperature; default ``ceil(n_epochs * batches per epoch / n_steps)``.
    n_epochs : float, default=1.0
        Passes over the data during annealing (when ``batches_per_step`` is None), at least
        one batch per temperature step: on data smaller than ``n_steps`` batches the
        annealing reads more than ``n_epochs`` passes (lower ``n_steps`` or ``batch_size``).
    learning_decay, learning_offset : float, default 0.6 and 1.0
        ``eta_t = (t + learning_offset) ** -learning_decay``; ``learning_decay`` in (0.5, 1].
    polish_passes : int, default=1
        Full Lloyd passes at T = 0 after annealing.
    prefetch : int, default=1
        Dask input: batches read ahead while the current one is reduced (0: none).
    reallocate : bool, default=True
        Seed with k-means++ on 20 rows per cluster of the in-memory seeding sample (or
        from ``init`` when it is an array), then
        refine the seeds on the whole sample with Lloyd and the phase-transition
        re-allocation moves (``docs/theory.md`` section 6.7) before the stochastic EM (a
        full-data re-allocation would cost full passes out of core). The running moments
        start from the sample's moments either way (section 6.3). On small in-memory data
        the seeding is most of the time: ``reallocate=False, init_size=20 * n_clusters,
        n_steps=10`` ran at 0.90x ``MiniBatchKMeans``' time on CLINC150 (22,500 rows, K =
        150) with a better ARI (0.672 vs 0.662), where the default took 2.2x for 0.738
        (``benchmarks/study_minibatch_frontier.py``).
    scheduler : str, distributed.Client or None
        As ``AnnealedKMeans(scheduler=...)`` (Dask input only).
    progress : bool, default=False
        A tqdm progress bar over the temperature steps.

    Attributes
    ----------
    cluster_centers_, cluster_weights_ : ndarray
    inertia_ : float
        J on all rows, each row's distance summed in float64 (as ``score``) in memory and
        wherever the final pass writes labels (``labels_path``); out of core without
        labels, the final moments pass's GEMM form (relative rounding ~1e-7, more where
        rows of a much larger weight sit on their centers; a labelling pass would cost
        40-80 % of that pass).
    free_energy_, soft_distortion_ : float
        All rows, final centers, final temperature.
    labels_ : ndarray or None
        NumPy input; None otherwise (see ``labels_path_``).
    temperature_, temperature_start_, critical_temperature_ : float
        The critical temperature is that of the seeding sample.
    probability_temperature_ : float
        The temperature of :meth:`predict_proba` (0.25 x the median margin: of every row in
        memory, of a sample of up to 20,000 out of core).
    seeding_rows_ : int
        Rows of the seeding sample (``init_size`` or its default).
    n_batches_, n_steps_, n_passes_, n_iter_ : int
        Batches, temperature steps, full passes, updates + passes.
    rows_seen_, n_rows_, n_relocations_, batch_chunks_ : int
        Rows read by the updates, rows, empty-cluster relocations, chunks per batch.
    labels_path_ : str or None
    trace_ : Trace
        Annealing records are batch sums scaled to the total weight.
    schedule_ : Schedule
        The schedule that ran, with its state (a copy of the ``schedule`` parameter).
    n_features_in_ : int
    """

    def __init__(self, n_clusters=8, *, metric="euclidean", responsibilities="softmax",
                 schedule="geometric", n_steps=20, init="k-means++", init_size=None,
                 temperature_start="auto", temperature_end_ratio=0.05, auto_start_fraction=0.5,
                 mass_constrained=False, batch_size=None, batches_per_step=None, n_epochs=1.0,
                 learning_decay=0.6, learning_offset=1.0, polish_passes=1, prefetch=1,
                 scheduler=None, random_state=None, tol=1e-4, verbose=0, checkpoint=None,
                 reallocate=True, progress=False):
        self.n_clusters = n_clusters
        self.metric = metric
        self.responsibilities = responsibilities
        self.schedule = schedule
        self.n_steps = n_steps
        self.init = init
        self.init_size = init_size
        self.temperature_start = temperature_start
        self.temperature_end_ratio = temperature_end_ratio
        self.auto_start_fraction = auto_start_fraction
        self.mass_constrained = mass_constrained
        self.batch_size = batch_size
        self.batches_per_step = batches_per_step
        self.n_epochs = n_epochs
        self.learning_decay = learning_decay
        self.learning_offset = learning_offset
        self.polish_passes = polish_passes
        self.prefetch = prefetch
        self.scheduler = scheduler
        self.random_state = random_state
        self.tol = tol
        self.verbose = verbose
        self.checkpoint = checkpoint
        self.reallocate = reallocate
        self.progress = progress

    def _check_params(self):
        rc = self._check_common()
        if not (isinstance(self.schedule, str) and self.schedule in MINIBATCH_SCHEDULES):
            raise ValueError(f"mini-batch annealing supports the schedules "
                             f"{MINIBATCH_SCHEDULES}; got {self.schedule!r}")
        if not isinstance(self.mass_constrained, (bool, np.bool_)):
            raise ValueError(f"mass_constrained must be True or False; got "
                             f"{self.mass_constrained!r}")
        pp = self.polish_passes
        if not isinstance(pp, numbers.Integral) or isinstance(pp, bool) or pp < 0:
            raise ValueError(f"polish_passes must be >= 0; got {pp!r}")
        bs = self.batch_size
        if bs is not None and (not isinstance(bs, numbers.Integral) or isinstance(bs, bool)
                               or bs < 1):
            raise ValueError(f"batch_size must be None or a positive integer; got {bs!r}")
        for name in ("batches_per_step", "init_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool)
                                  or v < 1):
                raise ValueError(f"{name} must be None or a positive integer; got {v!r}")
        ne = self.n_epochs
        if not (isinstance(ne, numbers.Real) and not isinstance(ne, bool)
                and math.isfinite(ne) and ne > 0):
            raise ValueError(f"n_epochs must be a finite number > 0; got {ne!r}")
        if not (isinstance(self.tol, numbers.Real) and self.tol >= 0):
            raise ValueError(f"tol must be a non-negative number; got {self.tol!r}")
        pf = self.prefetch
        if not isinstance(pf, numbers.Integral) or isinstance(pf, bool) or pf < 0:
            raise ValueError(f"prefetch must be an integer >= 0; got {pf!r}")
        return rc

    @pinned_blas
    def fit(self, X, y=None, sample_weight=None, *, ids=None, labels_path=None,
            overwrite=False):
        """Anneal over ``X``; with ``labels_path`` (Dask / Parquet input), write the labels
        (and ids) as Parquet in the final pass (see :func:`fastanneal.dask.write_labels`).
        Returns self."""
        with E.verbose_logging(self.verbose):
            return self._fit(X, sample_weight, ids, labels_path, overwrite)

    def _fit(self, X, sample_weight, ids, labels_path, overwrite):
        t_start = time.perf_counter()
        self._forget_fit()
        rc = self._check_params()
        K = int(self.n_clusters)
        metric = metric_code(self.metric)
        if labels_path is not None:
            _check_labels_path(labels_path, X)
        if labels_path is not None and os.path.exists(labels_path) and not overwrite:
            raise FileExistsError(f"{labels_path} exists; pass overwrite=True to replace it")
        rng = self._rng()
        from ._parquet import ParquetStream, open_parquet
        if isinstance(X, (str, os.PathLike)) and self.scheduler is None:
            X = open_parquet(X, metric=self.metric)        # out of core, in this process
        if isinstance(X, ParquetStream):
            if sample_weight is not None or ids is not None:
                raise ValueError("with open_parquet(...) input, give the weight and id "
                                 "columns to open_parquet (weight=..., id=...)")
            if X.metric != metric:
                raise ValueError(f"open_parquet(..., metric=...) must match the estimator's "
                                 f"metric {self.metric!r}")
            stream = full = X
            n_threads = 1
        elif isinstance(X, np.ndarray) or (not hasattr(X, "__dask_graph__")
                                           and not isinstance(X, (str, os.PathLike))
                                           and type(X).__name__ != "EmbeddingArrays"):
            if ids is not None or labels_path is not None:
                raise ValueError("ids and labels_path are for Dask / Parquet input; with a "
                                 "NumPy array the labels are in labels_")
            Xv = self._validate_X(X, reset=True)
            w = self._validate_weights(sample_weight, Xv.shape[0], dtype=Xv.dtype)
            Xv, origin = self._centered(Xv, w)
            full = InMemorySource(Xv, w, metric)
            full.origin = origin
            stream = ArrayStream(Xv, w, metric, int(self.batch_size or DEFAULT_BATCH_ROWS))
            n_threads = 1
        else:
            from .dask import open_batch_stream
            stream = open_batch_stream(X, sample_weight, ids, metric, self.scheduler,
                                       int(max(0, self.prefetch)))
            full = stream
            n_threads = stream.n_threads_total
        try:
            return self._fit_stream(full, stream, K, rc, metric, rng, n_threads,
                                    labels_path, overwrite, stream.has_ids, t_start)
        finally:
            full.close()

    def _fit_stream(self, full, stream, K, rc, metric, rng, n_threads, labels_path, overwrite,
                    with_ids, t_start):
        if full.n_rows < K:
            raise ValueError(f"n_samples={full.n_rows} should be >= n_clusters={K}")
        self.n_features_in_ = full.n_features
        self.n_rows_ = full.n_rows
        W_total = full.total_weight
        if not W_total > 0:
            raise ValueError("sample_weight sums to zero: no row carries weight")
        if not math.isfinite(W_total):
            raise ValueError("sample_weight sums to infinity: rescale the weights (only "
                             "their ratios matter)")
        kd, lo = check_learning(self.learning_decay, self.learning_offset)
        n_steps = int(self.n_steps)
        ckpt = self._make_checkpoint(full, K, required=("T0", "T_c", "perm_seed"))
        st = ckpt.load() if ckpt is not None else None
        resumed = st is not None
        trace = Trace()
        # ---------------------------------------------------------- seeding
        if hasattr(full, "set_origin"):
            full.set_origin(None)           # the data's own frame until the fit decides
        if st is None:
            # (at most a quarter of the rows: on 22,500 rows the old max(100 K, 20,000)
            # made the seeding nearly a full-batch fit, about half of AnnealedKMeans' time)
            init_size = int(self.init_size or max(20 * K, min(max(100 * K, 20_000),
                                                               full.n_rows // 4)))
            Xs, ws = _sample_with_weight(full, min(init_size, full.n_rows), rng)
            if Xs.shape[0] < K:
                raise ValueError(f"the seeding sample has {Xs.shape[0]} rows < n_clusters={K}")
            if hasattr(full, "set_origin"):
                # streamed rows far from the origin: the seeding sample's mean becomes the
                # origin every chunk is measured from (no extra pass over the data); the
                # sample was read in the data's own frame (a stream reused from an earlier
                # fit forgets its origin first)
                Xs, origin = self._centered(Xs, ws)
                full.set_origin(origin)
            _check_distinct(full, Xs, ws, K, metric)
            ws = _seeding_weights(ws)
            C, T0, T_end, T_c, scale = _seed_from_sample(self, Xs, ws, K, metric, rng,
                                                         getattr(full, "origin", None))
            # the seeding sample is data too: its moments at the seeds and T_start start
            # the running moments (they are not discarded by the first batch)
            m0 = InMemorySource(Xs, ws, metric).moments(
                C, T0, rc, np.full(K, -math.log(K)) if self.mass_constrained and rc == 0
                else None, hard_sums=False)
            sample_rows = Xs.shape[0]
            del Xs, ws
            perm_seed = int(rng.integers(2 ** 62))
            st = E.AnnealState(centers=C, temperature=T0, T_start=T0, T_end=T_end,
                               scale=scale)
            extra = {"T0": T0, "T_c": T_c, "perm_seed": perm_seed, "sample_rows": sample_rows}
            origin = getattr(full, "origin", None)
            if hasattr(full, "set_origin") and origin is not None:
                extra["origin"] = [float(v) for v in origin]
        else:
            trace._rows = list(st.trace_rows)
            rng.bit_generator.state = st.rng_state
            extra = st.extra
            if hasattr(full, "set_origin") and extra.get("origin") is not None:
                full.set_origin(np.asarray(extra["origin"], dtype=np.float64))
        if ckpt is not None:
            self.checkpoint_info_ = {"path": str(ckpt.path), "finished": st.phase == "done",
                                     "resumed_from": st.step if resumed else None,
                                     "temperature": st.temperature if resumed else None,
                                     "phase": st.phase if resumed else None,
                                     "replaced": ckpt.replaced}
        # ---------------------------------------------------------- batches
        nonempty = [r for r in stream.chunk_rows if r > 0]
        if isinstance(stream, ArrayStream):
            batch_chunks = 1                    # its chunks are batch_size rows
        elif self.batch_size:
            batch_chunks = max(1, int(round(int(self.batch_size) / float(np.mean(nonempty)))))
        elif nonempty:
            # about target_rows rows of whole chunks (open_parquet: its chunk_rows; Dask:
            # DEFAULT_BATCH_ROWS): several where the chunks are smaller (64-row row groups
            # made every batch 64 rows, a fit 14x slower), one where they are larger -- never
            # the cluster's thread count (one chunk per worker thread made the fit depend on
            # how many workers the cluster had)
            target = getattr(stream, "target_rows", None) or DEFAULT_BATCH_ROWS
            batch_chunks = max(1, int(round(target / float(np.mean(nonempty)))))
        else:
            batch_chunks = 1
        batch_chunks = max(1, min(batch_chunks, len(nonempty)))
        per_epoch = math.ceil(len(nonempty) / batch_chunks)
        bps = int(self.batches_per_step) if self.batches_per_step else \
            max(1, math.ceil(float(self.n_epochs) * per_epoch / n_steps))
        running = RunningMoments(metric, bool(self.mass_constrained), rc, kd, lo, st.scale,
                                 row_weight=W_total / full.n_rows)
        rule = StochasticEMRule(stream, running, batch_chunks, bps, extra["perm_seed"],
                                W_total)
        if not resumed:
            batch_rows = batch_chunks * float(np.mean(nonempty))
            st.rule_state = running.initial_state(m0, sample_rows / batch_rows)
        cfg = EngineConfig(n_clusters=K, resp=rc, mass_constrained=False, max_iter=1,
                           tol=float(self.tol), polish=int(self.polish_passes) > 0,
                           max_polish_iter=max(1, int(self.polish_passes)),
                           verbose=int(self.verbose))
        hook = None
        if ckpt is not None:
            ckpt.trace, ckpt.extra, hook = trace, extra, ckpt.save
        schedule = _copied(make_schedule(self.schedule, n_steps))
        self.schedule_ = schedule
        bar = _attach_progress(cfg, schedule, self.progress)
        try:
            result = E.run(full, st, schedule, cfg, rng, trace, t_start, rule=rule, hook=hook)
        finally:
            if bar is not None:
                bar.close()
        if ckpt is not None:
            ckpt.save(st)
        if st.anneal_rule_state:
            # resumed in or after the polish, the rule did not run here: its running prior
            # and counts as the annealing left them (a no-op for a run that annealed here)
            rule.load_state_dict(st.anneal_rule_state)
        C = self._set_centers(result.centers, getattr(full, "origin", None), full.dtype)
        self._scale, self._rows_seen = float(st.scale), int(full.n_rows)
        T_final = result.temperature
        logp = running.log_prior(K) if self.mass_constrained else None
        # ---------------------------------------------------------- final pass
        inertia = margin = margin_w = None
        if isinstance(stream, ArrayStream):
            mf = full.moments(C, T_final, rc, logp, hard_sums=False)
            # the labels' own distances, summed in float64, give inertia_ (= -score(X), as
            # AnnealedKMeans; the pass's GEMM-form distances keep a float32 residue per row)
            self.labels_, inertia, _, margin = nearest_objective_counts(
                full.X, full.w, C, full.metric, return_margin=True)
            self.labels_path_ = None
        else:
            # (the margins of every k-th row for the probability temperature: a sample of
            # at least eight row groups read after the fit was half a pass over a
            # 16-row-group log, all of a smaller one)
            mf, self.labels_path_, msample = stream.final_pass(
                C, T_final, rc, logp, labels_path, overwrite, with_ids,
                margin_every=max(1, full.n_rows // PROBABILITY_SAMPLE))
            if msample is not None and (msample[1] > 0).any():
                # (strided rows that all weigh 0 -- weights on every third row, a stride of
                # 3 -- fell back to the final temperature: a sample is drawn instead)
                margin, margin_w = msample
            self.labels_ = None
        counts = mf.hard_counts
        empty = int(np.sum(~(counts > 0)))
        if K > 1 and empty:
            warnings.warn(f"{empty} of the {K} fitted clusters hold no row (of weight > 0); "
                          "the data may hold fewer points that can be told apart, or a "
                          "larger polish_passes may fill them", AnnealingWarning, stacklevel=3)
        self.cluster_weights_ = counts / counts.sum()
        self.inertia_ = float(mf.hard_distortion) if inertia is None else inertia
        if not (math.isfinite(self.inertia_) and math.isfinite(float(mf.free_energy))):
            # (the seeding sample's weights are rescaled: only the whole data's sums show it)
            raise ValueError(f"the objectives overflow float64 (inertia {self.inertia_!r}): "
                             "they are sums of weight x squared distance; rescale the weights "
                             "(divide them by a constant: only their ratios matter) or the "
                             "rows")
        self.free_energy_ = float(mf.free_energy)
        self.soft_distortion_ = float(mf.soft_distortion)
        self.hardening_gap_ = float(mf.soft_distortion - mf.hard_distortion)
        self.temperature_ = float(T_final)
        self.temperature_start_ = float(extra["T0"])
        self.critical_temperature_ = float(extra["T_c"])
        self.seeding_rows_ = int(extra.get("sample_rows", 0)) or None
        self.n_batches_ = int(rule.n_batches)
        self.n_steps_ = int(n_steps)
        self.n_passes_ = int(result.n_iter - rule.n_batches) + 1     # polish + final pass
        self.n_iter_ = int(result.n_iter) + 1
        self.rows_seen_ = int(running.rows_seen)
        self.n_relocations_ = int(result.relocations)
        self.batch_chunks_ = int(batch_chunks)
        self.trace_ = trace
        self._mass_constrained = bool(self.mass_constrained)
        self._set_probability_temperature(full, rng, C, margin, margin_w)
        if result.relocations:
            warnings.warn(f"{result.relocations} empty cluster(s) were relocated during the fit",
                          AnnealingWarning, stacklevel=3)
        return self


def warm_up(dtype=np.float32, metric="euclidean", responsibilities="softmax"):
    """Compile (on the first run) or load from Numba's cache (after) the kernels a default
    fit of ``dtype`` rows with this metric and responsibility rule uses, by fitting 64 tiny
    rows. The command line calls it under its own progress line, so that the one-time
    compilation is shown as such instead of as a silent first fit. Returns the seconds it
    took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((64, 4)) + np.repeat(np.eye(4) * 6, 16, axis=0)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AnnealedKMeans(4, metric=metric, responsibilities=responsibilities, n_steps=3,
                       random_state=0).fit(X)
    return time.perf_counter() - t0


def _attach_progress(cfg, schedule, enabled):
    """A tqdm bar over the temperature steps wired into ``cfg`` (None when not enabled)."""
    if not enabled:
        return None
    bar = _progress_bar(schedule)
    cfg.progress = lambda step, T, rec: (bar.update(1), bar.set_postfix(
        T=f"{T:.3g}", J=f"{rec['hard_distortion']:.5g}"))
    return bar


def _progress_bar(schedule):
    try:
        from tqdm.auto import tqdm
    except ImportError as e:  # pragma: no cover - optional extra
        raise ImportError("progress=True needs tqdm: pip install 'fastanneal[progress]'") from e
    return tqdm(total=getattr(schedule, "n_steps", None), desc="annealing", unit="T")

"""Mini-batch (stochastic EM) annealing: out of core on Dask, or one in-memory batch at a time
(``partial_fit``), and the streaming label writer.

Step-size rule (stochastic EM, Cappe & Moulines 2009; the same rule as online LDA)
-----------------------------------------------------------------------------------
The running moments are per unit weight: ``N_k ~ E[w r_k] / E[w]`` and ``S_k ~ E[w r_k x] /
E[w]``. A batch ``b`` with moments ``(N_b, S_b)`` and weight ``W_b`` at the current centers and
temperature ``T`` updates them as::

    N <- (1 - eta_t) N + eta_t N_b / W_b
    S <- (1 - eta_t) S + eta_t S_b / W_b          centers c_k = S_k / N_k

with ``eta_0 = 1`` (the first batch initializes the running moments) and
``eta_t = (t + learning_offset) ** -learning_decay`` for the t-th update (t = 1, 2, ...),
``learning_decay`` (kappa) in (0.5, 1] -- the Robbins-Monro conditions ``sum eta = inf``,
``sum eta^2 < inf`` -- and ``learning_offset >= 1`` (larger values forget early batches more
slowly). At a fixed ``T`` this is a stochastic approximation of the soft-Lloyd (EM) fixed
point of ``F_T``; the schedule lowers ``T`` meanwhile. Clusters whose running mass is zero
are relocated by splitting the heaviest cluster (as the full-batch engine does).
"""
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from .. import _engine
from .._engine import AnnealingWarning, _project, _record, _split_largest, min_center_distance
from .._moments import compute_moments
from .._sources import InMemorySource
from .._trace import Trace
from .._validation import as_float_matrix, as_weights, metric_code, normalize_rows, resp_code
from . import _chunks as ch
from ._cluster import resolve_client
from ._inputs import as_dask_inputs, is_dask_collection
from ._source import _Submitter, dask_dtype, row_offsets

log = logging.getLogger("fastanneal")

MINIBATCH_SCHEDULES = ("geometric", "linear", "constant")


# ---------------------------------------------------------------------------- parameters
def _check_learning(learning_decay, learning_offset):
    kd = float(learning_decay)
    if not 0.5 < kd <= 1.0:
        raise ValueError(f"learning_decay (kappa) must be in (0.5, 1]; got {learning_decay!r}")
    t0 = float(learning_offset)
    if not (math.isfinite(t0) and t0 >= 1.0):
        raise ValueError(f"learning_offset must be >= 1; got {learning_offset!r}")
    return kd, t0


def _check_schedule(schedule):
    if not (isinstance(schedule, str) and schedule in MINIBATCH_SCHEDULES):
        raise ValueError(f"mini-batch annealing supports the schedules {MINIBATCH_SCHEDULES}; "
                         f"got {schedule!r}")
    return schedule


def schedule_temperature(schedule, t, T_start, T_end, n_steps):
    """Temperature of step ``t`` (held at ``T_end`` after ``n_steps`` steps)."""
    if schedule == "constant" or n_steps <= 1:
        return float(T_start)
    j = min(t, n_steps - 1) / (n_steps - 1)
    if schedule == "linear":
        return float(T_start + (T_end - T_start) * j)
    return float(T_start * (T_end / T_start) ** j)


def _as_rng(random_state):
    if isinstance(random_state, np.random.Generator):
        return random_state
    if isinstance(random_state, np.random.RandomState):
        return np.random.default_rng(random_state.randint(2 ** 31))
    return np.random.default_rng(random_state)


def _record_compat(*args, logp=None, **kwargs):
    """The engine's trace record (with the mass-constrained certificate when it takes
    ``logp``)."""
    if logp is not None:
        try:
            return _record(*args, logp=logp, **kwargs)
        except TypeError:
            pass
    return _record(*args, **kwargs)


# ---------------------------------------------------------------------------- seeding
def seed_from_sample(Xs, ws, K, metric, init, temperature_start, temperature_end_ratio,
                     auto_start_fraction, rng):
    """Initial centers, ``T_start``, ``T_end``, ``T_c`` and the data scale from an in-memory
    sample (validated rows; unit rows for cosine), as ``AnnealedKMeans.fit`` computes them
    on the full data."""
    from ..estimator import kmeans_plusplus
    src = InMemorySource(Xs, ws, metric)
    if src.total_weight <= 0:
        raise ValueError("the seeding sample carries no weight")
    mean = src.mean()
    mean_c = mean / max(np.linalg.norm(mean), 1e-300) if metric == 1 else mean
    m0 = src.moments(mean[None, :], 1.0, 2, None, hard_sums=False)
    scale = m0.hard_distortion / src.total_weight
    if not scale > 0 and K > 1:
        raise ValueError("all rows of the seeding sample are identical: more than one cluster "
                         "is undefined")
    T_c = 2.0 * float(src.cluster_top_eigenvalues(mean[None, :], 50, rng)[0])
    delta = 1e-3 * math.sqrt(max(scale, 1e-300))
    if isinstance(init, str):
        if init == "k-means++":
            C = kmeans_plusplus(Xs, ws, K, rng)
        elif init == "random":
            p = ws / ws.sum()
            idx = rng.choice(Xs.shape[0], size=K, replace=False,
                             p=p if (p > 0).sum() >= K else None)
            C = Xs[idx].astype(np.float64)
        elif init == "mean":
            # coincident centers stay coincident under EM: start them a small step apart
            u = rng.standard_normal((K, Xs.shape[1]))
            u *= delta / np.linalg.norm(u, axis=1, keepdims=True)
            C = mean_c[None, :] + u
        else:
            raise ValueError(f"init must be 'k-means++', 'random', 'mean' or an array; got "
                             f"{init!r}")
    else:
        C = np.array(init, dtype=np.float64)
        if C.shape != (K, Xs.shape[1]):
            raise ValueError(f"init array must have shape ({K}, {Xs.shape[1]}); got {C.shape}")
        if not np.isfinite(C).all():
            raise ValueError("init array contains NaN or infinity")
    C = _project(C, metric)
    ts = temperature_start
    if ts == "auto":
        T0 = None
        if K > 1:
            mh = src.moments(C, 1.0, 2, None, hard_sums=True)
            means = mh.finalize(previous_centers=C, hard=True).centers
            lam = src.cluster_top_eigenvalues(means, 15, rng)
            cand = lam[(mh.hard_counts > 0) & (lam > 0)]
            if cand.size:
                T0 = float(auto_start_fraction * 2.0 * cand.min())
        if T0 is None or not T0 > 0:
            T0 = 0.05 * scale if scale > 0 else 1.0
    elif ts == "critical":
        T0 = 1.02 * T_c if T_c > 0 else scale
    else:
        T0 = float(ts)
        if not (math.isfinite(T0) and T0 > 0):
            raise ValueError(f"temperature_start must be 'auto', 'critical' or a positive "
                             f"number; got {ts!r}")
        if T0 > T_c > 0 and K > 1:
            warnings.warn(f"temperature_start={T0:.4g} is above the critical temperature "
                          f"T_c={T_c:.4g} (estimated on the seeding sample): clusters merge "
                          "until T falls below T_c", AnnealingWarning, stacklevel=3)
    r = float(temperature_end_ratio)
    if not 0 < r <= 1:
        raise ValueError(f"temperature_end_ratio must be in (0, 1]; got {temperature_end_ratio!r}")
    return C, float(T0), float(r * T0), float(T_c), float(scale)


# ---------------------------------------------------------------------------- state
@dataclass
class MiniBatchState:
    """Running moments of stochastic-EM annealing (picklable; NumPy only).

    ``N`` (K,) and ``S`` (K, D) are the running per-unit-weight moments (None before the
    first update); ``t`` counts the updates made.
    """
    centers: np.ndarray
    T_start: float
    T_end: float
    n_steps: int
    metric: int = 0
    resp: int = 0
    mass_constrained: bool = False
    learning_decay: float = 0.6
    learning_offset: float = 1.0
    schedule: str = "geometric"
    scale: float = 1.0
    critical_temperature: float = math.nan
    dtype: object = np.float64
    rng: object = None
    N: object = None
    S: object = None
    t: int = 0
    temperature: float = math.nan
    rows_seen: int = 0
    weight_seen: float = 0.0
    relocations: int = 0
    last_shift: float = math.nan
    objectives: dict = field(default_factory=dict)
    trace: Trace = field(default_factory=Trace)
    started: float = field(default_factory=time.perf_counter)

    @property
    def n_clusters(self):
        return self.centers.shape[0]

    def step_size(self, t=None):
        """``eta_t``: 1 for the first update, then ``(t + learning_offset) ** -learning_decay``."""
        t = self.t if t is None else t
        if t == 0:
            return 1.0
        return float((t + self.learning_offset) ** -self.learning_decay)

    def next_temperature(self):
        """The schedule's temperature for the next update (``partial_fit``: one step per
        call, ``T_end`` after ``n_steps`` calls)."""
        return schedule_temperature(self.schedule, self.t, self.T_start, self.T_end,
                                    self.n_steps)

    @property
    def log_prior(self):
        if not (self.mass_constrained and self.resp == 0):
            return None
        K = self.n_clusters
        if self.N is None:
            return np.full(K, -math.log(K))
        p = self.N / max(self.N.sum(), 1e-300)
        return np.log(np.maximum(p, 1e-300))

    def update(self, m):
        """One stochastic-EM step with the batch moments ``m`` (computed at ``self.centers``);
        returns the step size used (0 when the batch carries no weight)."""
        W = m.weight
        if not W > 0:
            return 0.0
        eta = self.step_size()
        Nb, Sb = m.N / W, m.S / W
        if self.N is None or eta >= 1.0:
            N, S = Nb.copy(), Sb.copy()
        else:
            N = (1.0 - eta) * self.N + eta * Nb
            S = (1.0 - eta) * self.S + eta * Sb
        C_old = self.centers
        # the engine's emptiness threshold (a share of the weight), here per unit weight
        empty = ~(N > getattr(_engine, "MIN_MASS", 0.0) * N.sum())
        with np.errstate(invalid="ignore", divide="ignore"):
            C = S / N[:, None]
        if self.metric == 1:
            norms = np.linalg.norm(C, axis=1)
            ok = ~empty & (norms > 0)
            C[ok] /= norms[ok, None]
            empty |= ~(norms > 0)
        C[empty] = C_old[empty]
        if empty.any():
            delta = 1e-3 * math.sqrt(max(self.scale, 1e-300))
            N = np.where(empty, 0.0, N)
            for k in np.nonzero(empty)[0]:
                donor = _split_largest(C, N, k, self.rng, delta)
                N[k] = N[donor] = 0.5 * N[donor]         # the donor shares its mass
                self.relocations += 1
            C = _project(C, self.metric)
            S = C * N[:, None]
        self.N, self.S = N, S
        self.last_shift = float(np.max(np.einsum("ij,ij->i", C - C_old, C - C_old)))
        self.centers = C
        self.temperature = float(m.temperature)
        self.t += 1
        self.rows_seen += int(m.rows)
        self.weight_seen += float(W)
        self.objectives = m.objectives()
        return eta

    def apply_to(self, est):
        """Set the fitted attributes of an estimator (``partial_fit``); returns it."""
        est.cluster_centers_ = self.centers.astype(self.dtype)
        N = self.N if self.N is not None else np.full(self.n_clusters, 1.0)
        est.cluster_weights_ = N / N.sum()
        est.temperature_ = float(self.temperature)
        est.temperature_start_ = float(self.T_start)
        est.critical_temperature_ = float(self.critical_temperature)
        est.n_steps_ = int(self.t)
        est.n_iter_ = int(self.t)
        est.n_relocations_ = int(self.relocations)
        est.trace_ = self.trace
        est._mass_constrained = bool(self.mass_constrained)
        return est


def _estimator_params(est):
    """The parameters the mini-batch paths read from an ``AnnealedKMeans`` (with defaults for
    the mini-batch ones it may not have)."""
    get = getattr
    mc = get(est, "mass_constrained", False)
    mc = False if (isinstance(mc, str) and mc == "auto") else bool(mc)
    rc = resp_code(get(est, "responsibilities", "softmax"))
    if rc == 2:
        raise ValueError("responsibilities must be 'softmax' or 'entmax15' for fitting")
    return dict(
        n_clusters=int(get(est, "n_clusters", 8)),
        metric=get(est, "metric", "euclidean"),
        responsibilities=get(est, "responsibilities", "softmax"),
        schedule=get(est, "schedule", "geometric"),
        n_steps=int(get(est, "n_steps", 20)),
        init=get(est, "init", "k-means++"),
        temperature_start=get(est, "temperature_start", "auto"),
        temperature_end_ratio=get(est, "temperature_end_ratio", 0.05),
        auto_start_fraction=get(est, "auto_start_fraction", 0.5),
        mass_constrained=mc,
        learning_decay=get(est, "learning_decay", 0.6),
        learning_offset=get(est, "learning_offset", 1.0),
        random_state=get(est, "random_state", None),
    )


def start_partial_fit(est, X, w=None):
    """The state of ``AnnealedKMeans.partial_fit`` from its first batch (validated rows,
    unit rows for cosine): k-means++ seeds, ``T_start`` ("auto" as in ``fit``) and the data
    scale come from this batch; each later call is one temperature step."""
    p = _estimator_params(est)
    X = as_float_matrix(X, "X", allow_empty=False)
    metric = metric_code(p["metric"])
    if metric == 1:
        X = normalize_rows(X)
    w = as_weights(w, X.shape[0])
    K = p["n_clusters"]
    if K < 1:
        raise ValueError(f"n_clusters must be a positive integer; got {K!r}")
    if X.shape[0] < K:
        raise ValueError(f"the first partial_fit batch has {X.shape[0]} rows; at least "
                         f"n_clusters={K} are needed to seed the centers")
    sched = _check_schedule(p["schedule"])
    kd, t0 = _check_learning(p["learning_decay"], p["learning_offset"])
    rng = est._rng() if hasattr(est, "_rng") else _as_rng(p["random_state"])
    C, T0, T_end, T_c, scale = seed_from_sample(
        X, w, K, metric, p["init"], p["temperature_start"], p["temperature_end_ratio"],
        p["auto_start_fraction"], rng)
    return MiniBatchState(centers=C, T_start=T0, T_end=T_end, n_steps=max(1, p["n_steps"]),
                          metric=metric, resp=resp_code(p["responsibilities"]),
                          mass_constrained=p["mass_constrained"], learning_decay=kd,
                          learning_offset=t0, schedule=sched, scale=scale,
                          critical_temperature=T_c, dtype=X.dtype, rng=rng)


def partial_fit_update(state, X_batch, w=None, T=None):
    """One stochastic-EM annealing update of ``state`` with an in-memory batch.

    Computes the batch moments at ``state.centers`` and temperature ``T`` (default: the
    schedule's next temperature, :meth:`MiniBatchState.next_temperature`) with the CPU
    kernel, then applies the step-size rule of this module. Appends one trace record.
    Returns ``state`` (updated in place).
    """
    X = as_float_matrix(X_batch, "X")
    if X.shape[1] != state.centers.shape[1]:
        raise ValueError(f"X has {X.shape[1]} features; the state has "
                         f"{state.centers.shape[1]}")
    if state.metric == 1:
        X = normalize_rows(X)
    w = as_weights(w, X.shape[0])
    T = state.next_temperature() if T is None else float(T)
    if not (math.isfinite(T) and T > 0):
        raise ValueError(f"temperature T must be finite and > 0; got {T}")
    C_before = state.centers
    logp = state.log_prior
    m = compute_moments(X, w, C_before, T, state.metric, state.resp, logp, hard_sums=False)
    rel0 = state.relocations
    state.update(m)
    _record_compat(state.trace, state.t - 1, state.t, T, m, state.centers, state.last_shift,
                   state.relocations - rel0, 0, state.n_clusters, state.started, logp=logp)
    return state


# ---------------------------------------------------------------------------- streaming
class _ChunkPlan(_Submitter):
    """Per-chunk delayed objects of the inputs, submitted on demand (nothing persisted)."""

    def __init__(self, data, metric, handle):
        super().__init__(handle)
        X = data.X
        self.metric = int(metric)
        self.dtype = dask_dtype(X.dtype)
        self.n_rows, self.n_features = (int(s) for s in X.shape)
        self.chunk_rows = tuple(int(c) for c in X.chunks[0])
        self.offsets = row_offsets(self.chunk_rows)
        self.xd = list(X.to_delayed().ravel())
        nc = len(self.xd)
        self.wd = list(data.weights.to_delayed().ravel()) if data.weights is not None \
            else [None] * nc
        self.idd = list(data.ids.to_delayed().ravel()) if data.ids is not None else [None] * nc
        self.weights = data.weights
        self.nthreads = handle.task_threads()
        self.n_threads_total = handle.n_worker_threads()

    @property
    def n_chunks(self):
        return len(self.xd)

    def prepared(self, i):
        import dask
        t = dask.delayed(ch.prepare_chunk, pure=True)(
            self.xd[i], self.wd[i], i, int(self.offsets[i]), self.metric, self.dtype)
        return self.client.compute(t)

    def total_weight(self):
        if self.weights is None:
            return float(self.n_rows)
        return float(self.client.compute(self.weights.sum()).result())

    def map_chunks(self, fn, indices, window, per_chunk=None, combine=None, with_ids=False,
                   **kwargs):
        """Run ``fn(x, w, ids, index, row0, metric, dtype, **kwargs, **per_chunk(i))`` -- one
        task that reads, validates and reduces a chunk, so nothing stays in memory -- over
        the chunks ``indices`` with at most ``window`` of them in flight. With ``combine``,
        folds the results in the order of ``indices`` (deterministic) and returns the total
        (None for no chunks); else returns the list of results."""
        import dask
        from distributed import wait
        indices = list(indices)
        pending = deque(enumerate(indices))
        inflight = {}
        done = {}
        total = None
        results = []
        nxt = 0
        try:
            while pending or inflight:
                while pending and len(inflight) < window:
                    j, i = pending.popleft()
                    extra = per_chunk(i) if per_chunk is not None else {}
                    t = dask.delayed(fn, pure=False)(
                        self.xd[i], self.wd[i], self.idd[i] if with_ids else None, i,
                        int(self.offsets[i]), self.metric, self.dtype, **kwargs, **extra)
                    inflight[self.client.compute(t)] = j
                with self.client.as_current():
                    res = wait(list(inflight), return_when="FIRST_COMPLETED")
                for f in res.done:
                    j = inflight.pop(f)
                    done[j] = f.result()      # raises the chunk's error
                    f.release()
                while nxt in done:
                    part = done.pop(nxt)
                    if combine is None:
                        results.append(part)
                    else:
                        total = part if total is None else combine(total, part)
                    nxt += 1
        except BaseException:
            for f in inflight:
                f.cancel()
            raise
        return results if combine is None else total

    def stream(self, fn, window, out_dir=None, with_ids=False, **kwargs):
        """A full pass of :func:`~fastanneal.dask._chunks.stream_chunk` over every chunk;
        returns the merged Moments (None for no chunks)."""
        return self.map_chunks(fn, range(self.n_chunks), window, combine=lambda a, b: a + b,
                               with_ids=with_ids, out_dir=out_dir, **kwargs)


class _AtomicFolder:
    """A temporary folder next to ``path``, renamed to ``path`` on :meth:`commit` (removed on
    :meth:`abort`): readers never see a partial result."""

    def __init__(self, path, overwrite=False):
        self.path = os.path.abspath(os.fspath(path))
        if os.path.exists(self.path) and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it")
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = os.path.join(parent, f".{os.path.basename(self.path)}.tmp-{uuid.uuid4().hex}")
        os.makedirs(self.tmp)
        self.overwrite = overwrite

    def commit(self):
        old = None
        if os.path.exists(self.path):
            if not self.overwrite:
                raise FileExistsError(f"{self.path} appeared during the fit")
            old = f"{self.tmp}.old"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def _final_pass(plan, C, T, resp, log_prior, window, labels_path=None, overwrite=False,
                with_ids=False):
    folder = _AtomicFolder(labels_path, overwrite) if labels_path is not None else None
    try:
        cf = plan.put(np.ascontiguousarray(C, dtype=plan.dtype))
        m = plan.stream(ch.stream_chunk, window, out_dir=folder.tmp if folder else None,
                        with_ids=with_ids, C=cf, T=float(T), resp=int(resp),
                        log_prior=log_prior, hard_sums=False, nthreads=plan.nthreads)
    except BaseException:
        if folder is not None:
            folder.abort()
        raise
    path = folder.commit() if folder is not None else None
    return m, path


def write_labels(X, centers, path, *, ids=None, metric="euclidean", scheduler=None,
                 overwrite=False, window=None):
    """Write the hard labels of every row of ``X`` as Parquet, one file per chunk, without
    gathering them.

    ``X`` is anything :func:`~fastanneal.dask.as_dask_inputs` accepts (a Dask array, a Parquet
    path, ...); ``ids`` an optional Dask / NumPy array of row ids (or the ids of an
    :class:`~fastanneal.dask.EmbeddingArrays`). The files ``part-000000.parquet``, ... with the
    columns ``row`` (global row number), ``id`` (when given) and ``label`` (int32) are written
    into a temporary folder next to ``path``, which is renamed to ``path`` only when every
    chunk succeeded: on an error (NaN in a chunk, ...) nothing is written. Workers write the
    files, so ``path`` must be on a filesystem they share with the client.

    Returns a dict with ``path``, ``rows``, ``inertia`` (``J``) and ``counts`` (hard weight
    per cluster).
    """
    mc = metric_code(metric)
    C = np.asarray(centers, dtype=np.float64)
    if C.ndim != 2 or not np.isfinite(C).all():
        raise ValueError("centers must be a finite 2-D array")
    if mc == 1:
        C = _project(C, 1)
    data = as_dask_inputs(X, None, ids)
    if data.X.shape[1] != C.shape[1]:
        raise ValueError(f"X has {data.X.shape[1]} features but centers have {C.shape[1]}")
    handle = resolve_client(scheduler)
    try:
        plan = _ChunkPlan(data, mc, handle)
        window = window or max(2, 2 * plan.n_threads_total)
        m, out = _final_pass(plan, C, 1.0, 2, None, window, path, overwrite,
                             with_ids=data.ids is not None)
    finally:
        handle.close()
    rows = 0 if m is None else m.rows
    return {"path": out, "rows": rows, "inertia": 0.0 if m is None else m.hard_distortion,
            "counts": np.zeros(C.shape[0]) if m is None else m.hard_counts}


# ---------------------------------------------------------------------------- annealer
def _scaled(m, factor):
    """``m`` with its additive fields multiplied by ``factor`` (a batch scaled to the data)."""
    return replace(m, N=m.N * factor, S=m.S * factor,
                   soft_distortion=m.soft_distortion * factor, entropy=m.entropy * factor,
                   free_energy=m.free_energy * factor,
                   hard_distortion=m.hard_distortion * factor,
                   hard_counts=m.hard_counts * factor,
                   hard_sums=None if m.hard_sums is None else m.hard_sums * factor,
                   weight=m.weight * factor, rows=int(round(m.rows * factor)),
                   margin_sum=m.margin_sum * factor)


class MiniBatchAnnealer:
    """Out-of-core annealed soft k-means by stochastic EM over chunks read on demand.

    Each update reads the next batch of chunks (whole chunks of the Dask array / Parquet row
    groups, in a random order per epoch), computes their moments at the current temperature
    on the workers with the CPU kernel and updates the running moments with the step-size
    rule of :mod:`fastanneal.dask._minibatch`. The schedule lowers the temperature every
    ``batches_per_step`` updates. Then ``polish_passes`` streaming Lloyd passes (T = 0) and a
    final streaming pass compute the hard objective ``J``, the free energy at the final
    temperature, the cluster weights and -- with ``labels_path`` -- write the labels. Memory
    stays bounded by ``(prefetch + 1)`` batches of chunks on the workers (the streaming
    passes: ``2 * worker threads`` chunks in flight), whatever the size of the data.

    Parameters
    ----------
    n_clusters, metric, responsibilities, n_steps, init, temperature_start,
    temperature_end_ratio, auto_start_fraction, mass_constrained, random_state :
        As :class:`~fastanneal.AnnealedKMeans` (``schedule`` one of "geometric", "linear",
        "constant"; ``mass_constrained`` a bool). Seeding (k-means++, ``T_start="auto"``,
        ``T_c``) uses an in-memory sample of ``init_size`` rows from random chunks.
    init_size : int or None
        Rows of the seeding sample; default ``max(100 * n_clusters, 20_000)``.
    batch_size : int or None
        Rows per update, rounded to whole chunks (at least one); default one chunk per
        worker thread.
    batches_per_step : int or None
        Updates per temperature; default ``ceil(n_epochs * batches per epoch / n_steps)``.
    n_epochs : float, default=1.0
        Passes over the data during annealing (when ``batches_per_step`` is None).
    learning_decay, learning_offset : float, default 0.6 and 1.0
        ``eta_t = (t + learning_offset) ** -learning_decay``; ``learning_decay`` in (0.5, 1].
    polish_passes : int, default=1
        Full streaming Lloyd passes at T = 0 after annealing.
    prefetch : int, default=1
        Batches read ahead while the current one is reduced (0: none).
    scheduler : str, distributed.Client or None
        As ``AnnealedKMeans(scheduler=...)``.

    Attributes
    ----------
    cluster_centers_, cluster_weights_, inertia_ (J on all rows), free_energy_ and
    soft_distortion_ (all rows, final centers, final temperature), temperature_,
    temperature_start_, critical_temperature_ (of the seeding sample), n_batches_, n_steps_,
    n_passes_ (full streaming passes), rows_seen_ (rows read by the updates), n_rows_,
    n_relocations_, labels_path_, trace_ (annealing records are batch estimates scaled to the
    total weight), n_features_in_. All NumPy / Python scalars.
    """

    def __init__(self, n_clusters=8, *, metric="euclidean", responsibilities="softmax",
                 schedule="geometric", n_steps=20, init="k-means++", init_size=None,
                 temperature_start="auto", temperature_end_ratio=0.05, auto_start_fraction=0.5,
                 mass_constrained=False, batch_size=None, batches_per_step=None, n_epochs=1.0,
                 learning_decay=0.6, learning_offset=1.0, polish_passes=1, prefetch=1,
                 scheduler=None, random_state=None, verbose=0):
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
        self.verbose = verbose

    # ------------------------------------------------------------------ helpers
    def _sample(self, plan, n_target, rng, min_chunks=8):
        """About ``n_target`` random rows from at least ``min_chunks`` random chunks (data
        stored in cluster order would bias a sample of one chunk); each chunk is read and
        subsampled on a worker, so only the sample travels."""
        nonempty = [i for i in range(plan.n_chunks) if plan.chunk_rows[i] > 0]
        order = [int(i) for i in rng.permutation(nonempty)]
        mean_rows = float(np.mean([plan.chunk_rows[i] for i in nonempty]))
        m = min(len(order), max(min_chunks, math.ceil(n_target / mean_rows)))
        picked = sorted(order[:m])
        per = math.ceil(n_target / m)
        take = {}
        for i in picked:
            n_i = plan.chunk_rows[i]
            take[i] = np.arange(n_i) if per >= n_i else np.sort(
                rng.choice(n_i, size=per, replace=False))
        parts = plan.map_chunks(ch.sample_chunk, picked, max(2, 2 * plan.n_threads_total),
                                per_chunk=lambda i: {"idx": take[i]})
        Xs = np.concatenate([p[0] for p in parts])
        ws = np.concatenate([p[1] for p in parts])
        if Xs.shape[0] > n_target:
            idx = np.sort(rng.choice(Xs.shape[0], size=n_target, replace=False))
            Xs, ws = Xs[idx], ws[idx]
        return np.ascontiguousarray(Xs), ws

    def _batches(self, plan, batch_chunks, rng):
        """Endless stream of batches (lists of chunk indices), a fresh permutation per epoch."""
        nonempty = [i for i in range(plan.n_chunks) if plan.chunk_rows[i] > 0]
        cur = []
        while True:
            for i in rng.permutation(nonempty):
                cur.append(int(i))
                if len(cur) == batch_chunks:
                    yield cur
                    cur = []

    # ------------------------------------------------------------------ fit
    def fit(self, X, sample_weight=None, *, ids=None, labels_path=None, overwrite=False):
        """Anneal over ``X`` (a Dask array, Dask DataFrame, Parquet path, EmbeddingArrays or
        NumPy array); with ``labels_path``, write the labels (and ids) as Parquet in the final
        pass (see :func:`write_labels`). Returns self."""
        t_start = time.perf_counter()
        K = self.n_clusters
        if not isinstance(K, (int, np.integer)) or isinstance(K, bool) or K < 1:
            raise ValueError(f"n_clusters must be a positive integer; got {K!r}")
        K = int(K)
        metric = metric_code(self.metric)
        rc = resp_code(self.responsibilities)
        if rc == 2:
            raise ValueError("responsibilities must be 'softmax' or 'entmax15' for fitting")
        sched = _check_schedule(self.schedule)
        kd, t0 = _check_learning(self.learning_decay, self.learning_offset)
        n_steps = int(self.n_steps)
        if n_steps < 1:
            raise ValueError(f"n_steps must be >= 1; got {self.n_steps!r}")
        polish_passes = int(self.polish_passes)
        if polish_passes < 0:
            raise ValueError(f"polish_passes must be >= 0; got {self.polish_passes!r}")
        prefetch = max(0, int(self.prefetch))
        if labels_path is not None and os.path.exists(labels_path) and not overwrite:
            raise FileExistsError(f"{labels_path} exists; pass overwrite=True to replace it")
        rng = _as_rng(self.random_state)
        chunk_rows = int(self.batch_size) if (self.batch_size and not is_dask_collection(X)
                                              and isinstance(X, np.ndarray)) else None
        data = as_dask_inputs(X, sample_weight, ids, chunk_rows=chunk_rows)
        handle = resolve_client(self.scheduler)
        try:
            plan = _ChunkPlan(data, metric, handle)
            self._fit(plan, K, metric, rc, sched, kd, t0, n_steps, polish_passes, prefetch,
                      rng, labels_path, overwrite, data.ids is not None, t_start)
        finally:
            handle.close()
        return self

    def _fit(self, plan, K, metric, rc, sched, kd, t0, n_steps, polish_passes, prefetch, rng,
             labels_path, overwrite, with_ids, t_start):
        if plan.n_rows < K:
            raise ValueError(f"n_samples={plan.n_rows} should be >= n_clusters={K}")
        self.n_features_in_ = plan.n_features
        self.n_rows_ = plan.n_rows
        W_total = plan.total_weight()
        if not W_total > 0:
            raise ValueError("sample_weight sums to zero: no row carries weight")
        # ---------------------------------------------------------- seeding
        init_size = int(self.init_size or max(100 * K, 20_000))
        Xs, ws = self._sample(plan, min(init_size, plan.n_rows), rng)
        if Xs.shape[0] < K:
            raise ValueError(f"the seeding sample has {Xs.shape[0]} rows < n_clusters={K}")
        C, T0, T_end, T_c, scale = seed_from_sample(
            Xs, ws, K, metric, self.init, self.temperature_start, self.temperature_end_ratio,
            self.auto_start_fraction, rng)
        del Xs, ws
        state = MiniBatchState(centers=C, T_start=T0, T_end=T_end, n_steps=n_steps,
                               metric=metric, resp=rc, mass_constrained=bool(
                                   self.mass_constrained), learning_decay=kd,
                               learning_offset=t0, schedule=sched, scale=scale,
                               critical_temperature=T_c, dtype=plan.dtype, rng=rng,
                               started=t_start)
        # ---------------------------------------------------------- batches
        nonempty = [r for r in plan.chunk_rows if r > 0]
        if self.batch_size:
            mean_rows = float(np.mean(nonempty))
            batch_chunks = max(1, int(round(int(self.batch_size) / mean_rows)))
        else:
            batch_chunks = plan.n_threads_total
        batch_chunks = max(1, min(batch_chunks, len(nonempty)))
        per_epoch = math.ceil(len(nonempty) / batch_chunks)
        if self.batches_per_step:
            bps = int(self.batches_per_step)
        else:
            bps = max(1, math.ceil(float(self.n_epochs) * per_epoch / n_steps))
        batches = self._batches(plan, batch_chunks, rng)
        queue = deque()

        def submit_next():
            queue.append([plan.prepared(i) for i in next(batches)])

        trace = state.trace
        n_batches = 0
        for step in range(n_steps):
            T = schedule_temperature(sched, step, T0, T_end, n_steps)
            step_m = None
            rel0 = state.relocations
            logp_step = state.log_prior
            for _ in range(bps):
                if not queue:
                    submit_next()
                futs = queue.popleft()
                while len(queue) < prefetch:      # read ahead while this batch is reduced
                    submit_next()
                cf = plan.put(np.ascontiguousarray(state.centers, dtype=plan.dtype))
                parts = plan.client.map(ch.chunk_moments, futs, C=cf, T=T, metric=metric,
                                        resp=rc, log_prior=state.log_prior, hard_sums=False,
                                        nthreads=plan.nthreads, pure=False)
                m = plan.tree(parts, ch.merge_moments).result()
                del parts, futs
                state.update(m)
                n_batches += 1
                step_m = m if step_m is None else step_m + m
            dmin, _ = min_center_distance(state.centers)
            _record_compat(trace, step, n_batches, T,
                           _scaled(step_m, W_total / step_m.weight), state.centers,
                           state.last_shift, state.relocations - rel0, 0, K, t_start, dmin,
                           logp=logp_step)
            if self.verbose:
                log.info("mini-batch step %d T=%.4g F~%.6g J~%.6g rows=%d", step, T,
                         trace[-1]["free_energy"], trace[-1]["hard_distortion"],
                         state.rows_seen)
        for f in queue:
            plan.client.cancel(f)
        queue.clear()
        window = max(2, 2 * plan.n_threads_total)
        C = state.centers
        T_final = state.temperature
        # ---------------------------------------------------------- polish (T = 0)
        passes = 0
        for _ in range(polish_passes):
            cf = plan.put(np.ascontiguousarray(C, dtype=plan.dtype))
            mh = plan.stream(ch.stream_chunk, window, C=cf, T=T_final, resp=2, log_prior=None,
                             hard_sums=True, nthreads=plan.nthreads)
            passes += 1
            upd = mh.finalize(previous_centers=C, hard=True)
            Cn = upd.centers
            if upd.empty.any():
                delta = 1e-3 * math.sqrt(max(scale, 1e-300))
                for k in np.nonzero(upd.empty)[0]:
                    _split_largest(Cn, mh.hard_counts, k, rng, delta)
                    state.relocations += 1
                Cn = _project(Cn, metric)
            shift = float(np.max(np.einsum("ij,ij->i", Cn - C, Cn - C)))
            C = Cn
            _record(trace, -1, n_batches + passes, 0.0, mh, C, shift, int(upd.empty.sum()), 0,
                    K, t_start)
        # ---------------------------------------------------------- final pass
        mf, path = _final_pass(plan, C, T_final, rc, state.log_prior, window, labels_path,
                               overwrite, with_ids=with_ids)
        passes += 1
        self.cluster_centers_ = C.astype(plan.dtype)
        counts = mf.hard_counts
        self.cluster_weights_ = counts / counts.sum()
        self.inertia_ = float(mf.hard_distortion)
        self.free_energy_ = float(mf.free_energy)
        self.soft_distortion_ = float(mf.soft_distortion)
        self.temperature_ = float(T_final)
        self.temperature_start_ = float(T0)
        self.critical_temperature_ = float(T_c)
        self.n_batches_ = int(n_batches)
        self.n_steps_ = int(n_steps)
        self.n_passes_ = int(passes)
        self.rows_seen_ = int(state.rows_seen)
        self.n_relocations_ = int(state.relocations)
        self.batch_chunks_ = int(batch_chunks)
        self.labels_path_ = path
        self.trace_ = trace
        self._mass_constrained = bool(self.mass_constrained)
        if state.relocations:
            warnings.warn(f"{state.relocations} empty cluster(s) were relocated during the fit",
                          AnnealingWarning, stacklevel=3)
        return self

    # ------------------------------------------------------------------ inference
    def predict(self, X):
        """Hard labels: a NumPy array for NumPy input, a lazy Dask array for Dask input."""
        return predict_labels(X, self.cluster_centers_, self.metric)

    def get_params(self, deep=True):
        import inspect
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {n: getattr(self, n) for n in names}

    def set_params(self, **params):
        for k, v in params.items():
            if k not in self.get_params():
                raise ValueError(f"invalid parameter {k!r} for {type(self).__name__}")
            setattr(self, k, v)
        return self

    def __getstate__(self):
        state = dict(self.__dict__)
        from distributed import Client
        if isinstance(state.get("scheduler"), Client):
            state["scheduler"] = None          # a live client does not pickle
        return state


def _predict_block(x, C, metric):
    from .._moments import assign
    mc = metric_code(metric)
    X = as_float_matrix(x, "X")
    if mc == 1:
        X = normalize_rows(X)
    if X.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return assign(X, C, mc, _prepared=True)[0]


def predict_labels(X, centers, metric="euclidean"):
    """Nearest-center labels of ``X``: NumPy in, NumPy out; Dask array in, lazy Dask array
    out (one task per row chunk)."""
    C = np.asarray(centers)
    if is_dask_collection(X):
        if len(X.chunks[1]) != 1:
            X = X.rechunk({1: -1})
        return X.map_blocks(_predict_block, C, metric, drop_axis=1, dtype=np.int64)
    return _predict_block(X, C, metric)


def fit_minibatch_into(est, X, sample_weight=None):
    """``AnnealedKMeans.fit`` in mini-batch mode (``batch_size`` set): runs
    :class:`MiniBatchAnnealer` with the estimator's parameters and copies the fitted
    attributes onto ``est`` (``labels_`` is None: use ``predict`` or :func:`write_labels`).
    Returns ``est``."""
    p = _estimator_params(est)
    mb = MiniBatchAnnealer(
        p["n_clusters"], metric=p["metric"], responsibilities=p["responsibilities"],
        schedule=p["schedule"], n_steps=p["n_steps"], init=p["init"],
        temperature_start=p["temperature_start"],
        temperature_end_ratio=p["temperature_end_ratio"],
        auto_start_fraction=p["auto_start_fraction"], mass_constrained=p["mass_constrained"],
        batch_size=getattr(est, "batch_size", None),
        learning_decay=p["learning_decay"], learning_offset=p["learning_offset"],
        polish_passes=1 if getattr(est, "polish", True) else 0,
        scheduler=getattr(est, "scheduler", None),
        random_state=est._rng() if hasattr(est, "_rng") else p["random_state"],
        verbose=getattr(est, "verbose", 0))
    mb.fit(X, sample_weight)
    for name in ("cluster_centers_", "cluster_weights_", "inertia_", "free_energy_",
                 "soft_distortion_", "temperature_", "temperature_start_",
                 "critical_temperature_", "n_steps_", "n_relocations_", "trace_",
                 "n_features_in_", "_mass_constrained"):
        setattr(est, name, getattr(mb, name))
    est.n_iter_ = mb.n_batches_ + mb.n_passes_
    est.hardening_gap_ = float(mb.soft_distortion_ - mb.inertia_)
    est.labels_ = None
    return est

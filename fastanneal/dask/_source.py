"""``DaskSource``: full-batch moments over persisted chunks on a Dask cluster."""
import logging
import math
import warnings
import weakref

import numpy as np

from .. import _config
from .._sources import COVARIANCE_MAX_D, _about, power_iteration_eigs
from .._validation import far_from_origin, metric_code
from . import _chunks as ch
from ._cluster import resolve_client
from ._inputs import as_dask_inputs

log = logging.getLogger("fastanneal")

#: Fan-in of the tree reductions (chunks merged per task).
SPLIT_EVERY = 8

#: A pass computes each group of :data:`SPLIT_EVERY` consecutive chunks and their merge in
#: one task ("fused") once there are at least this many groups per worker thread: then a
#: group is placed whole on one worker and the pass's tasks fall from about 1.14 to 0.14 a
#: chunk, while the groups still spread evenly over the threads (the busiest thread has at
#: most one group more than the average over at least this many). Results are the same bits
#: either way: the first level of the tree merges the same chunks in the same order.
FUSE_GROUPS_PER_THREAD = 8


def _identity(x):
    return x


def dask_dtype(dtype):
    """float32 stays float32; every other dtype becomes float64 (as the in-memory path)."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float32 else np.dtype(np.float64)


def row_offsets(chunks):
    off = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(chunks, out=off[1:])
    return off


class _Submitter:
    """Small helpers around one client: put a value in the graph, map, tree-reduce."""

    def __init__(self, handle):
        self.handle = handle
        self.client = handle.client

    def put(self, value):
        """A future of ``value`` that the scheduler can recompute (it is in the task spec;
        unlike ``scatter``, a worker lost mid-fit does not lose it)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Large object.*")
            return self.client.submit(_identity, value, pure=False)

    def map_tree(self, func, seqs, merge, map_kw=None, merge_kw=None):
        """``func`` over the chunks (``func(*args, **map_kw)`` for ``args`` in ``zip(*seqs)``),
        reduced with ``merge(*group, **merge_kw)`` in the tree of :meth:`tree`; returns one
        future (or None when there are no chunks). Groups of the first level whose chunks
        share a worker (``self._fused``, see :data:`FUSE_GROUPS_PER_THREAD`) are one task
        (:func:`~fastanneal.dask._chunks.map_merge`): the same result bit for bit."""
        map_kw, merge_kw = dict(map_kw or {}), dict(merge_kw or {})
        seqs = [list(s) for s in seqs]
        n = len(seqs[0]) if seqs else 0
        fused = getattr(self, "_fused", None)
        if n < 2 or fused is None or len(fused) != -(-n // SPLIT_EVERY):
            return self.tree(self.client.map(func, *seqs, pure=False, **map_kw), merge,
                             **merge_kw)
        level = []
        for j, i in enumerate(range(0, n, SPLIT_EVERY)):
            group = [s[i:i + SPLIT_EVERY] for s in seqs]
            if fused[j]:
                level.append(self.client.submit(ch.map_merge, func, merge, group, map_kw,
                                                 merge_kw, pure=False))
            else:
                parts = self.client.map(func, *group, pure=False, **map_kw)
                level.append(self.client.submit(merge, *parts, pure=False, **merge_kw))
        return self.tree(level, merge, **merge_kw)

    def tree(self, futures, func, **kwargs):
        """Reduce ``futures`` with ``func(*group, **kwargs)`` in a fixed order (a tree of
        fan-in :data:`SPLIT_EVERY`); returns one future (or None when empty)."""
        futs = list(futures)
        if not futs:
            return None
        while len(futs) > 1:
            futs = [self.client.submit(func, *futs[i:i + SPLIT_EVERY], pure=False, **kwargs)
                    for i in range(0, len(futs), SPLIT_EVERY)]
        return futs[0]


class DaskSource(_Submitter):
    """Moment source over the row chunks of a Dask array, persisted once on the cluster.

    Each chunk is validated on its worker (NaN / infinity, negative weights, zero rows for
    cosine: the error names the chunk and its global row range) and, for cosine,
    unit-normalized. Every moments pass maps the same Numba kernel as the in-memory source
    over the chunks and merges the records with a tree of tasks in a fixed order, so the
    result does not depend on which worker ran a chunk (nor on a worker lost and recomputed).

    Parameters
    ----------
    X : dask array (n, D)
        The rows.
    w : dask array (n,) or None
        Row weights with the same row chunks as ``X``.
    metric : int
        0 euclidean, 1 cosine.
    handle : :class:`~fastanneal.dask._cluster.ClientHandle`
        The client, and what this library started for it.
    """

    def __init__(self, X, w, metric, handle):
        import dask
        import dask.base
        super().__init__(handle)
        self._token = dask.base.tokenize(X, w)
        self._finalizer = weakref.finalize(self, handle.close)
        self.metric = int(metric)
        self.dtype = dask_dtype(X.dtype)
        self.n_rows, self.n_features = (int(s) for s in X.shape)
        self.chunk_rows = tuple(int(c) for c in X.chunks[0])
        self.offsets = row_offsets(self.chunk_rows)
        self.row_base = int(_config.ROW_BASE.get())  # the first row's number in messages
        self._nthreads = handle.task_threads()
        xd = X.to_delayed().ravel()
        wd = w.to_delayed().ravel() if w is not None else [None] * len(xd)
        self._fused = None
        where = self._placement()
        tasks = []
        for i, (x, wb) in enumerate(zip(xd, wd)):
            # the planned worker as a task annotation: every chunk in ONE graph submission
            # (computing each chunk's delayed on its own ships the whole array graph once
            # per chunk: quadratic in the chunks, 18 s for 400 chunks on two workers)
            with dask.annotate(**({} if where is None else
                                  {"workers": [where[i]], "allow_other_workers": True})):
                tasks.append(dask.delayed(ch.prepare_chunk, pure=True)(
                    x, wb, i, int(self.offsets[i]), self.metric, self.dtype,
                    row_base=self.row_base, expect=(self.chunk_rows[i], self.n_features)))
        self._chunks = self.client.compute(tasks)
        try:
            futs = self.client.map(ch.chunk_stats, self._chunks, pure=False)
            # in chunk order: a bad input is reported for its first chunk, not for whichever
            # chunk failed first in time (and as soon as the chunks before it are done)
            stats = [self.handle.result(f) for f in futs]
        except BaseException:
            self._release()
            raise
        self._fused = self._plan_fusion()
        with np.errstate(over="ignore"):
            self.total_weight = float(sum(s[1] for s in stats))
        if self.n_rows and not self.total_weight > 0:
            self._release()
            raise ValueError("sample_weight sums to zero: no row carries weight")
        if not math.isfinite(self.total_weight):
            self._release()
            raise ValueError("sample_weight sums to infinity: rescale the weights (only "
                             "their ratios matter)")
        #: the point the rows are measured from (Euclidean rows far from the origin relative
        #: to their spread: the persisted chunks are shifted to their weighted mean, as the
        #: in-memory route centers its rows; ``docs/theory.md``, "Rows far from the origin")
        self.origin = None
        if self.metric == 0 and self.n_rows and stats:
            mean = sum(s[2] for s in stats) / self.total_weight
            msq = sum(s[3] for s in stats) / self.total_weight
            if far_from_origin(mean, msq, self.dtype):
                self._shift_chunks(mean)

    def _shift_chunks(self, origin):
        old = self._chunks
        of = self.put(np.ascontiguousarray(origin, dtype=np.float64))
        self._chunks = self.client.map(ch.shift_chunk, old, origin=of, pure=False)
        try:
            self.handle.wait(self._chunks)
        finally:
            for f in old:
                f.release()
        self._fused = self._plan_fusion()
        self.origin = np.asarray(origin, dtype=np.float64)
    def _workers_info(self):
        try:
            return self.client.scheduler_info(n_workers=-1)["workers"]
        except Exception:  # pragma: no cover
            return None

    def _fuses(self, info):
        """Whether the passes fuse the first level of their trees: at least
        :data:`FUSE_GROUPS_PER_THREAD` groups of chunks per worker thread."""
        n = len(self.chunk_rows)
        if not info or n < 2:
            return False
        threads = sum(max(1, int(w.get("nthreads", 1))) for w in info.values())
        return -(-n // SPLIT_EVERY) >= FUSE_GROUPS_PER_THREAD * threads

    def _placement(self):
        """A worker for each chunk, in proportion to the workers' threads (greedy, largest
        first): a pass lasts as long as the busiest worker. When the passes fuse (see
        :data:`FUSE_GROUPS_PER_THREAD`) each group of :data:`SPLIT_EVERY` consecutive chunks
        is placed whole, so that its fused task reads local chunks. Used as a loose
        restriction -- a chunk lost with its worker is recomputed anywhere."""
        info = self._workers_info()
        n = len(self.chunk_rows)
        if info is None or len(info) < 2 or n < 2:
            return None
        step = SPLIT_EVERY if self._fuses(info) else 1
        units = [range(i, min(i + step, n)) for i in range(0, n, step)]
        rows = [sum(self.chunk_rows[i] for i in u) for u in units]
        workers = sorted(info)
        threads = np.array([max(1, int(info[w].get("nthreads", 1))) for w in workers], float)
        load = np.zeros(len(workers))
        out = [None] * n
        for u in sorted(range(len(units)), key=lambda u: -rows[u]):
            j = int(np.argmin((load + rows[u]) / threads))
            load[j] += rows[u]
            for i in units[u]:
                out[i] = workers[j]
        return out

    def _plan_fusion(self):
        """Per group of the trees' first level: whether its chunks share a worker (then a
        pass computes the group in one task). None: no fusing (too few groups per thread)."""
        if not self._fuses(self._workers_info()):
            return None
        try:
            who = self.client.who_has(self._chunks)
        except Exception:  # pragma: no cover
            return None
        flags = []
        for i in range(0, len(self._chunks), SPLIT_EVERY):
            held = [set(who.get(f.key, ())) for f in self._chunks[i:i + SPLIT_EVERY]]
            flags.append(bool(set.intersection(*held)))
        return flags

    # ------------------------------------------------------------------ moments
    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        from .._moments import Moments
        C = np.ascontiguousarray(centers, dtype=self.dtype)
        lp = None if log_prior is None else np.ascontiguousarray(log_prior, dtype=np.float64)
        cf = self.put(C)
        total = self.map_tree(ch.chunk_moments, [self._chunks], ch.merge_moments, dict(
            C=cf, T=float(T), metric=self.metric, resp=int(resp), log_prior=lp,
            hard_sums=bool(hard_sums), nthreads=self._nthreads))
        if total is None:
            return Moments.zeros(C.shape[0], self.n_features, T, hard_sums=hard_sums)
        return self.handle.result(total)

    def grad_forward(self, centers, T, resp):
        """The gradient's forward pass, mapped over the chunks and tree-merged."""
        C = np.ascontiguousarray(centers, dtype=np.float64)
        return self.handle.result(self.map_tree(
            ch.chunk_grad_forward, [self._chunks], ch.merge_moments,
            dict(C=self.put(C), T=float(T), gmetric=self.metric, resp=int(resp),
                 nthreads=self._nthreads)))

    def grad_moments(self, centers, T, resp, globals_):
        """The gradient's backward pass, mapped over the chunks and tree-merged."""
        C = np.ascontiguousarray(centers, dtype=np.float64)
        return self.handle.result(self.map_tree(
            ch.chunk_grad_moments, [self._chunks], ch.merge_moments,
            dict(C=self.put(C), T=float(T), gmetric=self.metric, resp=int(resp),
                 g=self.put(globals_), nthreads=self._nthreads)))

    def fingerprint(self):
        """Key of the data for checkpoints: Dask's token of the input collections."""
        # the frame is part of the key: a checkpoint of raw-frame centers is not resumed
        # by shifted chunks (or the reverse)
        return f"dask:{self._token}:{self.metric}" + (":centered" if self.origin is not None
                                                       else "")

    def mean(self):
        tot = self.handle.result(self.map_tree(ch.chunk_weighted_sum, [self._chunks],
                                               ch.add_arrays))
        return tot[:-1] / self.total_weight

    def covariance(self, mean=None):
        """The weighted covariance ``sum w (x - mean)(x - mean)^T / W`` (D x D, float64,
        exact: per-chunk GEMMs, tree-summed). With it the critical temperature needs no
        random start vector, as in memory."""
        if self.n_features > COVARIANCE_MAX_D:
            return None
        mean = self.mean() if mean is None else np.asarray(mean, dtype=np.float64)
        mf = self.put(np.ascontiguousarray(mean))
        tot = self.map_tree(ch.chunk_scatter, [self._chunks], ch.add_arrays, dict(mean=mf))
        if tot is None:
            return np.zeros((self.n_features, self.n_features))
        return self.handle.result(tot) / self.total_weight

    def sample(self, n, rng):
        """``n`` rows drawn without replacement, in row order (all rows, in order, when
        ``n >= n_rows``): the same rows as :class:`~fastanneal._sources.InMemorySource` for
        the same generator state."""
        if n >= self.n_rows:
            parts = self.handle.result(self.client.map(ch.chunk_take, self._chunks,
                                                       idx=None, pure=False))
            return self._concat(parts)
        idx = np.sort(rng.choice(self.n_rows, size=n, replace=False))
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        futs = []
        for c in np.unique(which):
            local = idx[which == c] - self.offsets[c]
            futs.append(self.client.submit(ch.chunk_take, self._chunks[c], local, pure=False))
        return self._concat(self.handle.result(futs))

    def _concat(self, parts):
        if not parts:
            return np.empty((0, self.n_features), self.dtype), np.empty(0)
        return (np.ascontiguousarray(np.concatenate([p[0] for p in parts])),
                np.concatenate([p[1] for p in parts]))

    def objective(self, centers):
        """``(J, hard_counts)`` at ``centers``, each row's distance summed in float64 (one
        pass on the workers, reduced in a tree)."""
        C = np.ascontiguousarray(centers, dtype=np.float64)
        cf = self.put(C)
        r = self.map_tree(ch.chunk_objective, [self._chunks], ch.add_arrays,
                          dict(C=cf, objective_metric=self.metric, nthreads=self._nthreads))
        r = self.handle.result(r) if r is not None else np.zeros(1 + C.shape[0])
        return float(r[0]), np.asarray(r[1:], dtype=np.float64)

    def labels(self, centers):
        """Hard labels of all rows as one NumPy array (gathered: for data that fits)."""
        futs = self._label_futures(centers)
        parts = self.handle.result(futs)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _label_futures(self, centers):
        C = np.ascontiguousarray(centers, dtype=self.dtype)
        cf = self.put(C)
        return self.client.map(ch.chunk_labels, self._chunks, C=cf, metric=self.metric,
                               nthreads=self._nthreads, pure=False)

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False,
                                means=None, tol=None, start=None):
        """``lambda_max`` of each hard cluster's weighted covariance (1/W_k) by power
        iteration, the matvec mapped over the chunks (``cluster_cov_matvec_kernel``); with
        ``return_vectors`` also the unit top eigenvectors ``(lam, V)``."""
        centers = np.asarray(centers, dtype=np.float64)
        K = centers.shape[0]
        if K == 1:
            labs = [None] * len(self._chunks)
        else:
            labs = self._label_futures(centers)
        wk = self.map_tree(ch.chunk_bincount, [self._chunks, labs], ch.add_arrays, dict(K=K))
        wk = self.handle.result(wk) if wk is not None else np.zeros(K)
        mu = _about(centers, means)
        mu_f = self.put(mu)

        def matvec(mu, V):
            vf = self.put(np.ascontiguousarray(V, dtype=np.float64))
            out = self.map_tree(ch.chunk_cov_matvec, [self._chunks, labs], ch.add_arrays,
                                dict(mu=mu_f, V=vf, nthreads=self._nthreads))
            return self.handle.result(out) if out is not None else np.zeros((K, self.n_features))
        return power_iteration_eigs(matvec, mu, wk, n_iter, rng, return_vectors, tol=tol,
                                    start=start)

    def n_distinct_rows(self, rng, cap):
        """Distinct rows with non-zero weight, counted up to ``cap`` (random-projection hash,
        the same draw from ``rng`` as the in-memory check)."""
        v = rng.standard_normal(self.n_features)
        out = self.map_tree(ch.chunk_row_hashes, [self._chunks], ch.union_capped,
                            dict(v=v, cap=int(cap)), dict(cap=int(cap)))
        return 0 if out is None else int(self.handle.result(out).shape[0])

    # ------------------------------------------------------------------ lifetime
    def _release(self):
        chunks, self._chunks = getattr(self, "_chunks", None), []
        self._fused = None
        if chunks:
            try:
                self.client.cancel(chunks)
            except Exception:  # pragma: no cover - client already closed
                pass

    def close(self):
        """Release the persisted chunks and close what this source started (also done when
        the source is garbage-collected, e.g. after a fit that raised)."""
        self._release()
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_dask_source(estimator, X, sample_weight=None):
    """The Dask source of :meth:`AnnealedKMeans.fit`: returns ``(source, None, None)``.

    ``X`` may be a Dask array (row chunks; columns are rechunked to one chunk), a Dask
    DataFrame, a Parquet path or a NumPy array. The cluster is ``estimator.scheduler`` (an
    address or a Client) when set, else the default client, else an embedded LocalCluster
    that ``source.close()`` shuts down. Sets ``estimator.n_features_in_``.
    """
    metric = metric_code(getattr(estimator, "metric", "euclidean"))
    data = as_dask_inputs(X, sample_weight)
    handle = resolve_client(getattr(estimator, "scheduler", None))
    try:
        source = DaskSource(data.X, data.weights, metric, handle)
    except BaseException:
        handle.close()
        raise
    estimator.n_features_in_ = source.n_features
    return source, None, None

"""Mini-batch annealing over Dask: the batch stream that
:class:`fastanneal.MiniBatchAnnealedKMeans` reads (batch moments computed on the workers,
chunks read on demand, a full streaming pass for the polish and the final labels), and the
streaming label writer. The annealing itself (stochastic EM) is the engine's
(:mod:`fastanneal._minibatch`); this module only produces moments and streams labels."""
import os
import shutil
from collections import deque

import numpy as np

from .. import _config
from .._engine import _project
from .._io import clean_stale_temps, temp_folder
from .._moments import Moments
from .._validation import (as_float_matrix, check_range, far_from_origin, float_dtype_of,
                           metric_code, normalize_rows)
from . import _chunks as ch
from ._cluster import resolve_client
from ._inputs import as_dask_inputs, is_dask_collection
from ._source import _Submitter, dask_dtype, row_offsets


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
        self.row_base = int(_config.ROW_BASE.get())  # the first row's number in messages
        self.xd = list(X.to_delayed().ravel())
        nc = len(self.xd)
        self.wd = list(data.weights.to_delayed().ravel()) if data.weights is not None \
            else [None] * nc
        self.idd = list(data.ids.to_delayed().ravel()) if data.ids is not None else [None] * nc
        self.weights = data.weights
        self.nthreads = handle.task_threads()
        self.n_threads_total = handle.n_worker_threads()
        #: rows are measured from this point when set (:meth:`set_origin`)
        self.origin = None

    def set_origin(self, origin):
        """Measure every chunk read from now on from ``origin`` (None: from 0): the frame of
        a fit whose rows lie far from the origin (``docs/theory.md``)."""
        self.origin = None if origin is None else np.asarray(origin, dtype=np.float64)

    @property
    def n_chunks(self):
        return len(self.xd)

    def prepared(self, i):
        import dask
        t = dask.delayed(ch.prepare_chunk, pure=True)(
            self.xd[i], self.wd[i], i, int(self.offsets[i]), self.metric, self.dtype,
            origin=self.origin, row_base=self.row_base,
            expect=(self.chunk_rows[i], self.n_features))
        return self.client.compute(t)

    def total_weight(self):
        """The weights' sum, read chunk by chunk through the same delayed objects as every
        pass (a whole-array reduction would put a second, differently optimized task under
        the same keys into the scheduler: "different run_spec" warnings). Bad weights are
        named by their row."""
        if self.weights is None:
            return float(self.n_rows)
        import dask
        parts = self.handle.result(self.client.compute(
            [dask.delayed(ch.weight_stats, pure=True)(w, i, int(self.offsets[i]) + self.row_base)
             for i, w in enumerate(self.wd)]))
        ch.raise_bad_weights(parts, self.dtype)
        with np.errstate(over="ignore"):
            return float(sum(p["sum"] for p in parts))

    def map_chunks(self, fn, indices, window, per_chunk=None, combine=None, with_ids=False,
                   **kwargs):
        """Run ``fn(x, w, ids, index, row0, metric, dtype, **kwargs, **per_chunk(i))`` -- one
        task that reads, validates and reduces a chunk, so nothing stays in memory -- over
        the chunks ``indices`` with at most ``window`` of them in flight. With ``combine``,
        folds the results in the order of ``indices`` (deterministic) and returns the total
        (None for no chunks); else returns the list of results."""
        import dask
        indices = list(indices)
        if self.origin is not None:
            kwargs = dict(kwargs, origin=self.origin)
        pending = deque(enumerate(indices))
        inflight = {}
        done = {}
        failed = {}                     # position -> the erred future (kept to raise it)
        total = None
        results = []
        nxt = 0
        try:
            while pending or inflight:
                if failed:
                    # a chunk erred: submit nothing after it, and raise the error of the
                    # first erred chunk in order once every chunk before it is done (the
                    # same message whichever task failed first in time)
                    first = min(failed)
                    if all(j > first for j in inflight.values()):
                        failed[first].result()
                    pending = deque(p for p in pending if p[0] < first)
                while pending and len(inflight) < window:
                    j, i = pending.popleft()
                    extra = dict(per_chunk(i) if per_chunk is not None else {},
                                 expect=(self.chunk_rows[i], self.n_features),
                                 row_base=self.row_base)
                    t = dask.delayed(fn, pure=False)(
                        self.xd[i], self.wd[i], self.idd[i] if with_ids else None, i,
                        int(self.offsets[i]), self.metric, self.dtype, **kwargs, **extra)
                    inflight[self.client.compute(t)] = j
                res = self.handle.wait(list(inflight), return_when="FIRST_COMPLETED")
                for f in res.done:
                    j = inflight.pop(f)
                    if f.status == "error":
                        failed[j] = f
                        continue
                    done[j] = f.result()
                    f.release()
                while nxt in done:
                    part = done.pop(nxt)
                    if combine is None:
                        results.append(part)
                    else:
                        total = part if total is None else combine(total, part)
                    nxt += 1
            if failed:
                failed[min(failed)].result()            # raises the first chunk's error
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




class DaskBatchStream(_ChunkPlan, ch.StreamedPasses):
    """The out-of-core data of a mini-batch fit: batches of chunks whose moments are
    computed on the workers (read ahead by ``prefetch`` batches), full streaming passes
    (``moments``: the polish), a sample from random chunks (seeding) and the final pass
    that writes labels. Closes the cluster it started."""

    def __init__(self, data, metric, handle, prefetch=1):
        super().__init__(data, metric, handle)
        self._handle = handle
        self.has_ids = data.ids is not None
        self.prefetch_depth = int(prefetch)
        self._queue = {}
        self._W = None
        self._data_token = None
        try:
            import dask.base
            self._data_token = dask.base.tokenize(data.X, data.weights)
        except Exception:  # pragma: no cover - untokenizable input
            self._data_token = None

    @property
    def total_weight(self):
        if self._W is None:
            self._W = super().total_weight()
        return self._W

    def fingerprint(self):
        if self._data_token is None:
            raise ValueError("this input cannot be fingerprinted for a checkpoint")
        return f"dask:{self._data_token}:{self.metric}:{self.n_rows}"

    def prefetch(self, batches):
        for ids in batches:
            key = tuple(ids)
            if key not in self._queue:
                self._queue[key] = [self.prepared(i) for i in ids]

    def batch_moments(self, ids, C, T, resp, log_prior):
        futs = self._queue.pop(tuple(ids), None) or [self.prepared(i) for i in ids]
        cf = self.put(np.ascontiguousarray(C, dtype=self.dtype))
        parts = self.client.map(ch.chunk_moments, futs, C=cf, T=T, metric=self.metric,
                                resp=resp, log_prior=log_prior, hard_sums=False,
                                nthreads=self.nthreads, pure=False)
        return self.handle.result(self.tree(parts, ch.merge_moments))

    @property
    def window(self):
        return max(2, 2 * self.n_threads_total)

    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        """A full streaming pass (chunks read, reduced and dropped on the workers)."""
        cf = self.put(np.ascontiguousarray(centers, dtype=self.dtype))
        m = self.stream(ch.stream_chunk, self.window, C=cf, T=float(T), resp=int(resp),
                        log_prior=log_prior, hard_sums=bool(hard_sums), nthreads=self.nthreads,
                        keep_S=True)
        if m is None:
            return Moments.zeros(np.shape(centers)[0], self.n_features, T, hard_sums=hard_sums)
        return m

    def sample(self, n_target, rng, min_chunks=8):
        """About ``n_target`` random rows from at least ``min_chunks`` random chunks (data
        stored in cluster order would bias a sample of one chunk); each chunk is read and
        subsampled on a worker, so only the sample travels."""
        from .._minibatch import sample_plan
        take = sample_plan(self.chunk_rows, n_target, rng, min_chunks)
        picked = sorted(take)
        parts = self.map_chunks(ch.sample_chunk, picked, self.window,
                                per_chunk=lambda i: {"idx": take[i]})
        Xs = np.concatenate([p[0] for p in parts])
        ws = np.concatenate([p[1] for p in parts])
        if Xs.shape[0] > n_target:
            idx = np.sort(rng.choice(Xs.shape[0], size=n_target, replace=False))
            Xs, ws = Xs[idx], ws[idx]
        return np.ascontiguousarray(Xs), ws

    # ------------------------------------------------ the rest of the protocol, streamed
    def _reduce(self, work, combine=None, **kwargs):
        return self.map_chunks(ch.on_prepared, range(self.n_chunks), self.window,
                               combine=combine or (lambda a, b: a + b), work=work, **kwargs)

    def final_pass(self, C, T, resp, log_prior, labels_path=None, overwrite=False,
                   with_ids=False, margin_every=None):
        """``(moments, labels folder, None)``: the margins for ``probability_temperature_``
        come from a sample of the persisted chunks after the pass (``margin_every`` is not
        used: the sample is drawn on the workers, as cheaply)."""
        m, folder = _final_pass(self, C, T, resp, log_prior, self.window, labels_path,
                                overwrite, with_ids=with_ids)
        return m, folder, None

    def close(self):
        for futs in self._queue.values():
            for f in futs:
                f.cancel()
        self._queue.clear()
        self._handle.close()


def open_batch_stream(X, sample_weight=None, ids=None, metric=0, scheduler=None, prefetch=1):
    """The :class:`DaskBatchStream` of ``X`` (a Dask array / DataFrame, Parquet path,
    :class:`EmbeddingArrays`) on the cluster ``scheduler`` (an address, a Client, the default
    client or an embedded LocalCluster)."""
    data = as_dask_inputs(X, sample_weight, ids)
    handle = resolve_client(scheduler)
    try:
        return DaskBatchStream(data, metric, handle, prefetch)
    except BaseException:
        handle.close()
        raise


class _AtomicFolder:
    """A temporary folder next to ``path``, renamed to ``path`` on :meth:`commit` (removed on
    :meth:`abort`): readers never see a partial result."""

    def __init__(self, path, overwrite=False):
        self.path = os.path.abspath(os.fspath(path))
        clean_stale_temps(self.path)       # first: it may put back a dead run's moved-aside output
        if os.path.exists(self.path) and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it")
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        # ``.<name>.<host>-<pid>.<random>.tmpdir``: a later run removes it if this one dies
        self.tmp = str(temp_folder(self.path))
        self.overwrite = overwrite

    def commit(self):
        old = None
        if os.path.exists(self.path):
            if not self.overwrite:
                raise FileExistsError(f"{self.path} appeared during the fit")
            old = self.tmp[:-len(".tmpdir")] + "-old.tmpdir"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        if old is not None:
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old, ignore_errors=True)
            else:                       # a file (or link) replaced by the labels folder
                os.remove(old)
        return self.path

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def _final_pass(plan, C, T, resp, log_prior, window, labels_path=None, overwrite=False,
                with_ids=False):
    folder = _AtomicFolder(labels_path, overwrite) if labels_path is not None else None
    try:
        cf = plan.put(np.ascontiguousarray(C, dtype=plan.dtype))
        c64 = plan.put(np.ascontiguousarray(C, dtype=np.float64))
        m = plan.stream(ch.stream_chunk, window, out_dir=folder.tmp if folder else None,
                        with_ids=with_ids, C=cf, T=float(T), resp=int(resp),
                        log_prior=log_prior, hard_sums=False, nthreads=plan.nthreads,
                        C_exact=c64)
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
    from ..estimator import _check_labels_path
    _check_labels_path(path, X, "path")   # never over (or inside) the files it reads
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
        origin = _centers_origin(C, mc, plan.dtype)
        if origin is not None:                  # far from the origin: labels by rounding
            plan.set_origin(origin)             # otherwise (docs/theory.md)
            C = C - origin
        window = window or max(2, 2 * plan.n_threads_total)
        m, out = _final_pass(plan, C, 1.0, 2, None, window, path, overwrite,
                             with_ids=data.ids is not None)
    finally:
        handle.close()
    rows = 0 if m is None else m.rows
    return {"path": out, "rows": rows, "inertia": 0.0 if m is None else m.hard_distortion,
            "counts": np.zeros(C.shape[0]) if m is None else m.hard_counts}


def _prepared_block(x, metric, origin, block_info):
    """One block of rows validated like a fitted chunk (the errors name its global rows),
    measured from ``origin`` when given: a :class:`~fastanneal.dask._chunks.Chunk`."""
    row0, index, expect = 0, 0, None
    if block_info is not None and 0 in block_info:
        loc = block_info[0]["array-location"]
        row0, index = int(loc[0][0]), int(block_info[0]["chunk-location"][0])
        expect = (loc[0][1] - loc[0][0], loc[1][1] - loc[1][0])
    x = np.asarray(x)
    dtype = float_dtype_of(x.dtype)
    return ch.prepare_chunk(x, None, index, row0, metric, dtype, origin=origin,
                            expect=expect)


def _rows_block(x, C, metric, origin, fn, block_info=None):
    """``fn(rows, C)`` of one validated block (an (m, K) result per block of rows)."""
    chunk = _prepared_block(x, metric, origin, block_info)
    return fn(chunk.X, C)


def _row_chunked(X, C):
    """The Dask input ``X`` as a 2-D Dask array of ``C``'s features in one column chunk."""
    X = as_dask_inputs(X).X
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_features); got {X.ndim} dimensions")
    if X.shape[1] != C.shape[1]:
        raise ValueError(f"X has {X.shape[1]} features but the centers have {C.shape[1]}")
    return X.rechunk({1: -1}) if len(X.chunks[1]) != 1 else X


def map_rows(X, C, metric, origin, fn, dtype, cols=None):
    """``fn(rows, C)`` -> (m, cols) (default cols = K) for every row block of the Dask
    array ``X``: a lazy (n, cols) Dask array (one task per row chunk; the rows validated
    like a fit's)."""
    X = _row_chunked(X, C)
    return X.map_blocks(_rows_block, C, metric_code(metric), origin, fn,
                        chunks=(X.chunks[0], (C.shape[0] if cols is None else cols,)),
                        dtype=dtype)


def _predict_block(x, C, metric, origin=None, block_info=None):
    """Labels of one block (validated like a fitted chunk: the errors name its global rows;
    measured from ``origin`` when given)."""
    from .._moments import assign
    chunk = _prepared_block(x, metric, origin, block_info)
    if chunk.rows == 0:
        return np.zeros(0, dtype=np.int64)
    return assign(chunk.X, C, metric, _prepared=True)[0]


def _centers_origin(C, mc, dtype):
    """A point to measure rows from when Euclidean ``centers`` lie far from the origin
    compared with their spread (the rows they label then do too: ``docs/theory.md``, "Rows
    far from the origin"); None otherwise."""
    if mc != 0 or C.shape[0] == 0:
        return None
    mean = C.mean(axis=0)
    msq = float(np.mean(np.einsum("ij,ij->i", C, C)))
    return mean if far_from_origin(mean, msq, dtype) else None


def predict_labels(X, centers, metric="euclidean", origin=None):
    """Nearest-center labels of ``X``: NumPy in, NumPy out; Dask array / DataFrame in, lazy
    Dask array out (one task per row chunk). Rows are validated like a fit's (NaN, shape,
    zero rows for cosine; errors name the global row); cosine centers are unit-normalised.
    ``origin``: the rows are measured from it and ``centers`` are given measured from it
    too (the frame of a fit of rows far from the origin). Without it, Euclidean centers
    far from the origin compared with their spread are measured (with the rows) from
    their mean, so that rounding does not decide the labels."""
    mc = metric_code(metric)
    C = as_float_matrix(centers, "centers", dtype=np.float64, allow_empty=False)
    if mc == 1:
        C = _project(C, 1)
    if origin is not None:
        origin = np.asarray(origin, dtype=np.float64)
    else:
        dt = getattr(X, "dtype", np.float64)
        origin = _centers_origin(C, mc, float_dtype_of(dt))
        if origin is not None:
            C = C - origin
    if is_dask_collection(X):
        return _row_chunked(X, C).map_blocks(_predict_block, C, mc, origin, drop_axis=1,
                                             dtype=np.int64)
    X = as_float_matrix(X, "X", finite=False)
    if X.shape[1] != C.shape[1]:
        raise ValueError(f"X has {X.shape[1]} features but the centers have {C.shape[1]}")
    return _predict_block(X, C, mc, origin)

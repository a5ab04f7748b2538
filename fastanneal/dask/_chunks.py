"""Worker-side functions of the Dask backend. Each runs on one chunk of rows (or merges the
results of chunks) and calls the same Numba kernels as the in-memory source."""
import os
from dataclasses import dataclass

import numba
import numpy as np

from .. import _kernels as K_
from .._moments import assign, compute_moments
from .._validation import (_SQ_MAX, _SQ_MIN, check_normal_weights, check_range,
                           check_weight_range, normalize_rows, row_sqnorms, rows_mean,
                           shifted_rows)


@dataclass
class Chunk:
    """A validated chunk: C-contiguous float32/float64 rows (unit rows for cosine), float64
    weights, its index and the global number of its first row."""
    X: np.ndarray
    w: np.ndarray
    index: int
    row0: int

    @property
    def rows(self):
        return self.X.shape[0]

    def where(self):
        n = self.rows
        return (f"chunk {self.index} (rows {self.row0}-{self.row0 + n - 1})" if n
                else f"chunk {self.index} (no rows)")


def _sizeof_chunk(chunk):
    """Dask's size of a persisted chunk: its arrays. Without it Dask took ``sys.getsizeof``
    of the dataclass, 56 bytes for a megabyte of rows: the dashboard and the memory
    accounting missed the data, and the scheduler moved chunks freely (work stealing
    judged them free to transfer), splitting the groups that a pass fuses (8-11 % of the
    data moved on every pass)."""
    return int(chunk.X.nbytes) + int(np.asarray(chunk.w).nbytes) + 100


try:        # (registered where this module is imported: on the workers too)
    from dask.sizeof import sizeof as _dask_sizeof
    _dask_sizeof.register(Chunk)(_sizeof_chunk)
except ImportError:  # pragma: no cover - dask is a dependency
    pass


def weight_stats(w, index, row0):
    """``{"sum": float, "NaN" / "infinity" / "negative values": (count, first row) or
    None}`` of one chunk of weights (rows counted from ``row0``)."""
    w = np.asarray(w, dtype=np.float64).ravel()
    out = {}
    for what, bad in zip(WEIGHT_FAULTS, (np.isnan(w), np.isinf(w), w < 0)):
        idx = np.flatnonzero(bad)
        out[what] = (int(idx.size), row0 + int(idx[0])) if idx.size else None
    with np.errstate(over="ignore", invalid="ignore"):
        out["sum"] = float(w.sum())
        out["max"] = float(np.nanmax(w)) if w.size and not np.isnan(w).all() else 0.0
    return out


WEIGHT_FAULTS = ("NaN", "infinity", "negative values")


def raise_bad_weights(stats, dtype=None):
    """The ``ValueError`` for the first fault found in :func:`weight_stats` records (one
    chunk's, or several chunks' in row order), naming how many rows and the first; with
    float32 rows (``dtype``) also a largest weight they cannot carry."""
    for what in WEIGHT_FAULTS:
        bad = [s[what] for s in stats if s[what] is not None]
        if bad:
            raise ValueError(f"sample_weight contains {what} ({sum(b[0] for b in bad)} rows; "
                             f"the first is row {bad[0][1]})")
    if dtype is not None and stats:
        check_weight_range(max(s.get("max", 0.0) for s in stats), dtype)


def checked_weights(w, block_info=None):
    """One block of a Dask array of weights as float64, refused (:func:`raise_bad_weights`)
    when it holds a NaN, an infinity or a negative weight (for ``map_blocks``)."""
    row0 = block_info[0]["array-location"][0][0] if block_info and 0 in block_info else 0
    raise_bad_weights([weight_stats(w, 0, row0)])
    return np.asarray(w, dtype=np.float64)


def set_threads(nthreads):
    """Numba threads for the kernels this worker thread runs next."""
    n = numba.config.NUMBA_NUM_THREADS
    if nthreads:
        n = max(1, min(int(nthreads), n))
    numba.set_num_threads(n)
    return n


class NonFiniteRows(ValueError):
    """A chunk's rows hold NaN or infinity, or (cosine) an all-zero row: ``kind`` ("NaN" /
    "infinity" / "an all-zero vector") and the first such ``row`` (numbered as the message numbers it), for callers that name the row in
    their own terms (the command: its file and column). Pickles (Dask ships it back)."""

    def __init__(self, message, kind, row):
        super().__init__(message, kind, row)
        self.kind, self.row = kind, row

    def __str__(self):
        return str(self.args[0])


def prepare_chunk(x, w, index, row0, metric, dtype, name="X", origin=None, row_base=0,
                  expect=None):
    """Validate one chunk (finite, non-negative weights, non-zero rows for cosine; with
    ``expect``, the ``(rows, features)`` the collection declares for it, NaN for unknown)
    and return a :class:`Chunk` (its rows measured from ``origin`` when given: rows far from
    the origin, ``docs/theory.md``). Errors name the chunk and its global row range, rows
    counted from ``row_base`` (0; the command line counts from 1)."""
    x = np.asarray(x)
    if x.dtype == object or not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise ValueError(f"{name} has dtype {x.dtype}; expected real numbers")
    if x.ndim != 2:
        raise ValueError(f"{name} chunk {index} must be 2-D; got shape {x.shape}")
    if expect is not None:
        for got, want, what in zip(x.shape, expect, ("rows", "columns")):
            if want == want and got != want:            # (NaN: not declared)
                raise ValueError(
                    f"{name} chunk {index} holds {got} {what}, but the array declares "
                    f"{int(want)} for it (its data changed since the collection was made, "
                    "or a from_delayed / map_blocks shape is wrong): rows would be lost or "
                    "misnumbered")
    x = np.ascontiguousarray(x, dtype=dtype)
    n = x.shape[0]
    r0 = row0 + int(row_base)               # (the first row's number in messages)
    where = (f"chunk {index} (rows {r0}-{r0 + n - 1})" if n
             else f"chunk {index} (no rows)")
    # one parallel pass of squared row norms for every check (a NaN or inf makes its row's
    # norm non-finite; the largest bounds the range); five NumPy passes over the chunk
    # before (isfinite, two norms, max, min: ~8 % of an out-of-core cosine fit)
    sq = row_sqnorms(x) if n else np.zeros(0)
    if n and not np.isfinite(sq).all() and not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        kind = "NaN" if np.isnan(x[tuple(bad)]) else "infinity"
        raise NonFiniteRows(f"{name} contains {kind} in {where}; first at row "
                            f"{r0 + int(bad[0])}, column {int(bad[1])}", kind,
                            r0 + int(bad[0]))
    if w is None:
        w = np.ones(n, dtype=np.float64)
    else:
        w = np.asarray(w, dtype=np.float64).reshape(-1)
        if w.shape[0] != n:
            raise ValueError(f"sample_weight of {where} has {w.shape[0]} entries for {n} rows")
        if not np.isfinite(w).all():
            i = int(np.argwhere(~np.isfinite(w))[0, 0])
            raise ValueError(f"sample_weight contains NaN or infinity in {where}; first at row "
                             f"{r0 + i}")
        if (w < 0).any():
            i = int(np.argwhere(w < 0)[0, 0])
            raise ValueError(f"sample_weight contains negative weights in {where}; first at "
                             f"row {r0 + i}")
        check_normal_weights(w, where=f" ({where})", row0=r0)
        w = np.ascontiguousarray(w)
    if metric == 1 and n:
        if (sq == 0).any():
            i = int(np.argwhere(sq == 0)[0, 0])
            raise NonFiniteRows(f"{name} has an all-zero row in {where} (row {r0 + i}); the "
                                "cosine metric needs non-zero vectors", "an all-zero vector",
                                r0 + i)
        x = normalize_rows(x, name, sqnorms=sq)     # unit rows: in range by construction
    elif n and not _SQ_MIN[x.dtype] <= float(sq.max()) <= _SQ_MAX[x.dtype]:
        check_range(x, name, where)                 # (it names the problem, or passes)
    if origin is not None:
        x = shifted_rows(x, origin)
    return Chunk(x, w, int(index), int(row0))


def shift_chunk(chunk, origin):
    """The chunk with its rows measured from ``origin``."""
    return Chunk(shifted_rows(chunk.X, origin), chunk.w, chunk.index, chunk.row0)


# ------------------------------------------------------------------------- per-chunk work
def chunk_stats(chunk):
    """``(rows, weight, sum w x, sum w |x|^2)`` of a chunk (float64 sums; no float64 copy of
    the rows: the same block GEMVs and squared-norm pass as ``centered_rows``). Float32
    rows with a largest weight they cannot carry are refused first."""
    check_weight_range(chunk.w, chunk.X.dtype)
    W = float(chunk.w.sum())
    if chunk.rows == 0 or not W > 0:
        return chunk.rows, W, np.zeros(chunk.X.shape[1]), 0.0
    return (chunk.rows, W, rows_mean(chunk.X, chunk.w) * W,
            float(chunk.w @ row_sqnorms(chunk.X)))


def chunk_moments(chunk, C, T, metric, resp, log_prior, hard_sums, nthreads):
    set_threads(nthreads)
    return compute_moments(chunk.X, chunk.w, C, T, metric, resp, log_prior, hard_sums)


def chunk_grad_forward(chunk, C, T, gmetric, resp, nthreads):
    """The gradient's forward sums of a chunk (:class:`fastanneal.gradient.GradForward`)."""
    from ..gradient import forward_moments
    set_threads(nthreads)
    return forward_moments(chunk.X, chunk.w, C, T, gmetric, resp)


def chunk_grad_moments(chunk, C, T, gmetric, resp, g, nthreads):
    """The gradient's backward sums of a chunk (:class:`fastanneal.gradient.GradMoments`)."""
    from ..gradient import backward_moments
    set_threads(nthreads)
    return backward_moments(chunk.X, chunk.w, C, T, gmetric, resp, g)


def merge_moments(*parts):
    """Sum of Moments (or GradMoments) records in the given order (deterministic)."""
    out = parts[0]
    for p in parts[1:]:
        out = out.merge(p)
    return out


def map_merge(func, merge, seqs, map_kw, merge_kw):
    """``merge(*[func(*args, **map_kw) for args in zip(*seqs)], **merge_kw)``: one group of
    the first level of a tree reduction in ONE task (``DaskSource.map_tree``). The same
    calls in the same order as one task per chunk followed by the group's merge task, so
    the result is bit-identical; the scheduler handles one task instead of nine."""
    return merge(*[func(*args, **map_kw) for args in zip(*seqs)], **merge_kw)


def add_arrays(*parts):
    out = np.array(parts[0], dtype=np.float64, copy=True)
    for p in parts[1:]:
        out += p
    return out


def chunk_weighted_sum(chunk):
    """``(sum_i w_i x_i, sum_i w_i)`` as one float64 vector of length D + 1."""
    out = np.empty(chunk.X.shape[1] + 1)
    out[:-1] = chunk.w @ chunk.X.astype(np.float64, copy=False)
    out[-1] = chunk.w.sum()
    return out


def chunk_scatter(chunk, mean, block=16384):
    """``sum_i w_i (x_i - mean)(x_i - mean)^T`` over the chunk (D x D, float64, as the
    estimator's in-memory covariance)."""
    from .._sources import scatter_matrix
    return scatter_matrix(chunk.X, chunk.w, mean, block)


def chunk_labels(chunk, C, metric, nthreads):
    """Hard labels of the chunk's rows (int64)."""
    set_threads(nthreads)
    if chunk.rows == 0:
        return np.zeros(0, dtype=np.int64)
    return assign(chunk.X, C, metric, _prepared=True)[0]


def exact_final_labels(chunk, C, metric, nthreads, m):
    """The chunk's hard labels, with ``m.hard_distortion`` (its moments at the same
    centers) replaced by the exact ``J`` of those labels: each row's distance to the nearer
    of its two nearest centers summed in float64 (``inertia_`` as ``score`` computes it;
    the moments pass's GEMM-form float32 distances keep ~1e-7 |x|^2 a row, which heavy
    weights multiply). One labelling pass: where the labels are wanted anyway, the exact
    ``J`` costs only the O(n D) sums."""
    set_threads(nthreads)
    if chunk.rows == 0:
        return np.zeros(0, dtype=np.int64)
    from .._moments import nearest_distances
    labels, d = nearest_distances(chunk.X, C, metric)
    m.hard_distortion = float(np.asarray(chunk.w, dtype=np.float64) @ d)
    return labels


def chunk_objective(chunk, C, objective_metric, nthreads):
    """``(J, hard_counts)`` of the chunk's rows: ``sum w_i min_k d(x_i, c_k)`` with each
    distance summed in float64 (``inertia_`` as ``score`` computes it) and the weight
    nearest to each center (:func:`~fastanneal._moments.nearest_objective_counts`)."""
    set_threads(nthreads)
    if chunk.rows == 0:
        return np.zeros(1 + C.shape[0])
    from .._moments import nearest_objective_counts
    _, J, counts = nearest_objective_counts(chunk.X, chunk.w, C, objective_metric)
    return np.concatenate([[J], counts])    # (one array: chunks add up)


def chunk_bincount(chunk, labels, K):
    if labels is None:
        return np.array([chunk.w.sum()] + [0.0] * (K - 1))
    return np.bincount(labels, weights=chunk.w, minlength=K).astype(np.float64)


def chunk_cov_matvec(chunk, labels, mu, V, nthreads):
    """``sum_{i in k} w_i (x_i - mu_k)((x_i - mu_k) . v_k)`` over the chunk (K x D)."""
    nth = set_threads(nthreads)
    if chunk.rows == 0:
        return np.zeros(mu.shape)
    if labels is None:
        labels = np.zeros(chunk.rows, dtype=np.int64)
    return K_.cluster_cov_matvec_kernel(chunk.X, chunk.w, labels, mu, V, nth)


def on_prepared(x, w, ids, index, row0, metric, dtype, work, origin=None, expect=None,
                row_base=0, **kwargs):
    """Read, validate and prepare one chunk on the worker, then ``work(chunk, **kwargs)``
    (the streaming passes of :class:`~fastanneal.dask.DaskBatchStream`)."""
    return work(prepare_chunk(x, w, index, row0, metric, dtype, origin=origin, expect=expect,
                              row_base=row_base), **kwargs)


def chunk_cov_matvec_at(chunk, C, label_metric, mu, V, nthreads):
    """``(matvec, weights)`` of the clusters of the hard partition induced by ``C`` (labels
    computed in the task: the streaming form of :func:`chunk_cov_matvec`)."""
    K = C.shape[0]
    labels = None if K == 1 else chunk_labels(chunk, C, label_metric, nthreads)
    return chunk_cov_matvec(chunk, labels, mu, V, nthreads), chunk_bincount(chunk, labels, K)


def chunk_take(chunk, idx):
    """Rows ``idx`` (local indices) and their weights."""
    if idx is None:
        return chunk.X, chunk.w
    return chunk.X[idx], chunk.w[idx]


def chunk_row_hashes(chunk, v, cap):
    """Distinct exact hashes of the rows with non-zero weight (at most ``cap``; see
    :func:`fastanneal._sources.row_hashes`)."""
    from .._sources import row_hashes
    return np.unique(row_hashes(chunk.X[chunk.w > 0], v))[:cap]


def union_capped(*parts, cap):
    return np.unique(np.concatenate(parts))[:cap]


# ------------------------------------------------------------------------- streaming passes
def stream_chunk(x, w, ids, index, row0, metric, dtype, C, T, resp, log_prior, hard_sums,
                 nthreads, out_dir=None, with_labels=False, name="X", keep_S=False,
                 origin=None, expect=None, row_base=0, C_exact=None):
    """Read, validate and reduce one chunk in a streaming pass (nothing stays in memory).

    Returns the chunk's Moments (``S`` dropped unless ``hard_sums`` or ``keep_S``: the final
    pass only needs the scalars and hard counts). With ``out_dir``, writes ``part-{index:06d}.parquet`` with the
    columns ``row`` (global row number), ``id`` (when ids are given) and ``label``; with
    labels the moments' ``hard_distortion`` is the exact ``J`` of those labels
    (:func:`exact_final_labels`, at ``C_exact``, the float64 centers, when given: ``C`` is
    in the rows' dtype). Without labels it stays the pass's GEMM form (a labelling pass
    costs 40-80 % of a moments pass: not spent for the objective alone).
    """
    chunk = prepare_chunk(x, w, index, row0, metric, dtype, name, origin, row_base,
                          expect=expect)
    m = chunk_moments(chunk, C, T, metric, resp, log_prior, hard_sums, nthreads)
    if not (hard_sums or keep_S):
        m.S = m.S[:, :0].copy()
    if out_dir is not None or with_labels:
        labels = exact_final_labels(chunk, C if C_exact is None else C_exact, metric,
                                    nthreads, m)
    if out_dir is not None:
        write_label_part(out_dir, index, row0, labels, ids)
    if with_labels:
        return m, labels
    return m


def sample_chunk(x, w, ids, index, row0, metric, dtype, idx, name="X", origin=None,
                 expect=None, row_base=0):
    """Rows ``idx`` (local, validated) of one chunk read on the worker."""
    chunk = prepare_chunk(x, w, index, row0, metric, dtype, name, origin, row_base,
                          expect=expect)
    return chunk_take(chunk, idx)


def write_label_part(out_dir, index, row0, labels, ids=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = labels.shape[0]
    cols = {"row": pa.array(np.arange(row0, row0 + n, dtype=np.int64))}
    if ids is not None:
        if not isinstance(ids, (pa.Array, pa.ChunkedArray)):    # (Arrow: kept as typed)
            ids = pa.array(np.asarray(ids))
        if len(ids) != n:
            raise ValueError(f"ids of chunk {index} have {len(ids)} entries for {n} rows")
        cols["id"] = ids
    cols["label"] = pa.array(labels.astype(np.int32, copy=False))
    path = os.path.join(out_dir, f"part-{index:06d}.parquet")
    tmp = path + ".inprogress"
    pq.write_table(pa.table(cols), tmp)
    os.replace(tmp, path)
    return n


# ------------------------------------------------------------------------- whole-data folds
class StreamedPasses:
    """The whole-data reductions of the moment-source protocol (mean, covariance, gradient
    sums, cluster eigenvalues, distinct rows) as folds of the per-chunk functions above over
    ``self._reduce(work, combine=None, **kwargs)``: one streaming pass each. Shared by the
    Dask batch stream (chunks on the workers) and the in-process Parquet stream (row groups
    read ahead); needs ``n_features``, ``metric``, ``total_weight`` and ``nthreads``."""

    def mean(self):
        return self._reduce(chunk_weighted_sum)[:-1] / self.total_weight

    def objective(self, centers):
        """``(J, hard_counts)`` at ``centers``, each row's distance summed in float64 (one
        streaming pass)."""
        C = np.asarray(centers, np.float64)
        r = self._reduce(chunk_objective, C=C, objective_metric=self.metric,
                         nthreads=self.nthreads)
        r = np.zeros(1 + C.shape[0]) if r is None else r
        return float(r[0]), r[1:]

    def covariance(self, mean):
        from .._sources import COVARIANCE_MAX_D
        if self.n_features > COVARIANCE_MAX_D:
            return None
        return self._reduce(chunk_scatter, mean=np.asarray(mean, np.float64)) \
            / self.total_weight

    def grad_forward(self, centers, T, resp):
        return self._reduce(chunk_grad_forward, combine=lambda a, b: a.merge(b),
                            C=np.asarray(centers, np.float64), T=float(T), gmetric=self.metric,
                            resp=int(resp), nthreads=self.nthreads)

    def grad_moments(self, centers, T, resp, globals_):
        return self._reduce(chunk_grad_moments, combine=lambda a, b: a.merge(b),
                            C=np.asarray(centers, np.float64), T=float(T), gmetric=self.metric,
                            resp=int(resp), g=globals_, nthreads=self.nthreads)

    def cluster_top_eigenvalues(self, centers, n_iter, rng, return_vectors=False,
                                means=None, tol=None, start=None):
        """Lanczos with one streaming pass per matvec (out of core: each pass reads the
        data; the mini-batch fit only needs it for ``schedule="critical"``)."""
        from .._sources import _about, power_iteration_eigs
        C = np.asarray(centers, dtype=np.float64)
        wk = []

        def matvec(mu, V):
            mv, counts = self._reduce(
                chunk_cov_matvec_at, combine=lambda a, b: (a[0] + b[0], a[1] + b[1]),
                C=C, label_metric=self.metric, mu=mu, V=np.ascontiguousarray(V),
                nthreads=self.nthreads)
            wk[:] = [counts]
            return mv
        matvec(C, np.zeros_like(C))
        return power_iteration_eigs(matvec, _about(C, means), wk[0], n_iter, rng,
                                    return_vectors, tol=tol, start=start)

    def n_distinct_rows(self, rng, cap):
        v = rng.standard_normal(self.n_features)
        h = self._reduce(chunk_row_hashes, combine=lambda a, b: union_capped(
            a, b, cap=int(cap)), v=v, cap=int(cap))
        return 0 if h is None else int(h.shape[0])

    def labels(self, centers):
        return None            # out of core: labels are streamed by final_pass

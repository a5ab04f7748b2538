"""The out-of-core route of ``fastanneal cluster``, one row group at a time: checks,
labelling and writing, in this process or on Dask workers (``--backend dask``).

Each step is one task per row group (:class:`fastanneal._cli_stream.LogPiece`), which reads
the row group itself; the same functions run in a loop in this process, or as Dask tasks
on the workers, where the client then holds the log's metadata, the centers and merged
per-cluster summaries -- never an array with a row per row of the log:

1. **Checks** (:func:`check_log`): the weight and id columns of the row group, with the
   in-memory route's one-line errors (row numbers of the whole log); each task returns its
   live-row count, its weight and the 64-bit keys of its ids (the integer value itself, or
   FNV-1a of the bytes). The keys are merged and searched for repeats (on the workers: a
   fixed tree of sorted merges); only repeated keys come back, and the ids behind them are
   then compared exactly, so a hash collision never rejects a log.
2. The mini-batch fit (:func:`fastanneal._cli_stream.fit_stream`).
3. **Labelling** (:func:`label_log`): cluster, probability, margin and runner-up of every
   row (24 bytes a row, kept by the process that computed them); the row groups' cluster
   summaries (:meth:`fastanneal._cli_results.ClusterSummary.merge`) and, with a truth
   column, their contingency counts are merged (on the workers) and only the total is
   returned.
4. **Writing** (:func:`write_log`): the input columns but the dropped ones, plus the result
   columns with the clusters numbered largest first, row group by row group. On Dask every
   worker writes its row groups' output rows as a Parquet part file into a temporary
   folder next to the output; this process copies the parts into the output in row order,
   one block at a time, and removes them. The workers must therefore see the output's
   folder (a shared filesystem, as they already see the input).
"""
import copy
import os
import shutil
from collections import Counter
from pathlib import Path

import numba
import numpy as np

from ._io import InputError, check_ids, temp_folder, text_list, weight_vector

__all__ = ["check_log", "label_log", "write_log", "id_keys"]

#: Result columns, in output order.
RESULT_COLUMNS = ("cluster", "probability", "margin", "runner_up")


# =========================================================================== ids as keys
@numba.njit(cache=True, nogil=True)
def _fnv1a(offsets, data, out):
    for i in range(out.shape[0]):
        h = np.uint64(0xCBF29CE484222325)
        for j in range(offsets[i], offsets[i + 1]):
            h = (h ^ np.uint64(data[j])) * np.uint64(0x100000001B3)
        out[i] = h


def id_keys(col):
    """64-bit keys of the ids of an Arrow column (no nulls): integers are their own key
    (exact), every other type is hashed (FNV-1a) from its UTF-8 / binary bytes (a cast to
    string first for dates, floats, ...). Equal ids have equal keys; unequal ids collide
    with probability about 2^-64 per pair."""
    import pyarrow as pa
    import pyarrow.compute as pc
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_unsigned_integer(t):     # (from 2^63 up: the int64 cast failed)
        v = pc.cast(arr, pa.uint64()).to_numpy(zero_copy_only=False)
        return np.ascontiguousarray(v, dtype=np.uint64)
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        v = pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False)
        return np.ascontiguousarray(v, dtype=np.int64).view(np.uint64)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)):
        try:
            arr = pc.cast(arr, pa.large_string())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            arr = pa.array([repr(v) for v in arr.to_pylist()], type=pa.large_string())
        t = arr.type
    n = len(arr)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)
    off = np.ascontiguousarray(off[arr.offset:arr.offset + n + 1], dtype=np.int64)
    data = (np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None
            else np.zeros(1, dtype=np.uint8))
    _fnv1a(off, data, out)
    return out


# =========================================================================== worker tasks
def check_piece(piece, weight_column, id_column):
    """Check the weights and ids of one row group; ``{"live", "weight", "keys"}``."""
    cols = [c for c in (weight_column, id_column) if c]
    live, wsum, keys = 0, 0.0, []
    for r0, t in piece.batches(cols):
        if weight_column:
            w = weight_vector(t, weight_column, piece.source, row0=r0, whole=False)
            live += int(np.count_nonzero(w > 0))
            wsum += float(w.sum())
        else:
            live += t.num_rows
            wsum += float(t.num_rows)
        if id_column:
            check_ids(t, id_column, piece.source, row0=r0, unique=False)
            keys.append(id_keys(t.column(id_column)))
    k = np.sort(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.uint64)
    return {"live": live, "weight": wsum, "keys": k}


def merge_checks(*parts):
    """Sum the counts and merge the sorted id keys of several row groups."""
    keys = np.concatenate([p["keys"] for p in parts])
    keys.sort(kind="mergesort")          # runs of sorted keys: a merge
    return {"live": sum(p["live"] for p in parts), "weight": sum(p["weight"] for p in parts),
            "keys": keys}


def repeated_keys(total):
    """The root of the check tree: counts and the keys that occur more than once."""
    k = total["keys"]
    rep = np.unique(k[1:][k[1:] == k[:-1]]) if k.shape[0] > 1 else k[:0]
    return {"live": total["live"], "weight": total["weight"], "repeated": rep}


def ids_with_keys(piece, id_column, keys):
    """``(row, id)`` of the rows of one row group whose id key is in ``keys``."""
    out = []
    for r0, t in piece.batches([id_column]):
        col = t.column(id_column)
        hit = np.flatnonzero(np.isin(id_keys(col), keys))
        if hit.size:
            vals = col.take(hit).to_pylist()
            out.extend((r0 + int(i), v) for i, v in zip(hit.tolist(), vals))
    return out


class PieceLabels:
    """What labelling one row group gives: its cluster summary, its truth contingency
    counts (or None) and the per-row results (kept on the worker for :func:`write_piece`)."""

    def __init__(self, summary, truth, results):
        self.summary = summary
        self.truth = truth
        self.results = results


def label_piece(piece, labeller, columns, n_total, n_representatives, nthreads=None,
                prefetch=0, into=None):
    """Assignments of every row of one row group and its :class:`ClusterSummary`
    (``nthreads``: the kernels' threads on a Dask worker; ``prefetch``: blocks decoded
    ahead in a background thread; ``into``: a :class:`PieceLabels` whose summary and truth
    counts the rows are added to, in row order, instead of new ones)."""
    from ._cli_results import ClusterSummary, ambiguous_margin, assignments, truth_missing
    if nthreads is not None:
        from .dask._chunks import set_threads
        set_threads(nthreads)
    text_col, weight_col, id_col, truth_col = columns
    K = labeller.cluster_centers_.shape[0]
    summ = (into.summary if into is not None else
            ClusterSummary(K, n_total, n_representatives, with_ids=id_col is not None,
                           ambiguous_below=ambiguous_margin(labeller)))
    n = piece.n_rows
    ldt = np.int32 if K < 2 ** 31 else np.int64
    labels, ru = np.empty(n, dtype=ldt), np.empty(n, dtype=ldt)
    prob, margin = np.empty(n), np.empty(n)
    truth = (into.truth if into is not None else Counter()) if truth_col else None
    cols = [c for c in dict.fromkeys([piece.column, text_col, weight_col, id_col, truth_col])
            if c]
    for r0, x, t in piece.blocks(cols, prefetch=prefetch):
        m = x.shape[0]
        lab, p, mar, cos, sec = assignments(labeller, x, runner_up=True)
        o = r0 - piece.row0
        labels[o:o + m], prob[o:o + m], margin[o:o + m], ru[o:o + m] = lab, p, mar, sec
        texts = text_list(t, text_col, piece.source) if text_col else None
        w = (weight_vector(t, weight_col, piece.source, row0=r0, whole=False) if weight_col
             else np.ones(m))
        ids = t.column(id_col).to_numpy(zero_copy_only=False) if id_col else None
        summ.add(r0, lab, p, mar, sec, cos, w, texts, ids)
        if truth is not None:
            truth.update((a, b) for a, b in zip(t.column(truth_col).to_pylist(),
                                                lab.tolist()) if not truth_missing(a))
    return PieceLabels(summ, truth, (labels, prob, margin, ru))


def merge_labels(*parts):
    """The summary and truth counts of several row groups (a new object: the parts stay as
    they are, their rows are written later)."""
    first = parts[0]
    summ = copy.deepcopy(first.summary)
    truth = None if first.truth is None else Counter(first.truth)
    for p in parts[1:]:
        summ.merge(p.summary)
        if truth is not None:
            truth.update(p.truth)
    return PieceLabels(summ, truth, None)


def output_tables(results, rank, piece, keep, schema):
    """The output rows of one row group: the ``keep`` input columns (cast to the dataset's
    ``schema``) plus the result columns, clusters renumbered by ``rank``, as tables of at
    most a row group."""
    import pyarrow as pa
    labels, prob, margin, ru = results
    res = {"cluster": rank[labels], "probability": prob, "margin": margin,
           "runner_up": np.where(ru >= 0, rank[np.maximum(ru, 0)], -1)}
    for r0, t in piece.batches(keep, rows=max(piece.n_rows, 1)):
        if keep and t.schema != schema:
            t = t.cast(schema)
        o = r0 - piece.row0
        m = t.num_rows
        for name in RESULT_COLUMNS:
            t = t.append_column(name, pa.array(res[name][o:o + m]))
        yield t


def write_piece(labelled, rank, piece, keep, schema, part_path):
    """:func:`output_tables` of one row group as one Parquet file (none for a row group of
    no rows); returns the number of rows written."""
    import pyarrow.parquet as pq
    writer = None
    n = 0
    try:
        for t in output_tables(labelled.results, rank, piece, keep, schema):
            if writer is None:
                writer = pq.ParquetWriter(part_path, t.schema)
            writer.write_table(t)
            n += t.num_rows
    finally:
        if writer is not None:
            writer.close()
    return n


# =========================================================================== the client
class _Labeller:
    """What labelling needs of a fitted estimator (centers, metric, probability
    temperature and cluster masses): small and picklable (the estimator holds the client)."""

    def __init__(self, est):
        self.cluster_centers_ = np.asarray(est.cluster_centers_)
        self.metric = est.metric
        self.probability_temperature_ = float(est.probability_temperature_)
        self.cluster_weights_ = np.asarray(est.cluster_weights_, dtype=np.float64)

    def _check_X(self, X):
        if X.shape[1] != self.cluster_centers_.shape[1]:
            raise ValueError(f"X has {X.shape[1]} features; the fit had "
                             f"{self.cluster_centers_.shape[1]}")
        return X


def _tree(client, futures, func):
    """The Dask backend's fixed-order merge tree (``_Submitter.tree`` of
    :mod:`fastanneal.dask._source`)."""
    from .dask._cluster import ClientHandle
    from .dask._source import _Submitter
    return _Submitter(ClientHandle(client)).tree(futures, func)


def _handle(client):
    """The waits of the command's Dask steps: they give up when the cluster has lost every
    worker (:meth:`fastanneal.dask.ClientHandle.wait`), as the fit's do."""
    from .dask._cluster import ClientHandle
    return ClientHandle(client)


def _first_error(futures):
    """Raise the error of the first failed task in ``futures``' order (deterministic
    messages whatever the scheduling), if any failed."""
    if not futures:
        return
    _handle(futures[0].client).wait(futures)
    for f in futures:
        if f.status == "error":
            f.result()


def _pieces(log):
    return [log.piece(i) for i in range(len(log.data.pieces))]


def check_log(log, args, client=None, st=None):
    """Checks of the weight and id columns (on the workers of ``client``, or in this
    process without one); ``(live rows, total weight)``.
    Raises :class:`InputError` (one line) for a missing, negative or non-finite weight, a
    zero total weight, a missing id or a repeated id (both rows named)."""
    wcol, icol = args.weight_column, args.id_column
    if not wcol and not icol:
        if st is not None:
            st.update(log.n_rows)
        return log.n_rows, float(log.n_rows)
    pieces = _pieces(log)
    if client is None:
        parts = []
        for p in pieces:
            parts.append(check_piece(p, wcol, icol))
            if st is not None:
                st.update(p.n_rows)
        total = repeated_keys(merge_checks(*parts))
        del parts
    else:
        futs = [client.submit(check_piece, p, wcol, icol, pure=False) for p in pieces]
        root = client.submit(repeated_keys, _tree(client, futs, merge_checks), pure=False)
        try:
            total = _handle(client).result(root)
        except BaseException:
            _first_error(futs)
            raise
        finally:
            del futs
        if st is not None:
            st.update(log.n_rows)
    if wcol and not total["weight"] > 0:
        raise InputError(f"{log.path}: weight column {wcol!r} sums to zero")
    rep = total["repeated"]
    if icol and rep.shape[0]:
        hits = ([ids_with_keys(p, icol, rep) for p in pieces] if client is None else
                _handle(client).result([client.submit(ids_with_keys, p, icol, rep, pure=False)
                                        for p in pieces]))
        rows = {}
        for part in hits:
            for r, v in part:
                rows.setdefault(v, []).append(r)
        dup = [(sorted(r)[1], sorted(r)[0], v) for v, r in rows.items() if len(r) > 1]
        if dup:
            second, first, v = min(dup, key=lambda d: d[0])
            raise InputError(f"{log.path}: duplicate id {v!r} in column {icol!r} (rows "
                             f"{first + 1} and {second + 1})")
    return int(total["live"]), float(total["weight"])


class LogLabels:
    """The labelling of the whole log: the merged summary, its cluster table (clusters
    renumbered largest first), the truth contingency counts, and the per-row-group results
    (:class:`PieceLabels` in this process, or futures of them on the workers)."""

    def __init__(self, pieces, parts, total):
        from ._cli_results import ranks
        self.pieces = pieces
        self.parts = parts
        self.summary = total.summary
        self.truth = total.truth
        self.order = self.summary.order()
        self.rank = ranks(self.order)
        self.clusters = self.summary.table(self.order)

    def release(self):
        for f in self.parts:
            if hasattr(f, "release"):
                f.release()
        self.parts = []


def label_log(log, est, args, client=None, nthreads=None, st=None, n_representatives=5):
    """Label every row (one task per row group; on the workers of ``client``, or in this
    process, merging the summaries in row order); see the module docstring."""
    pieces = _pieces(log)
    cols = (args.text_column if log.has_text else None, args.weight_column, args.id_column,
            args.truth_column)
    if client is None:
        parts, total = [], None
        for p in pieces:
            # one summary, the rows added in order (as one pass over the log would)
            part = label_piece(p, est, cols, log.n_rows, n_representatives, prefetch=2,
                               into=total)
            if total is None:
                total = PieceLabels(part.summary, part.truth, None)
            parts.append(PieceLabels(None, None, part.results))
            if st is not None:
                st.update(p.n_rows)
        return LogLabels(pieces, parts, total)
    lab = client.scatter(_Labeller(est), broadcast=True)
    futs = [client.submit(label_piece, p, lab, cols, log.n_rows, n_representatives, nthreads,
                          pure=False) for p in pieces]
    root = _tree(client, futs, merge_labels)
    try:
        if st is not None:
            rows = {f.key: p.n_rows for f, p in zip(futs, pieces)}
            pending = set(futs)
            while pending:
                res = _handle(client).wait(list(pending), return_when="FIRST_COMPLETED")
                pending -= set(res.done)
                if any(f.status == "error" for f in res.done):
                    break
                for f in res.done:
                    st.update(rows[f.key])
        total = _handle(client).result(root)
    except BaseException:
        _first_error(futs)
        for f in futs:
            f.cancel()
        raise
    return LogLabels(pieces, futs, total)


def write_log(log, labels, keep, writer, output, client=None, st=None):
    """The output rows into ``writer`` (a :class:`fastanneal._io.TableWriter`), in row
    order: straight from this process's results, or from part files written by the
    workers into a temporary folder next to ``output``, copied one block at a time and
    removed."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    schema = pa.schema([log.data.schema.field(c) for c in keep])
    if client is None:
        for part, piece in zip(labels.parts, labels.pieces):
            for t in output_tables(part.results, labels.rank, piece, keep, schema):
                writer.write(t)
                if st is not None:
                    st.update(t.num_rows)
        labels.release()
        return
    # absolute: the workers write the parts from their own working directories (a relative
    # -o failed there, after the whole fit and labelling)
    folder = os.path.abspath(temp_folder(output))
    try:
        rank = client.scatter(labels.rank, broadcast=True)
        parts = [str(Path(folder) / f"part-{i:06d}.parquet") for i in range(len(labels.pieces))]
        futs = [client.submit(write_piece, f, rank, p, keep, schema, path, pure=False)
                for f, p, path in zip(labels.parts, labels.pieces, parts)]
        try:
            written = _handle(client).result(futs)
        except BaseException:
            _first_error(futs)
            raise
        labels.release()
        for path, n in zip(parts, written):
            if not n:
                continue
            with pq.ParquetFile(path) as pf:
                for b in pf.iter_batches(batch_size=65536, use_threads=False):
                    writer.write(pa.Table.from_batches([b]))
                    if st is not None:
                        st.update(b.num_rows)
            Path(path).unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)

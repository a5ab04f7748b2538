"""In-process reading of Parquet embeddings, row group by row group, for data larger than
memory (no Dask): :class:`ParquetDataset` (a file or a folder, hive partitions as columns,
as a list of row groups read on demand), :func:`prefetched` (the next row group decoded in
a background thread while the current one is reduced) and :class:`ParquetStream`, the
source that :class:`fastanneal.MiniBatchAnnealedKMeans` anneals over out of core
(:func:`fastanneal.open_parquet`). The per-chunk work (validation, moments, labels) is the
same code as on the Dask workers (:mod:`fastanneal.dask._chunks`)."""
import hashlib
import math
import numbers
import os
import queue
import threading

import numpy as np

__all__ = ["ParquetDataset", "ParquetStream", "ParquetReadError", "open_parquet",
           "prefetched"]


def release_decoded():
    """Hand Arrow's freed decoding buffers back to the system. Arrow's allocator keeps the
    pages of columns decoded and dropped (a streaming pass would otherwise grow by a few row
    groups; an in-memory read would keep ~0.1 GiB of them through the fit); the C library's
    allocator, which would return them by itself, halves the decoding rate instead. Call it
    after the data read so far has been freed or copied out."""
    import pyarrow as pa
    pa.default_memory_pool().release_unused()

def _embedding_info(field, where):
    """(kind, D or None) of an embedding field; kind 'fixed' or 'list'."""
    import pyarrow as pa
    t = field.type
    if pa.types.is_fixed_size_list(t):
        kind, D = "fixed", t.list_size
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        kind, D = "list", None
    else:
        raise ValueError(f"column {field.name!r} of {where} has type {t}; an embedding column "
                         "must be a fixed-size list or a list of numbers")
    vt = t.value_type
    if not (pa.types.is_floating(vt) or pa.types.is_integer(vt)):
        raise ValueError(f"column {field.name!r} of {where} holds {vt} values; expected numbers")
    return kind, D, vt


def _weights64(col, name, where):
    """A weight column as float64 (integers, decimals and numeric strings converted; nulls
    as NaN for the caller to name)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    try:
        col = pc.cast(col, pa.float64(), safe=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise ValueError(f"weight column {name!r} is not numeric ({where})") from None
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)


def _value_dtype(vt):
    import pyarrow as pa
    return np.float32 if (pa.types.is_float32(vt) or pa.types.is_float16(vt)) else np.float64


def embedding_block(arr, D, dtype, where, row0=0, column="embedding"):
    """An Arrow (chunked) list / fixed-size-list array as an ``(n, D)`` NumPy array."""
    import pyarrow as pa
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    n = len(arr)
    if arr.null_count:
        i = int(np.argwhere(arr.is_null().to_numpy(zero_copy_only=False))[0, 0])
        raise ValueError(f"column {column!r} has a null embedding in {where}, row {row0 + i}")
    if pa.types.is_fixed_size_list(arr.type):
        if D is not None and arr.type.list_size != D:
            raise ValueError(f"column {column!r} in {where} has {arr.type.list_size} dimensions; "
                             f"expected {D}")
        D = arr.type.list_size
    else:
        lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
        if D is None:
            D = int(lengths[0]) if n else 0
        bad = np.argwhere(lengths != D)
        if bad.size:
            i = int(bad[0, 0])
            raise ValueError(f"column {column!r} has an embedding of length {int(lengths[i])} in "
                             f"{where}, row {row0 + i}; expected {D}")
    values = arr.flatten()
    if values.null_count:           # a missing number, named as such (not "contains NaN")
        i = int(np.argwhere(values.is_null().to_numpy(zero_copy_only=False))[0, 0]) // max(D, 1)
        raise ValueError(f"column {column!r} has a missing number in {where}, row {row0 + i}")
    vals = values.to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(vals, dtype=dtype).reshape(n, D)



# ------------------------------------------------------------------------- reading ahead
def prefetched(fn, items, depth=1):
    """Yield ``(item, fn(item))`` in the order of ``items``, computing up to ``depth`` items
    ahead in one background thread (Parquet decoding releases the GIL, so the next row
    group is read while the caller reduces the current one). An exception of ``fn`` is
    raised at its item; closing the generator early stops the thread."""
    items = list(items)
    if depth <= 0 or len(items) < 2:
        for it in items:
            yield it, fn(it)
        return
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        for it in items:
            if stop.is_set():
                return
            try:
                r = (it, fn(it), None)
            except BaseException as e:   # handed to the consumer
                r = (it, None, e)
            while not stop.is_set():
                try:
                    q.put(r, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if r[2] is not None:
                return
    t = threading.Thread(target=work, name="fastanneal-prefetch", daemon=True)
    t.start()
    try:
        for _ in items:
            it, res, err = q.get()
            if err is not None:
                raise err
            yield it, res
    finally:
        stop.set()
        t.join()


# ------------------------------------------------------------------------- datasets
class ParquetReadError(OSError):
    """A row group could not be read (I/O error, failed page checksum, corrupt data)."""


def _scan_format():
    import pyarrow.dataset as ds
    # buffered reads (not the whole column chunk at once): half the memory, same speed
    return ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(
        page_checksum_verification=True, use_buffered_stream=True, buffer_size=1 << 22,
        pre_buffer=False))


def _widest_schema(dataset):
    """The dataset's schema with each column in the widest type of its files (int32 in one
    file and int64 in another: int64; float32 and float64 embeddings: float64), so that
    every row group reads without loss: the first file's schema alone failed on a later
    file's larger ids after the whole fit, and narrowed its float64 embeddings. Types that
    do not unify (a text column that is a number elsewhere) keep the first file's, whose
    reads then fail naming the file."""
    import pyarrow as pa
    base = dataset.schema
    try:
        unified = pa.unify_schemas([f.physical_schema for f in dataset.get_fragments()],
                                   promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError):
        return base
    fields = [unified.field(f.name) if f.name in unified.names else f for f in base]
    return pa.schema(fields, metadata=base.metadata)


def widest_dataset(path, fmt):
    """``pyarrow.dataset.dataset(path)`` (hive partitioning, file format ``fmt``) read in
    each column's widest type over its files (:func:`_widest_schema`): the in-memory and
    the out-of-core routes open Parquet folders the same way."""
    import pyarrow.dataset as ds
    dset = ds.dataset(path, format=fmt, partitioning="hive")
    wide = _widest_schema(dset)
    if wide.equals(dset.schema):
        return dset
    return ds.dataset(path, format=fmt, partitioning="hive", schema=wide)


#: Blocks of this many bytes, evenly spaced through a file, hashed into its stamp.
STAMP_BLOCK, STAMP_BLOCKS = 4096, 16


def file_stamp(file):
    """``(size, hash)`` of ``file`` (the Parquet footer and :data:`STAMP_BLOCKS` blocks
    spread through the file), or None when it cannot be read: the footer holds every row
    group's size and column statistics and the blocks sample the pages, so a file rewritten
    with other rows almost always changes it (a file written without statistics,
    uncompressed, to the same size matched on its footer alone; the blocks see most such
    rewrites, not one confined between them), while an identical copy of the file (each
    machine its own, a touch, a sync tool) does not -- unlike the modification time."""
    try:
        with open(file, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            if size < 12:
                return (size, "")
            f.seek(size - 8)
            tail = f.read(8)
            n = int.from_bytes(tail[:4], "little")
            if tail[4:] != b"PAR1" or n > size - 12:
                return (size, "")
            f.seek(size - 8 - n)
            h = hashlib.blake2b(f.read(n), digest_size=16)
            for j in range(STAMP_BLOCKS):
                f.seek(j * max(0, size - STAMP_BLOCK) // max(1, STAMP_BLOCKS - 1))
                h.update(f.read(STAMP_BLOCK))
            return (size, h.hexdigest())
    except OSError:
        return None


def changed_message(path):
    """What a file that changed since it was opened is told as (the library and the
    command: the rows read so far are of the old content)."""
    return (f"{path} changed since it was opened (its size or content differs): read it "
            "again (open_parquet again from Python, or rerun the command)")


def _stat(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


def file_changed(path, stat, stamp):
    """Whether ``path`` changed since it had ``os.stat`` ``stat`` (:func:`_stat`) and
    content ``stamp`` (:func:`file_stamp`): the cheap stat first, the stamp only when it
    differs (a touch or an identical copy is no change)."""
    return _stat(path) != stat and file_stamp(path) != stamp


class ParquetDataset:
    """A Parquet file, or a folder of them (hive ``key=value`` folders become columns; names
    starting with ``.`` or ``_`` are skipped), as its row groups in the order in which
    ``pyarrow`` reads the whole dataset. Only metadata is read here."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"{self.path}: no such file or folder")
        # (absolute: the pieces' paths are read again by Dask workers in other directories)
        self.dataset = widest_dataset(os.path.abspath(self.path), _scan_format())
        self.schema = self.dataset.schema
        self.pieces = []
        rows = []
        for frag in self.dataset.get_fragments():
            for g in frag.split_by_row_group():
                self.pieces.append(g)
                rows.append(int(g.row_groups[0].num_rows))
        self.piece_rows = np.array(rows, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.piece_rows)]).astype(np.int64)
        self.n_rows = int(self.offsets[-1])
        #: each file's :func:`file_stamp` (size, Parquet footer) when opened: the row
        #: groups above are that state's (a file rewritten since -- rows appended -- was
        #: fitted with the old layout: the new rows got no label, without a word); and its
        #: ``os.stat`` (size, mtime), a cheap first test before each read
        files = {g.path for g in self.pieces}
        self.stamps = {p: file_stamp(p) for p in files}
        self._stats = {p: _stat(p) for p in files}

    def check_unchanged(self, paths=None):
        """ValueError when a file changed since the dataset was opened (a touch or an
        identical copy, which keep the footer, is no change)."""
        for p in (self.stamps if paths is None else paths):
            if file_changed(p, self._stats.get(p), self.stamps.get(p)):
                raise ValueError(changed_message(p))
            self._stats[p] = _stat(p)       # (a touch: the stamp is not read again)

    @property
    def column_names(self):
        return list(self.schema.names)

    def require_in_every_file(self, columns):
        """Each ``(what, name)`` column is in every file (or a hive partition key): a file
        without it read as nulls, named "a null embedding" instead of a missing column."""
        import pyarrow.dataset as ds
        seen = set()
        for piece in self.pieces:
            if piece.path in seen:
                continue
            seen.add(piece.path)
            have = set(piece.physical_schema.names)
            keys = set(ds.get_partition_keys(piece.partition_expression))
            for what, col in columns:
                if col in have or col in keys:
                    continue
                raise ValueError(f"{what} column {col!r} not found in {piece.path}; "
                                 f"available columns: {sorted(have)}")

    def where(self, i):
        piece = self.pieces[i]
        return f"{os.path.basename(piece.path)} row group {piece.row_groups[0].id}"

    def read(self, i, columns):
        """Row group ``i`` as a ``pyarrow.Table`` of ``columns`` (None: all)."""
        import pyarrow as pa
        release_decoded()           # the row groups read before are freed by now
        self.check_unchanged((self.pieces[i].path,))
        try:
            t = self.pieces[i].to_table(schema=self.schema, columns=columns, use_threads=False)
        except (OSError, pa.ArrowException) as e:   # a failed page checksum included
            raise ParquetReadError(f"{self.path} ({self.where(i)}): {e}") from e
        if t.num_rows != self.piece_rows[i]:
            raise ValueError(f"{self.where(i)} of {self.path} has {t.num_rows} rows; its "
                             f"metadata says {int(self.piece_rows[i])}")
        return t

    def tables(self, columns, indices=None, depth=1):
        """``(i, table)`` for the row groups ``indices`` (all, in order), read ahead."""
        self.check_unchanged()
        idx = range(len(self.pieces)) if indices is None else indices
        return prefetched(lambda i: self.read(i, columns), idx, depth)


# ------------------------------------------------------------------------- the stream
def open_parquet(path, column="embedding", weight=None, id=None, *, metric="euclidean",
                 dtype=None, chunk_rows=4096, prefetch=1, device=None):
    """Open Parquet embeddings for out-of-core annealing in this process (no Dask).

    ``MiniBatchAnnealedKMeans(K).fit(open_parquet("log.parquet", weight="count"))`` anneals
    over ``chunk_rows``-row batches of the row groups (a random order of row groups per
    epoch, a random order of the batches within each), decoding the next row group while
    the current one is reduced. Memory: about two row groups plus the seeding sample,
    whatever the size of the file (write logs with row groups of at most ~100,000 rows).

    Parameters
    ----------
    path : str or path-like
        A Parquet file or a folder of Parquet files (hive partitions become columns).
    column : str
        The embedding column (``fixed_size_list`` or ``list`` of numbers).
    weight, id : str or None
        Optional columns of sample weights (numbers >= 0) and row ids (written next to the
        labels by ``fit(..., labels_path=...)``).
    metric : "euclidean" or "cosine"
        Must be the estimator's metric (cosine rows are unit-normalised as they are read).
    dtype : numpy dtype or None
        None: float32 for float16/float32 values, float64 otherwise.
    chunk_rows : int
        Rows per mini-batch update (``batch_size`` of the estimator rounds to whole chunks):
        row groups are cut into chunks of at most this many rows, and a batch takes several
        chunks where the row groups are smaller (about ``chunk_rows`` rows a batch).
    prefetch : int
        Row groups decoded ahead in a background thread (0: none).
    device : {None, "cpu", "cuda"}
        Where the mini-batches' and the full moments passes' moments are computed: the CPU
        kernels (None, "cpu"), or the GPU (``"cuda"``: each decoded batch is streamed
        through the GPU by :class:`fastanneal.cuda.CudaBlocks`, the products by cuBLAS
        where CuPy is installed). Everything else stays on the CPU kernels: the seeding
        sample (and ``suggest_k``'s sample), the mean, covariance and per-cluster
        eigenvalues, the gradient passes and the final labelling pass.
    """
    from ._validation import metric_code
    return ParquetStream(ParquetDataset(path), column, weight, id, metric_code(metric),
                         dtype, chunk_rows, prefetch, device)


def _passes_base():
    from .dask._chunks import StreamedPasses
    return StreamedPasses


class ParquetStream(_passes_base()):
    """Chunks of ``chunk_rows`` rows within the row groups of a :class:`ParquetDataset`:
    the batches of a mini-batch fit, and full streaming passes (``moments``, the polish and
    the final pass) in row-group order. See :func:`open_parquet`."""

    n_threads_total = 1
    nthreads = 0                              # the kernels use every Numba thread

    def __init__(self, data, column="embedding", weight=None, id=None, metric=0, dtype=None,
                 chunk_rows=4096, prefetch=1, device=None):
        import pyarrow as pa
        self.data = data
        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be None, 'cpu' or 'cuda'; got {device!r}")
        if device == "cuda":
            from .cuda.source import _require_cuda
            _require_cuda()         # no usable GPU: a clear RuntimeError now, not mid-fit
        self.device = "cuda" if device == "cuda" else "cpu"
        self._gpu = None
        names = data.column_names
        for what, col in (("embedding", column), ("weight", weight), ("id", id)):
            if col is not None and col not in names:
                raise ValueError(f"{what} column {col!r} not found in {data.path}; available "
                                 f"columns: {names}")
        data.require_in_every_file([(w, c) for w, c in (("embedding", column),
                                                        ("weight", weight), ("id", id))
                                    if c is not None])
        kind, D, vt = _embedding_info(data.schema.field(column), data.path)
        if weight is not None:
            wt = data.schema.field(weight).type
            if not (pa.types.is_floating(wt) or pa.types.is_integer(wt)
                    or pa.types.is_decimal(wt) or pa.types.is_string(wt)
                    or pa.types.is_large_string(wt)):
                raise ValueError(f"weight column {weight!r} of {data.path} has type {wt}; "
                                 "expected numbers")
        self.column, self.weight, self.id = column, weight, id
        self.metric = int(metric)
        self.dtype = np.dtype(dtype) if dtype is not None else np.dtype(_value_dtype(vt))
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64 (the kernels' types); got "
                             f"{self.dtype}")
        if D is None:           # list<float>: the length of the first embedding
            D = 0
            for i, r in enumerate(data.piece_rows):
                if r:
                    first = data.read(i, [column]).column(0).slice(0, 1)
                    D = int(embedding_block(first, None, self.dtype, data.where(i), 0,
                                            column).shape[1])
                    break
        self.n_features = int(D)
        self.n_rows = data.n_rows
        self.has_ids = id is not None
        self.prefetch_depth = 1 if prefetch else 0
        self._depth = int(max(0, prefetch))
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral) or \
                chunk_rows < 1:
            raise ValueError(f"chunk_rows must be an integer >= 1; got {chunk_rows!r}")
        c = int(chunk_rows)
        self.target_rows = c                 # (row groups smaller than it: batches of several)
        self.chunks = []                     # (piece, local start, local stop)
        for p, r in enumerate(data.piece_rows):
            for a in range(0, int(r), c):
                self.chunks.append((p, a, min(int(r), a + c)))
        self.chunk_rows = tuple(b - a for _, a, b in self.chunks) or (0,)
        self._W = None
        self._cache = {}                     # piece -> Chunk (the current and the next)
        self._pending = {}                   # piece -> Future
        self._pool = None
        #: rows are measured from this point when set (:meth:`set_origin`)
        self.origin = None
        #: the number of the log's first row in error messages (the command line: 1)
        self.row_base = 0

    def set_origin(self, origin):
        """Measure every row group read from now on from ``origin`` (None: from 0): the frame
        of a fit whose rows lie far from the origin (``docs/theory.md``)."""
        self.origin = None if origin is None else np.asarray(origin, dtype=np.float64)
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._cache = {}

    # ------------------------------------------------ reading
    def _columns(self):
        return [c for c in (self.column, self.weight, self.id) if c is not None]

    def _prepare(self, i, table=None):
        """Row group ``i`` read, validated (finite, weights >= 0, non-zero rows for cosine)
        and, for cosine, unit-normalised: a :class:`fastanneal.dask._chunks.Chunk`."""
        from .dask._chunks import prepare_chunk
        if table is None:
            table = self.data.read(i, self._columns())
        row0 = int(self.data.offsets[i])
        where = self.data.where(i)
        x = embedding_block(table.column(self.column), self.n_features, self.dtype, where,
                            row0 + self.row_base, self.column)
        w = None
        if self.weight is not None:
            w = _weights64(table.column(self.weight), self.weight, where)
            if np.isnan(w).any():
                j = int(np.argmax(np.isnan(w)))
                raise ValueError(f"weight column {self.weight!r} has a missing value at row "
                                 f"{row0 + self.row_base + j} ({where})")
        ch = prepare_chunk(x, w, i, row0, self.metric, self.dtype, origin=self.origin,
                           row_base=self.row_base)
        if self.id is not None:
            # Arrow, in the dataset's type: through NumPy a null made one row group's int64
            # ids float64 (large ids rounded) and decimals changed precision per file, so the
            # labels folder's files no longer shared a schema
            ids = table.column(self.id).combine_chunks()
            if ids.null_count:
                j = int(np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))[0])
                raise ValueError(f"id column {self.id!r} has a missing value at row "
                                 f"{row0 + self.row_base + j} ({where})")
            ch.ids = ids
        return ch

    def _piece(self, p):
        if p in self._cache:
            return self._cache[p]
        fut = self._pending.pop(p, None)
        ch = fut.result() if fut is not None else self._prepare(p)
        self._cache = {p: ch}                # the previous row group is dropped
        return ch

    def prefetch(self, batches):
        """Start decoding the row group of the next batch (one ahead, in a thread)."""
        if not self._depth or not batches or not batches[0]:
            return
        p = self.chunks[batches[0][0]][0]
        if p in self._cache or p in self._pending:
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastanneal-prefetch")
        self._pending = {p: self._pool.submit(self._prepare, p)}

    def passes(self, depth=None):
        """Every row group once, in order, as prepared chunks (the next one read ahead)."""
        depth = self._depth if depth is None else depth
        cols = self._columns()
        for i, table in self.data.tables(cols, depth=depth):
            yield self._prepare(i, table)

    # ------------------------------------------------ the mini-batch protocol
    def epoch_order(self, rng):
        """The chunks in a random order of row groups, each row group's chunks in a random
        order (a row group is decoded once per epoch)."""
        by_piece = {}
        for j, (p, a, b) in enumerate(self.chunks):
            if b > a:
                by_piece.setdefault(p, []).append(j)
        out = []
        for p in rng.permutation(sorted(by_piece)):
            js = by_piece[int(p)]
            out.extend(js[k] for k in rng.permutation(len(js)))
        return np.asarray(out, dtype=np.int64)

    def _block_moments(self, X, w, C, T, resp, log_prior, hard_sums):
        """One block's moments on this stream's device (the CPU kernels or the GPU)."""
        if self.device == "cuda":
            if self._gpu is None:
                from .cuda import CudaBlocks
                self._gpu = CudaBlocks(self.n_features, self.dtype, self.metric)
            return self._gpu.moments(X, w, C, T, resp, log_prior, hard_sums)
        from ._moments import compute_moments
        return compute_moments(X, w, C, T, self.metric, resp, log_prior, hard_sums=hard_sums)

    def batch_moments(self, ids, C, T, resp, log_prior):
        m = None
        for j in ids:
            p, a, b = self.chunks[j]
            ch = self._piece(p)
            mi = self._block_moments(ch.X[a:b], ch.w[a:b], C, T, resp, log_prior, False)
            m = mi if m is None else m + mi
        return m

    @property
    def total_weight(self):
        if self._W is None:
            if self.weight is None:
                self._W = float(self.n_rows)
            else:
                tot, hi = 0.0, 0.0
                for i, t in self.data.tables([self.weight], depth=self._depth):
                    w = _weights64(t.column(0), self.weight, self.data.where(i))
                    bad = ~np.isfinite(w) | (w < 0)
                    if bad.any():
                        j = int(np.argmax(bad))
                        what = ("a missing value" if np.isnan(w[j]) else "infinity"
                                if np.isinf(w[j]) else f"a negative value ({w[j]:g})")
                        raise ValueError(f"weight column {self.weight!r} has {what} at row "
                                         f"{int(self.data.offsets[i]) + j} "
                                         f"({self.data.where(i)})")
                    tot += float(w.sum())
                    hi = max(hi, float(w.max()) if w.size else 0.0)
                from ._validation import check_weight_range
                check_weight_range(hi, self.dtype, f"weight column {self.weight!r}")
                if not math.isfinite(tot):
                    raise ValueError(f"weight column {self.weight!r} sums to more than float64 "
                                     "can hold; rescale the weights (divide them by a constant)")
                self._W = tot
        return self._W

    def fingerprint(self):
        files = sorted({f.path for f in self.data.pieces})
        # content and modification time: a file of another content but the same size and
        # mtime (cp -p, rsync -t, tar) resumed another fit's state silently; the content
        # stamp samples blocks, so a same-size rewrite between them is caught by its mtime
        stamp = [(f, self.data.stamps.get(f) or file_stamp(f), os.path.getmtime(f))
                 for f in files]
        # the chunking decides the batches, so the fit: a checkpoint of another chunk_rows
        # resumed into a fit equal to neither
        chunks = hashlib.sha256(np.asarray(self.chunk_rows, np.int64).tobytes()).hexdigest()
        return (f"parquet:{stamp}:{self.column}:{self.weight}:{self.metric}:{self.n_rows}:"
                f"{self.dtype}:chunks={chunks[:16]}")

    def sample(self, n_target, rng, min_chunks=8):
        """About ``n_target`` random rows from at least ``min_chunks`` random row groups."""
        from ._minibatch import sample_plan
        take = sample_plan(tuple(int(r) for r in self.data.piece_rows), n_target, rng,
                           min_chunks)
        Xs, W = self._gather(take)
        if Xs.shape[0] > n_target:
            idx = np.sort(rng.choice(Xs.shape[0], size=n_target, replace=False))
            Xs, W = Xs[idx], W[idx]
        return np.ascontiguousarray(Xs), W

    def sample_weighted(self, n_target, rng):
        """Up to ``n_target`` random rows among those of weight > 0 (one pass over the weight
        column, then the row groups that hold the picked rows): the seeding sample of a log
        whose few weighted rows a sample of row groups missed ("the seeding sample carries
        no weight" for three seeds of four, on a log with 100 weighted rows of 100,000)."""
        if self.weight is None:
            return self.sample(n_target, rng)
        where = []
        for i, t in self.data.tables([self.weight], depth=self._depth):
            w = _weights64(t.column(0), self.weight, self.data.where(i))
            pos = np.flatnonzero(w > 0)
            if pos.size:
                where.append((i, pos))
        if not where:
            return self.sample(n_target, rng)
        piece = np.concatenate([np.full(p.size, i, dtype=np.int64) for i, p in where])
        local = np.concatenate([p for _, p in where])
        if piece.size > n_target:
            pick = np.sort(rng.choice(piece.size, size=int(n_target), replace=False))
            piece, local = piece[pick], local[pick]
        Xs, W = self._gather({i: local[piece == i] for i in set(piece.tolist())})
        return np.ascontiguousarray(Xs), W

    def _gather(self, take):
        """The rows ``take[i]`` (row indices within row group ``i``) of each row group in
        ``take``, prepared, in row-group order: ``(X, w)``."""
        xs, ws = [], []
        for i, table in self.data.tables(self._columns(), sorted(take), self._depth):
            ch = self._prepare(i, table)
            xs.append(ch.X[take[i]])
            ws.append(ch.w[take[i]])
        return np.concatenate(xs), np.concatenate(ws)

    # ------------------------------------------------ full passes
    def _reduce(self, work, combine=None, **kwargs):
        total = None
        for ch in self.passes():
            r = work(ch, **kwargs)
            total = r if total is None else (combine(total, r) if combine else total + r)
        return total

    def moments(self, centers, T, resp=0, log_prior=None, hard_sums=False):
        from ._moments import Moments
        m = self._reduce(lambda ch: self._block_moments(ch.X, ch.w, centers, T, resp,
                                                        log_prior, hard_sums))
        if m is None:
            return Moments.zeros(np.shape(centers)[0], self.n_features, T, hard_sums=hard_sums)
        return m

    def final_pass(self, C, T, resp, log_prior, labels_path=None, overwrite=False,
                   with_ids=False, margin_every=None):
        """``(moments, labels folder, margins)``: the moments of every row at ``(C, T)``
        (hard counts for the cluster weights); with ``labels_path``, the hard labels (and
        ids) written as Parquet, one file per row group, into a folder published
        atomically; with ``margin_every``, ``(margin d_(2) - d_(1), weight)`` of every
        ``margin_every``-th row (for ``probability_temperature_``: no read after the fit,
        and the same rows whether the fit ran whole or resumed), else None."""
        from ._moments import assign
        from .dask import _chunks as ch
        from .dask._minibatch import _AtomicFolder
        folder = _AtomicFolder(labels_path, overwrite) if labels_path is not None else None
        C64 = np.ascontiguousarray(C, dtype=np.float64)
        C = np.ascontiguousarray(C, dtype=self.dtype)
        m = None
        margins, weights = [], []
        try:
            for c in self.passes():
                mi = ch.chunk_moments(c, C, T, self.metric, resp, log_prior, False, 0)
                mi.S = mi.S[:, :0].copy()
                if folder is not None:      # (the labels' exact J replaces the GEMM form)
                    lab = ch.exact_final_labels(c, C64, self.metric, 0, mi)
                    ch.write_label_part(folder.tmp, c.index, c.row0, lab,
                                        getattr(c, "ids", None) if with_ids else None)
                if margin_every and c.rows and C.shape[0] > 1:
                    pick = np.arange((-c.row0) % margin_every, c.rows, margin_every)
                    if pick.size:
                        margins.append(assign(c.X[pick], C64, "cosine" if self.metric == 1
                                              else "euclidean")[2])
                        weights.append(np.asarray(c.w, dtype=np.float64)[pick])
                m = mi if m is None else m + mi
        except BaseException:
            if folder is not None:
                folder.abort()
            raise
        sample = ((np.concatenate(margins), np.concatenate(weights)) if margins else
                  ((np.zeros(0), np.zeros(0)) if margin_every else None))
        return m, (folder.commit() if folder is not None else None), sample

    def close(self):
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()
        self._cache.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None

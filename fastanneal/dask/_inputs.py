"""Lazy inputs of the Dask backend: Dask arrays, Dask DataFrames and Parquet datasets with an
embedding column (fixed-size list or list of numbers), read with pyarrow one chunk at a time."""
import glob
import math
import os
from typing import NamedTuple, Optional

import numpy as np

from .. import _config
from .._parquet import _embedding_info, _value_dtype, embedding_block  # noqa: F401
from .._parquet import file_stamp

#: Target bytes of one chunk when a NumPy array is split for the Dask backend.
DEFAULT_CHUNK_BYTES = 64 * 2 ** 20


#: ``token -> paths`` of every :func:`read_parquet_embeddings` call in this process: the
#: arrays' task names carry the token, so a writer can tell which files a Dask array (or
#: one derived from it) reads and refuse to write over them (:func:`parquet_inputs_of`)
_INPUT_PATHS = {}
_READ_PREFIXES = ("read-embeddings-", "read-weights-", "read-ids-")


def parquet_inputs_of(x):
    """The Parquet paths ``x`` reads: a path or list of paths itself, or, for an
    :class:`EmbeddingArrays` or a Dask collection made by (or from) :func:`
    read_parquet_embeddings` in this process, the paths it was opened with."""
    if isinstance(x, EmbeddingArrays):
        return sorted({p for a in x if a is not None for p in parquet_inputs_of(a)})
    if isinstance(x, (str, os.PathLike)):
        return [os.fspath(x)]
    if isinstance(x, (list, tuple)):
        if x and all(isinstance(p, (str, os.PathLike)) for p in x):
            return [os.fspath(p) for p in x]
        return []
    if not is_dask_collection(x):
        return []
    graph = x.__dask_graph__()
    names = getattr(graph, "layers", None)
    names = set(names.keys() if names is not None else graph.keys())
    names.add(getattr(x, "name", None))
    out = set()
    for name in names:
        if isinstance(name, tuple):
            name = name[0]
        if not isinstance(name, str):
            continue
        if name in _INPUT_PATHS:                 # the arrays themselves (kept by persist)
            out.update(_INPUT_PATHS[name])
        elif name.startswith(_READ_PREFIXES):
            out.update(_INPUT_PATHS.get(name.split("-")[2], ()))
    return sorted(out)


def every_parquet_input():
    """Every path :func:`read_parquet_embeddings` opened in this process (for a writer
    that cannot tell what a Dask collection reads: a persisted or rebuilt graph)."""
    return sorted({p for paths in _INPUT_PATHS.values() for p in paths})


class EmbeddingArrays(NamedTuple):
    """Lazy rows and their optional weights and ids, with the same row chunks."""
    X: object                  #: dask array (n, D), one column chunk
    weights: Optional[object]  #: dask array (n,) float64, or None
    ids: Optional[object]      #: dask array (n,), or None


def is_dask_collection(x):
    return hasattr(x, "dask") and hasattr(x, "__dask_graph__")


def _is_dask_dataframe(x):
    return is_dask_collection(x) and hasattr(x, "columns") and hasattr(x, "npartitions")


# ------------------------------------------------------------------------- Parquet
def _parquet_files(path):
    if isinstance(path, (list, tuple)):
        files = [os.fspath(p) for p in path]
    else:
        path = os.fspath(path)
        if os.path.isdir(path):
            files = sorted(
                f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                if os.path.isfile(f) and not any(
                    part.startswith((".", "_"))
                    for part in os.path.relpath(f, path).split(os.sep))
                and f.endswith((".parquet", ".parq", ".pq")))
        elif os.path.exists(path):
            files = [path]
        else:
            files = sorted(glob.glob(path))
    if not files:
        raise FileNotFoundError(f"no Parquet files found at {path!r}")
    # absolute: the workers read them, from their own working directories
    return [os.path.abspath(f) for f in files]


def _where(file, row_groups):
    """"name.parquet row group 3" / "name.parquet row groups 3-5" for messages."""
    name = os.path.basename(file)
    if len(row_groups) == 1:
        return f"{name} row group {row_groups[0]}"
    return f"{name} row groups {row_groups[0]}-{row_groups[-1]}"


def _unchanged(file, stamp):
    """``file`` still has the size and Parquet footer (:func:`file_stamp`) it had when the
    dataset was opened: a file rewritten with the same row counts read other rows
    silently."""
    if stamp is None:
        return
    now = file_stamp(file)
    if now is None:
        raise OSError(f"{file}: cannot be read")
    if tuple(now) != tuple(stamp):
        raise ValueError(f"{file} changed after read_parquet_embeddings opened it (its size "
                         "or its Parquet footer differs): open it again")


def _planned(where, file, n, rows):
    """The piece holds the rows the dataset was opened with (else the file changed since)."""
    if rows is not None and n != rows:
        raise ValueError(f"{file} ({where}) has {n} rows, but the dataset was opened with "
                         f"{rows}: the file changed after read_parquet_embeddings (open it "
                         "again)")


def read_parquet_piece(file, row_groups, column, D, dtype, row0=0, batch_rows=8192,
                       rows=None, stamp=None):
    """Read the embedding column of some row groups of one file as an ``(n, D)`` array.

    Decoded ``batch_rows`` rows at a time straight into one NumPy array, and Arrow's pool
    handed its unused memory back afterwards: a chunk costs its own size plus one small
    batch, and Arrow's allocator (mimalloc / jemalloc) does not keep the pages of every
    chunk a streaming pass has read.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    where = _where(file, row_groups)
    _unchanged(file, stamp)
    try:
        with pq.ParquetFile(file, pre_buffer=False, buffer_size=1 << 22,
                            page_checksum_verification=True) as pf:
            if max(row_groups) >= pf.metadata.num_row_groups:
                _planned(where, file, 0, rows if rows else None)
            n = sum(pf.metadata.row_group(rg).num_rows for rg in row_groups)
            _planned(where, file, n, rows)
            out = np.empty((n, D), dtype=dtype)
            r = 0
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=row_groups,
                                         columns=[column], use_threads=False):
                m = batch.num_rows
                out[r:r + m] = embedding_block(batch.column(0), D, dtype, where, row0 + r,
                                               column)
                r += m
                del batch
    except OSError as e:          # a failed page checksum included: name the file
        raise OSError(f"{file} ({where}): {e}") from e
    if r != n:
        raise ValueError(f"{where} of {file} has {r} rows; its metadata says {n}")
    pa.default_memory_pool().release_unused()
    return out


def read_parquet_values(file, row_groups, column, dtype, row0=0, rows=None, stamp=None):
    """A scalar column (weights, ids) of some row groups of one file as a 1-D array. A null
    is an error naming its row (counted like the embeddings' rows, from ``row0``): a null
    id or weight has no value to give (converting it would turn ids into floats)."""
    import pyarrow.parquet as pq
    where = _where(file, row_groups)
    _unchanged(file, stamp)
    try:
        with pq.ParquetFile(file, page_checksum_verification=True) as pf:
            if max(row_groups) >= pf.metadata.num_row_groups:
                _planned(where, file, 0, rows if rows else None)
            tab = pf.read_row_groups(row_groups, columns=[column])
    except OSError as e:          # a failed page checksum included: name the file
        raise OSError(f"{file}: {e}") from e
    col = tab.column(0)
    _planned(where, file, len(col), rows)
    if col.null_count:
        i = int(np.argwhere(col.is_null().to_numpy(zero_copy_only=False))[0, 0])
        raise ValueError(f"column {column!r} has a null in {where}, row {row0 + i} "
                         f"({col.null_count} null(s) there)")
    out = col.to_numpy() if col.num_chunks else np.zeros(0)
    return np.asarray(out, dtype=dtype) if dtype != object else np.asarray(out, dtype=object)


def _open_parquet_file(pq, f):
    """``pq.ParquetFile(f)``; a file that is not Parquet (truncated, empty, another format)
    is a ValueError naming it: in a folder of thousands, pyarrow's own message does not."""
    try:
        return pq.ParquetFile(f)
    except (OSError, ValueError) as e:       # (pyarrow.ArrowInvalid is a ValueError)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{f} is not a readable Parquet file ({first}); remove or replace "
                         "it") from None


def read_parquet_embeddings(path, column="embedding", weight=None, id=None, *, dtype=None,
                            rows_per_chunk=None):
    """Open a Parquet dataset lazily as Dask arrays of rows (+ weights and ids).

    Only the metadata is read here; each chunk is read by a worker when it is needed.

    Parameters
    ----------
    path : str, path-like, list of paths, or a glob
        A Parquet file, a folder of Parquet files (recursively; names starting with ``.``
        or ``_`` are skipped) or a list of files.
    column : str, default="embedding"
        The embedding column: ``fixed_size_list<float>`` or ``list<float>`` (every row must
        have the same length; integers are accepted and converted).
    weight, id : str or None
        Optional columns of sample weights (numbers) and of row ids (any primitive type).
    dtype : numpy dtype or None
        Of the rows. None: float32 for float16/float32 values, float64 otherwise.
    rows_per_chunk : int or None
        None: one chunk per row group. An int: consecutive row groups of a file are joined
        into chunks of at most this many rows (a row group is never split: a larger one is
        a chunk of its own).

    Returns
    -------
    EmbeddingArrays
        ``(X, weights, ids)``: ``X`` a Dask array ``(n, D)`` with one column chunk,
        ``weights`` (float64) and ``ids`` Dask arrays with the same row chunks, or None.

    Raises
    ------
    ValueError
        A missing column (the message lists the columns present), or an embedding column
        that is not a list of numbers.
    """
    import dask
    import dask.array as da
    import pyarrow.parquet as pq

    files = _parquet_files(path)
    pieces = []          # (file, [row groups], rows)
    D = None
    vt0 = None
    kind0 = None
    id_dtype = None
    for f in files:
        with _open_parquet_file(pq, f) as pf:
            schema = pf.schema_arrow
            names = schema.names
            for what, col in (("embedding", column), ("weight", weight), ("id", id)):
                if col is not None and col not in names:
                    raise ValueError(f"{what} column {col!r} not found in {f}; available "
                                     f"columns: {names}")
            kind, Df, vt = _embedding_info(schema.field(column), f)
            if weight is not None:
                import pyarrow as pa
                wt = schema.field(weight).type
                if not (pa.types.is_floating(wt) or pa.types.is_integer(wt)):
                    raise ValueError(f"weight column {weight!r} of {f} has type {wt}; expected "
                                     "numbers")
            if id is not None:
                t = schema.field(id).type.to_pandas_dtype()
                t = np.dtype(object) if t in (object, np.object_) else np.dtype(t)
                if id_dtype is None:
                    id_dtype = t
                elif id_dtype != t:
                    id_dtype = np.dtype(object)
            if vt0 is None or _value_dtype(vt) == np.float64:
                vt0, kind0 = vt, kind       # the widest value type over the files
            if Df is not None:
                if D is not None and Df != D:
                    raise ValueError(f"column {column!r} of {f} has {Df} dimensions; earlier "
                                     f"files have {D}")
                D = Df
            md = pf.metadata
            group, rows = [], 0
            for rg in range(md.num_row_groups):
                nr = md.row_group(rg).num_rows
                if group and (rows_per_chunk is None or rows + nr > rows_per_chunk):
                    pieces.append((f, group, rows))
                    group, rows = [], 0
                group.append(rg)
                rows += nr
            if group:
                pieces.append((f, group, rows))
            if D is None:
                # list<float>: the dimension is the length of the first embedding
                for rg in range(md.num_row_groups):
                    if md.row_group(rg).num_rows:
                        tab = pf.read_row_group(rg, columns=[column])
                        first = tab.column(0).slice(0, 1).combine_chunks()
                        if first.null_count:
                            raise ValueError(f"column {column!r} has a null embedding in "
                                             f"{os.path.basename(f)} row group {rg}, row 0")
                        D = int(first.value_lengths()[0].as_py())
                        break
    if D is None:
        D = 0
    if dtype is None:
        dtype = _value_dtype(vt0)
    dtype = np.dtype(dtype)
    blocks, wblocks, iblocks = [], [], []
    row0 = int(_config.ROW_BASE.get())           # (rows in messages: the command counts from 1)
    tok = dask.base.tokenize(files, column, weight, id, str(dtype), rows_per_chunk, row0,
                             [os.path.getmtime(f) if os.path.exists(f) else 0 for f in files])
    given = [path] if isinstance(path, (str, os.PathLike)) and os.path.exists(path) else files
    _INPUT_PATHS[tok] = sorted({os.fspath(p) for p in given} | set(files))
    stamps = {f: file_stamp(f) for f in files}
    for j, (f, rgs, rows) in enumerate(pieces):
        x = dask.delayed(read_parquet_piece, pure=True)(
            f, rgs, column, D, dtype, row0, rows=rows, stamp=stamps.get(f),
            dask_key_name=f"read-embeddings-{tok}-{j}")
        blocks.append(da.from_delayed(x, shape=(rows, D), dtype=dtype))
        if weight is not None:
            wv = dask.delayed(read_parquet_values, pure=True)(
                f, rgs, weight, np.float64, row0, rows, stamp=stamps.get(f),
                dask_key_name=f"read-weights-{tok}-{j}")
            wblocks.append(da.from_delayed(wv, shape=(rows,), dtype=np.float64))
        if id is not None:
            iv = dask.delayed(read_parquet_values, pure=True)(
                f, rgs, id, id_dtype, row0, rows, stamp=stamps.get(f),
                dask_key_name=f"read-ids-{tok}-{j}")
            iblocks.append(da.from_delayed(iv, shape=(rows,), dtype=id_dtype))
        row0 += rows
    if not blocks:
        return EmbeddingArrays(da.zeros((0, D), dtype=dtype, chunks=(1, D)),
                               da.zeros(0, chunks=1) if weight is not None else None,
                               da.zeros(0, chunks=1, dtype=id_dtype) if id is not None else None)
    X = da.concatenate(blocks, axis=0)
    W = da.concatenate(wblocks) if weight is not None else None
    ids = da.concatenate(iblocks) if id is not None else None
    for a in (X, W, ids):           # (the names survive persist(); the read layers do not)
        if a is not None:
            _INPUT_PATHS[a.name] = _INPUT_PATHS[tok]
    return EmbeddingArrays(X, W, ids)


# ------------------------------------------------------------------------- DataFrames
def _frame_embedding(pdf, column, D, dtype, index, where_prefix="partition"):
    import pyarrow as pa
    s = pdf[column]
    try:
        arr = pa.array(s)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        arr = pa.array([None if v is None else np.asarray(v).tolist() for v in s])
    return embedding_block(arr, D, dtype, f"{where_prefix} {index}", 0, column)


def _frame_values(pdf, column, dtype):
    return np.asarray(pdf[column].to_numpy(), dtype=dtype)


def embeddings_from_dataframe(df, column=None, weight=None, id=None, *, dtype=None):
    """Dask arrays of rows (+ weights and ids) from a Dask DataFrame with an embedding column
    (Arrow list / fixed-size list, or an object column of sequences).

    ``column=None`` (default): the column ``"embedding"`` when the frame has one, else all
    its numeric columns (but ``weight`` and ``id``) are the features -- name the weight and
    id columns, or they become features too. A ``column`` that is named but not in the
    frame is an error.

    Partition lengths are computed once (``len`` of each partition) so that the row chunks
    are known.
    """
    import dask
    import dask.array as da

    names = list(df.columns)
    for what, col in (("weight", weight), ("id", id)):
        if col is not None and col not in names:
            raise ValueError(f"{what} column {col!r} not found; available columns: {names}")
    if column is not None and column not in names:
        raise ValueError(f"embedding column {column!r} not found; available columns: {names}")
    if column is None and "embedding" in names:
        column = "embedding"
    lengths = tuple(int(n) for n in df.map_partitions(len).compute())
    if column is not None:
        head = df[column].partitions[0].compute() if df.npartitions else None
        first = next((v for v in (head if head is not None else [])), None)
        if first is None:
            # find the first non-empty partition
            for p in range(df.npartitions):
                part = df[column].partitions[p].compute()
                if len(part):
                    first = part.iloc[0]
                    break
        if first is None:
            raise ValueError(f"column {column!r} has no rows")
        if isinstance(first, (str, bytes)) or not hasattr(first, "__len__") or not (
                np.asarray(first).ndim == 1 and np.asarray(first).dtype.kind in "iuf"):
            raise ValueError(f"embedding column {column!r} holds {type(first).__name__} values "
                             f"(first: {str(first)[:60]!r}); expected a list of numbers per "
                             "row (a Dask DataFrame may have turned an object column of arrays "
                             "into strings: store the embeddings as an Arrow list column)")
        D = len(first)
        if dtype is None:
            small = np.asarray(first).dtype in (np.float32, np.float16)
            dtype = np.float32 if small else np.float64
        dtype = np.dtype(dtype)
        parts = df.to_delayed()
        read = dask.delayed(_frame_embedding, pure=True)
        blocks = [da.from_delayed(read(p, column, D, dtype, i), shape=(n, D), dtype=dtype)
                  for i, (p, n) in enumerate(zip(parts, lengths))]
        X = da.concatenate(blocks, axis=0)
    else:
        from pandas.api.types import is_bool_dtype, is_numeric_dtype
        feats = [c for c in names if c not in (weight, id)
                 and is_numeric_dtype(df[c].dtype) and not is_bool_dtype(df[c].dtype)]
        if not feats:
            raise ValueError(f"no 'embedding' column and no numeric columns; available "
                             f"columns: {names}")
        plain = all(isinstance(df[c].dtype, np.dtype) for c in feats)
        X = (df[feats] if plain else df[feats].astype(dtype or np.float64)).to_dask_array(
            lengths=lengths)
        if dtype is not None:
            X = X.astype(dtype)
        X = X.rechunk({1: -1})
    parts = df.to_delayed() if (weight is not None or id is not None) else None
    W = ids = None
    if weight is not None:
        W = da.concatenate([da.from_delayed(dask.delayed(_frame_values, pure=True)(
            p, weight, np.float64), shape=(n,), dtype=np.float64)
            for p, n in zip(parts, lengths)])
    if id is not None:
        idd = df[id].dtype
        idt = idd if isinstance(idd, np.dtype) and idd.kind in "iufb" else np.dtype(object)
        ids = da.concatenate([da.from_delayed(dask.delayed(_frame_values, pure=True)(
            p, id, idt), shape=(n,), dtype=idt) for p, n in zip(parts, lengths)])
    return EmbeddingArrays(X, W, ids)


# ------------------------------------------------------------------------- coercion
def _default_rows(n_features, itemsize):
    return max(1, DEFAULT_CHUNK_BYTES // max(1, n_features * itemsize))


def _as_aligned(v, chunks, name):
    """A 1-D Dask array with the given row chunks (or None)."""
    import dask.array as da
    if v is None:
        return None
    n = sum(chunks)
    if is_dask_collection(v) and not hasattr(v, "chunks") and hasattr(v, "to_dask_array"):
        v = v.to_dask_array(lengths=True)            # a Dask Series
    if is_dask_collection(v):
        if v.ndim != 1:
            raise ValueError(f"{name} must be 1-D; got {v.ndim} dimensions")
        if any(math.isnan(c) for c in v.chunks[0]):
            v = v.compute_chunk_sizes()
        if v.shape[0] != n:
            raise ValueError(f"{name} has {v.shape[0]} entries for {n} rows")
        return v.rechunk((chunks,)) if v.chunks[0] != tuple(chunks) else v
    a = np.asarray(v)
    if a.ndim == 0:
        if a.dtype.kind not in "iuf":
            raise ValueError(f"{name} must be numeric; got {a.dtype}")
        return da.full(n, float(a), chunks=(chunks,))
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},); got {a.shape}")
    return da.from_array(a, chunks=(chunks,))


class SmallChunksWarning(UserWarning):
    """Input whose chunking makes the Dask route slow (many tiny chunks)."""


#: more chunks than this with fewer than TINY_CHUNK_ROWS rows each on average: a warning
TINY_CHUNKS_MIN = 64
TINY_CHUNK_ROWS = 1024


def as_dask_inputs(X, sample_weight=None, ids=None, *, chunk_rows=None, column=None):
    """Coerce the inputs of the Dask backend to :class:`EmbeddingArrays` with known row chunks
    and a single column chunk.

    ``X`` may be a Dask array, a Dask DataFrame (an ``embedding`` list column, or numeric
    columns), a path to Parquet data (read with :func:`read_parquet_embeddings`), an
    :class:`EmbeddingArrays`, or a NumPy array (split into chunks of ``chunk_rows`` rows,
    default about 64 MiB).
    """
    import dask.array as da

    w_in, id_in = None, None
    if isinstance(X, EmbeddingArrays):
        X, w_in, id_in = X
    elif isinstance(X, (str, os.PathLike)) or (isinstance(X, (list, tuple)) and X
                                               and isinstance(X[0], (str, os.PathLike))):
        X, w_in, id_in = read_parquet_embeddings(X, column=column or "embedding")
    elif _is_dask_dataframe(X):
        X, w_in, id_in = embeddings_from_dataframe(X, column=column)
    if sample_weight is None:
        sample_weight = w_in
    if ids is None:
        ids = id_in
    if is_dask_collection(X):
        if not hasattr(X, "chunks") or X.ndim != 2:
            raise ValueError(f"X must be a 2-D Dask array; got {type(X).__name__} with "
                             f"{getattr(X, 'ndim', '?')} dimensions")
    else:
        A = np.asarray(X)
        if A.dtype == object:
            raise ValueError("X has dtype object; expected a numeric 2-D array")
        if A.ndim != 2:
            raise ValueError(f"X must be 2-D (n_samples, n_features); got shape {A.shape}")
        rows = chunk_rows or _default_rows(A.shape[1], A.dtype.itemsize)
        X = da.from_array(A, chunks=(rows, -1))
    if any(math.isnan(c) for c in X.chunks[0]):
        X = X.compute_chunk_sizes()
    if X.shape[1] == 0:
        raise ValueError("X has 0 features; at least 1 is required")
    if len(X.chunks[1]) != 1:
        X = X.rechunk({1: -1})
    chunks = X.chunks[0]
    if len(chunks) > TINY_CHUNKS_MIN and X.shape[0] < TINY_CHUNK_ROWS * len(chunks):
        import warnings
        warnings.warn(
            f"the rows come in {len(chunks):,} chunks of {X.shape[0] / len(chunks):,.0f} rows "
            "on average: every chunk is a task in every pass, so passes cost scheduling more "
            f"than arithmetic; use chunks of >= {TINY_CHUNK_ROWS:,} rows (a Dask array: "
            "X.rechunk({0: 100_000}); Parquet: larger row groups, or "
            "read_parquet_embeddings(rows_per_chunk=100_000))", SmallChunksWarning,
            stacklevel=3)
    return EmbeddingArrays(X, _as_aligned(sample_weight, chunks, "sample_weight"),
                           _as_aligned(ids, chunks, "ids"))

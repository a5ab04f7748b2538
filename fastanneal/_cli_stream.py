"""The ``fastanneal cluster`` route for Parquet logs with an embedding column: nothing of the
log is held beyond what the chosen route needs.

* **In memory** (the embeddings fit ``--memory-limit``): the embedding column is decoded row
  group by row group straight into one float32/float64 matrix (no Arrow copy kept), the
  small columns (weights, ids, texts, truth) are read alone, and the output is written row
  group by row group from the input file (the input table is never held whole).
* **Out of core** (they do not): the checks of the ids and weights, mini-batch annealing
  over the row groups (:class:`fastanneal._parquet.ParquetStream`, or the Dask workers),
  one labelling pass (assignments and :class:`fastanneal._cli_results.ClusterSummary`) and
  one writing pass, each one row group (:class:`LogPiece`) at a time
  (:mod:`fastanneal._cli_pieces`): only the per-row results are kept, 24 bytes a row (on
  the workers with ``--backend dask``). Ids, weights, texts and truth are never columns of
  the whole log in memory.
"""
import math
import os
import re

import numpy as np

from ._io import InputError, embedding_matrix
from ._parquet import release_decoded

__all__ = ["parse_size", "default_memory_limit", "ParquetLog"]

#: Rows per decoded block of the embeddings (:meth:`ParquetLog.embeddings`, and the
#: labelling pass out of core: :meth:`ParquetLog.blocks`).
BLOCK_ROWS = 16384
#: The default ``--memory-limit``: this share of the machine's memory.
MEMORY_FRACTION = 0.5
#: Bytes the in-memory route needs per byte of embeddings (the matrix, the fit's working
#: memory, the per-row results) -- measured by ``benchmarks/bench_scale.py``.
IN_MEMORY_FACTOR = 1.5
#: ... plus this many bytes per row (labels, distances, weights, row numbers).
IN_MEMORY_ROW_BYTES = 48


def parse_size(text):
    """``"8G"``, ``"500M"``, ``"2.5GB"``, ``"1e9"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8G, 500M, 2.5GB)")
    unit = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}[m.group(2).lower()]
    try:
        v = float(m.group(1)) * unit
    except ValueError:                  # "1.2.3"
        raise ValueError(f"not a size: {text!r} (examples: 8G, 500M, 2.5GB)") from None
    if not math.isfinite(v) or v > 2 ** 62:
        raise ValueError(f"not a size: {text!r} is too large (examples: 8G, 500M, 2.5GB)")
    return int(v)


def total_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 * 2 ** 30


def default_memory_limit():
    return int(MEMORY_FRACTION * total_memory())


def fmt_bytes(b):
    for unit, f in (("GB", 2 ** 30), ("MB", 2 ** 20), ("kB", 2 ** 10)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{b} B"


def checked_embeddings(table, column, source, row0, dim, dtype):
    """The embedding column of a block of the log as ``(n, dim)`` rows of ``dtype``
    (checked: no missing or non-finite values, the log's width)."""
    x = embedding_matrix(table, column, source, row0)
    if x.shape[1] != dim:
        raise InputError(f"{source}: ragged embeddings in column {column!r}: row {row0 + 1} "
                         f"has {x.shape[1]} values, row 1 has {dim}")
    if x.dtype != dtype:
        x = x.astype(dtype)
    return x


class LogPiece:
    """One row group of a :class:`ParquetLog`: all that a process (a Dask worker) needs to
    read it on its own -- the fragment, the dataset's schema, its first row's number in
    the log and the embedding column's width and type. Picklable (about 2 kB)."""

    def __init__(self, log, i):
        d = log.data
        self.source = log.path
        frag = d.pieces[i]
        # the file, the row group and the hive partition's values, not the pyarrow fragment:
        # a fragment pickled again opens its file, so the Dask scheduler (which re-pickles
        # each task) had to see the data -- where it could not, the tasks failed to
        # serialize and the user's workers shut down
        self.path = frag.path
        self.row_group = int(frag.row_groups[0].id)
        self.partition = frag.partition_expression
        self._fragment = frag
        self.schema = d.schema
        self.index = int(i)
        self.row0 = int(d.offsets[i])
        self.n_rows = int(d.piece_rows[i])
        self.where = d.where(i)
        self.column = log.args.embedding_column
        self.dim = log.dim
        self.dtype = log.dtype
        # the file as the command opened it: every pass (checks, labelling, writing) reads
        # it again, on Dask on the workers (a file replaced after the fit was labelled and
        # written from its new rows with the old centers, exit 0)
        self.stamp = d.stamps.get(self.path)
        self.stat = d._stats.get(self.path)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fragment"] = None
        return state

    @property
    def fragment(self):
        """The row group as a pyarrow fragment (made again where the piece was unpickled)."""
        if self._fragment is None:
            from pyarrow.fs import LocalFileSystem

            from ._parquet import _scan_format
            self._fragment = _scan_format().make_fragment(
                self.path, filesystem=LocalFileSystem(), partition_expression=self.partition,
                row_groups=[self.row_group])
        return self._fragment

    def check_unchanged(self):
        from ._parquet import changed_message, file_changed
        if file_changed(self.path, self.stat, self.stamp):
            raise InputError(changed_message(self.path))

    def embeddings(self, table, row0):
        return checked_embeddings(table, self.column, self.source, row0, self.dim, self.dtype)

    def blocks(self, cols, rows=BLOCK_ROWS, prefetch=0):
        """``(row0, embeddings, table)`` blocks of at most ``rows`` rows (the embedding
        column and ``cols``); ``prefetch``: blocks decoded ahead in a background thread."""
        from ._parquet import prefetched
        cols = list(dict.fromkeys([self.column] + [c for c in cols if c]))
        reader = self.batches(cols, rows)
        it = reader
        if prefetch:
            # one call more than the blocks: the last one ends the reader (its row check)
            n_blocks = -(-self.n_rows // max(int(rows), 1))
            it = (b for _, b in prefetched(lambda _j: next(reader, None),
                                           range(n_blocks + 1), depth=prefetch))
        for b in it:
            if b is None:
                return
            r0, t = b
            yield r0, self.embeddings(t, r0), t

    def batches(self, cols, rows=BLOCK_ROWS):
        """``(row0, table)`` blocks of at most ``rows`` rows of ``cols``, in order, decoded
        from the row group's pages (checksummed); columns that are not in the file (hive
        partitions) from the fragment's table, sliced. A read error names the file and the
        row group; so does a row count that differs from the metadata."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        cols = list(cols)
        rows = int(rows)
        r0 = self.row0
        release_decoded()
        self.check_unchanged()
        try:
            with pq.ParquetFile(self.path, pre_buffer=False, buffer_size=1 << 22,
                                page_checksum_verification=True) as pf:
                physical = set(pf.schema_arrow.names) >= set(cols) and cols
                if physical:
                    for b in pf.iter_batches(batch_size=rows, columns=cols, use_threads=False,
                                             row_groups=[self.row_group]):
                        t = pa.Table.from_batches([b])
                        yield r0, t
                        r0 += t.num_rows
            if not physical:
                t = self.fragment.to_table(schema=self.schema, columns=cols, use_threads=False)
                for s in range(0, t.num_rows, rows):
                    b = t.slice(s, rows)
                    yield r0, b
                    r0 += b.num_rows
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"cannot read {self.source} ({self.where}): {e}") from None
        self.check_unchanged()             # (replaced while this row group was read)
        got = r0 - self.row0
        if got != self.n_rows:
            raise InputError(f"{self.source} ({self.where}): {got} rows read; the metadata "
                             f"says {self.n_rows}")


class ParquetLog:
    """A Parquet input of ``fastanneal cluster``: its row groups, the checked columns, the
    embedding width and the route (``"memory"`` or ``"stream"``) under a memory limit."""

    def __init__(self, path, args):
        import pyarrow as pa

        from ._parquet import ParquetDataset
        self.path = str(path)
        try:
            self.data = ParquetDataset(path)
        except FileNotFoundError:
            raise InputError(f"{path}: no such file or folder") from None
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{path}: cannot read as PARQUET: {e}") from None
        names = self.data.column_names
        if not names:
            raise InputError(f"{path}: no columns")
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InputError(f"{path}: the column name {dup!r} appears more than once; column "
                             "names must be unique")
        if self.data.n_rows == 0:
            raise InputError(f"{path}: no rows (only a header or an empty dataset)")
        self.args = args
        self.n_rows = self.data.n_rows
        self.column_names = names
        cols = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        for what, c in (("embedding column", args.embedding_column),
                        ("weight column", args.weight_column), ("id column", args.id_column)):
            if c is not None and c not in names:
                raise InputError(f"{path}: {what} {c!r} not found (columns: {cols})")
        if args.truth_column and args.truth_column not in names:
            raise InputError(f"{path}: truth column {args.truth_column!r} not found "
                             f"(columns: {cols})")
        self.has_text = args.text_column in names
        if getattr(args, "text_column_given", args.text_column != "query") and \
                not self.has_text:
            raise InputError(f"{path}: text column {args.text_column!r} not found "
                             f"(columns: {cols})")
        # the width and value type of the embeddings, from the first row
        first = next((i for i, r in enumerate(self.data.piece_rows) if r), 0)
        import pyarrow as pa
        import pyarrow.parquet as pq
        piece = self.data.pieces[first]
        try:            # one row (a dataset scan would read several row groups ahead)
            with pq.ParquetFile(piece.path, pre_buffer=False, buffer_size=1 << 20) as pf:
                b = next(pf.iter_batches(batch_size=1, row_groups=[piece.row_groups[0].id],
                                         columns=[args.embedding_column]))
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{path}: cannot read as PARQUET: {e}") from None
        t = pa.Table.from_batches([b]).slice(0, 1)
        x0 = embedding_matrix(t, args.embedding_column, path, int(self.data.offsets[first]))
        self.dim = int(x0.shape[1])
        self.dtype = x0.dtype
        self.embedding_bytes = self.n_rows * self.dim * self.dtype.itemsize

    @property
    def in_memory_bytes(self):
        """What the in-memory route needs: ``IN_MEMORY_FACTOR`` times the embedding bytes
        plus ``IN_MEMORY_ROW_BYTES`` per row."""
        return IN_MEMORY_FACTOR * self.embedding_bytes + IN_MEMORY_ROW_BYTES * self.n_rows

    def route(self, limit):
        """``"memory"`` when :attr:`in_memory_bytes` fit ``limit`` bytes."""
        return "memory" if self.in_memory_bytes <= limit else "stream"

    def _tables(self, cols):
        """``data.tables`` with read errors as one-line input errors."""
        from ._parquet import ParquetReadError
        it = self.data.tables(cols)
        while True:
            try:
                i, t = next(it)
            except StopIteration:
                return
            except ParquetReadError as e:
                raise InputError(f"cannot read {e}") from None
            yield i, t

    def small_table(self, with_text):
        """The weight, id, truth (and text) columns of every row, as one Arrow table."""
        a = self.args
        cols = [c for c in (a.weight_column, a.id_column, a.truth_column) if c]
        if with_text and self.has_text:
            cols.append(a.text_column)
        cols = list(dict.fromkeys(cols))
        import pyarrow as pa
        if not cols:
            return pa.table({"_": pa.nulls(self.n_rows)}).drop_columns(["_"])
        try:
            t = self.data.dataset.to_table(columns=cols)
        except (OSError, pa.ArrowException) as e:
            raise InputError(f"{self.path}: cannot read as PARQUET: {e}") from None
        release_decoded()             # the decoding buffers of the read
        return t

    def embeddings(self, st=None):
        """The embedding column as one ``(n, D)`` matrix, decoded row group by row group
        into it (checked: no missing rows, equal widths, finite values)."""
        X = np.empty((self.n_rows, self.dim), dtype=self.dtype)
        # small batches straight into X (no row group held whole); pages are checksummed
        for r0, t in self._batches([self.args.embedding_column], BLOCK_ROWS):
            x = self._block(t, r0)
            X[r0:r0 + x.shape[0]] = x
            if st is not None:
                st.update(x.shape[0])
        release_decoded()             # the last row group's pages, freed by now
        return X

    def _block(self, table, row0):
        return checked_embeddings(table, self.args.embedding_column, self.path, row0,
                                  self.dim, self.dtype)

    def piece(self, i):
        """Row group ``i`` as a :class:`LogPiece` (what a Dask worker needs to read it)."""
        return LogPiece(self, i)

    def blocks(self, columns, rows=None):
        """``(row0, embeddings, table)`` of every row in order, in blocks of at most ``rows``
        rows decoded straight from the row groups' pages (two blocks read ahead): the
        working set is a few blocks, not whole row groups (decoding a 65,536-row group of
        384-d float32 as one table peaks at about 250 MB). Columns that are not in the
        files (hive partitions) come from whole row-group tables, sliced."""
        rows = int(rows or BLOCK_ROWS)
        for i in range(len(self.data.pieces)):
            yield from self.piece(i).blocks(columns, rows, prefetch=2)

    def _batches(self, cols, rows):
        """``(row0, table)`` blocks of ``rows`` rows of every row group, in order (pages
        checksummed; a read error names the file and the row group)."""
        for i in range(len(self.data.pieces)):
            yield from self.piece(i).batches(cols, rows)

    def output_columns(self, drop, results):
        """The input columns the output keeps: all but ``drop`` and those that the result
        columns (names in ``results``) replace."""
        return [c for c in self.column_names if c not in set(drop) and c not in results]

    def write(self, writer, drop, results, st=None):
        """Copy every row group of the input (minus ``drop``) with the result columns
        appended (``results``: name -> array of all rows) into ``writer``."""
        import pyarrow as pa
        keep = self.output_columns(drop, results)
        for i, t in self._tables(keep):
            r0 = int(self.data.offsets[i])
            n = t.num_rows
            for name, values in results.items():
                t = t.append_column(name, pa.array(values[r0:r0 + n]))
            writer.write(t)
            if st is not None:
                st.update(n)


def fit_stream(log, args, console):
    """Mini-batch annealing over the row groups of ``log`` (out of core)."""
    import warnings

    from ._parquet import ParquetStream
    from .cli import CLIError, _as_flags, fit_result
    from .estimator import MiniBatchAnnealedKMeans
    from ._validation import metric_code
    if args.schedule == "critical":
        raise CLIError("--schedule critical needs the embeddings in memory; use the default "
                       "schedule out of core, or raise --memory-limit")
    def local_stream(device=None):
        s = ParquetStream(log.data, args.embedding_column, args.weight_column, None,
                          metric_code(args.metric), log.dtype, device=device)
        s.row_base = 1                      # rows counted from 1, as the in-memory route
        return s
    suggestion = None
    if args.k == "auto":
        try:
            stream = local_stream()
        except ValueError as e:
            raise CLIError(f"cannot read {log.path}: {_as_flags(e)}") from None
        # choosing K out of core: the phase-transition path on a uniform sample of the
        # row groups (suggest_k's max_rows), then the mini-batch fit with that K
        from .choose_k import STREAM_ROWS, suggest_k
        console.note(f"choosing K on a sample of {min(STREAM_ROWS, log.n_rows):,} rows "
                     "(out of core)")
        from ._parquet import ParquetReadError
        try:
            suggestion = suggest_k(stream, k_max=int(args.k_max), metric=args.metric,
                                   random_state=int(args.seed))
        except ParquetReadError as e:
            raise CLIError(f"cannot read {e}") from None
        except ValueError as e:
            raise CLIError(f"cannot rank K: {_as_flags(e, args)}") from None
    kw = dict(n_clusters=int(args.k) if suggestion is None else int(suggestion.best),
              metric=args.metric,
              responsibilities=args.responsibilities, schedule=args.schedule,
              n_steps=int(args.steps), random_state=int(args.seed), progress=console.bars)
    if args.checkpoint:
        kw["checkpoint"] = args.checkpoint
    from ._parquet import ParquetReadError
    from .dask._chunks import NonFiniteRows
    # the fit's passes: on the Dask workers (each reads its own row groups) or in this process
    if args.backend == "dask":
        kw["scheduler"] = args._dask_scheduler
        data = dask_inputs(log, args, console)
    else:
        # --backend cuda: the row groups are decoded here and each batch reduced on the GPU
        try:
            data = local_stream("cuda" if args.backend == "cuda" else None)
        except ValueError as e:
            raise CLIError(f"cannot read {log.path}: {_as_flags(e)}") from None
    est = MiniBatchAnnealedKMeans(**kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(data)
        except ParquetReadError as e:
            raise CLIError(f"cannot read {e}") from None
        except NonFiniteRows as e:
            # named as the in-memory route names it (the file, the column and the row), not
            # as the library's "X ... in chunk 5"
            why = "; the cosine metric needs non-zero vectors" if "zero" in e.kind else ""
            raise CLIError(f"{log.path}: embedding column {args.embedding_column!r} "
                           f"contains {e.kind} at row {e.row}{why}") from None
        except ValueError as e:
            raise CLIError(f"cannot cluster: {_as_flags(e, args)}") from None
    if suggestion is not None:
        est.n_clusters_, est.k_suggestion_ = int(suggestion.best), suggestion
    return fit_result(est, args, console, caught)


def dask_inputs(log, args, console):
    """The row groups of ``log`` as lazy Dask arrays (:func:`fastanneal.dask.
    read_parquet_embeddings`: one chunk per row group, read by the worker that needs it), for
    the mini-batch fit on the cluster of ``--backend dask``: the client and the scheduler
    see metadata and moments only."""
    from .cli import CLIError
    from .dask import read_parquet_embeddings
    try:
        arrays = read_parquet_embeddings(log.path, args.embedding_column,
                                         weight=args.weight_column, dtype=log.dtype)
    except (OSError, ValueError) as e:
        raise CLIError(f"cannot read {log.path} on the Dask cluster: {e}") from None
    console.note(f"out of core on the Dask cluster: {arrays.X.numblocks[0]:,} chunks (row "
                 "groups), each read by the worker that needs it")
    return arrays

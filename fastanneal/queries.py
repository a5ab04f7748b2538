"""Labelled clusters of a query log from Python: what ``fastanneal cluster`` writes, as one
object (``fastanneal.QueryClusters``)."""
import numpy as np

from ._moments import pinned_blas

__all__ = ["QueryClusters"]


def _missing(v):
    """None, NaN of any float type, NaT, pandas' NA: no id (a value unequal to itself, or
    one whose comparison has no truth value)."""
    if v is None:
        return True
    try:
        return bool(v != v)
    except TypeError:               # pandas.NA: its comparisons are NA
        return True


class QueryClusters:
    """Cluster queries (texts and/or embeddings) and describe the clusters.

    Parameters
    ----------
    n_clusters : int or "auto", default=30
        ``"auto"``: chosen from the phase transitions up to ``k_max`` (see
        :func:`fastanneal.suggest_k`).
    metric : {"cosine", "euclidean"}, default="cosine"
    k_max : int, default=50 (with ``n_clusters="auto"``)
    n_representatives : int, default=5
        Distinct queries per cluster in :meth:`cluster_info`, most central first.
    embed_precision : {"float32", "bfloat16"}, default="float32"
        When texts are embedded (no ``embeddings`` given): the precision of the model's
        matrix products. ``"float32"``: the exact all-MiniLM-L6-v2 vectors;
        ``"bfloat16"``: about 1.9x faster on CPUs with native bfloat16 (AVX512-BF16 or AMX),
        mean ``1 - cos`` about 1.5e-5 against the exact vectors.
    random_state : int, default=0
    **params
        Further :class:`fastanneal.AnnealedKMeans` parameters (``schedule``, ``n_steps``,
        ``backend``, ``checkpoint``, ``progress``, ``verbose``, ...).

    Attributes
    ----------
    estimator_ : AnnealedKMeans
        The fitted estimator (after :meth:`fit`). It numbers the clusters in its own order;
        :meth:`predict` and every table here number them largest first.
    labels_, probability_, margin_, runner_up_ : ndarray
        Per-row arrays; clusters are numbered largest (by weight) first, like the
        command's outputs. ``probability_`` is :meth:`AnnealedKMeans.predict_proba` of the
        row's cluster (the temperature chosen from the data).
    n_clusters_ : int

    Examples
    --------
    >>> import numpy as np, fastanneal
    >>> rng = np.random.default_rng(0)
    >>> E = np.concatenate([rng.normal(size=(50, 8)) + 6 * np.eye(8)[k] for k in range(3)])
    >>> texts = [f"{w} query {i}" for i, w in enumerate(["pin"] * 50 + ["flight"] * 50 +
    ...                                                   ["alarm"] * 50)]
    >>> qc = fastanneal.QueryClusters(3, random_state=0).fit(texts=texts, embeddings=E)
    >>> info = qc.cluster_info()
    >>> sorted(info.column("size").to_pylist())
    [50, 50, 50]
    >>> sorted(info.column("label").to_pylist())[0].split()[0] in ("alarm", "flight", "pin")
    True
    """

    def __init__(self, n_clusters=30, *, metric="cosine", k_max=50, n_representatives=5,
                 embed_precision="float32", random_state=0, **params):
        self.n_clusters = n_clusters
        self.metric = metric
        self.k_max = k_max
        self.n_representatives = n_representatives
        self.embed_precision = embed_precision
        self.random_state = random_state
        self.params = params

    # ------------------------------------------------------------------ fit
    @pinned_blas
    def fit(self, texts=None, embeddings=None, *, weights=None, ids=None):
        """Fit on ``embeddings`` ((n, D) array) and/or ``texts`` (n strings; embedded with
        ``fastanneal[embed]`` when no embeddings are given, each from its first 256 tokens
        like ``SentenceTransformer.encode``; numbers become their text, bytes are an
        error). ``weights``: query frequencies
        (>= 0). ``ids``: unique row ids carried to the outputs. Returns self."""
        from ._cli_results import label_clusters
        from ._validation import float_dtype_of
        from .estimator import AnnealedKMeans
        if texts is None and embeddings is None:
            raise ValueError("give texts, embeddings or both")
        nr = self.n_representatives
        if isinstance(nr, (bool, np.bool_)) or not isinstance(nr, (int, np.integer)) or nr < 0:
            raise ValueError("n_representatives must be an integer >= 0 (0: no "
                             f"representative_queries column); got {nr!r}")
        if self.embed_precision not in ("float32", "bfloat16"):
            raise ValueError("embed_precision must be 'float32' or 'bfloat16', got "
                             f"{self.embed_precision!r}")
        if texts is not None:
            texts = _checked_texts(texts)
        X = self._embeddings(texts, embeddings)
        self._embedded = embeddings is None     # (predict embeds new texts only then)
        n = X.shape[0]
        if texts is not None and len(texts) != n:
            raise ValueError(f"{len(texts)} texts for {n} embedding rows")
        id_array = None
        if ids is not None:
            ids, id_array = _checked_ids(ids, n)
        w = np.ones(n) if weights is None else _checked_weights(weights)
        kw = dict(n_clusters=self.n_clusters, metric=self.metric,
                  random_state=self.random_state, **self.params)
        if self.n_clusters == "auto":
            kw["k_max"] = self.k_max          # checked by the estimator (no int() rounding)
        try:
            est = AnnealedKMeans(**kw).fit(X, sample_weight=w)
        except ValueError as e:
            if self.n_clusters == "auto" and "k_max=" in str(e) and self.k_max == 50:
                raise ValueError(f"{e} (k_max is QueryClusters' default, 50: give a smaller "
                                 "k_max=)") from None
            raise
        w = est._validate_weights(w, n)
        lab = label_clusters(est, np.ascontiguousarray(X, dtype=float_dtype_of(X.dtype)),
                             w, texts, ids, int(self.n_representatives),
                             id_type=None if id_array is None else id_array.type)
        self.estimator_ = est
        self.n_clusters_ = int(est.cluster_centers_.shape[0])
        self.labels_ = lab.labels
        self.probability_ = lab.probability
        self.margin_ = lab.margin
        self.runner_up_ = lab.runner_up
        self._clusters = lab.clusters
        self._order = lab.order
        self._rank = lab.rank
        self._texts, self._ids, self._w = texts, id_array, w
        return self

    def _embeddings(self, texts, embeddings):
        """The rows to cluster or to predict: ``embeddings`` checked (2-D, finite), or
        the checked ``texts`` embedded (``fastanneal[embed]``)."""
        from ._io import InputError
        if embeddings is None:
            from .cli import _load_embedder, distinct_texts
            gap = next((i for i, t in enumerate(texts) if t is None), None)
            if gap is not None:
                raise ValueError(f"texts hold a missing value at row {gap} (None, NaN or NA); "
                                 "embedding needs every text: drop the row or give "
                                 "embeddings=")
            try:
                encode = _load_embedder(self.embed_precision)
            except InputError as e:
                raise ImportError(str(e).replace("with --embedding-column",
                                                 "as embeddings=")) from None
            distinct, inverse = distinct_texts(texts)     # each distinct text embedded once
            embeddings = _embed_chunks(encode, distinct, bool(self.params.get("progress")))
            embeddings = embeddings[inverse]
        X = np.asarray(embeddings)
        if X.ndim != 2:
            raise ValueError(f"embeddings must be 2-D (n, D); got shape {X.shape}")
        if np.issubdtype(X.dtype, np.number) and X.shape[0] and not np.isfinite(X).all():
            i, j = (int(v) for v in np.argwhere(~np.isfinite(X))[0])
            kind = "NaN" if np.isnan(X[i, j]) else "infinity"
            raise ValueError(f"embeddings hold {kind} at row {i} (column {j})")
        return X

    @pinned_blas
    def predict(self, texts=None, embeddings=None):
        """The clusters of new queries (``embeddings``, or ``texts`` embedded as in
        :meth:`fit`), numbered as :meth:`cluster_info` and ``labels_`` number them (largest
        first; ``estimator_.predict`` numbers them in the estimator's own order)."""
        self._check()
        if texts is None and embeddings is None:
            raise ValueError("give texts or embeddings")
        if embeddings is None and not self._embedded:
            raise ValueError("the fit clustered your embeddings: give embeddings= for the new "
                             "queries too (their texts alone would be embedded with "
                             "fastanneal's model, another space)")
        X = self._embeddings(None if texts is None else _checked_texts(texts), embeddings)
        if texts is not None and embeddings is not None and len(texts) != X.shape[0]:
            raise ValueError(f"{len(texts)} texts for {X.shape[0]} embedding rows")
        return self._rank[self.estimator_.predict(X)]

    def _check(self):
        if not hasattr(self, "estimator_"):
            raise RuntimeError("call fit() first")

    # ------------------------------------------------------------------ results
    def cluster_info(self):
        """The cluster table (``pyarrow.Table``), largest cluster first: cluster, size,
        weight, share, label (c-TF-IDF terms), central_query, representative_queries,
        cohesion (mean cosine to the center; Euclidean metric: minus the mean squared distance), terms, central_row (the central query's row,
        counted from 1 like a line of the input; ``assignments()["row"]`` counts from 0)
        and central_id (with ``ids``)."""
        self._check()
        return self._clusters

    def assignments(self):
        """One row per input row (``pyarrow.Table``): row (from 0), id, query (when given),
        cluster, probability, margin, runner_up."""
        import pyarrow as pa
        self._check()
        cols = {"row": np.arange(self.labels_.shape[0], dtype=np.int64)}
        if self._ids is not None:
            cols["id"] = self._ids          # (typed once: uint64 from 2^63 up)
        if self._texts is not None:
            cols["query"] = pa.array(self._texts, type=pa.string())
        cols.update(cluster=self.labels_, probability=self.probability_,
                    margin=self.margin_, runner_up=self.runner_up_)
        return pa.table(cols)

    @property
    def cluster_centers_(self):
        """Centers in the order of :meth:`cluster_info` (largest cluster first)."""
        self._check()
        return np.asarray(self.estimator_.cluster_centers_)[self._order]

    def to_parquet(self, path):
        """Write :meth:`assignments` to ``path`` (a ``.parquet`` name) and
        :meth:`cluster_info` next to it (``<stem>.clusters.parquet``), atomically."""
        return self.write(path, "parquet")

    def write(self, path, fmt=None):
        """Write :meth:`assignments` to ``path`` (format from the extension: .csv, .tsv,
        .parquet, .jsonl) and :meth:`cluster_info` to ``<stem>.clusters.<ext>`` (``ext``
        the format's own: ``x.pq`` -> ``x.clusters.parquet``, ``x.ndjson`` ->
        ``x.clusters.jsonl``), each written complete to a temporary file, then both renamed
        into place. Returns the two paths."""
        from ._io import OutputSet, check_writable, output_format, sidecar, write_table
        self._check()
        named = output_format(path)
        if fmt is not None and fmt != named:
            raise ValueError(f"{path}: a {fmt} file needs a .{fmt} name (this name says "
                             f"{named})")
        fmt = named
        ext = {"csv": ".csv", "tsv": ".tsv", "parquet": ".parquet", "jsonl": ".jsonl"}[fmt]
        side = sidecar(path, "clusters", ext)
        for p in (path, side):          # before any work: clear messages naming the path
            check_writable(p)
        with OutputSet() as outs:
            write_table(self.assignments(), outs.temp_for(path), fmt, ("id",))
            write_table(self._clusters, outs.temp_for(side), fmt, ("central_id",))
            outs.commit()
        return path, (str(side) if isinstance(path, str) else side)

    def report(self, path, title="fastanneal clusters"):
        """Write the self-contained HTML report atomically: the clusters first (searchable,
        sortable, with representative queries and nearest clusters), the ambiguous queries,
        the closest cluster pairs, the sizes, then the annealing diagnostics. Returns
        ``path``."""
        from ._io import atomic_write_bytes, check_writable
        from ._cli_results import ambiguous_margin
        from .report import ambiguous_rows, build_report
        self._check()
        check_writable(path)
        est = self.estimator_
        summary = [("rows", f"{self.labels_.shape[0]:,}"), ("clusters (K)", str(self.n_clusters_)),
                   ("metric", self.metric), ("objective J (inertia)", f"{est.inertia_:.6g}")]
        html = build_report(title=title, summary=summary, trace=est.trace_.as_dict(),
                            clusters=self._clusters, centers=self.cluster_centers_,
                            metric=self.metric,
                            k_suggestion=getattr(est, "k_suggestion_", None),
                            ambiguous=ambiguous_rows(self.probability_, self.labels_,
                                                     self.runner_up_, self.margin_,
                                                     self._texts,
                                                     below=ambiguous_margin(est)),
                            responsibilities=getattr(est, "responsibilities", "softmax"))
        atomic_write_bytes(path, html.encode("utf-8"))
        return path


def _checked_ids(ids, n):
    """``(ids as a list, ids as an Arrow array)``, checked as the command checks an id
    column: one per row, none missing, single values of one kind (numbers or strings: the
    outputs store them in one typed column), unique."""
    import pyarrow as pa
    ids = list(ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} ids for {n} rows")
    for i, v in enumerate(ids):
        if _missing(v):
            raise ValueError(f"ids have a missing value ({v!r}) at row {i}")
        if isinstance(v, str) and not v:
            raise ValueError(f"ids have an empty value ('') at row {i}")
    try:
        arr = pa.array(ids)
    except OverflowError:
        big = next((i for i, v in enumerate(ids)
                    if isinstance(v, (int, np.integer)) and not -2 ** 63 <= int(v) < 2 ** 64),
                   None)
        if big is not None:
            raise ValueError(f"ids must fit in 64-bit integers (or be strings): row {big} "
                             f"holds {ids[big]!r}") from None
        try:        # integers from 2^63 up (and none negative): unsigned 64-bit ids
            arr = pa.array(ids, type=pa.uint64())
        except (OverflowError, pa.ArrowException, TypeError, ValueError):
            raise ValueError("ids must fit one 64-bit integer type (or be strings): they mix "
                             "negative ids with ids of 2^63 or more") from None
    except (pa.ArrowException, TypeError, ValueError):
        arr = None
    if arr is not None and isinstance(arr.type, pa.BaseExtensionType):
        raise ValueError(f"ids of type {arr.type} (e.g. {ids[0]!r}) cannot be written to "
                         "every output format: give them as strings or integers "
                         "(e.g. [str(v) for v in ids])")
    if arr is None or pa.types.is_nested(arr.type) or pa.types.is_null(arr.type):
        kind = _id_kind(ids[0]) if ids else None
        odd = next((i for i, v in enumerate(ids) if _id_kind(v) != kind or kind == "other"),
                   0)
        raise ValueError("ids must be single values of one kind (all numbers or all "
                         f"strings): row {odd} holds {type(ids[odd]).__name__} "
                         f"{ids[odd]!r}" + (f", row 0 {type(ids[0]).__name__} {ids[0]!r}"
                                            if odd else ""))
    if len(set(ids)) != n:
        first = {}
        for i, v in enumerate(ids):
            if v in first:
                raise ValueError(f"ids are not unique: {v!r} at rows {first[v]} and {i}")
            first[v] = i
    return ids, arr


def _checked_weights(weights):
    """Query frequencies as float64; a missing one (None, NaN) named as such (not as the
    estimator's "NaN or infinity")."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("weights must be numbers (query frequencies >= 0)") from None
    if w.ndim == 1 and np.isnan(w).any():
        raise ValueError(f"weights hold a missing value (None or NaN) at row "
                         f"{int(np.argmax(np.isnan(w)))}")
    return w


def _id_kind(v):
    if isinstance(v, (str, bytes)):
        return "text"
    if isinstance(v, (bool, np.bool_)):
        return "other"
    if isinstance(v, (int, float, np.integer, np.floating)):
        return "number"
    return "other"


def _checked_texts(texts):
    """The texts as a list of str or None (missing: None, NaN, NA), in row order. A bare
    string or bytes is not a list of texts; bytes and containers are not texts; numbers
    become their str (a log's query "404")."""
    if isinstance(texts, (str, bytes, bytearray)):
        raise ValueError("texts must be a sequence of strings (one per row), not a single "
                         f"{type(texts).__name__}: wrap it in a list")
    if getattr(texts, "ndim", 1) != 1:           # a 2-D array, a DataFrame
        raise ValueError(f"texts must be 1-D (one per row: a list, an array or a Series); "
                         f"got {type(texts).__name__} of shape {getattr(texts, 'shape', '?')}")
    if hasattr(texts, "to_pylist"):                # an Arrow array or chunked array
        texts = texts.to_pylist()
    out = []
    for i, t in enumerate(texts):
        if isinstance(t, str):
            if not t.isascii():
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(
                        f"text at row {i} is not valid Unicode: {t[e.start]!r} at character "
                        f"{e.start} is half of a surrogate pair (a truncated emoji?); the "
                        "outputs are UTF-8: fix or drop the row") from None
            out.append(t)
        elif isinstance(t, (bytes, bytearray, np.bytes_)):
            raise ValueError(f"text at row {i} is bytes ({bytes(t)[:20]!r}); decode the texts "
                             "first (e.g. t.decode('utf-8'))")
        elif _missing(t):               # a missing text stays missing: not the query "nan"
            out.append(None)
        elif isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.number)):
            raise ValueError(f"text at row {i} is a {type(t).__name__}, not a string")
        else:
            out.append(str(t))
    return out


def _embed_chunks(encode, texts, progress=False, chunk=2048):
    """``encode`` over ``texts`` in chunks, with a tqdm bar (queries/s, ETA) if asked."""
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(texts), desc="embedding", unit="query")
    out = []
    try:
        for s in range(0, len(texts), chunk):
            out.append(np.asarray(encode(texts[s:s + chunk]), dtype=np.float32))
            if bar is not None:
                bar.update(len(texts[s:s + chunk]))
    finally:
        if bar is not None:
            bar.close()
    return np.concatenate(out) if out else np.zeros((0, 384), np.float32)

"""What the ``fastanneal`` command computes from a fit: per-row assignments (cluster,
probability, margin), the labelled cluster table, the adjusted Rand index and the summary."""
import heapq

import numpy as np

__all__ = ["truth_missing", "adjusted_rand_index", "adjusted_rand_index_from_counts", "assignments", "summary_items", "print_summary",
           "label_clusters", "Labelled", "ClusterSummary"]


def truth_missing(v):
    """A truth label that is no label: null, or an empty / blank text (CSV cells are read as
    text: an unlabelled row is '')."""
    return v is None or (isinstance(v, str) and not v.strip())


def adjusted_rand_index(a, b):
    """Adjusted Rand index of two labelings (Hubert & Arabie), NumPy only."""
    _, ai = np.unique(np.asarray(a), return_inverse=True)
    _, bi = np.unique(np.asarray(b), return_inverse=True)
    n = ai.shape[0]
    if n < 2:
        return 1.0
    nb = int(bi.max()) + 1
    cont = np.bincount(ai * nb + bi, minlength=(int(ai.max()) + 1) * nb).astype(np.float64)
    return _ari_from_table(cont.reshape(-1, nb), n)


def adjusted_rand_index_from_counts(pairs):
    """The adjusted Rand index from a contingency table given as ``{(a, b): count}`` (the
    pairs of the two labelings and how many rows have each): the form that is added up
    over the blocks of a log that is never held whole."""
    if not pairs:
        return 1.0
    keys = list(pairs)
    _, ai = np.unique(np.array([str(type(k[0])) + repr(k[0]) for k in keys]),
                      return_inverse=True)
    _, bi = np.unique(np.array([k[1] for k in keys]), return_inverse=True)
    counts = np.array([pairs[k] for k in keys], dtype=np.float64)
    nb = int(bi.max()) + 1
    cont = np.bincount(ai * nb + bi, weights=counts,
                       minlength=(int(ai.max()) + 1) * nb).reshape(-1, nb)
    n = int(counts.sum())
    if n < 2:
        return 1.0
    return _ari_from_table(cont, n)


def _ari_from_table(cont, n):
    def comb2(x):
        return float((x * (x - 1) / 2).sum())
    s = comb2(cont)
    sa = comb2(cont.sum(axis=1))
    sb = comb2(cont.sum(axis=0))
    total = n * (n - 1) / 2
    expected = sa * sb / total
    top = (sa + sb) / 2
    if top == expected:
        return 1.0
    return (s - expected) / (top - expected)


def _unit(M):
    M = np.asarray(M, dtype=np.float64)
    n = np.linalg.norm(M, axis=1, keepdims=True)
    return M / np.where(n > 0, n, 1.0)


def assignments(est, X, block_entries=1 << 21, runner_up=False):
    """``(labels, probability, margin, centrality)`` computed blockwise (``centrality``: the
    row's cosine to its center with the cosine metric, minus its squared distance to it
    with the Euclidean one -- higher is more central either way; the cosine about the
    origin says nothing about Euclidean rows away from it); the soft
    responsibility of the assigned cluster (``predict_proba``'s default) never needs the
    full N x K matrix; with a probability temperature it comes from the same distance pass
    as the labels (:func:`fastanneal._moments.label_rows`). ``runner_up``: also the second-nearest center of every row
    (-1 for K = 1), from the same assignment pass."""
    from ._moments import assign, label_rows
    C = np.asarray(est.cluster_centers_)
    K = C.shape[0]
    n = X.shape[0]
    # the default probability (softmax with the cluster masses as prior at the probability
    # temperature) comes from the labels' own distances: one pass, no n x K block
    fused = hasattr(est, "probability_temperature_")
    if fused:
        if n:
            est._check_X(X[:1])              # the estimator's checks of the columns
        logp = np.log(np.maximum(np.asarray(est.cluster_weights_, np.float64), 1e-300))
        # no n x K block here, but the rows are copied (dtype, unit rows): bound the copies
        block = max(1, min(n, block_entries // max(X.shape[1], 1)))
    else:
        block = max(1, min(n, block_entries // max(K, X.shape[1], 1)))   # n x K temporaries
    labels = np.empty(n, dtype=np.int64)
    prob = np.empty(n, dtype=np.float64)
    margin = np.empty(n, dtype=np.float64)
    cos = np.empty(n, dtype=np.float64)
    second = np.empty(n, dtype=np.int64)
    Cu = _unit(C)
    euclid = est.metric != "cosine"
    for s in range(0, n, block):
        Xb = X[s:s + block]
        if fused:
            lab, dmin, mar, sec, p = label_rows(Xb, C, est.probability_temperature_, logp,
                                                est.metric)
            prob[s:s + block] = p
        else:
            lab, dmin, mar, sec = assign(Xb, C, est.metric, return_second=True)
            P = est.predict_proba(Xb)
            prob[s:s + block] = P[np.arange(lab.shape[0]), lab]
        labels[s:s + block] = lab
        second[s:s + block] = sec
        margin[s:s + block] = mar if K > 1 else np.inf
        cos[s:s + block] = (-np.asarray(dmin, dtype=np.float64) if euclid else
                            np.einsum("ij,ij->i", _unit(Xb), Cu[lab]))
    if K == 1:
        margin[:] = np.nan
    if runner_up:
        return labels, prob, margin, cos, second
    return labels, prob, margin, cos


class Labelled:
    """What a fit says about the rows and the clusters, clusters renumbered largest first:
    ``labels``, ``probability``, ``margin``, ``runner_up`` (per row) and ``clusters`` (the
    cluster table, a ``pyarrow.Table``)."""

    def __init__(self, labels, probability, margin, runner_up, clusters, order):
        self.labels = labels
        self.probability = probability
        self.margin = margin
        self.runner_up = runner_up
        self.clusters = clusters
        self.order = order


def _sample_mask(rows, n_total, cap):
    """Rows kept for the c-TF-IDF counts: all when ``n_total <= cap``, else a fixed
    pseudo-random ``cap / n_total`` share (a hash of the row number: the same rows
    whatever the blocks)."""
    if n_total <= cap:
        return None
    h = (np.asarray(rows, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(11)
    return h.astype(np.float64) * 2.0 ** -53 < cap / n_total


def _best_distinct(cand, n):
    """The ``n`` best ``(-cos, row, text)`` candidates of distinct texts (best first; a
    text counts at its best occurrence)."""
    keep, kept = [], set()
    for r in sorted(cand, key=lambda r: (r[0], r[1])):
        if r[2] not in kept:
            kept.add(r[2])
            keep.append(r)
            if len(keep) == n:
                break
    return keep


def _clip(text, n=40):
    from .report import _short
    return _short(" ".join(str(text).split()), n)


class ClusterSummary:
    """The labelled cluster table and the ambiguous rows, accumulated block by block in row
    order (:meth:`add`), so that a log larger than memory is labelled in one streaming
    pass; the result is the same whatever the blocks (sums of weights and cosines up to the
    order of floating-point additions).

    Per cluster: size, weight, the sum of the rows' cosines to the center (cohesion), the
    most central row (highest cosine; ties: first row), the ``n_representatives`` most
    central distinct texts (exact: each block's best candidates merged), c-TF-IDF counts
    (every row up to ``text_sample`` rows, a fixed pseudo-random sample of that many
    beyond), and the ``n_ambiguous`` distinct queries (rows without text: rows) of lowest
    probability among the rows whose margin is below ``ambiguous_below`` (None: any)."""

    def __init__(self, K, n_rows, n_representatives=5, with_ids=False, text_sample=1_000_000,
                 n_ambiguous=50, id_type=None, ambiguous_below=None):
        from .labels import TermCounts
        self.K = int(K)
        self.n_rows = int(n_rows)
        self.n_rep = int(n_representatives)
        self.text_sample = int(text_sample)
        self.n_amb = int(n_ambiguous)
        self.amb_below = None if ambiguous_below is None else float(ambiguous_below)
        self.with_ids = bool(with_ids)
        self.id_type = id_type          # the id column's Arrow type (None: inferred)
        self.size = np.zeros(K, dtype=np.int64)
        self.weight = np.zeros(K)
        self.cos_sum = np.zeros(K)
        self.central_cos = np.full(K, -np.inf)
        self.central_row = np.full(K, -1, dtype=np.int64)
        self.central_text = [None] * K
        self.central_id = [None] * K
        self.reps = [[] for _ in range(K)]          # (-cos, row, text), best first
        self.terms = TermCounts(K)
        self.has_texts = None
        self.ambiguous = []                         # (p, row, label, runner_up, margin, text)

    def add(self, row0, labels, probability, margin, runner_up, cos, w, texts=None,
            ids=None):
        """Rows ``row0 ..`` with their assignments (original cluster numbers), weights and
        optional texts / ids (sequences of the block's length)."""
        K = self.K
        n = labels.shape[0]
        if n == 0:
            return
        self.has_texts = texts is not None
        self.size += np.bincount(labels, minlength=K)
        self.weight += np.bincount(labels, weights=w, minlength=K)
        self.cos_sum += np.bincount(labels, weights=cos, minlength=K)
        rows = np.arange(row0, row0 + n, dtype=np.int64)
        idx = np.lexsort((rows, -cos, labels))
        lab_s = labels[idx]
        starts = np.flatnonzero(np.r_[True, lab_s[1:] != lab_s[:-1]])
        ends = np.r_[starts[1:], n]
        for s0, e0 in zip(starts.tolist(), ends.tolist()):
            k = int(lab_s[s0])
            i = int(idx[s0])
            c = float(cos[i])
            if c > self.central_cos[k]:                 # earlier rows win ties
                self.central_cos[k] = c
                self.central_row[k] = row0 + i
                self.central_text[k] = texts[i] if texts is not None else None
                self.central_id[k] = ids[i] if ids is not None else None
            if texts is not None and self.n_rep > 0:
                # the block's best n distinct texts (a text kept from an earlier block may
                # come again with a higher cosine: its best occurrence ranks it)
                cand = list(self.reps[k])
                seen = set()
                got = 0
                for j in idx[s0:e0].tolist():
                    if got >= self.n_rep:
                        break
                    t = texts[j]
                    if t is None or t in seen:
                        continue
                    seen.add(t)
                    got += 1
                    cand.append((-float(cos[j]), row0 + j, t))
                self.reps[k] = _best_distinct(cand, self.n_rep)
        if texts is not None:
            m = _sample_mask(rows, self.n_rows, self.text_sample)
            if m is None:
                self.terms.add(["" if t is None else t for t in texts], labels, w)
            else:
                sel = np.flatnonzero(m)
                self.terms.add(["" if texts[j] is None else texts[j] for j in sel.tolist()],
                               labels[sel], np.asarray(w)[sel])
        if self.n_amb > 0 and K > 1:
            p = np.asarray(probability, dtype=np.float64)
            keep = (np.asarray(runner_up) >= 0) & np.isfinite(p)
            if self.amb_below is not None:
                keep &= np.asarray(margin) < self.amb_below
            ok = np.flatnonzero(keep)
            if ok.size:
                best = ok[np.lexsort((ok, p[ok]))]
                self.ambiguous = _fewest_distinct(self.ambiguous, (
                    (float(p[j]), row0 + j, int(labels[j]), int(runner_up[j]),
                     float(margin[j]), texts[j] if texts is not None else None)
                    for j in best.tolist()), self.n_amb)

    def merge(self, other):
        """Add the summary of other rows (another block range, e.g. the row groups a Dask
        worker labelled): the result is the summary of both row sets as :meth:`add` would
        have made it in row order, whatever the order of the merges (each part's best
        candidates are kept exactly; sums up to the order of the additions). Returns self."""
        if (other.K, other.n_rows, other.n_rep, other.text_sample, other.n_amb,
                other.amb_below) != (self.K, self.n_rows, self.n_rep, self.text_sample,
                                     self.n_amb, self.amb_below):
            raise ValueError("cannot merge the summaries of different labellings")
        self.size += other.size
        self.weight += other.weight
        self.cos_sum += other.cos_sum
        theirs, mine = other.central_row, self.central_row
        better = (theirs >= 0) & ((other.central_cos > self.central_cos)
                                  | ((other.central_cos == self.central_cos)
                                     & ((mine < 0) | (theirs < mine))))
        for k in np.flatnonzero(better).tolist():
            self.central_cos[k] = other.central_cos[k]
            self.central_row[k] = theirs[k]
            self.central_text[k] = other.central_text[k]
            self.central_id[k] = other.central_id[k]
        for k in range(self.K):
            if not other.reps[k]:
                continue
            self.reps[k] = _best_distinct(self.reps[k] + other.reps[k], self.n_rep)
        self.terms.merge(other.terms)
        if other.has_texts is not None:
            self.has_texts = bool(self.has_texts) or bool(other.has_texts)
        if other.ambiguous:
            self.ambiguous = _fewest_distinct(self.ambiguous, other.ambiguous, self.n_amb)
        return self

    def order(self):
        """Clusters largest (weight) first; ties: lower number first."""
        return np.lexsort((np.arange(self.K), -self.weight))

    def table(self, order=None):
        """The per-cluster table (clusters renumbered by ``order``: largest first)."""
        import pyarrow as pa
        order = self.order() if order is None else order
        size = self.size
        cohesion = np.where(size > 0, self.cos_sum / np.maximum(size, 1), np.nan)
        texts = bool(self.has_texts)
        short, terms = self.terms.labels() if texts else ([""] * self.K, [""] * self.K)
        if texts:
            # a cluster of emoji or stop words only ("how do i", "can you") has no term:
            # its most central query stands for it, in brackets (a quote, not terms)
            short = [s or (f"[{_clip(self.central_text[k])}]" if self.central_text[k]
                           else "") for k, s in enumerate(short)]
        cols = {
            "cluster": np.arange(self.K, dtype=np.int64),
            "size": size[order],
            "weight": self.weight[order],
            "share": self.weight[order] / max(self.weight.sum(), 1e-300),
            "label": [short[k] for k in order],
            "central_query": [self.central_text[k] if texts else None for k in order],
            **({"representative_queries": pa.array([[t for _, _, t in self.reps[k]]
                                                    for k in order],
                                                   type=pa.list_(pa.string()))}
               if texts and self.n_rep > 0 else {}),
            "cohesion": cohesion[order],
            "terms": [terms[k] for k in order],
        }
        if self.with_ids:
            vals = [self.central_id[k] for k in order]
            try:
                # (in the id column's type: inferred from the central ids alone, float ids
                # 1e300, 2, 3 gave a double id column and an int64 central_id)
                cols["central_id"] = pa.array(vals, type=self.id_type)
            except OverflowError:       # uint64 ids from 2^63 up: Arrow infers int64
                cols["central_id"] = pa.array(vals, type=pa.uint64())
        cr = self.central_row[order]
        cols["central_row"] = np.where(cr >= 0, cr + 1, -1)
        return pa.table(cols)

    def ambiguous_rows(self, rank):
        """The report's ambiguous rows, clusters renumbered by ``rank`` (None for K = 1:
        no runner-up, no section)."""
        if self.K < 2 or self.n_amb <= 0:
            return None
        return [{"row": r, "query": t, "cluster": int(rank[k]), "runner_up": int(rank[ru]),
                 "probability": p, "margin": m}
                for p, r, k, ru, m, t in self.ambiguous]


def ranks(order):
    rank = np.empty(order.shape[0], dtype=np.int64)
    rank[order] = np.arange(order.shape[0])
    return rank


def ambiguous_margin(est):
    """The margin below which a row counts as ambiguous: half the median margin
    (``2 T_p``: odds against the runner-up below ``e^2`` ~ 7.4), so that clusters all
    clearly apart list no row, whatever their number."""
    return 2.0 * float(est.probability_temperature_)


def _fewest_distinct(have, new, n):
    """The ``n`` entries ``(p, row, ...)`` of lowest ``(p, row)`` of ``have`` (sorted,
    distinct) and the iterable ``new`` (sorted), one per query text (the lowest: a log
    repeats its queries, and 60 copies of one border query filled the list), rows without
    a text each their own."""
    out, seen = [], set()
    for r in heapq.merge(have, new, key=lambda r: (r[0], r[1])):
        key = ("row", r[1]) if r[5] is None else r[5]
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
        if len(out) == n:
            break
    return out


def label_clusters(est, X, w, texts=None, ids=None, n_representatives=5, block=65536,
                   id_type=None):
    """Per-row assignments and the labelled cluster table of a fitted estimator (what the
    ``fastanneal`` command writes and :class:`fastanneal.QueryClusters` returns), computed
    by :class:`ClusterSummary` over row blocks (``id_type``: the ids' Arrow type)."""
    K = np.asarray(est.cluster_centers_).shape[0]
    n = X.shape[0]
    summ = ClusterSummary(K, n, n_representatives, with_ids=ids is not None, id_type=id_type,
                          ambiguous_below=ambiguous_margin(est))
    labels = np.empty(n, dtype=np.int64)
    prob = np.empty(n)
    margin = np.empty(n)
    ru = np.empty(n, dtype=np.int64)
    for s in range(0, n, block):
        e = min(n, s + block)
        lab, p, mar, cos, sec = assignments(est, X[s:e], runner_up=True)
        labels[s:e], prob[s:e], margin[s:e], ru[s:e] = lab, p, mar, sec
        tb = None if texts is None else texts[s:e]
        if hasattr(tb, "to_pylist"):                # an Arrow column: one block at a time
            tb = tb.to_pylist()
        summ.add(s, lab, p, mar, sec, cos, w[s:e], tb, None if ids is None else ids[s:e])
    order = summ.order()
    rank = ranks(order)
    # renumbered in place, block by block: no whole-log temporaries at the labelling's
    # memory peak (the embeddings are still held)
    for s in range(0, n, block):
        e = min(n, s + block)
        labels[s:e] = rank[labels[s:e]]
        r = ru[s:e]
        ru[s:e] = np.where(r >= 0, rank[np.maximum(r, 0)], -1)
    lab = Labelled(labels, prob, margin, ru, summ.table(order), order)
    lab.summary = summ
    lab.rank = rank
    return lab


def summary_items(args, n, D, K, fit, timings, ari, est):
    m = fit.meta
    kdesc = str(K)
    sug = getattr(est, "k_suggestion_", None)
    schedule = f"{args.schedule}, {args.steps} steps"
    if sug is not None:
        rule = ("finest natural level" if len(getattr(sug, "levels", ())) else
                "widest plateau (no natural level)")
        kdesc = (f"{K} (auto: {rule} among 2..{sug.k_max}; next: "
                 + ", ".join(str(k) for k in sug.ranking[1:4])
                 + ("" if sug.supported else "; no clear plateau: weak evidence") + ")")
        from .estimator import MiniBatchAnnealedKMeans
        schedule = (f"K chosen by the phase-transition path on a sample of the rows; then "
                    f"{schedule} over mini-batches (out of core)"
                    if isinstance(est, MiniBatchAnnealedKMeans) else
                    "phase-transition path (critical), continued for the chosen K")
    items = [("rows", f"{n:,}"), ("dimensions", str(D)), ("clusters (K)", kdesc),
             ("metric", args.metric), ("schedule", schedule),
             ("responsibilities", args.responsibilities), ("seed", str(args.seed)),
             ("T start / final", f"{m['temperature_start_']:.4g} / {m['temperature_']:.4g}"),
             ("critical temperature T_c", f"{m['critical_temperature_']:.4g}"),
             ("objective J (inertia)", f"{m['inertia_']:.6g}"),
             ("hardening gap", f"{m['hardening_gap_']:.4g}")]
    if ari is not None:
        items.append((f"ARI vs {args.truth_column!r}", f"{ari:.3f}"))
    if m.get("resumed_from") is not None:
        items.append(("resumed", f"from step {m['resumed_from']}"))
    items.append(("time", ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())))
    return items


def print_summary(console, args, output, clusters_path, report, n, K, fit, timings, ari, ctab):
    if console.quiet:
        return
    m = fit.meta
    console.out(f"clustered {n:,} rows into {K} clusters in {timings['total']:.1f} s "
                f"(fit {timings['fit']:.1f} s; J = {m['inertia_']:.5g}, "
                f"T final = {m['temperature_']:.3g})")
    if ari is not None:
        console.out(f"ARI against {args.truth_column!r}: {ari:.3f}")
    top = ctab.slice(0, min(8, ctab.num_rows)).to_pylist()
    if top:
        console.out("largest clusters:")
        for r in top:
            cq = _printable(r["central_query"] or "")
            cq = cq if len(cq) <= 48 else cq[:45] + "..."
            label = _printable(r["label"] or "")[:36]
            console.out(f"  {r['cluster']:>4}  {r['size']:>7,}  {label:<36}  {cq}")
    console.out(f"rows:     {output}")
    console.out(f"clusters: {clusters_path}")
    if report:
        console.out(f"report:   {report}")




def _printable(text):
    """``text`` for a terminal line: control characters (escape sequences, newlines,
    carriage returns: a query log holds text typed by strangers) shown as ``\\x1b`` and
    the like instead of acted on."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)

"""What the ``fastanneal`` command computes from a fit: per-row assignments (cluster,
probability, margin), the labelled cluster table, the adjusted Rand index and the summary."""
import numpy as np

__all__ = ["adjusted_rand_index", "assignments", "cluster_table", "summary_items",
           "print_summary", "label_clusters", "Labelled"]


def adjusted_rand_index(a, b):
    """Adjusted Rand index of two labelings (Hubert & Arabie), NumPy only."""
    _, ai = np.unique(np.asarray(a), return_inverse=True)
    _, bi = np.unique(np.asarray(b), return_inverse=True)
    n = ai.shape[0]
    if n < 2:
        return 1.0
    nb = int(bi.max()) + 1
    cont = np.bincount(ai * nb + bi, minlength=(int(ai.max()) + 1) * nb).astype(np.float64)

    def comb2(x):
        return float((x * (x - 1) / 2).sum())
    s = comb2(cont)
    sa = comb2(cont.reshape(-1, nb).sum(axis=1))
    sb = comb2(cont.reshape(-1, nb).sum(axis=0))
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


def assignments(est, X, block_entries=1 << 22, runner_up=False):
    """``(labels, probability, margin, cosine_to_center)`` computed blockwise: the soft
    responsibility of the assigned cluster (``predict_proba`` at the final temperature) never
    needs the full N x K matrix. ``runner_up``: also the second-nearest center of every row
    (-1 for K = 1), from the same assignment pass."""
    from ._moments import assign
    C = np.asarray(est.cluster_centers_)
    K = C.shape[0]
    n = X.shape[0]
    block = max(1, min(n, block_entries // max(K, 1)))
    labels = np.empty(n, dtype=np.int64)
    prob = np.empty(n, dtype=np.float64)
    margin = np.empty(n, dtype=np.float64)
    cos = np.empty(n, dtype=np.float64)
    second = np.empty(n, dtype=np.int64)
    Cu = _unit(C)
    for s in range(0, n, block):
        Xb = X[s:s + block]
        lab, _, mar, sec = assign(Xb, C, est.metric, return_second=True)
        P = est.predict_proba(Xb)
        labels[s:s + block] = lab
        second[s:s + block] = sec
        prob[s:s + block] = P[np.arange(lab.shape[0]), lab]
        margin[s:s + block] = mar if K > 1 else np.inf
        cos[s:s + block] = np.einsum("ij,ij->i", _unit(Xb), Cu[lab])
    if K == 1:
        margin[:] = np.nan
    if runner_up:
        return labels, prob, margin, cos, second
    return labels, prob, margin, cos


def representatives(labels, cos, texts, K, n):
    """Up to ``n`` distinct texts per cluster, most central first (highest cosine to the
    center; ties: first row)."""
    out = [[] for _ in range(K)]
    if texts is None or n <= 0:
        return out
    idx = np.lexsort((np.arange(labels.shape[0]), -cos, labels))
    for i in idx:
        k = labels[i]
        lst = out[k]
        if len(lst) >= n:
            continue
        t = texts[i]
        if t is not None and t not in lst:
            lst.append(t)
    return out


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


def label_clusters(est, X, w, texts=None, ids=None, n_representatives=5):
    """Per-row assignments and the labelled cluster table of a fitted estimator (what the
    ``fastanneal`` command writes and :class:`fastanneal.QueryClusters` returns)."""
    labels, prob, margin, cos, ru = assignments(est, X, runner_up=True)
    K = np.asarray(est.cluster_centers_).shape[0]
    weight = np.bincount(labels, weights=w, minlength=K)
    order = np.lexsort((np.arange(K), -weight))          # largest cluster first
    rank = np.empty(K, dtype=np.int64)
    rank[order] = np.arange(K)
    ctab = cluster_table(labels, w, cos, texts, ids, K, order, n_representatives)
    ru_new = np.where(ru >= 0, rank[np.maximum(ru, 0)], -1)
    return Labelled(rank[labels], prob, margin, ru_new, ctab, order)


def cluster_table(labels, w, cos, texts, ids, K, order, n_representatives=0):
    """The per-cluster table (clusters renumbered by ``order``: largest first)."""
    import pyarrow as pa
    from .labels import cluster_labels
    size = np.bincount(labels, minlength=K)
    weight = np.bincount(labels, weights=w, minlength=K)
    cos_sum = np.bincount(labels, weights=cos, minlength=K)
    cohesion = np.where(size > 0, cos_sum / np.maximum(size, 1), np.nan)
    # most central member: highest cosine to the center (ties: first row)
    idx = np.lexsort((np.arange(labels.shape[0]), -cos, labels))
    first = np.ones(idx.shape[0], dtype=bool)
    first[1:] = labels[idx][1:] != labels[idx][:-1]
    central = np.full(K, -1, dtype=np.int64)
    central[labels[idx][first]] = idx[first]
    if texts is not None:
        short, terms = cluster_labels(["" if t is None else t for t in texts], labels, K,
                                      weights=w)
    else:
        short, terms = [""] * K, [""] * K
    reps = (representatives(labels, cos, texts, K, n_representatives)
            if texts is not None and n_representatives > 0 else None)
    cols = {
        "cluster": np.arange(K, dtype=np.int64),
        "size": size[order],
        "weight": weight[order],
        "share": weight[order] / max(weight.sum(), 1e-300),
        "label": [short[k] for k in order],
        "central_query": [(texts[central[k]] if texts is not None and central[k] >= 0 else None)
                          for k in order],
        **({"representative_queries": pa.array([reps[k] for k in order],
                                                type=pa.list_(pa.string()))}
           if reps is not None else {}),
        "cohesion": cohesion[order],
        "terms": [terms[k] for k in order],
    }
    if ids is not None:
        cols["central_id"] = pa.array([ids[central[k]] if central[k] >= 0 else None
                                       for k in order])
    cols["central_row"] = np.where(central[order] >= 0, central[order] + 1, -1)
    return pa.table(cols)


def summary_items(args, n, D, K, fit, timings, ari, est):
    m = fit.meta
    kdesc = str(K)
    sug = getattr(est, "k_suggestion_", None)
    if sug is not None:
        kdesc = (f"{K} (auto: widest plateau among 2..{sug.k_max}; next: "
                 + ", ".join(str(k) for k in sug.ranking[1:4])
                 + ("" if sug.supported else "; no clear plateau: weak evidence") + ")")
    items = [("rows", f"{n:,}"), ("dimensions", str(D)), ("clusters (K)", kdesc),
             ("metric", args.metric), ("schedule", f"{args.schedule}, {args.steps} steps" if sug is None else
                          "phase-transition path (critical), continued for the chosen K"),
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
            cq = r["central_query"]
            cq = "" if cq is None else (cq if len(cq) <= 48 else cq[:45] + "...")
            console.out(f"  {r['cluster']:>4}  {r['size']:>7,}  {r['label'][:36]:<36}  {cq}")
    console.out(f"rows:     {output}")
    console.out(f"clusters: {clusters_path}")
    if report:
        console.out(f"report:   {report}")



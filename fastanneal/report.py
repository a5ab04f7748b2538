"""A self-contained HTML report of a clustering run (``fastanneal cluster --report``).

One HTML file, no external resources: the figures are PNGs drawn with matplotlib (the
``fastanneal[report]`` extra; the object-oriented API, so no global backend is touched) and
embedded as base64 ``data:`` URIs. Sections: run summary, the annealing trace (temperature,
entropy, free energy F and hard objective J, hardening gap, certificate, distinct centers),
the cluster size distribution, a 2-D PCA projection of the centers, and the cluster table.
"""
import base64
import html
import io
import math

import numpy as np

__all__ = ["build_report", "trace_figure", "sizes_figure", "centers_figure", "pca_2d"]

_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;margin:2em auto;
max-width:1180px;color:#1d232a;padding:0 1em;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid
#d8dee4;padding-bottom:.2em}
table{border-collapse:collapse;font-size:.88em}
td,th{padding:.25em .6em;border-bottom:1px solid #e4e8ec;text-align:left;vertical-align:top}
th{background:#f3f5f7;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.summary td:first-child{color:#57606a}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eef0f2}
figcaption{color:#57606a;font-size:.9em}
.muted{color:#57606a;font-size:.9em}
"""


def _png(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _figure(w, h):
    from matplotlib.figure import Figure
    return Figure(figsize=(w, h), layout="constrained")


def _anneal_rows(trace):
    step = np.asarray(trace.get("step", []))
    return step >= 0


def trace_figure(trace):
    """Six panels over the temperature steps; PNG bytes."""
    sel = _anneal_rows(trace)
    x = np.asarray(trace["step"])[sel] if sel.any() else np.zeros(0)
    g = {k: np.asarray(v)[sel] for k, v in trace.items()}
    polish = ~sel
    J_polish = np.asarray(trace["hard_distortion"])[polish] if polish.any() else np.zeros(0)
    fig = _figure(12, 6.2)
    axes = fig.subplots(2, 3)

    def panel(ax, title, ylabel=None, logy=False):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("temperature step", fontsize=8)
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=.3)
        if logy:
            ax.set_yscale("log")

    ax = axes[0, 0]
    T = g["temperature"]
    ax.plot(x, T, "o-", ms=3, color="#0969da")
    panel(ax, "temperature T", logy=bool(T.size and (T > 0).all()))
    ax = axes[0, 1]
    ax.plot(x, g["entropy"], "o-", ms=3, color="#8250df")
    panel(ax, "assignment entropy (nats / unit weight)")
    ax = axes[0, 2]
    ax.plot(x, g["free_energy"], "o-", ms=3, label="free energy F", color="#cf222e")
    ax.plot(x, g["hard_distortion"], "s-", ms=3, label="hard objective J", color="#1a7f37")
    if J_polish.size:
        ax.axhline(J_polish[-1], ls="--", color="#1a7f37", lw=1, label="J after polish")
    ax.legend(fontsize=7)
    panel(ax, "F and J")
    ax = axes[1, 0]
    ax.plot(x, g["hardening_gap"], "o-", ms=3, color="#bc4c00")
    panel(ax, "hardening gap (soft - hard distortion)")
    ax = axes[1, 1]
    gap = np.maximum(g["certificate_gap"], 0)
    ax.plot(x, gap, "o-", ms=3, label="J - F", color="#cf222e")
    ax.plot(x, g["certificate_bound"], "--", label="bound T W log K", color="#57606a")
    ok = np.asarray(g.get("certificate_ok", np.ones_like(x, dtype=bool)), dtype=bool)
    if (~ok).any():
        ax.plot(x[~ok], gap[~ok], "x", color="k", label="violated")
    ax.legend(fontsize=7)
    pos = np.concatenate([gap[gap > 0], g["certificate_bound"][g["certificate_bound"] > 0]])
    panel(ax, "certificate 0 <= J - F <= T W log K", logy=bool(pos.size))
    ax = axes[1, 2]
    nd = np.asarray(g.get("n_distinct", np.zeros_like(x)), dtype=float)
    ax.plot(x, nd, "o-", ms=3, color="#0550ae", label="distinct centers")
    ax.set_ylim(bottom=0)
    panel(ax, "distinct centers")
    if "min_center_distance" in g:
        ax2 = ax.twinx()
        ax2.plot(x, g["min_center_distance"], ":", color="#bc4c00", label="min center distance")
        ax2.tick_params(labelsize=8)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    return _png(fig)


def sizes_figure(sizes, weights=None):
    """Cluster sizes (largest first) and their distribution; PNG bytes."""
    sizes = np.asarray(sizes, dtype=float)
    fig = _figure(12, 3.4)
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[2, 1])
    k = np.arange(sizes.shape[0])
    ax1.bar(k, sizes, width=1.0 if sizes.shape[0] > 60 else 0.8, color="#0969da", label="rows")
    if weights is not None and not np.allclose(np.asarray(weights), sizes):
        ax1b = ax1.twinx()
        ax1b.plot(k, weights, ".", color="#bc4c00", label="weight")
        ax1b.set_ylabel("total weight", fontsize=8)
        ax1b.tick_params(labelsize=8)
    ax1.set_xlabel("cluster (largest first)", fontsize=8)
    ax1.set_ylabel("rows", fontsize=8)
    ax1.set_title("cluster sizes", fontsize=10)
    ax1.tick_params(labelsize=8)
    ax1.grid(alpha=.3, axis="y")
    bins = min(30, max(5, int(math.sqrt(max(sizes.shape[0], 1)))))
    ax2.hist(sizes, bins=bins, color="#8250df")
    ax2.set_xlabel("rows per cluster", fontsize=8)
    ax2.set_ylabel("clusters", fontsize=8)
    ax2.set_title("size distribution", fontsize=10)
    ax2.tick_params(labelsize=8)
    return _png(fig)


def pca_2d(M):
    """First two principal components of the rows of ``M`` (NumPy SVD): (n, 2) coordinates
    and the share of variance each explains."""
    M = np.asarray(M, dtype=np.float64)
    Mc = M - M.mean(axis=0, keepdims=True)
    if M.shape[0] < 2:
        return np.zeros((M.shape[0], 2)), np.zeros(2)
    U, S, _ = np.linalg.svd(Mc, full_matrices=False)
    r = min(2, S.shape[0])
    Y = np.zeros((M.shape[0], 2))
    Y[:, :r] = U[:, :r] * S[:r]
    var = S ** 2
    share = np.zeros(2)
    share[:r] = var[:r] / var.sum() if var.sum() > 0 else 0.0
    return Y, share


def centers_figure(centers, sizes, labels=None, cohesion=None, metric="cosine", annotate=20):
    """2-D PCA of the centers (unit vectors for cosine), marker area ~ cluster size; PNG."""
    C = np.asarray(centers, dtype=np.float64)
    if metric == "cosine":
        C = C / np.maximum(np.linalg.norm(C, axis=1, keepdims=True), 1e-300)
    Y, share = pca_2d(C)
    sizes = np.asarray(sizes, dtype=float)
    fig = _figure(8.5, 6.5)
    ax = fig.subplots()
    area = 20 + 600 * sizes / max(sizes.max(), 1)
    c = cohesion if cohesion is not None else "#0969da"
    sc = ax.scatter(Y[:, 0], Y[:, 1], s=area, c=c, cmap="viridis", alpha=.75,
                    edgecolors="k", linewidths=.4)
    if cohesion is not None:
        cb = fig.colorbar(sc, ax=ax, shrink=.8)
        cb.set_label("cohesion (mean cosine to center)", fontsize=8)
        cb.ax.tick_params(labelsize=8)
    for i in range(min(annotate, C.shape[0])):
        text = str(i)
        if labels is not None and labels[i]:
            lab = labels[i]
            text += ": " + (lab if len(lab) <= 28 else lab[:26] + "..")
        ax.annotate(text, (Y[i, 0], Y[i, 1]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xlabel(f"PC 1 ({100 * share[0]:.0f}% of center variance)", fontsize=8)
    ax.set_ylabel(f"PC 2 ({100 * share[1]:.0f}%)", fontsize=8)
    ax.set_title("cluster centers, 2-D PCA (area ~ size; the largest are labelled)",
                 fontsize=10)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=.3)
    return _png(fig)


def _img(png, alt):
    b64 = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (int, np.integer)):
        return f"{v:,}"
    return str(v)


def _table_html(rows, columns, numeric):
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cls = ' class="num"' if c in numeric else ""
            cells.append(f"<td{cls}>{html.escape(_fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table class="clusters"><thead><tr>{head}</tr></thead><tbody>'
            + "\n".join(body) + "</tbody></table>")


def choose_k_figure(suggestion):
    """The K-choosing evidence (:meth:`fastanneal.KSuggestion.plot`) as PNG bytes."""
    import matplotlib
    matplotlib.use("Agg")
    return _png(suggestion.plot())


def build_report(title, summary, trace, clusters, centers, metric="cosine",
                 k_suggestion=None):
    """The report as one HTML string.

    ``summary``: list of (name, value) pairs; ``trace``: dict of arrays (``Trace.as_dict()``);
    ``clusters``: the cluster table (``pyarrow.Table`` or list of dicts with ``cluster, size,
    weight, label, central_query, cohesion``...), in the order of ``centers`` (K, D).
    """
    rows = clusters.to_pylist() if hasattr(clusters, "to_pylist") else list(clusters)
    sizes = np.array([r["size"] for r in rows], dtype=float)
    weights = np.array([r.get("weight", r["size"]) for r in rows], dtype=float)
    labels = [r.get("label") or "" for r in rows]
    cohesion = np.array([np.nan if r.get("cohesion") is None else r["cohesion"] for r in rows],
                        dtype=float)
    figs = [
        ("trace", "The annealing trace",
         trace_figure(trace),
         "Per temperature step: T falls along the schedule; the entropy of the soft "
         "assignments falls as clusters harden; F rises towards J; the certificate keeps "
         "0 &le; J &minus; F &le; T W log K. The dashed line is J after the final Lloyd polish."),
        ("sizes", "Cluster sizes", sizes_figure(sizes, weights), "Rows per cluster."),
        ("centers", "Cluster centers", centers_figure(
            centers, sizes, labels, None if np.isnan(cohesion).all() else cohesion, metric),
         "Projection of the centers on their first two principal components (numpy SVD)."),
    ]
    if k_suggestion is not None:
        top = ", ".join(f"K={r['k']} ({r['width']:.2f})" for r in k_suggestion.table()[:5])
        figs.insert(0, ("choose-k", "Choosing K", choose_k_figure(k_suggestion),
                        "Left: effective clusters on the annealing path against the temperature "
                        "(log scale, cooling to the right); the shaded bands are the widest "
                        "plateaus. Right: the hard objective J of the coldest state of each K "
                        f"on the path. Ranked by plateau width in log T: {html.escape(top)}."))
    cols = [c for c in ("cluster", "size", "weight", "share", "label", "central_query",
                        "cohesion", "terms") if rows and c in rows[0]]
    numeric = {"cluster", "size", "weight", "share", "cohesion"}
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title>",
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             '<p class="muted">Annealed soft k-means (fastanneal). Self-contained report: '
             "all figures are embedded.</p>",
             '<h2 id="summary">Summary</h2><table class="summary">']
    for k, v in summary:
        parts.append(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>")
    parts.append("</table>")
    for fid, heading, png, caption in figs:
        parts.append(f'<h2 id="{fid}">{html.escape(heading)}</h2>')
        parts.append(f"<figure>{_img(png, heading)}<figcaption>{caption}</figcaption></figure>")
    parts.append('<h2 id="clusters">Clusters</h2>')
    parts.append('<p class="muted">label: distinctive terms by class-based TF-IDF; '
                 "central_query: the member closest to the center; cohesion: mean cosine of "
                 "the members to the center.</p>")
    parts.append(_table_html(rows, cols, numeric))
    parts.append("</body></html>")
    return "\n".join(parts)

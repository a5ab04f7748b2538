"""A self-contained HTML report of a clustering run, written for the analyst first.

One HTML file with no external resources and no plotting dependency: the figures are inline
SVG drawn here, the table search and sorting are a few lines of inline JavaScript (the page
reads without it). Sections, in the order an analyst reads them:

1. **Summary** of the run (rows, K, objective, time, ...).
2. **Clusters**: one row per cluster, largest first: size, share, label (class-based TF-IDF
   terms), representative queries, cohesion, and the nearest clusters (by center
   similarity). A search box filters the rows (every cell is searched) and a click on a
   column heading sorts by it. The address can carry the search: ``report.html#q=alarm``
   (and ``&sort=cohesion`` or ``&sort=-size``).
3. **Ambiguous queries**: the rows with the lowest probability, with their runner-up cluster.
4. **Closest cluster pairs** (merge candidates) and the **cluster sizes** (rank plot), which
   read at K = 1,000 where a 2-D projection of the centers is a blob.
5. **Choosing K** (when K was chosen from the phase transitions) and the **annealing
   diagnostics**: temperature, entropy, F and J, hardening gap, certificate, distinct
   centers per temperature step.

Every text from the data is HTML-escaped.
"""
import html
import re
import math

import numpy as np

__all__ = ["build_report", "svg_chart", "nearest_clusters", "closest_pairs",
           "ambiguous_rows"]

_CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,"DejaVu Sans",Arial,sans-serif;margin:1.5em auto;
max-width:1280px;color:#1d232a;padding:0 1em;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid
#d8dee4;padding-bottom:.2em}
nav a{margin-right:1em}
table{border-collapse:collapse;font-size:.88em}
td,th{padding:.25em .6em;border-bottom:1px solid #e4e8ec;text-align:left;vertical-align:top}
th{background:#f3f5f7;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th[aria-sort=ascending]::after{content:" \\25B2";font-size:.7em}
table.sortable th[aria-sort=descending]::after{content:" \\25BC";font-size:.7em}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.summary td:first-child{color:#57606a}
td ul{margin:0;padding-left:1.1em}td li{margin:0}
.label{font-weight:600}.terms{color:#57606a;font-size:.85em}
.near a{color:#0550ae;text-decoration:none;white-space:nowrap}
.figs{display:flex;flex-wrap:wrap;gap:.6em}
figure{margin:1em 0}figcaption{color:#57606a;font-size:.9em;max-width:70em}
svg text{font-family:inherit}
.muted{color:#57606a;font-size:.9em}
input.search{font-size:1em;padding:.3em .5em;width:24em;max-width:90%;margin:.4em 0}
tr:target{background:#fff8c5}
"""

_JS = r"""
(function(){
function val(td){var v=td.getAttribute('data-v');if(v!==null&&v!==''&&!isNaN(+v))return +v;
 return (td.textContent||'').toLowerCase();}
function sortBy(table,col,desc){var tb=table.tBodies[0];var rows=Array.prototype.slice.call(tb.rows);
 rows.sort(function(a,b){var x=val(a.cells[col]),y=val(b.cells[col]);
  if(typeof x!==typeof y){x=String(x);y=String(y);}
  return (x<y?-1:x>y?1:0)*(desc?-1:1);});
 rows.forEach(function(r){tb.appendChild(r);});
 Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
  if(i===col)th.setAttribute('aria-sort',desc?'descending':'ascending');else th.removeAttribute('aria-sort');});}
function filter(table,q,count){q=(q||'').toLowerCase().trim();var n=0,rows=table.tBodies[0].rows;
 for(var i=0;i<rows.length;i++){var hit=!q||rows[i].textContent.toLowerCase().indexOf(q)>=0;
  rows[i].style.display=hit?'':'none';if(hit)n++;}
 if(count)count.textContent=q?('showing '+n+' of '+rows.length):(rows.length+' rows');return n;}
document.querySelectorAll('table.sortable').forEach(function(table){
 Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
  th.addEventListener('click',function(){sortBy(table,i,th.getAttribute('aria-sort')==='ascending');});});});
document.querySelectorAll('input.search').forEach(function(inp){
 var table=document.getElementById(inp.getAttribute('data-table'));
 var count=document.getElementById(inp.getAttribute('data-count'));
 inp.addEventListener('input',function(){filter(table,inp.value,count);});});
var h=location.hash.replace(/^#/,'');if(h.indexOf('=')<0)return;
var p={};h.split('&').forEach(function(kv){var i=kv.indexOf('=');
 if(i>0){var v=kv.slice(i+1).replace(/\+/g,' ');
  try{v=decodeURIComponent(v);}catch(e){}p[kv.slice(0,i)]=v;}});
var table=document.getElementById('clusters');if(!table)return;
if(p.sort){var desc=p.sort.charAt(0)==='-',key=desc?p.sort.slice(1):p.sort;
 Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
  if(th.getAttribute('data-key')===key)sortBy(table,i,desc);});}
if(p.q!==undefined){var inp=document.getElementById('cluster-search');inp.value=p.q;
 filter(table,p.q,document.getElementById('cluster-count'));}
})();
"""

_COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#57606a"]


# =========================================================================== SVG charts
#: C0 control characters but tab, newline and carriage return (and DEL): not allowed in
#: HTML text (a parse error; browsers show U+FFFD), so the report shows U+FFFD itself
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _e(s):
    return html.escape(_CONTROL.sub("\ufffd", str(s)), quote=True)


def _fnum(v):
    """A short tick label."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        m, ex = f"{v:.0e}".split("e")
        return f"{m}e{int(ex)}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _linear_ticks(lo, hi, n=5):
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step - 1e-9) * step
    ticks = []
    t = start
    while t <= hi + 1e-9 * step and len(ticks) < 50:
        ticks.append(0.0 if abs(t) < 1e-12 * step else t)
        t += step
    return ticks


def _log_ticks(lo, hi):
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks = [10.0 ** e for e in range(a, b + 1) if lo * (1 - 1e-9) <= 10.0 ** e <= hi * (1 + 1e-9)]
    if len(ticks) < 2:                       # a narrow range: 1-2-5 steps
        ticks = [m * 10.0 ** e for e in range(a - 1, b + 1) for m in (1, 2, 5)
                 if lo * (1 - 1e-9) <= m * 10.0 ** e <= hi * (1 + 1e-9)]
    return ticks


class _Scale:
    def __init__(self, lo, hi, p0, p1, log=False):
        self.log = log and lo > 0 and hi > 0
        f = (lambda v: math.log10(v)) if self.log else (lambda v: v)
        self.f = f
        self.lo, self.hi = f(lo), f(hi)
        if self.hi == self.lo:
            pad = abs(self.lo) * 0.05 or 1.0
            self.lo, self.hi = self.lo - pad, self.hi + pad
        self.p0, self.p1 = p0, p1

    def __call__(self, v):
        return self.p0 + (self.f(v) - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)


def _finite(x, y, logx, logy):
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    if logx:
        ok &= x > 0
    if logy:
        ok &= y > 0
    return x[ok], y[ok]


def svg_chart(series, title, xlabel="", ylabel="", width=400, height=240, logx=False,
              logy=False, reverse_x=False, bands=(), vlines=(), hlines=(), ymin=None):
    """A line chart as an inline ``<svg>`` string.

    ``series``: dicts with ``x``, ``y``, and optionally ``label``, ``color``, ``dash``
    (bool), ``marker`` (bool, default True), ``step`` (draw as a step function), ``fill``
    (fill the area under the line; for bar-like rank plots). ``bands``: ``(x0, x1, color,
    label)`` shaded spans; ``vlines`` / ``hlines``: ``(value, color, label)``. Non-finite
    points (and non-positive ones on a log axis) are left out; a chart with no point says so.
    """
    ml, mr, mt, mb = 58, 12, 26, 40
    pts = [(s, *_finite(s["x"], s["y"], logx, logy)) for s in series]
    xs = np.concatenate([p[1] for p in pts] + [np.zeros(0)])
    ys = np.concatenate([p[2] for p in pts] + [np.zeros(0)])
    for v, _, _ in hlines:
        if math.isfinite(v) and (v > 0 or not logy):
            ys = np.append(ys, v)
    for x0, x1, _, _ in bands:
        for v in (x0, x1):
            if math.isfinite(v) and (v > 0 or not logx):
                xs = np.append(xs, v)
    if ymin is not None and ys.size:
        ys = np.append(ys, ymin)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}">',
           f"<title>{_e(title)}</title>",
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2:.1f}" y="15" text-anchor="middle" font-size="12" '
           f'font-weight="600">{_e(title)}</text>']
    x0p, x1p, y0p, y1p = ml, width - mr, height - mb, mt
    if xs.size == 0 or ys.size == 0:
        out.append(f'<text x="{width / 2:.1f}" y="{height / 2:.1f}" text-anchor="middle" '
                   f'font-size="11" fill="#57606a">no data</text></svg>')
        return "".join(out)
    sx = _Scale(xs.min(), xs.max(), x1p if reverse_x else x0p, x0p if reverse_x else x1p, logx)
    sy = _Scale(ys.min(), ys.max(), y0p, y1p, logy)
    # grid and ticks
    yt = _log_ticks(ys.min(), ys.max()) if sy.log else _linear_ticks(ys.min(), ys.max())
    xt = _log_ticks(xs.min(), xs.max()) if sx.log else _linear_ticks(xs.min(), xs.max())
    for t in yt:
        y = sy(t)
        out.append(f'<line x1="{x0p}" x2="{x1p}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eaeef2"/>'
                   f'<text x="{x0p - 4}" y="{y + 3.5:.1f}" text-anchor="end" font-size="10" '
                   f'fill="#57606a">{_e(_fnum(t))}</text>')
    for t in xt:
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y0p}" y2="{y1p}" stroke="#eaeef2"/>'
                   f'<text x="{x:.1f}" y="{y0p + 13}" text-anchor="middle" font-size="10" '
                   f'fill="#57606a">{_e(_fnum(t))}</text>')
    out.append(f'<rect x="{x0p}" y="{y1p}" width="{x1p - x0p}" height="{y0p - y1p}" '
               f'fill="none" stroke="#afb8c1"/>')
    out.append(f'<text x="{(x0p + x1p) / 2:.1f}" y="{height - 6}" text-anchor="middle" '
               f'font-size="10.5">{_e(xlabel)}</text>')
    out.append(f'<text transform="translate(12,{(y0p + y1p) / 2:.1f}) rotate(-90)" '
               f'text-anchor="middle" font-size="10.5">{_e(ylabel)}</text>')
    legend = []
    for a, b, color, label in bands:
        if not (math.isfinite(a) and math.isfinite(b)) or (sx.log and min(a, b) <= 0):
            continue
        pa_, pb = sorted((sx(a), sx(b)))
        out.append(f'<rect x="{pa_:.1f}" y="{y1p}" width="{max(pb - pa_, 1):.1f}" '
                   f'height="{y0p - y1p}" fill="{color}" fill-opacity="0.22"/>')
        if label:
            legend.append((label, color, "band"))
    rules = [(v, c, lab, True) for v, c, lab in vlines] + \
        [(v, c, lab, False) for v, c, lab in hlines]
    for v, color, label, vertical in rules:          # dashed reference lines
        scale = sx if vertical else sy
        if not (math.isfinite(v) and (v > 0 or not scale.log)):
            continue
        p = scale(v)
        x1, x2, y1, y2 = (p, p, y0p, y1p) if vertical else (x0p, x1p, p, p)
        out.append(f'<line x1="{x1:.1f}" x2="{x2:.1f}" y1="{y1:.1f}" y2="{y2:.1f}" '
                   f'stroke="{color}" stroke-dasharray="5,3"/>')
        if label:
            legend.append((label, color, "dash"))
    for j, (s, x, y) in enumerate(pts):
        color = s.get("color", _COLORS[j % len(_COLORS)])
        if x.size == 0:
            continue
        px = [sx(v) for v in x]
        py = [sy(v) for v in y]
        if s.get("step"):
            qx, qy = [px[0]], [py[0]]
            for i in range(1, len(px)):
                qx += [px[i], px[i]]
                qy += [py[i - 1], py[i]]
            px, py = qx, qy
        d = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py))
        if s.get("fill"):
            base = sy(max(ys.min(), 1e-300) if sy.log else min(ys.min(), 0.0))
            out.append(f'<polygon points="{px[0]:.1f},{base:.1f} {d} {px[-1]:.1f},{base:.1f}" '
                       f'fill="{color}" fill-opacity="0.55" stroke="none"/>')
        dash = ' stroke-dasharray="5,3"' if s.get("dash") else ""
        out.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="1.6"'
                   f'{dash}/>')
        if s.get("marker", True) and x.size <= 80 and not s.get("step"):
            out.extend(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.4" fill="{color}"/>'
                       for a, b in zip(px, py))
        if s.get("label"):
            legend.append((s["label"], color, "dash" if s.get("dash") else "line"))
    for i, (label, color, kind) in enumerate(legend):
        y = y1p + 12 + 13 * i
        x = x0p + 8
        if kind == "band":
            out.append(f'<rect x="{x}" y="{y - 7}" width="14" height="9" fill="{color}" '
                       f'fill-opacity="0.35"/>')
        else:
            dash = ' stroke-dasharray="4,2"' if kind == "dash" else ""
            out.append(f'<line x1="{x}" x2="{x + 14}" y1="{y - 3}" y2="{y - 3}" '
                       f'stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{x + 18}" y="{y}" font-size="10" fill="#1d232a">{_e(label)}</text>')
    out.append("</svg>")
    return "".join(out)


# =========================================================================== cluster views
def _unit(M):
    M = np.asarray(M, dtype=np.float64)
    n = np.linalg.norm(M, axis=1, keepdims=True)
    return M / np.where(n > 0, n, 1.0)


def nearest_clusters(centers, metric="cosine", n=3, block=256):
    """``(index, score)``, each (K, min(n, K-1)): the nearest other clusters of every
    cluster, nearest first. ``score``: cosine similarity of the centers (``"cosine"``) or
    squared Euclidean distance (``"euclidean"``). Computed in row blocks (never K x K)."""
    C = np.asarray(centers, dtype=np.float64)
    K = C.shape[0]
    m = max(0, min(int(n), K - 1))
    idx = np.zeros((K, m), dtype=np.int64)
    score = np.zeros((K, m))
    if m == 0:
        return idx, score
    U = _unit(C) if metric == "cosine" else C
    sq = (U * U).sum(axis=1)
    for s in range(0, K, block):
        Ub = U[s:s + block]
        D = np.maximum(sq[s:s + block, None] + sq[None, :] - 2.0 * (Ub @ U.T), 0.0)
        D[np.arange(Ub.shape[0]), np.arange(s, s + Ub.shape[0])] = np.inf
        part = np.argpartition(D, m - 1, axis=1)[:, :m] if m < K else np.argsort(D, axis=1)
        dpart = np.take_along_axis(D, part, axis=1)
        o = np.lexsort((part, dpart), axis=1)        # nearest first; ties: lower index
        part = np.take_along_axis(part, o, axis=1)
        dpart = np.take_along_axis(dpart, o, axis=1)
        idx[s:s + block] = part
        score[s:s + block] = 1.0 - dpart / 2.0 if metric == "cosine" else dpart
    return idx, score


def closest_pairs(idx, score, metric="cosine", n=20):
    """The ``n`` closest distinct cluster pairs ``(a, b, score)`` (a < b) from
    :func:`nearest_clusters` (most similar first): the candidates for a merge."""
    seen = {}
    for a in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            b = int(idx[a, j])
            key = (min(a, b), max(a, b))
            seen.setdefault(key, float(score[a, j]))
    items = sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]) if metric == "cosine"
                   else (kv[1], kv[0]))
    return [(a, b, s) for (a, b), s in items[:n]]


def ambiguous_rows(probability, labels, runner_up, margin=None, texts=None, n=50,
                   below=None):
    """The ``n`` distinct queries (rows without text: rows) with the lowest probability
    (ties: first row) among the rows whose ``margin`` is below ``below`` (None: every row;
    :class:`fastanneal.QueryClusters` and the command use half the median margin), as a
    list of dicts ``row, query, cluster, runner_up, probability, margin`` (the report's
    "ambiguous queries"). Rows without a runner-up are left out; None where no row has
    one (K = 1)."""
    from ._cli_results import _fewest_distinct
    p = np.asarray(probability, dtype=float)
    ok = np.asarray(runner_up) >= 0
    if not ok.any() or n <= 0:
        return None
    ok &= np.isfinite(p)
    if below is not None and margin is not None:
        ok &= np.asarray(margin) < below
    cand = np.nonzero(ok)[0]
    order = cand[np.lexsort((cand, p[cand]))]
    best = _fewest_distinct([], ((float(p[i]), int(i), int(labels[i]), int(runner_up[i]),
                                  None if margin is None else float(margin[i]),
                                  None if texts is None else texts[i])
                                 for i in order.tolist()), n)
    return [{"row": r, "query": t, "cluster": k, "runner_up": ru, "probability": pr,
             "margin": m} for pr, r, k, ru, m, t in best]


# =========================================================================== HTML pieces
def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return ""
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    return str(v)


def _num_td(v, text=None):
    dv = "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else repr(float(v))
    return f'<td class="num" data-v="{dv}">{_e(_fmt(v) if text is None else text)}</td>'


def _short(s, n=60):
    s = "" if s is None else str(s)
    return s if len(s) <= n else s[:n - 1] + "\u2026"


def _cluster_ref(k, labels):
    lab = labels[k] if 0 <= k < len(labels) else ""
    # <bdi>: a right-to-left label does not reorder what follows it in the cell
    return f'<a href="#c{k}">#{k}</a> <bdi>{_e(_short(lab, 40))}</bdi>'


def _cluster_td(k, labels):
    """A table cell naming cluster ``k`` that sorts by its number (as text "#10" came
    before "#2")."""
    return f'<td data-v="{int(k)}">{_cluster_ref(int(k), labels)}</td>'


def _clusters_table(rows, labels, near_idx, near_score, metric):
    sim = "cos" if metric == "cosine" else "d\u00b2"
    has_reps = any(r.get("representative_queries") for r in rows)
    has_central = any(r.get("central_query") for r in rows)
    heads = [("cluster", "#", True), ("size", "size", True), ("share", "share", True),
             ("label", "label", False)]
    if has_reps or has_central:
        heads.append(("queries", "representative queries" if has_reps else "central query",
                      False))
    heads += [("cohesion", "cohesion", True), ("nearest", f"nearest clusters ({sim})", False)]
    th = "".join(f'<th data-key="{k}" scope="col">{_e(t)}</th>' for k, t, _ in heads)
    body = []
    for i, r in enumerate(rows):
        k = int(r.get("cluster", i))
        cells = [_num_td(k), _num_td(r.get("size")),
                 _num_td(r.get("share"), None if r.get("share") is None
                         else f"{100 * float(r['share']):.1f}%")]
        terms = r.get("terms") or ""
        lab = r.get("label") or ""
        cells.append(f'<td><span class="label">{_e(_short(lab, 120))}</span>'
                     + (f'<br><span class="terms">{_e(_short(terms, 120))}</span>'
                        if terms and terms != lab else "") + "</td>")
        if has_reps or has_central:
            qs = list(r.get("representative_queries") or []) or (
                [r["central_query"]] if r.get("central_query") else [])
            cells.append("<td><ul>" + "".join(f"<li>{_e(_short(q, 90))}</li>" for q in qs)
                         + "</ul></td>")
        cells.append(_num_td(r.get("cohesion")))
        if near_idx is not None and k < near_idx.shape[0]:
            items = [f'{_cluster_ref(int(j), labels)} ({s:.2f})'
                     for j, s in zip(near_idx[k], near_score[k])]
            cells.append('<td class="near">' + "<br>".join(items) + "</td>")
        else:
            cells.append("<td></td>")
        body.append(f'<tr id="c{k}">' + "".join(cells) + "</tr>")
    return (f'<table id="clusters" class="clusters sortable"><thead><tr>{th}</tr></thead><tbody>'
            + "\n".join(body) + "</tbody></table>")


def _ambiguous_table(amb, labels):
    th = "".join(f"<th>{t}</th>" for t in ("row (from 1)", "query", "cluster", "runner-up",
                                            "probability", "margin"))
    body = []
    for a in amb:
        q = a.get("query")
        # rows count from 1, as central_row and every message of the command do
        body.append("<tr>" + _num_td(a["row"] + 1) + f"<td>{_e(_short(q, 90))}</td>"
                    + _cluster_td(a['cluster'], labels)
                    + _cluster_td(a['runner_up'], labels)
                    + _num_td(a["probability"]) + _num_td(a.get("margin")) + "</tr>")
    return (f'<table id="ambiguous" class="ambiguous sortable"><thead><tr>{th}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def _pairs_table(pairs, labels, sizes, metric):
    sim = "cosine of the centers" if metric == "cosine" else "squared distance"
    th = "".join(f"<th>{t}</th>" for t in ("cluster", "size", "cluster", "size", sim))
    body = []
    for a, b, s in pairs:
        body.append("<tr>" + _cluster_td(a, labels) + _num_td(int(sizes[a]))
                    + _cluster_td(b, labels) + _num_td(int(sizes[b]))
                    + _num_td(s, f"{s:.3f}") + "</tr>")
    return (f'<table id="pairs" class="pairs sortable"><thead><tr>{th}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def sizes_svg(sizes):
    """Rows per cluster, largest first (a rank plot; log scale when sizes spread > 30x)."""
    s = np.sort(np.asarray(sizes, dtype=float))[::-1]
    x = np.arange(1, s.shape[0] + 1, dtype=float)
    logy = bool(s.size and s.min() > 0 and s.max() / s.min() > 30)
    return svg_chart([{"x": x, "y": s, "color": "#0969da", "step": True, "fill": True,
                       "marker": False}],
                     "rows per cluster, largest first", "cluster rank", "rows", width=620,
                     height=240, logy=logy, ymin=None if logy else 0.0)


def certificate_form(trace, responsibilities="softmax"):
    """How the trace's certificate reads: ``(mass_constrained, bound_text)``. The
    mass-constrained softmax of the critical schedule has ``T sum_k J_k log p_k <= J - F <=
    0`` (its trace records the negative lower bound); plain softmax ``0 <= J - F <= T W log
    K``; entmax-1.5 ``0 <= J - F <= (4/3) T W (1 - K^-1/2)``."""
    bound = np.asarray(trace.get("certificate_bound", []), dtype=float)
    gap = np.asarray(trace.get("certificate_gap", []), dtype=float)
    mass = bool((bound < 0).any() or (gap < 0).any())
    if mass:
        return True, "-T \u03a3 J\u2096 log p\u2096"
    if responsibilities == "entmax15":
        return False, "(4/3) T W (1 - K^-1/2)"
    return False, "T W log K"


def trace_svgs(trace, responsibilities="softmax"):
    """Six small charts of the annealing trace (one per diagnostic), as SVG strings.
    ``responsibilities``: the fit's rule (the certificate's bound depends on it)."""
    step = np.asarray(trace.get("step", []))
    sel = step >= 0
    g = {k: np.asarray(v)[sel] for k, v in trace.items()}
    x = step[sel].astype(float)
    J_polish = np.asarray(trace.get("hard_distortion", []))[~sel]
    T = g.get("temperature", np.zeros(0))
    w, h = 400, 230
    figs = [svg_chart([{"x": x, "y": T, "color": "#0969da"}], "temperature T",
                      "temperature step", "T", w, h, logy=bool(T.size and (T > 0).all())),
            svg_chart([{"x": x, "y": g.get("entropy", np.zeros(0)), "color": "#8250df"}],
                      "assignment entropy (nats per unit weight)", "temperature step",
                      "entropy", w, h, ymin=0.0)]
    hl = [(float(J_polish[-1]), "#1a7f37", "J after polish")] if J_polish.size else []
    figs.append(svg_chart([{"x": x, "y": g.get("free_energy", np.zeros(0)), "color": "#cf222e",
                            "label": "free energy F"},
                           {"x": x, "y": g.get("hard_distortion", np.zeros(0)),
                            "color": "#1a7f37", "label": "hard objective J"}],
                          "F and J", "temperature step", "", w, h, hlines=hl))
    figs.append(svg_chart([{"x": x, "y": g.get("hardening_gap", np.zeros(0)),
                            "color": "#bc4c00"}],
                          "hardening gap (soft - hard distortion)", "temperature step", "", w, h))
    gap = np.asarray(g.get("certificate_gap", np.zeros(0)), dtype=float)
    bound = np.asarray(g.get("certificate_bound", np.zeros(0)), dtype=float)
    mass, btext = certificate_form(g, responsibilities)
    if mass:
        # T sum_k J_k log p_k <= J - F <= 0: drawn as F - J >= 0 under -lower
        gap, bound, gname = -gap, -bound, "F - J"
    else:
        gname = "J - F"
    pos = np.concatenate([gap[gap > 0], bound[bound > 0]])
    figs.append(svg_chart([{"x": x, "y": gap, "color": "#cf222e", "label": gname},
                           {"x": x, "y": bound, "color": "#57606a", "dash": True,
                            "label": f"bound {btext}"}],
                          f"certificate 0 \u2264 {gname} \u2264 {btext}", "temperature step",
                          "", w, h, logy=bool(pos.size)))
    nd = np.asarray(g.get("n_distinct", np.zeros_like(x)), dtype=float)
    figs.append(svg_chart([{"x": x, "y": nd, "color": "#0550ae"}], "distinct centers",
                          "temperature step", "centers", w, h, ymin=0.0))
    return figs


def choose_k_svgs(suggestion, top=3):
    """The K-choosing evidence: effective clusters against T with the widest plateaus
    shaded, and J against K (two SVG strings)."""
    T = np.asarray(suggestion.path_temperature, dtype=float)
    nd = np.asarray(suggestion.path_clusters, dtype=float)
    colors = ["#2da44e", "#bf8700", "#8250df", "#cf222e"]
    bands = []
    for j, k in enumerate(suggestion.ranking[:top]):
        i = int(np.nonzero(suggestion.ks == k)[0][0])
        lo, hi = float(suggestion.t_out[i]), float(suggestion.t_in[i])
        if np.isfinite(lo) and np.isfinite(hi) and hi > lo > 0:
            bands.append((lo, hi, colors[j % len(colors)],
                          f"K={k} (width {suggestion.width[i]:.2f})"))
    a = svg_chart([{"x": T, "y": nd, "color": "#0550ae", "step": True, "marker": False}],
                  "phase transitions", "temperature T (log, cooling \u2192)",
                  "effective clusters", 520, 260, logx=True, reverse_x=True, bands=bands)
    J = np.asarray(suggestion.hard_distortion, dtype=float)
    b = svg_chart([{"x": np.asarray(suggestion.ks, dtype=float), "y": J, "color": "#0550ae"}],
                  "objective along the path", "K", "J (hard distortion)", 420, 260,
                  vlines=[(float(suggestion.best), "#2da44e",
                           f"suggested K={suggestion.best}")])
    return a, b


# =========================================================================== the report
def build_report(title, summary, trace, clusters, centers, metric="cosine",
                 k_suggestion=None, ambiguous=None, n_neighbours=3, n_pairs=20,
                 responsibilities="softmax"):
    """The report as one HTML string.

    Parameters
    ----------
    title : str
    summary : list of (name, value) pairs
    trace : dict of arrays (``Trace.as_dict()``)
    clusters : ``pyarrow.Table`` or list of dicts
        The cluster table (``cluster, size, weight, share, label, central_query,
        representative_queries, cohesion, terms`` ...), in the order of ``centers``.
    centers : (K, D) array
    metric : {"cosine", "euclidean"}
    k_suggestion : :class:`fastanneal.KSuggestion`, optional
        Adds the "Choosing K" section.
    ambiguous : list of dicts, optional
        :func:`ambiguous_rows`: adds the "Ambiguous queries" section (an empty list: the
        section says that no row is near a border; None: no section).
    n_neighbours, n_pairs : int
        Nearest clusters listed per cluster; closest pairs listed.
    responsibilities : {"softmax", "entmax15", "hard"}
        The fit's rule: the bound of the certificate chart depends on it.
    """
    rows = clusters.to_pylist() if hasattr(clusters, "to_pylist") else list(clusters)
    K = len(rows)
    labels = [r.get("label") or "" for r in rows]
    sizes = np.array([r.get("size", 0) for r in rows], dtype=float)
    C = np.asarray(centers)
    near_idx = near_score = None
    pairs = []
    if C.ndim == 2 and C.shape[0] == K and K > 1:
        near_idx, near_score = nearest_clusters(C, metric, n_neighbours)
        pairs = closest_pairs(near_idx, near_score, metric, n_pairs)
    nav = [("summary", "Summary"), ("clusters-h", "Clusters")]
    if ambiguous is not None:
        nav.append(("ambiguous-h", "Ambiguous queries"))
    nav += [("pairs-h", "Closest pairs"), ("sizes", "Sizes")]
    if k_suggestion is not None:
        nav.append(("choose-k", "Choosing K"))
    nav.append(("trace", "Annealing diagnostics"))
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{_e(title)}</title>",
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1>",
             '<p class="muted">Annealed soft k-means (fastanneal). One self-contained file: '
             "no network, no plugins.</p>",
             "<nav>" + "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in nav) + "</nav>",
             '<h2 id="summary">Summary</h2><table class="summary">']
    for k, v in summary:
        parts.append(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>")
    parts.append("</table>")
    # ------------------------------------------------------------------ clusters
    parts.append(f'<h2 id="clusters-h">Clusters ({K:,})</h2>')
    parts.append('<p class="muted">Largest first. <b>label</b>: the most distinctive terms '
                 "of the cluster (class-based TF-IDF); <b>representative queries</b>: distinct "
                 "members closest to the center; <b>cohesion</b>: "
                 + ("mean cosine of the members to the center (1 = identical)" if
                    metric == "cosine" else "minus the mean squared distance of the members "
                    "to the center (0 = identical; higher is tighter)")
                 + "; <b>nearest clusters</b>: the most similar other "
                 "clusters. Click a heading to sort; the search box filters on every cell "
                 "(link to a search with <code>#q=word</code>).</p>")
    parts.append('<input type="search" id="cluster-search" class="search" '
                 'placeholder="search clusters: label, query, number" data-table="clusters" '
                 'data-count="cluster-count" aria-label="search clusters"> '
                 f'<span id="cluster-count" class="muted">{K:,} rows</span>')
    parts.append(_clusters_table(rows, labels, near_idx, near_score, metric))
    # ------------------------------------------------------------------ ambiguous
    if ambiguous is not None:
        parts.append('<h2 id="ambiguous-h">Ambiguous queries</h2>')
        if ambiguous:
            parts.append(f'<p class="muted">The {len(ambiguous)} distinct queries the '
                         "clustering is least sure of: lowest probability of their cluster, "
                         "with the runner-up cluster, among the rows whose margin is below "
                         "half the median margin (nearer a border than most rows). "
                         "Probability and margin are defined in the documentation (the "
                         "probability is the soft assignment at a temperature chosen from "
                         "the data: it ranks rows within this fit).</p>")
            parts.append(_ambiguous_table(ambiguous, labels))
        else:
            parts.append('<p class="muted">None: no row\'s margin is below half the median '
                         "margin; every row is clearly nearer its own cluster than any "
                         "other.</p>")
    # ------------------------------------------------------------------ similarity + sizes
    parts.append('<h2 id="pairs-h">Closest cluster pairs</h2>')
    if pairs:
        parts.append('<p class="muted">The most similar pairs of clusters: candidates to '
                     "merge, or topics that border each other.</p>")
        parts.append(_pairs_table(pairs, labels, sizes, metric))
    else:
        parts.append('<p class="muted">One cluster: no pairs.</p>')
    parts.append('<h2 id="sizes">Cluster sizes</h2>')
    parts.append(f"<figure>{sizes_svg(sizes)}<figcaption>Rows per cluster against the "
                 "cluster's rank (largest first).</figcaption></figure>")
    # ------------------------------------------------------------------ diagnostics
    if k_suggestion is not None:
        top = ", ".join(f"K={r['k']} ({r['width']:.2f})" for r in k_suggestion.table()[:5])
        a, b = choose_k_svgs(k_suggestion)
        parts.append('<h2 id="choose-k">Choosing K</h2>')
        parts.append(f'<figure><div class="figs">{a}{b}</div><figcaption>Left: effective '
                     "clusters on the annealing path against the temperature (log scale, "
                     "cooling to the right); the shaded bands are the widest plateaus. Right: "
                     "the hard objective J of the coldest state of each K on the path. Ranked "
                     f"by plateau width in log T: {_e(top)}.</figcaption></figure>")
    parts.append('<h2 id="trace">Annealing diagnostics</h2>')
    mass, btext = certificate_form(trace, responsibilities)
    cert = (f"the mass-constrained rule of the critical schedule keeps {_e(btext[1:])} &le; "
            "J &minus; F &le; 0, drawn as F &minus; J" if mass else
            f"the certificate keeps 0 &le; J &minus; F &le; {_e(btext)}")
    parts.append('<figure><div class="figs">' + "".join(trace_svgs(trace, responsibilities))
                 + "</div><figcaption>Per temperature step: T falls along the schedule; the "
                 "entropy of the soft assignments falls as clusters harden; F (the soft "
                 "objective) and J (the hard one) of the centers each step starts from "
                 "meet as T falls, both falling as the centers improve; "
                 f"{cert}. The dashed line in the F and J chart is J after the final Lloyd "
                 "polish.</figcaption></figure>")
    parts.append(f"<script>{_JS}</script>")
    parts.append("</body></html>")
    return "\n".join(parts)

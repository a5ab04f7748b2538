"""The HTML report: structure, escaping, the cluster views against NumPy references, the
SVG charts, and rendering (search, sort, screenshot) in a headless Chromium."""
import html.parser
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastanneal import AnnealedKMeans
from fastanneal.cli import main
from fastanneal.report import (ambiguous_rows, build_report, closest_pairs, nearest_clusters,
                               svg_chart)


class _Parse(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs, self.tables, self.h2, self.external, self.scripts = 0, [], [], [], 0
        self.rows = {}
        self._table = None
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svgs += 1
        if tag == "script":
            self.scripts += 1
            if "src" in a:
                self.external.append((tag, a))
        if tag in ("link", "iframe", "img", "object", "embed") or any(
                str(v).startswith(("http:", "https:", "//")) for k, v in a.items()
                if k in ("src", "href")):
            self.external.append((tag, a))
        if tag == "table":
            self._table = a.get("id") or a.get("class", "")
            self.tables.append(self._table)
        if tag == "tr" and self._table is not None:
            self.rows[self._table] = self.rows.get(self._table, 0) + 1
        if tag == "h2":
            self._in_h2 = True

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        if tag == "h2":
            self._in_h2 = False

    def handle_data(self, data):
        if self._in_h2:
            self.h2.append(data.strip())


def check_structure(text, n_clusters):
    assert text.startswith("<!DOCTYPE html>")
    p = _Parse()
    p.feed(text)
    assert p.external == [], p.external                 # self-contained, no network
    assert p.scripts == 1                                # the inline sort/search script
    assert p.svgs >= 7                                   # sizes + six diagnostics
    assert {"summary", "clusters"} <= set(p.tables)
    assert p.rows["clusters"] == n_clusters + 1          # header + one row per cluster
    heads = [h for h in p.h2 if h]
    assert heads[0] == "Summary" and heads[1].startswith("Clusters")   # clusters first
    assert heads[-1] == "Annealing diagnostics"
    for h in ("Cluster sizes", "Closest cluster pairs"):
        assert h in heads
    for start in [i for i in range(len(text)) if text.startswith("<svg", i)]:
        ET.fromstring(text[start:text.index("</svg>", start) + 6])   # well-formed SVG
    return p


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(5)
    C = rng.normal(size=(5, 10)) * 3
    lab = np.arange(400) % 5
    X = C[lab] + rng.normal(size=(400, 10))
    est = AnnealedKMeans(5, metric="cosine", random_state=0).fit(X)
    return X, est


def _table(est, texts):
    K = est.n_clusters
    sizes = np.bincount(est.labels_, minlength=K)
    return pa.table({"cluster": np.arange(K), "size": sizes, "weight": sizes.astype(float),
                     "share": sizes / sizes.sum(), "label": [f"t{k} / u{k}" for k in range(K)],
                     "central_query": texts[:K], "cohesion": np.linspace(.5, .9, K),
                     "terms": ["a, b"] * K})


def test_report_structure_and_escaping(fitted):
    X, est = fitted
    texts = ["<script>alert(1)</script>", "a & b", "plain", "x", "y"]
    text = build_report("run <1>", [("rows", "400"), ("K", "5")], est.trace_.as_dict(),
                        _table(est, texts), est.cluster_centers_)
    check_structure(text, 5)
    assert "<script>alert" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "a &amp; b" in text and "run &lt;1&gt;" in text


@pytest.mark.parametrize("kw, title, caption", [
    ({}, "certificate 0 \u2264 J - F \u2264 T W log K", "0 &le; J &minus; F &le; T W log K"),
    (dict(responsibilities="entmax15"), "certificate 0 \u2264 J - F \u2264 (4/3) T W",
     "0 &le; J &minus; F &le; (4/3) T W (1 - K^-1/2)"),
    (dict(schedule="critical"), "certificate 0 \u2264 F - J \u2264 -T \u03a3",
     "&le; J &minus; F &le; 0, drawn as F &minus; J"),
])
def test_the_certificate_chart_follows_the_fits_rule(kw, title, caption):
    """The critical schedule's mass-constrained softmax has T sum_k J_k log p_k <= J - F <=
    0: the chart clipped J - F at 0 (a flat line) under a negative "bound T W log K" and the
    caption claimed 0 <= J - F <= T W log K; entmax-1.5's bound is (4/3) T W (1 - K^-1/2).
    The chart now draws what the trace holds, with the rule's own bound, non-negative."""
    X = np.random.default_rng(0).normal(size=(600, 4)) + np.repeat(np.eye(4) * 6, 150, 0)
    est = AnnealedKMeans(4, random_state=0, **kw).fit(X)
    text = build_report("t", [], est.trace_.as_dict(), _table(est, ["q"] * 4),
                        est.cluster_centers_, metric="euclidean",
                        responsibilities=est.responsibilities)
    check_structure(text, 4)
    assert title in text and caption in text
    gap = np.asarray(est.trace_.as_dict()["certificate_gap"])
    if "critical" in kw.values():
        assert gap.min() < 0                    # what the old chart hid
    # title (aria-label, <title>, text), legend, caption
    assert text.count("T W log K") == (5 if not kw else 0)


def test_report_text_is_isolated_and_without_control_characters(fitted):
    """A right-to-left label does not reorder the score after it (<bdi>); C0 control
    characters (a parse error in HTML) are shown as U+FFFD."""
    X, est = fitted
    tab = _table(est, ["nul\x00here", "bell\x07", "ok", "x", "y"])
    tab = tab.set_column(tab.schema.get_field_index("label"), "label",
                         pa.array(["\u05e9\u05dc\u05d5\u05dd"] + [f"t{k}" for k in range(1, 5)]))
    text = build_report("t", [], est.trace_.as_dict(), tab, est.cluster_centers_)
    check_structure(text, 5)
    assert "\x00" not in text and "\x07" not in text and "nul\ufffdhere" in text
    assert "<bdi>\u05e9\u05dc\u05d5\u05dd</bdi>" in text


def test_report_with_one_cluster_and_no_trace_rows(fitted):
    X, est = fitted
    trace = {k: v[-1:] for k, v in est.trace_.as_dict().items()}    # only the polish record
    one = _table(est, ["q"] * 5).slice(0, 1)
    text = build_report("tiny", [], trace, one, est.cluster_centers_[:1])
    check_structure(text, 1)


def test_nearest_clusters_and_pairs_match_numpy():
    rng = np.random.default_rng(11)
    C = rng.normal(size=(300, 7))             # > one block of 256 rows
    for metric in ("cosine", "euclidean"):
        idx, score = nearest_clusters(C, metric, n=4)
        U = C / np.linalg.norm(C, axis=1, keepdims=True) if metric == "cosine" else C
        D = ((U[:, None, :] - U[None, :, :]) ** 2).sum(-1)
        np.fill_diagonal(D, np.inf)
        ref = np.argsort(D, axis=1, kind="stable")[:, :4]
        np.testing.assert_array_equal(idx, ref)
        want = (U @ U.T)[np.arange(300)[:, None], ref] if metric == "cosine" else \
            np.take_along_axis(D, ref, axis=1)
        np.testing.assert_allclose(score, want, atol=1e-9)
        pairs = closest_pairs(idx, score, metric, n=10)
        iu = np.triu_indices(300, 1)
        best = np.argsort(D[iu], kind="stable")[:10]
        assert [(a, b) for a, b, _ in pairs] == [(int(iu[0][j]), int(iu[1][j])) for j in best]
    idx, score = nearest_clusters(C[:1], "cosine")
    assert idx.shape == (1, 0)


def test_ambiguous_rows_are_the_least_probable():
    rng = np.random.default_rng(3)
    p = rng.uniform(size=200)
    lab = rng.integers(0, 5, 200)
    ru = (lab + 1) % 5
    ru[7] = -1                                  # no runner-up (K = 1): never listed
    p[7] = -1.0
    amb = ambiguous_rows(p, lab, ru, margin=p * 2, texts=[f"q{i}" for i in range(200)], n=12)
    want = [i for i in np.argsort(p, kind="stable") if i != 7][:12]
    assert [a["row"] for a in amb] == want
    assert amb[0]["query"] == f"q{want[0]}" and amb[0]["runner_up"] == ru[want[0]]
    assert ambiguous_rows(p, lab, np.full(200, -1)) is None     # K = 1: no section


def test_ambiguous_queries_are_distinct_and_near_a_border():
    """60 copies of one border query filled the whole list; rows of clusters all clearly
    apart were listed as "least sure" (probability 0.87 on perfectly separated blobs)."""
    from fastanneal._cli_results import ClusterSummary
    rng = np.random.default_rng(4)
    n = 300
    p = rng.uniform(0.5, 1.0, n)
    p[100:160] = 0.3                                    # one query, 60 times, on a border
    texts = [f"q{i}" for i in range(n)]
    texts[100:160] = ["apple"] * 60
    lab = rng.integers(0, 4, n)
    ru = (lab + 1) % 4
    margin = 4.0 * p
    amb = ambiguous_rows(p, lab, ru, margin, texts, n=10)
    assert [a["query"] for a in amb][0] == "apple" and len({a["query"] for a in amb}) == 10
    assert [a["row"] for a in amb[1:]] == [i for i in np.argsort(p, kind="stable")
                                           if not 100 <= i < 160][:9]
    # near a border only: margin below the bound
    amb = ambiguous_rows(p, lab, ru, margin, texts, n=10, below=2.4)
    assert amb and all(a["margin"] < 2.4 for a in amb)
    assert ambiguous_rows(p, lab, ru, margin, texts, n=10, below=0.1) == []
    # the command's block-wise summary lists the same, whatever the blocks and merges
    cos = rng.uniform(size=n)
    whole = ClusterSummary(4, n, 3, n_ambiguous=10, ambiguous_below=2.4)
    whole.add(0, lab, p, margin, ru, cos, np.ones(n), texts)
    parts = []
    for a, b in ((0, 120), (120, 130), (130, n)):
        s = ClusterSummary(4, n, 3, n_ambiguous=10, ambiguous_below=2.4)
        s.add(a, lab[a:b], p[a:b], margin[a:b], ru[a:b], cos[a:b], np.ones(b - a), texts[a:b])
        parts.append(s)
    merged = parts[2].merge(parts[0]).merge(parts[1])
    rank = np.arange(4)
    assert merged.ambiguous_rows(rank) == whole.ambiguous_rows(rank) == amb
    # the report: an empty list says so, None leaves the section out
    X = np.random.default_rng(0).normal(size=(200, 4)) + np.repeat(np.eye(4) * 60, 50, 0)
    est = AnnealedKMeans(4, random_state=0).fit(X)
    args = ("t", [], est.trace_.as_dict(), _table(est, ["q"] * 4), est.cluster_centers_)
    html = build_report(*args, ambiguous=[])
    assert "Ambiguous queries" in html and "no row" in html
    assert "Ambiguous queries" not in build_report(*args)


def test_svg_chart_is_well_formed_and_says_when_empty():
    x = np.arange(1, 30, dtype=float)
    svg = svg_chart([{"x": x, "y": np.exp(-x), "label": "a <b>"},
                     {"x": x, "y": np.r_[np.nan, x[1:]], "dash": True}],
                    "t & t", "x", "y", logy=True, bands=[(3, 8, "#0f0", "band")],
                    vlines=[(5, "#f00", "v")], hlines=[(1e-3, "#00f", "h")])
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert "a &lt;b&gt;" in svg and "t &amp; t" in svg
    assert svg.count("<polyline") == 2
    empty = svg_chart([{"x": [1.0], "y": [np.nan]}], "nothing")
    ET.fromstring(empty)
    assert "no data" in empty
    neg = svg_chart([{"x": [1.0, 2.0], "y": [-1.0, 0.0]}], "log of non-positive", logy=True)
    assert "no data" in neg


def test_report_lists_ambiguous_queries_and_neighbours(fitted):
    X, est = fitted
    amb = [{"row": 4, "query": "<b>tie</b>", "cluster": 1, "runner_up": 3,
            "probability": 0.51, "margin": 0.01}]
    text = build_report("r", [], est.trace_.as_dict(), _table(est, ["q"] * 5),
                        est.cluster_centers_, ambiguous=amb)
    p = check_structure(text, 5)
    assert p.rows["ambiguous"] == 2 and "Ambiguous queries" in p.h2
    assert "&lt;b&gt;tie&lt;/b&gt;" in text
    amb_html = text[text.index('<table id="ambiguous"'):]
    # rows count from 1 in the report, as central_row and the command's messages do
    assert "row (from 1)" in amb_html and ">5</td>" in amb_html and ">4</td>" not in amb_html
    idx, _ = nearest_clusters(est.cluster_centers_, "cosine", 3)
    row0 = text[text.index('<tr id="c0">'):text.index("</tr>", text.index('<tr id="c0">'))]
    for j in idx[0]:
        assert f'href="#c{j}"' in row0


@pytest.fixture(scope="module")
def cli_report(tmp_path_factory):
    """A report written by the command line on a small real sample (CLINC150 demo rows)."""
    d = tmp_path_factory.mktemp("rep")
    from fastanneal.cli import DEMO_DATA
    t = pq.read_table(DEMO_DATA)
    keep = np.isin(np.asarray(t.column("label").to_pylist()),
                   ["alarm", "roll_dice", "translate", "pin_change", "book_flight", "thank_you"])
    pq.write_table(t.filter(pa.array(keep)), d / "q.parquet")
    rc = main(["cluster", str(d / "q.parquet"), "-o", str(d / "out.csv"), "--k", "6",
               "--embedding-column", "embedding", "--truth-column", "label",
               "--report", str(d / "report.html"), "--steps", "8", "-q"])
    assert rc == 0
    return d / "report.html"


def test_cli_report_structure(cli_report):
    text = cli_report.read_text(encoding="utf-8")
    check_structure(text, 6)
    assert "ARI vs &#x27;label&#x27;" in text or "ARI vs 'label'" in text
    for word in ("alarm", "dice"):                      # c-TF-IDF labels made it in
        assert word in text


def _chromium(args, timeout=120):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                               "--disable-background-networking", "--disable-component-update",
                               "--disable-sync", "--no-first-run",
                               f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


def test_report_renders_in_headless_chromium(cli_report, tmp_path):
    shot = tmp_path / "shot.png"
    r = _chromium(["--window-size=1200,7000", f"--screenshot={shot}",
                   Path(cli_report).resolve().as_uri()])
    assert shot.exists(), r.stderr[-2000:]
    import matplotlib.image as mpimg
    img = mpimg.imread(shot)
    assert img.shape[0] >= 6000 and img.shape[1] >= 1100
    rgb = img[..., :3]
    # not blank: plenty of non-white pixels, and colour (links, figures) not just black text
    nonwhite = (rgb < 0.95).any(axis=2).mean()
    colourful = (rgb.max(axis=2) - rgb.min(axis=2) > 0.25).mean()
    assert nonwhite > 0.05, nonwhite
    assert colourful > 0.005, colourful


class _Rows(html.parser.HTMLParser):
    """The rows of table#clusters in DOM order: (visible, text, cohesion data-v)."""

    def __init__(self):
        super().__init__()
        self.rows, self._in, self._row, self._td = [], False, None, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "clusters":
            self._in = True
        if self._in and tag == "tr" and "id" in a:
            self._row = ["display: none" not in (a.get("style") or ""), "", []]
        if self._row is not None and tag == "td":
            self._row[2].append(a.get("data-v"))

    def handle_endtag(self, tag):
        if tag == "table":
            self._in = False
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._row is not None:
            self._row[1] += data


def test_report_search_and_sort_run_in_chromium(cli_report):
    """The inline script runs in a real browser: a search given in the address hides the
    rows without the word, a sort orders the rows by the column."""
    uri = Path(cli_report).resolve().as_uri()
    static = _Rows()
    static.feed(Path(cli_report).read_text(encoding="utf-8"))
    assert len(static.rows) == 6 and all(v for v, _, _ in static.rows)
    word = "set an alarm"                        # a query phrase, not in any label
    want = sum(word in t.lower() for _, t, _ in static.rows)
    # the search must hide some rows and keep some, or the check below proves nothing
    assert 1 <= want < 6, f"{want} of 6 rows contain {word!r}: pick another phrase"
    r = _chromium(["--dump-dom", uri + "#q=set%20an%20alarm"])
    dom = _Rows()
    dom.feed(r.stdout)
    assert len(dom.rows) == 6, r.stderr[-2000:]
    shown = [t for v, t, _ in dom.rows if v]
    assert len(shown) == want and all(word in t.lower() for t in shown)
    assert f"showing {want} of 6" in r.stdout
    r = _chromium(["--dump-dom", uri + "#sort=-cohesion"])
    dom = _Rows()
    dom.feed(r.stdout)
    coh = [float(cells[5]) for _, _, cells in dom.rows]
    assert coh == sorted(coh, reverse=True)
    assert 'data-key="cohesion" scope="col" aria-sort="descending"' in r.stdout
    # a bare '%' (not valid percent-encoding) is searched as typed: the script used to stop
    # on decodeURIComponent's URIError and show every row
    r = _chromium(["--dump-dom", uri + "#q=100%"])
    assert "showing 0 of 6" in r.stdout, r.stderr[-2000:]


def test_report_with_the_choose_k_evidence(fitted):
    X, est = fitted
    import fastanneal
    s = fastanneal.suggest_k(X, k_max=8, metric="cosine", random_state=0)
    text = build_report("auto", [], est.trace_.as_dict(), _table(est, ["q"] * 5),
                        est.cluster_centers_, k_suggestion=s)
    p = check_structure(text, 5)
    assert "Choosing K" in p.h2
    assert p.svgs >= 9                                   # + the two K-choosing charts
    assert f"suggested K={s.best}" in text

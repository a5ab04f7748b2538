"""The HTML report: structure (always) and rendering in a headless Chromium (when present)."""
import base64
import html.parser
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("matplotlib", reason="the report needs fastanneal[report] (matplotlib)")

from fastanneal import AnnealedKMeans  # noqa: E402
from fastanneal.cli import main  # noqa: E402
from fastanneal.report import build_report, pca_2d  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Parse(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.tables, self.h2, self.external = [], [], [], []
        self.rows = {}
        self._table = None
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        if tag in ("script", "link", "iframe") or (tag == "img" and not
                                                     a.get("src", "").startswith("data:")):
            self.external.append((tag, a))
        if tag == "table":
            self._table = a.get("class", "")
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
    assert p.external == [], p.external                 # self-contained
    assert len(p.imgs) == 3
    for src in p.imgs:
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.split(",", 1)[1])
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
    assert {"summary", "clusters"} <= set(p.tables)
    assert p.rows["clusters"] == n_clusters + 1          # header + one row per cluster
    for h in ("Summary", "The annealing trace", "Cluster sizes", "Cluster centers", "Clusters"):
        assert h in p.h2
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


def test_report_with_one_cluster_and_no_trace_rows(fitted):
    X, est = fitted
    trace = {k: v[-1:] for k, v in est.trace_.as_dict().items()}    # only the polish record
    one = _table(est, ["q"] * 5).slice(0, 1)
    text = build_report("tiny", [], trace, one, est.cluster_centers_[:1])
    check_structure(text, 1)


def test_pca_2d_matches_covariance_eigenvectors():
    rng = np.random.default_rng(0)
    M = rng.normal(size=(50, 6)) * np.array([5, 2, 1, .5, .1, .1])
    Y, share = pca_2d(M)
    ev = np.linalg.eigvalsh(np.cov(M.T, bias=True))[::-1]
    np.testing.assert_allclose(share, ev[:2] / ev.sum(), rtol=1e-10)
    np.testing.assert_allclose(Y.var(axis=0), ev[:2], rtol=1e-10)
    Y1, s1 = pca_2d(M[:1])
    assert Y1.shape == (1, 2) and (s1 == 0).all()


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


def test_report_renders_in_headless_chromium(cli_report, tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu",
                            "--disable-background-networking", "--disable-component-update",
                            "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                            "--window-size=1200,2200", f"--screenshot={shot}",
                            Path(cli_report).resolve().as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert shot.exists(), r.stderr[-2000:]
    import matplotlib.image as mpimg
    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1100
    rgb = img[..., :3]
    # not blank: plenty of non-white pixels, and colour (the figures) not just black text
    nonwhite = (rgb < 0.95).any(axis=2).mean()
    colourful = (rgb.max(axis=2) - rgb.min(axis=2) > 0.25).mean()
    assert nonwhite > 0.05, nonwhite
    assert colourful > 0.01, colourful

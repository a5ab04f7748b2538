"""The documentation builds without a warning, and its code does not rot silently.

``sphinx-build -W --keep-going -b html docs <tmp>`` (the command CI runs through this test)
must succeed: a broken cross-reference, a malformed numpydoc section, a missing page or an
autodoc import failure is an error. The generated pages are then checked for content that
only the docstrings and the argument parser can supply, and every ```python block of the
user guides must at least compile. The guides' commands were run by hand when written; the
build needs no network (no intersphinx) and no theme beyond Sphinx's own alabaster.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GUIDES = sorted((DOCS / "guide").glob("*.md"))
pytestmark = pytest.mark.slow
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.S | re.M)


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    """Build the HTML docs once for this module (about 15-25 s on two cores)."""
    import sphinx  # noqa: F401  (a docs requirement of the test extra: fail, not skip)
    import myst_parser  # noqa: F401
    import numpydoc  # noqa: F401
    out = tmp_path_factory.mktemp("docs_html")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(out / ".doctrees"), str(DOCS), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"sphinx-build failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return out


def _text(path):
    """The visible text of an HTML page (tags dropped, entities of interest decoded)."""
    raw = path.read_text(encoding="utf-8")
    raw = re.sub(r"<[^>]+>", "", raw)
    return raw.replace("&#8212;", "--").replace("&quot;", '"').replace("&#39;", "'")


def test_docs_build_without_warnings(html):
    assert GUIDES, "no user guide pages"
    for page in ["index", "theory", "benchmarking", "api/index", "api/cli", "api/estimators",
                 "api/dask", "api/cuda", *[f"guide/{g.stem}" for g in GUIDES]]:
        assert (html / f"{page}.html").is_file(), page


def test_api_page_has_the_estimator_parameters(html):
    text = _text(html / "api" / "estimators.html")
    assert "AnnealedKMeans" in text and "MiniBatchAnnealedKMeans" in text
    for name in ("n_clusters", "temperature_start", "temperature_end_ratio", "schedule",
                 "checkpoint", "cluster_centers_", "predict_proba"):
        assert name in text, name


def test_api_pages_cover_the_public_names(html):
    import fastanneal
    import fastanneal.cuda
    import fastanneal.dask
    ids = set()
    for page in (html / "api").glob("*.html"):
        ids.update(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))
    missing = [f"fastanneal.{n}" for n in fastanneal.__all__ if f"fastanneal.{n}" not in ids]
    missing += [f"fastanneal.cuda.{n}" for n in fastanneal.cuda.__all__
                if f"fastanneal.cuda.{n}" not in ids]
    missing += [f"fastanneal.dask.{n}" for n in fastanneal.dask.__all__
                if f"fastanneal.dask.{n}" not in ids]
    assert not missing, f"public names without an API entry: {missing}"


def test_cli_page_is_the_parser_help(html):
    text = _text(html / "api" / "cli.html")
    for needle in ("--embedding-column", "--checkpoint", "--backend", "--k-max", "suggest-k",
                   "fastanneal demo", "--no-report"):
        assert needle in text, needle


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
def test_guide_python_blocks_compile(guide):
    """Every ```python block of a user guide compiles (names and calls are checked by hand
    and by the library's own tests; this catches a block that no longer parses)."""
    blocks = [m for m in FENCE.finditer(guide.read_text(encoding="utf-8"))
              if m.group("lang").strip().lower() in ("python", "py")]
    for m in blocks:
        body = "\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines())
        line = guide.read_text(encoding="utf-8")[:m.start()].count("\n") + 1
        compile(body, f"{guide.relative_to(REPO)}:{line}", "exec")


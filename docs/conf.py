"""Sphinx configuration of the fastanneal documentation.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (``tests/test_docs.py``
runs exactly this). Offline: no intersphinx, no theme beyond the built-in alabaster.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))            # cli_help, the local extension
sys.path.insert(0, os.path.dirname(HERE))                 # the package, also when not installed

import fastanneal  # noqa: E402

project = "fastanneal"
author = "the fastanneal authors"
copyright = "the fastanneal authors"
release = version = fastanneal.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
    "cli_help",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = []

html_theme = "alabaster"
html_static_path = []
html_theme_options = {"description": "Annealed soft k-means for dense query embeddings",
                      "fixed_sidebar": True}

# MyST: headings get anchors so that the links of theory.md's contents list resolve.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# autodoc / numpydoc
autodoc_default_options = {}          # members are listed page by page
autodoc_member_order = "bysource"
autodoc_typehints = "none"              # types are stated in the numpydoc sections
autosummary_generate = False
numpydoc_show_class_members = False     # autodoc lists the members; no stub pages
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

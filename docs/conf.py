"""Sphinx configuration: Markdown pages through myst-parser; builds offline, strict (-W -n)."""

import os
import sys

project = "ddtree_numba"
author = "the ddtree_numba developers"
copyright = "2026, the ddtree_numba developers"

# ``import ddtree_numba`` chooses the GPU or the simulator by itself; the docs' figures and
# gallery are built on the simulator everywhere, so pin it (CI sets it too).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon",
              "sphinx.ext.viewcode",                    # [source] links, pages built locally
              "sphinx_gallery.gen_gallery", "sphinx-mathjax-offline"]   # MathJax served locally
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "amsmath"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}   # .rst: the gallery
exclude_patterns = ["_build", "_generated/*.md", "auto_examples/*.ipynb", "auto_examples/*.py",
                    "auto_examples/*.zip", "auto_examples/*.json"]
html_theme = "pydata_sphinx_theme"    # NumPy's, SciPy's, pandas' theme; assets bundled, offline
html_title = "ddtree_numba"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 11,   # short toctree titles (index.md): all fit at 1280 px
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_sidebars = {"**": []}              # one level of pages: the top bar lists them all
highlight_language = "none"             # docstring literal blocks are pseudo-code, not Python
html_static_path = []

# Figures and tables generated from the code and the committed benchmark CSVs at every build
# (docs/figures.py); nothing generated is committed, so nothing can go stale.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import figures  # noqa: E402

figures.generate(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_generated"))

autodoc_typehints = "none"          # types are in the numpy-style docstrings
napoleon_numpy_docstring = True
napoleon_google_docstring = False
# The build is offline (no intersphinx), so names of other projects' types cannot resolve;
# the docstrings' own words ("array", "optional", shapes) are not types either.
nitpick_ignore_regex = [
    ("py:class", r"numpy\..*|numba\..*|array|device array|optional|callable|tuple|dict|"
                 r"list|str|int|float|bool|object|sequence|mapping"),
]

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",         # regenerated on every build (not committed)
    "filename_pattern": r"/\d\d_",           # execute every numbered example
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "write_computation_times": False,        # those pages load jQuery / DataTables from CDNs
}

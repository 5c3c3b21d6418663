"""Sphinx configuration: Markdown pages through myst-parser; builds offline, strict (-W -n)."""

project = "ddtree_numba"
author = "the ddtree_numba developers"
copyright = "2026, the ddtree_numba developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Greedy DDTree speculative decoding kernels in numba.cuda",
                      "fixed_sidebar": True}
html_static_path = []

autodoc_typehints = "none"          # types are in the numpy-style docstrings
napoleon_numpy_docstring = True
napoleon_google_docstring = False
# The build is offline (no intersphinx), so names of other projects' types cannot resolve;
# the docstrings' own words ("array", "optional", shapes) are not types either.
nitpick_ignore_regex = [
    ("py:class", r"numpy\..*|numba\..*|array|device array|optional|callable|tuple|dict|"
                 r"list|str|int|float|bool|object"),
]

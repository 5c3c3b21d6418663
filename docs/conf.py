"""Sphinx configuration: Markdown pages through myst-parser; builds offline, strict (-W -n)."""

project = "ddtree_numba"
author = "the ddtree_numba developers"
copyright = "2026, the ddtree_numba developers"

extensions = ["myst_parser"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"description": "Greedy DDTree speculative decoding kernels in numba.cuda",
                      "fixed_sidebar": True}
html_static_path = []

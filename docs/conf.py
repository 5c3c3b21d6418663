"""Sphinx configuration: Markdown pages through myst-parser; builds offline, strict (-W -n)."""

import os

project = "ddtree_numba"
author = "the ddtree_numba developers"
copyright = "2026, the ddtree_numba developers"

# The examples choose the GPU or the simulator before numba is imported; a docs build has no
# GPU to rely on, so pin the simulator (CI sets it too).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon",
              "sphinx_gallery.gen_gallery"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}   # .rst: the gallery
exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py", "auto_examples/*.zip",
                    "auto_examples/*.json"]
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

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",         # regenerated on every build (not committed)
    "filename_pattern": r"/\d\d_",           # execute every numbered example
    "ignore_pattern": r"_common\.py",
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
}

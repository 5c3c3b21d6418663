"""The GPU test run's order (``conftest.py``): the tests measured longest start first, and the
list it reads names tests that exist."""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

from scripts import ROOT

import conftest


def _listed():
    with open(conftest.GPU_TEST_SECONDS) as f:
        return [line.rstrip("\n").split("\t") for line in f
                if line.strip() and not line.startswith("#")]


def test_the_list_names_tests_that_exist():
    """A renamed or removed test would silently lose its place at the front."""
    functions = {}
    missing = []
    for seconds, test in _listed():
        assert float(seconds) >= 0, test
        path, _, name = test.partition("::")
        name = name.split("[")[0]
        if path not in functions:
            source = pathlib.Path(ROOT, path)
            tree = ast.parse(source.read_text()) if source.exists() else ast.Module(body=[])
            functions[path] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name not in functions[path]:
            missing.append(test)
    assert not missing, f"listed in {conftest.GPU_TEST_SECONDS} but not found: {missing}"


def test_longest_listed_tests_go_first_and_the_rest_keep_their_order():
    listed = _listed()
    long_s, longest = listed[0]
    shorter = next(test for s, test in listed if float(s) < float(long_s))
    names = ["tests/test_x.py::a", shorter, "tests/test_x.py::b", longest, "tests/test_x.py::c"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    conftest._longest_first(items)
    assert [i.nodeid for i in items] == [longest, shorter, *(n for n in names if "test_x" in n)]

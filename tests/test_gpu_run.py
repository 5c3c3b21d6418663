"""The GPU test run's order (``conftest.py``): the tests measured longest start first, each
followed by a short one, and the list it reads names tests that exist."""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

from scripts import ROOT

import conftest


def test_the_list_names_tests_that_exist():
    """A renamed or removed test would silently lose its place at the front."""
    functions = {}
    missing = []
    listed = conftest.gpu_test_seconds()
    assert listed, f"nothing read from {conftest.GPU_TEST_SECONDS}"
    for test, seconds in listed.items():
        assert seconds >= 0, test
        path, _, name = test.partition("::")
        name = name.split("[")[0]
        if path not in functions:
            source = pathlib.Path(ROOT, path)
            tree = ast.parse(source.read_text()) if source.exists() else ast.Module(body=[])
            functions[path] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name not in functions[path]:
            missing.append(test)
    assert not missing, f"listed in {conftest.GPU_TEST_SECONDS} but not found: {missing}"


def test_longest_listed_tests_go_first_each_followed_by_another_and_the_rest_keep_order():
    """xdist queues a worker's next test behind the one it runs: a short test follows each
    long one, so that no long test waits behind another."""
    listed = conftest.gpu_test_seconds()
    longest = next(iter(listed))
    assert listed[longest] == max(listed.values()), "the list is not longest first"
    shorter = next(test for test, seconds in listed.items() if seconds < listed[longest])
    names = ["tests/test_x.py::a", shorter, "tests/test_x.py::b", longest, "tests/test_x.py::c",
             "tests/test_x.py::d"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    conftest._longest_first(items)
    assert [i.nodeid for i in items] == [longest, "tests/test_x.py::a", shorter,
                                         "tests/test_x.py::b", "tests/test_x.py::c",
                                         "tests/test_x.py::d"]
    few = [SimpleNamespace(nodeid=n) for n in (shorter, longest)]      # no short test left
    conftest._longest_first(few)
    assert [i.nodeid for i in few] == [longest, shorter]

"""The house stays easy to see: no import cycles, no import from a lower layer into a higher
one (``tools/import_graph.py`` defines the layers), and the step imports no model."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_cycles_and_no_upward_imports():
    tool = load_tool()
    edges = tool.edges(ROOT / "ddtree_numba")
    assert len(edges) > 50                               # the parser sees the package
    assert tool.cycles(edges) == []
    assert tool.upward(edges) == []


def test_the_step_imports_no_model():
    tool = load_tool()
    for a, b, _ in tool.edges(ROOT / "ddtree_numba"):
        if a in ("step", "step.greedy", "step.sampled", "step.ops") or a.startswith("reference"):
            assert not b.startswith("models"), (a, b)


def test_an_upward_import_is_caught(tmp_path):
    tool = load_tool()
    pkg = tmp_path / "ddtree_numba"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "models").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models/__init__.py").write_text("")
    (pkg / "models/toy.py").write_text("from ..kernels import k\n")
    (pkg / "kernels/__init__.py").write_text("from .k import f\n")
    (pkg / "kernels/k.py").write_text("from ..models.toy import T\n")
    edges = tool.edges(pkg)
    assert ("kernels.k", "models.toy", False) in edges
    assert tool.upward(edges) == [("kernels.k", "models.toy", False)]
    assert tool.cycles(edges)                           # kernels -> models -> kernels

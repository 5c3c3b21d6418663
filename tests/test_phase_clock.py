"""benchmarks/phase_clock.py: its marks go in at lines of the kernels' source, found by text.
The script stops on a GPU when an anchor has changed; this checks them on every run of the
suite, so that a kernel edit that moves an anchor fails here rather than in device time."""

import ast
import importlib.util
import os
import sys
import types

import pytest
from scripts import ROOT


@pytest.fixture(scope="module")
def phase_clock():
    # the script imports the benchmarks' harness for its side effect on numba's settings; the
    # harness needs CuPy, which the test install leaves out: a stand-in is enough here
    stand_in = types.ModuleType("harness")
    stand_in.Bench = None
    saved = sys.modules.get("harness")
    sys.modules["harness"] = stand_in
    try:
        spec = importlib.util.spec_from_file_location(
            "phase_clock", os.path.join(ROOT, "benchmarks", "phase_clock.py"))
        module = importlib.util.module_from_spec(spec)   # a script, not a package module
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            del sys.modules["harness"]
        else:
            sys.modules["harness"] = saved


@pytest.mark.parametrize("report", ["resident", "merge", "filtered", "threshold", "finish"])
def test_every_anchor_is_in_its_kernel_once(phase_clock, report):
    module = {"resident": phase_clock.resident_module, "merge": phase_clock.topk_module,
              "filtered": phase_clock.filtered_module,
              "threshold": phase_clock.threshold_module,
              "finish": phase_clock.finish_module}[report]
    source = open(module.__file__).read()
    for anchor, replacement in getattr(phase_clock, f"{report}_edits")():
        assert source.count(anchor) == 1, anchor    # as instrument() applies them: in turn
        source = source.replace(anchor, replacement)
    _check_marks_reach_their_users(ast.parse(source, module.__file__))


def _check_marks_reach_their_users(tree):
    """In the marked copy: a function that reads ``marks`` takes it or makes it, and inside a
    function that has ``marks`` every call of a function of the module passes as many
    arguments as it takes (the kernels the script never launches are never compiled, and may
    keep their unmarked calls)."""
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}

    def own_nodes(function):            # its body, not that of the functions it defines
        todo = list(ast.iter_child_nodes(function))
        while todo:
            node = todo.pop()
            yield node
            if not isinstance(node, ast.FunctionDef):
                todo += ast.iter_child_nodes(node)

    def names(function, context):
        return {n.id for n in own_nodes(function) if isinstance(n, ast.Name)
                and isinstance(n.ctx, context)}

    for function in functions.values():
        has_marks = ("marks" in {a.arg for a in function.args.args}
                     or "marks" in names(function, ast.Store))
        assert has_marks or "marks" not in names(function, ast.Load), function.name
        if not has_marks:
            continue
        for call in own_nodes(function):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
                callee = functions.get(call.func.id)
                if callee is not None and callee is not function:
                    assert len(call.args) == len(callee.args.args), (function.name,
                                                                     callee.name)

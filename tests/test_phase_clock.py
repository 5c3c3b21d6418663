"""benchmarks/phase_clock.py: its marks go in at lines of the kernels' source, found by text.
The script stops on a GPU when an anchor has changed; this checks them on every run of the
suite, so that a kernel edit that moves an anchor fails here rather than in device time."""

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
    compile(source, module.__file__, "exec")        # the marked copy is still Python

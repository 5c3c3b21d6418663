"""Test-session switch between numba's CUDA simulator (default) and a real GPU.

The simulator must be chosen before numba is imported, so this root conftest sets
``NUMBA_ENABLE_CUDASIM`` from ``DDTREE_GPU``:

* ``pytest``                  -> simulator (CPU only; ``gpu``-marked tests are skipped)
* ``DDTREE_GPU=1 pytest``     -> the same suite on the real GPU, plus the ``gpu`` tests

``DDTREE_BACKEND=gpu`` (the package's own switch) selects the GPU here too.
"""

import os

ON_GPU = (os.environ.get("DDTREE_GPU", "0") == "1"
          or os.environ.get("DDTREE_BACKEND", "").strip().lower() == "gpu")
os.environ["NUMBA_ENABLE_CUDASIM"] = "0" if ON_GPU else "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One BLAS thread per worker process (and the subprocesses it starts), set before numpy
    # is imported: ``-n`` workers already use every core, and numpy's default of a thread per
    # core in every worker would oversubscribe them (the float64 reference models are
    # numpy matrix products). An explicit setting wins.
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")

import pytest  # noqa: E402

from ddtree_numba._platform import collect_less_often  # noqa: E402

# On the GPU most of the suite's time is numba compiling kernels; the collector's passes over
# the heap while it inlines helpers are a quarter of that (``collect_less_often``).
collect_less_often()


def pytest_report_header(config):
    return f"ddtree_numba: {'real GPU (DDTREE_GPU=1)' if ON_GPU else 'CUDA simulator'}"


# On the GPU most of the suite's time is numba compiling kernels, and some tests take one to
# four minutes while every worker compiles. pytest-xdist's default hands a quarter of the tests
# out up front in per-worker queues: two long tests queued on one worker ran one after the
# other while others sat idle, and one starting last ran alone for a minute. On the GPU a
# worker is handed one test at a time instead (``--maxschedchunk 1``: each keeps one test
# queued behind the one it runs), so idle workers take the next test. Replaying the measured
# durations of a 16-worker run on the H200: about 560 s before, 430 s this way.
def pytest_configure(config):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if ON_GPU and not config.option.maxschedchunk:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real GPU: run with DDTREE_GPU=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

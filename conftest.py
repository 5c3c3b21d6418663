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

from ddtree_numba._platform import collect_less_often, kernel_cache_requested  # noqa: E402

if ON_GPU and kernel_cache_requested(default=True):
    # Compile each kernel once for the whole run, not once in every worker: numba's on-disk
    # kernel cache (``DDTREE_KERNEL_CACHE``, ``ddtree_numba.kernels._device``) in a directory of
    # this run's own, so that nothing from an earlier version of the code can load
    # (``DDTREE_KERNEL_CACHE=0`` turns it off). Made here, before numba is imported, by the
    # process that starts the ``-n`` workers; they, and the programs the tests start (examples,
    # the CLI), inherit it through the environment. A run killed by a signal leaves the
    # directory behind (``ddtree-kernels-*`` in the temporary directory).
    if "DDTREE_TEST_KERNEL_CACHE" not in os.environ:         # the run's first process
        import atexit
        import shutil
        import tempfile

        os.environ["DDTREE_TEST_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="ddtree-kernels-")
        atexit.register(shutil.rmtree, os.environ["DDTREE_TEST_KERNEL_CACHE"],
                        ignore_errors=True)
    os.environ.update(DDTREE_KERNEL_CACHE="1",
                      NUMBA_CACHE_DIR=os.environ["DDTREE_TEST_KERNEL_CACHE"])

import pytest  # noqa: E402

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


#: Tests measured to take 10 s or more on the GPU (``seconds<TAB>test id``), written by
#: ``benchmarks/suite_timeline.py --long 10`` from whole runs.
GPU_TEST_SECONDS = os.path.join(os.path.dirname(__file__), "tests", "gpu_test_seconds.tsv")


def gpu_test_seconds() -> dict:
    """``{test id: seconds}`` from :data:`GPU_TEST_SECONDS`, in its order (empty if missing)."""
    try:
        with open(GPU_TEST_SECONDS) as f:
            rows = [line.rstrip("\n").split("\t") for line in f
                    if line.strip() and not line.startswith("#")]
    except FileNotFoundError:
        return {}
    return {test: float(seconds) for seconds, test in rows}


def _longest_first(items) -> None:
    """On the GPU, start the tests measured longest first (longest-processing-time order: a
    four-minute test dealt out last would run alone at the end), each followed by one of the
    others. pytest-xdist keeps a second test queued behind the one a worker runs (it hands each
    worker two at the start, then one more each time one ends): in plain longest-first order
    the two longest tests went to one worker, one after the other, and each later long test
    waited behind another. With a short test after each long one, the test queued behind a
    long one is short, and the next long test goes to the first worker to finish one.
    Replaying a 2026-12-06 H100 run's durations through xdist's dealing, with a list made
    from an earlier run: 700 s in plain longest-first order, 590 s this way (502 s with
    the run's own durations as the list; their mean over 16 workers was 499 s).
    Every worker sorts the same collection the same way, as xdist requires."""
    seconds = gpu_test_seconds()
    long = sorted((item for item in items if item.nodeid in seconds),
                  key=lambda item: -seconds[item.nodeid])
    short = [item for item in items if item.nodeid not in seconds]
    order = []
    for i, item in enumerate(long):
        order += [item, *short[i:i + 1]]
    items[:] = order + short[len(long):]


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        _longest_first(items)
        return
    skip = pytest.mark.skip(reason="needs a real GPU: run with DDTREE_GPU=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

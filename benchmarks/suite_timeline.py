"""A pytest plugin that writes where the GPU test suite's time goes, one line a test, as the tests
finish (so that a run cut off by a time limit still leaves its lines).

``run_gpu.sh tests*`` loads it (``-p suite_timeline``, with ``benchmarks/`` on the path) and sets
``SUITE_TIMELINE`` to the file to write. Each worker times numba's kernel compilations in every
test: ``CUDADispatcher.compile`` is the one call through which a kernel's machine code is made
or loaded, so the time inside it, and whether the dispatcher's cache-miss count rose, say how
much of a test was compiling and how much was loading from the on-disk cache (or waiting for
another worker to store the kernel, then loading it). The process that
started the workers gets every test's report and writes the line:

    seconds_since_start  worker  outcome  seconds  compiles  compile_s  loads  load_s  test_id
    slowest_compiles

(the last column: the test's three longest compilations, ``kernel=seconds`` joined by ``,``).

``python suite_timeline.py FILE`` sums such a file up: per test file, the tests, their seconds,
and how many of those seconds were compiling; then the kernels that took longest to compile.
``python suite_timeline.py FILE [FILE ...] --long S`` prints ``seconds<TAB>test_id`` for the
tests that took at least S seconds, longest first, a test's time from the last file that has
it (a run cut off by a limit leaves some tests out): ``tests/gpu_test_seconds.tsv``, from which
conftest.py starts the longest tests first on the GPU.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import pytest

_start = time.monotonic()
_counts = {"compiles": 0, "compile_s": 0.0, "loads": 0, "load_s": 0.0}
_slowest: list = []     # (seconds, kernel) of this test's compilations


def _misses(dispatcher) -> int:
    return sum(dispatcher.stats.cache_misses.values())


def _time_compilations() -> None:
    """Wrap ``CUDADispatcher.compile`` (a worker's kernels are made or loaded inside it)."""
    from numba.cuda.dispatcher import CUDADispatcher

    original = CUDADispatcher.compile
    depth = [0]

    def timed_compile(self, sig):
        if depth[0] or sig in getattr(self, "overloads", {}):
            return original(self, sig)            # nested, or already made: not counted
        depth[0] += 1
        misses, t0 = _misses(self), time.perf_counter()
        try:
            return original(self, sig)
        finally:
            seconds = time.perf_counter() - t0
            depth[0] -= 1
            kind = "compile" if _misses(self) > misses else "load"
            _counts[kind + "s"] += 1
            _counts[kind + "_s"] += seconds
            if kind == "compile":
                _slowest.append((seconds, self.py_func.__qualname__))

    CUDADispatcher.compile = timed_compile


_spent: dict = {}      # (the starting process) test id -> [seconds so far, worst outcome]


def pytest_collection_finish(session):
    # After the test modules imported the package, which wraps ``compile`` itself (with the
    # kernel cache on, a process waits there for another that compiles the same kernel): the
    # time timed here includes such waits, and a load after one shows as a long load.
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "1") == "0":      # the GPU: kernels compile
        _time_compilations()


def pytest_runtest_logstart(nodeid, location):
    for key in _counts:
        _counts[key] = 0 if key in ("compiles", "loads") else 0.0
    _slowest.clear()


@pytest.hookimpl(tryfirst=True)     # before pytest's own, which makes the report from the item
def pytest_runtest_makereport(item, call):
    if call.when == "teardown":
        slowest = ",".join(f"{name}={seconds:.0f}" for seconds, name in sorted(_slowest)[::-1][:3])
        item.user_properties.append(("kernel_times", {**_counts, "slowest": slowest}))


def pytest_runtest_logreport(report):
    path = os.environ.get("SUITE_TIMELINE")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    spent = _spent.setdefault(report.nodeid, [0.0, "passed"])
    spent[0] += report.duration                 # setup + call + teardown
    if report.outcome != "passed":
        spent[1] = report.outcome
    if report.when != "teardown":
        return
    seconds, outcome = _spent.pop(report.nodeid)
    times = dict(report.user_properties).get("kernel_times", {})
    worker = getattr(report, "worker_id", None) or "-"
    with open(path, "a") as f:
        f.write(f"{time.monotonic() - _start:.1f}\t{worker}\t{outcome}\t{seconds:.2f}\t"
                f"{times.get('compiles', 0)}\t{times.get('compile_s', 0.0):.2f}\t"
                f"{times.get('loads', 0)}\t{times.get('load_s', 0.0):.2f}\t{report.nodeid}\t"
                f"{times.get('slowest', '')}\n")


def _lines(path: str):
    for line in open(path):
        fields = line.rstrip("\n").split("\t")
        yield fields + [""] * (10 - len(fields))    # files written before the last column


def summarise(path: str) -> None:
    """Per test file: tests, wall seconds of their workers, compile seconds, load seconds; then
    the longest compilations."""
    by_file = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
    kernels = collections.defaultdict(list)
    last = 0.0
    for since, _, _, seconds, compiles, compile_s, _, load_s, test, slowest in _lines(path):
        for entry in filter(None, slowest.split(",")):
            name, _, kernel_seconds = entry.rpartition("=")
            kernels[name].append(float(kernel_seconds))
        row = by_file[test.split("::")[0]]
        row[0] += 1
        row[1] += float(seconds)
        row[2] += float(compile_s)
        row[3] += float(load_s)
        row[4] += int(compiles)
        last = max(last, float(since))
    print(f"{'file':44s} {'tests':>6s} {'test_s':>8s} {'compile_s':>9s} {'compiles':>8s} "
          f"{'load_s':>7s}")
    for name, (n, s, c, ld, k) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:44s} {n:6d} {s:8.1f} {c:9.1f} {k:8d} {ld:7.1f}")
    total = [sum(r[i] for r in by_file.values()) for i in range(5)]
    print(f"{'all':44s} {total[0]:6d} {total[1]:8.1f} {total[2]:9.1f} {total[4]:8d} "
          f"{total[3]:7.1f}   last line at {last:.0f} s")
    if kernels:
        print("\nlongest compilations (kernel: times compiled among the tests' three longest, "
              "seconds each)")
        for name, times in sorted(kernels.items(), key=lambda kv: -max(kv[1]))[:20]:
            print(f"  {name}: {len(times)}x, " + " ".join(f"{t:.0f}" for t in sorted(times)))


def long_tests(paths: list, at_least: float) -> None:
    """``seconds<TAB>test_id`` for the tests of at least ``at_least`` seconds, longest first; a
    test in several files gets its time from the last."""
    seconds = {f[8]: float(f[3]) for path in paths for f in _lines(path)}
    rows = [(s, test) for test, s in seconds.items() if s >= at_least]
    for s, test in sorted(rows, key=lambda r: (-r[0], r[1])):
        print(f"{s:.0f}\t{test}")


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[-2] == "--long":
        long_tests(sys.argv[1:-2], float(sys.argv[-1]))
    else:
        summarise(sys.argv[1])

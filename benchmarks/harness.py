"""Shared benchmark harness: device events, warm-up, L2 flush, median, CSV with GPU and date.

Small kernels launched from Python spend more time in the launch (15-80 us per numba launch)
than on the GPU, so device time is measured on a **CUDA graph** of the launches: the work is
captured once with CuPy stream capture (numba launches go to the capturing stream through
``kernels.use_stream``) and each replay is bracketed by two CUDA events. Between replays a
256 MiB buffer is rewritten so the inputs do not sit in the 50-60 MB L2 (each replay starts
cold, as it would inside a real step). The host cost of an eager call is measured separately
with ``time.perf_counter``.

Reported per configuration: the median of ``reps`` replays (and the min and max), plus a
derived metric where one exists (GB/s against the measured copy bandwidth, TFLOP/s).
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable

# A CuPy/torch array handed to a numba launch is synchronised on the stream in its CUDA Array
# Interface; inside a stream capture that synchronisation is illegal. The benchmarks order
# their own work on one stream, so turn it off (before numba is imported).
os.environ.setdefault("NUMBA_CUDA_ARRAY_INTERFACE_SYNC", "0")

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_numba import kernels as K  # noqa: E402

# A benchmark compiles many kernels first: see collect_less_often. A baseline checkout older
# than it (``run_gpu.sh ab``'s AB_BASE) compiles with the collector's default instead, which
# changes its compile time only.
try:
    from ddtree_numba._platform import collect_less_often
except ImportError:
    pass
else:
    collect_less_often()

FLUSH_BYTES = 256 << 20


class Bench:
    """Times device work on one CuPy stream; collects rows for a CSV file."""

    def __init__(self, name: str, out_dir: str | None = None):
        self.name = name
        self.out_dir = out_dir or os.environ.get("OUT", "benchmarks/results")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.flush_buffer = cp.empty(FLUSH_BYTES // 4, cp.float32)
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        self.date = datetime.date.today().isoformat()
        self.rows: list[dict] = []

    def flush_l2(self):
        with self.stream:
            self.flush_buffer.fill(1.0)

    def capture(self, launch: Callable[[], None]):
        """Warm up ``launch`` (compilation, module load), then capture it into a graph."""
        with self.stream, K.use_stream(self.stream):
            launch()
        self.stream.synchronize()
        with self.stream:
            self.stream.begin_capture()
            with K.use_stream(self.stream):
                launch()
            return self.stream.end_capture()

    def time_graph(self, graph, reps: int = 50, flush: bool = True) -> dict:
        """Median / min / max milliseconds of single graph replays, each between events."""
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(3):
            graph.launch(self.stream)
        for _ in range(reps):
            if flush:
                self.flush_l2()
            start.record(self.stream)
            graph.launch(self.stream)
            end.record(self.stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}

    def time_device(self, launch: Callable[[], None], reps: int = 50, flush: bool = True):
        """Graph-replay device time of ``launch`` (see :meth:`time_graph`)."""
        return self.time_graph(self.capture(launch), reps, flush)

    def time_eager_events(self, launch: Callable[[], None], reps: int = 20) -> dict:
        """Events around an eager call on the stream (for libraries that cannot be captured)."""
        start, end = cp.cuda.Event(), cp.cuda.Event()
        with self.stream:
            launch()
        times = []
        for _ in range(reps):
            self.flush_l2()
            with self.stream:
                start.record(self.stream)
                launch()
                end.record(self.stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end))
        return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}

    def time_host(self, call: Callable[[], None], reps: int = 20, sync=True) -> dict:
        """Wall-clock milliseconds of ``call`` (CPU baselines, host overhead), median."""
        call()
        times = []
        for _ in range(reps):
            if sync:
                cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            call()
            if sync:
                cp.cuda.Device().synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}

    def add(self, **row):
        """Keep a row for the CSV and print it at once, one JSON line: a run cut short by a
        time limit (a device command's, say) still leaves the rows it measured."""
        row = {"bench": self.name, "gpu": self.gpu, "date": self.date, **row}
        self.rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        return row

    def write_csv(self) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"{self.name}.csv")
        keys: list[str] = []
        for row in self.rows:
            keys += [k for k in row if k not in keys]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)
        return path


def copy_bandwidth_gbs(bench: Bench, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (GB/s)."""
    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(10):
        with bench.stream:
            start.record(bench.stream)
            b[...] = a
            end.record(bench.stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    del a, b
    return 2 * nbytes / (statistics.median(times[2:]) * 1e-3) / 1e9


def print_table(rows: list[dict], columns: list[str], title: str):
    print(f"\n{title}")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v) -> str:
    if isinstance(v, float | np.floating):
        return f"{v:.4g}"
    return "" if v is None else str(v)

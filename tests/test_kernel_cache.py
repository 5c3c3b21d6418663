"""The on-disk kernel cache (``DDTREE_KERNEL_CACHE=1``, ``kernels/_device.py``): every kernel
takes the switch, it stays off on the simulator, concurrent saves keep every entry, and on the
GPU a kernel compiled in one process loads in the next."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import time

import pytest
from scripts import ROOT, clean_env, run

PACKAGE = pathlib.Path(ROOT) / "ddtree_numba"
#: Kernels that link CUDA C++, which numba cannot store: compiled in every process.
UNCACHED = {"kernels/verify_attn/mma.py"}


def _jit_calls(tree):
    """``cuda.jit(...)`` calls and bare ``@cuda.jit`` decorators in a module's syntax tree."""
    for node in ast.walk(tree):
        decorators = getattr(node, "decorator_list", [])
        for d in decorators:
            if isinstance(d, ast.Attribute) and d.attr == "jit":
                yield d, []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "jit" and getattr(node.func.value, "id", "") == "cuda":
            yield node, node.keywords


def test_every_kernel_takes_the_cache_switch():
    """A kernel (``cuda.jit`` without ``device=True``) passes ``cache=CACHE_KERNELS`` or comes
    from ``kernel_for_block``, which does; a bare ``@cuda.jit`` kernel would compile in every
    process again."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in UNCACHED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node, keywords in _jit_calls(tree):
            names = {k.arg: k.value for k in keywords}
            device = names.get("device")
            if isinstance(device, ast.Constant) and device.value is True:
                continue
            if relative == "kernels/_device.py" and "cache" not in names:
                continue            # kernel_for_block's simulator branch: no cache there
            cache = names.get("cache")
            if not (isinstance(cache, ast.Name) and cache.id == "CACHE_KERNELS"):
                missing.append(f"{relative}:{node.lineno}")
    assert not missing, f"kernels without cache=CACHE_KERNELS: {missing}"


def test_the_switch_is_off_on_the_simulator():
    code = "from ddtree_numba.kernels._device import CACHE_KERNELS; print(CACHE_KERNELS)"
    done = run(["-c", code], NUMBA_ENABLE_CUDASIM="1", DDTREE_KERNEL_CACHE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# One process of the concurrent-save test: it waits until the test says go, then saves its own
# entry into the shared index. The index write is slowed down so that, without the lock, every
# process would read the empty index, pick data file 1, and all but one entry would be lost.
SAVER = """
import os, sys, time
from numba.cuda.core.caching import IndexDataCacheFile
from ddtree_numba.kernels._device import _serialise_cache_saves
folder, me = sys.argv[1], int(sys.argv[2])
if sys.argv[3] == "locked":
    _serialise_cache_saves()
slow_write = IndexDataCacheFile._save_index
def _save_index(self, overloads):
    time.sleep(0.3)
    slow_write(self, overloads)
IndexDataCacheFile._save_index = _save_index
cache = IndexDataCacheFile(folder, "kernel", ("stamp", 1))
open(os.path.join(folder, f"ready-{me}"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.01)
cache.save(("signature", me), f"code of {me}")
"""


def _save_concurrently(folder, processes: int, mode: str) -> list:
    env = clean_env(NUMBA_ENABLE_CUDASIM="1")
    children = [subprocess.Popen([sys.executable, "-c", SAVER, str(folder), str(i), mode],
                                 env=env, stderr=subprocess.PIPE, text=True)
                for i in range(processes)]
    deadline = time.monotonic() + 120
    while sum(os.path.exists(folder / f"ready-{i}") for i in range(processes)) < processes:
        assert time.monotonic() < deadline, "the saving processes did not start"
        assert all(c.poll() is None for c in children), [c.stderr.read() for c in children]
        time.sleep(0.05)
    (folder / "go").touch()
    for child in children:
        assert child.wait(timeout=120) == 0, child.stderr.read()
    from numba.cuda.core.caching import IndexDataCacheFile

    cache = IndexDataCacheFile(str(folder), "kernel", ("stamp", 1))
    return [cache.load(("signature", i)) for i in range(processes)]


def test_concurrent_saves_keep_every_entry(tmp_path):
    loaded = _save_concurrently(tmp_path, 4, "locked")
    assert loaded == [f"code of {i}" for i in range(4)]


# One process of the compile-lock test: it waits until the test says go, then holds the lock
# of its cache entry for a second (as if compiling), and writes when it held it.
HOLDER = """
import os, sys, time
from ddtree_numba.kernels._device import _compiling
folder, me, entry = sys.argv[1], sys.argv[2], sys.argv[3]
open(os.path.join(folder, f"ready-{me}"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.01)
with _compiling(folder, entry):
    start = time.time()
    time.sleep(1.0)
    end = time.time()
print(start, end)
"""


def test_one_process_compiles_an_entry_while_the_others_wait(tmp_path):
    """Two processes after the same cache entry hold its lock one after the other; a third,
    after another entry, does not wait for them."""
    env = clean_env(NUMBA_ENABLE_CUDASIM="1")
    entries = {"a": "kernel x (float32[:],)", "b": "kernel x (float32[:],)",
               "c": "kernel x (int32[:],)"}
    children = {me: subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), me, entry],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
                for me, entry in entries.items()}
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{me}").exists() for me in entries):
        assert time.monotonic() < deadline, "the processes did not start"
        assert all(c.poll() is None for c in children.values()), \
            [c.stderr.read() for c in children.values()]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    held = {}
    for me, child in children.items():
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        held[me] = tuple(map(float, out.split()))
    (a_start, a_end), (b_start, b_end) = sorted([held["a"], held["b"]])
    assert b_start >= a_end, "two processes held one entry's lock at once"
    c_start, c_end = held["c"]
    assert any(start < c_end and c_start < end for start, end in (held["a"], held["b"])), \
        "another entry waited for this one"


@pytest.mark.gpu
def test_processes_started_together_compile_each_kernel_once(tmp_path):
    """Two processes launch the same kernels at the same moment with an empty cache: each
    kernel is compiled by one of them and loaded by the other (without the compile lock both
    would compile every kernel)."""
    script = tmp_path / "launch.py"
    script.write_text(f"""
import gc, os, sys, time
import numpy as np
from numba.cuda.dispatcher import CUDADispatcher
import ddtree_numba.kernels as K
logits = np.random.default_rng(0).standard_normal((2, 3, 4096)).astype(np.float32)
open(sys.argv[1], "w").close()          # imported: now wait for the other process
while not os.path.exists({str(tmp_path / "go")!r}):
    time.sleep(0.01)
K.draft_topk(logits, 8)
kernels = [d for d in gc.get_objects() if isinstance(d, CUDADispatcher)]
print(sum(sum(d.stats.cache_hits.values()) for d in kernels),
      sum(sum(d.stats.cache_misses.values()) for d in kernels))
""")
    env = clean_env(DDTREE_KERNEL_CACHE="1", NUMBA_CACHE_DIR=str(tmp_path / "cache"),
                    PYTHONHASHSEED="0", NUMBA_ENABLE_CUDASIM="0")
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    children = [subprocess.Popen([sys.executable, str(script), str(r)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for r in ready]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, "the processes did not start"
        assert all(c.poll() is None for c in children), [c.stderr.read() for c in children]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    counts = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err
        counts.append(tuple(map(int, out.split())))
    hits = sum(h for h, _ in counts)
    misses = sum(m for _, m in counts)
    assert misses > 0 and hits == misses, counts


@pytest.mark.gpu
def test_a_kernel_compiled_in_one_process_loads_in_the_next(tmp_path):
    """The same draft_topk calls (the split-row and the whole-row kernels) in two fresh
    processes sharing one cache directory: the first compiles and stores, the second loads
    every kernel it launches (no miss) and gets the same results."""
    code = """
import gc
import numpy as np
from numba.cuda.dispatcher import CUDADispatcher
import ddtree_numba.kernels as K
rng = np.random.default_rng(0)
for bs in (1, 8):             # one row split across blocks, and whole rows a block
    logits = rng.standard_normal((bs, 3, 4096)).astype(np.float32)
    log_probs, ids = K.draft_topk(logits, 8)
    print(ids.copy_to_host().tobytes().hex(), end=" ")
kernels = [d for d in gc.get_objects() if isinstance(d, CUDADispatcher)]
print(sum(sum(d.stats.cache_hits.values()) for d in kernels),
      sum(sum(d.stats.cache_misses.values()) for d in kernels))
"""
    env = dict(DDTREE_KERNEL_CACHE="1", NUMBA_CACHE_DIR=str(tmp_path), PYTHONHASHSEED="0",
               NUMBA_ENABLE_CUDASIM="0")
    first = run(["-c", code], timeout=600, **env)
    assert first.returncode == 0, first.stderr
    second = run(["-c", code], timeout=600, **env)
    assert second.returncode == 0, second.stderr
    *ids1, hits1, misses1 = first.stdout.split()
    *ids2, hits2, misses2 = second.stdout.split()
    assert int(misses1) > 0 and int(hits1) == 0
    assert int(hits2) == int(misses1) and int(misses2) == 0
    assert ids2 == ids1
    assert list(tmp_path.rglob("*.nbc")), "nothing was stored"

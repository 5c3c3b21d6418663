"""The on-disk kernel cache (``DDTREE_KERNEL_CACHE=1``, ``kernels/_device.py``): every kernel
takes the switch, it stays off on the simulator, concurrent saves keep every entry, and on the
GPU a kernel compiled in one process loads in the next."""

from __future__ import annotations

import ast
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
            # kernel_for_block's ``cache`` defaults to CACHE_KERNELS
            allowed = ("CACHE_KERNELS", "cache") if relative == "kernels/_device.py" else (
                "CACHE_KERNELS",)
            if not (isinstance(cache, ast.Name) and cache.id in allowed):
                missing.append(f"{relative}:{node.lineno}")
    assert not missing, f"kernels without cache=CACHE_KERNELS: {missing}"


def test_the_switch_is_off_on_the_simulator():
    code = "from ddtree_numba.kernels._device import CACHE_KERNELS; print(CACHE_KERNELS)"
    done = run(["-c", code], NUMBA_ENABLE_CUDASIM="1", DDTREE_KERNEL_CACHE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# The start of every script run by run_together: ``folder, me = sys.argv[1], sys.argv[2]``,
# and ``wait_for_go()``, which says this process is ready and waits until the test says go.
PRELUDE = """
import os, sys, time
folder, me = sys.argv[1], sys.argv[2]
def wait_for_go():
    open(os.path.join(folder, f"ready-{me}"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.01)
"""


def run_together(scripts, folder, env, timeout=120) -> list:
    """Run ``PRELUDE + script`` in one fresh process each (``sys.argv``: the folder, the
    script's index), say go once every one is ready, so that they all start the part under
    test at the same moment; return their standard outputs (each must exit 0)."""
    children = [subprocess.Popen([sys.executable, "-c", PRELUDE + script, str(folder), str(i)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
                for i, script in enumerate(scripts)]
    deadline = time.monotonic() + timeout
    while not all((folder / f"ready-{i}").exists() for i in range(len(children))):
        assert time.monotonic() < deadline, "the processes did not start"
        assert all(c.poll() is None for c in children), [c.stderr.read() for c in children]
        time.sleep(0.05)
    (folder / "go").touch()
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=timeout)
        assert child.returncode == 0, err
        outputs.append(out)
    return outputs


# A process of the concurrent-save test saves its own entry into the shared index. The index
# write is slowed down so that, without the lock, every process would read the empty index,
# pick data file 1, and all but one entry would be lost.
SAVER = """
from numba.cuda.core.caching import IndexDataCacheFile
from ddtree_numba.kernels._device import _serialise_cache_saves
_serialise_cache_saves()
slow_write = IndexDataCacheFile._save_index
def _save_index(self, overloads):
    time.sleep(0.3)
    slow_write(self, overloads)
IndexDataCacheFile._save_index = _save_index
cache = IndexDataCacheFile(folder, "kernel", ("stamp", 1))
wait_for_go()
cache.save(("signature", me), f"code of {me}")
"""


def test_concurrent_saves_keep_every_entry(tmp_path):
    from numba.cuda.core.caching import IndexDataCacheFile

    run_together([SAVER] * 4, tmp_path, clean_env(NUMBA_ENABLE_CUDASIM="1"))
    cache = IndexDataCacheFile(str(tmp_path), "kernel", ("stamp", 1))
    assert [cache.load(("signature", str(i))) for i in range(4)] == \
        [f"code of {i}" for i in range(4)]


# A process of the compile-lock test holds the lock of its cache entry (its argument) for a
# second, as if compiling, and prints when it held it.
HOLDER = """
from ddtree_numba.kernels._device import _compiling
wait_for_go()
with _compiling(folder, {entry!r}):
    start = time.time()
    time.sleep(1.0)
    end = time.time()
print(start, end)
"""


def test_one_process_compiles_an_entry_while_the_others_wait(tmp_path):
    """Two processes after the same cache entry hold its lock one after the other; a third,
    after another entry, does not wait for them."""
    entries = ["kernel x (float32[:],)", "kernel x (float32[:],)", "kernel x (int32[:],)"]
    outputs = run_together([HOLDER.format(entry=e) for e in entries], tmp_path,
                           clean_env(NUMBA_ENABLE_CUDASIM="1"))
    a, b, c = (tuple(map(float, out.split())) for out in outputs)
    (a_start, a_end), (b_start, b_end) = sorted([a, b])
    assert b_start >= a_end, "two processes held one entry's lock at once"
    assert any(start < c[1] and c[0] < end for start, end in (a, b)), \
        "another entry waited for this one"


# A process of the GPU tests below: draft_topk at one row split across blocks and at whole
# rows a block, then the cache hits and misses of every kernel it launched, and the ids.
LAUNCHER = """
import gc
import numpy as np
from numba.cuda.dispatcher import CUDADispatcher
import ddtree_numba.kernels as K
rng = np.random.default_rng(0)
inputs = [rng.standard_normal((bs, 3, 4096)).astype(np.float32) for bs in (1, 8)]
wait_for_go()
ids = [K.draft_topk(logits, 8)[1].copy_to_host().tobytes().hex() for logits in inputs]
kernels = [d for d in gc.get_objects() if isinstance(d, CUDADispatcher)]
print(sum(sum(d.stats.cache_hits.values()) for d in kernels),
      sum(sum(d.stats.cache_misses.values()) for d in kernels), *ids)
"""


def _launch(tmp_path, processes: int) -> list:
    env = clean_env(DDTREE_KERNEL_CACHE="1", NUMBA_CACHE_DIR=str(tmp_path / "cache"),
                    PYTHONHASHSEED="0", NUMBA_ENABLE_CUDASIM="0")
    outputs = run_together([LAUNCHER] * processes, tmp_path, env, timeout=600)
    (tmp_path / "go").unlink()
    for i in range(processes):
        (tmp_path / f"ready-{i}").unlink()
    return [(int(hits), int(misses), ids) for hits, misses, *ids in map(str.split, outputs)]


@pytest.mark.gpu
def test_processes_started_together_compile_each_kernel_once(tmp_path):
    """Two processes launch the same kernels at the same moment with an empty cache: each
    kernel is compiled by one of them and loaded by the other (without the compile lock both
    would compile every kernel); the ids are the same."""
    (hits_a, misses_a, ids_a), (hits_b, misses_b, ids_b) = _launch(tmp_path, 2)
    assert misses_a + misses_b > 0 and hits_a + hits_b == misses_a + misses_b
    assert ids_a == ids_b


@pytest.mark.gpu
def test_a_kernel_compiled_in_one_process_loads_in_the_next(tmp_path):
    """The same draft_topk calls in two fresh processes, one after the other, sharing one
    cache directory: the first compiles and stores, the second loads every kernel it launches
    (no miss) and gets the same ids."""
    [(hits1, misses1, ids1)] = _launch(tmp_path, 1)
    [(hits2, misses2, ids2)] = _launch(tmp_path, 1)
    assert misses1 > 0 and hits1 == 0
    assert hits2 == misses1 and misses2 == 0
    assert ids2 == ids1
    assert list((tmp_path / "cache").rglob("*.nbc")), "nothing was stored"

"""The on-disk kernel cache (``DDTREE_KERNEL_CACHE=1``, ``kernels/_device.py``): every kernel
takes the switch, it stays off on the simulator, every cached kernel has one key in every
process, concurrent saves keep every entry, one process compiles an entry while the others
wait, and on the GPU a kernel compiled in one process loads in the others."""

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


# Every cached kernel the build report lists, with its signature: numba's cache key for it
# (the key's target part left out: it needs a GPU), hashed, one line each.
KEYS = """
import hashlib, types
from ddtree_numba.build_report import kernel_specs
no_target = types.SimpleNamespace(magic_tuple=lambda: ())
for spec in kernel_specs():
    cache = getattr(spec.kernel, "_cache", None)
    if type(cache).__name__ == "NullCache":
        continue                                    # the tensor-core kernels: not cached
    key = repr(cache._index_key(spec.signature, no_target))
    print(spec.stage, spec.variant, hashlib.sha256(key.encode()).hexdigest())
"""


def test_every_cached_kernel_has_one_key_in_every_process():
    """Two processes (on numba's real CUDA target, which needs no GPU to make the keys; with
    different hash seeds) compute the same cache key for every cached kernel. A key pickles the
    kernel's closure: an ``@intrinsic`` or a ``float32x4`` class a device function in it uses
    pickles with an identity drawn in the process, and made draft_topk's resident and one-pass
    kernels and the tiled verify_attn kernels compile in every process that launched them."""
    keys = []
    # the second process imports more first, as a pytest worker or an example would: what is
    # in sys.modules changes how cloudpickle writes some objects
    more = "import pytest, ddtree_numba.step, ddtree_numba.models.deepseek_v3\n"
    for seed, first in (("0", ""), ("1", more)):
        done = run(["-c", first + KEYS], timeout=600, NUMBA_ENABLE_CUDASIM="0",
                   DDTREE_KERNEL_CACHE="1", PYTHONHASHSEED=seed)
        assert done.returncode == 0, done.stderr[-3000:]
        keys.append(dict(line.rsplit(" ", 1) for line in done.stdout.splitlines()))
    assert len(keys[0]) > 40, keys[0]                # (56 on 2026-12-06)
    assert keys[0] == keys[1], sorted(k for k in keys[0] if keys[0][k] != keys[1].get(k))


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


# A process of the GPU tests below: commit_kv on a one-page cache of float32 and of float16
# (two entries of one kernel, among the cheapest of the library to compile), then the cache
# hits and misses of every kernel it launched, and the cache and lengths each call left
# (each checked against the reference there).
LAUNCHER = """
import gc
import numpy as np
from numba.cuda.dispatcher import CUDADispatcher
import ddtree_numba.kernels as K
from ddtree_numba import reference
table, prefix = np.zeros((1, 1), np.int32), np.array([2], np.int32)
nodes, accepted = np.array([[0, 3, 5, -1, -1, -1, -1, -1]], np.int32), np.array([2], np.int32)
caches = [np.arange(16 * 8, dtype=dtype).reshape(1, 16, 8) for dtype in (np.float32, np.float16)]
wait_for_go()
results = []
for cache in caches:
    want = cache.copy()
    want_lengths = reference.commit_kv(want, table, prefix, nodes, accepted)
    lengths = K.commit_kv(cache, table, prefix, nodes, accepted).copy_to_host()
    assert cache.tobytes() == want.tobytes() and lengths.tobytes() == want_lengths.tobytes()
    results.append((cache.tobytes() + lengths.tobytes()).hex())
kernels = [d for d in gc.get_objects() if isinstance(d, CUDADispatcher)]
print(sum(sum(d.stats.cache_hits.values()) for d in kernels),
      sum(sum(d.stats.cache_misses.values()) for d in kernels), *results)
"""


def _launch(tmp_path, processes: int) -> list:
    env = clean_env(DDTREE_KERNEL_CACHE="1", NUMBA_CACHE_DIR=str(tmp_path / "cache"),
                    NUMBA_ENABLE_CUDASIM="0")
    outputs = run_together([LAUNCHER] * processes, tmp_path, env, timeout=600)
    (tmp_path / "go").unlink()
    for i in range(processes):
        (tmp_path / f"ready-{i}").unlink()
    return [(int(hits), int(misses), results) for hits, misses, *results in map(str.split, outputs)]


@pytest.mark.gpu
def test_processes_started_together_compile_each_kernel_once(tmp_path):
    """Two processes launch the same kernels at the same moment with an empty cache: each
    kernel is compiled by one of them and loaded by the other (without the compile lock both
    would compile every kernel); both get the reference's bits."""
    (hits_a, misses_a, results_a), (hits_b, misses_b, results_b) = _launch(tmp_path, 2)
    counts = f"hits {hits_a} and {hits_b}, misses {misses_a} and {misses_b}"
    assert misses_a + misses_b == 2 and hits_a + hits_b == 2, counts
    assert results_a == results_b


@pytest.mark.gpu
def test_a_kernel_compiled_in_one_process_loads_in_the_next(tmp_path):
    """The same commit_kv calls in two fresh processes, one after the other, sharing one
    cache directory: the first compiles and stores, the second loads every kernel it launches
    (no miss); both get the reference's bits."""
    [(hits1, misses1, results1)] = _launch(tmp_path, 1)
    [(hits2, misses2, results2)] = _launch(tmp_path, 1)
    counts = f"hits {hits1} then {hits2}, misses {misses1} then {misses2}"
    assert (hits1, misses1) == (0, 2) and (hits2, misses2) == (2, 0), counts
    assert results2 == results1
    assert list((tmp_path / "cache").rglob("*.nbc")), "nothing was stored"

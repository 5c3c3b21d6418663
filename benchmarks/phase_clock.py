"""Where one block's time goes: clock marks at a kernel's barriers (GPU only).

Nsight Compute says which instructions stall; this says how long each *phase* of a block takes.
The kernel's source is copied with a mark after chosen lines, and the copy is compiled in place
of the original. A mark is ``if tid == 0: marks[slot] = clock()``. ``clock`` is a CUDA C++
device function returning the SM's ``clock64()``, linked with ``cuda.declare_device``. A mark
placed right after a barrier reads when the block left it. So the difference of two such marks
is the time of the phase between them, as long as its slowest warp took. Marks of the
threshold select also record which phase ended (a code: ``100 + d`` is level ``d``'s count and
so on); the list is printed in order.

Four kernels:

* ``draft_topk``'s resident part kernel, V 163 840, K 256 and 16, float32. The median over the
  120 blocks of each phase, the number of candidates sorted, and the last block's merge, with
  marks inside it (``draft_topk.merge_parts``: its loads, the log-sum-exp, each round).
* ``draft_topk``'s one-pass kernel (``variant="filtered"``, whole rows a block), bs 64, L 15,
  V 163 840, float32 K 256 and 16, bfloat16 K 256: the launch's span and its waves of blocks
  (``%globaltimer``), each phase of a block (the loop, the block's log-sum-exp, the radix
  select, the gather, the sort, the write; blocks that took the two-pass fall-back are left
  out), each warp's loop, how many of its tiles appended or took the slow append, and its
  compactions before a fast append (those inside a slow append are not counted).
* ``build_tree``'s threshold select, on ``bench_build_tree.py``'s inputs, one line per budget.
  Codes: ``1`` root and row 0; ``100 + d`` level ``d``'s count; ``200 + d`` a floor rise (the
  radix select); ``300 + d`` the compaction after it; ``400 + d`` the expansion; ``500 + d``
  the next row stored (rows wider than ``ROW_HALF`` only: narrower ones need no phase for
  it); ``600 + i`` the i-th final sort; ``700`` the node table; ``800`` the links.
* ``build_tree``'s finish kernel, on the threshold select's trees of those inputs (bs 1 at
  budgets 64, 256 and 1 024; bs 64 at 256 and 1 024), at the rows a block that
  ``finish_rows`` picks and at ``FINISH_ROWS``: the launch's span (``%globaltimer``, first
  block's start to last block's end), when the blocks started, and each phase of a block
  (the parents staged, the walks, the writes).

``python phase_clock.py [resident] [filtered] [threshold] [finish]`` runs the reports named
(all four by default). Kernels are launched back to back, without an L2 flush and outside a graph.
Compare phases with each other, not the totals with the benchmarks. Each mark adds a few
instructions to thread 0. The anchors are lines of the kernels' source: if one has changed,
the script stops and names it. Writes ``$OUT/phase_clock.txt``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import types

import numpy as np
from harness import Bench  # noqa: F401  (sets NUMBA_CUDA_ARRAY_INTERFACE_SYNC before numba)
from numba import cuda

import ddtree_numba.kernels.build_tree_finish as finish_module
import ddtree_numba.kernels.build_tree_threshold as threshold_module
import ddtree_numba.kernels.draft_topk_filtered as filtered_module
import ddtree_numba.kernels.draft_topk_resident as resident_module
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.kernels.draft_topk import parts_per_row

topk_module = importlib.import_module("ddtree_numba.kernels.draft_topk")   # not the function

CLOCK_SOURCE = r"""
extern "C" __device__ int phase_clock(long long* out) { *out = clock64(); return 0; }
extern "C" __device__ int phase_ns(long long* out) {
    long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); *out = t; return 0; }
"""
PRELUDE = """
_clock_link = cuda.CUSource(CLOCK_SOURCE)
clock = cuda.declare_device("phase_clock", "int64()", link=_clock_link)
ns = cuda.declare_device("phase_ns", "int64()", link=_clock_link)
if "kernel_for_block" in globals():         # not cached: see instrument()
    _kernel_for_block = kernel_for_block

    def kernel_for_block(threads, blocks_per_sm=1):
        return _kernel_for_block(threads, blocks_per_sm, cache=False)
"""


def instrument(module, edits):
    """A copy of ``module`` compiled from its source with ``edits`` (``(anchor, replacement)``
    pairs, each anchor found exactly once) and the clock functions; returns the new module."""
    source = open(module.__file__).read()
    package = module.__name__.rsplit(".", 1)[0]
    source = source.replace("from ..", "from ddtree_numba.").replace(
        "from .", f"from {package}.")
    for anchor, replacement in edits:
        if source.count(anchor) != 1:
            sys.exit(f"phase_clock: {module.__name__} no longer has this line once: {anchor!r}")
        source = source.replace(anchor, replacement)
    # Not in the on-disk kernel cache (DDTREE_KERNEL_CACHE): the copy has no file to key its
    # kernels by, and they link the clock's CUDA C++, which numba cannot store (the prelude
    # does the same for kernel_for_block).
    source = source.replace("cache=CACHE_KERNELS", "cache=False")
    copy = types.ModuleType(module.__name__ + "_marked")
    copy.__dict__["CLOCK_SOURCE"] = CLOCK_SOURCE
    exec(compile(source.replace("\nTHREADS = ", PRELUDE + "\nTHREADS = ", 1)
                 .replace("\nRESIDENT_THREADS = ", PRELUDE + "\nRESIDENT_THREADS = ", 1)
                 .replace("\nFILTER_THREADS = ", PRELUDE + "\nFILTER_THREADS = ", 1)
                 .replace("\nFINISH_ROWS = ", PRELUDE + "\nFINISH_ROWS = ", 1),
                 f"<{copy.__name__}>", "exec"), copy.__dict__)
    return copy


def mark(indent: int, slot: str, code: str | None = None, fn: str = "clock") -> str:
    """Source lines: thread 0 writes ``fn()`` (and ``code``) at ``slot``."""
    pad = " " * indent
    lines = f"{pad}if tid == 0:\n{pad}    marks[{slot}] = {fn}()\n"
    if code is not None:
        lines += f"{pad}    codes[{slot}] = {code}\n"
    return lines


# ---------------------------------------------------------------- draft_topk, resident parts
RESIDENT_PHASES = ["start", "loads and keys", "block max", "floor", "sum of exp", "gather",
                   "sort", "store", "arrival", "merge (last block)"]


def resident_edits():
    a = [("    def load_keys(words, wlo, whi, k, tid, keys, cand, red_u, red_f):",
          "    def load_keys(words, wlo, whi, k, tid, keys, cand, red_u, red_f, marks):")]
    after = {
        "        top_t = uint32(0)                       # this thread's largest key (0: holds "
        "none)\n": 1,
        "        key_max = block_max_u32(red_u, top_t, tid, T)\n": 2,
        "        floor = max(floor, uint32(1))           # never the \"none\" key 0 (past the "
        "slice)\n": 3,
        "        total = block_sum_f32(red_f, s, tid, T)\n": 4,
    }
    a += [(line, line + mark(8, str(slot))) for line, slot in after.items()]
    sort = "                sort_desc_any(cand, found, tid, RESIDENT_THREADS)\n"   # (part kernel)
    a += [(sort, mark(16, "5") + "                if tid == 0:\n                    marks[14] = "
           "found\n" + sort + mark(16, "6"))]
    a += [("    def part_kernel(words, bits, k, chunk, part_keys, part_max, part_sum, "
           "row_done,\n                    top_log_probs, top_token_ids):",
           "    def part_kernel(words, bits, k, chunk, part_keys, part_max, part_sum, "
           "row_done,\n                    top_log_probs, top_token_ids, all_marks):"),
          ("        n_words = words.shape[1]\n        lo = min(p * chunk, n_words)",
           "        marks = all_marks[row_id, p]\n" + mark(8, "10", fn="ns") + mark(8, "0")
           + "        n_words = words.shape[1]\n        lo = min(p * chunk, n_words)"),
          ("lo, hi, k, tid, keys, cand,\n                                                     "
           "red_u, red_f)\n",
           "lo, hi, k, tid, keys, cand,\n                                                     "
           "red_u, red_f, marks)\n"),
          ("        cuda.threadfence()                      # this thread's stores are visible "
           "GPU-wide\n",
           mark(8, "7") + "        cuda.threadfence()                      # this thread's "
           "stores are visible GPU-wide\n"),
          ("        cuda.syncthreads()                      # the flag is set\n",
           "        cuda.syncthreads()                      # the flag is set\n" + mark(8, "8")),
          ("                        RESIDENT_THREADS, top_log_probs, top_token_ids)\n\n"
           "    return whole_row_kernel",
           "                        RESIDENT_THREADS, top_log_probs, top_token_ids, marks)\n"
           + mark(12, "9") + mark(8, "11", fn="ns") + "\n    return whole_row_kernel"),
          ("            cuda.threadfence()                  # (in every thread, before its "
           "reads)\n",
           "            cuda.threadfence()                  # (in every thread, before its "
           "reads)\n" + mark(12, "15"))]
    return a


# Inside the last block's merge (``draft_topk.merge_parts``, marks 16-25): its set-up, the
# lists' loads, the log-sum-exp, each round, the outputs.
MERGE_PHASES = {15: "second fence", 16: "merge set-up", 17: "lists loaded", 18: "log-sum-exp",
                19: "round 1", 20: "round 2", 21: "round 3", 22: "round 4", 23: "round 5",
                24: "round 6", 25: "outputs"}


def merge_edits():
    signature = ("def merge_parts(part_keys, part_max, part_sum, row_id, k, lists, stats, tid, "
                 "T, top_log_probs,\n                top_token_ids):")
    rounds = "        cuda.syncthreads()                  # every list of the round merged\n"
    lse = "    cuda.syncthreads()                      # lists and lse in place\n"
    write = ("    _write_top(lists, k, stats[0], row_id, tid, T, top_log_probs, top_token_ids)"
             "\n\n\n@cuda.jit(cache=CACHE_KERNELS)\ndef _merge_kernel")
    return [(signature, signature.replace("top_token_ids):", "top_token_ids, marks):")),
            ("    n = p2 * k2\n", "    n = p2 * k2\n" + mark(4, "16")),
            ("    _row_lse(part_max[row_id]", mark(4, "17") + "    _row_lse(part_max[row_id]"),
            (lse, lse + mark(4, "18") + "    rnd = 0\n"),
            (rounds, rounds + mark(8, "min(19 + rnd, 24)") + "        rnd += 1\n"),
            (write, write.replace("\n\n\n@cuda", "\n" + mark(4, "25") + "\n\n@cuda"))]


def resident_report(write):
    import torch

    marked = instrument(resident_module, resident_edits())
    marked_topk = instrument(topk_module, merge_edits())   # the merge, marked too
    marked.merge_parts = marked_topk.merge_parts
    marked_topk.clock = marked.clock        # one copy of the clock functions is linked
    L, V = 15, 163_840
    for k in (256, 16):
        x = (torch.randn((1, L, V), device="cuda") * 3).to(torch.float32)
        bits = K.as_device(x.view(torch.int32)).view(np.uint32).reshape(L, V)
        words = bits.view(np.uint64)
        parts = parts_per_row(L, V, k)
        scratch = K.allocate_topk_scratch(1, L, V, k)
        outs = (cuda.device_array((L, k), np.float32), cuda.device_array((L, k), np.int32))
        _, part = marked.resident_kernels(False)
        chunk = math.ceil(words.shape[1] / parts)
        for _ in range(5):                  # compile, warm up; the last launch is read
            marks = cuda.to_device(np.zeros((L, parts, 32), np.int64))
            part[(L, parts), marked.RESIDENT_THREADS](words, bits, k, chunk, *scratch, *outs,
                                                      marks)
            cuda.synchronize()
        t = marks.copy_to_host()
        span_ns = t[:, :, 11].max() - t[:, :, 10].min()   # globaltimer: one clock for all
        last = t[:, :, 9] > 0                  # the merging blocks: clock64 is per SM, so the
        ghz = np.median((t[:, :, 9] - t[:, :, 0])[last]      # rate comes from within a block
                        / (t[:, :, 11] - t[:, :, 10])[last])
        write(f"\ndraft_topk resident, bs 1, L {L}, V {V}, k {k}, float32, {parts} parts: "
              f"{span_ns / 1e3:.1f} us from the first block's start to the last one's end "
              f"(clock {ghz:.2f} GHz)")
        phases = np.diff(t[:, :, :10], axis=2) / ghz / 1e3
        for i in range(9):
            values = phases[:, :, i]
            if i == 8:                      # only the last block of each row merges
                values = values[t[:, :, 9] != 0]
            write(f"  {RESIDENT_PHASES[i]:>15} -> {RESIDENT_PHASES[i + 1]:<18} median "
                  f"{np.median(values):6.2f} us, max {np.max(values):6.2f}")
        write(f"  candidates sorted a block: median {np.median(t[:, :, 14]):.0f}, "
              f"max {t[:, :, 14].max()}")
        merging = t[last]                   # [rows, 32]: the blocks that merged
        before = merging[:, 8]
        for slot, name in MERGE_PHASES.items():
            if (merging[:, slot] == 0).all():
                continue                    # (a round the merge did not have)
            us = np.median(merging[:, slot] - before) / ghz / 1e3
            write(f"    merge: {name:<13} median {us:6.2f} us")
            before = merging[:, slot]


# ---------------------------------------------------------------- draft_topk, one pass
FILTERED_PHASES = ["start", "state reset", "guessed floor", "loop (slowest warp) and lse",
                   "radix select", "gather", "sort", "write"]


def filtered_edits():
    """Marks 0-7 (thread 0: the block's phases), 10/11 (``%globaltimer`` at its start and end),
    12 (candidates sorted), 13 (the radix select's levels), and per warp ``w``: 16 + w its
    loop's end, 24 + w its tiles that appended, 32 + w its compactions before a fast append,
    40 + w its slow appends."""
    # the phases called by the whole-row kernel take the marks (the row-slices kernel, never
    # launched here, is left calling them without: it is never compiled)
    sig = ("    def filter_slice(words, wlo, whi, k, tid, buf, hist, red_u, red_f, counts, tops,\n"
           "                     floor_b, slice_lo):")
    edge_sig = ("    def held_edge(kk, tid, buf, hist, scratch, result, counts, tops, "
                "floor_b):")
    gather_sig = "    def gather_held(edge, tid, buf, top, counts, n_cand):"
    reset = ("        cuda.syncthreads()                  # block state reset before any warp "
             "reads it\n")
    guessed = ("        cuda.syncthreads()                  # every warp's guess in floor_b[1]\n")
    start = "        m = NEG_INF\n        s = float32(0.0)\n"
    # a warp's tile counts live in shared memory (lane 0 of each warp, its own slots; a
    # global counter's load would stall the loop), passed to both calls of filter_tile
    counters = ("        counters = cuda.shared.array(96, int32)     # appends, compactions,"
                " slow appends\n        if tid & 31 == 0:\n"
                "            for c in range(3):\n                counters[c * WARPS + warp] = 0\n")
    tile_sig = "                    buf, base, hist, hbase, lanes_below, floor_b):\n"
    call_1 = ("                                                   hist, hbase, lanes_below, "
              "floor_b)\n            tile += stride\n")
    call_2 = "base, hist, hbase, lanes_below, floor_b)\n                tile += stride\n"

    def count(indent, c):
        pad = " " * indent
        return (f"{pad}if lane == 0:\n"
                f"{pad}    counters[{c} * WARPS + (cuda.threadIdx.x >> 5)] += 1\n")

    scan = ("        end = warp_inclusive_scan(int32(mine), lane)\n"
            "        arriving = cuda.shfl_sync(FULL_MASK, end, 31)\n"
            "        if n + arriving > WARP_CAP and n > kk:\n")
    room = ("            # make room first: compact (raising the floor), then filter the "
            "tile again\n")
    slow = "        for q in range(LOADS * per_word):\n"
    loop_end = ("        # the warp's largest held key: the top of the end's first histogram "
                "(read here, by\n")
    warp_marks = ("        if lane == 0:\n            marks[16 + warp] = clock()\n"
                  "            marks[24 + warp] = counters[warp]\n"
                  "            marks[32 + warp] = counters[WARPS + warp]\n"
                  "            marks[40 + warp] = counters[2 * WARPS + warp]\n")
    lse_done = "        cut_key = max(floor_b[0], floor_b[1])\n"
    level = "                ties = result[2]\n"
    fallback = "        again = counts[WARPS] != 0 or short or kk - need + ties > TOP_CAP\n"
    gathered = "        cuda.syncthreads()                  # all gathered\n"
    sort = "        sort_desc_any(top, n_cand[0], tid, T)\n"
    kernel = "    def whole_row_kernel(words, bits, k, top_log_probs, top_token_ids):\n"
    body = "        tid = cuda.threadIdx.x\n        (buf, top, hist"
    call = ("        m, total, kk = filter_slice(row_words, 0, n_words, k, tid, buf, hist, red_u, "
            "red_f,\n                                    counts, tops, floor_b, slice_lo)\n"
            "        edge, again = held_edge(kk, tid, buf, hist, scratch, result, counts, tops, "
            "floor_b)\n")
    gather_call = "            gather_held(edge, tid, buf, top, counts, n_cand)\n        lse"
    write_top = ("        _write_top(top, k, lse, row_id, tid, FILTER_THREADS, top_log_probs, "
                 "top_token_ids)\n\n    @kernel_for_block")
    return [(sig, sig.replace("slice_lo):", "slice_lo, marks):")),
            (edge_sig, edge_sig.replace("floor_b):", "floor_b, marks):")),
            (gather_sig, gather_sig.replace("n_cand):", "n_cand, marks):")),
            (reset, reset + mark(8, "1")),
            (guessed, guessed + mark(8, "2")),
            (start, start + counters),
            (tile_sig, tile_sig.replace("floor_b):", "floor_b, counters):")),
            (call_1, call_1.replace("floor_b)", "floor_b, counters)")),
            (call_2, call_2.replace("floor_b)", "floor_b, counters)")),
            (scan, count(8, 0) + scan),
            (room, room + count(12, 1)),
            (slow, count(8, 2) + slow),
            (loop_end, warp_marks + loop_end),
            (lse_done, mark(8, "3") + lse_done),
            (level, level + "                if tid == 0:\n"
             "                    marks[13] += 1\n"),
            (fallback, mark(8, "4") + fallback),
            (gathered, gathered + mark(8, "5") + "        if tid == 0:\n"
             "            marks[12] = n_cand[0]\n"),
            (sort, sort + mark(8, "6")),
            (kernel, kernel.replace("top_token_ids):", "top_token_ids, all_marks):")),
            (body, body.replace("        (buf,", "        marks = all_marks[row_id]\n"
                                + mark(8, "10", fn="ns") + mark(8, "0") + "        (buf,")),
            (call, call.replace("slice_lo)", "slice_lo, marks)").replace("floor_b)",
                                                                          "floor_b, marks)")),
            (gather_call, gather_call.replace("n_cand)", "n_cand, marks)")),
            (write_top, write_top.replace("\n\n    @kernel_for_block",
                                          "\n" + mark(8, "7") + mark(8, "11", fn="ns")
                                          + "\n    @kernel_for_block"))]


def filtered_report(write):
    import torch

    marked = instrument(filtered_module, filtered_edits())
    bs, L, V = 64, 15, 163_840
    rows = bs * L
    for k, dtype in ((256, torch.float32), (16, torch.float32), (256, torch.bfloat16)):
        bf16 = dtype == torch.bfloat16
        x = (torch.randn((rows, V), device="cuda") * 3).to(dtype)
        bits = K.as_device(x.view(torch.int16 if bf16 else torch.int32)).view(
            np.uint16 if bf16 else np.uint32)
        words = bits.view(np.uint64)
        outs = (cuda.device_array((rows, k), np.float32), cuda.device_array((rows, k), np.int32))
        whole_row, _ = marked.filtered_kernels(bf16)
        for _ in range(3):                  # compile, warm up; the last launch is read
            marks = cuda.to_device(np.zeros((rows, 48), np.int64))
            whole_row[rows, marked.FILTER_THREADS](words, bits, k, *outs, marks)
            cuda.synchronize()
        t = marks.copy_to_host()
        begin, end = t[:, 10], t[:, 11]
        span_us = (end.max() - begin.min()) / 1e3
        ghz = np.median((t[:, 7] - t[:, 0]) / (end - begin))
        block_us = (end - begin) / 1e3
        starts = np.sort(begin - begin.min()) / 1e3
        wave = cuda.get_current_device().MULTIPROCESSOR_COUNT * marked.BLOCKS_PER_SM
        waves = ", ".join(f"{starts[i]:.0f}" for i in range(0, rows, wave))
        name = "bfloat16" if bf16 else "float32"
        gbs = rows * V * x.element_size() / (span_us * 1e-6) / 1e9
        write(f"\ndraft_topk one pass, bs {bs}, L {L}, V {V}, k {k}, {name}: {span_us:.0f} us "
              f"from the first block's start to the last one's end ({gbs:.0f} GB/s; clock "
              f"{ghz:.2f} GHz)\n  a block: median {np.median(block_us):.1f} us, max "
              f"{block_us.max():.1f}; blocks running at once, mean over the span: "
              f"{block_us.sum() / span_us:.0f} of {wave}; block i*{wave} started at (us): "
              f"{waves}")
        selected = t[:, 5] > 0                  # (a fall-back block has no marks 5 and 6)
        write(f"  blocks that took the two-pass fallback: {rows - selected.sum()} of {rows}")
        phases = np.diff(t[selected, :8], axis=1) / ghz / 1e3
        for i in range(7):
            write(f"  {FILTERED_PHASES[i]:>28} -> {FILTERED_PHASES[i + 1]:<28} median "
                  f"{np.median(phases[:, i]):7.2f} us, max {phases[:, i].max():7.2f}")
        loops = (t[:, 16:24] - t[:, 2:3]) / ghz / 1e3
        write(f"  a warp's loop: median {np.median(loops):.1f} us, slowest of a block "
              f"median {np.median(loops.max(axis=1)):.1f}, fastest of a block median "
              f"{np.median(loops.min(axis=1)):.1f}")
        for label, lo in (("appending tiles", 24), ("compactions", 32), ("slow appends", 40)):
            v = t[:, lo:lo + 8]
            write(f"  {label} a warp: median {np.median(v):.0f}, max {v.max()}")
        write(f"  candidates sorted a block: median {np.median(t[:, 12]):.0f}, "
              f"max {t[:, 12].max()}")
        levels = t[selected, 13]
        write(f"  radix select levels a block: median {np.median(levels):.0f}, max "
              f"{levels.max()}")


# ---------------------------------------------------------------- build_tree, threshold select
def threshold_edits():
    syncs = {
        "    cuda.syncthreads()                             # the root and row 0 in place\n":
            (4, "1"),
        "        cuda.syncthreads()                         # the level written, lp_row read\n":
            (8, "400 + d"),
        "            cuda.syncthreads()                     # the next row in place\n":
            (12, "500 + d"),
        "        cuda.syncthreads()                         # flags and positions complete\n":
            (8, "600 + it"),
        "    cuda.syncthreads()                             # every next_token reset before "
        "the links\n": (4, "700"),
    }

    def counted(indent, code):
        pad = " " * indent
        return (f"{pad}if tid == 0:\n{pad}    marks[b, mk] = clock()\n"
                f"{pad}    codes[b, mk] = {code}\n{pad}mk += 1\n")

    edits = [("next_sibling, ranks, num_nodes):",
              "next_sibling, ranks, num_nodes, marks, codes):"),
             ("    width0 = int32(min(K, B))",
              "    mk = 0\n" + counted(4, "0") + "    if tid == 0:\n        marks[b, 127] = ns()\n"
              "    width0 = int32(min(K, B))")]
    edits += [(line, line + counted(indent, code)) for line, (indent, code) in syncs.items()]
    count = ("                M = _count_children(score, mult, lp_row, at, work, scratch, start, "
             "n, d, K,\n                                    B, floor, tid, T)\n")
    rise = "                                           hist, scratch, found, tid, T))\n"
    compact = "                                start, tid, T)\n            stage += 1\n"
    edits += [(count, count + counted(16, "100 + d")), (rise, rise + counted(12, "200 + d")),
              (compact, compact.replace("            stage", counted(12, "300 + d")
                                        + "            stage"))]
    links = "        if rank[i] == 0 and 0 <= up < j:\n            next_token[b, up] = j\n"
    edits += [(links, links + "    cuda.syncthreads()\n" + counted(4, "800")
               + "    if tid == 0:\n        marks[b, 126] = ns()\n        marks[b, 125] = mk\n")]
    return edits


def threshold_report(write):
    import cupy as cp

    marked = instrument(threshold_module, threshold_edits())
    rng = np.random.default_rng(0)                  # bench_build_tree.py's inputs, bs 1
    L = 15
    for budget in (64, 128, 256, 1024):
        Kk = min(budget, 1024)
        for bs in (1, 8, 64):
            x = (rng.standard_normal((bs, L, Kk + 16)) * 3).astype(np.float32)
            if bs != 1:
                continue
            lp, _ = ref.draft_topk(x, Kk)
            d_lp = K.as_device(cp.asarray(lp))
            tree = K.allocate_tree(bs, budget + 1)
            ranks = K.as_device(cp.empty((bs, budget + 1), cp.int32))
            table = (tree.parents, tree.depths, tree.log_weights, tree.next_token,
                     tree.next_sibling, ranks, tree.num_nodes)
            marks = cuda.to_device(np.zeros((bs, 128), np.int64))
            codes = cuda.to_device(np.full((bs, 128), -1, np.int64))
            for _ in range(3):
                marked._select_threshold_kernel[bs, marked.THREADS, 0, marked.ARENA_BYTES](
                    d_lp, budget, *table, marks, codes)
            cuda.synchronize()
            t, c = marks.copy_to_host()[0], codes.copy_to_host()[0]
            n = int(t[125])
            elapsed_ns = t[126] - t[127]
            ghz = (t[n - 1] - t[0]) / elapsed_ns
            steps = ", ".join(f"{int(c[i])}: {(t[i] - t[i - 1]) / ghz / 1e3:.2f}"
                              for i in range(1, n))
            write(f"\nthreshold select, bs 1, budget {budget}: {elapsed_ns / 1e3:.1f} us "
                  f"(clock {ghz:.2f} GHz); phase code: us\n  {steps}")


# ---------------------------------------------------------------- build_tree, finish kernel
FINISH_PHASES = ["start", "parents staged", "rows walked", "rows written"]


def finish_edits():
    """Marks ``marks[b, block, :]``: 0 the start (``%globaltimer``), 1-4 the SM's clock at
    the start and after each of the kernel's barriers (one added after the writes, so that
    the last mark waits for the block's slowest warp), 5 the end (``%globaltimer``)."""
    def at(indent, slot, fn="clock"):
        pad = " " * indent
        return f"{pad}if tid == 0:\n{pad}    marks[b, cuda.blockIdx.x, {slot}] = {fn}()\n"

    barrier = "    cuda.syncthreads()" + " " * 30      # (the comments' column)
    staged = barrier + "# parent_s complete before the walks\n"
    walked = barrier + "# every row's words complete\n"
    written = "        positions[b, i0 + tid] = position\n"
    return [("mask_bytes, mask_words, head):", "mask_bytes, mask_words, head, marks):"),
            ("    tid = cuda.threadIdx.x\n",
             "    tid = cuda.threadIdx.x\n" + at(4, 0, "ns") + at(4, 1)),
            (staged, staged + at(4, 2)), (walked, walked + at(4, 3)),
            (written, written + "    cuda.syncthreads()\n" + at(4, 4) + at(4, 5, "ns"))]


def finish_report(write):
    import cupy as cp

    marked = instrument(finish_module, finish_edits())
    rng = np.random.default_rng(0)
    L = 15
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    for bs, budget in ((1, 64), (1, 256), (1, 1024), (64, 256), (64, 1024)):
        Kk = min(budget, 1024)
        x = (rng.standard_normal((bs, L, Kk + 16)) * 3).astype(np.float32)
        lp, ids = ref.draft_topk(x, Kk)
        d_lp = K.as_device(cp.asarray(lp))
        d_ids = K.as_device(cp.asarray(ids.astype(np.int32)))
        roots = K.as_device(cp.arange(bs, dtype=cp.int32))
        prefix = K.as_device(cp.full(bs, 100, cp.int32))
        tree = K.allocate_tree(bs, budget + 1)
        ranks = K.as_device(cp.empty((bs, budget + 1), cp.int32))
        table = (tree.parents, tree.depths, tree.log_weights, tree.next_token,
                 tree.next_sibling, ranks, tree.num_nodes)
        threshold_module._select_threshold_kernel[bs, threshold_module.THREADS, 0,
                                                  threshold_module.ARENA_BYTES](
            d_lp, budget, *table)
        N = budget + 1
        for rows in sorted({marked.finish_rows(bs, N, sms), marked.FINISH_ROWS}):
            grid = (-(-N // rows), bs)
            marks = cuda.to_device(np.zeros((bs, grid[0], 6), np.int64))
            for _ in range(3):                  # compile, warm up; the last launch is read
                marked._finish_kernel[grid, marked.FINISH_THREADS](
                    d_ids, roots, prefix, True, tree.parents, tree.depths, ranks,
                    tree.num_nodes, rows, *marked.finish_outputs(tree), marks)
            cuda.synchronize()
            t = marks.copy_to_host().reshape(-1, 6)
            begin, end = t[:, 0], t[:, 5]
            span_us = (end.max() - begin.min()) / 1e3
            ghz = np.median((t[:, 4] - t[:, 1]) / np.maximum(end - begin, 1))
            starts = np.sort(begin - begin.min()) / 1e3
            write(f"\nfinish, bs {bs}, budget {budget}, {rows} rows a block ({grid[0] * bs} "
                  f"blocks): {span_us:.1f} us from the first block's start to the last one's "
                  f"end (clock {ghz:.2f} GHz); blocks started by (us): median "
                  f"{np.median(starts):.1f}, last {starts[-1]:.1f}; a block: median "
                  f"{np.median(end - begin) / 1e3:.1f} us, max {(end - begin).max() / 1e3:.1f}")
            phases = np.diff(t[:, 1:5], axis=1) / ghz / 1e3
            for i in range(3):
                write(f"  {FINISH_PHASES[i]:>15} -> {FINISH_PHASES[i + 1]:<15} median "
                      f"{np.median(phases[:, i]):6.2f} us, max {phases[:, i].max():6.2f}")


def main():
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results"))
    lines = []

    def write(line):
        print(line, flush=True)
        lines.append(line)

    reports = {"resident": resident_report, "filtered": filtered_report,
               "threshold": threshold_report, "finish": finish_report}
    chosen = sys.argv[1:] or list(reports)
    unknown = [name for name in chosen if name not in reports]
    if unknown:
        sys.exit(f"phase_clock.py: unknown report {unknown[0]!r}; expected some of "
                 f"{', '.join(reports)}")
    name = cuda.get_current_device().name
    write(f"phase_clock on {name.decode() if isinstance(name, bytes) else name}")
    for report in chosen:
        reports[report](write)
    with open(os.path.join(out_dir, "phase_clock.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

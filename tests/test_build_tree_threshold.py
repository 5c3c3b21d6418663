"""The floor model of build_tree equals the reference's best-first pops (same nodes,
numbering, depths, ranks and float32 scores) on random rows and on the edges, at capacities
small enough that every path runs (both floor rises, the fall-back, repeated sorts); its radix
select is exact; and the ``"threshold"`` kernel equals the reference on inputs that take each
of those paths in the simulator's 256-entry list, and stays in bounds on unchecked input."""

import numpy as np
import pytest
from cases import random_topk
from numba import cuda, float32, int8, int16, int32, uint64
from test_build_tree import assert_trees_equal
from test_build_tree_levels import KINDS, LARGE_SIZES, SMALL_SIZES, sorted_rows

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.reference import best_first
from ddtree_numba.reference.build_tree_threshold import (
    best_first_by_threshold,
    floor_caps,
    floor_edge,
    kth_largest,
    score_keys,
)


def same_as_reference(lp, budget, capacity):
    """The model's tree equals best_first's (``None``: it fell back); returns its stats."""
    got, stats = best_first_by_threshold(lp, budget, capacity)
    if got is not None:
        want = best_first(lp, budget)
        for name, a, b in zip(("parents", "depths", "ranks"), want[:3], got[:3], strict=True):
            assert list(a) == list(b), name
        assert np.array_equal(np.array(want[3], np.float32), np.array(got[3], np.float32))
        assert stats["most"] <= capacity
    return got is not None, stats


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_reference_on_every_kind_size_and_capacity(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    seen = {"select": 0, "fallback": 0, "resort": 0}
    for L, K_, budget in SMALL_SIZES:
        lp = sorted_rows(rng, L, K_, kind)
        for capacity in (2048, 2 * budget + 2, budget + 4):
            done, stats = same_as_reference(lp, budget, capacity)
            seen["select"] += stats["selects"] > 0
            seen["fallback"] += not done
            seen["resort"] += stats["sorts"] > 1
            if kind in ("random", "log_softmax") and capacity >= 2 * budget + 2:
                assert done                   # no crowd of ties: no fall-back
    assert seen["select"] > 0                 # the floor rose on this kind's rows
    if kind in ("ties", "zeros"):
        assert seen["fallback"] > 0           # ties crowded a small list


def test_levels_stats_are_the_counts_of_each_level():
    """``stats["levels"]`` (the docs' picture of a level reads it): without a floor rise, level
    0 is the root's count alone, each next level has one parent for each child of the last,
    and the counts add up to the nodes listed."""
    rng = np.random.default_rng(11)
    lp = sorted_rows(rng, 3, 8, "log_softmax")     # at most 1 + 8 + 64 + 512 nodes: no rise
    got, stats = best_first_by_threshold(lp, 40, capacity=4096)
    assert got is not None and stats["selects"] == 0
    levels = stats["levels"]
    assert len(levels[0]) == 1 and 2 <= len(levels) <= 3
    for before, after in zip(levels, levels[1:], strict=False):
        assert len(after) == sum(before)
    assert 1 + sum(map(sum, levels)) == stats["most"]


@pytest.mark.parametrize("kind", ("random", "log_softmax", "zeros", "ties"))
def test_large_budgets_at_the_gpu_capacity(kind):
    rng = np.random.default_rng(7)
    for L, K_, budget in LARGE_SIZES:
        done, stats = same_as_reference(sorted_rows(rng, L, K_, kind), budget, 2048)
        assert done == (kind in ("random", "log_softmax"))   # zeros: every node ties at 0


def test_repeated_sorts_settle_equal_scores_by_their_parents():
    """Rounded rows: equal scores whose parents also tie need more than one sort."""
    rng = np.random.default_rng(3)
    most = 1
    for _ in range(40):
        lp = sorted_rows(rng, 5, 7, "ties")
        done, stats = same_as_reference(lp, 17, 2048)
        assert done
        most = max(most, stats["sorts"])
    assert most >= 3


def test_kth_largest_is_exact_with_repeats():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 300):
        keys = score_keys(np.round(rng.standard_normal(n), 1).astype(np.float32))
        for k in {1, (n + 1) // 2, n}:
            assert kth_largest(keys, k) == np.sort(keys)[::-1][k - 1]


def test_floor_edge_is_a_floor_that_keeps_at_most_its_cap():
    """The edge is at most the k-th largest key; it leaves at most ``cap`` keys, or it is the
    k-th key itself (four rounds: ties or close keys crowd every bin)."""
    rng = np.random.default_rng(1)
    for n, spread in ((300, 3.0), (2000, 3.0), (2000, 0.001), (50, 0.0)):
        keys = score_keys(-np.abs(rng.standard_normal(n) * spread).astype(np.float32))
        want = np.sort(keys)[::-1]
        for k in {1, n // 3, n}:
            for cap in (0, k, k + 32, 2 * k, n):
                edge, rounds = floor_edge(keys, k, cap)
                assert 1 <= rounds <= 4
                assert edge <= want[k - 1]
                kept = int(np.count_nonzero(keys >= edge))
                assert kept <= cap or (rounds == 4 and edge == want[k - 1])
                if cap >= n:
                    assert rounds == 1                  # the first bin's edge keeps them all


def test_floor_caps():
    assert floor_caps(256, 2048) == (288, 511)          # 2 ** 9 slots in the final sort
    assert floor_caps(1024, 2048) == (1056, 2047)
    assert floor_caps(40, 44) == (40, 63)               # no room: the cap is B
    assert floor_caps(0, 2048) == (0 + 32, 0)


def test_rises_take_fewer_rounds_on_the_benchmark_rows():
    """On ``bench_build_tree``'s inputs (log-softmax of Gaussian logits, x 3) the floor's rises
    stop at the first bins: two rounds a rise or fewer, where the exact select takes four."""
    rng = np.random.default_rng(0)
    for budget in (256, 1024):
        x = (rng.standard_normal((15, budget + 16)) * 3).astype(np.float32)
        lp, _ = ref.draft_topk(x[None], budget)
        done, stats = same_as_reference(lp[0], budget, 2048)
        assert done and stats["selects"] >= 1
        # the exact select takes 4 rounds a rise, and there is one more rise at the end
        assert stats["rounds"] <= 2 * (stats["selects"] + 1)


# --- the kernel (the simulator's list holds 256 entries, a GPU's 2048) ----------------------
def kernel_cases():
    """Inputs that overflow the simulator's list (both floor rises), that fall back (every
    score ties), that need repeated sorts, and the edges; rows wider than the simulator's
    ``ROW_HALF`` (one row array, stored at each level's end) and narrower (two halves), each
    with floor rises."""
    rng = np.random.default_rng(11)
    cases = []
    for L, K_, budget, kind in ((5, 64, 40, "random"), (4, 64, 100, "log_softmax"),
                                (3, 64, 64, "random"), (5, 16, 100, "zeros"),
                                (5, 7, 17, "ties"), (15, 2, 17, "ties"), (1, 1, 0, "random"),
                                (1, 8, 1, "random"), (6, 64, 60, "neg_inf"),
                                (6, 16, 120, "random")):
        lp = np.stack([sorted_rows(rng, L, K_, kind) for _ in range(2)])
        cases.append((lp, budget))
    return cases


def run_kernel_cases(which=None):
    cases = kernel_cases()
    for lp, budget in (cases if which is None else [cases[i] for i in which]):
        bs, L, K_ = lp.shape
        ids = np.broadcast_to(np.arange(K_, dtype=np.int32), lp.shape).copy()
        roots = np.arange(bs, dtype=np.int32)
        prefix = np.array([5, 900], np.int32)
        want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
        assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                        variant="threshold"), want)


def test_kernel_cases_take_every_path():
    """The cases above do reach the paths they are meant for, at the simulator's capacity."""
    from ddtree_numba.kernels.build_tree_threshold import CAPACITY, ROW_HALF

    stats = [best_first_by_threshold(lp[b], budget, CAPACITY) for lp, budget in kernel_cases()
             for b in range(lp.shape[0])] if K.SIMULATOR else []
    if K.SIMULATOR:
        # floor rises with the row in one array and in two halves
        halves = [min(lp.shape[2], budget) <= ROW_HALF for lp, budget in kernel_cases()
                  for b in range(lp.shape[0])]
        risen = [tree is not None and s["selects"] > 0 for tree, s in stats]
        assert any(r and h for r, h in zip(risen, halves, strict=True))
        assert any(r and not h for r, h in zip(risen, halves, strict=True))
        assert any(tree is None for tree, _ in stats)
        assert any(s["selects"] >= 2 for tree, s in stats if tree is not None)
        assert any(s["sorts"] >= 2 for tree, s in stats if tree is not None)
        assert any(s["end"] for tree, s in stats if tree is not None)
        # a rise that stopped at a bin's edge before the fourth round
        assert any(s["rounds"] < 4 * (s["selects"] + s["end"]) for tree, s in stats
                   if tree is not None and s["selects"])


def test_kernel_bit_exact_on_every_path():
    run_kernel_cases()


@pytest.mark.skipif(not K.SIMULATOR, reason="the simulator's emulated warp shuffles")
def test_kernel_with_its_gpu_scan_and_sort_on_emulated_shuffles(monkeypatch):
    """The block scan and the sort the kernel takes on a GPU (warp shuffles), emulated."""
    from simulated_warp import emulated_shuffles

    from ddtree_numba.kernels import _primitives, build_tree_levels, build_tree_threshold

    for module in (build_tree_threshold, build_tree_levels):   # (the fall-back's select too)
        monkeypatch.setattr(module, "block_inclusive_scan_open",
                            _primitives._warp_shuffle_scan_open)
    monkeypatch.setattr(_primitives, "bitonic_sort_desc", _primitives._bitonic_sort_gpu)
    with emulated_shuffles():
        run_kernel_cases(which=(0, 3, 4, 9))   # both floor rises (one row; two halves); the
                                               # fall-back; repeated sorts


def test_kernel_unchecked_positive_log_probs_stay_in_bounds():
    """Log-probs > 0 (refused when checked) break the floor's argument; unchecked, the tree is
    wrong but no index leaves its array (the simulator raises IndexError where a GPU would
    touch memory out of bounds)."""
    from numba import cuda

    rng = np.random.default_rng(4)
    lp, ids = random_topk(rng, 2, 5, 8, V=16)
    lp = np.ascontiguousarray(-lp[..., ::-1]) + 1.0            # ascending and positive
    lp[1, 2, 3] = np.nan
    roots, prefix = np.array([1, 2], np.int32), np.array([0, 9], np.int32)
    tree = K.build_tree(cuda.to_device(lp), cuda.to_device(ids), cuda.to_device(roots), 20,
                        prefix_lens=cuda.to_device(prefix), variant="threshold")
    parents = tree.parents.copy_to_host()
    assert ((parents >= -1) & (parents < 21)).all()
    assert (tree.num_nodes.copy_to_host() <= 21).all()


def test_shared_layout_places_each_array_aligned_and_apart():
    from ddtree_numba.kernels._device import shared_layout

    offsets, nbytes = shared_layout((np.uint64, 3), (np.float32, 5), (np.int16, 2), (np.int8, 7))
    assert offsets == (0, 6, 22, 48) and nbytes == 55   # bytes 0, 24, 44, 48
    with pytest.raises(ValueError, match=r"arrays: a float32 array .* unaligned \(byte 2\)"):
        shared_layout((np.int16, 1), (np.float32, 1))


@pytest.mark.parametrize("phase", ["list", "levels"])
def test_kernel_shared_arrays_do_not_overlap(phase):
    """The threshold kernel's one dynamic shared block: the list's arrays lie apart from each
    other, so do the fall-back's, and each set fits the block the launch asks for."""
    from ddtree_numba.kernels import build_tree_threshold as t

    C, R, S, Nc = t.CAPACITY, t.ROW, t.SCAN_SCRATCH, t.NODE_CAPACITY
    arrays = {   # name: (offset in elements, itemsize, count)
        "list": [(t.AT_WORK, 8, C), (t.AT_SCORE, 4, C), (t.AT_ROW, 4, R), (t.AT_HIST, 4, t.BINS),
                 (t.AT_SCRATCH, 4, S), (t.AT_FOUND, 4, 3), (t.AT_FLAGS, 4, 4),
                 (t.AT_PARENT, 2, C), (t.AT_RANK, 2, C), (t.AT_MULT, 2, C), (t.AT_DEPTH, 1, C)],
        "levels": [(t.AT_G_KEY, 8, Nc), (t.AT_CAND, 8, t.CAND_CAP), (t.AT_LEVELS_ROW, 4, Nc),
                   (t.AT_PLIST, 4, Nc), (t.AT_OFFSETS, 4, Nc), (t.AT_NEWPOS, 4, Nc),
                   (t.AT_LEVELS_SCRATCH, 4, S), (t.AT_STATE, 4, 2), (t.AT_G_DEPTH, 2, Nc)],
    }[phase]
    spans = sorted((at * size, (at + count) * size) for at, size, count in arrays)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= t.ARENA_BYTES <= 48 * 1024


@pytest.mark.gpu
def test_kernel_falls_back_in_its_block_at_gpu_capacity():
    """At the GPU's 2 048-entry list: a request whose scores all tie crowds it and takes the
    levels select inside the same block and shared memory; the other requests of the launch,
    which do not, keep their own trees. Every tree equals the reference."""
    from ddtree_numba.kernels.build_tree_threshold import CAPACITY

    rng = np.random.default_rng(29)
    L, K_, budget = 15, 1024, 1024
    lp = np.stack([sorted_rows(rng, L, K_, kind)
                   for kind in ("log_softmax", "zeros", "random", "zeros")])
    fell_back = [best_first_by_threshold(lp[b], budget, CAPACITY)[0] is None for b in range(4)]
    assert fell_back == [False, True, False, True]      # the inputs take the paths meant
    ids = np.broadcast_to(np.arange(K_, dtype=np.int32), lp.shape).copy()
    roots = np.arange(4, dtype=np.int32)
    prefix = np.array([0, 7, 300, 4000], np.int32)
    want = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    assert_trees_equal(K.build_tree(lp, ids, roots, budget, prefix_lens=prefix,
                                    variant="threshold"), want)


def _expand_kernel_for(T):
    """A kernel running the threshold select's step 4 (``_expand``) alone on given sums, with
    the row at an offset ``AT`` of its array (as in the second of its halves)."""
    from ddtree_numba.kernels.build_tree_threshold import CAPACITY, ROW, _expand
    AT = 7

    @cuda.jit
    def kernel(counts_sums, parent_scores, row, n, start, M, d, B, out_f, out_i):
        tid = cuda.threadIdx.x
        score = cuda.shared.array(CAPACITY, float32)
        parent = cuda.shared.array(CAPACITY, int16)
        rank = cuda.shared.array(CAPACITY, int16)
        depth = cuda.shared.array(CAPACITY, int8)
        mult = cuda.shared.array(CAPACITY, int16)
        work = cuda.shared.array(CAPACITY, uint64)
        lp_row = cuda.shared.array(ROW, float32)
        for i in range(tid, CAPACITY, T):
            score[i] = parent_scores[i]
            mult[i] = 1 + i % 3
            parent[i] = -7
            work[i] = uint64(counts_sums[i])
        for i in range(tid, ROW, T):            # the row at lp_row[AT:], garbage before it
            lp_row[i] = row[i - AT] if i >= AT else float32(1e30)
        cuda.syncthreads()
        _expand(score, parent, rank, depth, mult, work, lp_row, AT, n, start, M, d, B, tid, T)
        cuda.syncthreads()
        for i in range(tid, CAPACITY, T):
            out_f[i] = score[i]
            out_i[0, i] = int32(parent[i])
            out_i[1, i] = int32(rank[i])
            out_i[2, i] = int32(depth[i])
            out_i[3, i] = int32(mult[i])

    return kernel


@pytest.mark.parametrize("widths", [
    [5], [0, 0, 3], [40, 0, 0, 0, 1, 0, 2], [1] * 30, [0] * 20 + [7] + [0] * 20 + [1],
    [0, 0, 0], [2, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 1],
    "random"])
def test_expand_writes_every_child_once_whatever_the_widths(widths):
    """Step 4 alone: each thread writes a run of the level's children, stepping from parent to
    parent and searching again past parents without children; the list equals the model's
    layout (parents in order, each one's children in rank order) for one parent, runs of
    childless parents, more children than threads and none at all."""
    from ddtree_numba.kernels.build_tree_threshold import CAPACITY, ROW, THREADS

    rng = np.random.default_rng(3)
    if widths == "random":
        widths = list(rng.integers(0, 4, 60) * (rng.random(60) < 0.5))
    start, P = 9, len(widths)
    n = start + P
    M = int(sum(widths))
    assert n + M <= CAPACITY
    sums = np.zeros(CAPACITY, np.int64)
    sums[:P] = np.cumsum(widths)
    scores = -rng.random(CAPACITY).astype(np.float32)
    row = np.float32(-0.25) * np.arange(ROW, dtype=np.float32)     # a descending row
    d, B = 3, 50
    out_f = np.zeros(CAPACITY, np.float32)
    out_i = np.zeros((4, CAPACITY), np.int32)
    _expand_kernel_for(THREADS)[1, THREADS](sums, scores, row, np.int32(n), np.int32(start),
                                            np.int32(M), np.int32(d), np.int32(B), out_f, out_i)
    j = n
    for u, w in enumerate(widths):
        for r in range(w):
            p = start + u
            assert out_f[j] == np.float32(scores[p] + row[r])
            assert list(out_i[:, j]) == [p, r, d + 1, min((1 + p % 3) * (r + 1), B + 1)]
            j += 1
    assert (out_i[0, n + M:] == -7).all() and (out_i[0, :n] == -7).all()   # nothing else

"""commit_kv: paged cache, shuffled block table, pages crossed, k = 0, untouched rows; every
layer of a stacked cache in one launch."""

import numpy as np
import pytest
from cases import paged_cache
from ml_dtypes import bfloat16

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.arrays import host_values


def random_paths(rng, bs, N, max_k):
    nodes = np.full((bs, N), -1, np.int32)
    lens = np.zeros(bs, np.int32)
    for b in range(bs):
        k = int(rng.integers(0, min(max_k, N - 1) + 1))
        nodes[b, 0] = 0
        nodes[b, 1 : k + 1] = np.sort(rng.choice(np.arange(1, N), k, replace=False))
        lens[b] = k
    return nodes, lens


def expected(cache, table, prefix, nodes, lens):
    want = cache.copy()
    page_size = cache.shape[1]
    for b in range(len(prefix)):
        P = int(prefix[b])
        for i in range(1, int(lens[b]) + 1):          # sequential ascending order
            s, d = P + nodes[b, i], P + i
            want[table[b, d // page_size], d % page_size] = \
                want[table[b, s // page_size], s % page_size]
    return want


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.float16])
def test_reference_and_kernel(seed, dtype):
    rng = np.random.default_rng(seed)
    bs, N = int(rng.integers(1, 5)), int(rng.integers(1, 40))
    page_size = int(rng.choice([1, 4, 16]))
    prefix = rng.integers(0, 30, bs).astype(np.int32)
    cache, table = paged_cache(rng, bs, prefix, N, page_size=page_size, D=12, dtype=dtype)
    nodes, lens = random_paths(rng, bs, N, max_k=12)
    want = expected(cache, table, prefix, nodes, lens)

    got_ref = cache.copy()
    new_ref = ref.commit_kv(got_ref, table, prefix, nodes, lens)
    assert got_ref.tobytes() == want.tobytes()         # bit-exact, every other row untouched
    np.testing.assert_array_equal(new_ref, prefix + lens + 1)

    got_k = cache.copy()
    new_k = K.commit_kv(got_k, table, prefix, nodes, lens)
    assert got_k.tobytes() == want.tobytes()
    np.testing.assert_array_equal(new_k.copy_to_host(), prefix + lens + 1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, bfloat16])
def test_stacked_layers_commit_as_each_layer_alone(seed, dtype):
    """A ``[layers, num_pages, page_size, D]`` cache: the same moves in every layer, in one
    launch, bit for bit what committing each layer's cache alone gives."""
    rng = np.random.default_rng(100 + seed)
    bs, N, layers = int(rng.integers(1, 4)), int(rng.integers(2, 20)), int(rng.integers(2, 4))
    prefix = rng.integers(0, 20, bs).astype(np.int32)
    cache, table = paged_cache(rng, bs, prefix, N, page_size=4, D=12, dtype=dtype)
    stack = np.stack([cache] + [rng.standard_normal(cache.shape).astype(dtype)
                                for _ in range(layers - 1)])
    nodes, lens = random_paths(rng, bs, N, max_k=8)
    want = np.stack([expected(layer, table, prefix, nodes, lens) for layer in stack])
    for impl in (ref.commit_kv, K.commit_kv):
        got = stack.copy()
        new = impl(got, table, prefix, nodes, lens)
        assert got.tobytes() == want.tobytes(), impl
        np.testing.assert_array_equal(host_values(new), prefix + lens + 1)


def two_requests():
    """A small case: request 0 accepts nodes 1 and 3 after an empty prefix, request 1 nothing
    after 5 rows (new lengths 3 and 6)."""
    prefix = np.array([0, 5], np.int32)
    cache, table = paged_cache(np.random.default_rng(0), 2, prefix, 4, page_size=2, D=3)
    nodes = np.array([[0, 1, 3, -1], [0, -1, -1, -1]], np.int32)
    return cache, table, prefix, nodes, np.array([2, 0], np.int32)


def test_a_stack_of_no_layers_still_gives_the_new_lengths():
    cache, table, prefix, nodes, lens = two_requests()
    empty = np.zeros((0, *cache.shape), np.float32)
    for impl in (ref.commit_kv, K.commit_kv):
        new = impl(empty, table, prefix, nodes, lens)
        assert host_values(new).tolist() == [3, 6]


@pytest.mark.parametrize("shape", [(4, 12), (1, 1, 4, 2, 12)])
def test_a_cache_of_another_rank_is_refused_by_name(shape):
    rng = np.random.default_rng(0)
    prefix = np.array([0], np.int32)
    _, table = paged_cache(rng, 1, prefix, 3, page_size=2, D=12)
    nodes, lens = np.array([[0, 1, -1]], np.int32), np.array([1], np.int32)
    for impl in (ref.commit_kv, K.commit_kv):
        with pytest.raises(ValueError, match=r"kv_cache: expected rank 3 .* or rank 4"):
            impl(np.zeros(shape, np.float32), table, prefix, nodes, lens)


def test_more_stacked_layers_than_a_grid_holds_are_refused_by_name():
    from ddtree_numba.validation import MAX_STACKED_LAYERS

    rng = np.random.default_rng(0)
    prefix = np.array([0], np.int32)
    _, table = paged_cache(rng, 1, prefix, 3, page_size=2, D=1)
    nodes, lens = np.array([[0, 1, -1]], np.int32), np.array([1], np.int32)
    huge = np.broadcast_to(np.zeros(1, np.float32), (MAX_STACKED_LAYERS + 1, 3, 2, 1))
    with pytest.raises(ValueError, match="kv_cache: expected at most 65535 stacked layers"):
        K.commit_kv(huge, table, prefix, nodes, lens)


def test_out_must_not_be_prefix_lens_and_zero_width_rows_still_give_lengths():
    cache, table, prefix, nodes, lens = two_requests()
    d_prefix = K.as_device(prefix)
    with pytest.raises(ValueError, match="out: expected a buffer of its own"):
        K.commit_kv(K.as_device(cache), table, d_prefix, nodes, lens, out=d_prefix)
    assert host_values(d_prefix).tolist() == [0, 5]                 # untouched
    with pytest.raises(ValueError, match="out: expected"):
        K.commit_kv(cache, table, prefix, nodes, lens, out=K.as_device(np.zeros(3, np.int32)))
    narrow = np.zeros((cache.shape[0], cache.shape[1], 0), np.float32)
    assert host_values(K.commit_kv(narrow, table, prefix, nodes, lens)).tolist() == [3, 6]


@pytest.mark.parametrize("seed", range(2))
def test_long_paths_take_several_plan_passes_and_move_chunks(seed):
    """Paths of 40 to 99 moves: several rounds of the plan (16 moves a round on the simulator,
    64 on a GPU), more moves than a simulated block has threads, several chunks of eight
    moves a column."""
    rng = np.random.default_rng(40 + seed)
    bs, N = 2, 100
    prefix = rng.integers(0, 30, bs).astype(np.int32)
    cache, table = paged_cache(rng, bs, prefix, N, page_size=4, D=12)
    nodes = np.tile(np.arange(N, dtype=np.int32), (bs, 1))     # a_i = i, then moves a_i > i
    lens = np.array([int(rng.integers(40, N)), N - 1], np.int32)
    for b in range(bs):
        k = int(lens[b])
        nodes[b, 1 : k + 1] = np.sort(rng.choice(np.arange(1, N), k, replace=False))
        nodes[b, k + 1 :] = -1
    want = expected(cache, table, prefix, nodes, lens)
    got = cache.copy()
    new = K.commit_kv(got, table, prefix, nodes, lens)
    assert got.tobytes() == want.tobytes()
    np.testing.assert_array_equal(new.copy_to_host(), prefix + lens + 1)


def test_kernel_unchecked_garbage_stays_in_bounds():
    """``check=False`` with path nodes, lengths and pages outside their ranges: no crash, the
    new lengths clamp ``k`` to ``[0, N - 1]``, and the only rows written are destinations of
    moves whose source and destination pass every check (which values they get is not
    defined: unordered nodes break the read-before-write order)."""
    rng = np.random.default_rng(3)
    bs, N, page_size = 3, 50, 4
    prefix = np.array([0, 5, 9], np.int32)
    cache, table = paged_cache(rng, bs, prefix, N, page_size=page_size, D=8)
    table[1, 2] = -7                                    # a page that is no page
    table[2, 0] = cache.shape[0] + 3
    nodes = rng.integers(-5, N + 5, (bs, N)).astype(np.int32)
    lens = np.array([N + 10, 45, -3], np.int32)
    d_cache = K.as_device(cache.copy())
    new = K.commit_kv(d_cache, *(K.as_device(a) for a in (table, prefix, nodes, lens)),
                      check=False)
    np.testing.assert_array_equal(new.copy_to_host(), prefix + np.clip(lens, 0, N - 1) + 1)
    writable = np.zeros(cache.shape[:2], bool)          # (page, offset) a move may write
    capacity = table.shape[1] * page_size
    for b in range(bs):
        P = int(prefix[b])
        for i in range(1, int(np.clip(lens[b], 0, N - 1)) + 1):
            a = int(nodes[b, i])
            src, dst = P + a, P + i
            if 0 <= a < N and src < capacity and dst < capacity:
                sp, dp = table[b, src // page_size], table[b, dst // page_size]
                if 0 <= sp < cache.shape[0] and 0 <= dp < cache.shape[0]:
                    writable[dp, dst % page_size] = True
    changed = (d_cache.copy_to_host() != cache).any(axis=2)
    assert changed.any() and not (changed & ~writable).any()


def test_overlapping_moves_and_k0():
    """Path 0 -> 2 -> 3: move 1 reads the slot that move 2 writes (read-all-then-write)."""
    rng = np.random.default_rng(0)
    prefix = np.array([3, 0], np.int32)
    cache, table = paged_cache(rng, 2, prefix, 5, page_size=2, D=4)
    nodes = np.array([[0, 2, 3, -1, -1], [0, -1, -1, -1, -1]], np.int32)
    lens = np.array([2, 0], np.int32)
    want = expected(cache, table, prefix, nodes, lens)
    row = lambda c, b, s: c[table[b, s // 2], s % 2]   # noqa: E731
    np.testing.assert_array_equal(row(want, 0, 4), row(cache, 0, 5))   # slot P+1 <- P+2
    np.testing.assert_array_equal(row(want, 0, 5), row(cache, 0, 6))   # slot P+2 <- P+3
    for impl in (ref.commit_kv, K.commit_kv):
        got = cache.copy()
        impl(got, table, prefix, nodes, lens)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("P", [-2, -1000, -(2**31), 2**31 - 3, 2**31 - 1])
def test_kernel_unchecked_prefix_out_of_range_moves_nothing(P):
    """``check=False`` with a prefix that is no slot: negative (slot ``P + i`` would index the
    block table at a negative page, which wraps around or runs out of bounds) or so large that
    ``P + N`` passes ``MAX_POSITION`` (``P + i`` wraps around int32). The row moves nothing and
    its new prefix length is ``P`` unchanged; the other row commits normally."""
    rng = np.random.default_rng(0)
    N, page_size = 4, 2
    good = np.array([0, 3], np.int32)
    cache, table = paged_cache(rng, 2, good, N, page_size=page_size, D=3)
    prefix = np.array([P, 3], np.int32)
    nodes = np.array([[0, 1, 3, -1], [0, 2, -1, -1]], np.int32)
    lens = np.array([2, 1], np.int32)
    want = expected(cache, table, good * [0, 1], nodes, lens * [0, 1])   # row 0: no move
    got = cache.copy()
    with pytest.raises(ValueError, match="prefix_lens"):
        ref.commit_kv(got, table, prefix, nodes, lens)
    new = K.commit_kv(got, table, prefix, nodes, lens, check=False)
    assert got.tobytes() == want.tobytes()
    assert new.copy_to_host().tolist() == [P, 3 + 1 + 1]

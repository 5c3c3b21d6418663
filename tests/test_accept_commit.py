"""accept_commit: greedy accept and KV commit in one launch, bit-exact to tree_accept then
commit_kv (references) on one layer and on every layer of a 4-D cache; 16-bit caches; paths
of up to 44 moves; unchecked garbage stays in bounds; bad input named; nothing changed on
error."""

import importlib

import numpy as np
import pytest
from cases import paged_cache, random_parents
from ml_dtypes import bfloat16

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref

FIELDS = ("accept_nodes", "accept_len", "accept_tokens", "bonus_token")


def problem(seed, bs, N, layers, dtype, page_size=4, D=12):
    """Random trees whose predictions follow a random child (paths of a few nodes; seed
    ``"chain"``: the path 0 -> 2 -> 4 -> ... with a leaf beside each step, accepted whole:
    ``(N - 1) // 2`` moves ``a_i = 2 i``), a random prefix per request, and a shuffled paged
    cache of ``layers`` layers (None: one 3-D layer)."""
    chain = seed == "chain"
    rng = np.random.default_rng(99 if chain else seed)
    parents, tokens = random_parents(rng, bs, N)
    if chain:        # 0 -> 2 -> 4 -> ..., a leaf i + 1 beside each step: a_i = 2 i
        i = np.arange(N)
        parents = np.tile(np.where(i % 2 == 0, i - 2, i - 1).astype(np.int32), (bs, 1))
        parents[:, 0] = -1
        tokens = np.tile(np.arange(N, dtype=np.int32), (bs, 1))
    tree = ref.tree_from_parents(parents, tokens)
    predict = np.full((bs, N), 10**6, np.int32)
    for b in range(bs):
        for i in range(N):
            kids = np.flatnonzero(parents[b] == i)
            if chain:
                predict[b, i] = i + 2 if i + 2 < N else 10**6
            elif kids.size and rng.random() < 0.8:
                predict[b, i] = tree.token_ids[b, kids[rng.integers(0, kids.size)]]
    prefix = rng.integers(0, 20, bs).astype(np.int32)
    one, table = paged_cache(rng, bs, prefix, N, page_size=page_size, D=D, dtype=dtype)
    cache = one if layers is None else np.stack(
        [one] + [rng.standard_normal(one.shape).astype(dtype) for _ in range(layers - 1)])
    return tree, predict, cache, table, prefix


def expected(tree, predict, cache, table, prefix):
    want_accept = ref.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)
    want = cache.copy()
    for layer in (want if want.ndim == 4 else [want]):      # views: moved in place
        new_prefix = ref.commit_kv(layer, table, prefix, want_accept.accept_nodes,
                                   want_accept.accept_len)
    return want_accept, want, new_prefix


@pytest.mark.parametrize("seed, bs, N, layers, dtype, D, page_size", [
    (0, 3, 20, None, np.float32, 12, 4),
    (1, 4, 33, 3, np.float32, 12, 1),           # one slot a page: the window is N pages
    (2, 2, 12, 2, bfloat16, 12, 4),             # 24-byte rows: three uint64 words
    (3, 1, 1, 2, np.float16, 12, 4),
    (4, 5, 60, 1, np.float32, 12, 16),
    (5, 3, 40, 4, np.float32, 40, 8),           # 80 (layer, word) items: several blocks
    (6, 2, 30, 3, bfloat16, 13, 4),             # 26-byte rows: moved as uint16
    (7, 2, 25, 2, np.float32, 5, 4),            # 20-byte rows: moved as uint32
    (8, 2, 130, 2, np.float32, 12, 4),          # N > 3 x 32: the staging loop runs too
    ("chain", 2, 90, 2, np.float32, 12, 4),     # 44 overlapping moves: several plan passes
    ("chain", 2, 90, 2, np.float32, 12, 1),     # a window of 90 pages, past a 32-thread block
])
def test_equals_tree_accept_then_commit_kv(seed, bs, N, layers, dtype, D, page_size):
    tree, predict, cache, table, prefix = problem(seed, bs, N, layers, dtype,
                                                  page_size=page_size, D=D)
    want_accept, want_cache, want_prefix = expected(tree, predict, cache, table, prefix)
    got_cache = cache.copy()
    res, new_prefix = K.accept_commit(tree.token_ids, tree.next_token, tree.next_sibling,
                                      predict, got_cache, table, prefix)
    got = res.to_host()
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want_accept, field),
                                      err_msg=field)
    assert got_cache.tobytes() == want_cache.tobytes()     # every other row untouched
    np.testing.assert_array_equal(new_prefix.copy_to_host(), want_prefix)
    if N > 1:
        assert want_accept.accept_len.max() >= 1            # some rows really moved


def test_a_grid_too_small_for_the_items_strides_over_them(monkeypatch):
    """With two blocks a request where the items need three (as when ``MAX_PARTS`` caps the
    grid) a thread moves its first item with the AcceptResult rows between the reads and the
    writes, then strides over the rest by the grid's blocks: 44 moves (several chunks) of
    ``3 T`` (layer, word) items, ``T`` threads a block."""
    module = importlib.import_module("ddtree_numba.kernels.accept_commit")
    monkeypatch.setattr(module, "MAX_PARTS", 2)
    D = 2 * module.ACCEPT_COMMIT_THREADS            # 3 layers of D / 2 uint64 words: 3 T
    tree, predict, cache, table, prefix = problem("chain", 2, 90, 3, np.float32, D=D)
    want_accept, want_cache, want_prefix = expected(tree, predict, cache, table, prefix)
    got_cache = cache.copy()
    res, new_prefix = K.accept_commit(tree.token_ids, tree.next_token, tree.next_sibling,
                                      predict, got_cache, table, prefix)
    assert module.as_words(K.as_device(cache)).shape[3] * 3 == 3 * module.ACCEPT_COMMIT_THREADS
    got = res.to_host()
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), getattr(want_accept, field),
                                      err_msg=field)
    assert got_cache.tobytes() == want_cache.tobytes()
    np.testing.assert_array_equal(new_prefix.copy_to_host(), want_prefix)


def test_device_cache_in_place_and_out_buffers():
    tree, predict, cache, table, prefix = problem(5, 3, 25, 2, np.float32)
    want_accept, want_cache, want_prefix = expected(tree, predict, cache, table, prefix)
    device_cache = K.as_device(cache)
    out = (K.allocate_accept(3, 25), K.as_device(np.zeros(3, np.int32)))
    args = [K.as_device(a) for a in (tree.token_ids, tree.next_token, tree.next_sibling,
                                     predict)]
    res, new_prefix = K.accept_commit(*args, device_cache, K.as_device(table),
                                      K.as_device(prefix), out=out)
    assert res is out[0] and new_prefix is out[1]
    assert device_cache.copy_to_host().tobytes() == want_cache.tobytes()
    np.testing.assert_array_equal(new_prefix.copy_to_host(), want_prefix)


def test_new_lengths_may_not_be_written_over_prefix_lens():
    """Other blocks of a request still read ``prefix_lens[b]`` after its new length is
    written: ``out[1]`` must be a buffer of its own (as for ``commit_kv``)."""
    tree, predict, cache, table, prefix = problem(5, 3, 25, 2, np.float32)
    device_prefix = K.as_device(prefix)
    with pytest.raises(ValueError, match="out\\[1\\]: expected a buffer of its own"):
        K.accept_commit(tree.token_ids, tree.next_token, tree.next_sibling, predict,
                        K.as_device(cache), K.as_device(table), device_prefix,
                        out=(K.allocate_accept(3, 25), device_prefix))
    np.testing.assert_array_equal(device_prefix.copy_to_host(), prefix)


def test_unchecked_garbage_stays_in_bounds():
    """check=False with links, prefixes and pages outside their ranges: an answer, no crash,
    and a prefix that is no valid start commits nothing and keeps its length."""
    rng = np.random.default_rng(7)
    bs, N = 3, 9
    lists = [rng.integers(-3, N + 3, (bs, N)).astype(np.int32) for _ in range(4)]
    cache = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    table = rng.integers(-2, 6, (bs, 3)).astype(np.int32)
    prefix = np.array([-5, 2, 2**31 - 4], np.int32)
    res, new_prefix = K.accept_commit(*(K.as_device(a) for a in lists), K.as_device(cache),
                                      K.as_device(table), K.as_device(prefix), check=False)
    k = res.accept_len.copy_to_host()
    assert ((0 <= k) & (k <= N - 1)).all()
    np.testing.assert_array_equal(new_prefix.copy_to_host()[[0, 2]], prefix[[0, 2]])


def test_a_prefix_that_is_no_valid_start_commits_nothing():
    """check=False with ``P = -1`` on a path of 44 moves: the slots ``P + i`` of every move but
    the first are in range, yet no row moves (the cache unchanged byte for byte) and the
    length stays."""
    tree, predict, cache, table, _ = problem("chain", 2, 90, 2, np.float32)
    prefix = np.full(2, -1, np.int32)
    got = cache.copy()
    res, new_prefix = K.accept_commit(tree.token_ids, tree.next_token, tree.next_sibling,
                                      predict, got, table, prefix, check=False)
    np.testing.assert_array_equal(res.accept_len.copy_to_host(), [44, 44])
    assert got.tobytes() == cache.tobytes()
    np.testing.assert_array_equal(new_prefix.copy_to_host(), prefix)


@pytest.mark.parametrize("change, message", [
    ("prefix", r"prefix_lens"),
    ("table", r"block_table"),
    ("cache_dtype", r"kv_cache: expected float32"),
    ("cache_rank", r"kv_cache: expected"),
    ("link", r"next_token"),
])
def test_bad_input_is_refused_by_name_and_nothing_changes(change, message):
    tree, predict, cache, table, prefix = problem(6, 2, 10, 2, np.float32)
    next_token = tree.next_token.copy()
    if change == "prefix":
        prefix = np.array([-1, 0], np.int32)
    elif change == "table":
        table = table[:, :1].copy()
    elif change == "cache_dtype":
        cache = cache.astype(np.float64)
    elif change == "cache_rank":
        cache = cache[0, 0]
    elif change == "link":
        next_token[0, 0] = 77
    before = [a.copy() for a in (cache, table, prefix, next_token)]
    with pytest.raises((ValueError, TypeError), match=message):
        K.accept_commit(tree.token_ids, next_token, tree.next_sibling, predict, cache, table,
                        prefix)
    for a, b in zip((cache, table, prefix, next_token), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_moves_use_the_widest_word_a_row_allows():
    """uint64 when a row is whole 8-byte words of a contiguous, aligned cache; else the
    element's own bits."""
    import importlib

    words = importlib.import_module("ddtree_numba.kernels.accept_commit").as_words
    for shape, dtype, want in (((2, 3, 4, 576), np.float32, np.uint64),
                               ((2, 3, 4, 12), np.float16, np.uint64),
                               ((2, 3, 4, 13), np.float16, np.uint16),
                               ((2, 3, 4, 5), np.float32, np.uint32)):
        cache = K.as_device(np.zeros(shape, dtype))
        got = words(cache)
        assert got.dtype == want, (shape, dtype)
        assert got.shape[:3] == shape[:3]
        assert got.shape[3] * got.dtype.itemsize == shape[3] * np.dtype(dtype).itemsize
    strided = K.as_device(np.zeros((2, 3, 4, 16), np.float32))[:, :, :, :8]
    assert words(strided).dtype == np.uint32            # not contiguous: element by element

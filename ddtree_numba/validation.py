"""Argument checks shared by :mod:`ddtree_numba.reference` and :mod:`ddtree_numba.kernels`.

This is the one place where the buffer contract (the *Buffer contracts* page of the docs) is
enforced. Every public
function of both packages calls the ``check_<stage>`` function of its stage before it touches
anything, so a bad argument gets the same error from the numpy spec and from the GPU kernel:

* :class:`TypeError` for a wrong Python type or dtype,
* :class:`ValueError` for a wrong rank, shape or value,

and the message names the argument, what was expected and what came
(``top_token_ids: expected int32[bs=2, L=3, K=4], got int64[2, 3, 4]``). No check writes to
its inputs, so nothing the caller owns is modified when a check fails.

Shape and dtype checks work on numpy arrays and on device arrays (anything with
``__cuda_array_interface__``: numba, CuPy, torch) without copying them. Value checks (NaN,
sorted rows, ranges, tree structure) need the values: they run on numpy inputs, and on device
inputs only when the caller asks with ``check=True`` (which copies them to the host).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .arrays import (
    BFLOAT16,
    CACHE_DTYPES,
    FLOAT16,
    FLOAT32,
    INT32,
    UINT32,
    array_info,
    data_address,
    describe,
    dtype_name,
    host_values,
)
from .limits import GREEDY_TEMPERATURE, MAX_ELEMENTS, MAX_POSITION, ceil_words


def _expected(dtypes, dims) -> str:
    names = "|".join(dtype_name(d) for d in dtypes)
    return f"{names}[{', '.join(dims)}]"


def require_array(name: str, a, dtypes, dims, sizes: dict, *, contiguous: bool = True):
    """Check dtype, rank and named dimensions of ``a``; fill ``sizes`` with the named extents.

    ``dims`` names each axis (``("bs", "L", "K")``); an axis whose name is already in ``sizes``
    must match it, otherwise its extent is recorded. Returns the :class:`ArrayInfo`.
    """
    info = array_info(name, a)
    dtypes = tuple(np.dtype(d) for d in dtypes if d is not None)
    shown = [f"{d}={sizes[d]}" if d in sizes else d for d in dims]
    if info.dtype not in dtypes:
        raise TypeError(f"{name}: expected {_expected(dtypes, shown)}, got {describe(info)}")
    if len(info.shape) != len(dims):
        raise ValueError(
            f"{name}: expected rank {len(dims)} {_expected(dtypes, shown)}, got {describe(info)}"
        )
    for axis, (dim, extent) in enumerate(zip(dims, info.shape, strict=True)):
        if dim in sizes and sizes[dim] != extent:
            raise ValueError(
                f"{name}: expected {_expected(dtypes, shown)}, got {describe(info)} "
                f"(axis {axis} is {dim}={sizes[dim]} from an earlier argument)"
            )
        sizes.setdefault(dim, int(extent))
    if contiguous and not info.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strided {describe(info)}")
    return info


def require_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """Check that ``value`` is a Python or numpy integer in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


def require_cache_dtype(name: str, value) -> np.dtype:
    """The numpy dtype of a cache type named ``value`` (``arrays.CACHE_DTYPES``)."""
    if value not in CACHE_DTYPES:
        raise ValueError(f"{name}: expected one of {tuple(CACHE_DTYPES)}, got {value!r}")
    return CACHE_DTYPES[value]


def _values_wanted(infos, check) -> bool:
    """Value checks run on host inputs, and on device inputs when ``check`` is True."""
    if check is None:
        return not any(info.on_device for info in infos)
    return bool(check)


def _first_index(mask: np.ndarray) -> tuple:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _no_nan(name: str, values: np.ndarray):
    nan = np.isnan(values.astype(np.float32, copy=False))
    if nan.any():
        raise ValueError(f"{name}: NaN is not allowed, found one at index {_first_index(nan)}")


# --------------------------------------------------------------------------------------------
# One check per stage
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopKSizes:
    bs: int
    L: int
    V: int
    k: int


def check_draft_topk(logits, k, *, check=None) -> TopKSizes:
    """``logits`` float32|bfloat16 ``[bs, L, V]``, ``1 <= k <= V``; no NaN or +inf logits."""
    sizes: dict = {}
    info = require_array("logits", logits, (FLOAT32, BFLOAT16), ("bs", "L", "V"), sizes)
    if sizes["V"] < 1 or sizes["L"] < 1:
        raise ValueError(f"logits: expected L >= 1 and V >= 1, got {describe(info)}")
    k = require_int("k", k, low=1, high=sizes["V"])
    if _values_wanted([info], check):
        values = host_values(logits).astype(np.float32)
        _no_nan("logits", values)
        if np.isposinf(values).any():
            raise ValueError(f"logits: +inf is not allowed, found one at index "
                             f"{_first_index(np.isposinf(values))}")
    return TopKSizes(sizes["bs"], sizes["L"], sizes["V"], k)


@dataclass(frozen=True)
class TreeSizes:
    bs: int
    L: int
    K: int
    budget: int

    @property
    def N(self) -> int:
        return self.budget + 1

    @property
    def W(self) -> int:
        return ceil_words(self.N)


def check_prefix_not_negative(prefix_lens) -> np.ndarray:
    """Every ``P >= 0``; returns the values as int64."""
    p = host_values(prefix_lens).astype(np.int64)
    if (p < 0).any():
        b = int(np.flatnonzero(p < 0)[0])
        raise ValueError(f"prefix_lens: expected values >= 0, got {int(p[b])} in request {b}")
    return p


def check_prefix_range(prefix_lens, N: int):
    """``0 <= P`` and ``P + N <= MAX_POSITION`` for every request: tree positions
    ``P + depth`` and slots ``P + j`` (``j < N``) and the committed length ``P + k + 1`` are
    int32 on the device and must not wrap around."""
    p = check_prefix_not_negative(prefix_lens)
    over = p + N > MAX_POSITION
    if over.any():
        b = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"prefix_lens: expected P + N <= {MAX_POSITION} (positions and cache slots are "
            f"int32), got P={int(p[b])} + N={N} = {int(p[b]) + N} in request {b}"
        )


def check_prefix_lens(prefix_lens, sizes: dict, values: bool):
    """``prefix_lens`` int32 ``[bs]``; with ``values``, each ``P`` in ``[0, MAX_POSITION - N]``
    (``sizes["N"]``, the tree capacity, must be known)."""
    info = require_array("prefix_lens", prefix_lens, (INT32,), ("bs",), sizes)
    if values:
        check_prefix_range(prefix_lens, sizes["N"])
    return info


def check_build_tree(top_log_probs, top_token_ids, root_token_ids, budget, prefix_lens=None,
                     *, check=None) -> TreeSizes:
    """Inputs of ``build_tree``: see the buffer contract (docs: contracts) and
    :func:`ddtree_numba.reference.build_tree`.

    Value rules: log-probs are not NaN and ``<= 0`` (so a child never outscores its parent),
    each ``[b, d, :]`` row is non-increasing, token ids are ``>= 0`` and distinct within a row,
    prefix lengths are in ``[0, MAX_POSITION - N]`` (positions ``P + depth`` are int32).
    """
    sizes: dict = {}
    infos = [
        require_array("top_log_probs", top_log_probs, (FLOAT32,), ("bs", "L", "K"), sizes),
        require_array("top_token_ids", top_token_ids, (INT32,), ("bs", "L", "K"), sizes),
        require_array("root_token_ids", root_token_ids, (INT32,), ("bs",), sizes),
    ]
    if sizes["L"] < 1 or sizes["K"] < 1:
        raise ValueError(f"top_log_probs: expected L >= 1 and K >= 1, got {describe(infos[0])}")
    # N = budget + 1 positions 0..N-1 must be int32 even at P = 0 (the reference has no other
    # bound of its own; the kernels and the host add theirs)
    budget = require_int("budget", budget, low=0, high=MAX_POSITION - 1)
    if prefix_lens is not None:
        infos.append(require_array("prefix_lens", prefix_lens, (INT32,), ("bs",), sizes))
    if _values_wanted(infos, check):
        lp = host_values(top_log_probs)
        ids = host_values(top_token_ids)
        _no_nan("top_log_probs", lp)
        if (lp > 0).any():
            raise ValueError(
                "top_log_probs: log-probabilities must be <= 0, got "
                f"{float(lp.max())} at index {_first_index(lp > 0)}"
            )
        rising = lp[..., 1:] > lp[..., :-1]
        if rising.any():
            b, d, r = _first_index(rising)
            raise ValueError(
                f"top_log_probs: each [b, d, :] row must be sorted descending, row [{b}, {d}] "
                f"rises at rank {r + 1} ({lp[b, d, r]} < {lp[b, d, r + 1]})"
            )
        if (ids < 0).any():
            raise ValueError(f"top_token_ids: expected ids >= 0, got {int(ids.min())} at index "
                             f"{_first_index(ids < 0)}")
        ordered = np.sort(ids, axis=-1)
        repeated = ordered[..., 1:] == ordered[..., :-1]
        if repeated.any():
            b, d, _ = _first_index(repeated)
            raise ValueError(f"top_token_ids: ids must be distinct within a row, row [{b}, {d}] "
                             "repeats one")
        roots = host_values(root_token_ids)
        if (roots < 0).any():
            raise ValueError(f"root_token_ids: expected ids >= 0, got {int(roots.min())}")
        if prefix_lens is not None:
            check_prefix_range(prefix_lens, budget + 1)
    return TreeSizes(sizes["bs"], sizes["L"], sizes["K"], budget)


def check_host_tree_size(name: str, bs: int, N: int, got: str):
    """A host ``DraftTree`` of ``bs`` trees of capacity ``N`` fits the host: its largest buffer,
    the ``bool[bs, N, N]`` visibility mask, holds at most ``MAX_ELEMENTS`` elements (``bs``
    counted as at least 1, so the bound does not depend on an empty batch)."""
    elements = max(bs, 1) * N * N
    if elements > MAX_ELEMENTS:
        raise ValueError(
            f"{name}: expected a tree capacity N with bs * N * N <= {MAX_ELEMENTS} (the "
            f"bool[bs, N, N] visibility mask the reference allocates), got {got} with bs={bs}: "
            f"{elements} elements"
        )


def check_tree_from_parents(parents, token_ids, prefix_lens=None):
    """``parents`` int32 ``[bs, N]``: -1 at the root and padding, ``0 <= parents[i] < i``
    for every other node; nodes ``0..n-1`` valid, the rest padding. Returns ``num_nodes``."""
    sizes: dict = {}
    require_array("parents", parents, (INT32,), ("bs", "N"), sizes)
    require_array("token_ids", token_ids, (INT32,), ("bs", "N"), sizes)
    if sizes["N"] < 1:
        raise ValueError("parents: expected N >= 1 (node 0 is the root)")
    check_host_tree_size("parents", sizes["bs"], sizes["N"], f"N={sizes['N']}")
    if prefix_lens is not None:
        check_prefix_lens(prefix_lens, sizes, True)
    par = host_values(parents)
    tok = host_values(token_ids)
    num_nodes = np.empty(sizes["bs"], np.int32)
    index = np.arange(sizes["N"])
    for b in range(sizes["bs"]):
        if par[b, 0] != -1:
            raise ValueError(f"parents: row {b} is not a tree: the root (node 0) must have "
                             f"parent -1, got {par[b, 0]}")
        padding = np.flatnonzero(par[b, 1:] == -1) + 1
        n = int(padding[0]) if padding.size else sizes["N"]
        if (par[b, n:] != -1).any():
            raise ValueError(f"parents: row {b} is not a tree: node {n} has parent -1 but a "
                             "later node has a parent (padding must be contiguous at the end)")
        bad = (par[b, 1:n] < 0) | (par[b, 1:n] >= index[1:n])
        if bad.any():
            i = int(np.flatnonzero(bad)[0]) + 1
            raise ValueError(f"parents: row {b} is not a tree in topological order: expected "
                             f"0 <= parents[{i}] < {i}, got {par[b, i]}")
        if (tok[b, :n] < 0).any():
            raise ValueError(f"token_ids: row {b} has a negative id among its {n} nodes")
        num_nodes[b] = n
    return num_nodes


@dataclass(frozen=True)
class AttnSizes:
    bs: int
    N: int
    H: int
    Dc: int
    Dr: int
    num_pages: int
    page_size: int
    max_pages: int


def check_verify_attn(q_latent, q_rope, kv_cache, block_table, prefix_lens, visibility_bits,
                      num_nodes, sm_scale, *, check=None) -> AttnSizes:
    sizes: dict = {}
    infos = [
        require_array("q_latent", q_latent, (FLOAT32,), ("bs", "N", "H", "Dc"), sizes),
        require_array("q_rope", q_rope, (FLOAT32,), ("bs", "N", "H", "Dr"), sizes),
        require_array("kv_cache", kv_cache, (FLOAT32, BFLOAT16, FLOAT16),
                      ("num_pages", "page_size", "D"), sizes),
        require_array("block_table", block_table, (INT32,), ("bs", "max_pages"), sizes),
        require_array("prefix_lens", prefix_lens, (INT32,), ("bs",), sizes),
    ]
    sizes["W"] = ceil_words(sizes["N"])
    infos.append(require_array("visibility_bits", visibility_bits, (UINT32,),
                               ("bs", "N", "W"), sizes))
    infos.append(require_array("num_nodes", num_nodes, (INT32,), ("bs",), sizes))
    if sizes["D"] != sizes["Dc"] + sizes["Dr"]:
        raise ValueError(f"kv_cache: expected last axis Dc + Dr = {sizes['Dc'] + sizes['Dr']} "
                         f"(latent first, rope last), got {sizes['D']}")
    require_page_size(infos[2], sizes)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale: expected a float, got {type(sm_scale).__name__}")
    with np.errstate(over="ignore", under="ignore"):
        scale32 = np.float32(sm_scale)          # the kernels scale in float32
    if not (np.isfinite(scale32) and scale32 > 0):
        raise ValueError(f"sm_scale: expected a finite float > 0 that float32 holds (the "
                         f"kernels scale in float32), got {sm_scale}")
    if _values_wanted(infos, check):
        check_paged_slots(block_table, prefix_lens, sizes["N"], sizes["num_pages"],
                          sizes["page_size"])
        n = host_values(num_nodes)
        if ((n < 1) | (n > sizes["N"])).any():
            raise ValueError(f"num_nodes: expected values in [1, N={sizes['N']}], got "
                             f"{n.tolist()}")
        bits = host_values(visibility_bits)
        for b in range(sizes["bs"]):
            for i in range(int(n[b])):
                row = bits[b, i]
                if not (row[0] & 1) or not (row[i // 32] >> (i % 32)) & 1:
                    raise ValueError(f"visibility_bits: row [{b}, {i}] must show the root "
                                     "(bit 0) and the node itself (bit i)")
            cols = np.arange(sizes["W"] * 32) >= n[b]
            hidden = np.unpackbits(bits[b].view(np.uint8), axis=-1, bitorder="little")
            if (hidden[: n[b]][:, cols]).any():
                raise ValueError(f"visibility_bits: request {b} shows nodes >= num_nodes="
                                 f"{int(n[b])}")
    return AttnSizes(sizes["bs"], sizes["N"], sizes["H"], sizes["Dc"], sizes["Dr"],
                     sizes["num_pages"], sizes["page_size"], sizes["max_pages"])


def require_page_size(cache_info, sizes: dict):
    """A cache page holds at least one slot (slot ``t`` is at ``t // page_size``)."""
    if sizes["page_size"] < 1:
        raise ValueError(f"kv_cache: expected page_size >= 1 ([num_pages, page_size, D]), got "
                         f"{describe(cache_info)}")


def check_paged_slots(block_table, prefix_lens, N, num_pages, page_size):
    """Slots ``[0, P + N)`` of every request map to valid, distinct pages of the cache."""
    check_prefix_range(prefix_lens, N)
    table = host_values(block_table)
    prefix = host_values(prefix_lens)
    capacity = table.shape[1] * page_size
    used = []
    for b in range(table.shape[0]):
        need = int(prefix[b]) + N
        if need > capacity:
            raise ValueError(
                f"prefix_lens: request {b} needs slots [0, {need}) (prefix {int(prefix[b])} + "
                f"N={N} tree nodes) but block_table maps only {capacity} "
                f"({table.shape[1]} pages x {page_size})"
            )
        pages = table[b, : (need + page_size - 1) // page_size]
        if ((pages < 0) | (pages >= num_pages)).any():
            raise ValueError(f"block_table: request {b} uses a page outside [0, {num_pages}): "
                             f"{pages.tolist()}")
        used.append(pages)
    used = np.concatenate(used) if used else np.empty(0, np.int32)
    if np.unique(used).size != used.size:
        raise ValueError("block_table: a page is used twice among the slots in use "
                         "(requests must not share pages)")


@dataclass(frozen=True)
class AcceptSizes:
    bs: int
    N: int


def _require_tree_lists(lists, sizes: dict) -> list:
    """``int32[bs, N]`` for each ``(name, array)`` of ``lists`` (the tree's rows), ``N >= 1``
    (checked or not: every walk starts at node 0). Returns their infos."""
    infos = [require_array(name, a, (INT32,), ("bs", "N"), sizes) for name, a in lists]
    if sizes["N"] < 1:
        raise ValueError("token_ids: expected N >= 1 (node 0 is the root)")
    return infos


def _check_tree_links(next_token, next_sibling, N: int) -> None:
    """The value checks of first-child / next-sibling lists: links are -1 or node indices in
    ``(0, N)`` and no node is the target of two links (the lists form a tree)."""
    for name, links in (("next_token", next_token), ("next_sibling", next_sibling)):
        v = host_values(links)
        bad = (v < -1) | (v == 0) | (v >= N)
        if bad.any():
            raise ValueError(f"{name}: expected -1 or a node index in [1, N={N}), "
                             f"got {int(v[bad][0])} at index {_first_index(bad)}")
    # no node the target of two links: sorted, a row's links >= 0 have no equal neighbours
    both = np.sort(np.concatenate([host_values(next_token), host_values(next_sibling)],
                                  axis=1), axis=1)
    twice = ((both[:, 1:] == both[:, :-1]) & (both[:, 1:] >= 0)).any(axis=1)
    if twice.any():
        raise ValueError(f"next_token/next_sibling: request {int(np.argmax(twice))} links to "
                         "a node twice, so its lists are not a tree")


def check_tree_accept(token_ids, next_token, next_sibling, target_predict, *,
                      check=None) -> AcceptSizes:
    """Links are -1 or node indices in ``(0, N)``, no node is the target of two links, so the
    first-child / next-sibling lists seen from the root form a tree and every walk ends."""
    sizes: dict = {}
    infos = _require_tree_lists((("token_ids", token_ids), ("next_token", next_token),
                                 ("next_sibling", next_sibling),
                                 ("target_predict", target_predict)), sizes)
    if _values_wanted(infos, check):
        _check_tree_links(next_token, next_sibling, sizes["N"])
    return AcceptSizes(sizes["bs"], sizes["N"])


#: How far a row of ``target_probs`` may sum from 1 (float32 sums over a vocabulary of 10^5
#: values round by ~1e-5; a softmax computed in bf16 by ~1e-3).
PROB_SUM_TOL = 2e-3


def _require_sampled_tree(token_ids, next_token, next_sibling, uniforms, bonus_uniforms,
                          sizes: dict) -> list:
    """The array checks shared by :func:`check_tree_sample` and
    :func:`check_tree_sample_logits` (shapes into ``sizes``); returns their infos."""
    infos = _require_tree_lists((("token_ids", token_ids), ("next_token", next_token),
                                 ("next_sibling", next_sibling)), sizes)
    return infos + [require_array("uniforms", uniforms, (FLOAT32,), ("bs", "N"), sizes),
                    require_array("bonus_uniforms", bonus_uniforms, (FLOAT32,), ("bs",), sizes)]


def _check_sampled_tree_values(token_ids, next_token, next_sibling, uniforms, bonus_uniforms,
                               V: int) -> tuple:
    """The value checks of a tree to walk by sampling: a tree (as for ``tree_accept``),
    uniforms in ``[0, 1)``, token ids in ``[0, V)`` at the nodes the walk can reach and no token
    twice among siblings. Returns ``(nodes_of_tree, tree_of)``: the sorted nodes the walk can
    reach in each distinct tree of the batch (``int64`` arrays), and the tree of each request."""
    _, N = array_info("token_ids", token_ids).shape
    _check_tree_links(next_token, next_sibling, N)
    for name, u in (("uniforms", uniforms), ("bonus_uniforms", bonus_uniforms)):
        v = host_values(u)
        bad = ~((v >= 0) & (v < 1))
        if bad.any():
            raise ValueError(f"{name}: expected values in [0, 1), got {float(v[bad][0])} "
                             f"at index {_first_index(bad)}")
    tokens, first = host_values(token_ids), host_values(next_token)
    sibling = host_values(next_sibling)
    # A batch often repeats a tree (the same lists and tokens): each distinct tree is walked
    # once, in the order of its first request, so the first request that fails is reported.
    trees, first_request, tree_of = np.unique(np.concatenate([tokens, first, sibling], axis=1),
                                              axis=0, return_index=True, return_inverse=True)
    nodes_of_tree = [None] * len(trees)
    for t in np.argsort(first_request):
        b = int(first_request[t])
        stack, nodes = [0], []
        while stack:                            # the nodes the walk can reach from the root
            i = stack.pop()
            nodes.append(i)
            child = first[b, i]
            while child != -1:
                stack.append(int(child))
                child = sibling[b, child]
        for i in nodes[1:]:                     # the tokens the walk looks up
            if not 0 <= tokens[b, i] < V:
                raise ValueError(f"token_ids: expected ids in [0, V={V}) at the tree's nodes, "
                                 f"got {int(tokens[b, i])} at index ({b}, {i})")
        for i in nodes:                         # a token twice among siblings would count its
            child, seen = first[b, i], set()    # probability twice: not lossless
            while child != -1:
                if int(tokens[b, child]) in seen:
                    raise ValueError(f"token_ids: the children of node ({b}, {i}) repeat "
                                     f"token {int(tokens[b, child])}; sibling tokens must "
                                     f"differ")
                seen.add(int(tokens[b, child]))
                child = sibling[b, child]
        nodes_of_tree[t] = np.array(sorted(nodes))
    return nodes_of_tree, tree_of.reshape(-1)


#: Elements of ``target_probs`` a vectorised value check reads at once (a bound on its copy).
_CHECK_CHUNK = 1 << 22


def check_tree_sample(token_ids, next_token, next_sibling, target_probs, uniforms,
                      bonus_uniforms, *, check=None) -> AcceptSizes:
    """The tree lists as for ``tree_accept``; ``target_probs`` ``float32[bs, N, V]`` whose rows
    at the tree's nodes are probabilities (no NaN, none negative, sum 1 within
    :data:`PROB_SUM_TOL`); ``uniforms`` ``float32[bs, N]`` and ``bonus_uniforms`` ``float32[bs]``
    in ``[0, 1)``."""
    sizes: dict = {}
    infos = _require_sampled_tree(token_ids, next_token, next_sibling, uniforms, bonus_uniforms,
                                  sizes)
    infos.append(require_array("target_probs", target_probs, (FLOAT32,), ("bs", "N", "V"),
                               sizes))
    if sizes["V"] < 1:
        raise ValueError("target_probs: expected a vocabulary of at least 1 token")
    if not _values_wanted(infos, check):        # one decision for all six arrays
        return AcceptSizes(sizes["bs"], sizes["N"])
    nodes_of_tree, tree_of = _check_sampled_tree_values(token_ids, next_token, next_sibling,
                                                        uniforms, bonus_uniforms, sizes["V"])
    probs = host_values(target_probs)
    # the rows the walk can read, checked for all requests of one tree at once (in chunks);
    # the first request with a bad row is reported
    V = sizes["V"]
    first_bad = None
    order = np.argsort(tree_of, kind="stable")
    starts = np.searchsorted(tree_of[order], np.arange(len(nodes_of_tree) + 1))
    for t, nodes in enumerate(nodes_of_tree):
        requests = order[starts[t]:starts[t + 1]]
        step = max(1, _CHECK_CHUNK // (len(nodes) * V))
        for c in range(0, len(requests), step):
            chunk = requests[c:c + step]
            if len(chunk) == 1 and nodes[-1] == len(nodes) - 1:    # a view: nodes 0..n-1
                rows = probs[chunk[0]:chunk[0] + 1, :len(nodes)]
            else:
                rows = probs[chunk[:, None], nodes[None, :]]    # [requests, nodes, V]
            bad = ~(rows.min(-1) >= 0) | (np.abs(rows.sum(-1, dtype=np.float64) - 1)
                                          > PROB_SUM_TOL)
            if bad.any():
                b = int(chunk[bad.any(axis=1)].min())
                first_bad = b if first_bad is None else min(first_bad, b)
                break                           # (requests ascend within a tree)
    if first_bad is not None:
        b, nodes = first_bad, nodes_of_tree[tree_of[first_bad]]
        rows = probs[b][nodes]
        lowest = rows.min(-1)
        if not (lowest >= 0).all():             # negative or NaN
            node = int(np.argmax(~(lowest >= 0)))
            tok = int(np.argmax(~(rows[node] >= 0)))
            raise ValueError(f"target_probs: expected probabilities (>= 0, not NaN), got "
                             f"{float(rows[node, tok])} at index ({b}, {nodes[node]}, {tok})")
        sums = rows.sum(-1, dtype=np.float64)
        node = int(np.argmax(np.abs(sums - 1) > PROB_SUM_TOL))
        raise ValueError(f"target_probs: expected each tree node's row to sum to 1 "
                         f"(within {PROB_SUM_TOL}), got {sums[node]:.6g} at node "
                         f"({b}, {nodes[node]})")
    return AcceptSizes(sizes["bs"], sizes["N"])


def check_tree_sample_logits(token_ids, next_token, next_sibling, logits, temperature, top_k,
                             top_p, uniforms, bonus_uniforms, *, check=None) -> SamplingSizes:
    """The tree and uniforms as for :func:`check_tree_sample`; ``logits`` and the parameters
    as for :func:`check_sampling_probs`."""
    sizes: dict = {}
    infos = _require_sampled_tree(token_ids, next_token, next_sibling, uniforms, bonus_uniforms,
                                  sizes)
    infos.append(require_array("logits", logits, (FLOAT32,), ("bs", "N", "V"), sizes))
    wanted = _values_wanted(infos + [array_info("temperature", temperature)], check)
    sz = check_sampling_probs(logits, temperature, top_k, top_p, check=wanted)
    if wanted:
        _check_sampled_tree_values(token_ids, next_token, next_sibling, uniforms,
                                   bonus_uniforms, sz.V)
    return sz


def check_accept_commit(token_ids, next_token, next_sibling, target_predict, kv_cache,
                        block_table, prefix_lens, *, check=None) -> CommitSizes:
    """The tree lists as for :func:`check_tree_accept`; ``kv_cache`` one layer
    ``[num_pages, page_size, D]`` or all, ``[layers, num_pages, page_size, D]``;
    ``block_table`` and ``prefix_lens`` as for :func:`check_commit_kv`, with valid, distinct
    pages for the slots ``[0, P + N)`` of every request (the path is the walk's: a root path
    of the tree, so ``a_i >= i``)."""
    sizes: dict = {}
    infos = _require_tree_lists((("token_ids", token_ids), ("next_token", next_token),
                                 ("next_sibling", next_sibling),
                                 ("target_predict", target_predict)), sizes)
    infos += [require_array("kv_cache", kv_cache, (FLOAT32, BFLOAT16, FLOAT16),
                            kv_cache_dims(kv_cache), sizes),
              require_array("block_table", block_table, (INT32,), ("bs", "max_pages"), sizes),
              require_array("prefix_lens", prefix_lens, (INT32,), ("bs",), sizes)]
    require_page_size(infos[4], sizes)
    if _values_wanted(infos, check):
        _check_tree_links(next_token, next_sibling, sizes["N"])
        check_paged_slots(block_table, prefix_lens, sizes["N"], sizes["num_pages"],
                          sizes["page_size"])
    return CommitSizes(sizes["bs"], sizes["N"], sizes["num_pages"], sizes["page_size"],
                       sizes["D"])


@dataclass(frozen=True)
class UniformSizes:
    bs: int
    N: int
    seed: int


def check_sample_uniforms(seed, prefix_lens, N, *, check=None) -> UniformSizes:
    """``seed`` an int in ``[0, 2^64)``, ``prefix_lens`` ``int32[bs]`` (values ``>= 0`` when
    checked), ``N >= 1`` nodes."""
    seed = require_int("seed", seed, low=0, high=2**64 - 1)
    N = require_int("N", N, low=1, high=2**31 - 1)
    sizes: dict = {}
    info = require_array("prefix_lens", prefix_lens, (INT32,), ("bs",), sizes)
    if _values_wanted([info], check):
        check_prefix_not_negative(prefix_lens)  # (any int32 P is a position to key by)
    return UniformSizes(sizes["bs"], N, seed)


@dataclass(frozen=True)
class SamplingSizes:
    bs: int
    N: int
    V: int


def check_sampling_params(temperature, top_k, top_p, *, check=None) -> int:
    """Per request ``temperature`` ``float32[bs]`` (finite, ``>= 0``; below
    ``limits.GREEDY_TEMPERATURE`` greedy), ``top_k`` ``int32[bs]`` (``>= 0``; 0 keeps every
    token) and ``top_p`` ``float32[bs]`` in ``(0, 1]``; returns ``bs``."""
    sizes: dict = {}
    infos = [require_array("temperature", temperature, (FLOAT32,), ("bs",), sizes),
             require_array("top_k", top_k, (INT32,), ("bs",), sizes),
             require_array("top_p", top_p, (FLOAT32,), ("bs",), sizes)]
    if _values_wanted(infos, check):
        t, k, p = host_values(temperature), host_values(top_k), host_values(top_p)
        for name, values, bad, want in (
                ("temperature", t, ~(np.isfinite(t) & (t >= 0)), "finite, >= 0"),
                ("top_k", k, k < 0, ">= 0 (0: no top-k)"),
                ("top_p", p, ~((p > 0) & (p <= 1)), "in (0, 1]")):
            if bad.any():
                b = int(np.flatnonzero(bad)[0])
                raise ValueError(f"{name}: expected {want}, got {values[b]} in request {b}")
    return sizes["bs"]


def check_sampling_probs(logits, temperature, top_k, top_p, *, check=None) -> SamplingSizes:
    """``logits`` ``float32[bs, N, V]`` (finite or -inf, at least one finite value per row, and
    finite once divided by the request's temperature); the parameters as for
    :func:`check_sampling_params`."""
    sizes: dict = {}
    info = require_array("logits", logits, (FLOAT32,), ("bs", "N", "V"), sizes)
    if sizes["V"] < 1:
        raise ValueError("logits: expected a vocabulary of at least 1 token")
    wanted = _values_wanted([info, array_info("temperature", temperature)], check)
    bs = check_sampling_params(temperature, top_k, top_p, check=wanted)
    if bs != sizes["bs"]:
        raise ValueError(f"temperature: expected float32[bs={sizes['bs']}] (one per request "
                         f"of logits), got {bs} values")
    if wanted:
        values = host_values(logits)
        bad = np.isnan(values) | (values == np.inf)
        if bad.any():
            raise ValueError(f"logits: expected finite values or -inf, got "
                             f"{float(values[bad][0])} at index {_first_index(bad)}")
        empty = ~np.isfinite(values).any(-1)
        if empty.any():
            raise ValueError(f"logits: expected at least one finite value per row, row "
                             f"{_first_index(empty)} has none")
        t = host_values(temperature)
        for b in np.flatnonzero(t >= GREEDY_TEMPERATURE):
            finite = values[b][np.isfinite(values[b])]
            with np.errstate(over="ignore"):
                scaled = np.abs(finite).max() / np.float32(t[b])
            if not np.isfinite(scaled):
                raise ValueError(f"temperature: {float(t[b]):.6g} in request {int(b)} makes "
                                 f"its logits overflow float32 (largest |logit| "
                                 f"{float(np.abs(finite).max()):.6g})")
    return SamplingSizes(sizes["bs"], sizes["N"], sizes["V"])


@dataclass(frozen=True)
class CommitSizes:
    bs: int
    N: int
    num_pages: int
    page_size: int
    D: int


#: CUDA's limit on a grid's z extent: ``commit_kv`` launches one z-block per layer of a stack
MAX_STACKED_LAYERS = 65535


def kv_cache_dims(kv_cache) -> tuple:
    """The axis names of a cache that commits accept: one layer ``[num_pages, page_size, D]``,
    or all layers stacked, ``[layers, num_pages, page_size, D]`` (at most
    ``MAX_STACKED_LAYERS``); any other rank is refused, naming ``kv_cache``."""
    info = array_info("kv_cache", kv_cache)
    dims = ("num_pages", "page_size", "D")
    if len(info.shape) == 4:
        if info.shape[0] > MAX_STACKED_LAYERS:
            raise ValueError(f"kv_cache: expected at most {MAX_STACKED_LAYERS} stacked layers, "
                             f"got {describe(info)}")
        return ("layers", *dims)
    if len(info.shape) != 3:
        raise ValueError(f"kv_cache: expected rank 3 [num_pages, page_size, D] or rank 4 "
                         f"[layers, num_pages, page_size, D], got {describe(info)}")
    return dims


def require_buffer(name: str, a, dtype, shape, made_by: str, *, contiguous: bool = False):
    """An output or scratch buffer a kernel writes without bounds checks: ``a`` must be
    ``dtype`` of exactly ``shape`` (a smaller one would be written out of bounds), and with
    ``contiguous`` C-contiguous (a launcher that views it flat), else a ``ValueError`` naming
    it and what makes the right one (``made_by``)."""
    info = array_info(name, a)
    if info.shape != tuple(shape) or info.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected {np.dtype(dtype).name}{list(shape)} ({made_by}), "
                         f"got {describe(info)}")
    if contiguous and not info.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous buffer ({made_by}), got strided "
                         f"{describe(info)}")


def require_new_lengths(name: str, out, prefix_lens, bs: int):
    """``out``, where a commit writes each request's new length: ``int32[bs]`` and a buffer
    of its own. Not ``prefix_lens`` itself: other blocks of the request still read
    ``prefix_lens[b]`` after the thread that writes the new length is done."""
    require_array(name, out, (np.int32,), ("bs",), {"bs": bs})
    if data_address(out) == data_address(prefix_lens):
        raise ValueError(f"{name}: expected a buffer of its own, got prefix_lens itself")
    return out


def check_commit_kv(kv_cache, block_table, prefix_lens, accept_nodes, accept_len, *,
                    check=None) -> CommitSizes:
    """``kv_cache`` one layer or all (:func:`kv_cache_dims`). The accepted path starts at the
    root, strictly increases (so ``a_i >= i``: the moves cannot overwrite a row still to be
    read), and ends after ``accept_len`` nodes."""
    sizes: dict = {}
    infos = [
        require_array("kv_cache", kv_cache, (FLOAT32, BFLOAT16, FLOAT16),
                      kv_cache_dims(kv_cache), sizes),
        require_array("block_table", block_table, (INT32,), ("bs", "max_pages"), sizes),
        require_array("prefix_lens", prefix_lens, (INT32,), ("bs",), sizes),
        require_array("accept_nodes", accept_nodes, (INT32,), ("bs", "N"), sizes),
        require_array("accept_len", accept_len, (INT32,), ("bs",), sizes),
    ]
    require_page_size(infos[0], sizes)
    if sizes["N"] < 1:
        raise ValueError(f"accept_nodes: expected N >= 1 (the path starts at the root), got "
                         f"{describe(infos[3])}")
    if _values_wanted(infos, check):
        n = sizes["N"]
        check_paged_slots(block_table, prefix_lens, n, sizes["num_pages"], sizes["page_size"])
        k = host_values(accept_len)
        path = host_values(accept_nodes)
        if ((k < 0) | (k > n - 1)).any():
            raise ValueError(f"accept_len: expected values in [0, N-1={n - 1}], got {k.tolist()}")
        for b in range(sizes["bs"]):
            nodes = path[b, : k[b] + 1]
            if nodes[0] != 0 or (np.diff(nodes) <= 0).any() or nodes[-1] >= n:
                raise ValueError(f"accept_nodes: row {b} is not a root path of the tree: expected "
                                 f"0 = a_0 < a_1 < ... < a_k < N, got {nodes.tolist()}")
    return CommitSizes(sizes["bs"], sizes["N"], sizes["num_pages"], sizes["page_size"],
                       sizes["D"])

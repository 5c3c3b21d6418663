"""``GreedyStep``: one greedy DDTree step entirely on the device, eager or as one CUDA graph.

One call runs, for every request of the batch, with no host synchronisation::

    drafter.draft(root, prefix_lens)            -> draft logits      [bs, L, V]
    kernels.draft_topk                          -> top log-probs, ids [bs, L, K]
    kernels.build_tree                          -> DraftTree          [bs, N]
    target.forward(tree, block_table, prefix)   -> target logits     [bs * N, V]
                                                   (and each node's cache row at slot P + j)
    argmax                                      -> target_predict     [bs, N]
    kernels.accept_commit                       -> AcceptResult, and the accepted rows of
                                                   every layer moved to P + 1 .. P + k
    advance                                     -> emitted tokens appended; prefix_lens and
                                                   root updated for the next step

Every buffer is allocated once, in the constructor, so the same launches can be captured into a
CUDA graph (``mode="graph"``: CuPy stream capture of numba's launches on
``cuda.external_stream``) and replayed each step for a few microseconds of host time. The
state that changes from step to step (``root_token_ids``, ``prefix_lens``, the cache, the
emitted tokens) lives in those same buffers and is updated in place by the last launch, so the
graph's arguments never change.

``accept_commit`` is one launch when the target keeps its layers' caches in one
``[layers, num_pages, page_size, D]`` array (``target.kv_cache``, whose layers are exactly what
``kv_caches()`` returns, as in the toy and DeepSeek-V3 targets); for any other target the step
runs its two halves, ``kernels.tree_accept`` then ``kernels.commit_kv`` once per layer cache.

The drafter and the target are any objects with the :class:`~ddtree_numba.interfaces.Drafter`
and :class:`~ddtree_numba.interfaces.Target` interfaces, the same that
:func:`ddtree_numba.reference.greedy_step` runs (the toy ones are in :mod:`ddtree_numba.models`).
The step imports no model.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .. import kernels
from ..arrays import array_info, data_address
from ..interfaces import Drafter, Target
from ..limits import (
    MAX_BATCH,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_K,
    MAX_NODES,
    MAX_PAGE_SIZE,
    MAX_POSITION,
)
from ..paging import shuffled_block_table
from ..validation import require_int
from .ops import default_step_ops

MODES = ("eager", "graph")


class GreedyStep:
    """Static buffers and launches of greedy DDTree steps for a fixed batch.

    Parameters
    ----------
    target : Target
        The model (device arrays), e.g.
        :class:`~ddtree_numba.models.toy_mla_device.DeviceToyMLA`.
    drafter : Drafter
        The block drafter (device arrays), e.g.
        :class:`~ddtree_numba.models.toy_drafter.ToyDrafter`.
    bs, L, K, budget : int
        Requests, draft depth, tokens kept per depth, draft nodes per tree (``N = budget + 1``).
    max_steps : int
        Steps the cache and token buffers hold after each :meth:`start`: every request gets
        ``max_steps * (min(L, budget) + 1) + N`` cache slots.
    page_size : int
        Cache page size (block table built here, pages shuffled as an allocator would).
    mode : str
        ``"eager"`` (launch every kernel each step) or ``"graph"`` (capture once, replay;
        needs a GPU and CuPy).
    ops : object, optional
        The argmax / advance backend (``ddtree_numba.step.ops``); by default the kernels on
        a GPU and their numpy twins on the simulator.
    seed : int
        Seeds the page shuffle.
    """

    def __init__(self, target: Target, drafter: Drafter, *, bs: int, L: int, K: int, budget: int,
                 max_steps: int, page_size: int = 16, mode: str = "eager", ops=None,
                 seed: int = 0):
        for name, value, kind in (("target", target, Target), ("drafter", drafter, Drafter)):
            if not isinstance(value, kind):         # runtime_checkable: has the members
                raise TypeError(f"{name}: expected a {kind.__name__} (ddtree_numba.interfaces), "
                                f"got {type(value).__name__}")
        seed = require_int("seed", seed, low=0)
        self.bs, self.L, self.K, self.budget, self.max_steps = check_step_sizes(
            bs=bs, L=L, K=K, budget=budget, max_steps=max_steps, vocab=target.vocab)
        page_size = require_int("page_size", page_size, low=1, high=MAX_PAGE_SIZE)
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if mode == "graph" and kernels.SIMULATOR:
            raise ValueError("mode: 'graph' needs a GPU (CUDA graphs do not exist on numba's "
                             "CUDA simulator); use 'eager'")
        if drafter.vocab != target.vocab:
            raise ValueError(f"drafter.vocab: expected the target's vocabulary "
                             f"{target.vocab}, got {drafter.vocab}")
        self.mode, self.target, self.drafter = mode, target, drafter
        self.ops = ops if ops is not None else default_step_ops()
        self.N = N = self.budget + 1
        self.tokens_per_step = min(self.L, self.budget) + 1        # at most k + 1 per step
        capacity = self.max_steps * self.tokens_per_step
        # every request's slots [0, capacity + N) are int32 positions, and the host allocates
        # bs of them (block table, emitted tokens): refuse sizes that cannot be held
        slots = capacity + N + page_size
        if slots > MAX_POSITION or self.bs * slots > MAX_ELEMENTS:
            raise ValueError(f"max_steps: {self.max_steps} steps of up to "
                             f"{self.tokens_per_step} tokens need {slots} cache slots per "
                             f"request x bs={self.bs}; at most {MAX_POSITION} per request and "
                             f"{MAX_ELEMENTS} in all fit (int32 positions, host memory)")

        rng = np.random.default_rng(seed)
        table, num_pages = shuffled_block_table(rng, [capacity] * self.bs, N, page_size)
        self.block_table = cuda.to_device(table)
        drafter.allocate(bs=self.bs, L=self.L)
        target.allocate(bs=self.bs, N=N, num_pages=num_pages, page_size=page_size,
                        max_pages=table.shape[1])

        self.stacked_kv_cache = stacked_kv_cache(target)

        def zeros(*shape, dtype=np.int32):
            return cuda.to_device(np.zeros(shape, dtype))

        # state carried from step to step (updated in place by the last launch)
        self.root_token_ids, self.prefix_lens = zeros(self.bs), zeros(self.bs)
        self.emitted, self.emitted_count = zeros(self.bs, capacity), zeros(self.bs)
        # per-step outputs, overwritten every step
        self.top_log_probs = zeros(self.bs, self.L, self.K, dtype=np.float32)
        self.top_token_ids = zeros(self.bs, self.L, self.K)
        self.topk_scratch = kernels.allocate_topk_scratch(self.bs, self.L, target.vocab, self.K)
        self.tree = kernels.allocate_tree(self.bs, N)
        self.tree_scratch = zeros(self.bs, N)
        self.target_predict = zeros(self.bs, N)
        self.accept = kernels.allocate_accept(self.bs, N)
        self.new_prefix_lens = zeros(self.bs)
        self.steps_done = 0
        self.draft_logits = None
        self._started = False
        self._stream = self._graph = None

    # -- the step -------------------------------------------------------------------------
    def stages(self) -> list:
        """``(name, launch)`` for each stage of a step, in order (benchmarks time them one by
        one); each launch goes to the current stream and does not synchronise."""
        if self.stacked_kv_cache is not None:      # the target's layers in one array
            accept = [("accept_commit", self._accept_commit)]
        else:
            accept = [("tree_accept", self._tree_accept), ("commit_kv", self._commit_kv)]
        return [("drafter", self._draft), ("draft_topk", self._top_k),
                ("build_tree", self._build_tree), ("target_forward", self._target_forward),
                ("argmax", self._argmax), *accept, ("advance", self._advance)]

    def _launch(self) -> None:
        """Every launch of one step, in order, on the current stream; no synchronisation."""
        for _, launch in self.stages():
            launch()

    def _draft(self):
        self.draft_logits = self.drafter.draft(self.root_token_ids, self.prefix_lens)

    def _top_k(self):
        kernels.draft_topk(self.draft_logits, self.K, scratch=self.topk_scratch,
                           out=(self.top_log_probs, self.top_token_ids))

    def _build_tree(self):
        kernels.build_tree(self.top_log_probs, self.top_token_ids, self.root_token_ids,
                           self.budget, prefix_lens=self.prefix_lens, out=self.tree,
                           scratch=self.tree_scratch)

    def _target_forward(self):
        self.target_logits = self.target.forward(self.tree, self.block_table, self.prefix_lens)

    def _argmax(self):
        self.ops.argmax(self.target_logits, self.tree.num_nodes, self.target_predict)

    def _tree_accept(self):
        kernels.tree_accept(self.tree.token_ids, self.tree.next_token, self.tree.next_sibling,
                            self.target_predict, out=self.accept)

    def _commit_kv(self):
        # a stacked cache commits every layer in one launch (the sampled step, whose walk is
        # its own kernel, commits this way), other targets' caches one launch each
        stack = self.stacked_kv_cache
        for cache in self.target.kv_caches() if stack is None else [stack]:
            kernels.commit_kv(cache, self.block_table, self.prefix_lens,
                              self.accept.accept_nodes, self.accept.accept_len,
                              out=self.new_prefix_lens)

    def _accept_commit(self):
        kernels.accept_commit(self.tree.token_ids, self.tree.next_token, self.tree.next_sibling,
                              self.target_predict, self.stacked_kv_cache, self.block_table,
                              self.prefix_lens, check=False,
                              out=(self.accept, self.new_prefix_lens))

    def _advance(self):
        self.ops.advance(self.accept, self.new_prefix_lens, self.prefix_lens,
                         self.root_token_ids, self.emitted, self.emitted_count)

    def start(self, root_token_ids) -> None:
        """Begin decoding: each request's last token (``int32[bs]``) at position 0, empty
        prefix. In graph mode the first call also compiles (one eager step, whose rows past
        the prefix are never read) and captures the graph."""
        roots = np.asarray(root_token_ids)
        if roots.shape != (self.bs,) or not np.issubdtype(roots.dtype, np.integer):
            raise ValueError(f"root_token_ids: expected int[{self.bs}], got "
                             f"{roots.dtype}{list(roots.shape)}")
        if roots.min() < 0 or roots.max() >= self.target.vocab:
            raise ValueError(f"root_token_ids: expected ids in [0, {self.target.vocab}), got "
                             f"[{roots.min()}, {roots.max()}]")
        if self.mode == "graph" and self._graph is None:
            self._reset(roots)
            self._capture()
        self._reset(roots)

    def _reset(self, roots) -> None:
        self.root_token_ids.copy_to_device(roots.astype(np.int32))
        self.prefix_lens.copy_to_device(np.zeros(self.bs, np.int32))
        self.emitted_count.copy_to_device(np.zeros(self.bs, np.int32))
        self.steps_done = 0
        self._started = True

    def _capture(self) -> None:
        import cupy as cp

        self._stream = cp.cuda.Stream(non_blocking=True)
        with kernels.use_stream(self._stream):
            self._launch()                  # compile and load every kernel before capture
        self._stream.synchronize()
        self._stream.begin_capture()
        try:
            with kernels.use_stream(self._stream):
                self._launch()
        finally:
            self._graph = self._stream.end_capture()

    def __call__(self) -> None:
        """Run one step (asynchronously: read results with :meth:`tokens` etc.)."""
        if not self._started:
            raise RuntimeError("call start() before the first step")
        if self.steps_done >= self.max_steps:
            raise RuntimeError(f"max_steps: this GreedyStep holds {self.max_steps} steps after "
                               f"start(); call start() again or build it with more")
        if self.mode == "graph":
            self._graph.launch(self._stream)
        else:
            self._launch()
        self.steps_done += 1

    # -- reading results (these synchronise) ------------------------------------------------
    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        cuda.synchronize()

    def tokens(self) -> list:
        """The tokens emitted so far, one list per request."""
        self.synchronize()
        count, emitted = self.emitted_count.copy_to_host(), self.emitted.copy_to_host()
        return [emitted[b, : count[b]].tolist() for b in range(self.bs)]

    def last_step(self) -> dict:
        """Host copies of the last step's tree, predictions and accepted path.

        Raises ``RuntimeError`` before the first step after :meth:`start` (the buffers hold
        nothing yet)."""
        if self.steps_done == 0:                   # start() resets it: nothing written yet
            raise RuntimeError("last_step: no step has run since start(); call step() first")
        self.synchronize()
        return {"tree": self.tree.to_host(), "target_predict": self.target_predict.copy_to_host(),
                "accept": self.accept.to_host(), "draft_logits": self.draft_logits.copy_to_host(),
                "prefix_lens": self.prefix_lens.copy_to_host()}


def check_step_sizes(*, bs, L, K, budget, max_steps, vocab: int,
                     names=("bs", "L", "K", "budget", "max_steps")) -> tuple:
    """``(bs, L, K, budget, max_steps)`` within the kernels' limits, else a ``ValueError``
    naming the size (by ``names``, the caller's words for them): checked before anything is
    allocated or computed (the demo checks its sizes with this too, before it decodes the
    expected output)."""
    limits = ((bs, 1, MAX_BATCH), (L, 1, MAX_DEPTH), (K, 1, min(MAX_K, vocab)),
              (budget, 0, MAX_NODES - 1), (max_steps, 1, None))
    return tuple(require_int(name, value, low=low, high=high)
                 for name, (value, low, high) in zip(names, limits, strict=True))


def stacked_kv_cache(target: Target):
    """``target.kv_cache`` when it is one C-contiguous ``[layers, num_pages, page_size, D]``
    array whose layers are exactly the caches that ``target.kv_caches()`` returns (same order,
    shapes, strides and memory), else ``None``; a single cache is its own stack. With a stack
    the step commits every layer in one launch (``accept_commit``, or ``commit_kv`` in the
    sampled step)."""
    layers = list(target.kv_caches())
    if len(layers) == 1 and getattr(layers[0], "ndim", 0) == 3:
        return layers[0]
    stack = getattr(target, "kv_cache", None)
    if stack is None or getattr(stack, "ndim", 0) != 4 or stack.shape[0] != len(layers):
        return None
    if not array_info("kv_cache", stack).c_contiguous:   # the stacked launches need one block
        return None
    base = data_address(stack)
    for i, layer in enumerate(layers):
        if (layer.shape != stack.shape[1:] or layer.dtype != stack.dtype
                or layer.strides != stack.strides[1:]
                or data_address(layer) != base + i * stack.strides[0]):
            return None
    return stack

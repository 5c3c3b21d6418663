"""Every size limit of the library, in one place, with the reason for each.

The kernels keep per-request state in static shared memory and in fixed-size local arrays
(numba has no dynamic shapes there), so a few sizes have hard upper bounds. The launchers, the
references where a bound protects the host (memory), :class:`~ddtree_numba.GreedyStep` and the
command line all check against the constants below, so a size that cannot run is refused with a
``ValueError`` naming the argument before anything is allocated or launched.
"""

from __future__ import annotations


def ceil_words(n: int) -> int:
    """``W = ceil(n / 32)``: uint32 words of a visibility row over ``n`` nodes (the one place
    this formula is written)."""
    return (n + 31) // 32


#: Largest node capacity ``N = budget + 1`` of a draft tree on the GPU: the tree builder's
#: warp keeps 33 nodes per lane in shared memory (32 x 33 = 1056).
MAX_NODES = 1056
#: Largest draft budget (draft nodes per tree, the root excluded).
MAX_BUDGET = MAX_NODES - 1
#: Largest bit-mask width ``W = ceil(N / 32)`` (uint32 words per visibility row).
MAX_WORDS = ceil_words(MAX_NODES)
#: Largest draft depth ``L``: tree depths are stored as int16 in the builder, and no block
#: drafter drafts more than 64 positions.
MAX_DEPTH = 64
#: Largest ``K`` of ``draft_topk``: the block-wide bitonic sort of the candidates in shared
#: memory holds at most this many winners.
MAX_K = 1024
#: Largest latent width ``Dc`` of ``verify_attn``'s tiled kernel: one staged latent sub-tile
#: is ``8 x Dc`` float32 in shared memory (DeepSeek-V3 / Kimi-K2: 512).
MAX_DC = 512
#: Largest batch: kernels put the request index on a grid's y or z axis (at most 65535 blocks).
MAX_BATCH = 65535
#: Largest cache page size the step allocates (FlashMLA uses 64; 4096 is far past any engine's).
MAX_PAGE_SIZE = 4096
#: Positions and cache slots are int32 on the device: ``prefix_lens + N`` must stay below this.
MAX_POSITION = 2**31 - 1
#: Largest number of elements the host side will allocate for one buffer in a reference or in
#: :class:`~ddtree_numba.GreedyStep` (2**31: 8 GiB of float32). Larger asks are refused with a
#: ``ValueError`` naming the argument instead of a ``MemoryError`` deep inside numpy.
MAX_ELEMENTS = 2**31

#: Largest vocabulary of ``tree_sample`` on the GPU: its block keeps one float32 sum per chunk
#: of 64 tokens in static shared memory (4096 x 4 bytes); Kimi-K2 has 163 840 tokens,
#: DeepSeek-V3 129 280.
MAX_VOCAB = 4096 * 64

#: Temperatures below this sample greedily (as vLLM's ``_SAMPLING_EPS``): logits divided by a
#: tinier temperature overflow float32, and the distribution is a one-hot at float32 precision
#: long before that.
GREEDY_TEMPERATURE = 1e-5

"""Reference ``sample_uniforms``: the uniforms of a sampled step, from a counter-based generator.

Sampled verification (:func:`~ddtree_numba.reference.tree_sample`) needs one uniform per tree
node and one per request for the bonus token. They come from Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; the generator of cuRAND's
``curand_Philox4x32_10`` and of PyTorch's CUDA sampling), a pure function of a 128-bit counter
and a 64-bit key: no state, so any thread can compute any uniform, eager and graph replays
draw the same numbers, and nothing goes back to the host.

Keys and counters (one Philox call per uniform, the first of its four output words)::

    key     = (seed & 0xFFFFFFFF, seed >> 32)
    counter = (node, request, position, STREAM_NODE)      node uniforms, node in [0, N)
    counter = (0,    request, position, STREAM_BONUS)     the bonus uniform of the request
    u       = (word >> 8) * 2**-24                         exact in float32, in [0, 1)

``position`` is the request's prefix length when the step starts (``prefix_lens[b]``): it
grows every step, so no (request, step) pair reuses a counter, and it lives on the device, so a
captured CUDA graph draws fresh uniforms on every replay. A run is reproducible from
``(seed, prompts)``; two requests never share uniforms.

Philox4x32-10: ten rounds, each ``(c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2),
hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))`` with 64-bit products, the key bumped by the Weyl constants
``(W0, W1)`` between rounds. The known-answer vectors of Random123's ``kat_vectors`` are
checked in ``tests/test_sample_uniforms.py``.
"""

from __future__ import annotations

import numpy as np

from ..validation import check_sample_uniforms

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57       # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85       # key increments (golden ratio, sqrt 3 - 1)
PHILOX_ROUNDS = 10
STREAM_NODE, STREAM_BONUS = 0x0DD7EE00, 0x0DD7EE01  # counter word 3: which kind of uniform
_MASK = np.uint64(0xFFFFFFFF)
_U64 = {name: np.uint64(value) for name, value in (("M0", PHILOX_M0), ("M1", PHILOX_M1),
                                                    ("W0", PHILOX_W0), ("W1", PHILOX_W1))}


def philox4x32(counter, key) -> np.ndarray:
    """Philox4x32-10 of ``counter`` (``uint32[..., 4]``) under ``key`` (``uint32[..., 2]``,
    broadcast): ``uint32[..., 4]``."""
    c = [np.asarray(counter, np.uint64)[..., i] for i in range(4)]
    k0, k1 = (np.asarray(key, np.uint64)[..., i] for i in range(2))
    for r in range(PHILOX_ROUNDS):
        if r:                                   # the key schedule: bumped between rounds
            k0, k1 = (k0 + _U64["W0"]) & _MASK, (k1 + _U64["W1"]) & _MASK
        p0, p1 = _U64["M0"] * c[0], _U64["M1"] * c[2]   # (uint64 constants: numpy 1.x
        #                                                   would promote a Python int to float)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _MASK,
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _MASK]
    return np.stack(c, -1).astype(np.uint32)


def uniform_from_bits(word) -> np.ndarray:
    """The float32 uniform in ``[0, 1)`` of a 32-bit word: its top 24 bits times ``2^-24``
    (every value exact in float32, 1 never reached)."""
    return ((np.asarray(word, np.uint32) >> np.uint32(8)).astype(np.float32)
            * np.float32(2.0**-24))


def sample_uniforms(seed, prefix_lens, N: int) -> tuple:
    """The uniforms of one sampled step.

    Parameters
    ----------
    seed : int
        In ``[0, 2^64)``: the run's key.
    prefix_lens : numpy.ndarray
        ``int32[bs]``: each request's prefix length at the start of the step (its position).
    N : int
        Tree nodes per request.

    Returns
    -------
    tuple
        Two numpy arrays, ``float32[bs, N]`` (node ``i``'s uniform decides which child of
        ``i`` is accepted) and ``float32[bs]`` (the bonus token's), both in ``[0, 1)``.
    """
    sz = check_sample_uniforms(seed, prefix_lens, N, check=True)
    key = np.array([sz.seed & 0xFFFFFFFF, sz.seed >> 32], np.uint32)
    b = np.arange(sz.bs, dtype=np.uint32)
    position = np.asarray(prefix_lens).astype(np.uint32)
    node = np.arange(sz.N, dtype=np.uint32)
    counters = np.stack(np.broadcast_arrays(node[None, :], b[:, None], position[:, None],
                                            np.uint32(STREAM_NODE)), -1)
    bonus = np.stack(np.broadcast_arrays(np.uint32(0), b, position, np.uint32(STREAM_BONUS)),
                     -1)
    return (uniform_from_bits(philox4x32(counters, key)[..., 0]),
            uniform_from_bits(philox4x32(bonus, key)[..., 0]))

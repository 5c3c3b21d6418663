"""The toy block drafter: a noisy view of the target's own greedy continuation.

:class:`ToyDrafter` stands in for a trained block drafter (DDTree's block-diffusion drafter):
it is given the target's plain greedy continuation of each request and produces, for the ``L``
positions after the root, logits that put a bonus on the right token with probability
``accuracy`` (else on a wrong guess, with a smaller bonus on the right one) plus noise. It is a
knob for how often the drafter agrees with the target, not a model.

The logits are a pure function of ``(seed, request, position, token)`` through a 32-bit hash,
computed by a numba.cuda kernel (:class:`KernelDraftOps`) or its numpy twin
(:class:`HostDraftOps`, bit for bit the same logits), so a run is reproducible on any device.
:class:`FixedDrafter` replays given logits (the reference step and the tests use it).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint64

from ..arrays import host_view
from ..kernels._device import CACHE_KERNELS, SIMULATOR, as_device, launch, launch_stream
from ..kernels._primitives import mul_rn

# CHUNK: columns of one (request, draft position) row a block writes. A row is a vocabulary
# wide, and one block per row left all but bs L SMs idle (8 blocks took about 140 us for 8 rows
# of 163 840 on the H200). The simulator's tests have tiny vocabularies: small chunks there, so
# that they cover several chunks and a partial last one, and as many threads (one Python thread
# each) as a chunk has columns.
CHUNK = 16 if SIMULATOR else 4096
ROW_THREADS = 16 if SIMULATOR else 128      # threads per block

MASK32 = 0xFFFFFFFF
SQRT3 = 1.7320508075688772
RUNNER_UP = 0.7       # the true token's share of the bonus when the drafter's guess is wrong


@cuda.jit(device=True, inline="always")
def _mix(h):
    """murmur3's 32-bit finaliser (on a uint64 holding 32 bits): a well-mixed hash."""
    h ^= h >> uint64(16)
    h = (h * uint64(0x85EBCA6B)) & uint64(MASK32)
    h ^= h >> uint64(13)
    h = (h * uint64(0xC2B2AE35)) & uint64(MASK32)
    h ^= h >> uint64(16)
    return h


@cuda.jit(device=True, inline="always")
def _hash(seed, b, position, lane):
    """A 32-bit hash of ``(seed, request, position, lane)``: the drafter's random source."""
    return _mix(_mix(_mix(_mix(uint64(seed)) ^ uint64(b)) ^ uint64(position)) ^ uint64(lane))


@cuda.jit(device=True, inline="always")
def _unit(h):
    """A float32 in [0, 1) from the top 24 bits of a hash (exact)."""
    return float32(h >> uint64(8)) * float32(1.0 / 16777216.0)


@cuda.jit(cache=CACHE_KERNELS)
def _draft_kernel(continuation, prefix_lens, seed, accuracy, confidence, noise_scale, logits):
    """Toy block-drafter logits: a noisy view of the target's own greedy continuation.

    Block ``(d, b, c)`` writes ``logits[b, d, c CHUNK : (c + 1) CHUNK]`` for the token at
    position ``P + 1 + d`` (``P = prefix_lens[b]`` is the root's position); thread ``tid`` the
    columns ``c CHUNK + tid``, ``+ blockDim``, ... With ``u`` a hash of ``(b, position)``:
    if ``u < accuracy`` the bonus ``confidence`` goes to the true token
    ``continuation[b, position]``; otherwise to a hashed wrong guess, and the true token gets
    ``RUNNER_UP * confidence`` (so a wider tree can still catch it). Every logit adds
    ``noise_scale`` times an Irwin-Hall(4) approximation of a standard normal.
    """
    d, b = cuda.blockIdx.x, cuda.blockIdx.y
    vocab = logits.shape[2]
    position = prefix_lens[b] + 1 + d
    true_token = continuation[b, position] if position < continuation.shape[1] else -1
    agree = _unit(_hash(seed, b, position, vocab)) < accuracy
    guess = true_token
    if not agree or true_token < 0:
        guess = int32(_hash(seed, b, position, vocab + 1) % uint64(vocab))
    first = cuda.blockIdx.z * CHUNK
    for v in range(first + cuda.threadIdx.x, min(vocab, first + CHUNK), cuda.blockDim.x):
        u = float32(0)
        for k in range(4):
            u += _unit(_hash(seed, b, position, 4 * v + k + 2 * vocab))
        # the two products that feed an add are rounded alone (mul_rn): fused into an FMA they
        # would differ from the numpy twin in the last bit
        value = mul_rn(noise_scale, (u - float32(2)) * float32(SQRT3))
        if v == guess:
            value += confidence
        elif v == true_token:
            value += mul_rn(float32(RUNNER_UP), confidence)
        logits[b, d, v] = value


class KernelDraftOps:
    """The drafter's logits by the numba.cuda kernel, on the current stream."""

    name = "kernels"

    def draft(self, continuation, prefix_lens, seed, accuracy, confidence, noise_scale, logits):
        bs, L, vocab = logits.shape
        chunks = max(1, (vocab + CHUNK - 1) // CHUNK)
        launch(_draft_kernel, (L, bs, chunks), ROW_THREADS, launch_stream())(
            continuation, prefix_lens, np.uint32(seed), np.float32(accuracy),
            np.float32(confidence), np.float32(noise_scale), logits)


class HostDraftOps:
    """The numpy twin of :class:`KernelDraftOps`, in place on numpy or simulator arrays."""

    name = "numpy"

    def draft(self, continuation, prefix_lens, seed, accuracy, confidence, noise_scale, logits):
        out, cont = host_view(logits), host_view(continuation)
        bs, L, vocab = out.shape
        b = np.arange(bs)[:, None]                                          # [bs, 1]
        position = host_view(prefix_lens)[:, None].astype(np.int64) + 1 + np.arange(L)
        inside = position < cont.shape[1]
        true_token = np.where(inside, cont[b, np.minimum(position, cont.shape[1] - 1)], -1)
        agree = _unit_host(_hash_host(seed, b, position, vocab)) < np.float32(accuracy)
        wrong = (_hash_host(seed, b, position, vocab + 1) % vocab).astype(np.int64)
        guess = np.where(agree & (true_token >= 0), true_token, wrong)     # [bs, L]
        v = np.arange(vocab)
        u = np.zeros((bs, L, vocab), np.float32)
        for k in range(4):
            u += _unit_host(_hash_host(seed, b[..., None], position[..., None],
                                       4 * v + k + 2 * vocab))
        value = np.float32(noise_scale) * ((u - np.float32(2)) * np.float32(SQRT3))
        # the kernel adds a bonus at the guess and at the true token only (elsewhere the noise
        # stays as it is, a -0.0 included)
        is_guess = v == guess[..., None]
        is_true = v == true_token[..., None]
        out[:] = np.where(is_guess, value + np.float32(confidence),
                          np.where(is_true, value + np.float32(RUNNER_UP) * np.float32(confidence),
                                   value))


def _mix_host(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def _hash_host(seed, b, position, lane):
    """numpy twin of the kernels' ``_hash`` (uint64 arrays, same bits)."""
    def u64(x):
        return np.asarray(x).astype(np.uint64)

    return _mix_host(_mix_host(_mix_host(_mix_host(u64(seed)) ^ u64(b)) ^ u64(position))
                     ^ u64(lane))


def _unit_host(h):
    return (h >> 8).astype(np.float32) * np.float32(1.0 / 16777216.0)


def default_draft_ops():
    """:class:`HostDraftOps` on the simulator, :class:`KernelDraftOps` on a GPU."""
    return HostDraftOps() if SIMULATOR else KernelDraftOps()


class ToyDrafter:
    """Drafter logits ``float32[bs, L, V]`` from a noisy view of the target's continuation.

    Parameters
    ----------
    continuation : numpy.ndarray
        ``int32[bs, S]``: each request's plain greedy sequence by position (position 0 is the
        start token), e.g. from :meth:`~ddtree_numba.models.toy_mla.ToyMLA.greedy`.
    vocab : int
    accuracy : float
        Probability that the drafter's top guess at a position is the target's token.
    confidence : float
        Logit bonus of the guess (the right token gets ``0.7 * confidence`` when the guess is
        wrong).
    noise : float
        Scale of the logit noise: Irwin-Hall(4), mean 0, variance 1, bounded by ``2 sqrt(3)``;
        so with ``confidence > 4 sqrt(3) noise`` (the default 8 > 6.93) the guess is always the
        drafter's top token, and ``accuracy`` is exactly how often that top token is right.
    seed : int
    """

    def __init__(self, continuation, *, vocab: int, accuracy: float = 0.8,
                 confidence: float = 8.0, noise: float = 1.0, seed: int = 0, ops=None):
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy: expected a probability in [0, 1], got {accuracy!r}")
        self.continuation = np.ascontiguousarray(continuation, np.int32)
        self.vocab, self.accuracy, self.confidence = vocab, accuracy, confidence
        self.noise, self.seed = noise, seed
        self.ops = ops if ops is not None else default_draft_ops()

    def allocate(self, *, bs: int, L: int) -> None:
        if self.continuation.ndim != 2 or self.continuation.shape[0] != bs:
            raise ValueError(f"continuation: expected int32[{bs}, S], got shape "
                             f"{list(self.continuation.shape)}")
        self.continuation_device = as_device(self.continuation)
        self.logits = cuda.device_array((bs, L, self.vocab), np.float32)

    def draft(self, root_token_ids, prefix_lens):
        self.ops.draft(self.continuation_device, prefix_lens, self.seed, self.accuracy,
                       self.confidence, self.noise, self.logits)
        return self.logits


class FixedDrafter:
    """A drafter that returns given logits (``[bs, L, V]``, numpy or device), whatever the
    roots: the replay of a recorded step, or hand-made logits for a test."""

    def __init__(self, logits):
        self.logits = logits
        self.vocab = int(logits.shape[-1])

    def allocate(self, *, bs: int, L: int) -> None:
        if tuple(self.logits.shape[:2]) != (bs, L):
            raise ValueError(f"logits: expected [bs={bs}, L={L}, V], got "
                             f"{list(self.logits.shape)}")

    def draft(self, root_token_ids, prefix_lens):
        return self.logits


def build_specs():
    """The draft kernel's specialisation (for the build report)."""
    from numba import types

    from ..kernels._specs import KernelSpec

    return [KernelSpec("toy_drafter", "draft", _draft_kernel,
                       (types.int32[:, ::1], types.int32[::1], types.uint32, types.float32,
                        types.float32, types.float32, types.float32[:, :, ::1]),
                       ROW_THREADS, True)]

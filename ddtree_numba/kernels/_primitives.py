"""Device helpers shared by several kernels: float bits, orderable keys, a warp max, block
reductions and a block scan.

*Orderable keys.* ``orderable_key(bits)`` maps the bits of a float32 to a uint32 whose unsigned
order is the float order: negative floats have all bits flipped (so a more negative value gets a
smaller key), non-negative floats get the sign bit set (so they sit above every negative).
``-0.0`` is made ``+0.0`` first, so the two compare equal as they do in numpy. Key ``0`` is
below every real float's key (it would be the bits ``0xFFFFFFFF``, a NaN) and serves as "none".

*Warp max.* ``warp_max_u32`` is one ``redux.sync.max.u32`` instruction (sm_80 and later): every
lane of the warp gets the maximum of the 32 values. The shuffle tree it replaces takes five
dependent ``shfl.xor`` + ``max`` steps.

*bfloat16 rounding.* ``bfloat16_bits(x)`` rounds a float32 to bfloat16 with integer
arithmetic on its bits (to nearest, ties to even, as numpy's ``ml_dtypes`` cast), so a kernel
can store a bfloat16 cache row on the GPU and on the simulator alike.

*Block reductions.* ``make_block_reduce(op)`` builds a tree reduction over the ``T`` threads of
a block (``T`` a power of two) in a shared array ``red`` of at least ``T`` elements, with any
binary device function ``op``: ``block_sum`` and ``block_max`` are two of them. Every thread of
the block must call it and gets the result; it ends with a barrier, so ``red`` may be reused at
once. The ``log2 T`` levels each combine ``red[tid]`` and ``red[tid + half]`` (the same order
for every call: a float sum is deterministic).

*Block scan.* ``block_inclusive_scan_open(scratch, value, tid, T)`` returns ``(inclusive,
total)``: the sum of ``value`` over threads ``0 .. tid`` and over the whole block. It is *open*:
it ends without a barrier, so the caller's next barrier must come before anyone writes
``scratch`` again (every caller stores the sums and publishes them with a barrier of its own,
which closes the scan; a closing barrier inside the scan would only double it). Two versions
with one result:

* the simulator's (the readable definition): Hillis-Steele in ``scratch[0:T]``, ``log2 T``
  steps, each a read, a barrier, an add and a barrier, one before them: 21 barriers at
  ``T = 1024``;
* the GPU's: each warp scans its 32 values in registers (five ``shfl.up`` steps: lane ``i``
  adds the running value of lane ``i - 1``, ``i - 2``, ``i - 4``, ...), lane 31 writes the warp's
  total to ``scratch[warp]``; after a barrier *every* warp scans those ``T / 32`` totals the
  same way (lane ``l`` loads total ``l``), and each thread adds the running total of the warps
  before its own, shuffled from lane ``warp - 1``: one barrier. (Warp 0 alone scanning the
  totals and publishing them in shared memory, as an earlier version did, needs a barrier
  more, and its closing barrier a third.)
  ``T`` must be a multiple of 32 there (every block that calls it is).

*Bitonic sort.* ``bitonic_sort_desc(keys, n, tid, T)`` sorts ``n`` uint64 keys (a power of two)
in shared memory, descending, with the bitonic network: for ``size = 2, 4, .., n`` and
``stride = size / 2, .., 1``, elements ``i`` and ``i ^ stride`` compare and exchange, the lower
index keeping the larger key where ``i & size == 0`` (a descending run) and the smaller
elsewhere. On the simulator every step goes through shared memory and ends with a barrier:
``log2 n (log2 n + 1) / 2`` barriers (36 at ``n = 256``). On a GPU, when ``n <= T``, thread ``i``
keeps element ``i`` in a register: steps of stride below 32 pair two lanes of one warp (a
shuffle, no barrier), and only the wider ones go through shared memory, two barriers each
(at ``n = 256`` six steps of stride 32 or more: 12 barriers, and one at the end, against
36). Up to ``4 T`` (``T`` a power of two), thread ``t`` keeps elements ``t``, ``t + T``,
``t + 2 T``, ``t + 3 T`` in four registers: a stride of ``T`` or ``2 T`` then pairs two of one
thread's registers (no barrier at all), and only strides from 32 to ``T / 2`` go through
shared memory (at ``n = 2 048``, ``T = 512``: 18 such steps, two barriers each, against the
shared-memory network's 66 barriers). Longer sorts take the shared-memory network.
``sort_desc_any(keys, n, tid, T)`` takes any ``n``: it fills ``keys[n:]`` up to the next
power of two with key 0, the smallest uint64 (the caller's buffer must hold that many), then
sorts; the padding sinks to the end.

*32-bit shifts.* ``shr_u32(x, shift)`` is ``uint32(x) >> shift`` in one 32-bit instruction
(numba would shift in 64 bits: three instructions, in loops that run once a logit).

*Exponentials of a sum.* ``exp2_ftz(x)`` is ``2**x`` by the hardware's ``ex2.approx.ftz``: a
relative error of about ``2**-22``, and results below ``2**-126`` are 0. A sum of ``exp(x - m)``
over a row holds a term of 1, so a flushed term changes it by less than ``V * 2**-126``. The
form without ``ftz`` costs three more instructions on every term, only to produce those.

*Unfused products.* On a GPU, NVVM fuses a multiply whose result feeds an add into one
fused multiply-add, rounded once, where numpy rounds the product and then the sum. Where a
kernel must equal its numpy twin bit for bit, ``mul_rn(a, b)`` is the float32 product as
libdevice's ``__fmul_rn``: ``mul.rn.f32``, which PTX never contracts into an FMA.

Simulator: the bit casts, ``mul_rn``, ``shr_u32`` and ``exp2_ftz`` have numpy versions and
the block helpers run as they are; the warp max does not exist there (kernels that need it
have a simulator-runnable variant instead).
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64, uint16, uint32, uint64

from ._device import SIMULATOR

SIGN = uint32(0x80000000)
ALL_BITS = uint32(0xFFFFFFFF)
FULL_MASK = 0xFFFFFFFF                      # every lane of a warp takes part in a shuffle

if SIMULATOR:

    def bits_to_float(bits):
        return np.array([bits], np.uint32).view(np.float32)[0]

    def float_to_bits(x):
        return np.array([x], np.float32).view(np.uint32)[0]

    def mul_rn(a, b):
        return np.float32(a) * np.float32(b)

    def shr_u32(x, shift):
        return np.uint32(np.uint32(x) >> np.uint32(shift))

    def exp2_ftz(x):
        y = np.exp2(np.float32(x), dtype=np.float32)
        return np.float32(0.0) if y < np.float32(2.0**-126) else y

    def warp_max_u32(value):  # pragma: no cover - never reached under the simulator
        raise NotImplementedError("warp_max_u32 needs a GPU (redux.sync)")

else:
    import uuid

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic as numba_intrinsic

    def intrinsic(definition):
        """numba's ``@intrinsic``, with one identity in every process. numba pickles an
        intrinsic with a ``uuid1`` drawn in the process, and its on-disk cache keys a kernel by
        a pickle of the kernel's closure, which takes in the device functions the closure holds
        and the globals they use. So every kernel made by a factory whose device functions
        call one of these (draft_topk's resident and filtered kernels, for one) had a key of
        its own in every process: with ``DDTREE_KERNEL_CACHE=1`` no process ever loaded
        another's compilation of it, and none waited for another compiling it. The identity
        here comes from the module and name instead (``_set_uuid``: numba-cuda 0.30 has no
        public way to give it; ``tests/test_kernel_cache.py`` checks the keys). A numba-cuda
        without that method keeps its own identity: kernels still compile and run, each
        process compiling its own."""
        made = numba_intrinsic(definition)
        if callable(getattr(made, "_set_uuid", None)):
            name = f"{definition.__module__}.{definition.__qualname__}"
            made._set_uuid(str(uuid.uuid5(uuid.NAMESPACE_URL, f"ddtree_numba:{name}")))
        return made

    @cuda.jit(device=True, inline="always")
    def bits_to_float(bits):
        return cuda.libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, inline="always")
    def float_to_bits(x):
        return uint32(cuda.libdevice.float_as_int(x))

    @cuda.jit(device=True, inline="always")
    def mul_rn(a, b):
        return cuda.libdevice.fmul_rn(a, b)    # rounded alone: never fused into an FMA

    @intrinsic
    def shr_u32(typingctx, x, shift):
        """``x >> shift`` as one 32-bit shift (``shift < 32``). numba types a shift of two
        uint32 as 64-bit and LLVM keeps it so: a zero extension, a 64-bit shift and a
        truncation where one instruction does."""
        if not (isinstance(x, types.Integer) and isinstance(shift, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            value, amount = (builder.trunc(a, i32) if a.type.width > 32 else
                             builder.zext(a, i32) if a.type.width < 32 else a for a in args)
            return builder.lshr(value, amount)

        return types.uint32(x, shift), codegen

    @intrinsic
    def exp2_ftz(typingctx, x):
        """``2**x`` (float32) as one ``ex2.approx.ftz.f32``: libdevice's ``exp2f`` and
        ``__expf`` use the form without ``ftz``, which wraps the hardware's ``ex2`` in a
        range test and two predicated multiplies to produce results below ``2**-126``."""
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;",
                               "=f,f")
            return builder.call(asm, args)

        return types.float32(types.float32), codegen

    @intrinsic
    def warp_max_u32(typingctx, value):
        """Max of ``value`` over the full warp, returned to every lane (``redux.sync``). All
        32 lanes of the warp must call it together, converged: inline assembly carries no
        *convergent* mark (``warp_max_key``), so a caller keeps it out of lane-dependent
        branches (the corners select calls it in warp 0's ``if tid < 32`` block, which a
        whole warp enters or skips)."""
        if value != types.uint32:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]),
                               "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r",
                               side_effect=True)
            return builder.call(asm, args)

        return types.uint32(types.uint32), codegen


@cuda.jit(device=True, inline="always")
def bfloat16_bits(x):
    """The bits of ``x`` (float32) rounded to bfloat16, to nearest, ties to even (what numpy's
    ``ml_dtypes.bfloat16`` cast and CUDA's ``__float2bfloat16_rn`` do); a NaN becomes the
    quiet NaN ``0x7FC0`` with its sign, as in ml_dtypes.

    bfloat16 is the upper half of a float32. Adding ``0x7FFF`` plus the lowest kept bit to the
    full bits carries into the kept half exactly when the dropped half is above one half of
    the last kept place, or equal to it with an odd kept half. Overflow rounds to infinity.
    """
    bits = float_to_bits(x)
    if bits & uint32(0x7FFFFFFF) > uint32(0x7F800000):   # NaN: the quiet one, sign kept
        return uint16(((bits >> uint32(16)) & uint32(0x8000)) | uint32(0x7FC0))
    return uint16((bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16))


@cuda.jit(device=True, inline="always")
def orderable_key(bits):
    """float32 bits -> uint32 key, unsigned order = float order (-0.0 == +0.0)."""
    if bits == SIGN:                        # -0.0 -> +0.0
        bits = uint32(0)
    if bits & SIGN:
        return uint32(~bits & ALL_BITS)     # negative: flip everything
    return uint32(bits | SIGN)              # non-negative: set the sign bit


@cuda.jit(device=True, inline="always")
def bits_of_key(key):
    """Inverse of :func:`orderable_key` (``+0.0`` for the key of ``-0.0``)."""
    if key & SIGN:
        return uint32(key ^ SIGN)
    return uint32(~key & ALL_BITS)


@cuda.jit(device=True, inline="always")
def key_of_float(x):
    return orderable_key(float_to_bits(x))


@cuda.jit(device=True, inline="always")
def float_of_key(key):
    return bits_to_float(bits_of_key(key))


# ------------------------------------------------------------------------------------------
# Block-wide helpers (every thread of the block must call them; the warp-level helpers
# further down say so where they are warp-wide instead)
# ------------------------------------------------------------------------------------------
def make_block_reduce(op):
    """``reduce(red, value, tid, T)``: ``op`` folded over one ``value`` per thread of a block
    of ``T`` threads (a power of two), by a tree in the shared array ``red[0:T]``. ``op`` is a
    device function of two values; numba compiles one reduction per ``op`` (a closure)."""

    @cuda.jit(device=True, inline="always")
    def block_reduce(red, value, tid, T):
        red[tid] = value
        cuda.syncthreads()                      # all values stored
        half = T // 2
        while half > 0:
            if tid < half:
                red[tid] = op(red[tid], red[tid + half])
            cuda.syncthreads()                  # this level done before the next reads it
            half //= 2
        total = red[0]
        cuda.syncthreads()                      # everyone read the result before reuse
        return total

    return block_reduce


@cuda.jit(device=True, inline="always")
def _add(a, b):
    return a + b


@cuda.jit(device=True, inline="always")
def _max(a, b):
    return max(a, b)


block_sum = make_block_reduce(_add)     # block_sum(red, value, tid, T): sum over the block
block_max = make_block_reduce(_max)     # block_max(red, value, tid, T): max over the block


@cuda.jit(device=True, inline="always")
def warp_max_key(key):
    """The largest uint32 ``key`` of the warp, to every lane: five ``shfl.xor`` steps (lane
    ``l`` takes the max with lane ``l ^ 16``, then ``l ^ 8``, ...). Not ``redux.sync``
    (``_primitives.warp_max_u32``): numba passes inline assembly to LLVM without the
    *convergent* mark its shuffle intrinsics carry."""
    best = int64(key)                       # (numba shuffles 32- and 64-bit signed values)
    offset = 16
    while offset > 0:
        best = max(best, cuda.shfl_xor_sync(FULL_MASK, best, offset))
        offset //= 2
    return uint32(best)


@cuda.jit(device=True, inline="always")
def warp_max_f32(value):
    """The largest float32 ``value`` of the warp, to every lane: the same five ``shfl.xor``
    steps as :func:`warp_max_key` (lane ``l`` takes the max with lane ``l ^ 16``, then
    ``l ^ 8``, ...)."""
    offset = 16
    while offset > 0:
        value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
        offset //= 2
    return value


@cuda.jit(device=True, inline="always")
def warp_sum_f32(value):
    """The sum of one float32 a lane, to every lane: five ``shfl.xor`` steps. The two lanes of
    a pair add the same two values in either order (float addition commutes), so every lane
    ends with the same bits."""
    offset = 16
    while offset > 0:
        value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
        offset //= 2
    return value


@cuda.jit(device=True, inline="always")
def _block_max_u32_by_warps(red, value, tid, T):
    """Max of one uint32 a thread over a block of whole warps: a shuffle tree in each warp
    (lane ``l`` takes the max with lane ``l ^ 16``, ``l ^ 8``, ...; every lane ends with the
    warp's max), lane 0 writes it to ``red[warp]``, and after a barrier every thread folds the
    ``T / 32`` warp maxima. Two barriers where the tree takes ``log2 T + 2``."""
    best = warp_max_key(value)
    if tid & 31 == 0:
        red[tid >> 5] = best
    cuda.syncthreads()                      # every warp's max in place
    total = red[0]
    for w in range(1, T >> 5):
        total = max(total, red[w])
    cuda.syncthreads()                      # everyone read red before it is reused
    return total


@cuda.jit(device=True, inline="always")
def _block_sum_f32_by_warps(red, value, tid, T):
    """Sum of one float32 a thread, as :func:`_block_max_u32_by_warps`. Every thread adds the
    warp sums in the same order (warp 0 first) and the butterfly's two lanes of a pair add
    the same two values, so all threads get the same total, and one call always the same."""
    value = warp_sum_f32(value)
    if tid & 31 == 0:
        red[tid >> 5] = value
    cuda.syncthreads()                      # every warp's sum in place
    total = red[0]
    for w in range(1, T >> 5):
        total += red[w]
    cuda.syncthreads()                      # everyone read red before it is reused
    return total


# One uint32 max and one float32 sum over a block; ``red`` holds one value a warp on a GPU and
# one a thread on the simulator (the tree above: it has no shuffles). The float sum's order
# differs between the two, as any float reduction's does.
block_max_u32 = block_max if SIMULATOR else _block_max_u32_by_warps
block_sum_f32 = block_sum if SIMULATOR else _block_sum_f32_by_warps


@cuda.jit(device=True, inline="always")
def _hillis_steele_scan_open(scratch, value, tid, T):
    """``(inclusive, total)`` of one int32 per thread, in ``scratch[0:T]`` (see above),
    without a closing barrier."""
    scratch[tid] = value
    cuda.syncthreads()                      # all values in place
    offset = 1
    while offset < T:
        add = scratch[tid - offset] if tid >= offset else 0
        cuda.syncthreads()                  # everyone read before anyone overwrites
        scratch[tid] += add
        cuda.syncthreads()                  # the step is complete before the next read
        offset *= 2
    return scratch[tid], scratch[T - 1]


@cuda.jit(device=True, inline="always")
def warp_inclusive_scan(x, lane):
    """Inclusive sum of ``x`` over lanes ``0 .. lane`` of a full warp (five shuffles)."""
    offset = 1
    while offset < 32:
        below = cuda.shfl_up_sync(FULL_MASK, x, offset)   # lane - offset's value (own if < 0)
        if lane >= offset:
            x = int32(x + below)            # int32 + int32 would widen to int64
        offset *= 2
    return x


@cuda.jit(device=True, inline="always")
def _warp_shuffle_scan_open(scratch, value, tid, T):
    """``(inclusive, total)`` of one int32 per thread: warps scan in registers, then every warp
    scans the ``T / 32`` warp totals held in ``scratch[0:T / 32]`` (see above). No closing
    barrier."""
    lane = tid & 31
    warp = tid >> 5
    warps = T >> 5
    x = warp_inclusive_scan(int32(value), lane)
    if lane == 31:
        scratch[warp] = x                   # the warp's total
    cuda.syncthreads()                      # every warp's total in place
    # lane l of every warp: the totals of warps 0 .. l (no one writes scratch until the
    # caller's next barrier)
    t = warp_inclusive_scan(scratch[lane] if lane < warps else int32(0), lane)
    # warps 0 .. warp - 1 (warp 0 reads lane 31 and drops it below)
    before = cuda.shfl_sync(FULL_MASK, t, (warp - 1) & 31)
    total = cuda.shfl_sync(FULL_MASK, t, warps - 1)   # lane warps - 1: every warp's total
    if warp > 0:
        x = int32(x + before)
    return x, total


# the simulator has no warp shuffles; on a GPU the same sums with 1 barrier instead of 21
block_inclusive_scan_open = _hillis_steele_scan_open if SIMULATOR else _warp_shuffle_scan_open


def block_scan_scratch(T: int) -> int:
    """int32 entries of ``scratch`` that :func:`block_inclusive_scan_open` needs for a block
    of ``T`` threads: one a thread on the simulator (Hillis-Steele), one a
    warp on a GPU, whose scan takes whole warps only (``T`` a multiple of 32, at most 1 024:
    full-mask shuffles, and every warp scans the warp totals)."""
    if not SIMULATOR and (T % 32 or not 32 <= T <= 1024):
        raise ValueError(f"T: expected a multiple of 32 in [32, 1024] on a GPU, got {T}")
    return T if SIMULATOR else T // 32


if SIMULATOR:

    @cuda.jit(device=True)
    def sync_warp():
        """The simulator has no ``syncwarp``: a block barrier stands in for it, so every
        thread of the block must reach each call (callers keep their loops uniform)."""
        cuda.syncthreads()

else:

    @cuda.jit(device=True, inline="always")
    def sync_warp():
        """Every lane of the warp waits here, and its shared-memory writes before it are
        visible to the warp's other lanes after it (``bar.warp.sync``, full mask)."""
        cuda.syncwarp(FULL_MASK)


@cuda.jit(device=True, inline="always")
def _bitonic_sort_in_shared(keys, n, tid, T):
    """Sort ``keys[0:n]`` descending in place (``n`` a power of two; shared memory)."""
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            for i in range(tid, n, T):
                j = i ^ stride
                if j > i:
                    descending = (i & size) == 0
                    a = keys[i]
                    b = keys[j]
                    if (a < b) == descending:
                        keys[i] = b
                        keys[j] = a
            cuda.syncthreads()              # this compare-exchange step done before the next
            stride //= 2
        size *= 2


@cuda.jit(device=True, inline="always")
def _bitonic_sort_in_registers(keys, n, tid, T):
    """The same network for ``n <= T``: thread ``i`` holds element ``i`` in a register. A step
    of stride < 32 pairs two lanes of one warp: a shuffle, no barrier. A wider step goes
    through ``keys``: write, barrier, read the partner, barrier. ``T`` must be whole warps (a
    multiple of 32): the shuffles take the full mask."""
    x = keys[tid] if tid < n else uint64(0)     # threads >= n carry a dummy through the steps
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            if stride >= 32:
                if tid < n:
                    keys[tid] = x
                cuda.syncthreads()          # every element in place
                y = keys[tid ^ stride] if tid < n else x
                cuda.syncthreads()          # every partner read before the next write
            else:
                # (numba shuffles signed 64-bit values: the bits go as int64 and come back)
                y = uint64(cuda.shfl_xor_sync(FULL_MASK, int64(x), stride))
            # the pair (i, i ^ stride): in a descending run the lower index keeps the larger
            if (tid < (tid ^ stride)) == ((tid & size) == 0):
                x = max(x, y)
            else:
                x = min(x, y)
            stride //= 2
        size *= 2
    if tid < n:
        keys[tid] = x
    cuda.syncthreads()                      # the sorted keys in place


@cuda.jit(device=True, inline="always")
def _keep(x, y, i, stride, size):
    """What element ``i`` of a bitonic step keeps, ``x`` its value and ``y`` its partner's
    (element ``i ^ stride``): in a descending run (``i & size == 0``) the lower index keeps the
    larger."""
    return max(x, y) if (i < (i ^ stride)) == ((i & size) == 0) else min(x, y)


@cuda.jit(device=True, inline="always")
def _exchange_in_shared(keys, x, i, n, stride, size):
    """One step of a stride between 32 and the block through ``keys``: element ``i`` (value
    ``x``) reads its partner; a thread's elements ``>= n`` keep their dummies."""
    return _keep(x, keys[i ^ stride], i, stride, size) if i < n else x


@cuda.jit(device=True, inline="always")
def _store_four(keys, n, i0, i1, i2, i3, x0, x1, x2, x3):
    """A thread's four elements (indices ``i0 < i1 < i2 < i3``, ``i0 < n``) into ``keys``,
    those below ``n``."""
    keys[i0] = x0
    if i1 < n:
        keys[i1] = x1
    if i2 < n:
        keys[i2] = x2
    if i3 < n:
        keys[i3] = x3


@cuda.jit(device=True, inline="always")
def _shuffle_step(x, i, stride, size):
    """One step of a stride below 32 for element ``i`` (value ``x``): its partner is the same
    register of lane ``tid ^ stride``. Every lane of the warp calls it (full mask); numba
    shuffles signed 64-bit values, so the bits go as int64 and come back."""
    return _keep(x, uint64(cuda.shfl_xor_sync(FULL_MASK, int64(x), stride)), i, stride, size)


@cuda.jit(device=True, inline="always")
def _bitonic_sort_in_registers_x4(keys, n, tid, T):
    """The network for ``2 T < n <= 4 T`` (``n = 4 T`` for powers of two; ``n = 2 T`` takes
    :func:`_bitonic_sort_in_registers_x2`): thread ``t`` holds elements ``t``, ``t + T``,
    ``t + 2 T``, ``t + 3 T`` in four registers (``x0 .. x3``; dummies past ``n``). A step of
    stride ``< 32`` is a shuffle in each register; of stride ``>= T``, a compare-exchange of two
    of the thread's own registers (slots ``q`` and ``q ^ stride / T``), no barrier; between the
    two, through ``keys`` (write, barrier, read, barrier). ``T`` must be a power of two (at
    least 32): then element ``i``'s partner ``i ^ stride`` is slot ``q ^ (stride / T)`` of the
    same thread for a stride of ``T`` or ``2 T``, and the same slot of lane ``t ^ stride`` below
    32."""
    x0 = keys[tid]
    x1 = keys[tid + T] if tid + T < n else uint64(0)
    x2 = keys[tid + 2 * T] if tid + 2 * T < n else uint64(0)
    x3 = keys[tid + 3 * T] if tid + 3 * T < n else uint64(0)
    i0 = tid                                # the elements' indices
    i1 = tid + T
    i2 = tid + 2 * T
    i3 = tid + 3 * T
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            if stride >= T:                 # partner in this thread: slot q ^ (stride / T)
                if stride == T:             # pairs (0, 1) and (2, 3)
                    x0, x1 = _keep(x0, x1, i0, stride, size), _keep(x1, x0, i1, stride, size)
                    x2, x3 = _keep(x2, x3, i2, stride, size), _keep(x3, x2, i3, stride, size)
                else:                       # stride 2 T: pairs (0, 2) and (1, 3)
                    x0, x2 = _keep(x0, x2, i0, stride, size), _keep(x2, x0, i2, stride, size)
                    x1, x3 = _keep(x1, x3, i1, stride, size), _keep(x3, x1, i3, stride, size)
            elif stride >= 32:              # partner in another warp: through shared memory
                _store_four(keys, n, i0, i1, i2, i3, x0, x1, x2, x3)
                cuda.syncthreads()          # every element in place
                x0 = _exchange_in_shared(keys, x0, i0, n, stride, size)
                x1 = _exchange_in_shared(keys, x1, i1, n, stride, size)
                x2 = _exchange_in_shared(keys, x2, i2, n, stride, size)
                x3 = _exchange_in_shared(keys, x3, i3, n, stride, size)
                cuda.syncthreads()          # every partner read before the next write
            else:                           # partner in this warp: a shuffle per register
                x0 = _shuffle_step(x0, i0, stride, size)
                x1 = _shuffle_step(x1, i1, stride, size)
                x2 = _shuffle_step(x2, i2, stride, size)
                x3 = _shuffle_step(x3, i3, stride, size)
            stride //= 2
        size *= 2
    _store_four(keys, n, i0, i1, i2, i3, x0, x1, x2, x3)
    cuda.syncthreads()                      # the sorted keys in place


@cuda.jit(device=True, inline="always")
def _bitonic_sort_in_registers_x2(keys, n, tid, T):
    """The network for ``n = 2 T`` (``T < n <= 2 T`` with both powers of two): thread ``t``
    holds elements ``t`` and ``t + T`` in two registers (``x0``, ``x1``), as
    :func:`_bitonic_sort_in_registers_x4` holds four, at half its shuffles and shared-memory
    traffic a step (a bfloat16 top-K whose ties at the ``k``-th key take it a little past the
    block's length sorts here). A step of stride ``T``, the widest, pairs the thread's two
    registers; of stride 32 to ``T / 2``, through ``keys``; below 32, a shuffle each."""
    i0 = tid                                # the elements' indices
    i1 = tid + T
    x0 = keys[i0]
    x1 = keys[i1]
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            if stride >= T:                 # stride T: the pair is (x0, x1), in this thread
                x0, x1 = _keep(x0, x1, i0, stride, size), _keep(x1, x0, i1, stride, size)
            elif stride >= 32:              # partner in another warp: through shared memory
                keys[i0] = x0
                keys[i1] = x1
                cuda.syncthreads()          # every element in place
                x0 = _keep(x0, keys[i0 ^ stride], i0, stride, size)
                x1 = _keep(x1, keys[i1 ^ stride], i1, stride, size)
                cuda.syncthreads()          # every partner read before the next write
            else:                           # partner in this warp: a shuffle per register
                x0 = _shuffle_step(x0, i0, stride, size)
                x1 = _shuffle_step(x1, i1, stride, size)
            stride //= 2
        size *= 2
    keys[i0] = x0
    keys[i1] = x1
    cuda.syncthreads()                      # the sorted keys in place


@cuda.jit(device=True, inline="always")
def _bitonic_sort_gpu(keys, n, tid, T):
    if n <= T:                              # uniform over the block: no barrier is skipped
        _bitonic_sort_in_registers(keys, n, tid, T)
    elif n == 2 * T and T & (T - 1) == 0:   # (a stride of T pairs t with t + T)
        _bitonic_sort_in_registers_x2(keys, n, tid, T)
    elif n <= 4 * T and T & (T - 1) == 0:   # (a stride of T pairs t + q T with t + (q ^ 1) T)
        _bitonic_sort_in_registers_x4(keys, n, tid, T)
    else:
        _bitonic_sort_in_shared(keys, n, tid, T)


# Sort ``keys[0:n]`` (uint64, shared memory, ``n`` a power of two) descending in place; every
# thread of the block calls it, after a barrier that put keys[0:n] in place (each path reads
# other threads' keys at once). The simulator has no shuffles: the shared-memory network there.
bitonic_sort_desc = _bitonic_sort_in_shared if SIMULATOR else _bitonic_sort_gpu


@cuda.jit(device=True, inline="always")
def sort_desc_any(keys, n, tid, T):
    """Sort ``keys[0:n]`` descending for any ``n``: pad to the next power of two ``n2`` with
    key 0 (``keys`` must hold ``n2``), then :data:`bitonic_sort_desc`. Every thread of the
    block calls it, after a barrier that put ``keys[0:n]`` in place."""
    n2 = 1
    while n2 < n:
        n2 *= 2
    for i in range(n + tid, n2, T):         # thread tid pads slots n + tid, n + tid + T, ...
        keys[i] = uint64(0)
    cuda.syncthreads()                      # padding in place before sorting
    bitonic_sort_desc(keys, n2, tid, T)

"""A numpy model of the one-pass draft top-K's filter (``kernels/draft_topk_filtered.py``):
how many logits a row the warps append and how often they compact, with and without the
guessed floor. No GPU; the GPU's shapes (8 warps of 32 lanes, 16 logits a lane a tile,
512 held keys a warp, float32 rows).

Then, for the rows with the guess, the end's exact select over what the warps hold, two ways:
fixed 11-bit digits of the key (the kernel's way until the thirty-first session) and the
kernel's way now, a first level's bins over the held keys' own span: how many levels each
takes and how many candidates reach the sort.

The model follows the kernel's rules, with two simplifications: warps take their tiles in
turn (tile ``t`` by warp ``t % 8``, as if they ran in step), and a compaction's new floor is
the exact ``kk``-th held key (the kernel's is the lower edge of that key's histogram bin, at
or below it). Run on the H200's benchmark rows (normal logits times 3) it gives the counts the
clock marks measured without the guess (``benchmarks/NOTES.md``: every tile appends, about
five compactions a warp at K 256).

    python benchmarks/topk_filter_model.py [--rows 20]
"""

from __future__ import annotations

import argparse

import numpy as np

from ddtree_numba.arrays import BFLOAT16
from ddtree_numba.reference.build_tree_threshold import score_keys

V = 163_840
THREADS, WARPS, LANES = 256, 8, 32
LOADS, PER_WORD = 8, 2                      # float32: 8-byte words, two logits each
TILE = LANES * LOADS * PER_WORD             # logits of a warp's tile: 512
WARP_CAP = 512
TOP_CAP = 512                               # the end's sort: the threshold bin and above
GUESS_MAX_RANK = 8


def guess_rank(n_words: int, kk: int) -> int:
    """The rank ``r`` of the guessed floor, as the kernel's ``guess_rank`` (0: no guess)."""
    logits = n_words * PER_WORD
    sample = THREADS * LOADS * PER_WORD
    if n_words < LOADS * THREADS:
        return 0
    r = (2 * kk * sample + 11 * logits - 1) // (9 * logits)
    return r if r <= GUESS_MAX_RANK else 0


def guessed_floor(row: np.ndarray, r: int) -> float:
    """The kernel's guess: thread ``t`` samples words ``u seg + t`` (``u < LOADS``) and takes
    its largest logit; the smallest over the warps of the warp's ``r``-th largest."""
    words = row.reshape(-1, PER_WORD)
    seg = words.shape[0] // LOADS
    index = np.arange(LOADS)[:, None] * seg + np.arange(THREADS)[None, :]   # [u, t]
    thread_max = words[index].max(axis=(0, 2)).reshape(WARPS, LANES)
    return float((-np.sort(-thread_max, axis=1)[:, r - 1]).min())


def filter_row(row: np.ndarray, kk: int, guess: bool) -> tuple:
    """``(logits appended, compactions a warp, tiles that append a warp, held logits, cut)``
    for one row; ``cut`` is the end's ``max(guess, block floor)``, as a logit."""
    floors = np.full(WARPS, -np.inf)
    block_floor = -np.inf
    if guess and (r := guess_rank(row.size // PER_WORD, kk)):
        floors[:] = guessed_floor(row, r)
    guessed = floors[0]
    held = [np.empty(0, np.float32) for _ in range(WARPS)]
    appended = compactions = appending = 0
    for t in range(row.size // TILE):
        w = t % WARPS
        x = row[t * TILE:(t + 1) * TILE]
        passing = x[x >= max(floors[w], block_floor)]
        if passing.size == 0:
            continue
        appending += 1
        if held[w].size + passing.size > WARP_CAP and held[w].size > kk:
            keys = np.sort(held[w])[::-1]
            floors[w] = keys[kk - 1]
            block_floor = max(block_floor, floors[w])
            held[w] = keys[keys >= floors[w]]
            compactions += 1
            passing = x[x >= max(floors[w], block_floor)]
        held[w] = np.concatenate([held[w], passing])
        appended += passing.size
    return (appended, compactions / WARPS, appending / WARPS, np.concatenate(held),
            max(guessed, block_floor))


def orderable_keys(x: np.ndarray) -> np.ndarray:
    """The kernels' orderable keys of float32 values (the reference's ``score_keys``; the
    model's rows hold no NaN), as uint64 for shifts without wrap."""
    return score_keys(x).astype(np.uint64)


def _threshold_bin(hist: np.ndarray, need: int) -> tuple[int, int]:
    """``(bin, keys above it)``: the bin holding the ``need``-th largest key."""
    from_top = np.cumsum(hist[::-1])
    i = int(np.searchsorted(from_top, need))
    b = hist.size - 1 - i
    return b, int(from_top[i] - hist[b])


def end_select(held: np.ndarray, cut: float, kk: int) -> tuple[int, int, int, int]:
    """The end's radix select over the held keys at or above the cut, two ways: fixed digits
    (levels of the key's top 11, next 11, last 10 bits, stopping once the threshold bin and all
    above it fit ``TOP_CAP``: the kernel's way until the thirty-first session) and the
    kernel's way now (a first level of 2 048 bins over ``[cut, largest held key]``, ``shift``
    from the span, then 11 bits at a time). Returns ``(levels, candidates sorted)`` for each,
    or ``None`` where fewer than ``kk`` held keys reach the cut (the kernel's two-pass
    fall-back)."""
    keys = orderable_keys(held)
    keys = keys[keys >= orderable_keys(np.array([cut], np.float32))[0]]
    if keys.size < kk:
        return None
    # fixed digits (the kernel's way before)
    need, prefix, key_mask, levels = kk, 0, 0, 0
    for shift, mask in ((21, 0x7FF), (10, 0x7FF), (0, 0x3FF)):
        levels += 1
        sel = keys[(keys & key_mask) == prefix]
        b, above = _threshold_bin(np.bincount((sel >> shift) & mask, minlength=mask + 1), need)
        ties = int(((sel >> shift) & mask == b).sum())
        need -= above
        prefix |= b << shift
        key_mask |= mask << shift
        if kk - need + ties <= TOP_CAP:
            break
    fixed = (levels, kk - need + ties)
    # span-based (the kernel's way now): the first level's bins cover [lo, hi]
    lo, hi = int(orderable_keys(np.array([cut], np.float32))[0]), int(keys.max())
    shift = max(0, (hi - lo).bit_length() - 11)
    need, above, levels = kk, 0, 0
    while True:
        levels += 1
        sel = keys[(keys >= lo) & (keys <= hi)].astype(np.int64)
        digits = (sel - lo) >> shift
        b, over = _threshold_bin(np.bincount(digits, minlength=2048), need - above)
        in_bin = int((digits == b).sum())
        if shift == 0 or above + over + in_bin <= TOP_CAP:
            return (*fixed, levels, above + over + in_bin)
        above += over
        lo += b << shift
        hi = lo + (1 << shift) - 1
        shift = max(0, shift - 11)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((args.rows, V)) * 3).astype(np.float32)
    print(f"V {V}, {args.rows} rows of normal logits x 3; means a row (appends) or a warp")
    print(f"{'K':>4} {'guess':>6} {'r':>2} {'appended':>9} {'compactions':>12} "
          f"{'tiles appending':>16}")
    ends = {}
    for kk in (256, 64, 16):
        for guess in (False, True):
            runs = [filter_row(row, kk, guess) for row in rows]
            got = np.array([run[:3] for run in runs])
            r = guess_rank(V // PER_WORD, kk) if guess else 0
            print(f"{kk:>4} {str(guess):>6} {r:>2} {got[:, 0].mean():>9.0f} "
                  f"{got[:, 1].mean():>12.1f} {got[:, 2].mean():>10.1f} of {V // TILE // WARPS}")
            if guess:
                ends[kk, "float32"] = [end_select(run[3], run[4], kk) for run in runs]
    for kk in (256, 16):                    # bfloat16 rows: the same logits, rounded
        runs = [filter_row(row.astype(BFLOAT16).astype(np.float32), kk, True) for row in rows]
        ends[kk, "bfloat16"] = [end_select(run[3], run[4], kk) for run in runs]
    print("\n(rows whose guess left fewer than K held keys, the fall-back: "
          f"{sum(e is None for v in ends.values() for e in v)})")
    print("\nthe end's radix select over the held keys (with the guess): levels and candidates "
          "sorted, mean (max)")
    print(f"{'K':>4} {'logits':>9} {'fixed digits':>22} {'span-based':>22}")
    for (kk, dtype), e in ends.items():
        e = np.array([x for x in e if x is not None])
        print(f"{kk:>4} {dtype:>9} {e[:, 0].mean():>5.2f} ({e[:, 0].max()}) "
              f"{e[:, 1].mean():>6.0f} ({e[:, 1].max():>3}) {e[:, 2].mean():>7.2f} "
              f"({e[:, 2].max()}) {e[:, 3].mean():>6.0f} ({e[:, 3].max():>3})")


if __name__ == "__main__":
    main()

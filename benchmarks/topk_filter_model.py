"""A numpy model of the one-pass draft top-K's filter (``kernels/draft_topk_filtered.py``):
how many logits a row the warps append and how often they compact, with and without the
guessed floor. No GPU; the GPU's shapes (8 warps of 32 lanes, 16 logits a lane a tile,
512 held keys a warp, float32 rows).

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

V = 163_840
THREADS, WARPS, LANES = 256, 8, 32
LOADS, PER_WORD = 8, 2                      # float32: 8-byte words, two logits each
TILE = LANES * LOADS * PER_WORD             # logits of a warp's tile: 512
WARP_CAP = 512
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


def filter_row(row: np.ndarray, kk: int, guess: bool) -> tuple[int, float, float]:
    """``(logits appended, compactions a warp, tiles that append a warp)`` for one row."""
    floors = np.full(WARPS, -np.inf)
    block_floor = -np.inf
    if guess and (r := guess_rank(row.size // PER_WORD, kk)):
        floors[:] = guessed_floor(row, r)
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
    return appended, compactions / WARPS, appending / WARPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(5)
    rows = (rng.standard_normal((args.rows, V)) * 3).astype(np.float32)
    print(f"V {V}, {args.rows} rows of normal logits x 3; means a row (appends) or a warp")
    print(f"{'K':>4} {'guess':>6} {'r':>2} {'appended':>9} {'compactions':>12} "
          f"{'tiles appending':>16}")
    for kk in (256, 64, 16):
        for guess in (False, True):
            got = np.array([filter_row(row, kk, guess) for row in rows])
            r = guess_rank(V // PER_WORD, kk) if guess else 0
            print(f"{kk:>4} {str(guess):>6} {r:>2} {got[:, 0].mean():>9.0f} "
                  f"{got[:, 1].mean():>12.1f} {got[:, 2].mean():>10.1f} of {V // TILE // WARPS}")


if __name__ == "__main__":
    main()

"""01: draft top-K log-probabilities from the drafter's logits
===========================================================


``draft_topk(logits, k)`` keeps, for each request and draft position, the ``k`` largest
logits (ties by smaller token id) and their log-softmax values. The kernel finds the k-th
largest by radix select on the float bits and sorts only the survivors; the ids must equal
the reference's exactly, the log-probs agree to float32 rounding of the log-sum-exp.
"""

# %%
import numpy as np

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)


def pick(simulator, gpu):
    """``gpu`` sizes on a GPU, ``simulator`` sizes on numba's CUDA simulator."""
    return simulator if K.SIMULATOR else gpu

bs, L, V, k = pick((2, 3, 200, 8), (8, 15, 163840, 256))
rng = np.random.default_rng(0)
logits = (rng.standard_normal((bs, L, V)) * 3).astype(np.float32)

# %%
# The reference defines the result; the kernel must reproduce it.
want_lp, want_ids = ref.draft_topk(logits, k)
lp, ids = K.draft_topk(logits, k)
lp, ids = lp.copy_to_host(), ids.copy_to_host()
print("request 0, depth 0, top 5 tokens:", ids[0, 0, :5], "log-probs:", np.round(lp[0, 0, :5], 3))
report("draft_topk ids", bool((ids == want_ids).all()))
report("draft_topk log-probs (within 1e-5)", bool(np.allclose(lp, want_lp, rtol=0, atol=1e-5)))

# sphinx_gallery_thumbnail_path = "_generated/layout_draft_topk.png"

"""04: verification attention over the paged latent cache
======================================================


DeepSeek-V3 / Kimi-K2 attention in the absorbed MLA form reads one 576-wide latent row per
token (512 latent + 64 rope), shared by all heads. ``verify_attn`` computes, for every node and
head, softmax attention over the prefix and the node's ancestors (``visibility_bits``) and
returns the output in latent space plus the log-sum-exp. The kernel is compared with the
float64 reference by relative error (bound 2e-5: float32 accumulation).
"""

# %%
import numpy as np

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.paging import shuffled_block_table


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)


def pick(simulator, gpu):
    """``gpu`` sizes on a GPU, ``simulator`` sizes on numba's CUDA simulator."""
    return simulator if K.SIMULATOR else gpu

bs, budget, H, Dc, Dr, page, max_prefix = pick((2, 6, 2, 16, 8, 4, 12),
                                               (2, 63, 64, 512, 64, 64, 2000))
rng = np.random.default_rng(3)
top_lp, top_ids = ref.draft_topk((rng.standard_normal((bs, 4, 16)) * 2).astype(np.float32), 4)
prefix = rng.integers(0, max_prefix, bs).astype(np.int32)
tree = ref.build_tree(top_lp, top_ids, np.zeros(bs, np.int32), budget, prefix_lens=prefix)
N = budget + 1

# %%
# A paged cache with a shuffled block table: slot t of request b is at
# kv_cache[block_table[b, t // page], t % page].
table, num_pages = shuffled_block_table(rng, prefix, N, page)
cache = rng.standard_normal((num_pages, page, Dc + Dr)).astype(np.float32)
q_latent = rng.standard_normal((bs, N, H, Dc)).astype(np.float32)
q_rope = rng.standard_normal((bs, N, H, Dr)).astype(np.float32)
sm_scale = ref.deepseek_sm_scale()                      # 192 ** -0.5 * mscale ** 2, not 576 ** -0.5

args = (q_latent, q_rope, cache, table, prefix, tree.visibility_bits, tree.num_nodes)
want_out, want_lse = ref.verify_attn(*args, sm_scale=sm_scale)
out, lse = K.verify_attn(*args, sm_scale=sm_scale)
out, lse = out.copy_to_host(), lse.copy_to_host()
err = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
print(f"relative error {err:.2e}; lse of node 0, head 0: {lse[0, 0, 0]:.4f}")
report("verify_attn (relative error <= 2e-5)", bool(err <= 2e-5))

# sphinx_gallery_thumbnail_path = "_generated/layout_verify_attn.png"

"""05: accept the agreeing path, commit its cache rows
===================================================


The target's argmax at every node (``target_predict``) decides: from the root, follow the child
whose token equals the target's prediction; the prediction at the last accepted node is the
bonus token. ``commit_kv`` then moves the accepted nodes' cache rows from slots ``P + a_i`` to
``P + i`` so the cache holds the committed sequence contiguously.
"""

# %%
import dataclasses

import numpy as np

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.paging import shuffled_block_table


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)

rng = np.random.default_rng(4)
top_lp, top_ids = ref.draft_topk((rng.standard_normal((2, 4, 16)) * 2).astype(np.float32), 3)
prefix = np.array([5, 9], np.int32)
tree = ref.build_tree(top_lp, top_ids, np.array([1, 2], np.int32), 10, prefix_lens=prefix)

# %%
# A pretend target: agrees with the draft along a random root path, then wants another token.
predict = np.full(tree.token_ids.shape, 999, np.int32)
for b in range(2):
    cur = 0
    for _ in range(3):
        kids = np.flatnonzero(tree.parents[b] == cur)
        if not kids.size:
            break
        child = int(rng.choice(kids))
        predict[b, cur] = tree.token_ids[b, child]
        cur = child
want = ref.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)
got = K.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict).to_host()
for b in range(2):
    k = int(want.accept_len[b])
    print(f"request {b}: accepted path {want.accept_nodes[b, : k + 1]}, commits tokens "
          f"{want.accept_tokens[b, : k + 1]} (the last one is the bonus)")
report("tree_accept", all(np.array_equal(getattr(got, f.name), getattr(want, f.name))
                          for f in dataclasses.fields(want)))

# %%
# Commit on a paged cache (8-row pages, pages shuffled): reference and kernel, same result.
page = 8
table, num_pages = shuffled_block_table(rng, prefix, 11, page)
cache = rng.standard_normal((num_pages, page, 6)).astype(np.float32)
cache_ref, cache_kernel = cache.copy(), cache.copy()
new_ref = ref.commit_kv(cache_ref, table, prefix, want.accept_nodes, want.accept_len)
new_kernel = K.commit_kv(cache_kernel, table, prefix, want.accept_nodes, want.accept_len)
print("new prefix lengths:", new_ref)
report("commit_kv", bool((cache_ref == cache_kernel).all()
                         and (new_kernel.copy_to_host() == new_ref).all()))

# sphinx_gallery_thumbnail_path = "_generated/layout_accept_commit.png"

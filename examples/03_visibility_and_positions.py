"""03: what each node may see: ancestor mask and positions
=======================================================


In the target's verification pass every node attends to the committed prefix and to its own
ancestors (and itself), never to a sibling's branch. ``visibility[b, i, j]`` says whether node
``j`` is visible from node ``i``; ``visibility_bits`` packs it 32 nodes per uint32 word for the
attention kernel; ``positions = prefix_lens + depth`` places each node at its RoPE position as if
its path alone had been decoded.
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

rng = np.random.default_rng(2)
top_lp, top_ids = ref.draft_topk((rng.standard_normal((1, 3, 12)) * 2).astype(np.float32), 3)
prefix = np.array([100], np.int32)
tree = ref.build_tree(top_lp, top_ids, np.array([7], np.int32), 8, prefix_lens=prefix)
n = int(tree.num_nodes[0])
print("parents  ", tree.parents[0, :n])
print("depths   ", tree.depths[0, :n])
print("positions", tree.positions[0, :n], "(prefix 100 + depth)")
print("visibility (row i: the nodes node i attends to)")
for i in range(n):
    print(f"  node {i}:", "".join("x" if v else "." for v in tree.visibility[0, i, :n]))

# %%
# The packed words are the same mask, and the kernel's finish stage computes both.
unpacked = ref.unpack_bits(tree.visibility_bits[0], n)
report("visibility_bits unpack to visibility", bool((unpacked == tree.visibility[0, :, :n]).all()))
got = K.build_tree(top_lp, top_ids, np.array([7], np.int32), 8, prefix_lens=prefix).to_host()
report("kernel visibility and positions",
       bool((got.visibility_bits == tree.visibility_bits).all()
            and (got.positions == tree.positions).all()))

# sphinx_gallery_thumbnail_path = "_generated/thumb_visibility.png"

"""numba.cuda kernels, one module per stage, with the same functions as the references.

Each launcher accepts numpy arrays or device arrays (numba, CuPy, torch: anything with the CUDA
Array Interface), validates them with :mod:`ddtree_numba.validation`, launches on the current
stream (:func:`use_stream`) without synchronising, and returns device arrays.
"""

from ._device import SIMULATOR, as_device, use_stream
from .accept_commit import accept_commit
from .build_tree import allocate_tree, build_tree
from .commit_kv import commit_kv
from .draft_topk import allocate_topk_scratch, draft_topk
from .sample_uniforms import allocate_uniforms, sample_uniforms
from .sampling_probs import allocate_probs, sampling_probs
from .tree_accept import allocate_accept, tree_accept
from .tree_sample import tree_sample, tree_sample_logits
from .verify_attn import allocate_workspace, verify_attn

__all__ = [
    "SIMULATOR",
    "accept_commit",
    "allocate_accept",
    "allocate_probs",
    "allocate_topk_scratch",
    "allocate_tree",
    "allocate_uniforms",
    "allocate_workspace",
    "as_device",
    "build_tree",
    "commit_kv",
    "draft_topk",
    "sample_uniforms",
    "sampling_probs",
    "tree_accept",
    "tree_sample",
    "tree_sample_logits",
    "use_stream",
    "verify_attn",
]

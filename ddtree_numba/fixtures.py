"""Golden fixtures: inputs and expected outputs of every stage, from the references, as KDTR.

``python -m ddtree_numba fixtures OUTDIR [--seed S] [--cases N]`` writes, for each case,
``OUTDIR/<stage>_<case>.kdtr`` for the stages ``draft_topk``, ``build_tree``, ``verify_attn``
(a float32 and a bfloat16 cache), ``tree_accept``, ``commit_kv`` and ``greedy_step`` (one whole
step of the bigram toy target, whose tables travel in the file), plus ``manifest.json``
describing every file and tensor. Tensor names are ``in.<argument>`` and ``out.<result>``;
scalars are rank-0 tensors. The same seed gives byte-identical files. Writing again into the
same folder replaces the fixtures its manifest lists (no stale file stays); other files there
are kept.

A native implementation loads a file (``tools/kdtr.h``), runs its stage on the ``in.`` tensors
and compares with the ``out.`` tensors: exactly for the integer and add-only stages, within
the documented bounds for ``draft_topk`` log-probs and ``verify_attn``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from . import reference as ref
from .arrays import BFLOAT16
from .kdtr import load_kdtr, save_kdtr
from .models.bigram import BigramTarget, noisy_drafter_logits
from .paging import shuffled_block_table


def _random_topk(rng, bs, L, K, V):
    x = (rng.standard_normal((bs, L, V)) * 3).astype(np.float32)
    return ref.draft_topk(x, K)


def _tree_outputs(tree, prefix="out.tree."):
    return {prefix + f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}


def _paged_cache(rng, bs, prefix_lens, N, page_size, D, dtype=np.float32):
    table, num_pages = shuffled_block_table(rng, prefix_lens, N, page_size)
    return rng.standard_normal((num_pages, page_size, D)).astype(dtype), table


def stage_cases(rng) -> dict:
    """One case of every stage: ``{stage: {tensor name: array}}``."""
    from .models.toy_drafter import FixedDrafter  # imports numba: only when writing

    cases = {}
    bs, L, V, K, budget = 2, 4, 24, 4, 12
    logits = (rng.standard_normal((bs, L, V)) * 2).astype(np.float32)
    logits[0, 0, 5:] = -np.inf                        # fewer than K finite entries
    logits[1, 2] = np.round(logits[1, 2])             # ties
    lp, ids = ref.draft_topk(logits, K)
    cases["draft_topk"] = {"in.logits": logits, "in.k": np.int32(K),
                           "out.top_log_probs": lp, "out.top_token_ids": ids}

    lp, ids = _random_topk(rng, bs, L, K, V)
    roots = rng.integers(0, V, bs).astype(np.int32)
    prefix = rng.integers(0, 20, bs).astype(np.int32)
    tree = ref.build_tree(lp, ids, roots, budget, prefix_lens=prefix)
    cases["build_tree"] = {"in.top_log_probs": lp, "in.top_token_ids": ids,
                           "in.root_token_ids": roots, "in.budget": np.int32(budget),
                           "in.prefix_lens": prefix, **_tree_outputs(tree)}

    small = ref.build_tree(lp, ids, roots, 4, prefix_lens=prefix)   # 5 nodes: quick to simulate
    Ns, H, Dc, Dr, page = 5, 2, 16, 8, 8
    for name, dtype in (("verify_attn", np.float32), ("verify_attn_bf16", BFLOAT16)):
        cache, table = _paged_cache(rng, bs, prefix, Ns, page, Dc + Dr, dtype)
        ql = rng.standard_normal((bs, Ns, H, Dc)).astype(np.float32)
        qr = rng.standard_normal((bs, Ns, H, Dr)).astype(np.float32)
        scale = 0.25
        out, lse = ref.verify_attn(ql, qr, cache, table, prefix, small.visibility_bits,
                                   small.num_nodes, sm_scale=scale)
        cases[name] = {"in.q_latent": ql, "in.q_rope": qr, "in.kv_cache": cache,
                       "in.block_table": table, "in.prefix_lens": prefix,
                       "in.visibility_bits": small.visibility_bits,
                       "in.num_nodes": small.num_nodes, "in.sm_scale": np.float64(scale),
                       "out.out_latent": out, "out.lse": lse}

    N = budget + 1

    predict = rng.integers(0, V, (bs, N)).astype(np.int32)
    for b in range(bs):                               # follow a path for a while
        cur = 0
        for _ in range(3):
            kids = np.flatnonzero(tree.parents[b] == cur)
            if not kids.size:
                break
            child = int(kids[-1])
            predict[b, cur] = tree.token_ids[b, child]
            cur = child
    acc = ref.tree_accept(tree.token_ids, tree.next_token, tree.next_sibling, predict)
    cases["tree_accept"] = {"in.token_ids": tree.token_ids, "in.next_token": tree.next_token,
                            "in.next_sibling": tree.next_sibling, "in.target_predict": predict,
                            **{f"out.{f.name}": getattr(acc, f.name)
                               for f in dataclasses.fields(acc)}}

    cache, table = _paged_cache(rng, bs, prefix, N, page, Dc + Dr)
    moved = cache.copy()
    new_prefix = ref.commit_kv(moved, table, prefix, acc.accept_nodes, acc.accept_len)
    cases["commit_kv"] = {"in.kv_cache": cache, "in.block_table": table,
                          "in.prefix_lens": prefix, "in.accept_nodes": acc.accept_nodes,
                          "in.accept_len": acc.accept_len, "out.kv_cache": moved,
                          "out.prefix_lens": new_prefix}

    target = BigramTarget(vocab=V, row_width=8, seed=int(rng.integers(1 << 30)))
    draft = noisy_drafter_logits(target, roots, L, confidence=3.0, rng=rng)
    cache, table = _paged_cache(rng, bs, prefix, N + L + 1, page, 8)
    cache_before = cache.copy()
    target.kv_cache = cache                     # the step commits into it in place
    step = ref.greedy_step(target, FixedDrafter(draft), roots, table, prefix, k=K,
                           budget=budget)
    cases["greedy_step"] = {
        "in.draft_logits": draft, "in.root_token_ids": roots, "in.kv_cache": cache_before,
        "in.block_table": table, "in.prefix_lens": prefix, "in.k": np.int32(K),
        "in.budget": np.int32(budget), "in.toy_next_of": target.next_of,
        "in.toy_embedding": target.embedding, **_tree_outputs(step.tree),
        "out.target_predict": step.target_predict,
        **{f"out.accept.{f.name}": getattr(step.accept, f.name)
           for f in dataclasses.fields(step.accept)},
        "out.kv_cache": cache, "out.prefix_lens": step.prefix_lens}
    return cases


DESCRIPTIONS = {
    "draft_topk": "reference.draft_topk(in.logits, in.k); ids exact, log-probs within the "
                  "bound of kernels/draft_topk.py",
    "build_tree": "reference.build_tree(in.top_log_probs, in.top_token_ids, "
                  "in.root_token_ids, in.budget, prefix_lens=in.prefix_lens); exact",
    "verify_attn": "reference.verify_attn(..., sm_scale=in.sm_scale), float32 cache; "
                   "relative error bound 2e-5",
    "verify_attn_bf16": "reference.verify_attn(..., sm_scale=in.sm_scale), bfloat16 cache; "
                        "relative error bound 2e-5",
    "tree_accept": "reference.tree_accept(in.token_ids, in.next_token, in.next_sibling, "
                   "in.target_predict); exact",
    "commit_kv": "reference.commit_kv(in.kv_cache, ...) in place; out.kv_cache is the cache "
                 "after; exact",
    "greedy_step": "one reference.greedy_step of the bigram toy target "
                   "(next token = in.toy_next_of[token]); exact",
}


class FixturesError(ValueError):
    """``outdir`` cannot take the fixtures (a file, or ``.kdtr`` files no manifest lists)."""


def _previous_files(outdir) -> list:
    """The files a previous :func:`write_fixtures` left in ``outdir`` (its manifest's list and
    the manifest itself). ``.kdtr`` files that no manifest lists are refused: they may be
    someone else's, and left in place they would pass for current fixtures."""
    if not os.path.exists(outdir):
        return []
    if not os.path.isdir(outdir):
        raise FixturesError(f"{outdir} exists and is not a folder")
    listed = []
    manifest_path = os.path.join(outdir, "manifest.json")
    if os.path.isfile(manifest_path):
        try:
            with open(manifest_path) as f:
                listed = [entry["file"] for entry in json.load(f)["files"]]
        except (ValueError, KeyError, TypeError) as error:
            raise FixturesError(f"{manifest_path} is not a fixtures manifest ({error}); "
                                "remove it or choose another folder") from None
        listed = [name for name in listed if os.path.basename(name) == name]
        listed.append("manifest.json")
    unlisted = sorted(name for name in os.listdir(outdir)
                      if name.endswith(".kdtr") and name not in listed)
    if unlisted:
        raise FixturesError(f"{outdir} holds .kdtr files that no manifest.json lists "
                            f"({', '.join(unlisted[:3])}{', ...' if len(unlisted) > 3 else ''}); "
                            "remove them or choose another folder")
    return [name for name in listed if os.path.isfile(os.path.join(outdir, name))]


def write_fixtures(outdir, *, seed: int = 0, cases: int = 1) -> dict:
    """Write ``cases`` cases of every stage to ``outdir``; return the manifest.

    The files are written to a fresh temporary folder inside ``outdir`` first; only when all
    are written do they replace the previous fixtures: the files the old ``manifest.json``
    lists are removed, so no stale fixture stays behind. Other files in ``outdir`` are left
    alone; ``.kdtr`` files that no manifest lists are refused (:class:`FixturesError`).
    """
    previous = _previous_files(outdir)
    os.makedirs(outdir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".fixtures-", dir=outdir)
    try:
        manifest = _write_all(staging, seed=seed, cases=cases)
        for name in previous:
            os.remove(os.path.join(outdir, name))
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(outdir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _write_all(outdir, *, seed: int, cases: int) -> dict:
    manifest = {"format": "KDTR v1 (ddtree_numba/kdtr.py)", "seed": seed, "files": []}
    rng = np.random.default_rng(seed)
    for case in range(cases):
        for stage, tensors in stage_cases(rng).items():
            name = f"{stage}_{case}.kdtr"
            save_kdtr(os.path.join(outdir, name), **tensors)
            manifest["files"].append({
                "file": name, "stage": stage, "case": case, "description": DESCRIPTIONS[stage],
                "tensors": {k: {"dtype": _dtype_name(np.asarray(v).dtype),
                                "shape": list(np.shape(v))} for k, v in tensors.items()}})
    with open(os.path.join(outdir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return manifest


def _dtype_name(dtype) -> str:
    return "bfloat16" if dtype == BFLOAT16 else np.dtype(dtype).name


def read_case(path) -> tuple:
    """``(inputs, outputs)`` of a fixture file: dicts without the ``in.`` / ``out.`` prefix."""
    tensors = load_kdtr(path)
    inputs = {k[3:]: v for k, v in tensors.items() if k.startswith("in.")}
    outputs = {k[4:]: v for k, v in tensors.items() if k.startswith("out.")}
    return inputs, outputs

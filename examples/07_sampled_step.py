"""07: sampling (temperature > 0): the distribution, the uniforms, the lossless walk, the step
=============================================================================================

Greedy verification accepts a draft token when it is the target's argmax. A sampled step
keeps the output distributed exactly as plain sampling from the target, whatever the drafter
proposed, in three stages after the target's forward:

1. ``sampling_probs``: the target's logits -> the distribution each request samples from
   (temperature, then top-k, then top-p, per request);
2. ``sample_uniforms``: one uniform per tree node and one per request for the bonus token, from
   Philox4x32-10 keyed by (seed, request, position, node): no state, nothing from the host;
3. ``tree_sample``: walk the tree with samples from the target (target-only verification).

The walk needs the distribution only at the nodes it visits, so the step runs 1 and 3 as one
kernel, ``tree_sample_logits``, that finds it there and nowhere else (section 4).

:class:`~ddtree_numba.SampledStep` is the greedy step with these three in place of argmax and
``tree_accept``. Every stage here is checked against its numpy reference.
"""

# %%
import numpy as np

from ddtree_numba import GreedyStep, SampledStep
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.kernels import SIMULATOR
from ddtree_numba.models.toy_drafter import ToyDrafter
from ddtree_numba.models.toy_mla import ToyMLA, ToyMLAConfig
from ddtree_numba.models.toy_mla_device import DeviceToyMLA
from ddtree_numba.step.demo import checked_sampled_run


def report(name: str, ok: bool) -> None:
    """Say whether a check matches the reference; stop the example if it does not."""
    print(f"{name}: {'matches the reference' if ok else 'DIFFERS FROM THE REFERENCE'}")
    if not ok:
        raise SystemExit(1)


# %%
# 1. The distribution. One row of 8 logits, three requests: temperature 1; temperature 0.5 with
# top-k 3; temperature 1 with top-p 0.8. Lower temperature sharpens, top-k and top-p cut the
# tail (ties at a threshold are kept), and temperature 0 would be a one-hot at the argmax.
logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -np.inf], np.float32)
x = np.broadcast_to(logits, (3, 1, 8)).copy()
params = (np.array([1.0, 0.5, 1.0], np.float32), np.array([0, 3, 0], np.int32),
          np.array([1.0, 1.0, 0.8], np.float32))
want = ref.sampling_probs(x, *params)
got = K.sampling_probs(x, *params).copy_to_host()
np.set_printoptions(precision=3, suppress=True)
for name, row in zip(("T 1", "T 0.5, top-k 3", "T 1, top-p 0.8"), want[:, 0], strict=True):
    print(f"{name:>15}: {row}")
report("kernel (float32 rounding, the same kept tokens)",
       np.allclose(got, want, atol=1e-6) and ((got > 0) == (want > 0)).all())

# %%
# 2. The uniforms: a pure function of (seed, request, position, node). The same key gives the
# same bits on the host and on the device, and the next step (a longer prefix) new ones.
prefix = np.array([0, 0], np.int32)
u, bonus = ref.sample_uniforms(2026, prefix, 5)
print(f"request 0, nodes 0-4: {u[0]}; bonus {bonus[0]:.3f}")
du, dbonus = K.sample_uniforms(2026, prefix, 5)
report("device uniforms, bit for bit",
       np.array_equal(du.copy_to_host(), u) and np.array_equal(dbonus.copy_to_host(), bonus))

# %%
# 3. Why the walk is lossless, measured: a root with children A, B (the drafter's guesses) over
# a 4-token vocabulary. The walk accepts A if u < p(A), else B if u < p(A) + p(B), else draws
# the bonus from the rest. Over many uniforms each token comes out with the target's
# probability, whatever the children are.
p_row = np.array([0.1, 0.4, 0.3, 0.2], np.float32)
tree = ref.tree_from_parents(np.array([[-1, 0, 0]], np.int32),
                             np.array([[0, 2, 3]], np.int32))        # children: tokens 2, 3
probs = np.broadcast_to(p_row, (1, 3, 4)).copy()
runs = 4000 if SIMULATOR else 20000
rng = np.random.default_rng(0)
counts = np.zeros(4)
for _ in range(runs):
    res = ref.tree_sample(tree.token_ids, tree.next_token, tree.next_sibling, probs,
                          rng.random((1, 3), dtype=np.float32),
                          rng.random(1, dtype=np.float32))
    counts[res.accept_tokens[0, 0]] += 1
print(f"first emitted token: empirical {counts / runs}, target {p_row}")
report("the target distribution, within 3 standard errors",
       bool((np.abs(counts / runs - p_row) < 3 * np.sqrt(p_row * (1 - p_row) / runs)).all()))

# %%
# 4. The walk straight from the logits. ``tree_sample_logits`` finds the distribution of each
# node its walk visits (the same passes as ``sampling_probs``), so its result is bit for bit
# that of ``tree_sample`` on ``sampling_probs``' output, without the [bs, N, V] probabilities.
logits_tree = np.random.default_rng(1).standard_normal((1, 3, 4)).astype(np.float32)
params = (np.array([0.9], np.float32), np.array([0], np.int32), np.array([0.95], np.float32))
u_nodes, u_bonus = np.array([[0.05, 0.6, 0.1]], np.float32), np.array([0.7], np.float32)
lists = (tree.token_ids, tree.next_token, tree.next_sibling)
fused = K.tree_sample_logits(*lists, logits_tree, *params, u_nodes, u_bonus).to_host()
pair = K.tree_sample(*lists, K.sampling_probs(logits_tree, *params).copy_to_host(), u_nodes,
                     u_bonus).to_host()
print(f"fused: tokens {fused.accept_tokens[0].tolist()}; two kernels: "
      f"{pair.accept_tokens[0].tolist()}")
report("the fused walk equals the two kernels", all(
    np.array_equal(getattr(fused, f), getattr(pair, f))
    for f in ("accept_nodes", "accept_len", "accept_tokens", "bonus_token")))

# %%
# 5. The step, on the toy MLA target. Temperature 0 is greedy decoding exactly; at temperature
# 0.8 every step is checked against the reference sampled step on the same drafter logits.
config = ToyMLAConfig.tiny(layers=1) if SIMULATOR else ToyMLAConfig.gpu()
bs, L, Kd, budget, steps = (2, 3, 2, 6, 3) if SIMULATOR else (4, 8, 8, 64, 8)
model = ToyMLA(config)
starts = np.random.default_rng(0).integers(0, config.vocab, bs).astype(np.int32)
greedy = np.array([model.greedy(int(s), steps * (L + 1)) for s in starts], np.int32)
continuation = np.concatenate([starts[:, None], greedy], axis=1)


def make(cls, **sampling):
    drafter = ToyDrafter(continuation, vocab=config.vocab, accuracy=0.8)
    return cls(DeviceToyMLA(model), drafter, bs=bs, L=L, K=Kd, budget=budget, max_steps=steps,
               **sampling)


def decode(step):
    step.start(starts)
    accepted = []
    for _ in range(steps):
        step()
        accepted.append(step.last_step()["accept"].accept_len)
    return step.tokens(), float(np.mean(accepted))


greedy_tokens, greedy_accept = decode(make(GreedyStep))
sampled_tokens, _ = decode(make(SampledStep, temperature=0.0, seed=1))
report("temperature 0, token for token against greedy decoding",
       sampled_tokens == greedy_tokens)

sampling = {"temperature": 0.8, "top_k": 0, "top_p": 1.0}
run = checked_sampled_run(make(SampledStep, seed=1, **sampling), model, starts,
                          out=lambda line: None)
report("every sampled device step (the reference sampled step)", True)
print(f"request 0 at temperature 0.8: {run['tokens'][0]}")
accepts = {t: decode(make(SampledStep, temperature=t, seed=1))[1] for t in (0.6, 1.0)}
print(f"mean accepted draft tokens per step: greedy {greedy_accept:.2f}, "
      + ", ".join(f"T {t}: {a:.2f}" for t, a in accepts.items())
      + " (the drafter guesses the greedy continuation: sampling strays from it)")

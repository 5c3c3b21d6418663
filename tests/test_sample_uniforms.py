"""The uniforms of a sampled step: Philox4x32-10 against Random123's known answers, the kernel
bit for bit against the reference, the counter layout, and the argument checks."""

import numpy as np
import pytest

from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.reference.sample_uniforms import philox4x32, uniform_from_bits

# Random123 1.14, tests/kat_vectors: "philox4x32 10 <counter x 4> <key x 2> <output x 4>"
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(counter, key, want):
    got = philox4x32(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert got.tolist() == list(want)


def test_uniform_from_bits_is_exact_and_below_one():
    words = np.array([0, 255, 256, 0xFFFFFF00, 0xFFFFFFFF], np.uint32)
    u = uniform_from_bits(words)
    assert u.dtype == np.float32
    assert u.tolist() == [0.0, 0.0, 2.0**-24, 1 - 2.0**-24, 1 - 2.0**-24]


@pytest.mark.parametrize("seed, prefix, N", [
    (0, [0], 1), (7, [0, 5, 123456, 2**31 - 1], 5), (2**64 - 1, [3, 3], 17)])
def test_kernel_equals_reference_bit_for_bit(seed, prefix, N):
    prefix = np.array(prefix, np.int32)
    want_u, want_b = ref.sample_uniforms(seed, prefix, N)
    got_u, got_b = K.sample_uniforms(seed, prefix, N)
    np.testing.assert_array_equal(got_u.copy_to_host(), want_u)
    np.testing.assert_array_equal(got_b.copy_to_host(), want_b)


def test_uniforms_differ_across_requests_positions_nodes_and_seeds():
    """Every (request, position, node) has its own counter, every seed its own key: no two
    uniforms of a step repeat, and the next step (a larger prefix) draws new ones."""
    prefix = np.array([10, 10, 11], np.int32)
    u, bonus = ref.sample_uniforms(1, prefix, 64)
    values = np.concatenate([u.ravel(), bonus])
    assert len(np.unique(values)) == len(values)
    assert not np.array_equal(u[0], u[1])                   # same position, other request
    assert not np.array_equal(ref.sample_uniforms(1, prefix + 4, 64)[0], u)
    assert not np.array_equal(ref.sample_uniforms(2, prefix, 64)[0], u)
    again = ref.sample_uniforms(1, prefix, 64)
    np.testing.assert_array_equal(again[0], u)              # a pure function of its key


def test_uniforms_are_uniform():
    """Chi-square over 16 equal bins of 2^16 uniforms (a test that can fail: a constant, a
    biased or a clustered generator does), at the 0.1 % level (critical value 37.7 for 15
    degrees of freedom)."""
    u, _ = ref.sample_uniforms(12345, np.arange(256, dtype=np.int32), 256)
    counts = np.bincount((u.ravel() * 16).astype(int), minlength=16)
    expected = u.size / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, chi2
    assert 0 <= u.min() and u.max() < 1


def test_argument_errors_are_clear():
    p = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="seed: expected an int in"):
        ref.sample_uniforms(-1, p, 3)
    with pytest.raises(ValueError, match="seed: expected an int in"):
        K.sample_uniforms(2**64, p, 3)
    with pytest.raises(TypeError, match="seed: expected an int"):
        ref.sample_uniforms(1.5, p, 3)
    with pytest.raises(ValueError, match="N: expected an int in"):
        ref.sample_uniforms(0, p, 0)
    with pytest.raises(ValueError, match="prefix_lens: expected values >= 0"):
        K.sample_uniforms(0, np.array([0, -1], np.int32), 3)
    with pytest.raises(TypeError, match="prefix_lens: expected int32"):
        ref.sample_uniforms(0, np.zeros(2, np.int64), 3)
    with pytest.raises(ValueError, match=r"out\[0\]: expected float32\[bs=2, N=3\]"):
        K.sample_uniforms(0, p, 3, out=K.allocate_uniforms(2, 4))
    with pytest.raises(TypeError, match=r"out\[1\]: expected float32"):
        K.sample_uniforms(0, p, 3, out=(K.allocate_uniforms(2, 3)[0], np.zeros(2, np.int32)))
    with pytest.raises(TypeError, match="out: expected a tuple"):
        K.sample_uniforms(0, p, 3, out=K.allocate_uniforms(2, 3)[0])

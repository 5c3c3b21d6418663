"""KDTR: round trips, hostile files, the C reader, and the committed golden fixtures."""

import os
import shutil
import struct
import subprocess
import tracemalloc

import numpy as np
import pytest
from ml_dtypes import bfloat16

from ddtree_numba import KdtrError, load_kdtr, save_kdtr
from ddtree_numba import kernels as K
from ddtree_numba import reference as ref
from ddtree_numba.fixtures import read_case, write_fixtures
from ddtree_numba.kdtr import ENTRY, HEADER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
DTYPES = [np.int32, np.int64, np.uint8, np.bool_, np.uint32, np.float16, bfloat16,
          np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_and_rank(tmp_path, dtype):
    rng = np.random.default_rng(0)
    arrays = {}
    for rank in range(5):
        shape = tuple(int(s) for s in rng.integers(1, 4, rank))
        values = rng.standard_normal(shape) * 50
        arrays[f"r{rank}"] = (values > 0) if dtype is np.bool_ else values.astype(dtype)
    arrays["empty"] = np.zeros((3, 0, 2), dtype)
    path = tmp_path / "a.kdtr"
    save_kdtr(path, **arrays)
    back = load_kdtr(path)
    assert list(back) == list(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == np.asarray(value).dtype
        assert back[name].shape == np.shape(value)
        assert back[name].tobytes() == np.asarray(value).tobytes()


def test_layout_is_the_documented_one(tmp_path):
    path = tmp_path / "a.kdtr"
    save_kdtr(path, x=np.arange(3, dtype=np.int32))
    raw = path.read_bytes()
    assert raw[:16] == b"KDTR" + struct.pack("<III", 1, 1, 0)
    name, code, rank, *rest = ENTRY.unpack_from(raw, HEADER.size)
    assert name.rstrip(b"\0") == b"x" and code == 1 and rank == 1
    assert rest[:8] == [3, 0, 0, 0, 0, 0, 0, 0]
    offset, nbytes = rest[8], rest[9]
    assert offset == 192 and nbytes == 12                      # align64(16 + 152)
    assert raw[offset : offset + 12] == np.arange(3, dtype="<i4").tobytes()


@pytest.mark.parametrize("name", ["caf\u00e9", "with space", "", "x" * 64, "a/b"])
def test_bad_names_are_rejected(tmp_path, name):
    with pytest.raises(KdtrError, match="tensor name"):
        save_kdtr(tmp_path / "a.kdtr", **{name: np.zeros(1)})
    assert not (tmp_path / "a.kdtr").exists()


def test_unsupported_dtype_and_rank(tmp_path):
    with pytest.raises(KdtrError, match="dtype complex128 cannot be stored"):
        save_kdtr(tmp_path / "a.kdtr", z=np.zeros(2, complex))
    with pytest.raises(KdtrError, match="rank 9 > 8"):
        save_kdtr(tmp_path / "a.kdtr", z=np.zeros((1,) * 9))


def test_bool_bytes_other_than_0_1_are_saved_as_0_1(tmp_path):
    """A bool array whose bytes are not 0 / 1 (a uint8 view) was written byte for byte, which
    the reader then rejected; it is stored as 0 / 1 (any non-zero byte is True)."""
    odd = np.array([2, 0, 255, 1], np.uint8).view(bool)
    path = tmp_path / "a.kdtr"
    save_kdtr(path, m=odd, s=odd[2])                   # rank 1 and rank 0
    back = load_kdtr(path)
    assert back["m"].view(np.uint8).tolist() == [1, 0, 1, 1]
    assert back["s"].view(np.uint8).tolist() == 1


@pytest.mark.parametrize("value", [[[1, 2], [3]], [1, "a"], [None], object()],
                         ids=["ragged", "mixed", "None", "object"])
def test_values_that_are_no_array_raise_kdtr_error(tmp_path, value):
    with pytest.raises(KdtrError, match="x: "):
        save_kdtr(tmp_path / "a.kdtr", x=value)
    assert not (tmp_path / "a.kdtr").exists()


def empty_with_extent(tmp_path, extent, dtype=np.float64):
    """A file whose one tensor has shape ``(0, extent)``: zero bytes, any extent."""
    path = tmp_path / "empty.kdtr"
    save_kdtr(path, e=np.zeros((0, 4), dtype))
    raw = bytearray(path.read_bytes())
    raw[entry_offset(0) + 80 : entry_offset(0) + 88] = struct.pack("<Q", extent)
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("extent", [2**64 - 1, 2**63, 2**60])
def test_empty_tensor_with_a_huge_extent_raises_kdtr_error(tmp_path, extent):
    """Zero bytes, but no reader can index the shape: the product of the non-zero extents
    times the itemsize must be at most 2**63 - 1 (numpy raised its own ValueError here)."""
    with pytest.raises(KdtrError, match="tensor e: shape"):
        load_kdtr(empty_with_extent(tmp_path, extent))


def test_empty_tensor_at_the_extent_bound_loads(tmp_path):
    extent = (2**63 - 1) // 8                           # x 8 bytes: just below 2**63
    assert load_kdtr(empty_with_extent(tmp_path, extent))["e"].shape == (0, extent)


def entry_offset(k):
    return HEADER.size + k * ENTRY.size


HOSTILE = {
    "bad magic": lambda b: b"KDTX" + b[4:],
    "unknown version": lambda b: b[:4] + struct.pack("<I", 7) + b[8:],
    "huge count": lambda b: b[:8] + struct.pack("<I", 2**31) + b[12:],
    "count past the end": lambda b: b[:8] + struct.pack("<I", 400) + b[12:],
    "unknown dtype": lambda b: b[: entry_offset(0) + 64] + struct.pack("<I", 99)
    + b[entry_offset(0) + 68 :],
    "rank 9": lambda b: b[: entry_offset(0) + 68] + struct.pack("<I", 9)
    + b[entry_offset(0) + 72 :],
    "overflowing shape": lambda b: b[: entry_offset(0) + 72] + struct.pack("<QQ", 2**62, 2**62)
    + b[entry_offset(0) + 88 :],
    "offset past the end": lambda b: b[: entry_offset(0) + 136] + struct.pack("<Q", 2**40)
    + b[entry_offset(0) + 144 :],
    "unaligned offset": lambda b: b[: entry_offset(0) + 136] + struct.pack("<Q", 200)
    + b[entry_offset(0) + 144 :],
    "overlap": lambda b: b[: entry_offset(1) + 136] + b[entry_offset(0) + 136 : entry_offset(0)
                                                         + 144] + b[entry_offset(1) + 144 :],
    "duplicate name": lambda b: b[: entry_offset(1)] + b[entry_offset(0) : entry_offset(0) + 64]
    + b[entry_offset(1) + 64 :],
    "non-ASCII name": lambda b: b[: entry_offset(0)] + b"\xff" + b[entry_offset(0) + 1 :],
    "truncated data": lambda b: b[:-8],
    "truncated header": lambda b: b[:10],
}


def sample_file(tmp_path):
    path = tmp_path / "ok.kdtr"
    save_kdtr(path, a=np.arange(12, dtype=np.float32).reshape(3, 4),
              b=np.arange(5, dtype=np.int64), c=np.ones((2, 2), bool))
    return path.read_bytes()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_files_raise_kdtr_error(tmp_path, case):
    bad = tmp_path / "bad.kdtr"
    bad.write_bytes(HOSTILE[case](sample_file(tmp_path)))
    with pytest.raises(KdtrError):
        load_kdtr(bad)


def test_fuzz_only_documented_errors_and_no_large_allocation(tmp_path):
    good = sample_file(tmp_path)
    rng = np.random.default_rng(0)
    bad = tmp_path / "fuzz.kdtr"
    tracemalloc.start()
    try:
        for trial in range(800):
            data = bytearray(good)
            kind = trial % 4
            if kind == 0:                                   # truncation
                data = data[: int(rng.integers(0, len(data)))]
            elif kind == 1:                                 # flipped bytes
                for _ in range(int(rng.integers(1, 6))):
                    data[int(rng.integers(0, len(data)))] ^= int(rng.integers(1, 256))
            elif kind == 2:                                 # absurd directory numbers
                at = int(rng.choice([8, 68, 72, 80, 136, 144, 16 + 152 + 72]))
                data[at : at + 8] = struct.pack("<Q", int(rng.integers(0, 2**63)))
            else:                                           # empty, with an absurd extent
                at = entry_offset(0) + 72
                data[at : at + 16] = struct.pack("<QQ", 0, int(rng.integers(0, 2**64,
                                                                           dtype=np.uint64)))
                data[entry_offset(0) + 144 : entry_offset(0) + 152] = bytes(8)
            bad.write_bytes(bytes(data))
            try:
                load_kdtr(bad)
            except KdtrError:
                pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak allocation {peak} bytes while reading hostile files"


def test_fixtures_are_deterministic(tmp_path):
    write_fixtures(tmp_path / "a", seed=5)
    write_fixtures(tmp_path / "b", seed=5)
    for name in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_c_reader_reads_a_fixture_bit_for_bit(tmp_path):
    exe = tmp_path / "kdtr_dump"
    subprocess.run(["cc", "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic",
                    "-I", os.path.join(ROOT, "tools"), os.path.join(ROOT, "tools", "kdtr_dump.c"),
                    "-o", str(exe)], check=True)
    write_fixtures(tmp_path / "fx", seed=1)
    for name in ("greedy_step_0.kdtr", "verify_attn_bf16_0.kdtr", "build_tree_0.kdtr"):
        out = tmp_path / name
        out.mkdir()
        listing = subprocess.run([str(exe), str(tmp_path / "fx" / name), str(out)],
                                 check=True, capture_output=True, text=True).stdout
        tensors = load_kdtr(tmp_path / "fx" / name)
        lines = listing.strip().splitlines()
        assert len(lines) == len(tensors)
        for line, (tname, value) in zip(lines, tensors.items(), strict=True):
            fields = line.split()
            assert fields[0] == tname
            assert [int(x) for x in fields[3:]] == list(value.shape)
            assert (out / f"{tname}.bin").read_bytes() == value.tobytes()
    bad = tmp_path / "bad.kdtr"
    bad.write_bytes(b"KDTR" + b"\0" * 4)
    done = subprocess.run([str(exe), str(bad)], capture_output=True, text=True)
    assert done.returncode == 1 and "truncated header" in done.stderr
    # the same extent bound as the Python reader, on both sides of it
    done = subprocess.run([str(exe), str(empty_with_extent(tmp_path, 2**60))],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "shape too large" in done.stderr
    done = subprocess.run([str(exe), str(empty_with_extent(tmp_path, (2**63 - 1) // 8))],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["e", "9", "2", "0",
                                                            str((2**63 - 1) // 8)]


# ------------------------------------------------------------------------------------------
# The committed golden fixtures as regression tests of the references and the kernels
# ------------------------------------------------------------------------------------------
def fixture(stage):
    return read_case(os.path.join(FIXTURES, f"{stage}_0.kdtr"))


def test_golden_draft_topk():
    x, want = fixture("draft_topk")
    lp, ids = ref.draft_topk(x["logits"], int(x["k"]))
    assert lp.tobytes() == want["top_log_probs"].tobytes()
    np.testing.assert_array_equal(ids, want["top_token_ids"])
    klp, kids = K.draft_topk(x["logits"], int(x["k"]))
    np.testing.assert_array_equal(kids.copy_to_host(), want["top_token_ids"])
    np.testing.assert_allclose(klp.copy_to_host(), want["top_log_probs"], rtol=0, atol=1e-5)


def test_golden_build_tree():
    x, want = fixture("build_tree")
    args = (x["top_log_probs"], x["top_token_ids"], x["root_token_ids"], int(x["budget"]))
    for tree in (ref.build_tree(*args, prefix_lens=x["prefix_lens"]),
                 K.build_tree(*args, prefix_lens=x["prefix_lens"]).to_host()):
        for key, value in want.items():
            np.testing.assert_array_equal(getattr(tree, key.split(".", 1)[1]), value, key)


@pytest.mark.parametrize("stage", ["verify_attn", "verify_attn_bf16"])
def test_golden_verify_attn(stage):
    x, want = fixture(stage)
    args = (x["q_latent"], x["q_rope"], x["kv_cache"], x["block_table"], x["prefix_lens"],
            x["visibility_bits"], x["num_nodes"])
    out, lse = ref.verify_attn(*args, sm_scale=float(x["sm_scale"]))
    assert out.tobytes() == want["out_latent"].tobytes() and lse.tobytes() == want["lse"].tobytes()
    kout, klse = K.verify_attn(*args, sm_scale=float(x["sm_scale"]))
    np.testing.assert_allclose(kout.copy_to_host(), want["out_latent"], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(klse.copy_to_host(), want["lse"], rtol=2e-5)


def test_golden_tree_accept_and_commit_kv():
    x, want = fixture("tree_accept")
    args = (x["token_ids"], x["next_token"], x["next_sibling"], x["target_predict"])
    for res in (ref.tree_accept(*args), K.tree_accept(*args).to_host()):
        for key, value in want.items():
            np.testing.assert_array_equal(getattr(res, key), value, key)
    x, want = fixture("commit_kv")
    for impl in (ref.commit_kv, K.commit_kv):
        cache = x["kv_cache"].copy()
        new_prefix = impl(cache, x["block_table"], x["prefix_lens"], x["accept_nodes"],
                          x["accept_len"])
        assert cache.tobytes() == want["kv_cache"].tobytes()
        if not isinstance(new_prefix, np.ndarray):
            new_prefix = new_prefix.copy_to_host()
        np.testing.assert_array_equal(new_prefix, want["prefix_lens"])


def test_golden_greedy_step():
    from ddtree_numba.models.bigram import BigramTarget
    from ddtree_numba.models.toy_drafter import FixedDrafter

    x, want = fixture("greedy_step")
    target = BigramTarget(vocab=x["toy_next_of"].size, row_width=x["toy_embedding"].shape[1])
    target.next_of, target.embedding = x["toy_next_of"], x["toy_embedding"]
    cache = target.kv_cache = x["kv_cache"].copy()
    step = ref.greedy_step(target, FixedDrafter(x["draft_logits"]), x["root_token_ids"],
                           x["block_table"], x["prefix_lens"], k=int(x["k"]),
                           budget=int(x["budget"]))
    np.testing.assert_array_equal(step.tree.parents, want["tree.parents"])
    np.testing.assert_array_equal(step.accept.accept_tokens, want["accept.accept_tokens"])
    np.testing.assert_array_equal(step.prefix_lens, want["prefix_lens"])
    assert cache.tobytes() == want["kv_cache"].tobytes()

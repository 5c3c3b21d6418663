"""KDTR: a small binary container of named tensors, for golden fixtures shared with native code.

Byte layout (version 1; every integer little-endian; offsets from the start of the file)::

    header, 16 bytes
      0   4  magic        b"KDTR"
      4   4  version      u32 = 1
      8   4  count        u32, number of tensors (<= 65536)
     12   4  reserved     u32 = 0
    directory, count entries of 152 bytes each, starting at byte 16
      0  64  name         ASCII [A-Za-z0-9_.-], 1..63 characters, NUL-padded
     64   4  dtype        u32 code (table below)
     68   4  rank         u32, 0..8
     72  64  shape        8 x u64; entries at and past `rank` are 0; the non-zero extents
                          times the itemsize multiply to at most 2**63 - 1
    136   8  offset       u64, where the data starts; a multiple of 64
    144   8  nbytes       u64 = product(shape) * itemsize
    data
      each tensor's bytes, C order, little-endian, at its offset; the first offset is the
      directory end rounded up to 64; tensors do not overlap and end inside the file

    dtype codes: 1 int32, 2 int64, 3 uint8, 4 bool (one byte, 0 or 1), 5 uint32, 6 float16,
                 7 bfloat16, 8 float32, 9 float64

Reading is defensive: the whole directory is checked (magic, version, count, names, codes,
ranks, unused shape slots, products without overflow, extents of empty tensors, nbytes,
alignment, bounds, overlaps, duplicate names) before any tensor is allocated, and every problem
raises ``KdtrError`` (a ``ValueError``) naming the tensor and the field. Names outside the
allowed ASCII set are rejected when saving and when loading; bool tensors are written as bytes
0 and 1 whatever bytes the array held.
"""

from __future__ import annotations

import os
import re
import struct
import tempfile

import numpy as np

from .arrays import BFLOAT16

MAGIC = b"KDTR"
VERSION = 1
HEADER = struct.Struct("<4sIII")               # magic, version, count, reserved
ENTRY = struct.Struct("<64sII8QQQ")            # name, dtype, rank, shape[8], offset, nbytes
MAX_RANK = 8
MAX_TENSORS = 65536
#: Largest product of a shape's non-zero extents times the itemsize: a signed 64-bit byte
#: count, what numpy (``intp``) and C (``int64_t`` / ``ptrdiff_t`` strides) can index. It bounds
#: empty tensors too, whose zero extent would otherwise let the others be anything.
MAX_SPAN = 2**63 - 1
ALIGN = 64
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,63}")

DTYPE_CODES = {
    1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("u1"), 4: np.dtype("?"),
    5: np.dtype("<u4"), 6: np.dtype("<f2"), 7: BFLOAT16, 8: np.dtype("<f4"),
    9: np.dtype("<f8"),
}
CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


class KdtrError(ValueError):
    """A KDTR file or a tensor to save breaks the format."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _code_of(name: str, array: np.ndarray) -> int:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    for known, code in CODE_OF.items():
        if dtype == known:
            return code
    names = "int32, int64, uint8, bool, uint32, float16, bfloat16, float32, float64"
    raise KdtrError(f"{name}: dtype {array.dtype} cannot be stored (supported: {names})")


def save_kdtr(path, **arrays) -> None:
    """Write ``arrays`` (name -> array-like) to ``path`` as a KDTR file, atomically.

    Names must match ``[A-Za-z0-9_.-]{1,63}``; arrays of rank 0 to 8 of the supported dtypes.
    """
    if len(arrays) > MAX_TENSORS:
        raise KdtrError(f"at most {MAX_TENSORS} tensors per file, got {len(arrays)}")
    entries, blobs = [], []
    offset = _align(HEADER.size + ENTRY.size * len(arrays))
    for name, value in arrays.items():
        if not NAME_PATTERN.fullmatch(name):
            raise KdtrError(f"tensor name {name!r}: expected 1 to 63 characters of "
                            "[A-Za-z0-9_.-] (ASCII only)")
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as error:    # ragged nested lists, odd objects
            raise KdtrError(f"{name}: cannot be stored as an array: {error}") from None
        code = _code_of(name, array)
        if array.ndim > MAX_RANK:
            raise KdtrError(f"{name}: rank {array.ndim} > {MAX_RANK}")
        if code == CODE_OF[np.dtype("?")]:
            array = array.view(np.uint8) != 0       # bool bytes other than 0 / 1 -> 0 / 1
        data = np.ascontiguousarray(array.astype(DTYPE_CODES[code], copy=False)).tobytes()
        shape = list(array.shape) + [0] * (MAX_RANK - array.ndim)
        entries.append(ENTRY.pack(name.encode("ascii"), code, array.ndim, *shape, offset,
                                  len(data)))
        blobs.append((offset, data))
        offset = _align(offset + len(data))
    directory = HEADER.pack(MAGIC, VERSION, len(arrays), 0) + b"".join(entries)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kdtr-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(directory)
            for start, data in blobs:
                f.write(b"\0" * (start - f.tell()))
                f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)               # mkstemp creates 0600: use the umask
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def parse_directory(buffer: bytes) -> list:
    """Validate the header and directory of a KDTR image; return its entries.

    Each entry is ``(name, dtype, shape, offset, nbytes)``. Nothing proportional to the
    declared shapes is allocated.
    """
    size = len(buffer)
    if size < HEADER.size:
        raise KdtrError(f"truncated: {size} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, count, _ = HEADER.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise KdtrError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise KdtrError(f"unknown version {version}, expected {VERSION}")
    if count > MAX_TENSORS:
        raise KdtrError(f"tensor count {count} > {MAX_TENSORS}")
    data_start = _align(HEADER.size + ENTRY.size * count)
    if HEADER.size + ENTRY.size * count > size:
        raise KdtrError(f"truncated: the directory of {count} tensors needs "
                        f"{HEADER.size + ENTRY.size * count} bytes, the file has {size}")
    entries, names = [], set()
    for k in range(count):
        raw_name, code, rank, *rest = ENTRY.unpack_from(buffer, HEADER.size + k * ENTRY.size)
        shape_slots, offset, nbytes = rest[:MAX_RANK], rest[MAX_RANK], rest[MAX_RANK + 1]
        name_bytes = raw_name.split(b"\0", 1)[0]
        if raw_name[len(name_bytes):].strip(b"\0"):
            raise KdtrError(f"tensor {k}: bytes after the name's NUL terminator")
        try:
            name = name_bytes.decode("ascii")
        except UnicodeDecodeError:
            raise KdtrError(f"tensor {k}: name is not ASCII") from None
        if not NAME_PATTERN.fullmatch(name):
            raise KdtrError(f"tensor {k}: name {name!r} is not 1 to 63 characters of "
                            "[A-Za-z0-9_.-]")
        if name in names:
            raise KdtrError(f"tensor {name}: duplicate name")
        names.add(name)
        if code not in DTYPE_CODES:
            raise KdtrError(f"tensor {name}: unknown dtype code {code}")
        if rank > MAX_RANK:
            raise KdtrError(f"tensor {name}: rank {rank} > {MAX_RANK}")
        if any(shape_slots[rank:]):
            raise KdtrError(f"tensor {name}: shape slots past rank {rank} are not 0")
        shape = tuple(int(s) for s in shape_slots[:rank])
        dtype = DTYPE_CODES[code]
        count_elems = 1
        span = dtype.itemsize                   # bytes of the non-zero extents
        for extent in shape:                    # Python ints: no overflow, but bound it
            span *= max(extent, 1)
            if span > MAX_SPAN:
                raise KdtrError(f"tensor {name}: shape {shape} too large: its non-zero "
                                f"extents span more than {MAX_SPAN} bytes")
            count_elems *= extent
            if count_elems * dtype.itemsize > size:
                raise KdtrError(f"tensor {name}: shape {shape} needs more bytes than the "
                                f"file has ({size})")
        if nbytes != count_elems * dtype.itemsize:
            raise KdtrError(f"tensor {name}: nbytes {nbytes} != product{shape} x "
                            f"{dtype.itemsize}")
        if offset % ALIGN:
            raise KdtrError(f"tensor {name}: offset {offset} is not a multiple of {ALIGN}")
        if offset < data_start or offset + nbytes > size:
            raise KdtrError(f"tensor {name}: bytes [{offset}, {offset + nbytes}) are outside "
                            f"the data region [{data_start}, {size})")
        entries.append((name, dtype, shape, offset, nbytes))
    spans = sorted((e[3], e[3] + e[4], e[0]) for e in entries if e[4])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise KdtrError(f"tensors {first} and {second} overlap")
    return entries


def load_kdtr(path) -> dict:
    """Read a KDTR file: ``{name: numpy array}`` in directory order.

    Raises :class:`~ddtree_numba.KdtrError` for a malformed file (see the module docstring).
    """
    with open(path, "rb") as f:
        buffer = f.read()
    out = {}
    for name, dtype, shape, offset, nbytes in parse_directory(buffer):
        if nbytes == 0:
            out[name] = np.empty(shape, dtype)
            continue
        if dtype == np.dtype("?") and max(buffer[offset : offset + nbytes]) > 1:
            raise KdtrError(f"tensor {name}: a bool byte other than 0 or 1")
        out[name] = np.frombuffer(buffer, dtype=dtype, count=nbytes // dtype.itemsize,
                                  offset=offset).reshape(shape).copy()
    return out

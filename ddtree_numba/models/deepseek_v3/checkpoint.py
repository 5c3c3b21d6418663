"""Hugging Face safetensors checkpoints of the DeepSeek-V3 architecture, read lazily.

A checkpoint folder holds ``config.json`` and either one ``model.safetensors`` or shards listed
by ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). A
:class:`Checkpoint` is a read-only mapping from tensor names to numpy arrays that opens each
shard once and reads a tensor only when it is asked for (through the ``safetensors`` package's
numpy API), so a 16-billion-parameter model is never read into host memory whole.

Official DeepSeek-V3 and Kimi-K2 releases store most weights as float8 (e4m3) with one float32
scale per 128 x 128 block (``quantization_config``: ``quant_method`` ``"fp8"``,
``weight_block_size`` ``[128, 128]``; the scale of ``W`` is ``W_scale_inv``). Asked for such a
weight, the checkpoint returns it dequantised to float32: ``W[i, j] * W_scale_inv[i // 128,
j // 128]``. Other quantisations are refused with a message saying so. The multi-token-prediction
layers (``model.layers.{num_hidden_layers}...``) are not listed: the next-token forward does
not use them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from .config import DeepseekV3Config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Checkpoint(Mapping):
    """Tensor name -> numpy array of a checkpoint folder (read on access, never cached).

    Attributes
    ----------
    config : DeepseekV3Config
        From the folder's ``config.json``.
    """

    def __init__(self, folder: str):
        if not os.path.isdir(folder):
            raise ValueError(f"folder: expected a checkpoint folder, got {folder!r} (not a "
                             f"directory)")
        self.folder = folder
        self.config = DeepseekV3Config.from_json(folder)
        self.block = _fp8_block(self.config.extra.get("quantization_config"))
        index = os.path.join(folder, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(folder, SINGLE)):
            weight_map = dict.fromkeys(_tensor_names(os.path.join(folder, SINGLE)), SINGLE)
        else:
            raise ValueError(f"folder: {folder!r} holds neither {SINGLE} nor {INDEX}")
        self.files = weight_map                                     # every tensor, scales too
        layers = self.config.num_hidden_layers
        self.names = sorted(n for n in weight_map if not n.endswith("_scale_inv")
                            and int((_LAYER.match(n) or [0, 0])[1]) < layers)
        self._listed = set(self.names)
        self._handles = {}
        self._headers = {}

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self):
        return iter(self.names)

    def __contains__(self, name) -> bool:
        return name in self._listed

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self:
            raise KeyError(f"{name}: no such tensor in {self.folder}")
        handle = self._handle(self.files[name])
        if handle.get_slice(name).get_dtype() != "F8_E4M3":
            return handle.get_tensor(name)
        if self.block is None:
            raise ValueError(f"{name}: a float8 weight, but config.json has no fp8 "
                             f"quantization_config with weight_block_size")
        scale_name = f"{name}_scale_inv"
        if scale_name not in self.files:
            raise ValueError(f"{name}: a float8 weight without {scale_name}")
        weight = self._read_fp8(self.files[name], name)
        scale = self._handle(self.files[scale_name]).get_tensor(scale_name)
        return dequantize_fp8(weight, scale, self.block)

    def _read_fp8(self, file: str, name: str) -> np.ndarray:
        """A float8 (e4m3) tensor, memory-mapped (numpy's safetensors API has no float8 type);
        each shard's header is parsed once."""
        if file not in self._headers:
            self._headers[file] = _header(os.path.join(self.folder, file))
        header, start = self._headers[file]
        entry = header[name]
        begin, end = entry["data_offsets"]
        raw = np.memmap(os.path.join(self.folder, file), np.uint8, mode="r",
                        offset=start + begin, shape=(end - begin,))
        return raw.view(ml_dtypes.float8_e4m3fn).reshape(entry["shape"])

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(os.path.join(self.folder, file), framework="numpy")
        return self._handles[file]


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """``float32``: ``weight[i, j] * scale_inv[i // bi, j // bj]`` (the last blocks may be
    partial)."""
    bi, bj = block
    rows, cols = weight.shape
    want = (-(-rows // bi), -(-cols // bj))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv: expected float32{list(want)} for a [{rows}, {cols}] weight "
                         f"in {bi} x {bj} blocks, got {list(scale_inv.shape)}")
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bi, 0), bj, 1)
    return weight.astype(np.float32) * scale[:rows, :cols]


def _fp8_block(quantization):
    """``(128, 128)`` for DeepSeek's block fp8, ``None`` without quantisation; other schemes
    are refused by name."""
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    block = quantization.get("weight_block_size")
    if method != "fp8" or quantization.get("fmt", "e4m3") != "e4m3" or not block:
        raise ValueError(f"quantization_config: only DeepSeek's block float8 (quant_method "
                         f"'fp8', fmt 'e4m3', weight_block_size) is dequantised; got "
                         f"{quantization}")
    return tuple(int(b) for b in block)


def _header(path: str) -> tuple:
    """``(header dict, data offset)`` of a safetensors file: an 8-byte little-endian length,
    then that many bytes of JSON, then the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _tensor_names(path: str) -> list:
    return [k for k in _header(path)[0] if k != "__metadata__"]

"""A GGUF file's tensors as our quantized layouts (kernels/quant_linear.py), one tensor at a time,
read memory-mapped with the `gguf` package: no full-precision copy of the model ever exists.

Each tensor is served in the best layout its type maps to ("Q4_K_M" and "Q5_K_M" files mix several):

    Q4_0, Q4_1             -> int4, groups of 32, exactly (Q4_0: w = d (q - 8); Q4_1: w = d q + m)
    Q2_K, Q3_K, Q4_K       -> int4, groups of 32, requantized: each holds uniform grids of at most 16 levels
                              on sub-blocks of 16-32 values, which int4 groups of 32 hold to half a step
    every other quantized type the `gguf` package reads (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, the IQ, TQ and FP4
    types)                 -> int8 rows (one scale per output row), requantized from the dequantized tensor
    F32, F16, BF16         -> the model dtype (dense)

Only a type the `gguf` package cannot read fails, naming the tensor and its type. ``conversions`` counts
what was converted to what, for the start-up log.

Row order: llama.cpp's converter permutes the rows of Llama's q and k projections (rotary pairs
interleaved); ``unpermute_rows`` undoes it as transformers' GGUF loader does, so the weights match the
HF folder converted from the same file.
"""
from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import torch

from engine.errors import InvalidConfigError
from kernels.quant_linear import (
    QuantizedWeight, int4_from_groups, int4_groups_of_float, int8_from_channels, int8_from_float, int8_rows_of_float,
)

EXACT_INT4 = ("Q4_0", "Q4_1")
REQUANT_INT4 = ("Q2_K", "Q3_K", "Q4_K")
DENSE = ("F32", "F16", "BF16")


def readable(kind: str) -> bool:
    """Whether the `gguf` package dequantizes this tensor type."""
    import gguf
    from gguf.quants import dequantize

    qtype = getattr(gguf.GGMLQuantizationType, kind, None)
    if qtype is None:
        return False
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, size * (256 // block if block < 256 else 1)), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False
    return True


def layout_of(kind: str) -> str:
    """The layout a tensor of GGUF type ``kind`` is served in: "int4", "int8" or "dense"."""
    if kind in DENSE:
        return "dense"
    return "int4" if kind in EXACT_INT4 + REQUANT_INT4 else "int8"


class UnsupportedQuantizationError(InvalidConfigError):
    """A GGUF tensor type (or a quantization setting) this server cannot run quantized."""


class GGUFTensors:
    """Name -> tensor view of one GGUF file (memory-mapped)."""

    def __init__(self, path: str | Path, int4_layout=None) -> None:
        """``int4_layout``: int4_from_groups' layout choice (kernels/quant_linear.int4_layout_chooser)."""
        from gguf import GGUFReader

        self.int4_layout = int4_layout
        self.conversions: collections.Counter[tuple[str, str]] = collections.Counter()  # (type, layout) -> tensors
        self.path = Path(path)
        self._reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self._reader.fields.get("general.architecture")
        self.architecture = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def type_of(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def is_quantized(self) -> bool:
        return any(t.tensor_type.name not in DENSE for t in self._tensors.values())

    def dense(self, name: str) -> torch.Tensor:
        """A float tensor (any type, dequantized if it is quantized), in the HF shape."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape))
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)).reshape(shape)).float()

    def quantized(self, name: str, rows: np.ndarray | None = None) -> QuantizedWeight:
        """The 2-D weight ``name`` ([out, in]) in our layout; ``rows`` reorders its output rows."""
        return pack(self.unpacked(name, rows), self.int4_layout)

    def unpacked(self, name: str, rows: np.ndarray | None = None) -> tuple:
        """("int4", q, scale, zero), ("int8", q, scale) or ("dense", w) before packing: weights that share an
        input (q, k, v) are stacked in this form, then packed once (the int4 pack tiles rows together)."""
        t = self._tensors[name]
        kind = t.tensor_type.name
        layout = layout_of(kind)
        self.conversions[(kind, layout)] += 1
        if kind in EXACT_INT4:
            return ("int4", *_exact_int4(np.asarray(t.data), kind, rows))
        if kind not in DENSE and not readable(kind):
            raise UnsupportedQuantizationError(
                f"{self.path.name}: tensor {name} is {kind}, a type the gguf package cannot read; pass "
                "quantization='none' to let transformers dequantize the file instead.")
        w = self.dense(name)
        if rows is not None:
            w = w[torch.from_numpy(rows)]
        if layout == "dense":
            return ("dense", w)
        return ("int4", *int4_groups_of_float(w)) if layout == "int4" else ("int8", *int8_rows_of_float(w))

    def summary(self) -> str:
        """What was converted to what: "81 Q5_0 -> int8, 27 Q4_K -> int4, ..." (most first)."""
        return ", ".join(f"{n} {kind} -> {layout}" for (kind, layout), n in self.conversions.most_common())


def pack(parts: tuple, int4_layout=None) -> QuantizedWeight | torch.Tensor:
    """A QuantizedWeight, or the float tensor itself for "dense" parts."""
    if parts[0] == "dense":
        return parts[1]
    if parts[0] == "int8":
        return int8_from_channels(*parts[1:])
    q, scale, zero = parts[1:]
    return int4_from_groups(q, scale, zero, q.shape[1] // scale.shape[1], layout=int4_layout)


def stack(parts: list[tuple], int4_layout=None) -> QuantizedWeight | torch.Tensor:
    """One weight of several unpacked ones with the same input, rows in order. Mixed layouts in one group
    take the finest among them: dense if any part is dense, else int8 rows if any part is int8."""
    kinds = {p[0] for p in parts}
    if "dense" in kinds:
        return torch.cat([_float(p) for p in parts])
    if len(kinds) > 1:  # int4 beside int8: all as int8 rows
        parts = [p if p[0] == "int8" else ("int8", *int8_rows_of_float(_dense_int4(p))) for p in parts]
    return pack((parts[0][0], *(torch.cat([p[i] for p in parts]) for i in range(1, len(parts[0])))), int4_layout)


def _float(p: tuple) -> torch.Tensor:
    if p[0] == "dense":
        return p[1]
    return _dense_int4(p) if p[0] == "int4" else p[1].float() * p[2][:, None]


def _dense_int4(p: tuple) -> torch.Tensor:
    _, q, scale, zero = p
    n, k = q.shape
    g = k // scale.shape[1]
    return ((q.float().reshape(n, -1, g) - 8) * scale[..., None] + zero[..., None]).reshape(n, k)


def _exact_int4(data: np.ndarray, kind: str, rows: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    block = 18 if kind == "Q4_0" else 20
    n = data.shape[0]
    blocks = data.reshape(n, -1, block)  # [N, K/32, bytes]
    if rows is not None:
        blocks = blocks[rows]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    qs = blocks[..., block - 16:]  # [N, K/32, 16]: byte j holds weights j (low nibble) and j + 16 (high)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # [N, K]
    if kind == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d  # d q + m = d (q - 8) + (m + 8 d)
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero)


def unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    dim = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(n_rows)


def quantized_embedding_weight(tensors: GGUFTensors, name: str) -> QuantizedWeight:
    """The token embedding (and tied LM head) as int8 rows: one scale per token, gathered by lookup."""
    t = tensors.type_of(name)
    if t not in DENSE and not readable(t):
        raise UnsupportedQuantizationError(f"{tensors.path.name}: tensor {name} is {t}, a type the gguf package "
                                           "cannot read; pass quantization='none' to dequantize the file instead.")
    tensors.conversions[(t, "int8")] += 1
    return int8_from_float(tensors.dense(name)) if t != "Q8_0" else _q8_0_rows(tensors, name)


def _q8_0_rows(tensors: GGUFTensors, name: str) -> QuantizedWeight:
    """Q8_0 (a scale per 32 values) to one scale per row without a float copy of the whole table."""
    data = np.asarray(tensors._tensors[name].data)
    n = data.shape[0]
    blocks = data.reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    q = blocks[..., 2:].view(np.int8).astype(np.float32)  # [N, K/32, 32]
    row_scale = np.maximum((np.abs(q).max(-1) * d).max(-1) / 127, 1e-12)  # [N]
    requant = np.clip(np.rint(q * (d / row_scale[:, None])[..., None]), -127, 127).astype(np.int8).reshape(n, -1)
    return int8_from_channels(torch.from_numpy(requant), torch.from_numpy(row_scale.astype(np.float32)))

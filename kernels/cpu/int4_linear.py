"""Weight-only int4 linear with int8 activations on CPU, through the C kernel in csrc/int4_linear.c.

    int4_linear_cpu(x[M, K], packed, scales, group_size) -> out[M, N]     (x float32 or bfloat16)
    int4_linear_torch(...)                                               the torch reference, same signature
    int8_linear_cpu(x[M, K], packed, scales) -> out[M, N] float32        an int8 table (LM head), same tiles
    int8_linear_torch(...)                                               its reference

The weights are groups of ``group_size`` inputs, w = q * d + m with q in [0, 15], packed by
:func:`pack_int4` into the kernel's tiles of 16 output columns (layout in the C file). Each row of x
is quantized per block of 32 inputs into two int8 digits, x = ad (hi + lo / 254) with
ad = max|x| / 127 (round to nearest even): ~16 bits against the block's largest input. The reference
does the same quantization, then the same sums in float64, so the two agree to float32 rounding.
"""

from __future__ import annotations

import torch

from .native import native_kernels

TILE = 16  # output columns per tile
ACT_BLOCK = 32  # inputs sharing one int8 activation scale


def supports(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the C kernel exists on this CPU and takes this shape."""
    native = native_kernels()
    return (native is not None and native.int4_linear is not None and out_features % TILE == 0
            and group_size % ACT_BLOCK == 0 and in_features % group_size == 0)


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] integers in [0, 15]; d, m [N, K/g] (w = q * d + m) ->
    (packed uint8 [N/16, K/8, 16, 4], scales float16 [N/16, K/g, 2, 16]). ``m`` None: symmetric groups
    (GGUF's Q4_0: w = (q - 8) d), scales [N/16, K/g, 1, 16] holding d alone: the kernel takes m = -8 d, and a
    decode step reads a tenth fewer bytes."""
    n, k = q.shape
    g = k // d.shape[1]
    if n % TILE or k % g or g % ACT_BLOCK or d.shape != (n, k // g) or (m is not None and m.shape != d.shape):
        raise ValueError(f"pack_int4: q {tuple(q.shape)}, d {tuple(d.shape)}, m {None if m is None else tuple(m.shape)}")
    u = q.to(torch.uint8).reshape(n // TILE, TILE, k // 8, 2, 4)  # k = 8 o + 4 h + i
    packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()  # [N/16, K/8, 16, 4]
    parts = [d] if m is None else [d, m]
    dm = torch.stack(parts).float().reshape(len(parts), n // TILE, TILE, k // g)  # [1 or 2, N/16, 16, K/g]
    half = dm.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError("pack_int4: a group scale or offset overflows float16")
    return packed, half.permute(1, 3, 0, 2).contiguous()  # [N/16, K/g, 2 or 1, 16]


def is_symmetric(scales: torch.Tensor) -> bool:
    """Whether packed scales hold d alone (m = -8 d)."""
    return scales.shape[2] == 1


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4`: (q [N, K] uint8, d, m [N, K/g] float32; m = -8 d when symmetric)."""
    tiles, octets = packed.shape[:2]
    n, k = tiles * TILE, octets * 8
    q = torch.stack([packed & 0x0F, packed >> 4], dim=2)  # [N/16, K/8, 2, 16, 4]
    q = q.permute(0, 3, 1, 2, 4).reshape(n, k)
    dm = scales.float().permute(2, 0, 3, 1).reshape(scales.shape[2], n, scales.shape[1])  # [2 or 1, N, K/g]
    return q, dm[0], -8 * dm[0] if is_symmetric(scales) else dm[1]


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the kernel computes with."""
    q, d, m = unpack_int4(packed, scales)
    g = q.shape[1] // d.shape[1]
    return q.float() * d.repeat_interleave(g, 1) + m.repeat_interleave(g, 1)


def int4_dequantize_cpu(packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize_int4` in C (csrc/int4_linear.c ps_int4_dequantize): the weight [N, K] from the packed
    form in float32, or bfloat16 (rounded to nearest even), for a prefill's rows through a GEMM
    (quant_linear.widened_int4_linear)."""
    n, k = packed.shape[0] * TILE, packed.shape[1] * 8
    if packed.dim() != 4 or packed.shape[2:] != (TILE, 4) or not packed.is_contiguous() or not scales.is_contiguous() \
            or scales.shape != (packed.shape[0], k // group_size, scales.shape[2], TILE) or k % group_size \
            or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4_dequantize: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
                         f"group {group_size}, {dtype}")
    out = torch.empty((n, k), dtype=dtype)
    native_kernels().int4_dequantize(packed.data_ptr(), scales.data_ptr(), out.data_ptr(), n, k, group_size,
                                     int(is_symmetric(scales)), int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def _check(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    if packed.dim() != 4 or packed.shape[2:] != (TILE, 4) or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"int4_linear: packed must be contiguous uint8 [N/16, K/8, 16, 4], got {tuple(packed.shape)}")
    n, k = packed.shape[0] * TILE, packed.shape[1] * 8
    if (scales.dtype != torch.float16 or not scales.is_contiguous() or group_size % ACT_BLOCK or k % group_size
            or scales.dim() != 4 or scales.shape[2] not in (1, 2)
            or scales.shape != (n // TILE, k // group_size, scales.shape[2], TILE)):
        raise ValueError(f"int4_linear: scales {tuple(scales.shape)} {scales.dtype} do not fit a [{n}, {k}] "
                         f"weight in groups of {group_size}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4_linear: x must be float32 or bfloat16 [M, {k}], got {tuple(x.shape)} {x.dtype}")


def int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                    two_digits: bool = True) -> torch.Tensor:
    """x [M, K] float32 / bfloat16 -> [M, N] in x's dtype (see module docstring; ``two_digits`` False: one int8
    digit per input, as llama.cpp's Q8 rows, half the multiply-adds)."""
    _check(x, packed, scales, group_size)
    return int4_linear_unchecked(x, packed, scales, group_size, two_digits)


def int4_linear_unchecked(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                          group_size: int, two_digits: bool = True) -> torch.Tensor:
    """:func:`int4_linear_cpu` for operands already checked: packed and scales as pack_int4 made them,
    x float32 / bfloat16 [M, K] (quant_linear's per-call path: the checks cost ~5 us, a third of a
    one-row call)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], packed.shape[0] * TILE
    out = torch.empty((m, n), dtype=x.dtype)
    if m == 0:
        return out
    rc = native_kernels().int4_linear(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), m, n,
                                      x.shape[1], group_size, x.stride(0), n, int(x.dtype == torch.bfloat16),
                                      torch.get_num_threads(), int(scales.shape[2] == 1), int(two_digits))
    if rc:
        raise MemoryError("int4_linear: no memory for the quantized activations")
    return out


def supports_int8(out_features: int, in_features: int) -> bool:
    """Whether the 8-bit variant (an int8 LM head's logits) exists on this CPU and takes this shape."""
    native = native_kernels()
    return (native is not None and native.int8_linear is not None and out_features % TILE == 0
            and in_features % ACT_BLOCK == 0)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 table q [N, K] in [-127, 127] with one scale per row [N] (w = q * scale) -> (packed uint8
    [N/16, K/4, 16, 4] holding q + 128, scales float16 [N/16, 1, 2, 16]: d = scale, m = -128 scale), for
    :func:`int8_linear_cpu` (one group of K inputs)."""
    n, k = q.shape
    if n % TILE or k % ACT_BLOCK or scale.shape != (n,) or q.dtype != torch.int8:
        raise ValueError(f"pack_int8: q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)}")
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(n // TILE, TILE, k // 4, 4)
    packed = u.permute(0, 2, 1, 3).contiguous()  # [N/16, K/4, 16, 4]
    dm = torch.stack([scale.float(), -128 * scale.float()]).reshape(2, n // TILE, 1, TILE).to(torch.float16)
    if not torch.isfinite(dm).all():
        raise ValueError("pack_int8: a row scale overflows float16")
    return packed, dm.permute(1, 2, 0, 3).contiguous()  # [N/16, 1, 2, 16]


def dequantize_int8(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 table [N, K] :func:`int8_linear_cpu` computes with (its float16 scales)."""
    tiles, quads = packed.shape[:2]
    q = packed.permute(0, 2, 1, 3).reshape(tiles * TILE, quads * 4).float()  # [N, K], q + 128
    dm = scales.float().permute(2, 0, 3, 1).reshape(2, tiles * TILE, 1)  # [2, N, 1]
    return q * dm[0] + dm[1]


def _check8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    if packed.dim() != 4 or packed.shape[2:] != (TILE, 4) or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"int8_linear: packed must be contiguous uint8 [N/16, K/4, 16, 4], got {tuple(packed.shape)}")
    n, k = packed.shape[0] * TILE, packed.shape[1] * 4
    if scales.dtype != torch.float16 or not scales.is_contiguous() or scales.shape != (n // TILE, 1, 2, TILE) \
            or k % ACT_BLOCK:
        raise ValueError(f"int8_linear: scales {tuple(scales.shape)} {scales.dtype} do not fit a [{n}, {k}] table")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int8_linear: x must be float32 or bfloat16 [M, {k}], got {tuple(x.shape)} {x.dtype}")


def int8_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    two_digits: bool = True) -> torch.Tensor:
    """x [M, K] float32 / bfloat16 -> [M, N] float32: the int8 table of :func:`pack_int8` against x's two int8
    digits (or one), through the int4 kernel's tiles with 8-bit weights (csrc/int4_linear.c ps_int8_linear)."""
    _check8(x, packed, scales)
    x = x if x.stride(1) == 1 else x.contiguous()
    xf = x.float() if x.dtype != torch.float32 else x
    m, n, k = xf.shape[0], packed.shape[0] * TILE, xf.shape[1]
    out = torch.empty((m, n), dtype=torch.float32)
    if m == 0:
        return out
    rc = native_kernels().int8_linear(xf.data_ptr(), packed.data_ptr(), scales.data_ptr(), out.data_ptr(), m, n, k,
                                      k, xf.stride(0), n, 0, torch.get_num_threads(), int(two_digits))
    if rc:
        raise MemoryError("int8_linear: no memory for the quantized activations")
    return out


def int8_linear_torch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                      two_digits: bool = True) -> torch.Tensor:
    """The reference of :func:`int8_linear_cpu`: the same int8 rows, the sums in float64."""
    _check8(x, packed, scales)
    xa = _activations_as_seen(x, two_digits)  # [M, K]
    return (xa @ dequantize_int8(packed, scales).double().t()).float()


def quantize_activations(x: torch.Tensor, two_digits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (hi + lo / 254 [M, K] float32, ad [M, K/32]): the kernel's two int8 digits (one: hi alone)."""
    xb = x.float().reshape(x.shape[0], -1, ACT_BLOCK)  # [M, K/32, 32]
    amax = xb.abs().amax(-1)  # [M, K/32]
    # 127 / amax as the kernel divides (torch computes a scalar over a tensor as a reciprocal times 127: an ulp off,
    # which moves the ties of one digit)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xs = xb * inv[..., None]
    hi = torch.round(xs)  # half to even, as the kernel's conversion
    if not two_digits:
        return hi.reshape(x.shape), amax / 127.0
    lo = torch.round((xs - hi) * 254)  # in [-127, 127]
    return (hi + lo / 254).reshape(x.shape), amax / 127.0


def _activations_as_seen(x: torch.Tensor, two_digits: bool = True) -> torch.Tensor:
    """x [M, K] as the kernels see it (its int8 digits times each block's scale), in float64."""
    aq, ad = quantize_activations(x, two_digits)
    blocks = aq.shape[1] // ACT_BLOCK
    return (aq.double().reshape(-1, blocks, ACT_BLOCK) * ad.double()[..., None]).reshape(aq.shape)


def int4_linear_torch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                      two_digits: bool = True) -> torch.Tensor:
    """The reference of :func:`int4_linear_cpu`: the same int8 rows, the sums in float64."""
    _check(x, packed, scales, group_size)
    w = dequantize_int4(packed, scales).double()  # [N, K]
    xa = _activations_as_seen(x, two_digits)  # [M, K]
    return (xa @ w.t()).to(x.dtype)

"""Weight-only low-bit linears through torch's own CPU kernels, with a torch reference of the same
signature (dequantize, then a float32 matmul).

Layouts (``QuantizedWeight.layout``):
    int4   groups of ``group_size`` input features share a scale and a zero:
           w = (q - 8) * scale + zero, q in [0, 15]; packed by _convert_weight_to_int4pack_for_cpu and
           run by _weight_int4pack_mm_for_cpu (scales_and_zeros [K/g, N, 2]).
    int4_vnni  the same groups, w = q * d + m, packed for kernels/cpu/int4_linear.py (the C kernel on
           AVX512-VNNI, or AVX2's vpmaddubsw: int8 activations, each 4-bit weight unpacked once for all
           rows); measured against int4 per shape at bind. Measured here (2-core Intel Xeon with AMX;
           benchmarks/cpu_kernels.py --cases int4: SmolLM2's 30 layers of linears, float32 inputs):
           2.9 vs 4.2 ms at 1 row, 5.9 vs 12.5 ms at 8 rows, 0.74 vs 1.38 s at 1,088 rows. AVX2 only
           (2-core AMD EPYC Zen 3, the dispatcher's timings): 8.8 vs 13.4 ms at 1 row, 1.42 vs 2.31 s at
           512 rows.
    int8   one scale per output row: w = q * scale, q in [-127, 127]; run by _weight_int8pack_mm.
torch's two kernels are computed in bfloat16 whatever the model dtype: their float32 paths are scalar.
Measured here (2-core AMD EPYC, K=576, N=1536): int4 0.029 ms at M=1 vs 0.073 ms for the dense
float32 linear and 0.061 ms dense bfloat16; 0.71 vs 0.70 ms (float32 dense) at M=64; 5.4 vs 4.8 ms
at M=512. int8, N=49152 (the LM head): 2.1 ms at M=1 vs 11.6 ms dense float32.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .cpu import int4_linear
from .cpu.hugepages import on_huge_pages
from .cpu.native import cpu_has_int8_dot

COMPUTE_DTYPE = torch.bfloat16


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear weight [out_features, in_features] kept quantized (see module docstring)."""

    layout: str  # "int4", "int4_vnni" or "int8"
    packed: torch.Tensor  # int4: the kernel's packed uint8; int4_vnni: [N/16, K/8, 16, 4] uint8; int8: [N, K] int8
    scales: torch.Tensor  # int4: scales_and_zeros [K/g, N, 2] bf16; int4_vnni: [N/16, K/g, 2, 16] fp16; int8: [N] bf16
    out_features: int
    in_features: int
    group_size: int = 0  # int4 / int4_vnni only
    exact_scales: torch.Tensor | None = None  # int8: the [N] scales in float32 (quantized_logits' refinement)
    # int8 LM head: (the rows prepacked for oneDNN's int8 matmul, their zero points [N]) (with_onednn_int8)
    onednn: tuple[torch.Tensor, torch.Tensor] | None = None
    # int8 LM head: the table in bfloat16, packed for oneDNN, where that computes its logits fastest here
    dense: torch.Tensor | None = None
    # int8 LM head: the table in the C kernel's 8-bit tiles (packed, scales: int4_linear.pack_int8), where chosen
    vnni: tuple[torch.Tensor, torch.Tensor] | None = None
    # int8 LM head: ((up to rows, kernel), ...) as measured at bind (with_logits_kernels); () the flags' choice
    logits_spans: tuple[tuple[int, str], ...] = ()
    # int4_vnni: calls on more rows than this widen the weight to float32 for the float32 GEMM (with_gemm_rows);
    # None: the int4 kernel at every row count
    gemm_above: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held: the table and its scales, and the second forms an LM head keeps (oneDNN's int8 rows,
        the bfloat16 table, the 8-bit tiles)."""
        extra = (self.packed.numel() if self.onednn is not None else 0) + \
            (self.in_features * self.out_features * 2 if self.dense is not None else 0) + \
            (sum(t.numel() * t.element_size() for t in self.vnni) if self.vnni is not None else 0)
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size() + extra

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)


def int4_from_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int = 32,
                     layout: Callable[[int, int, int], str] | None = None) -> QuantizedWeight:
    """q [N, K] integers in [0, 15]; scale, zero [N, K/group_size]: w = (q - 8) * scale + zero. ``layout``
    (n, k, group_size) -> "int4_vnni" | "int4" picks the layout (measured: int4_layout_chooser); by default
    int4_vnni wherever its C kernel takes the shape."""
    n, k = q.shape
    if k % group_size or scale.shape != (n, k // group_size) or zero.shape != scale.shape:
        raise ValueError(f"int4: q {tuple(q.shape)}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)}, "
                         f"group {group_size}")
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError("int4: q must lie in [0, 15]")
    vnni = int4_linear.supports(n, k, group_size)
    if vnni and layout is not None:
        vnni = layout(n, k, group_size) == "int4_vnni"
    return (_pack_int4_vnni if vnni else _pack_int4_torch)(q, scale, zero, group_size)


def _pack_int4_vnni(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> QuantizedWeight:
    n, k = q.shape
    # Symmetric groups (GGUF's Q4_0: zero 0) keep d alone: m = -8 d is exact in float16 as in float32.
    m = zero - 8 * scale.float() if bool(zero.any()) else None
    packed, dm = int4_linear.pack_int4(q, scale, m)
    return QuantizedWeight("int4_vnni", on_huge_pages(packed), dm, n, k, group_size)  # streamed: 2 MiB pages


def _pack_int4_torch(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> QuantizedWeight:
    n, k = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales = torch.stack([scale.t(), zero.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()  # [K/g, N, 2]
    return QuantizedWeight("int4", packed, scales, n, k, group_size)


def int4_layout_chooser(dispatch) -> Callable[[int, int, int], str]:
    """int4_from_groups' ``layout``: each weight shape's layout measured here once (kernels/cpu/choices.py)."""
    from .cpu.choices import int4_layout

    def choose(n: int, k: int, group_size: int) -> str:
        candidates = {"int4_vnni": (lambda q, s, z: _pack_int4_vnni(q, s, z, group_size), quantized_linear),
                      "int4": (lambda q, s, z: _pack_int4_torch(q, s, z, group_size), quantized_linear)}
        return int4_layout(dispatch, n, k, group_size, candidates)

    return choose


def int8_from_channels(q: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """q [N, K] int8; scale [N]: w = q * scale."""
    n, k = q.shape
    if q.dtype != torch.int8 or scale.shape != (n,):
        raise ValueError(f"int8: q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)}")
    return QuantizedWeight("int8", on_huge_pages(q.contiguous()), scale.to(COMPUTE_DTYPE).contiguous(), n, k,
                           exact_scales=scale.float().contiguous())


def int4_groups_of_float(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 groups of a float weight [N, K] (error at most half a step per group):
    (q [N, K], scale, zero [N, K/group_size]) for int4_from_groups."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(n, k)
    return q.to(torch.int32), scale, lo + 8 * scale


def int8_rows_of_float(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a float weight [N, K] (error at most half a step per row): (q, scale)."""
    w = w.float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def int4_from_float(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    return int4_from_groups(*int4_groups_of_float(w, group_size), group_size)


def int8_from_float(w: torch.Tensor) -> QuantizedWeight:
    return int8_from_channels(*int8_rows_of_float(w))


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the kernels compute with (scales as stored: bfloat16, int4_vnni float16)."""
    if qw.layout == "int8":
        return qw.packed.float() * qw.scales.float()[:, None]
    if qw.layout == "int4_vnni":
        return int4_linear.dequantize_int4(qw.packed, qw.scales)
    eye = torch.eye(qw.in_features, dtype=COMPUTE_DTYPE)
    # The kernel applied to the identity returns W^T exactly as it computes it.
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, qw.packed, qw.group_size, qw.scales).float().t()


def _check(x: torch.Tensor, qw: QuantizedWeight) -> None:
    if x.dim() != 2 or x.shape[1] != qw.in_features:
        raise ValueError(f"quantized_linear: x {tuple(x.shape)} for a weight of {qw.shape}")


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                     two_digits: bool = True) -> torch.Tensor:
    """x [M, K] (any float dtype) -> [M, N] in x's dtype. ``two_digits`` False: the C int4 kernel quantizes x to one
    int8 digit per input (llama.cpp's precision) where it takes two by default (steps without prompt tokens:
    with_quantized_linear)."""
    _check(x, qw)
    if two_digits and qw.gemm_above is not None and x.shape[0] > qw.gemm_above:  # a prompt's rows (decode: one digit)
        return _with_bias(widened_int4_linear(x, qw), bias)
    if qw.layout == "int4_vnni":  # packed and checked by int4_from_groups
        xk = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        y = int4_linear.int4_linear_unchecked(xk, qw.packed, qw.scales, qw.group_size, two_digits)
        if xk is x:  # in x's dtype already (a no-op .to costs ~3 us a call: 0.3 ms a step of SmolLM2's 120 linears)
            return _with_bias(y, bias)
    elif qw.layout == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(COMPUTE_DTYPE).contiguous(), qw.packed, qw.group_size,
                                                        qw.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE).contiguous(), qw.packed, qw.scales)
    return _with_bias(y.to(x.dtype), bias)


def widened_int4_linear(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: an int4_vnni weight widened for this call (the C kernel, ~0.1 ms for
    SmolLM2's largest) and multiplied by the GEMM of x's dtype: float32, or bfloat16 for bfloat16 activations
    (the weight rounded to bfloat16: 8 significant bits for a 4-bit value times a float16 scale). Why: where int8
    products go through AVX2's vpmaddubsw the int4 kernel multiplies at ~20 GMAC/s a core, the float32 GEMM at
    ~2x that; where oneDNN multiplies bfloat16 on AMX tiles a GEMM outruns the int4 kernel's two int8 digits
    many times over (with_gemm_rows measures where). The activations stay as they are, not two int8 digits."""
    dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    w = int4_linear.int4_dequantize_cpu(qw.packed, qw.scales, qw.group_size, dtype)  # [N, K]
    return F.linear(x.to(dtype), w).to(x.dtype)


def with_gemm_rows(qw, dispatch, dtype: torch.dtype = torch.float32):
    """An int4_vnni weight with ``gemm_above`` measured here for its shape and the activations' ``dtype``
    (kernels/cpu/choices.py int4_gemm_rows: the int4 kernel's two digits against :func:`widened_int4_linear` at
    prefill row counts); anything else as it is."""
    if not isinstance(qw, QuantizedWeight) or qw.layout != "int4_vnni":
        return qw
    from .cpu.choices import int4_gemm_rows

    plain = dataclasses.replace(qw, gemm_above=None)  # bound before: measured afresh
    above = int4_gemm_rows(dispatch, plain, {"int4_vnni": quantized_linear, "widened": widened_int4_linear}, dtype)
    return dataclasses.replace(plain, gemm_above=above)


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


REFINED_LOGITS = 64


def with_onednn_int8(qw: QuantizedWeight, probe: bool = False) -> QuantizedWeight:
    """An int8 LM head with its rows also prepacked for oneDNN's int8 x int8 matmul (VNNI / AMX-INT8),
    or the weight as it is where torch has no oneDNN int8 linear. Measured here (2-core Intel Xeon with
    AMX, V=49152, K=576): 0.75 vs 0.95 ms at 1 row, 1.4 vs 3.3 ms at 8 rows for _weight_int8pack_mm.
    Costs a second copy of the table (28 MiB for SmolLM2). Not on CPUs without an int8 dot product
    (cpu_has_int8_dot): oneDNN's AVX2 fallback saturates."""
    if (qw.layout != "int8" or qw.exact_scales is None or not hasattr(torch.ops.onednn, "qlinear_prepack")
            or not cpu_has_int8_dot()):
        return qw
    try:
        # probe: whether it packs at all, on a few rows (the whole table is packed only where it is bound)
        rows = qw.packed[:16] if probe else qw.packed
        packed = torch.ops.onednn.qlinear_prepack(rows, [1, qw.in_features])
    except RuntimeError:  # a torch built without oneDNN's x86 int8 kernels
        return qw
    return dataclasses.replace(qw, onednn=(packed, torch.zeros(qw.out_features, dtype=torch.int64)))


# The bfloat16 table is a second copy of the head at twice the int8 bytes (335 MiB for Gemma 3's 262k x 640), the
# 8-bit tiles and oneDNN's prepacked int8 table one each at the same bytes: at most one is kept, and only one that
# computes the logits at least this many times faster than the int8 table at some row count
# (choices.worth_their_memory).
HEAD_COPY_GAIN = 1.5


def with_logits_kernels(qw: QuantizedWeight, dispatch) -> QuantizedWeight:
    """An int8 LM head with the kernel of its logits measured here per row count (kernels/cpu/choices.py)
    among torch's int8 kernel ("int8pack"), the C int4 kernel's tiles with 8-bit weights on AVX512-VNNI or AVX2
    ("int8_vnni", a second copy at the int8 bytes, kept only where chosen), oneDNN's int8 matmul where the CPU has
    an int8 dot product ("onednn_int8", a prepacked second copy at the int8 bytes, kept only where chosen; measured
    once at 670 ms a call where oneDNN ran its reference kernel, against 26 ms for int8pack) and the table in
    bfloat16 through oneDNN ("bf16", a second copy at twice the int8 bytes, kept only where chosen); the float32
    refinement of quantized_logits follows any of them."""
    if qw.layout != "int8" or qw.exact_scales is None:
        return qw
    from .cpu.choices import lm_head_spans
    from .cpu.onednn_linear import onednn_bf16_supported, onednn_linear_available, pack_weight

    def bf16_table() -> torch.Tensor:
        return pack_weight(dequantize(qw).to(COMPUTE_DTYPE))  # oneDNN's packed form, or plain without its bf16

    def onednn_int8_fn():
        with_int8 = with_onednn_int8(qw)
        return lambda x: _onednn_int8_logits(x, with_int8)

    def bf16_fn():
        table = bf16_table()
        return lambda x: _bf16_table_logits(x, table)

    def int8_vnni_fn():
        packed, scales = int4_linear.pack_int8(qw.packed, qw.exact_scales)
        return lambda x: int4_linear.int8_linear_cpu(x, packed, scales, two_digits=False)

    candidates = {"int8pack": lambda: (lambda x: quantized_linear(x, qw).float())}
    if int4_linear.supports_int8(qw.out_features, qw.in_features):
        candidates["int8_vnni"] = int8_vnni_fn
    if with_onednn_int8(qw, probe=True).onednn is not None:
        candidates["onednn_int8"] = onednn_int8_fn
    # the bfloat16 table: through oneDNN where it has bfloat16 kernels, else through the C row kernel's AVX2 path
    # and the widened GEMM (on an AVX2-only AMD EPYC Zen 3 torch's int8 kernel took 10.5 ms at 1 row and 275 at
    # 64 for SmolLM2's head, the bfloat16 table 4.8 and ~50)
    if onednn_linear_available() and (onednn_bf16_supported() or _bf16_rows_kernel()):
        candidates["bf16"] = bf16_fn
    copies = {"int8_vnni": HEAD_COPY_GAIN, "onednn_int8": HEAD_COPY_GAIN, "bf16": HEAD_COPY_GAIN}  # one at most
    spans = lm_head_spans(dispatch, qw, candidates, second_copies=copies)
    used = {name for _, name in spans}
    return dataclasses.replace(qw, onednn=with_onednn_int8(qw).onednn if "onednn_int8" in used else None,
                               dense=bf16_table() if "bf16" in used else None, logits_spans=spans,
                               vnni=int4_linear.pack_int8(qw.packed, qw.exact_scales) if "int8_vnni" in used else None)


def _bf16_rows_kernel() -> bool:
    """The C row kernel takes bfloat16 here (AVX512-BF16, or AVX2's widening path)."""
    from .cpu.native import native_kernels

    native = native_kernels()
    return native is not None and native.linear_for(COMPUTE_DTYPE) is not None


def _bf16_table_logits(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the bfloat16 table [V, K]^T -> [M, V] float32: oneDNN on its packed form, else the C row kernel
    and the widened GEMM on the plain table."""
    from .cpu.linear import plain_bf16_linear
    from .cpu.onednn_linear import packed_linear

    xb = x.to(COMPUTE_DTYPE).contiguous()
    return (packed_linear(xb, table) if table.is_mkldnn else plain_bf16_linear(xb, table)).float()


def _logits_kernel(qw: QuantizedWeight, rows: int) -> str:
    if not qw.logits_spans:
        return "onednn_int8" if qw.onednn is not None else "int8pack"
    return next((name for upto, name in qw.logits_spans if rows <= upto), qw.logits_spans[-1][1])


def _onednn_int8_logits(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [M, K] -> [M, V] float32: each row quantized to int8 with its own scale (dynamic, symmetric),
    int8 x int8 in oneDNN with the rows' float32 scales, the row scale applied after."""
    xf = x.float()
    s = xf.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127  # [M, 1]
    xq = torch.round(xf / s).to(torch.int8)
    packed, zero = qw.onednn
    y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, qw.exact_scales, zero, None, 1.0, 0,
                                           torch.float32, "none", [], "")
    return y * s


def quantized_logits(x: torch.Tensor, qw: QuantizedWeight, refine: int = REFINED_LOGITS) -> torch.Tensor:
    """LM-head logits [M, V] float32 from an int8 table: the bfloat16 kernel for all V (or, prepacked
    by with_onednn_int8, oneDNN's int8 matmul on int8-quantized rows), then the ``refine`` largest of
    each row recomputed in float32 from the same int8 rows. The kernel's bfloat16 output has 8
    significant bits: at logits near 16 that is a step of 0.0625, enough to flip greedy choices
    (measured on SmolLM2's chat answer to the README's question: top-2 gap 0.08 in float32, a tie in
    bfloat16). Sampling reads only the top of the distribution; the tail keeps about that precision
    (int8 rows: measured within 0.9% of the largest logit)."""
    kernel = _logits_kernel(qw, x.shape[0])
    if kernel == "onednn_int8":
        logits = _onednn_int8_logits(x, qw)  # [M, V]
    elif kernel == "bf16":
        logits = _bf16_table_logits(x, qw.dense)  # [M, V]
    elif kernel == "int8_vnni":  # one int8 digit per input: the top of each row is recomputed below in float32
        logits = int4_linear.int8_linear_cpu(x, *qw.vnni, two_digits=False)  # [M, V]
    else:
        logits = quantized_linear(x, qw).float()  # [M, V]
    if qw.layout != "int8" or qw.exact_scales is None or refine <= 0:
        return logits
    top = logits.topk(min(refine, logits.shape[1]), dim=-1).indices  # [M, k]
    rows = qw.packed[top].float() * qw.exact_scales[top][..., None]  # [M, k, K]
    exact = torch.einsum("mk,mnk->mn", x.float(), rows)  # [M, k]
    return logits.scatter_(1, top, exact)


def quantized_linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same result from the dequantized weight in float32 (bfloat16 inputs, as torch's kernels see
    them; int4_vnni: the int8 rows its kernel sees)."""
    _check(x, qw)
    if qw.layout == "int4_vnni":
        y = int4_linear.int4_linear_torch(x.float(), qw.packed, qw.scales, qw.group_size)
    else:
        y = x.to(COMPUTE_DTYPE).float() @ dequantize(qw).t()
    return _with_bias(y.to(x.dtype), bias)


def with_quantized_linear(ops):
    """The op set with ``linear`` also taking QuantizedWeight (the backend's own linear otherwise),
    and ``pack_weight`` leaving quantized weights as they are: the one forward stays unchanged.

    Its ``decode_ops`` (a step without prompt tokens: decodes, speculative verification) run the C int4 kernel on
    one int8 digit per input, as llama.cpp's Q8 rows, where a step with prompt tokens keeps two. Why: at 8 rows the
    kernel is bound by its multiply-adds, and one digit halves them (SmolLM2's linears at batch 8: 6.8 -> 4.3 ms a
    step on a 2-core AMD EPYC Zen 4; at 1 row 1.78 -> 1.53), while a prompt's first token keeps the precision that
    answers the README's question as the dense model does (one digit in prefill turned its near-tie, "The" -1.92 /
    "L" -2.01, into "L'Étoile, ..."; one digit in decode moved perplexity 25.95 -> 25.98)."""
    dense_linear, dense_pack = ops.linear, ops.pack_weight
    pack_quantized = ops.pack_quantized or (lambda w: dataclasses.replace(w, gemm_above=None))  # no measured rows

    def pack_weight(w):
        return pack_quantized(w) if isinstance(w, QuantizedWeight) else dense_pack(w)

    def linears(two_digits: bool) -> dict:
        def linear(x, w, b=None):
            return quantized_linear(x, w, b, two_digits) if isinstance(w, QuantizedWeight) else dense_linear(x, w, b)

        if ops.linear_silu_mul is None:
            return {"linear": linear}
        dense_fused, silu_mul = ops.linear_silu_mul, ops.silu_mul

        def linear_silu_mul(x, w, b=None):
            return silu_mul(quantized_linear(x, w, b, two_digits)) if isinstance(w, QuantizedWeight) \
                else dense_fused(x, w, b)

        return {"linear": linear, "linear_silu_mul": linear_silu_mul}

    extra = {"pack_weight": pack_weight}
    if ops.linear_silu_mul is not None:
        dense_pack_gate_up = ops.pack_gate_up

        def pack_gate_up(w):
            return pack_quantized(w) if isinstance(w, QuantizedWeight) else dense_pack_gate_up(w)

        extra["pack_gate_up"] = pack_gate_up
    bound = dataclasses.replace(ops, **linears(True), **extra)
    return dataclasses.replace(bound, decode_ops=dataclasses.replace(bound, **linears(False)))

"""The "cpu" op set: the C kernels, bound once for one model dtype.

Two forms of each op:
  * the launchers (``add_rms_norm_cpu``, ``paged_attention_decode_cpu``, ``store_kv_cpu``,
    ``cpu_linear`` ...) check shapes, dtypes and strides on every call and fall back to the torch
    references for anything the C kernels do not cover: safe to call with anything (tests, debug);
  * the bound ops (``cpu_ops(dtype)``) hand raw pointers straight to the C kernels. What the
    launchers check per call is settled once here -- the library loaded, the dtype covered -- or
    by the model forward's own contract: its activations are row-contiguous, its weights
    contiguous in the model dtype (``LlamaForCausalLM.bind_ops`` verifies that once). The C
    kernels still check every block id and slot they read or write.

Why bound ops: decoding a few sequences (beams, n>1 samples, small batches) costs little
arithmetic per layer, so Python's share shows. Measured on SmolLM2 float32 (AVX-512 machine), a
4-row decode forward took 30.3 ms through modules and checking launchers and 24.1 ms through
direct kernel calls, most of the rest being the weight read.

Linear policy (one place; linear.c_kernel_rows): with AVX-512 the weights are packed at bind into
the lanes layout of csrc/lanes_linear.c, which takes every row count (CPUs with AMX: 1-64 float32
rows, oneDNN's packed copy above; bfloat16 runs the same layout on AMX tiles, csrc/amx_linear.c); with AVX2 only, oneDNN's packed copy, and the row kernel
(csrc/linear.c) on the plain weight for 1-8 float32 rows (linear.CpuLinearWeight). Unpacked weights
take the row kernel for 1-16 rows in float32 (1-8 in bfloat16 where the CPU has AVX512-BF16), oneDNN
for the other float32 row counts (MKL's sgemm takes an AVX2 path on AMD CPUs;
kernels/cpu/onednn_linear.py), F.linear otherwise. Without a C
compiler and without oneDNN, W @ x^T for 2-10 float32 rows, which measured faster than F.linear
on the machine it was tuned on.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from . import onednn_linear
from .native import NativeKernels, native_kernels
from ..copy_blocks import copy_blocks_torch
from .elementwise import add_rms_norm_cpu, rope_cpu, silu_mul_cpu
from .linear import (EVERY_ROW, CpuLinearWeight, c_kernel_rows, covers, has_amx_linear, has_lanes, lanes_launchers,
                     linear_covered, pack_lanes, pack_lanes_gated, row_reader, rows_covered, unpack_weight)
from ..interface import KernelOps
from ..quant_linear import with_gemm_rows, with_logits_kernels
from .paged_attention import call_decode, paged_attention_decode_cpu, paged_attention_prefill_cpu
from .choices import GEMM_ROWS, HEAD_ROWS, LINEAR_ROWS, gemm_form, linear_small_rows
from .dispatch import EVERY, Dispatcher
from .scratch import Scratch
from .store_kv import store_kv_cpu
from .widened_linear import WidenedWeight, widen, widened_linear

# Row counts for which W @ x^T is used (float32 on CPU) when neither the C kernel nor oneDNN is there.
WEIGHT_MAJOR_ROWS = range(2, 11)
logger = logging.getLogger(__name__)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The linear policy above, checking its operands on every call (any operands: F.linear's result)."""
    if covers(x, weight):
        return linear_covered(x, weight, bias)
    if onednn_linear.covers(x, weight):
        return onednn_linear.linear_covered(x, weight, bias)
    if not (x.dim() == 2 and x.shape[0] in WEIGHT_MAJOR_ROWS and weight.dtype == torch.float32
            and weight.device.type == "cpu"):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()  # [out, M] -> [M, out]
    return out if bias is None else out.add_(bias)


def checked_cpu_ops() -> KernelOps:
    """The launchers: every call checked, the references wherever a C kernel does not apply."""
    return KernelOps("cpu", _checked_linear, add_rms_norm_cpu, silu_mul_cpu, rope_cpu, store_kv_cpu,
                     paged_attention_decode_cpu, paged_attention_prefill_cpu, copy_blocks_torch, pack_weight,
                     linear_silu_mul=_checked_linear_silu_mul, pack_gate_up=pack_gate_up, unpack_weight=unpack_weight,
                     row_reader=row_reader)


def pack_weight(weight, *, gated: bool = False, rows: int | None = None, large: str | None = None):
    """A float32 / bfloat16 weight in the forms the bound linear reads on this CPU (linear.CpuLinearWeight):
    the C kernel's form (the lanes layout on AVX-512, else the plain weight) for up to ``rows`` rows,
    beside the GEMM form (``large``) for more, or one of the two alone; anything else as is. ``rows``: as the
    bound ops measured it (choices.linear_small_rows; EVERY_ROW: every row count), else the flags' policy
    (linear.c_kernel_rows). ``large``: "onednn" (oneDNN's packed copy), "widened" (bfloat16 multiplied in
    float32, widened_linear.py) or "torch" (the plain weight, F.linear), as measured, else by flags
    (:func:`gemm_forms`' first). ``gated``: an MLP's gate_up [2I, K] for linear_silu_mul, its lanes form
    reordered for the fused kernel (linear.pack_lanes_gated)."""
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu"):
        return onednn_linear.pack_weight(weight) if isinstance(weight, torch.Tensor) else weight
    if rows is None:
        rows = c_kernel_rows(weight.dtype)
    large = large or gemm_forms(weight.dtype)[0]
    if rows == 0:
        return pack_gemm_form(weight, large)
    lanes = has_lanes(weight.dtype)
    small = (pack_lanes_gated if gated else pack_lanes)(weight) if lanes else weight.detach().contiguous()
    packed = None if rows == EVERY_ROW else pack_gemm_form(weight, large)  # no GEMM copy where it is never read
    return CpuLinearWeight(small, packed, tuple(weight.shape), lanes, rows, gated and lanes)


def gemm_forms(dtype: torch.dtype) -> list[str]:
    """The GEMM forms eligible for a ``dtype`` weight here, the flags' pick first: oneDNN's packed copy where
    oneDNN has kernels for the dtype; for bfloat16 without them (no AVX512-BF16 / AMX), the weight widened to
    float32 per call beside torch's emulated bfloat16 matmul."""
    if onednn_linear.pack_weight(torch.zeros(1, 1, dtype=dtype)).is_mkldnn:
        return ["onednn"]
    if dtype == torch.bfloat16:
        return ["widened", "torch"]
    return ["torch"]


def pack_gemm_form(weight: torch.Tensor, name: str):
    """``weight`` in GEMM form ``name`` (gemm_forms)."""
    if name == "onednn":
        return onednn_linear.pack_weight(weight)
    if name == "widened":
        return widen(weight)
    return weight.detach()


def gemm_call(form_name: str):
    """fn(x, form) -> x @ weight^T for the GEMM form ``form_name``."""
    return {"onednn": onednn_linear.packed_linear, "widened": widened_linear, "torch": F.linear}[form_name]


def pack_gate_up(weight):
    """An MLP's gate_up weight [2I, K] for linear_silu_mul (pack_weight's gated form where the CPU has the
    lanes kernel; the plain forms elsewhere, which linear_silu_mul runs as linear then silu_mul)."""
    return pack_weight(weight, gated=True)


def _checked_linear_silu_mul(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if type(weight) is CpuLinearWeight and weight.gated:
        if x.dim() == 2 and x.shape[0] <= weight.small_rows:  # the bound ops' kernel: AMX tiles where built
            return lanes_launchers(x.dtype)[1](x, weight, bias)
        weight = weight.packed
    return silu_mul_cpu(_checked_linear(x, weight, bias))


def _checked_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if type(weight) is CpuLinearWeight and weight.gated:
        raise ValueError("a gate_up weight packed for linear_silu_mul (pack_gate_up) goes to linear_silu_mul")
    if type(weight) is CpuLinearWeight:
        if x.dim() == 2 and x.shape[0] <= weight.small_rows:
            if not weight.lanes:
                return linear_covered(x, weight.small, bias)
            return lanes_launchers(x.dtype)[0](x, weight, bias)
        weight = weight.packed
    if type(weight) is WidenedWeight:
        return widened_linear(x, weight, bias)
    if weight.is_mkldnn:  # packed at bind (onednn_linear.pack_weight)
        return onednn_linear.checked_packed_linear(x, weight, bias)
    return cpu_linear(x, weight, bias)


def cpu_ops(dtype: torch.dtype, *, checked: bool = False, dispatch: Dispatcher | None = None) -> KernelOps:
    """The op set for a model in ``dtype``. Bound ops choose their weights' forms by measuring them here
    (``dispatch``, kernels/cpu/choices.py); the checked launchers keep the flags' policy."""
    if dtype == torch.bfloat16 and not onednn_linear.onednn_bf16_supported():
        _note_bfloat16_without_its_instructions()
    native = native_kernels()
    if checked or native is None or not native.has_dtype(dtype):
        return checked_cpu_ops()
    return _BoundCpuOps(native, dtype, dispatch or Dispatcher()).ops()


@functools.cache  # once per process
def _note_bfloat16_without_its_instructions() -> None:
    logger.info("bfloat16 on a CPU without bfloat16 instructions (AVX512-BF16 / AMX): prefill multiplies in "
                "float32 on weights widened per call, decode reads the bfloat16 weights (kernels/cpu/"
                "widened_linear.py). Measured on an AVX2-only AMD EPYC Zen 3 with SmolLM2: shared-prefix batches "
                "1.2x slower than --dtype float32, single-stream decode 1.3x faster.")


class _BoundCpuOps:
    """Closures over one dtype's C entry points (see the module docstring for their contract)."""

    def __init__(self, native: NativeKernels, dtype: torch.dtype, dispatch: Dispatcher) -> None:
        self.native, self.dtype, self.dispatch = native, dtype, dispatch
        self.c_linear = native.linear_for(dtype)
        # The lanes layout's kernel: AMX tiles where the CPU has them for bfloat16 (csrc/amx_linear.c), else
        # lanes_linear.c's FMAs / vdpbf16ps. Both read the same layout; which is faster than oneDNN, and for
        # which rows, the bound ops measure (choices.linear_small_rows).
        self.amx = has_amx_linear(dtype)
        self.lanes_linear = native.amx_bf16 if self.amx else native.lanes_for(dtype)
        self.linear_rows = rows_covered(native, dtype)
        use_onednn = dtype == torch.float32 and onednn_linear.onednn_linear_available()
        self.other_linear = _onednn if use_onednn else F.linear
        self.norm_fn = native.elementwise_for("add_rms_norm", dtype)
        self.silu_mul_fn = native.elementwise_for("silu_mul", dtype)
        self.rope_fn = native.elementwise_for("rope", dtype)
        self.decode_fn = native.decode_for(dtype)
        self.gated_linear = native.amx_gated_bf16 if self.amx else native.lanes_gated_for(dtype)
        self.scratch = Scratch()  # the attention kernels' gathers, reused every layer and step

    def ops(self) -> KernelOps:
        return KernelOps("cpu", self.linear, self.add_rms_norm, self.silu_mul, self.rope, self.store_kv,
                         self.decode, functools.partial(paged_attention_prefill_cpu, scratch=self.scratch),
                         copy_blocks_torch, self.pack_weight, linear_silu_mul=self.linear_silu_mul,
                         pack_gate_up=functools.partial(self.pack_weight, gated=True), pack_lm_head=self.pack_lm_head,
                         pack_quantized=self.pack_quantized, unpack_weight=unpack_weight, row_reader=row_reader)

    # -- weights, in the forms measured fastest here (kernels/cpu/choices.py) ------------------------
    def pack_weight(self, weight, *, gated: bool = False, rows: tuple[int, ...] = LINEAR_ROWS):
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu"
                and weight.dtype == self.dtype):
            return pack_weight(weight, gated=gated)
        fused = gated and has_lanes(self.dtype)  # gate_up + SiLU-and-multiply in one C pass
        large = self._large_form(fused, weight, tuple(r for r in GEMM_ROWS if r <= max(rows)) or GEMM_ROWS[:1])
        small = self._small_form(fused, tuple(weight.shape))
        if small is None:  # no C kernel for this dtype here: the GEMM form alone
            return pack_weight(weight, gated=gated, rows=0, large=large[0])
        measured = linear_small_rows(self.dispatch, weight, gated=fused, small=small, large=large,
                                     limit=max(self.linear_rows) if small[0] == "rows" else EVERY, rows=rows)
        return pack_weight(weight, gated=gated, rows=EVERY_ROW if measured >= EVERY else measured, large=large[0])

    def pack_lm_head(self, weight):
        """The LM head: a dense weight as pack_weight at the row counts a head computes; an int8 table with
        its logits kernel measured per row count (quant_linear.with_logits_kernels)."""
        if isinstance(weight, torch.Tensor):
            return self.pack_weight(weight, rows=HEAD_ROWS)
        return with_logits_kernels(weight, self.dispatch)

    def pack_quantized(self, weight):
        """An int4 weight with the row count above which its rows go through the GEMM of this dtype on the weight
        widened per call, measured here per shape (quant_linear.with_gemm_rows); anything else as it is."""
        return with_gemm_rows(weight, self.dispatch, self.dtype)

    def _small_form(self, gated: bool, shape: tuple[int, int]):
        """(name, pack, call) of the C kernel's form for a weight of ``shape`` (N, K), or None where no C
        linear takes this dtype."""
        n, k = shape
        if has_lanes(self.dtype):
            name = "lanes_amx" if self.amx else "lanes"
            if gated:
                return name, pack_lanes_gated, lambda x, w: self._gated_call(x, w, (n // 2, k))
            return name, pack_lanes, lambda x, w: self._c_linear_call(self.lanes_linear, x, w, shape, None)
        if self.linear_rows:  # float32; bfloat16 with AVX512-BF16 or AVX2 (widened in registers)
            return "rows", lambda w: w.detach().contiguous(), lambda x, w: self._c_linear_call(self.c_linear, x, w,
                                                                                                 shape, None)
        return None

    def _large_form(self, gated: bool, weight: torch.Tensor, rows: tuple[int, ...]):
        """(name, pack, call) of the GEMM form: oneDNN's packed copy where it packs this dtype; for bfloat16
        without, the faster here of the weight widened to float32 and torch's matmul (choices.gemm_form)."""
        names = gemm_forms(self.dtype)
        name = names[0] if len(names) == 1 else gemm_form(
            self.dispatch, weight, {n: (functools.partial(pack_gemm_form, name=n), gemm_call(n)) for n in names}, rows)
        pack, call = functools.partial(pack_gemm_form, name=name), gemm_call(name)
        return (name, pack, (lambda x, w: self.silu_mul(call(x, w)))) if gated else (name, pack, call)

    def _gated_call(self, x: torch.Tensor, w: torch.Tensor, shape) -> torch.Tensor:
        i, k = shape
        out = torch.empty((x.shape[0], i), dtype=self.dtype)
        self.gated_linear(x.data_ptr(), w.data_ptr(), None, out.data_ptr(), x.shape[0], i, k, x.stride(0), i,
                          torch.get_num_threads())
        return out

    # x: [M, K] rows contiguous; weight [N, K] and bias [N] contiguous, all in the bound dtype.
    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if type(weight) is CpuLinearWeight:  # a C kernel up to small_rows rows, its other form beyond
            if m <= weight.small_rows:
                kernel = self.lanes_linear if weight.lanes else self.c_linear
                return self._c_linear_call(kernel, x, weight.small, weight.shape, bias)
            weight = weight.packed
        if type(weight) is WidenedWeight:  # bfloat16 multiplied in float32 (widened_linear.py)
            return widened_linear(x, weight, bias)
        if weight.is_mkldnn:  # packed at bind: oneDNN (onednn_linear.py)
            return onednn_linear.packed_linear(x, weight, bias)
        elif m not in self.linear_rows:
            return self.other_linear(x, weight, bias)
        return self._c_linear_call(self.c_linear, x, weight, weight.shape, bias)

    def _c_linear_call(self, kernel, x: torch.Tensor, weight: torch.Tensor, shape, bias: torch.Tensor | None
                       ) -> torch.Tensor:
        """x [M, K] through a C linear entry on `weight` (plain [N, K] or its lanes layout; shape = (N, K))."""
        m, (n, k) = x.shape[0], shape
        out = torch.empty((m, n), dtype=self.dtype)  # [M, N]
        kernel(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
               m, n, k, x.stride(0), n, torch.get_num_threads())
        return out

    # x: [M, K] rows contiguous; gate_up from pack_gate_up ([2I, K]: gate rows, then up rows), bias [2I].
    def linear_silu_mul(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if type(weight) is CpuLinearWeight and weight.gated:
            if m <= weight.small_rows:  # one pass: csrc/lanes_linear.c NAME_gated
                k, i = weight.shape[1], weight.shape[0] // 2
                out = torch.empty((m, i), dtype=self.dtype)  # [M, I]
                self.gated_linear(x.data_ptr(), weight.small.data_ptr(), None if bias is None else bias.data_ptr(),
                                  out.data_ptr(), m, i, k, x.stride(0), i, torch.get_num_threads())
                return out
            weight = weight.packed
        return self.silu_mul(self.linear(x, weight, bias))

    # x, residual: [T, H], each row contiguous, rows at any stride (Qwen3's and Gemma's per-head k norm with one
    # KV head reads a view of the qkv projection). Writes the new residual into `residual` (layer 0: it is x).
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, h = x.shape
        out = torch.empty((rows, h), dtype=self.dtype)  # [T, H]
        new_residual = x if residual is None else residual
        self.norm_fn(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                     new_residual.data_ptr(), out.data_ptr(), rows, h, x.stride(0),
                     0 if residual is None else residual.stride(0), new_residual.stride(0), h, eps,
                     torch.get_num_threads())
        return out, new_residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] contiguous -> [T, I]
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=self.dtype)
        self.silu_mul_fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, width, width // 2,
                         torch.get_num_threads())
        return out

    # x: [T, NH, D] with packed heads (the q/k slice of a qkv row); rotated in place.
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, nh, d = x.shape
        self.rope_fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, nh, d, x.stride(0), cos.stride(0),
                     torch.get_num_threads())
        return x

    # key/value: [T, Hkv, D], each token's heads contiguous; caches [NB, BS, Hkv, D] contiguous;
    # slot_mapping int64 contiguous.
    # k_scale / v_scale: an fp8 pool's (kernels/kv_quant.py), which binds fp8_kv.fp8_cpu_ops instead: ignored here.
    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        nb, bs, hkv, d = k_cache.shape
        size = key.element_size()
        bad = self.native.store_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   slot_mapping.data_ptr(), key.shape[0], hkv * d * size, key.stride(0) * size,
                                   value.stride(0) * size, k_cache.stride(1) * size, v_cache.stride(1) * size,
                                   nb * bs)
        if bad:
            raise IndexError(f"store_kv: slot_mapping holds slots outside [0, {nb * bs})")

    # query [B, Hq, D] (head rows contiguous); block_tables [B, W] int32 contiguous with W covering
    # every seq_len; seq_lens [B] int32 -- as the model runner builds them.
    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale, window: int = 0,
               softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        b, hq, d = query.shape
        nb, bs, hkv, _ = k_cache.shape
        n = self.native
        if hq // hkv > n.max_group or d > n.max_head_dim or bs > n.max_block_size or softcap > 0:
            return paged_attention_decode_cpu(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
                                              scratch=self.scratch)
        out = torch.empty((b, hq, d), dtype=self.dtype)  # [B, Hq, D]
        call_decode(self.decode_fn, (
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
            out.data_ptr(), b, hq, hkv, d, bs, block_tables.stride(0), nb, query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), hq * d, d, float(scale), window, torch.get_num_threads()), self.scratch, nb)
        return out


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # [M, N]

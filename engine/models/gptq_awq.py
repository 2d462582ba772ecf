"""Hugging Face GPTQ and AWQ checkpoints (``quantization_config.quant_method`` "gptq" / "awq"): the
scheme their config names, and each projection's integers unpacked into gguf_weights' form
(engine/models/hf_quantized.py stacks and serves them, or dequantizes them).

GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq" or "gptq_v2"), b = bits in {4, 8}, p = 32 / b:
    qweight int32 [K / p, N]   p values of consecutive inputs per word, input k at bits b * (k % p)
    qzeros  int32 [K / g, N / p] p values of consecutive outputs per word, same bit order;
                               "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself
    scales  fp16 [K / g, N];   g_idx int32 [K]: the group of each input (k // g unless act-order)
    w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
AWQ, version "gemm" (AutoAWQ's WQLinear_GEMM), 4 bits, always with zero points:
    qweight int32 [K, N / 8]   eight outputs per word in the order AWQ_ORDER: output 8c + AWQ_ORDER[i] at bits 4i
    qzeros  int32 [K / g, N / 8] the same order, the zero itself;  scales fp16 [K / g, N]
    w[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])
Checked against (read in their sources): AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
(pack: qweight rows, ``zeros -= 1`` then qzeros columns; forward: ``zeros + 1``), vLLM's
vllm/model_executor/layers/quantization/gptq.py (torch path: ``scales[g_idx] * (weight - (zeros + 1)[g_idx])``),
GPTQModel's convert_gptq_v1_to_v2_format (v2 = v1 + 1 in every zero nibble), AutoAWQ
awq/modules/linear/gemm.py (from_linear: order_map [0, 2, 4, 6, 1, 3, 5, 7]) and
awq/utils/packing_utils.py (unpack_awq, reverse_awq_order, dequantize_gemm), and compressed-tensors'
AutoAWQConverter (the tests compare with it).

Into our layouts (kernels/quant_linear.py): 4 bits -> int4 groups, u = q, zero' = (8 - zero) * scale, so
(u - 8) * scale + zero' = (q - zero) * scale exactly; per-channel (group_size -1) repeats the row's scale
over groups the kernel takes. 8 bits -> int8 rows: exact for symmetric per-channel (zero 128), otherwise
the dequantized rows requantized (as GGUF's Q8_0). Act-order (desc_act, a g_idx that is not k // g) is
served dequantized: the int4 kernel's groups are runs of consecutive inputs.
"""
from __future__ import annotations

import torch

from engine.models.gguf_weights import UnsupportedQuantizationError
from kernels.quant_linear import int8_rows_of_float

SUPPORTED_GPTQ = ("GPTQ 4- or 8-bit (checkpoint_format gptq or gptq_v2, sym true or false, group_size 32-256 or -1; "
                  "desc_act true is served dequantized)")
SUPPORTED_AWQ = "AWQ 4-bit version gemm with zero points (group_size 32-256 or -1)"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: packed position i holds output 8c + AWQ_ORDER[i]
KERNEL_GROUPS = (256, 128, 64, 32)  # int4 group sizes _weight_int4pack_mm_for_cpu takes
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def _refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{what} is not supported; supported: {SUPPORTED_GPTQ}; {SUPPORTED_AWQ}.")


def _group_size(qc: dict, method: str) -> int:
    g = qc.get("group_size", 128)
    g = -1 if g is None else int(g)
    if g != -1 and g not in KERNEL_GROUPS:
        raise _refuse(f"{method} group_size {g}")
    return g


def gptq_scheme(qc: dict) -> dict:
    """The scheme of a ``quant_method: gptq`` config, or UnsupportedQuantizationError naming what is."""
    bits, fmt = qc.get("bits"), qc.get("checkpoint_format", "gptq")
    if bits not in (4, 8):
        raise _refuse(f"GPTQ {bits}-bit")
    if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r}")
    if qc.get("dynamic") or qc.get("lm_head"):
        raise _refuse("GPTQ with per-module 'dynamic' overrides or a quantized lm_head")
    g = _group_size(qc, "GPTQ")
    return {"method": "gptq", "bits": bits, "group_size": g, "sym": bool(qc.get("sym", True)),
            "zero_offset": 1 if fmt == "gptq" else 0,  # v1 stores zero - 1
            "act_order": bool(qc.get("desc_act")) and g != -1}  # one group per row: the order is moot


def awq_scheme(qc: dict) -> dict:
    """The scheme of a ``quant_method: awq`` config, or UnsupportedQuantizationError naming what is."""
    version = str(qc.get("version", "gemm")).lower()
    if qc.get("bits", qc.get("w_bit", 4)) != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise _refuse(f"AWQ {qc.get('bits')}-bit version {version!r} zero_point {qc.get('zero_point', True)}")
    g = _group_size({"group_size": qc.get("group_size", qc.get("q_group_size", 128))}, "AWQ")
    return {"method": "awq", "bits": 4, "group_size": g, "sym": False, "zero_offset": 0, "act_order": False}


def _bits_of(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., C] -> [..., C, 32 / bits] unsigned fields, field i at bits * i, as int32."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((w[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.int32)


def _unpack_inputs(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight [K / p, N] -> [K, N]: word r holds inputs r * p ... r * p + p - 1."""
    fields = _bits_of(qweight, bits)  # [K/p, N, p]
    return fields.permute(0, 2, 1).reshape(-1, qweight.shape[1])


def _unpack_outputs(packed: torch.Tensor, bits: int, awq: bool) -> torch.Tensor:
    """[R, N / p] -> [R, N]: word c holds outputs c * p ... (in AWQ_ORDER for AWQ)."""
    fields = _bits_of(packed, bits)  # [R, N/p, p]
    if awq:  # field i is output AWQ_ORDER[i]: put each field at its output
        fields = fields[..., torch.argsort(torch.tensor(AWQ_ORDER))]
    return fields.reshape(packed.shape[0], -1)


def integers(state: dict[str, torch.Tensor], name: str, scheme: dict):
    """(q [K, N], zero [G, N], scale [G, N] float32, g_idx [K]) of the projection ``name``."""
    if f"{name}.qweight" not in state:
        raise UnsupportedQuantizationError(f"{name} has no qweight (a module left unquantized); "
                                           "pass quantization='none' to serve the checkpoint dequantized.")
    bits, awq = scheme["bits"], scheme["method"] == "awq"
    qweight = state[f"{name}.qweight"]
    q = _unpack_outputs(qweight, bits, True) if awq else _unpack_inputs(qweight, bits)  # [K, N]
    scale = state[f"{name}.scales"].float()  # [G, N]
    zero = _unpack_outputs(state[f"{name}.qzeros"], bits, awq)[:, : scale.shape[1]] + scheme["zero_offset"]
    k, groups = q.shape[0], scale.shape[0]
    g_idx = state.get(f"{name}.g_idx")
    g_idx = torch.arange(k) // (k // groups) if g_idx is None else g_idx.long()
    return q, zero, scale, g_idx


def dense(state: dict[str, torch.Tensor], name: str, scheme: dict) -> torch.Tensor:
    """The float32 weight [N, K] of the projection ``name`` (quantization="none", any g_idx)."""
    q, zero, scale, g_idx = integers(state, name, scheme)
    return (scale[g_idx] * (q - zero[g_idx]).float()).t().contiguous()  # [K, N] -> [N, K]


def _sequential(g_idx: torch.Tensor, groups: int) -> bool:
    k = g_idx.shape[0]
    return bool(torch.equal(g_idx, torch.arange(k) // (k // groups)))


def _kernel_group(g: int, name: str) -> int:
    for size in KERNEL_GROUPS:
        if g % size == 0:
            return size
    raise UnsupportedQuantizationError(f"{name}: a group of {g} inputs is not a multiple of {KERNEL_GROUPS[-1]}; "
                                       "pass quantization='none' to serve the checkpoint dequantized.")


def unpacked(state: dict[str, torch.Tensor], name: str, scheme: dict) -> tuple:
    """The projection ``name`` in gguf_weights' unpacked form: ("int4", u, scale, zero) or ("int8", q, scale)."""
    q, zero, scale, g_idx = integers(state, name, scheme)
    k, groups = q.shape[0], scale.shape[0]
    if scheme["bits"] == 8:
        if groups == 1 and bool((zero == 128).all()):  # symmetric per-channel: w = (q - 128) * scale exactly
            return ("int8", (q - 128).t().to(torch.int8).contiguous(), scale[0])
        return ("int8", *int8_rows_of_float(dense(state, name, scheme)))
    if not _sequential(g_idx, groups):
        raise UnsupportedQuantizationError(f"{name}: act-order g_idx cannot run through the int4 kernel's "
                                           "consecutive groups; pass quantization='none'.")
    g = k // groups
    repeat = g // _kernel_group(g, name)  # per-channel rows: the same scale over several kernel groups
    scale_t = scale.t().repeat_interleave(repeat, dim=1)  # [N, K/g']
    zero_t = (8 - zero).t().float().repeat_interleave(repeat, dim=1) * scale_t
    return ("int4", q.t().contiguous(), scale_t.contiguous(), zero_t.contiguous())


__all__ = ["SUPPORTED_GPTQ", "SUPPORTED_AWQ", "SUFFIXES", "gptq_scheme", "awq_scheme", "dense", "unpacked"]

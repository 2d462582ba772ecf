"""KernelOps: one backend's complete op set, the only interface the model forward calls (the op
signatures are in kernels/ops.py and docs/CONTRACTS.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from .elementwise import gelu_tanh_mul_torch

DEBUG_SWITCH = "PREFIXSERVE_DEBUG_KERNELS"


def unpacked(weight: torch.Tensor) -> torch.Tensor:
    return weight


@dataclass(frozen=True)
class KernelOps:
    """One backend's ops (signatures above and in docs/CONTRACTS.md); ``name`` says which.

    ``pack_weight(weight[N, K])`` returns a linear weight in the layout this backend's ``linear``
    reads fastest (an opaque oneDNN tensor on CPU; the weight itself elsewhere). The model packs
    each weight once, when it binds the set; ``linear`` takes either form.

    ``linear_silu_mul(x, gate_up, bias)``: ``silu_mul(linear(x, gate_up, bias))`` in one op, the same
    values, for a gate_up weight from ``pack_gate_up`` (which only this op reads); None where a backend has
    no fused form (the model then calls the two ops).
    """

    name: str
    linear: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    paged_attention_decode: Callable[..., torch.Tensor]
    paged_attention_prefill: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    pack_weight: Callable[[torch.Tensor], torch.Tensor] = unpacked
    # Gemma's MLP activation; every backend binds the reference (its share of a Gemma step is small).
    gelu_tanh_mul: Callable[..., torch.Tensor] = gelu_tanh_mul_torch
    linear_silu_mul: Callable[..., torch.Tensor] | None = None
    pack_gate_up: Callable[[torch.Tensor], torch.Tensor] | None = None
    # The LM head's weight (dense, or an int8 table) in the form its logits are computed fastest in here;
    # None: pack_weight for a dense head, an int8 table as it is.
    pack_lm_head: Callable | None = None
    # A quantized linear weight (kernels/quant_linear.QuantizedWeight) with the forms its rows run through measured
    # here (the CPU's int4 prefill through the float32 GEMM where faster); None: as it is.
    pack_quantized: Callable | None = None
    # pack_weight's inverse: a weight [N, K] back from its bound form, exactly (the model releases the plain
    # tensors its bound forms duplicate and unpacks them to bind another op set)
    unpack_weight: Callable = unpacked
    # row_reader(form) -> fn(ids) -> rows [T, K] read from a bound form, or None where the form cannot: a tied LM
    # head's form then serves the embedding too (None: the backend never does)
    row_reader: Callable | None = None
    # The set a step without prompt tokens runs (None: this one; engine/attention.py num_prompt_tokens). Why: where a
    # kernel trades precision for speed it does so only there, so a prompt's first output token keeps the full
    # precision (the int4 CPU linears: one int8 digit per input there, kernels/quant_linear.py with_quantized_linear)
    decode_ops: KernelOps | None = None


def debug_kernels() -> bool:
    return os.environ.get(DEBUG_SWITCH, "0").strip().lower() not in ("", "0", "false", "off", "no")

"""KernelOps: one backend's complete op set, the only interface the model forward calls.

    linear(x[M,K], weight[N,K], bias[N] | None) -> [M,N]
    add_rms_norm(x[T,H], residual[T,H] | None, weight[H], eps) -> (out[T,H], new_residual[T,H])
    silu_mul(gate_up[T,2I]) -> [T,I]          gelu_tanh_mul(gate_up[T,2I]) -> [T,I]  (Gemma)
    linear_silu_mul(x[T,K], gate_up, bias) -> [T,I]   silu_mul(linear(...)) in one op, gate_up from
        pack_gate_up; None where a backend has no fused form (the model then calls the two)
    rope(x[T,NH,D], cos[T,D/2], sin[T,D/2]) -> [T,NH,D]     (may write into x; use the result)
    store_kv(key[T,Hkv,D], value[T,Hkv,D], k_cache, v_cache, slot_mapping[T]) -> None
    paged_attention_decode(query[B,Hq,D], k_cache, v_cache, block_tables, seq_lens, scale,
                           window=0, softcap=0.0) -> [B,Hq,D]
    paged_attention_prefill(query[T,Hq,D], k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            scale, window=0, softcap=0.0) -> [T,Hq,D]
        window > 0: a query at position p sees keys p-window+1 .. p (sliding-window layers);
        softcap > 0: scores become softcap * tanh(score / softcap) (kernels/masked_attention.py)
    copy_blocks(kv_cache[L,2,NB,BS,Hkv,D], pairs[P,2]) -> None

Backends (``get_ops``): "torch" binds the references everywhere; "triton" the Triton kernels (attention,
KV store, block copy, the elementwise ops) and cuBLAS's matmul; "cpu" the C kernels (kernels/cpu/ops.py). A set is bound
once, at load, for one device and model dtype: where the checks a launcher makes on every call are
already settled by then (dtype, layout of the model's own tensors), the bound op skips them; the C
kernels still check every block id and slot they touch. ``PREFIXSERVE_DEBUG_KERNELS=1`` binds the
checking launchers instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .interface import KernelOps, debug_kernels

BACKENDS = ("auto", "triton", "torch", "cpu")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The concrete backend for ``backend`` on ``device`` (validates the pair).

    * ``"auto"``: Triton on CUDA devices (when triton imports), "cpu" on CPU, the torch
      references elsewhere.
    * ``"triton"``: force Triton. On CPU this is only valid with ``TRITON_INTERPRET=1`` (tests).
    * ``"torch"``: force the torch references (any device).
    * ``"cpu"``: the C kernels (CPU devices only).
    """
    from ._common import interpret_mode, require_triton, triton_available

    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'triton', 'torch' or 'cpu'")
    dev = torch.device(device)
    if backend == "auto":
        if dev.type == "cpu":
            return "cpu"
        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if backend == "cpu" and dev.type != "cpu":
        raise ValueError(f"backend='cpu' runs on CPU devices only, not {dev}; use 'auto'")
    if backend == "triton":
        if dev.type == "cpu":
            if not interpret_mode():
                raise ValueError(
                    "backend='triton' on a CPU device needs TRITON_INTERPRET=1 (the Triton interpreter, "
                    "for tests); use backend='torch' or 'auto' for CPU inference"
                )
        elif dev.type != "cuda":
            raise ValueError(f"backend='triton' does not support device {dev}; use backend='torch'")
        require_triton()
    return backend


def get_ops(backend: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            dispatch=None) -> KernelOps:
    """The op set of ``backend`` on ``device`` for a model in ``dtype``, bound once; on CPU the weights'
    forms are chosen by measurement through ``dispatch`` (kernels/cpu/dispatch.py; a fresh one if None)."""
    name = resolve_backend(backend, device)
    if name == "cpu":
        from .cpu.ops import cpu_ops

        return cpu_ops(dtype, checked=debug_kernels(), dispatch=dispatch)
    return reference_ops() if name == "torch" else triton_ops()


def reference_ops() -> KernelOps:
    from .copy_blocks import copy_blocks_torch
    from .elementwise import add_rms_norm_torch, rope_torch, silu_mul_torch
    from .paged_attention_decode import paged_attention_decode_torch
    from .paged_attention_prefill import paged_attention_prefill_torch
    from .store_kv import store_kv_torch

    return KernelOps("torch", F.linear, add_rms_norm_torch, silu_mul_torch, rope_torch, store_kv_torch,
                     paged_attention_decode_torch, paged_attention_prefill_torch, copy_blocks_torch)


def triton_ops() -> KernelOps:
    from .copy_blocks import copy_blocks_triton
    from .elementwise_triton import add_rms_norm_triton, rope_triton, silu_mul_triton
    from .paged_attention_decode import paged_attention_decode_triton
    from .paged_attention_prefill import paged_attention_prefill_triton
    from .store_kv import store_kv_triton

    return KernelOps("triton", F.linear, add_rms_norm_triton, silu_mul_triton, rope_triton, store_kv_triton,
                     paged_attention_decode_triton, paged_attention_prefill_triton, copy_blocks_triton)

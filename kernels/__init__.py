"""prefixserve attention kernels: paged KV store, paged attention (decode / prefill), block copy.

Each op has a Triton kernel (``<op>_triton``) and a torch reference with the same signature
(``<op>_torch``). The CPU production set ("cpu") is C kernels for decode and prefill attention and
the KV store (``paged_attention_decode_cpu``, ``paged_attention_prefill_cpu``, ``store_kv_cpu``,
built at first use; each falls back to its reference when no C compiler is present, and prefill in
bfloat16 to SDPA on CPUs with AMX) plus the torch block copy. Pick a set with
:func:`get_attention_ops`. See docs/CONTRACTS.md for the KV layout and op signatures.

Outside the attention sets, the model calls three CPU launcher modules directly, each with a torch
reference of the same signature and a fallback to it off CPU: ``kernels.linear_cpu`` (small-batch
linears), ``kernels.onednn_linear`` (other float32 linears, through oneDNN rather than MKL) and
``kernels.elementwise`` (residual add + RMSNorm, SiLU-and-multiply, rotary).

This module stays light on purpose: it imports only torch, never triton, and never touches CUDA at
import time. (Our top-level name ``kernels`` coincides with Hugging Face's unrelated ``kernels``
distribution, which transformers probes for; we deliberately define no ``__version__`` so such a
probe can never take this package for HF's.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "AttentionOps",
    "get_attention_ops",
    "store_kv_torch",
    "store_kv_triton",
    "paged_attention_decode_torch",
    "paged_attention_decode_triton",
    "paged_attention_prefill_torch",
    "paged_attention_prefill_triton",
    "copy_blocks_torch",
    "copy_blocks_triton",
    "paged_attention_decode_cpu",
    "paged_attention_prefill_cpu",
    "store_kv_cpu",
    "native_kernels",
    "NativeKernels",
]

_OPS = {
    "store_kv": "store_kv",
    "paged_attention_decode": "paged_attention_decode",
    "paged_attention_prefill": "paged_attention_prefill",
    "copy_blocks": "copy_blocks",
}


@dataclass(frozen=True)
class AttentionOps:
    """The four KV-cache ops of one backend (signatures in docs/CONTRACTS.md)."""

    store_kv: Callable[..., None]
    paged_attention_decode: Callable[..., torch.Tensor]
    paged_attention_prefill: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    name: str  # "triton", "torch" or "cpu"


def _load(op: str, backend: str) -> Callable[..., Any]:
    module = importlib.import_module(f"{__name__}.{_OPS[op]}")
    return getattr(module, f"{op}_{backend}")


def _make(backend: str) -> AttentionOps:
    if backend == "cpu":  # C kernels for attention and the KV store (each falls back to its reference)
        from .paged_attention_cpu import paged_attention_decode_cpu, paged_attention_prefill_cpu
        from .cpu_store_kv import store_kv_cpu

        return AttentionOps(
            store_kv=store_kv_cpu,
            paged_attention_decode=paged_attention_decode_cpu,
            paged_attention_prefill=paged_attention_prefill_cpu,
            copy_blocks=_load("copy_blocks", "torch"),
            name="cpu",
        )
    return AttentionOps(
        store_kv=_load("store_kv", backend),
        paged_attention_decode=_load("paged_attention_decode", backend),
        paged_attention_prefill=_load("paged_attention_prefill", backend),
        copy_blocks=_load("copy_blocks", backend),
        name=backend,
    )


def get_attention_ops(backend: str = "auto", device: torch.device | str = "cpu") -> AttentionOps:
    """Return the ops for ``backend`` on ``device``.

    * ``"auto"``: Triton on CUDA devices (when triton imports), "cpu" on CPU, the torch
      references elsewhere.
    * ``"triton"``: force Triton. On CPU this is only valid with ``TRITON_INTERPRET=1`` (tests).
    * ``"torch"``: force the torch references (any device).
    * ``"cpu"``: the C attention and KV-store kernels, torch elsewhere (CPU devices only).
    """
    from ._common import interpret_mode, require_triton, triton_available

    if not isinstance(backend, str) or backend not in ("auto", "triton", "torch", "cpu"):
        raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'triton', 'torch' or 'cpu'")
    dev = torch.device(device)
    if backend == "auto":
        if dev.type == "cpu":
            backend = "cpu"
        else:
            backend = "triton" if dev.type == "cuda" and triton_available() else "torch"
    elif backend == "cpu":
        if dev.type != "cpu":
            raise ValueError(f"backend='cpu' runs on CPU devices only, not {dev}; use 'auto'")
    elif backend == "triton":
        if dev.type == "cpu":
            if not interpret_mode():
                raise ValueError(
                    "backend='triton' on a CPU device needs TRITON_INTERPRET=1 (the Triton interpreter, "
                    "for tests); use backend='torch' or 'auto' for CPU inference"
                )
        elif dev.type != "cuda":
            raise ValueError(f"backend='triton' does not support device {dev}; use backend='torch'")
        require_triton()
    return _make(backend)


def __getattr__(name: str) -> Any:  # lazy access to the per-op functions, e.g. kernels.store_kv_torch
    if name in ("native_kernels", "NativeKernels"):  # the CPU C kernels' entry points (or None)
        from . import _native

        return getattr(_native, name)
    if name in ("paged_attention_decode_cpu", "paged_attention_prefill_cpu"):
        from . import paged_attention_cpu

        return getattr(paged_attention_cpu, name)
    if name == "store_kv_cpu":
        from .cpu_store_kv import store_kv_cpu

        return store_kv_cpu
    for op in _OPS:
        for backend in ("torch", "triton"):
            if name == f"{op}_{backend}":
                return _load(op, backend)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

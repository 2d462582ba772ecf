"""prefixserve kernels: one op set per backend behind one interface, ``KernelOps`` (kernels/interface.py; get_ops in kernels/ops.py).

    get_ops(backend, device, dtype) -> KernelOps: linear, add_rms_norm, silu_mul, rope, store_kv,
        paged_attention_decode, paged_attention_prefill, copy_blocks

Each op has a torch reference (``<op>_torch``) and, where a backend has its own kernel, that
kernel with the same signature: Triton (``<op>_triton``; attention, KV store, block copy) and the
CPU C kernels (``<op>_cpu`` launchers and the bound op set in kernels/cpu/ops.py; built at first
use, each falling back to its reference when no C compiler is present; bfloat16 attention runs on
AMX tiles where the CPU has them). See docs/CONTRACTS.md for the KV layout and op signatures.

This module stays light on purpose: it imports only torch, never triton, and never touches CUDA at
import time. (Our top-level name ``kernels`` coincides with Hugging Face's unrelated ``kernels``
distribution, which transformers probes for; we deliberately define no ``__version__`` so such a
probe can never take this package for HF's.)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from .interface import KernelOps
from .ops import get_ops

__all__ = [
    "KernelOps",
    "get_ops",
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

_OPS = ("store_kv", "paged_attention_decode", "paged_attention_prefill", "copy_blocks")


def _load(op: str, backend: str) -> Callable[..., Any]:
    module = importlib.import_module(f"{__name__}.{op}")
    return getattr(module, f"{op}_{backend}")


def __getattr__(name: str) -> Any:  # lazy access to the per-op functions, e.g. kernels.store_kv_torch
    if name in ("native_kernels", "NativeKernels"):  # the CPU C kernels' entry points (or None)
        from .cpu import native

        return getattr(native, name)
    if name in ("paged_attention_decode_cpu", "paged_attention_prefill_cpu"):
        from .cpu import paged_attention

        return getattr(paged_attention, name)
    if name == "store_kv_cpu":
        from .cpu.store_kv import store_kv_cpu

        return store_kv_cpu
    for op in _OPS:
        for backend in ("torch", "triton"):
            if name == f"{op}_{backend}":
                return _load(op, backend)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

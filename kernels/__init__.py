"""prefixserve attention kernels: paged KV store, paged attention (decode / prefill), block copy.

Each op has a Triton kernel (``<op>_triton``) and a torch reference with the same signature
(``<op>_torch``); the references are the CPU production path. Pick a set with
:func:`get_attention_ops`. See docs/CONTRACTS.md for the KV layout and op signatures.

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
    name: str  # "triton" or "torch"


def _load(op: str, backend: str) -> Callable[..., Any]:
    module = importlib.import_module(f"{__name__}.{_OPS[op]}")
    return getattr(module, f"{op}_{backend}")


def _make(backend: str) -> AttentionOps:
    return AttentionOps(
        store_kv=_load("store_kv", backend),
        paged_attention_decode=_load("paged_attention_decode", backend),
        paged_attention_prefill=_load("paged_attention_prefill", backend),
        copy_blocks=_load("copy_blocks", backend),
        name=backend,
    )


def get_attention_ops(backend: str = "auto", device: torch.device | str = "cpu") -> AttentionOps:
    """Return the ops for ``backend`` on ``device``.

    * ``"auto"``: Triton on CUDA devices (when triton imports), the torch references elsewhere.
    * ``"triton"``: force Triton. On CPU this is only valid with ``TRITON_INTERPRET=1`` (tests).
    * ``"torch"``: force the torch references (any device).
    """
    from ._common import interpret_mode, require_triton, triton_available

    if not isinstance(backend, str) or backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown attention backend {backend!r}; expected 'auto', 'triton' or 'torch'")
    dev = torch.device(device)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" and triton_available() else "torch"
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
    for op in _OPS:
        for backend in ("torch", "triton"):
            if name == f"{op}_{backend}":
                return _load(op, backend)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

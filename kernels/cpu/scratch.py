"""Scratch memory for the C attention kernels, owned by whoever calls them and reused call after call.

Why: prefill attention gathers each step's K and V into a float32 workspace (~27 MiB for a
2,048-token step over 1,088-token sequences) and shared-prefix decode gathers each group's prefix
(3-6 MiB). Allocated afresh per layer, that memory was faulted in page by page in some processes:
glibc did not keep it on its heap, and the GSP workload's bfloat16 prefill attention took 1.34-1.48 s
with 383k minor faults against 0.97 s with 10 (2-core AMD EPYC Zen 5, `benchmarks/profile_gsp.py`).
A buffer that only grows touches each page once.

Invariant: one caller at a time (a model runner's op set runs one forward at a time); views handed
out by :meth:`Scratch.take` are valid until the next call.
"""
from __future__ import annotations

import torch


class Scratch:
    """A float32 buffer that grows to the largest request and never shrinks."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    @property
    def floats(self) -> int:
        return self._buf.numel()

    def data_ptr(self) -> int:
        """The whole buffer's address (``floats`` long), for a C kernel that takes what it needs."""
        return self._buf.data_ptr()

    def take(self, floats: int) -> torch.Tensor:
        """A view of at least `floats` float32 elements (its contents are garbage)."""
        if floats > self._buf.numel():
            self._buf = torch.empty(max(floats, self._buf.numel() * 5 // 4), dtype=torch.float32)
        return self._buf[:max(floats, 0)]

"""Weights on 2 MiB pages: a linear streams its whole weight every step, and with 4 KiB pages every 4 KiB read
is a TLB miss, which in a VM is a nested page walk. Measured on a 2-core Zen 5 VM (Llama-3.2-1B shape, float32,
single-stream decode, every weight in the lanes layout): 111 ms a token on 4 KiB pages, 62.8 ms on 2 MiB
pages; the same machine's plain read rate moved only 48 -> 52 GB/s (torch.sum over 1 GiB).

    on_huge_pages(t) -> t's copy in a 2 MiB-aligned mapping advised MADV_HUGEPAGE (t itself where that
                        cannot help: under 2 MiB, not Linux, transparent huge pages "never")

Transparent huge pages are used in "always" or "madvise" mode (the common default); the kernel may still
fall back to 4 KiB pages under fragmentation, which only costs the speed above. The tensor keeps its mapping
alive (torch.frombuffer holds a reference), as the KV pool's does (engine/model_runner.py).
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import platform
from pathlib import Path

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def huge_pages_available() -> bool:
    """Linux with transparent huge pages enabled in "always" or "madvise" mode."""
    if platform.system() != "Linux":
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` on 2 MiB pages (or ``t`` where they cannot be had)."""
    nbytes = t.numel() * t.element_size()
    if nbytes < HUGE or t.device.type != "cpu" or t.is_mkldnn or not huge_pages_available():
        return t
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % HUGE  # the first 2 MiB boundary: huge pages map only aligned ranges
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(base), ctypes.c_size_t(nbytes + HUGE), MADV_HUGEPAGE)  # before any page is touched
    out = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
    out.copy_(t)
    return out

"""The CPU KV pool is zeros that cost nothing until written (model_runner.zeros_lazily)."""
import os

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY
from engine.model_runner import zeros_lazily


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_lazy_zeros_are_zeros_of_the_asked_shape_and_writable():
    t = zeros_lazily((2, 3, 5, 4), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 3, 5, 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t[1, 2] = 7.0
    assert t.sum().item() == 7.0 * 20
    assert zeros_lazily((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_a_large_pool_commits_memory_only_for_what_is_written():
    before = _rss_bytes()
    pool = zeros_lazily((1 << 28,), torch.float32, torch.device("cpu"))  # 1 GiB
    assert _rss_bytes() - before < (64 << 20)
    pool[: 1 << 20] = 1.0  # 4 MiB written
    grown = _rss_bytes() - before
    assert (4 << 20) <= grown < (128 << 20)
    del pool


def test_the_default_cpu_budget_is_vllms():
    assert DEFAULT_CPU_KV_CACHE_MEMORY == 4 << 30  # VLLM_CPU_KVCACHE_SPACE unset: 4 GiB

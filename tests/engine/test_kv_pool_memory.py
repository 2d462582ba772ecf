"""The CPU KV pool: zeros, writable, resident from creation (model_runner.zeroed_pool), and its default size
(engine/kv_budget.py): a share of available memory, capped by what the engine's limits can use."""
import os

import torch

import pytest

from engine.kv_budget import CPU_KV_FRACTION, available_memory_bytes, default_cpu_kv_budget
from engine.model_runner import zeroed_pool


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pool_is_zeros_of_the_asked_shape_and_writable():
    t = zeroed_pool((2, 3, 5, 4), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 3, 5, 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t[1, 2] = 7.0
    assert t.sum().item() == 7.0 * 20
    assert zeroed_pool((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_pool_pages_are_resident_before_the_first_write():
    """No page faults left for the first steps to pay (they cost ~0.65 ms per fresh float32 block)."""
    before = _rss_bytes()
    pool = zeroed_pool((64 << 20,), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _rss_bytes() - before >= (240 << 20)
    del pool


GIB = 1 << 30


def test_the_default_is_a_share_of_available_memory():
    b = default_cpu_kv_budget(block_bytes=1 << 20, block_size=16, max_num_seqs=64, max_model_len=8192,
                              available_bytes=16 * GIB)
    assert b.num_blocks == int(16 * GIB * CPU_KV_FRACTION) // (1 << 20) == 2048
    assert "16.0 GiB available" in b.reason


def test_the_default_is_capped_by_what_the_limits_can_use():
    # 4 sequences x 100 tokens = 4 x 7 blocks of 16: a bigger pool would never be filled.
    b = default_cpu_kv_budget(block_bytes=1 << 10, block_size=16, max_num_seqs=4, max_model_len=100,
                              available_bytes=16 * GIB)
    assert b.num_blocks == 28


def test_the_default_holds_one_longest_sequence_even_when_memory_is_low():
    b = default_cpu_kv_budget(block_bytes=1 << 20, block_size=16, max_num_seqs=64, max_model_len=8192,
                              available_bytes=1 * GIB)
    assert b.num_blocks == 512 and "low" in b.reason


def test_available_memory_is_read_from_the_machine():
    assert 0 < available_memory_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_an_engine_sizes_its_pool_from_the_machine_and_logs_it(tiny_model_factory, caplog):
    from engine import LLM

    with caplog.at_level("INFO", logger="prefixserve"):
        llm = LLM(str(tiny_model_factory("llama")), max_num_seqs=4, max_model_len=128)
    # The tiny model's blocks are small: the cap (4 x 128 tokens = 32 blocks of 16) binds.
    assert llm.model_info.num_kv_blocks == 32
    assert any("KV pool: 32 blocks" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kw", [{"num_kv_blocks": 40}, {"kv_cache_memory": 1 << 20}])
def test_explicit_sizes_win(tiny_model_factory, kw):
    from engine import LLM

    llm = LLM(str(tiny_model_factory("llama")), max_num_seqs=4, max_model_len=128, **kw)
    assert llm.model_info.num_kv_blocks == (40 if "num_kv_blocks" in kw else (1 << 20) // (llm.model_info.kv_cache_bytes // llm.model_info.num_kv_blocks))

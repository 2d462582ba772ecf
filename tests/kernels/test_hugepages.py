"""Weights on 2 MiB pages (kernels/cpu/hugepages.py): exact copies at a 2 MiB boundary, small tensors left as
they are, and the forms a linear streams every step (the lanes layout, int4 and int8 tables) placed there."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu.hugepages import HUGE, huge_pages_available, on_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages are off here")


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_a_copy_on_huge_pages_is_exact_and_aligned(dtype):
    t = (torch.randn(2000, 1500) * 50).to(dtype)  # at least 2 MiB in every dtype
    h = on_huge_pages(t)
    assert h.data_ptr() % HUGE == 0 and h.data_ptr() != t.data_ptr()
    assert h.dtype == dtype and h.shape == t.shape and h.is_contiguous() and torch.equal(h, t)
    h[0, 0] = 1  # writable, its own memory
    assert torch.equal(h[1:], t[1:])


def test_small_tensors_stay_where_they_are():
    t = torch.randn(100, 100)
    assert on_huge_pages(t) is t


@needs_thp
def test_streamed_weight_forms_land_on_huge_pages():
    from kernels.cpu.linear import pack_lanes
    from kernels.quant_linear import int4_from_float, int8_from_float

    w = torch.randn(2048, 1024)
    assert pack_lanes(w).data_ptr() % HUGE == 0
    assert int8_from_float(w).packed.data_ptr() % HUGE == 0
    qw = int4_from_float(torch.randn(4096, 1024))
    assert qw.layout != "int4_vnni" or qw.packed.data_ptr() % HUGE == 0

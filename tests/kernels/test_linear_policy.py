"""The CPU linear's weight forms (ops.pack_weight): the lanes layout for every row count on AVX-512, beside
oneDNN's packed copy where a C kernel only takes a few rows; each row count goes to its path and every path
gives F.linear's result. The forms here follow the flags' policy (linear.c_kernel_rows, monkeypatched to
stand for other CPUs); the bound ops measure theirs (tests/kernels/test_dispatch.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu.ops as ops_mod
from kernels.cpu.linear import EVERY_ROW, CpuLinearWeight, c_kernel_rows, has_amx_linear, has_lanes, pack_lanes
from kernels.cpu.native import native_kernels
from kernels.cpu.onednn_linear import onednn_linear_available, packed_linear

pytestmark = pytest.mark.skipif(native_kernels() is None or not onednn_linear_available(),
                                reason="needs the C kernels and oneDNN")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("checked", [False, True])
def test_few_rows_take_the_row_kernel_and_the_rest_the_packed_copy(monkeypatch, checked):
    """As on an AVX2-only CPU: the plain weight for 1-8 float32 rows, oneDNN's copy beyond."""
    monkeypatch.setattr(ops_mod, "c_kernel_rows", lambda dtype: 8 if dtype == torch.float32 else 0)
    monkeypatch.setattr(ops_mod, "has_lanes", lambda dtype: False)
    ops = ops_mod.cpu_ops(torch.float32, checked=checked)
    torch.manual_seed(0)
    w, b = torch.randn(200, 96), torch.randn(200)
    packed = ops_mod.pack_weight(w)
    assert type(packed) is CpuLinearWeight and packed.packed.is_mkldnn and not packed.lanes
    assert packed.small.data_ptr() == w.data_ptr()  # the module's own weight, not a copy
    assert type(ops_mod.pack_weight(w.bfloat16())) is not CpuLinearWeight  # none for bfloat16 here
    c_calls, real = [], ops_mod.linear_covered
    if checked:  # the bound ops call the C entry point directly: only the checking path can be counted
        monkeypatch.setattr(ops_mod, "linear_covered", lambda *a: c_calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 3, 4, 5, 8, 9, 64):
        x = torch.randn(rows, 96)
        out = ops.linear(x, packed, b)
        torch.testing.assert_close(out, F.linear(x, w, b), **TOL[torch.float32])
        if rows > 8:  # the packed copy, bit for bit
            assert torch.equal(out, packed_linear(x, packed.packed, b))
    if checked:
        assert c_calls == [1, 3, 4, 5, 8]


def test_no_second_form_where_packed_wins_everywhere(monkeypatch):
    monkeypatch.setattr(ops_mod, "c_kernel_rows", lambda dtype: 0)
    w = torch.randn(64, 32)
    assert ops_mod.pack_weight(w).is_mkldnn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("checked", [False, True])
def test_lanes_for_every_row_count_or_below_oneDNN(monkeypatch, dtype, amx, checked):
    """AVX-512: the lanes layout alone (every row count), or with AMX up to 64 float32 rows (1 bfloat16
    row) and oneDNN's copy beyond; odd N and K (padding), bias, and the second 8-row pass of the kernel."""
    if not has_lanes(dtype):
        pytest.skip(f"no lanes kernel for {dtype} on this CPU")
    import kernels.cpu.linear as linear_mod

    monkeypatch.setattr(linear_mod, "cpu_has_amx", lambda: amx)
    tiles = amx and dtype == torch.bfloat16 and has_amx_linear(dtype)  # the lanes layout on AMX tiles: every row
    assert c_kernel_rows(dtype) == (EVERY_ROW if tiles or not amx else 64 if dtype == torch.float32 else 1)
    ops = ops_mod.cpu_ops(dtype, checked=checked)
    torch.manual_seed(3)
    w, b = torch.randn(77, 45, dtype=dtype), torch.randn(77, dtype=dtype)
    packed = ops_mod.pack_weight(w)
    assert type(packed) is CpuLinearWeight and packed.lanes and packed.shape == (77, 45)
    assert (packed.packed is None) == (not amx or tiles)
    for rows in (1, 2, 7, 8, 9, 16, 17, 64, 65, 130):
        x = torch.randn(rows, 45, dtype=dtype)
        for bias in (None, b):
            out = ops.linear(x, packed, bias)
            assert out.shape == (rows, 77) and out.dtype == dtype
            torch.testing.assert_close(out, F.linear(x, w, bias), **TOL[dtype])
            if amx and not tiles and rows > 64:
                assert torch.equal(out, packed_linear(x, packed.packed, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lanes_layout_holds_the_weight_in_blocks_of_32_columns(dtype):
    w = (torch.arange(70 * 5) % 200).float().view(70, 5).to(dtype)  # integers below 256: exact in both dtypes
    lanes = pack_lanes(w)
    if dtype == torch.float32:
        assert lanes.shape == (3, 5, 32)  # [ceil(70/32), K, 32]
        assert lanes[1, 4, 3] == w[32 + 3, 4] and bool((lanes[2, :, 6:] == 0).all())  # columns 70-95: zeros
    else:
        assert lanes.shape == (3, 3, 32, 2)  # [ceil(70/32), ceil(5/2), 32, 2]
        assert lanes[1, 1, 3, 1] == w[32 + 3, 3] and lanes[0, 2, 0, 0] == w[0, 4]
        assert bool((lanes[:, 2, :, 1] == 0).all())  # the odd K's missing pair half


def test_the_lanes_kernel_rejects_bad_operands():
    if not has_lanes(torch.float32):
        pytest.skip("no lanes kernel here")
    from kernels.cpu.linear import lanes_linear

    w = ops_mod.pack_weight(torch.randn(40, 16))
    if type(w) is not CpuLinearWeight:
        pytest.skip("the lanes form is not this CPU's policy")
    with pytest.raises(ValueError, match="x must be"):
        lanes_linear(torch.randn(3, 17), w)
    with pytest.raises(ValueError, match="bias must be"):
        lanes_linear(torch.randn(3, 16), w, torch.randn(39))


def test_the_machines_policy_names_a_kernel_that_exists():
    from kernels.cpu.linear import rows_covered

    native = native_kernels()
    for dtype in (torch.float32, torch.bfloat16):
        rows = c_kernel_rows(dtype)
        if rows and not has_lanes(dtype):
            assert rows <= max(rows_covered(native, dtype))  # the row kernel on the plain weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("checked", [False, True])
def test_gate_up_with_silu_mul_in_one_pass_gives_the_two_ops_values(monkeypatch, dtype, amx, checked):
    """linear_silu_mul on a weight from pack_gate_up: bit for bit what linear then silu_mul give, at every
    row count (AMX: the fused kernel up to 64 float32 rows / 1 bfloat16 row, then oneDNN's copy and
    silu_mul); I not a multiple of 16 (the gated blocks' padding), odd K, with and without bias."""
    if not has_lanes(dtype):
        pytest.skip(f"no lanes kernel for {dtype} on this CPU")
    import kernels.cpu.linear as linear_mod

    monkeypatch.setattr(linear_mod, "cpu_has_amx", lambda: amx)
    ops = ops_mod.cpu_ops(dtype, checked=checked)
    torch.manual_seed(5)
    i, k = 37, 45
    w, b = (torch.randn(2 * i, k) / 4).to(dtype), torch.randn(2 * i).to(dtype)
    gate_up, plain = ops_mod.pack_gate_up(w), ops_mod.pack_weight(w)
    assert type(gate_up) is CpuLinearWeight and gate_up.gated and gate_up.shape == (2 * i, k)
    for rows in (1, 3, 8, 9, 17, 64, 65, 130):
        x = torch.randn(rows, k).to(dtype)
        for bias in (None, b):
            out = ops.linear_silu_mul(x, gate_up, bias)
            assert out.shape == (rows, i) and out.dtype == dtype
            assert torch.equal(out, ops.silu_mul(ops.linear(x, plain, bias)))


def test_gated_lanes_layout_pairs_16_gate_rows_with_their_up_rows():
    from kernels.cpu.linear import pack_lanes_gated

    i = 20  # two blocks: rows 0-15 and 16-19 (+ 12 zero rows) of each half
    w = torch.arange(2 * i, dtype=torch.float32)[:, None].expand(2 * i, 3).contiguous()  # row r holds r
    lanes = pack_lanes_gated(w)
    assert lanes.shape == (2, 3, 32)  # [blocks, K, 16 gate + 16 up columns]
    assert lanes[0, 0, :16].tolist() == list(range(16)) and lanes[0, 0, 16:].tolist() == list(range(20, 36))
    assert lanes[1, 2, :4].tolist() == [16, 17, 18, 19] and lanes[1, 2, 16:20].tolist() == [36, 37, 38, 39]
    assert bool((lanes[1, :, 4:16] == 0).all()) and bool((lanes[1, :, 20:] == 0).all())


def test_a_gate_up_packed_for_the_fused_op_is_refused_by_linear():
    if not has_lanes(torch.float32):
        pytest.skip("no lanes kernel here")
    ops = ops_mod.cpu_ops(torch.float32, checked=True)
    with pytest.raises(ValueError, match="linear_silu_mul"):
        ops.linear(torch.randn(2, 16), ops.pack_gate_up(torch.randn(64, 16)))


def test_the_fused_gate_up_rejects_bad_operands():
    if not has_lanes(torch.float32):
        pytest.skip("no lanes kernel here")
    from kernels.cpu.linear import lanes_linear_silu_mul

    w = ops_mod.pack_gate_up(torch.randn(64, 16))
    if type(w) is not CpuLinearWeight or not w.gated:
        pytest.skip("the gated lanes form is not this CPU's policy")
    with pytest.raises(ValueError, match="x must be"):
        lanes_linear_silu_mul(torch.randn(3, 17), w)
    with pytest.raises(ValueError, match="bias must be"):
        lanes_linear_silu_mul(torch.randn(3, 16), w, torch.randn(32))  # the bias covers gate and up: [2I]
    with pytest.raises(ValueError, match="x must be"):
        lanes_linear_silu_mul(torch.randn(3, 16).bfloat16(), w)

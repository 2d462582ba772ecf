"""The CPU linear policy for packed weights: where the C kernel beats oneDNN's packed copy at a few rows,
the weight is kept in both forms and each row count goes to its faster path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu.ops as ops_mod
from kernels.cpu.linear import SmallRowsWeight
from kernels.cpu.native import native_kernels
from kernels.cpu.onednn_linear import onednn_linear_available, packed_linear

pytestmark = pytest.mark.skipif(native_kernels() is None or not onednn_linear_available(),
                                reason="needs the C kernels and oneDNN")


@pytest.mark.parametrize("checked", [False, True])
def test_few_rows_take_the_c_kernel_and_the_rest_the_packed_copy(monkeypatch, checked):
    monkeypatch.setattr(ops_mod, "rows_over_packed", lambda dtype: range(1, 9) if dtype == torch.float32 else range(0))
    ops = ops_mod.cpu_ops(torch.float32, checked=checked)
    torch.manual_seed(0)
    w, b = torch.randn(200, 96), torch.randn(200)
    packed = ops.pack_weight(w)
    assert type(packed) is SmallRowsWeight and packed.packed.is_mkldnn
    assert packed.plain.data_ptr() == w.data_ptr()  # the module's own weight, not a copy
    assert type(ops.pack_weight(w.bfloat16())) is not SmallRowsWeight  # none for bfloat16 here
    c_calls, real = [], ops_mod.linear_covered
    if checked:  # the bound ops call the C entry point directly: only the checking path can be counted
        monkeypatch.setattr(ops_mod, "linear_covered", lambda *a: c_calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 3, 4, 5, 8, 9, 64):
        x = torch.randn(rows, 96)
        out = ops.linear(x, packed, b)
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        if rows > 8:  # the packed copy, bit for bit
            assert torch.equal(out, packed_linear(x, packed.packed, b))
    if checked:
        assert c_calls == [1, 3, 4, 5, 8]


def test_no_second_form_where_packed_wins_everywhere(monkeypatch):
    monkeypatch.setattr(ops_mod, "rows_over_packed", lambda dtype: range(0))
    w = torch.randn(64, 32)
    assert ops_mod.cpu_ops(torch.float32).pack_weight(w).is_mkldnn


def test_the_machines_policy_is_a_few_rows_or_none():
    """On this CPU: every row count the policy gives the C kernel is one the kernel covers, and the
    bound ops keep both forms exactly where the policy names some rows."""
    from kernels.cpu.linear import rows_covered, rows_over_packed

    native = native_kernels()
    for dtype in (torch.float32, torch.bfloat16):
        rows = rows_over_packed(dtype)
        assert set(rows) <= set(rows_covered(native, dtype))
        w = torch.randn(64, 32, dtype=dtype)
        if dtype == torch.bfloat16 and not ops_mod.onednn_linear.onednn_bf16_supported():
            continue
        assert (type(ops_mod.cpu_ops(dtype).pack_weight(w)) is SmallRowsWeight) == bool(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_ops_agree_with_f_linear_at_every_row_count(dtype):
    from kernels.cpu.linear import rows_over_packed

    if dtype == torch.bfloat16 and not ops_mod.onednn_linear.onednn_bf16_supported():
        pytest.skip("no bfloat16 oneDNN here")
    ops = ops_mod.cpu_ops(dtype)
    torch.manual_seed(1)
    w, b = torch.randn(300, 160, dtype=dtype), torch.randn(300, dtype=dtype)
    packed = ops.pack_weight(w)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for rows in (*rows_over_packed(dtype), 6, 9, 17):
        x = torch.randn(rows, 160, dtype=dtype)
        torch.testing.assert_close(ops.linear(x, packed, b), F.linear(x, w, b), **tol)

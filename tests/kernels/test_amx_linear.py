"""csrc/amx_linear.c: the bfloat16 lanes layout multiplied on AMX tiles, against F.linear in float32 (its
reference) and the vdpbf16ps kernel on the same layout. Runs where the CPU has AMX and the OS grants it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.cpu.ops as ops_mod
from kernels.cpu.linear import (CpuLinearWeight, amx_linear, amx_linear_silu_mul, has_amx_linear, lanes_linear,
                                lanes_linear_silu_mul, pack_lanes, pack_lanes_gated)

pytestmark = pytest.mark.skipif(not has_amx_linear(torch.bfloat16), reason="no AMX tiles for bfloat16 here")

BF16 = {"atol": 2e-2, "rtol": 2e-2}


def _weight(n: int, k: int, gated: bool = False) -> CpuLinearWeight:
    torch.manual_seed(n * 131 + k)
    w = (torch.randn(n, k) / k**0.5).bfloat16()
    return CpuLinearWeight((pack_lanes_gated if gated else pack_lanes)(w), None, (n, k), True, 64, gated), w


# (N, K): whole blocks; N not a multiple of 32 (the last block's masked columns); K a multiple of 32 (tiles)
# or not (the same layout through vdpbf16ps); SmolLM2's and Llama's inner widths
@pytest.mark.parametrize("n, k", [(64, 64), (77, 96), (576, 576), (40, 1536), (70, 2048), (33, 45)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 70])
def test_amx_linear_matches_the_reference(n, k, rows):
    weight, w = _weight(n, k)
    x, b = torch.randn(rows, k).bfloat16(), torch.randn(n).bfloat16()
    for bias in (None, b):
        out = amx_linear(x, weight, bias)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(out.float(), ref, **BF16)
        torch.testing.assert_close(out, lanes_linear(x, weight, bias), **BF16)


def test_rows_are_independent_of_the_batch_around_them():
    """A row's result does not depend on the rows computed with it (passes of 32, tiles of 16)."""
    weight, _ = _weight(96, 128)
    x = torch.randn(70, 128).bfloat16()
    full = amx_linear(x, weight)
    for lo, hi in ((0, 1), (3, 20), (31, 33), (64, 70)):
        assert torch.equal(amx_linear(x[lo:hi].contiguous(), weight), full[lo:hi])


@pytest.mark.parametrize("i, k", [(37, 64), (48, 576), (16, 45)])
@pytest.mark.parametrize("rows", [1, 9, 33])
def test_gated_amx_linear_is_the_plain_one_then_silu_mul(i, k, rows):
    """gate_up + SiLU-and-multiply in one pass: bit for bit silu_mul of the plain AMX linear (the same tiles,
    the same k order), and close to the float32 reference."""
    gated, w = _weight(2 * i, k, gated=True)
    plain = CpuLinearWeight(pack_lanes(w), None, (2 * i, k), True, 64)
    x, b = torch.randn(rows, k).bfloat16(), torch.randn(2 * i).bfloat16()
    silu_mul = ops_mod.cpu_ops(torch.bfloat16).silu_mul
    for bias in (None, b):
        out = amx_linear_silu_mul(x, gated, bias)
        assert out.shape == (rows, i)
        assert torch.equal(out, silu_mul(amx_linear(x, plain, bias)))
        torch.testing.assert_close(out, lanes_linear_silu_mul(x, gated, bias), **BF16)


def test_the_bound_bfloat16_ops_run_the_lanes_layout_on_tiles():
    """On this CPU the bound ops' small form is the AMX kernel: its values, not vdpbf16ps's."""
    ops = ops_mod.cpu_ops(torch.bfloat16)
    weight, _ = _weight(96, 256)
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(ops.linear(x, weight), amx_linear(x, weight))


def test_amx_linear_rejects_bad_operands():
    weight, _ = _weight(40, 64)
    with pytest.raises(ValueError, match="x must be"):
        amx_linear(torch.randn(3, 65).bfloat16(), weight)
    with pytest.raises(ValueError, match="bfloat16"):
        amx_linear(torch.randn(3, 64), weight)
    with pytest.raises(ValueError, match="bias must be"):
        amx_linear(torch.randn(3, 64).bfloat16(), weight, torch.randn(39).bfloat16())


@pytest.mark.parametrize("gated", [False, True])
def test_long_rows_go_in_k_slices_with_the_same_sums(gated):
    """K over 2,048 with more than one pass of rows goes in slices of k whose partial sums are kept between
    sweeps (Llama's down projection: K = 8,192); the sums run in the same k order, so every row is bit for bit
    what a one-row call (never sliced) gives, across chunks of rows too (300 rows: 256 a chunk at that slice)."""
    n, k = (64, 4160) if not gated else (96, 4160)  # two whole slices and a partial one
    weight, w = _weight(n, k, gated=gated)
    run = amx_linear_silu_mul if gated else amx_linear
    x, b = torch.randn(300, k).bfloat16(), torch.randn(n).bfloat16()
    full = run(x, weight, b)
    for r in (0, 31, 32, 255, 256, 299):
        assert torch.equal(run(x[r:r + 1].contiguous(), weight, b), full[r:r + 1])
    if not gated:
        torch.testing.assert_close(full.float(), F.linear(x.float(), w.float(), b.float()), **BF16)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 40, 300])
def test_rows_are_read_where_they_lie(gated, rows):
    """The A tiles are loaded from x itself at its row stride (no copy into tile order): a view whose rows lie
    further apart than K (here the first K columns of a wider activation) gives what its contiguous copy gives,
    across passes, chunks and k slices (K = 4,160 with 300 rows)."""
    n, k = 64, (576 if rows < 300 else 4160)
    weight, _ = _weight(n, k, gated=gated)
    run = amx_linear_silu_mul if gated else amx_linear
    wide = torch.randn(rows, k + 96).bfloat16()
    view = wide[:, :k]
    assert view.stride(0) == k + 96
    assert torch.equal(run(view, weight), run(view.contiguous(), weight))

"""bfloat16 linears where the CPU has no bfloat16 instructions: the weight widened to float32 for the GEMM rows
(kernels/cpu/widened_linear.py), the C row kernel's AVX2 path for decode rows (csrc/linear.c), and the bound
policy between them."""
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import ops as ops_mod
from kernels.cpu.linear import CpuLinearWeight, form_nbytes, linear_cpu, unpack_weight
from kernels.cpu.native import cpu_has_avx512, native_kernels
from kernels.cpu.onednn_linear import onednn_bf16_supported
from kernels.cpu.widened_linear import WidenedWeight, widen, widened_linear, widened_linear_reference


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (77, 131)])
@pytest.mark.parametrize("bias", [False, True])
def test_widened_linear_is_its_reference(rows, shape, bias):
    torch.manual_seed(rows)
    n, k = shape
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    x = torch.randn(rows, k).bfloat16()
    out = widened_linear(x, widen(w), b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # float32 sums in another order, rounded to bfloat16 once: at most one bfloat16 step apart
    torch.testing.assert_close(out, widened_linear_reference(x, widen(w), b), atol=2e-2, rtol=8e-3)


def test_widen_holds_the_weight_itself():
    w = torch.randn(8, 4).bfloat16()
    form = widen(w)
    assert form.weight.data_ptr() == w.data_ptr() and unpack_weight(form) is form.weight
    with pytest.raises(ValueError, match="bfloat16"):
        widen(torch.randn(8, 4))


avx2_bf16 = pytest.mark.skipif(native_kernels() is None or cpu_has_avx512()
                               or native_kernels().linear_for(torch.bfloat16) is None,
                               reason="the row kernel's AVX2 bfloat16 path runs on AVX2 CPUs without AVX-512")


@avx2_bf16
@pytest.mark.parametrize("rows", range(1, 17))
@pytest.mark.parametrize("shape", [(960, 576), (77, 131), (5, 7)])
def test_the_avx2_row_kernel_in_bfloat16_is_f_linear_in_float32_rounded_once(rows, shape):
    torch.manual_seed(rows)
    n, k = shape
    w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(rows, k + 3).bfloat16()[:, :k]  # rows at a stride
    out = linear_cpu(x, w, b)
    expected = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2 * expected.abs().max().item(), rtol=8e-3)


@avx2_bf16
@pytest.mark.skipif(onednn_bf16_supported(), reason="oneDNN has bfloat16 kernels on this CPU")
@pytest.mark.parametrize("checked", [False, True])
def test_bfloat16_without_its_instructions_takes_the_row_kernel_then_the_widened_gemm(tmp_path, checked):
    """One copy of the weight (the module's own, both forms), the row kernel's rows, the widened GEMM beyond."""
    from kernels.cpu.dispatch import Dispatcher

    ops = ops_mod.cpu_ops(torch.bfloat16, checked=checked,
                          dispatch=Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False))
    torch.manual_seed(0)
    w, b = torch.randn(200, 96).bfloat16(), torch.randn(200).bfloat16()
    packed = ops.pack_weight(w)
    assert type(packed) is CpuLinearWeight and not packed.lanes and packed.small_rows >= 1
    assert packed.small.data_ptr() == w.data_ptr()
    if packed.packed is not None:
        assert type(packed.packed) is WidenedWeight and packed.packed.weight.data_ptr() == w.data_ptr()
    assert form_nbytes(packed) == w.numel() * 2  # held once
    for rows in (1, 3, 8, 9, 16, 17, 64, 300):
        x = torch.randn(rows, 96).bfloat16()
        expected = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(ops.linear(x, packed, b).float(), expected,
                                   atol=2e-2 * expected.abs().max().item(), rtol=8e-3)

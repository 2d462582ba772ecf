"""The cpu op set's linear (one policy: C kernel, oneDNN, F.linear) gives F.linear's results for every
row count, bound or checked, and with the C kernel and oneDNN switched off (the weight-major form)."""
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.ops import WEIGHT_MAJOR_ROWS, cpu_linear, cpu_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4, 10, 11, 64])
@pytest.mark.parametrize("form", ["bound", "checked", "weight_major"])
def test_linear_matches_f_linear(rows, bias, dtype, form, monkeypatch):
    torch.manual_seed(rows)
    if form == "weight_major":  # neither the C kernel nor oneDNN: W @ x^T for 2-10 float32 rows
        monkeypatch.setattr("kernels.cpu.ops.covers", lambda x, w: False)
        monkeypatch.setattr("kernels.cpu.onednn_linear.covers", lambda x, w: False)
    linear = cpu_ops(dtype).linear if form == "bound" else cpu_linear
    w, x = torch.randn(160, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype)
    b = torch.randn(160, dtype=dtype) if bias else None
    with torch.inference_mode():
        out = linear(x, w, b)
    assert out.shape == (rows, 160) and out.is_contiguous() and out.dtype == dtype
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, F.linear(x, w, b), **tol)


def test_weight_major_rows_are_small_batches():
    assert 1 not in WEIGHT_MAJOR_ROWS and 11 not in WEIGHT_MAJOR_ROWS and 4 in WEIGHT_MAJOR_ROWS


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (1, 47, 33), (2, 63, 7), (2, 576, 960), (5, 96, 161),
                                      (8, 1536, 576), (9, 37, 64), (16, 576, 3072), (3, 15, 7)])
def test_c_linear_matches_f_linear(rows, k, n, bias):
    """The C kernel (1-16 rows, float32): every K tail (K % 16) after the 32-wide steps of 1-4 rows,
    odd N, the second 8-row pass."""
    from kernels.cpu.native import native_kernels
    from kernels.cpu.linear import covers, linear_cpu

    if native_kernels() is None:
        pytest.skip("no C compiler: Linear keeps the torch forms")
    torch.manual_seed(rows * k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    assert covers(x, w)
    torch.testing.assert_close(linear_cpu(x, w, b), F.linear(x, w, b), atol=1e-4 * k**0.5, rtol=1e-5)
    strided = torch.randn(rows, 2 * k)[:, ::2]  # a non-contiguous input row is copied, not misread
    torch.testing.assert_close(linear_cpu(strided, w, b), F.linear(strided, w, b), atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (1, 100, 33), (2, 576, 960), (5, 96, 161), (8, 1536, 576),
                                      (3, 37, 64), (4, 33, 7), (4, 127, 9)])
def test_c_linear_bf16_matches_f_linear(rows, k, n, bias):
    """bfloat16 (AVX512-BF16 CPUs, 1-8 rows): every K tail (K % 32) after the 64-wide steps of 1-4
    rows, odd N; float32 sums rounded once,
    as F.linear's: the same bits but for rare ties of the final rounding."""
    from kernels.cpu.native import native_kernels
    from kernels.cpu.linear import covers, linear_cpu

    if native_kernels() is None or native_kernels().linear_bf16 is None:
        pytest.skip("no C compiler or no AVX512-BF16: bfloat16 Linear keeps F.linear")
    torch.manual_seed(rows * k)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    assert covers(x, w)
    out, ref = linear_cpu(x, w, b), F.linear(x, w, b)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    assert (out != ref).float().mean() < 0.01


def test_c_linear_covers_only_small_cpu_batches():
    from kernels.cpu.native import cpu_has_avx512, native_kernels
    from kernels.cpu.linear import BF16_MAX_ROWS, covers

    w = torch.empty(8, 4)
    assert covers(torch.empty(1, 4), w) == (native_kernels() is not None) and not covers(torch.empty(17, 4), w)
    assert not covers(torch.empty(4, 4), torch.empty(4, 8).t())  # a transposed weight
    assert not covers(torch.empty(4, 4, dtype=torch.float16), w.half())
    assert not covers(torch.empty(4, 4, dtype=torch.bfloat16), w)  # mixed dtypes
    bf16_kernel = native_kernels() is not None and native_kernels().linear_bf16 is not None
    assert covers(torch.empty(4, 4, dtype=torch.bfloat16), w.bfloat16()) == bf16_kernel
    # AVX512-BF16's kernel takes 8 bfloat16 rows; AVX2's widening path as many as float32's (16)
    bf16_rows = BF16_MAX_ROWS if cpu_has_avx512() else 16
    assert covers(torch.empty(bf16_rows, 4, dtype=torch.bfloat16), w.bfloat16()) == bf16_kernel
    assert not covers(torch.empty(bf16_rows + 1, 4, dtype=torch.bfloat16), w.bfloat16())


@pytest.mark.parametrize("rows", [17, 64])
def test_float32_rows_outside_the_c_kernel_go_to_onednn(rows, monkeypatch):
    from kernels.cpu import onednn_linear

    if not onednn_linear.onednn_linear_available():
        pytest.skip("torch build without oneDNN, or not x86")
    calls = []
    real = onednn_linear.linear_covered
    monkeypatch.setattr(onednn_linear, "linear_covered", lambda *a: calls.append(a[0].shape) or real(*a))
    w, b = torch.randn(160, 96), torch.randn(160)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        out = cpu_linear(x, w, b)
    assert calls == [(rows, 96)]
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)

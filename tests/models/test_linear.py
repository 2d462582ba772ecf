"""engine.models.linear.Linear: the weight-major form gives F.linear's results for every row count."""
import pytest
import torch
import torch.nn.functional as F

from engine.models.linear import WEIGHT_MAJOR_ROWS, Linear, use_weight_major


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4, 10, 11, 64])
def test_linear_matches_f_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    out = layer(x)
    assert out.shape == (rows, 160) and out.is_contiguous() and out.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), **tol)


def test_weight_major_form_only_for_small_float32_cpu_batches():
    w32, w16 = torch.empty(8, 4), torch.empty(8, 4, dtype=torch.bfloat16)
    assert use_weight_major(torch.empty(4, 4), w32)
    assert not use_weight_major(torch.empty(1, 4), w32)  # one row: F.linear is as fast
    assert not use_weight_major(torch.empty(max(WEIGHT_MAJOR_ROWS) + 1, 4), w32)
    assert not use_weight_major(torch.empty(4, 4, dtype=torch.bfloat16), w16)  # measured slower in bf16
    assert not use_weight_major(torch.empty(2, 3, 4), w32)

"""The Triton elementwise kernels (kernels/elementwise_triton.py) against their torch references: the
CUDA op set's add_rms_norm, silu_mul and rope, in every dtype, on the GPU or under the interpreter.

The residual add rounds as the reference does (equal in the 16-bit dtypes); SiLU-and-multiply may differ
in a last bit on a few elements. The rotation is within one unit in the last place: on an H200 the
compiler fused each product into its sum (an FMA), so 20% of 16-bit elements were 1 ulp from the
reference, which rounds each product first (benchmarks/results/h200/check.log). RMSNorm's
sum of squares is added in another order, so its output may differ in a last bit, rarely. (Triton's
interpreter truncates float32 to bfloat16 where a GPU rounds to nearest, so on the CPU bfloat16 results
are compared within two units in the last place.)"""
import pytest
import torch
from kernels_testlib import DEVICE, DTYPES, HAS_CUDA, dname, needs_triton

from kernels.elementwise import add_rms_norm_torch, rope_torch, silu_mul_torch
from kernels.elementwise_triton import add_rms_norm_triton, rope_triton, silu_mul_triton

pytestmark = needs_triton
ROWS = [1, 5, 64]
TOL32 = {"atol": 1e-5, "rtol": 1e-5}


def _randn(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _close(out, ref, dtype, *, exact16: bool, ulp_anywhere: bool = False):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **TOL32)
    elif ulp_anywhere:  # one unit in the last place, on any share of the elements
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    elif dtype == torch.bfloat16 and not HAS_CUDA:  # the interpreter truncates each rounding
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    elif exact16:
        assert torch.equal(out, ref)
    else:  # one ulp, on few elements
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)
        assert (out != ref).float().mean() < 2e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(rows, hidden, dtype, with_residual):
    x, r = _randn(rows, hidden, dtype=dtype), _randn(rows, hidden, dtype=dtype, seed=1)
    w = _randn(hidden, dtype=dtype, seed=2) + 1
    residual = r if with_residual else None
    out, new_res = add_rms_norm_triton(x, residual, w, 1e-5)
    ref, ref_res = add_rms_norm_torch(x, residual, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    _close(new_res, ref_res, dtype, exact16=True)  # the residual add rounds as torch's
    _close(out, ref, dtype, exact16=False)
    if not with_residual:
        assert new_res is x


def test_add_rms_norm_reads_strided_rows():
    """Qwen3's per-head q/k norms pass views of the qkv projection."""
    qkv = _randn(3, 5 * 64, dtype=torch.float32)
    view = qkv[:, 64:192].unflatten(1, (2, 64)).flatten(0, 1)  # [6, 64], rows 64 apart in pairs
    rows = qkv[:, 64:192]  # [3, 128], row stride 320
    w = _randn(128, dtype=torch.float32, seed=3)
    out, _ = add_rms_norm_triton(rows, None, w, 1e-6)
    torch.testing.assert_close(out, add_rms_norm_torch(rows, None, w, 1e-6)[0], **TOL32)
    assert view.shape == (6, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [48, 1536, 3000])
def test_silu_mul_matches_reference(rows, inter, dtype):
    gu = _randn(rows, 2 * inter, dtype=dtype, scale=3.0)
    out = silu_mul_triton(gu)
    _close(out, silu_mul_torch(gu), dtype, exact16=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (40, 128), (5, 32)])
def test_rope_matches_reference_in_place_on_a_qkv_view(rows, heads, head_dim, dtype):
    kv_heads = 2
    qkv = _randn(rows, (heads + kv_heads) * head_dim, dtype=dtype)  # q and k heads, then v
    v_before = qkv[:, heads * head_dim:].clone()
    pos = torch.arange(rows, dtype=torch.float32)[:, None] * 7 + 3
    freqs = pos / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = freqs.cos().to(dtype).to(DEVICE), freqs.sin().to(dtype).to(DEVICE)
    x = qkv[:, : (heads - 1) * head_dim].view(rows, heads - 1, head_dim)  # strided: a row is qkv's row
    ref = rope_torch(x.clone(), cos, sin)
    out = rope_triton(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()  # in place
    # On an H200, 20% of 16-bit elements were 1 ulp off: the GPU compiler fused each product into the sum
    # (an FMA) although the kernel rounds it first, so the reference's double rounding is not reproduced there
    _close(out, ref, dtype, exact16=False, ulp_anywhere=True)
    assert torch.equal(qkv[:, heads * head_dim:], v_before)  # nothing past the rotated heads is touched


@pytest.mark.parametrize("call", [
    lambda: add_rms_norm_triton(_randn(2, 8, dtype=torch.float32), None, _randn(9, dtype=torch.float32), 1e-6),
    lambda: add_rms_norm_triton(_randn(2, 8, dtype=torch.float32), _randn(2, 8, dtype=torch.bfloat16),
                                _randn(8, dtype=torch.float32), 1e-6),
    lambda: silu_mul_triton(_randn(2, 7, dtype=torch.float32)),
    lambda: rope_triton(_randn(2, 3, 8, dtype=torch.float32), _randn(2, 3, dtype=torch.float32),
                        _randn(2, 4, dtype=torch.float32)),
    lambda: rope_triton(_randn(2, 3, 7, dtype=torch.float32), _randn(2, 3, dtype=torch.float32),
                        _randn(2, 3, dtype=torch.float32)),
], ids=["weight-size", "residual-dtype", "odd-gate-up", "cos-shape", "odd-head-dim"])
def test_launchers_refuse_bad_shapes(call):
    with pytest.raises(ValueError):
        call()

"""The fused elementwise C kernels (kernels/cpu/csrc/add_rms_norm.c, silu_mul.c, rope.c) against their torch references.

bfloat16 must match the reference bit for bit (every intermediate the reference rounds is rounded
the same way), except RMSNorm, whose float32 sum of squares is added in another order; float32
matches to rounding (rotary bit for bit: no FMA contraction).
"""
import pytest
import torch
from kernels_testlib import avx2_kernels

from kernels.cpu import native as _native
from kernels.cpu.elementwise import add_rms_norm_cpu, rope_cpu, silu_mul_cpu
from kernels.elementwise import add_rms_norm_torch, rope_torch, silu_mul_torch

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 64, 700]  # 700 x 576 > the kernels' threshold for splitting rows over threads
TOL32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module", autouse=True, params=["native", "avx2"])
def native(request, tmp_path_factory):
    """The engine's build (-march=native), then the AVX2-only build through the same launchers."""
    if _native.native_kernels() is None:
        if _native._compiler() is not None:
            pytest.fail("a C compiler is present but the CPU kernels did not build (see the warning log)")
        pytest.skip("no C compiler: the launchers are the torch references")
    if request.param == "native":
        yield
        return
    avx2 = avx2_kernels(tmp_path_factory.mktemp("avx2"))
    import kernels.cpu.elementwise as launchers

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launchers, "native_kernels", lambda: avx2)
        yield


def _randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(rows, dtype, with_residual):
    x, h = _randn(rows, 576, dtype=dtype), _randn(rows, 576, dtype=dtype, seed=1)
    w = _randn(576, dtype=dtype, seed=2) + 1
    residual = h if with_residual else None
    out, new_residual = add_rms_norm_cpu(x, residual, w, 1e-5)
    ref, ref_residual = add_rms_norm_torch(x, residual, w, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(new_residual, ref_residual)  # the residual add is exact
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, **TOL32)
    else:  # a different sum order may flip a final rounding, rarely
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)
        assert (out != ref).float().mean() < 1e-3
    if not with_residual:
        assert new_residual is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [3072, 2 * 17])  # SmolLM2's 2 x 1536, and a masked tail of 1
def test_silu_mul_matches_reference(rows, width, dtype):
    gate_up = _randn(rows, width, dtype=dtype, scale=4.0)  # reaches the exp's clamps at both ends
    gate_up[0, 0], gate_up[0, 1] = -120.0, 120.0
    out, ref = silu_mul_cpu(gate_up), silu_mul_torch(gate_up)
    assert out.shape == (rows, width // 2) and out.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,head_dim", [(12, 64), (5, 128), (3, 18)])
def test_rope_matches_reference_in_place_on_the_qkv_slice(rows, heads, head_dim, dtype):
    total = heads + 2  # a qkv row: q/k heads, then v heads the kernel must leave alone
    qkv = _randn(rows, total * head_dim, dtype=dtype)
    before = qkv.clone()
    angles = torch.arange(rows).float()[:, None] * torch.rand(head_dim // 2, generator=torch.Generator().manual_seed(3))
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    ref = rope_torch(qk.clone(), cos, sin)
    out = rope_cpu(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()  # written in place
    assert torch.equal(out, ref)
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])


def test_uncovered_inputs_take_the_reference():
    x16 = torch.randn(4, 64).half()  # float16: no C kernel
    w16 = torch.ones(64).half()
    out, _ = add_rms_norm_cpu(x16, None, w16, 1e-6)
    assert torch.equal(out, add_rms_norm_torch(x16, None, w16, 1e-6)[0])
    gate_up = torch.randn(4, 2 * 64)[:, ::2].contiguous().t().contiguous().t()  # column-major rows
    assert torch.equal(silu_mul_cpu(gate_up), silu_mul_torch(gate_up))
    x = torch.randn(4, 3, 16).transpose(0, 1)  # heads not packed in rows
    cos, sin = torch.randn(3, 8), torch.randn(3, 8)
    assert torch.equal(rope_cpu(x, cos, sin), rope_torch(x, cos, sin))
    mixed = torch.randn(4, 64)
    assert torch.equal(add_rms_norm_cpu(mixed, None, w16, 1e-6)[0], add_rms_norm_torch(mixed, None, w16, 1e-6)[0])


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="add_rms_norm"):
        add_rms_norm_cpu(torch.randn(4, 64), torch.randn(4, 32), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="rope"):
        rope_cpu(torch.randn(4, 3, 16), torch.randn(4, 7), torch.randn(4, 7))

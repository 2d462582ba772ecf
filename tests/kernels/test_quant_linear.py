"""Weight-only int4 / int8 linears (kernels/quant_linear.py) against references computed here from the
quantized values themselves (not from the kernels), on the bfloat16 inputs the kernels see."""
from __future__ import annotations

import pytest
import torch

from kernels.quant_linear import (
    COMPUTE_DTYPE, dequantize, int4_from_float, int4_from_groups, int8_from_channels, int8_from_float,
    quantized_linear, quantized_linear_reference, quantized_logits, with_onednn_int8,
)


def _int4_parts(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    zero = torch.randn(n, k // 32, generator=g) * 0.02
    return q, scale, zero


def _int4_weight(q, scale, zero) -> torch.Tensor:
    """w = (q - 8) * scale + zero with scale and zero as the kernel stores them (bfloat16)."""
    n, k = q.shape
    s, z = scale.to(COMPUTE_DTYPE).float(), zero.to(COMPUTE_DTYPE).float()
    return ((q.float().reshape(n, -1, 32) - 8) * s[..., None] + z[..., None]).reshape(n, k)


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("n,k", [(32, 64), (96, 128), (192, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_the_dequantized_weight(m, n, k, dtype):
    q, scale, zero = _int4_parts(n, k)
    qw = int4_from_groups(q, scale, zero)
    x = torch.randn(m, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    expected = x.to(COMPUTE_DTYPE).float() @ _int4_weight(q, scale, zero).t() + bias.float()
    out = quantized_linear(x, qw, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    scale_of = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=0.01 * scale_of, rtol=0.01)
    torch.testing.assert_close(quantized_linear_reference(x, qw, bias).float(), expected, atol=0.01 * scale_of,
                               rtol=0.01)
    torch.testing.assert_close(dequantize(qw), _int4_weight(q, scale, zero), atol=1e-2 * scale_of, rtol=1e-2)


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_the_dequantized_weight(m, dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (300, 128), generator=g, dtype=torch.int8)
    scale = torch.rand(300, generator=g) * 0.01 + 1e-3
    qw = int8_from_channels(q, scale)
    x = torch.randn(m, 128, dtype=dtype)
    expected = x.to(COMPUTE_DTYPE).float() @ (q.float() * scale.to(COMPUTE_DTYPE).float()[:, None]).t()
    torch.testing.assert_close(quantized_linear(x, qw).float(), expected, atol=0.02 * expected.abs().max().item(),
                               rtol=0.02)


def test_requantization_error_is_bounded():
    w = torch.randn(64, 128)
    w4 = dequantize(int4_from_float(w))
    step = (w.reshape(64, 4, 32).amax(-1) - w.reshape(64, 4, 32).amin(-1)) / 15  # per group
    assert ((w4 - w).abs().reshape(64, 4, 32) <= step[..., None] * 0.51 + 0.02).all()
    w8 = dequantize(int8_from_float(w))
    assert ((w8 - w).abs() <= w.abs().amax(1, keepdim=True) / 127 * 0.51 + 0.01).all()


@pytest.mark.parametrize("onednn", [False, True])
def test_logits_are_refined_in_float32_where_sampling_looks(onednn):
    w = torch.randn(5000, 64)
    qw = int8_from_float(w)
    if onednn:
        qw = with_onednn_int8(qw)
        if qw.onednn is None:
            pytest.skip("torch has no oneDNN int8 linear here")
    x = torch.randn(3, 64) * 4
    logits = quantized_logits(x, qw, refine=32)
    exact = x @ (qw.packed.float() * qw.exact_scales[:, None]).t()  # float32 from the same int8 table
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    # the tail: bfloat16 inputs and outputs, or (oneDNN) input rows quantized to int8 -- each input off by at
    # most half a step of max|x| / 127, each output by half a bfloat16 step (2^-8 relative): bounded per logit
    table = qw.packed.float() * qw.exact_scales[:, None]  # [V, K]
    bound = x.abs().amax(-1, keepdim=True) / 254 * table.abs().sum(-1) + exact.abs() * 2**-8 + 1e-3  # [M, V]
    assert ((logits - exact).abs() <= bound).all()


def test_no_onednn_int8_head_without_an_int8_dot_product(monkeypatch):
    """On CPUs without VNNI / AMX-INT8, oneDNN's int8 matmul saturates 16-bit pair sums (measured: logits
    off by 20% of the largest on an AVX2-only AMD EPYC), so the head keeps the bfloat16 kernel there."""
    import kernels.quant_linear as mod

    qw = int8_from_float(torch.randn(64, 32))
    monkeypatch.setattr(mod, "cpu_has_int8_dot", lambda: False)
    assert with_onednn_int8(qw) is qw


def test_stacked_parts_pack_like_separate_weights():
    """q, k and v are stacked before packing: the int4 pack tiles rows, so packed tensors of 32-row
    parts cannot be concatenated afterwards (this failed before the weights were stacked unpacked)."""
    from engine.models.gguf_weights import stack

    parts = [_int4_parts(n, 64, seed=i) for i, n in enumerate((64, 32, 32))]
    fused = stack([("int4", *p) for p in parts])
    x = torch.randn(4, 64)
    separate = torch.cat([quantized_linear(x, int4_from_groups(*p)) for p in parts], dim=1)
    torch.testing.assert_close(quantized_linear(x, fused), separate)


def test_bad_shapes_fail_clearly():
    q, scale, zero = _int4_parts(32, 64)
    with pytest.raises(ValueError, match="int4"):
        int4_from_groups(q, scale[:, :1], zero)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        int4_from_groups(q + 16, scale, zero)
    with pytest.raises(ValueError, match="quantized_linear"):
        quantized_linear(torch.randn(2, 63), int4_from_groups(q, scale, zero))

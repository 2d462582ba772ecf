"""The int4 x int8 C kernel (kernels/cpu/int4_linear.py) against its torch reference, the packing
against the values packed, and the activations' two int8 digits against the float input."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import int4_linear as il
from kernels.quant_linear import int4_from_groups, quantized_linear, quantized_linear_reference

needs_kernel = pytest.mark.skipif(not il.supports(16, 32, 32), reason="no C compiler, or neither AVX512-VNNI nor AVX2 here")


def _parts(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    d = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    m = -8 * d + torch.randn(n, k // group, generator=g) * 0.01
    return q, d, m


def test_pack_roundtrips_exactly():
    q, d, m = _parts(48, 128, 64)
    packed, scales = il.pack_int4(q, d, m)
    assert packed.shape == (3, 16, 16, 4) and packed.dtype == torch.uint8 and scales.shape == (3, 2, 2, 16)
    uq, ud, um = il.unpack_int4(packed, scales)
    assert torch.equal(uq.int(), q)
    assert torch.equal(ud, d.half().float()) and torch.equal(um, m.half().float())
    w = il.dequantize_int4(packed, scales)
    torch.testing.assert_close(w, q.float() * d.half().float().repeat_interleave(64, 1)
                               + m.half().float().repeat_interleave(64, 1))


def test_symmetric_groups_keep_d_alone():
    """Q4_0's w = (q - 8) d: scales [N/16, K/g, 1, 16], unpacked and dequantized with m = -8 d."""
    q, d, _ = _parts(48, 128, 32)
    packed, scales = il.pack_int4(q, d, None)
    assert scales.shape == (3, 4, 1, 16) and il.is_symmetric(scales)
    full_packed, full = il.pack_int4(q, d, -8 * d)
    assert torch.equal(packed, full_packed) and scales.numel() * 2 == full.numel()
    uq, ud, um = il.unpack_int4(packed, scales)
    assert torch.equal(uq.int(), q) and torch.equal(ud, d.half().float()) and torch.equal(um, -8 * d.half().float())
    assert torch.equal(il.dequantize_int4(packed, scales), il.dequantize_int4(full_packed, full))


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 8, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_symmetric_kernel_equals_the_two_scale_form(m, dtype):
    """The kernel's m = -8 d (exact in float32) gives the two-scale layout's output bit for bit."""
    q, d, _ = _parts(960, 576, 32, seed=m)
    sym = il.pack_int4(q, d, None)
    full = il.pack_int4(q, d, -8 * d)
    x = torch.randn(m, 576, dtype=dtype) * 2
    assert torch.equal(il.int4_linear_cpu(x, *sym, 32), il.int4_linear_cpu(x, *full, 32))
    torch.testing.assert_close(il.int4_linear_cpu(x, *sym, 32).float(), il.int4_linear_torch(x, *sym, 32).float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-2)


def test_q4_0_groups_pack_symmetric():
    """int4_from_groups with zero 0 (how GGUF's Q4_0 loads) holds d alone; Q4_1's offsets keep both."""
    q, d, m = _parts(32, 64, 32)
    if il.supports(32, 64, 32):
        assert int4_from_groups(q, d, torch.zeros_like(d)).scales.shape[2] == 1
        assert int4_from_groups(q, d, m + 8 * d).scales.shape[2] == 2


def test_activation_digits_carry_sixteen_bits():
    x = torch.randn(5, 256) * torch.logspace(-3, 2, 256)  # outliers next to small values in every block
    x[2, :32] = 0  # an all-zero block
    xq, ad = il.quantize_activations(x)
    approx = (xq.reshape(5, -1, 32) * ad[..., None]).reshape(5, 256)
    amax = x.abs().reshape(5, -1, 32).amax(-1).repeat_interleave(32, 1)
    assert ((approx - x).abs() <= amax / 127 / 254 * 0.5 * 1.001 + amax * 1e-7).all()
    assert (approx[2, :32] == 0).all()


def test_one_activation_digit_carries_eight_bits():
    """One digit (decode steps): each input within half a step of 8 bits against its block's largest, as llama.cpp's
    Q8 rows."""
    x = torch.randn(5, 256) * torch.logspace(-3, 2, 256)
    xq, ad = il.quantize_activations(x, two_digits=False)
    approx = (xq.reshape(5, -1, 32) * ad[..., None]).reshape(5, 256)
    amax = x.abs().reshape(5, -1, 32).amax(-1).repeat_interleave(32, 1)
    assert ((approx - x).abs() <= amax / 127 * 0.5 * 1.001).all()
    assert torch.equal(xq, xq.round()) and xq.abs().max() <= 127


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 17])
@pytest.mark.parametrize("n,k,group", [(16, 32, 32), (48, 256, 64), (960, 576, 32), (64, 512, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_digits", [True, False])
def test_kernel_matches_reference(m, n, k, group, dtype, two_digits):
    q, d, mm = _parts(n, k, group, seed=m)
    packed, scales = il.pack_int4(q, d, mm)
    wide = torch.randn(m, k + 24, dtype=dtype) * 3
    x = wide[:, 5:5 + k]  # rows with a stride other than K
    x[0, 7] = 40.0  # an outlier in one block
    out = il.int4_linear_cpu(x, packed, scales, group, two_digits)
    ref = il.int4_linear_torch(x, packed, scales, group, two_digits)
    assert out.dtype == dtype and out.shape == (m, n)
    # float32 sums of terms that cancel (q d against the offset m): bounded by the terms' magnitude
    digits = il.quantize_activations(x, two_digits)
    bound = (digits[0].abs().double() @ il.dequantize_int4(packed, scales).abs().double().t())
    bound = bound * digits[1].amax().double()
    tol = 2e-6 if dtype == torch.float32 else 2 ** -8
    err = (out.double() - ref.double()).abs()
    assert (err <= tol * (bound + ref.double().abs())).all(), err.max()


@needs_kernel
def test_zero_rows_and_bad_operands():
    q, d, m = _parts(32, 64, 32)
    packed, scales = il.pack_int4(q, d, m)
    assert il.int4_linear_cpu(torch.empty(0, 64), packed, scales, 32).shape == (0, 32)
    with pytest.raises(ValueError, match="x must be"):
        il.int4_linear_cpu(torch.randn(2, 63), packed, scales, 32)
    with pytest.raises(ValueError, match="x must be"):
        il.int4_linear_cpu(torch.randn(2, 64, dtype=torch.float16), packed, scales, 32)
    with pytest.raises(ValueError, match="scales"):
        il.int4_linear_cpu(torch.randn(2, 64), packed, scales, 64)
    with pytest.raises(ValueError, match="packed"):
        il.int4_linear_cpu(torch.randn(2, 64), packed[:, :4], scales, 32)
    with pytest.raises(ValueError, match="pack_int4"):
        il.pack_int4(q[:20], d[:20], m[:20])  # not a whole tile of 16 columns


@needs_kernel
def test_quantized_weights_take_the_kernel_where_it_applies(monkeypatch):
    """int4_from_groups packs for the C kernel where it applies, and for torch's int4 kernel where not
    (no AVX512-VNNI, no compiler); both compute the same linear (within bfloat16 activations for torch's)."""
    q, d, m = _parts(96, 128, 32)
    zero = m + 8 * d  # int4_from_groups' convention: w = (q - 8) * scale + zero
    vnni = int4_from_groups(q, d, zero)
    assert vnni.layout == "int4_vnni" and vnni.nbytes == 96 * 128 // 2 + 96 * 4 * 2 * 2
    with monkeypatch.context() as patch:
        patch.setattr(il, "supports", lambda *shape: False)
        torch_packed = int4_from_groups(q, d, zero)
    assert torch_packed.layout == "int4"
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    out = quantized_linear(x, vnni)
    torch.testing.assert_close(out, quantized_linear_reference(x, vnni), atol=1e-4, rtol=1e-5)
    dense = x @ (q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)).t()
    scale = dense.abs().max().item()
    torch.testing.assert_close(out, dense, atol=2e-3 * scale, rtol=0)  # float16 d and m, 16-bit activations
    torch.testing.assert_close(quantized_linear(x, torch_packed), dense, atol=0.02 * scale, rtol=0)


needs_int8 = pytest.mark.skipif(not il.supports_int8(16, 32), reason="no C compiler, or neither AVX512-VNNI nor AVX2 here")


def _table(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    return q, torch.rand(n, generator=g) * 0.05 + 1e-3


def test_int8_pack_roundtrips_to_the_table():
    q, s = _table(48, 96)
    packed, scales = il.pack_int8(q, s)
    assert packed.shape == (3, 24, 16, 4) and packed.dtype == torch.uint8 and scales.shape == (3, 1, 2, 16)
    torch.testing.assert_close(il.dequantize_int8(packed, scales), q.float() * s.half().float()[:, None],
                               rtol=0, atol=1e-6)


@needs_int8
@pytest.mark.parametrize("m", [1, 3, 8, 9, 64])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 256), (4096, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_digits", [True, False])
def test_int8_kernel_matches_reference(m, n, k, dtype, two_digits):
    q, s = _table(n, k, seed=m)
    packed, scales = il.pack_int8(q, s)
    wide = torch.randn(m, k + 24, dtype=dtype) * 3
    x = wide[:, 5:5 + k]  # rows with a stride other than K
    x[0, 7] = 40.0  # an outlier in one block
    out = il.int8_linear_cpu(x, packed, scales, two_digits)
    ref = il.int8_linear_torch(x, packed, scales, two_digits)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # float32 sums of terms that cancel: d (q + 128) against the offset -128 d, each up to 255 d |x| (and the
    # block sums reach 2^29: rounded to float32 before scaling)
    d = scales[:, 0, 0].float().reshape(-1)  # [N]
    digits = il.quantize_activations(x, two_digits)
    bound = digits[0].abs().double() @ (255 * d).double()[None, :].expand(k, n)
    bound = bound * digits[1].amax().double()
    err = (out.double() - ref.double()).abs()
    assert (err <= 2e-6 * (bound + ref.double().abs())).all(), err.max()
    # and against the exact product of the table: within half a step of the digits per input (a step of ad / 254
    # with two digits, of ad with one), summed over the row against |w|
    table = q.double() * s.half().double()[:, None]  # [N, K]
    exact = x.double() @ table.t()
    step = digits[1].double().repeat_interleave(32, 1) / (254 if two_digits else 1)  # [M, K]
    bound = 0.5 * step @ table.abs().t()
    assert ((out.double() - exact).abs() <= bound * 1.001 + 1e-5 * exact.abs().max()).all()


@needs_int8
def test_int8_zero_rows_and_bad_operands():
    q, s = _table(32, 64)
    packed, scales = il.pack_int8(q, s)
    assert il.int8_linear_cpu(torch.empty(0, 64), packed, scales).shape == (0, 32)
    with pytest.raises(ValueError, match="x must be"):
        il.int8_linear_cpu(torch.randn(2, 60), packed, scales)
    with pytest.raises(ValueError, match="packed"):
        il.int8_linear_cpu(torch.randn(2, 64), packed[:, :4], scales)
    with pytest.raises(ValueError, match="pack_int8"):
        il.pack_int8(q[:20], s[:20])  # not a whole tile of 16 columns


@needs_kernel
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64])
def test_dequantize_in_c_equals_the_reference(symmetric, group):
    g = torch.Generator().manual_seed(3)
    n, k = 48, 256
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // group, generator=g) * 0.05 + 1e-3
    m = None if symmetric else -torch.rand(n, k // group, generator=g) * 0.3
    packed, scales = il.pack_int4(q, d, m)
    assert torch.equal(il.int4_dequantize_cpu(packed, scales, group), il.dequantize_int4(packed, scales))
    assert torch.equal(il.int4_dequantize_cpu(packed, scales, group, torch.bfloat16),
                       il.dequantize_int4(packed, scales).bfloat16())  # rounded once, to nearest even
    with pytest.raises(ValueError, match="int4_dequantize"):
        il.int4_dequantize_cpu(packed, scales, group, torch.float16)
    with pytest.raises(ValueError, match="int4_dequantize"):
        il.int4_dequantize_cpu(packed, scales, 96)  # not the group the scales hold


@needs_kernel
def test_prompt_rows_widened_where_measured_faster_and_decode_rows_never(tmp_path):
    """with_gemm_rows: forced (PREFIXSERVE_KERNELS' int4_prefill) to the widened form, a prompt's rows above the
    threshold multiply the float32 weight by float32 activations exactly; fewer rows, and steps without prompt
    tokens (one digit), keep the int4 kernel; forced to the kernel, nothing is widened."""
    from kernels.cpu.dispatch import Dispatcher
    from kernels.quant_linear import dequantize, int4_from_groups, quantized_linear, with_gemm_rows

    g = torch.Generator().manual_seed(4)
    n, k = 64, 128
    qw = int4_from_groups(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3,
                          torch.randn(n, k // 32, generator=g) * 0.05)
    widened = with_gemm_rows(qw, Dispatcher(cache_dir=tmp_path, overrides="int4_prefill=widened"))
    assert widened.gemm_above == 16 and widened.packed is qw.packed  # no second copy
    assert with_gemm_rows(qw, Dispatcher(cache_dir=tmp_path, overrides="int4_prefill=int4_vnni")).gemm_above is None
    w = dequantize(qw)
    x = torch.randn(40, k, generator=g)
    exact = x.double() @ w.double().t()
    torch.testing.assert_close(quantized_linear(x, widened).double(), exact, rtol=1e-5, atol=1e-5)
    kernel = quantized_linear(x, qw)  # the int4 kernel's two int8 digits: close, not float32-exact
    assert not torch.equal(kernel, quantized_linear(x, widened))
    assert torch.equal(quantized_linear(x[:16], widened), quantized_linear(x[:16], qw))  # at the threshold: kernel
    assert torch.equal(quantized_linear(x, widened, two_digits=False), quantized_linear(x, qw, two_digits=False))
    bf = quantized_linear(x.bfloat16(), widened)
    assert bf.dtype == torch.bfloat16 and bf.shape == (40, n)
    # bfloat16 activations meet the weight widened to bfloat16 in the bfloat16 GEMM (AMX tiles where oneDNN has
    # them), not a float32 product
    assert torch.equal(bf, torch.nn.functional.linear(x.bfloat16(), w.bfloat16()))


@needs_kernel
def test_prompt_rows_are_measured_in_the_models_dtype(tmp_path):
    """with_gemm_rows times both forms on activations of the model's dtype, and keeps bfloat16's choice apart from
    float32's (a bfloat16 GEMM on AMX tiles and a float32 one differ many times over)."""
    from kernels.cpu.dispatch import Dispatcher
    from kernels.quant_linear import int4_from_groups, with_gemm_rows

    g = torch.Generator().manual_seed(5)
    n, k = 64, 128
    qw = int4_from_groups(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3,
                          torch.randn(n, k // 32, generator=g) * 0.05)
    seen = []
    d = Dispatcher(cache_dir=tmp_path, overrides="", is_busy=lambda: False)
    measure = d._measure

    def spy(op, key, candidates, make_input, *a):
        seen.append((key, make_input(4).dtype))
        return measure(op, key, candidates, make_input, *a)

    d._measure = spy
    with_gemm_rows(qw, d, torch.bfloat16)
    with_gemm_rows(qw, d)
    assert seen[0] == ("64x128 g32 asym bfloat16", torch.bfloat16) and seen[-1] == ("64x128 g32 asym", torch.float32)

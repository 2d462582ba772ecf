"""kernels.cpu.onednn_linear: float32 linears through oneDNN give F.linear's results (float32 rounding
apart), and every operand it does not cover goes to F.linear unchanged."""
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.onednn_linear import ENV_SWITCH, covers, onednn_linear, onednn_linear_available

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch build without oneDNN, or not x86")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,k,n", [(1, 576, 960), (17, 576, 576), (64, 1536, 576), (300, 96, 161), (2048, 64, 192),
                                      (3, 15, 7), (0, 32, 8)])
def test_matches_f_linear(rows, k, n, bias):
    torch.manual_seed(rows + k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    assert covers(x, w)
    out = onednn_linear(x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-4 * k**0.5, rtol=1e-5)


@needs_onednn
def test_strided_operands_are_read_as_strided():
    torch.manual_seed(0)
    w, b = torch.randn(48, 40), torch.randn(96)[::2]
    for x in (torch.randn(9, 80)[:, ::2], torch.randn(9, 64)[:, :40], torch.randn(40, 9).t()):
        torch.testing.assert_close(onednn_linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_uncovered_operands_go_to_f_linear():
    torch.manual_seed(1)
    x = torch.randn(5, 32)
    transposed = torch.randn(32, 24).t()  # the op would read it as row-major: never covered
    assert not covers(x, transposed)
    torch.testing.assert_close(onednn_linear(x, transposed), F.linear(x, transposed))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        xd, wd = x.to(dtype), torch.randn(24, 32, dtype=dtype)
        assert not covers(xd, wd)
        assert torch.equal(onednn_linear(xd, wd), F.linear(xd, wd))
    assert not covers(torch.randn(2, 5, 32), torch.randn(24, 32))  # 3-D input


def test_autograd_operands_go_to_f_linear():
    """The op has no backward: with grad on, a weight that needs grad keeps F.linear and trains."""
    w = torch.randn(24, 32, requires_grad=True)
    x = torch.randn(5, 32)
    assert not covers(x, w)
    onednn_linear(x, w).sum().backward()
    assert w.grad is not None
    with torch.inference_mode():
        assert covers(x, w) == onednn_linear_available()


@needs_onednn
def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="features"):
        onednn_linear(torch.randn(3, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="bias"):
        onednn_linear(torch.randn(3, 8), torch.randn(4, 8), torch.randn(5))


def test_switch_turns_it_off():
    code = "from kernels.cpu.onednn_linear import onednn_linear_available as a; print(a())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "", ENV_SWITCH: "0"}, cwd=pathlib.Path(__file__).parents[2])
    assert out.stdout.strip() == "False"


@needs_onednn
def test_bfloat16_weights_pack_only_where_onednn_has_bfloat16_kernels(monkeypatch):
    """Without AVX512-BF16 / AMX (an AVX2-only CPU), oneDNN's bfloat16 reorder raises: such weights stay
    plain and the bound linear's F.linear runs them; float32 packs either way."""
    from kernels.cpu import onednn_linear as mod

    torch.manual_seed(2)
    w = torch.randn(32, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    if mod.onednn_bf16_supported():
        packed = mod.pack_weight(w)
        assert packed.is_mkldnn
        torch.testing.assert_close(mod.packed_linear(x, packed), F.linear(x, w), atol=0.1, rtol=0.02)
    monkeypatch.setattr(mod, "onednn_bf16_supported", lambda: False)
    assert mod.pack_weight(w) is w
    assert mod.pack_weight(w.float()).is_mkldnn

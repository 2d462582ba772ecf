import os
import subprocess
import sys

import pytest
import torch
from kernels_testlib import DEVICE, needs_triton, poison_outputs

import kernels
from kernels import KernelOps, get_ops


def _run_py(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_debug_switch_binds_the_checking_launchers(monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_DEBUG_KERNELS", "1")
    cpu = get_ops("cpu", "cpu", torch.float32)
    assert cpu.store_kv is kernels.store_kv_cpu and cpu.paged_attention_decode is kernels.paged_attention_decode_cpu
    monkeypatch.setenv("PREFIXSERVE_DEBUG_KERNELS", "0")
    if kernels.native_kernels() is not None:  # bound: raw pointers to the C kernels, no per-call checks
        assert get_ops("cpu", "cpu", torch.float32).paged_attention_decode is not kernels.paged_attention_decode_cpu


def test_torch_backend_and_auto_on_cpu():
    ops = get_ops("torch", "cpu")
    assert isinstance(ops, KernelOps) and ops.name == "torch"
    assert ops.store_kv is kernels.store_kv_torch
    assert ops.paged_attention_decode is kernels.paged_attention_decode_torch
    assert ops.paged_attention_prefill is kernels.paged_attention_prefill_torch
    assert ops.copy_blocks is kernels.copy_blocks_torch
    cpu = get_ops("auto", torch.device("cpu"))  # the C kernels
    assert cpu.name == "cpu" and get_ops().name == "cpu"
    assert cpu.paged_attention_prefill.func is kernels.paged_attention_prefill_cpu  # with its scratch bound
    with pytest.raises(Exception):
        ops.name = "x"  # frozen


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        get_ops("cuda", "cpu")
    with pytest.raises(ValueError, match="backend"):
        get_ops(None, "cpu")


@needs_triton
def test_triton_backend_on_cpu(monkeypatch):
    if torch.cuda.is_available():
        assert get_ops("auto", "cuda").name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_ops("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = get_ops("triton", "cpu")
    assert ops.name == "triton" and ops.store_kv is kernels.store_kv_triton


def test_unsupported_device_for_triton():
    with pytest.raises(ValueError):
        get_ops("triton", "meta")


def test_import_is_light():
    """`import kernels` imports neither triton nor the op modules, and initializes no CUDA."""
    r = _run_py(
        "import sys, torch, kernels\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert 'kernels.paged_attention_decode' not in sys.modules\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert not hasattr(kernels, '__version__')\n"
        "ops = kernels.get_ops('auto', 'cpu')\n"
        "assert ops.name == 'cpu' and not torch.cuda.is_initialized()\n"
        "import kernels.store_kv, kernels.paged_attention_decode, kernels.paged_attention_prefill\n"
        "import kernels.copy_blocks\n"
        "kv = torch.zeros(1, 2, 2, 4, 1, 8)\n"
        "ops.store_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kv[0, 0], kv[0, 1], torch.tensor([0, 5]))\n"
        "assert 'triton' not in sys.modules, 'the op modules / torch path imported triton'\n"
    )
    assert r.returncode == 0, r.stderr


def test_works_without_triton():
    r = _run_py(
        "import sys\n"
        "sys.modules['triton'] = None; sys.modules['triton.language'] = None  # import fails\n"
        "import torch, kernels\n"
        "ops = kernels.get_ops('auto', 'cpu')\n"
        "kv = torch.zeros(1, 2, 2, 4, 1, 8)\n"
        "ops.store_kv(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kv[0, 0], kv[0, 1], torch.tensor([0, 5]))\n"
        "out = ops.paged_attention_decode(torch.ones(1, 2, 8), kv[0, 0], kv[0, 1],\n"
        "    torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32), 0.5)\n"
        "assert out.shape == (1, 2, 8)\n"
        "from kernels.store_kv import store_kv_triton\n"
        "try:\n"
        "    kernels.get_ops('triton', 'cuda')\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('expected an error')\n"
    )
    assert r.returncode == 0, r.stderr


def _pipeline(ops, dtype, seed=0):
    """A tiny engine step sequence on one layer: prefill 2 prompts (one with a shared prefix
    forked by copy-on-write), then 3 decode steps."""
    torch.manual_seed(seed)
    hq, hkv, d, bs, nb = 6, 2, 32, 8, 16
    kv_cache = torch.zeros((2, 2, nb, bs, hkv, d), dtype=dtype, device=DEVICE)
    k_cache, v_cache = kv_cache[1, 0], kv_cache[1, 1]
    tables = [[3, 7, 1, 0], [3, 9, 12, 0]]  # seq 1 shares block 3 (a full cached prefix block)
    lens = [13, 19]
    bt = torch.tensor(tables, dtype=torch.int32, device=DEVICE)

    def slots(s, start, end):
        return [tables[s][p // bs] * bs + p % bs for p in range(start, end)]

    # prefill: seq 0 all 13 tokens, seq 1 its 11 tokens after the 8-token cached prefix
    k_new = torch.randn((13 + 11, hkv, d), dtype=dtype, device=DEVICE)
    v_new = torch.randn_like(k_new)
    sm = torch.tensor(slots(0, 0, 13) + slots(1, 8, 19), device=DEVICE)
    ops.store_kv(k_new, v_new, k_cache, v_cache, sm)
    q = torch.randn((24, hq, d), dtype=dtype, device=DEVICE)
    qsl = torch.tensor([0, 13, 24], dtype=torch.int32, device=DEVICE)
    outs = [ops.paged_attention_prefill(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32,
                                                                                device=DEVICE), qsl, d**-0.5)]
    # copy-on-write: seq 1's partially filled last block 12 is forked into block 5
    ops.copy_blocks(kv_cache, torch.tensor([[12, 5]], device=DEVICE))
    tables[1][2] = 5
    bt = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        sm = torch.tensor([slots(0, lens[0], lens[0] + 1)[0], slots(1, lens[1], lens[1] + 1)[0]], device=DEVICE)
        ops.store_kv(torch.randn((2, hkv, d), dtype=dtype, device=DEVICE),
                     torch.randn((2, hkv, d), dtype=dtype, device=DEVICE), k_cache, v_cache, sm)
        lens = [n + 1 for n in lens]
        outs.append(ops.paged_attention_decode(torch.randn((2, hq, d), dtype=dtype, device=DEVICE), k_cache,
                                               v_cache, bt, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                               d**-0.5))
    return outs, kv_cache


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_on_a_pipeline(dtype, monkeypatch):
    poison_outputs(monkeypatch)
    ref_outs, ref_cache = _pipeline(get_ops("torch", DEVICE), dtype)
    outs, cache = _pipeline(get_ops("triton", DEVICE), dtype)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for a, b in zip(outs, ref_outs):
        torch.testing.assert_close(a, b, **tol)

"""The sampler's C kernels (kernels/cpu/csrc/top_p.c) built without AVX-512: for AVX2 (-march=x86-64-v3, its
8-lane paths) and for baseline x86-64 (the scalar paths), the race and the top-k / top-p filter against the torch
references. The engine's build takes the AVX-512 paths wherever the CPU has them, CI's included, so only this
test runs the others there."""
import ctypes

import pytest
import torch
from kernels_testlib import build_for

from kernels.cpu import native
from kernels.sampling import race_torch, top_k_top_p_probs_torch


@pytest.fixture(scope="module", params=["x86-64-v3", "x86-64"])  # AVX2 + FMA; SSE2 only
def portable(request, tmp_path_factory):
    out = build_for(request.param, [native.CSRC / "top_p.c"], tmp_path_factory.mktemp("portable") / "libtop_p.so")
    lib = ctypes.CDLL(str(out))
    lib.ps_race.argtypes, lib.ps_race.restype = native.RACE_ARGTYPES, None
    lib.ps_top_k_top_p.argtypes, lib.ps_top_k_top_p.restype = native.TOP_P_ARGTYPES, ctypes.c_int64
    return lib


@pytest.mark.parametrize("vocab", [1, 17, 300, 5000, 49152])
def test_the_portable_race_picks_the_reference_token(portable, vocab):
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(6, vocab, generator=g) ** 4
    probs[probs < 0.1] = 0.0
    probs[5] = float("nan")  # no positive probability: -1
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 99])
    tokens = torch.empty(6, dtype=torch.int64)
    portable.ps_race(probs.data_ptr(), 6, vocab, vocab, seeds.data_ptr(), tokens.data_ptr(), 2)
    assert torch.equal(tokens, race_torch(probs, seeds))
    assert tokens[5] == -1


@pytest.mark.parametrize("vocab", [17, 300, 5000, 49152])
def test_the_portable_filter_keeps_the_reference_set(portable, vocab):
    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(4, vocab, generator=g) * 3
    logits[1, : vocab // 2] = float("-inf")
    ks = torch.tensor([vocab, 40, vocab, 2000]).clamp(max=vocab)
    ps = torch.tensor([0.9, 1.0, 0.5, 0.95])
    out, kept = torch.empty(4, vocab), torch.empty(4, dtype=torch.int64)
    rc = portable.ps_top_k_top_p(logits.data_ptr(), 4, vocab, vocab, ks.data_ptr(), ps.data_ptr(), out.data_ptr(),
                                 kept.data_ptr(), 2)
    ref = top_k_top_p_probs_torch(logits, ks, ps)
    assert rc == 0 and torch.equal(out > 0, ref > 0)
    assert kept.tolist() == (ref > 0).sum(-1).tolist()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-4)

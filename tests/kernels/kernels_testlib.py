"""Helpers shared by the kernels tests: paged-KV fixtures with poison, naive attention, grids."""

from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


def build_for(march: str, sources, out):
    """The C sources compiled as the engine compiles them but for `march` instead of the native CPU, into
    `out`; skips off x86-64 or without a C compiler, or where this CPU cannot run `march` (x86-64-v3:
    AVX2 + FMA)."""
    import platform
    import subprocess

    from kernels.cpu import native

    if native._compiler() is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    if march == "x86-64-v3" and not native.cpu_has_avx2():
        pytest.skip("an AVX2 build needs a CPU with AVX2 to run")
    flags = [f for f in native.FLAGS if f != "-march=native"] + [f"-march={march}"]
    subprocess.run([native._compiler(), *flags, *map(str, sources), "-o", str(out), "-lm"], check=True,
                   capture_output=True, text=True)
    return out


def avx2_kernels(out_dir):
    """The CPU C kernels built for AVX2 + FMA only (-march=x86-64-v3), as on an AVX2-only CPU, loaded: the
    8-lane paths an AVX-512 build (CI's) never runs. Skips where the native build already is that build."""
    from kernels.cpu import native

    if native.cpu_has_avx2() and not native.cpu_has_avx512():
        pytest.skip("the native build is the AVX2 build here")
    return native._load(build_for("x86-64-v3", native.SOURCES, out_dir / "libprefixserve_cpu.so"))


def _triton_usable() -> tuple[bool, str]:
    """Triton importable, and on CPU its interpreter really on (see conftest.py)."""
    try:
        import triton.language
    except Exception as exc:  # pragma: no cover
        return False, f"triton is not installed ({exc!r})"
    if HAS_CUDA:
        return True, ""
    if os.environ.get("TRITON_INTERPRET") != "1" or type(triton.language.standard.zeros).__name__ != (
        "InterpretedFunction"
    ):
        return False, (
            "Triton interpreter unavailable: triton was imported before TRITON_INTERPRET=1 was set in "
            "this process (run tests/kernels on its own, or export TRITON_INTERPRET=1)"
        )
    return True, ""


HAS_TRITON, _WHY_NOT = _triton_usable()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=_WHY_NOT)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
POISON = float("nan")


def dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def config_grid(full: bool | None = None):
    """(queries_per_kv, head_dim, block_size, dtype) cases.

    Full product on CUDA; on CPU (Triton interpreter, slow) a covering subset in which every value
    of every axis appears at least once, plus a non power-of-2 head dim and a non power-of-2 Hkv.
    """
    full = HAS_CUDA if full is None else full
    if full:
        cases = list(itertools.product((1, 3, 8), (64, 128), (8, 16, 32), DTYPES))
    else:
        cases = [
            (1, 64, 16, torch.float32),
            (3, 128, 8, torch.bfloat16),
            (8, 64, 32, torch.float16),
            (3, 64, 32, torch.float32),
            (8, 128, 16, torch.bfloat16),
            (1, 128, 8, torch.float16),
        ]
    # odd shapes, masked in the kernels: head_dim 80 (not a power of 2)
    cases.append((2, 80, 16, torch.float32))
    return [pytest.param(g, d, bs, dt, id=f"G{g}-D{d}-bs{bs}-{dname(dt)}") for g, d, bs, dt in cases]


class PagedKV:
    """A poisoned paged KV cache for a batch of sequences.

    Every slot not holding a sequence position (unused blocks, the tail of each last block) is
    NaN, block tables are padded with the id of a NaN block or -1, so a kernel that reads past
    ``seq_len`` or through padding entries produces NaN (or crashes) instead of passing.
    """

    def __init__(self, seq_lens, num_kv_heads, head_dim, block_size, dtype, device=DEVICE, seed=0,
                 num_layers=1, extra_blocks=5):
        gen = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.seq_lens = list(seq_lens)
        self.block_size = block_size
        need = [math.ceil(n / block_size) for n in self.seq_lens]
        self.max_blocks = max(need + [1]) + 2  # padded columns
        num_blocks = sum(need) + extra_blocks + 1
        self.num_blocks = num_blocks
        self.kv_cache = torch.full(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), POISON, dtype=dtype
        )
        ids = list(range(num_blocks))
        rnd.shuffle(ids)
        self.poison_block = ids.pop()  # never written: all NaN
        self.tables = []
        for i, n in enumerate(need):
            blocks = [ids.pop() for _ in range(n)]
            pad = self.poison_block if i % 2 == 0 else -1
            self.tables.append(blocks + [pad] * (self.max_blocks - n))
        # real data, contiguous per sequence: [seq_len, Hkv, D] for K and V in every layer
        self.k = [torch.randn((num_layers, n, num_kv_heads, head_dim), generator=gen).to(dtype) for n in self.seq_lens]
        self.v = [torch.randn((num_layers, n, num_kv_heads, head_dim), generator=gen).to(dtype) for n in self.seq_lens]
        for s, n in enumerate(self.seq_lens):
            for p in range(n):
                blk, off = self.tables[s][p // block_size], p % block_size
                self.kv_cache[:, 0, blk, off] = self.k[s][:, p]
                self.kv_cache[:, 1, blk, off] = self.v[s][:, p]
        self.kv_cache = self.kv_cache.to(device)
        self.block_tables = torch.tensor(self.tables, dtype=torch.int32, device=device)
        self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)

    def caches(self, layer=0):
        return self.kv_cache[layer, 0], self.kv_cache[layer, 1]


def naive_attention(q, k, v, scale, q_positions):
    """Plain softmax attention in float64 on contiguous K/V.

    q [Lq, Hq, D]; k, v [Lk, Hkv, D]; the query of row i sees keys 0..q_positions[i].
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hq):
        kh, vh = kd[:, h // g], vd[:, h // g]
        for i in range(q.shape[0]):
            n = int(q_positions[i]) + 1
            scores = (kh[:n] @ qd[i, h]) * scale
            w = torch.softmax(scores, dim=0)
            out[i, h] = w @ vh[:n]
    return out


def poison_outputs(monkeypatch):
    """Make the Triton launchers allocate NaN-filled outputs (catches rows a kernel never writes)."""
    import kernels._common as common

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(common, "alloc_output", nan_empty)

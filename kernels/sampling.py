"""The sampler's top-k / top-p (nucleus) filter on CPU logits, as a sampling distribution, and its
draw from that distribution.

    top_k_top_p_probs(logits[S, V] float32, ks[S] int64 (k >= V: off), ps[S] float32 in (0, 1])
        -> probs[S, V] float32: softmax over each row's kept tokens, exactly 0 elsewhere
    race(probs[S, V] float32 >= 0, seeds[S] int64) -> tokens[S] int64: one draw per row

``top_k_top_p_probs_torch`` is the reference, vLLM's rule: sort each row, mask below the k-th
largest logit, drop the leading tokens whose ascending cumulative probability is <= 1 - p; then
keep every logit >= the smallest one kept (vLLM cuts by sort position: among tokens tied at the
cut, the sort's order would decide), softmax. ``top_k_top_p_probs`` runs the C kernel (kernels/cpu/csrc/top_p.c: a radix select
of the two cut values, no sort) where it is built, and the reference otherwise and for any row the
kernel declines (a NaN, or no finite logit). The kept sets agree but for a token whose cumulative
probability equals 1 - p to float32 rounding (the kernel sums masses in double).

``race`` is the exponential race, token = argmax p[i] / E[i] over p[i] > 0 with E[i] ~ Exp(1), which
draws i with probability p[i] / sum(p). E[i] = -log(u[i]) with u[i] from a hash of (seed, i), so a
seed fixes every token's noise whatever else is kept, and no generator state is needed. Not an
inverse-CDF draw (one uniform a row): that moves with the rounding of every probability before the
chosen one. ``race_torch`` is the reference (torch.log where the C kernel, kernels/cpu/csrc/top_p.c,
has a series good to 1e-7: they pick the same token but where two ratios tie that closely). A row
with no p > 0 (all zero, or NaN) gets -1.
"""
from __future__ import annotations

import torch

from .cpu.native import native_kernels


def top_k_top_p_probs_torch(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    ascending = logits.sort(dim=-1).values  # [S, V]
    kth = ascending.gather(1, (vocab - ks.clamp(max=vocab)).unsqueeze(1))  # [S, 1] smallest kept under top-k
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    cum = ascending.softmax(-1).cumsum(-1)  # [S, V], non-decreasing
    dropped = (cum <= (1.0 - ps.to(cum.dtype)).unsqueeze(1)).sum(-1, keepdim=True)  # [S, 1] leading tokens dropped
    smallest = ascending.gather(1, dropped.clamp(max=vocab - 1))  # [S, 1] the smallest kept logit
    return logits.masked_fill(logits < smallest, float("-inf")).softmax(-1)


def top_k_top_p_probs(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    s, vocab = _check(logits, ks, ps)
    native = native_kernels()
    if native is None or s == 0:
        return top_k_top_p_probs_torch(logits, ks, ps)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ks = ks.to(torch.int64).clamp(max=vocab).contiguous()
    ps = ps.to(torch.float32).contiguous()
    out = torch.empty((s, vocab), dtype=torch.float32)  # [S, V]
    kept = torch.empty(s, dtype=torch.int64)  # [S]
    rc = native.top_k_top_p(logits.data_ptr(), s, vocab, logits.stride(0), ks.data_ptr(), ps.data_ptr(),
                            out.data_ptr(), kept.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("top_k_top_p_probs: the C kernel could not allocate its scratch")
    declined = (kept < 0).nonzero().squeeze(1)
    if declined.numel():
        out[declined] = top_k_top_p_probs_torch(logits[declined], ks[declined], ps[declined])
    return out


def _check(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> tuple[int, int]:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"top_k_top_p_probs: logits must be [S, V] float32 on CPU, got {tuple(logits.shape)} "
                         f"{logits.dtype} on {logits.device}")
    s, vocab = logits.shape
    if ks.shape != (s,) or ps.shape != (s,):
        raise ValueError(f"top_k_top_p_probs: ks and ps must have shape ({s},), got {tuple(ks.shape)}, {tuple(ps.shape)}")
    if s and (bool((ks < 1).any()) or bool((ps <= 0).any()) or bool((ps > 1).any())):
        raise ValueError("top_k_top_p_probs: every k must be >= 1 and every p in (0, 1]")
    return s, vocab


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, without overflowing int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _splitmix64(z: int) -> int:
    """splitmix64's output function: nearby seeds get unrelated keys."""
    mask = (1 << 64) - 1
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def race_uniforms(seed: int, vocab: int) -> torch.Tensor:
    """u[i] in (0, 1) for tokens 0 .. vocab-1 of a row with this seed: 23 bits of two hash rounds,
    centred (so u < 1 and E = -log u > 0)."""
    seed = _splitmix64(seed)
    s0, s1 = seed & _MASK32, seed >> 32
    h = (_hash32(torch.arange(vocab, dtype=torch.int64) ^ s0) + s1) & _MASK32
    return ((_hash32(h) >> 9).to(torch.float32) + 0.5) * 2.0**-23  # [V]


def race_torch(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    s, vocab = _check_race(probs, seeds)
    tokens = torch.full((s,), -1, dtype=torch.int64)
    for row, seed in enumerate(seeds.tolist()):
        seed &= (1 << 64) - 1  # the C kernel's uint64_t
        p = probs[row]
        ratio = torch.where(p > 0, p / -race_uniforms(seed, vocab).log(), torch.zeros_like(p))  # [V]
        best = ratio.max(dim=-1)
        if best.values > 0:
            tokens[row] = best.indices
    return tokens


def race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    s, vocab = _check_race(probs, seeds)
    native = native_kernels()
    if native is None or s == 0:
        return race_torch(probs, seeds)
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    seeds = seeds.contiguous()
    tokens = torch.empty(s, dtype=torch.int64)  # [S]
    native.race(probs.data_ptr(), s, vocab, probs.stride(0), seeds.data_ptr(), tokens.data_ptr(),
                torch.get_num_threads())
    return tokens


def _check_race(probs: torch.Tensor, seeds: torch.Tensor) -> tuple[int, int]:
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.device.type != "cpu":
        raise ValueError(f"race: probs must be [S, V] float32 on CPU, got {tuple(probs.shape)} {probs.dtype} "
                         f"on {probs.device}")
    if seeds.shape != (probs.shape[0],) or seeds.dtype != torch.int64:
        raise ValueError(f"race: seeds must be int64 of shape ({probs.shape[0]},), got {tuple(seeds.shape)} {seeds.dtype}")
    return probs.shape

"""The sampler's top-k / top-p (nucleus) filter on CPU logits, as a sampling distribution.

    top_k_top_p_probs(logits[S, V] float32, ks[S] int64 (k >= V: off), ps[S] float32 in (0, 1])
        -> probs[S, V] float32: softmax over each row's kept tokens, exactly 0 elsewhere

``top_k_top_p_probs_torch`` is the reference, vLLM's rule: sort each row, mask below the k-th
largest logit, drop the leading tokens whose ascending cumulative probability is <= 1 - p; then
keep every logit >= the smallest one kept (vLLM cuts by sort position: among tokens tied at the
cut, the sort's order would decide), softmax. ``top_k_top_p_probs`` runs the C kernel (kernels/cpu/csrc/top_p.c: a radix select
of the two cut values, no sort) where it is built, and the reference otherwise and for any row the
kernel declines (a NaN, or no finite logit). The kept sets agree but for a token whose cumulative
probability equals 1 - p to float32 rounding (the kernel sums masses in double).
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

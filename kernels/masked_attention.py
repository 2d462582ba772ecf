"""Sliding-window and soft-capped attention over the paged KV cache: the torch reference every
backend's attention op uses when ``window`` or ``softcap`` changes the result.

    masked_paged_attention_torch(query[T,Hq,D], k_cache, v_cache, block_tables[S,max_blocks],
                                 seq_lens[S], query_start_loc[S+1], scale, window, softcap) -> [T,Hq,D]

The layout is the prefill op's (a decode batch is ``query_start_loc = arange(S+1)``): sequence ``s``
owns query rows ``query_start_loc[s] ..`` which are its last ``q_len`` positions. The query at
absolute position ``p`` sees keys ``k`` with ``k <= p`` and, when ``window > 0``, ``p - k < window``
(Mistral's and Gemma's sliding window: the token itself and the ``window - 1`` before it, as in
transformers' sliding-window mask). With ``softcap > 0`` each score becomes
``softcap * tanh(score / softcap)`` before the mask (Gemma's attention-logit soft-capping).

Only the keys some query of the sequence can see are gathered: a window of 512 over a 4,096-token
prompt reads each query chunk's 512 + chunk keys, not all 4,096.
"""
from __future__ import annotations

import math

import torch

# Queries scored per chunk: bounds the [Hq, rows, keys] float32 scores at ~Hq * 256 * keys * 4 bytes.
_QUERY_CHUNK = 256


def check_window_softcap(op: str, window: int, softcap: float) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{op}: window must be an int >= 0 (0: no window), got {window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"{op}: softcap must be a finite float >= 0 (0: none), got {softcap!r}")


def window_or_softcap_applies(seq_lens: torch.Tensor, window: int, softcap: float) -> bool:
    """Whether the mask changes anything: a soft cap always does, a window only past its length."""
    return softcap > 0 or (window > 0 and seq_lens.numel() > 0 and int(seq_lens.max()) > window)


def masked_paged_attention_torch(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                                 window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    t, hq, d = query.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    out = query.new_zeros((t, hq, d))
    kf, vf = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [NB*BS, Hkv, D]
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, kv_len in enumerate(lens):
        q0, q1 = qsl[s], qsl[s + 1]
        for c0 in range(q0, q1, _QUERY_CHUNK):
            c1 = min(q1, c0 + _QUERY_CHUNK)
            first = kv_len - (q1 - c0)  # absolute position of query row c0
            lo = max(0, first - window + 1) if window > 0 else 0  # the first key any row of the chunk sees
            hi = kv_len - (q1 - c1)  # one past the last row's position
            if hi <= 0:
                continue
            pos = torch.arange(lo, hi)
            slots = block_tables[s, pos // bs].to(torch.int64) * bs + pos % bs  # [K]
            k = kf.index_select(0, slots).float().permute(1, 2, 0)  # [Hkv, D, K]
            v = vf.index_select(0, slots).float().transpose(0, 1)  # [Hkv, K, D]
            q = query[c0:c1].float().reshape(c1 - c0, hkv, g, d).permute(1, 0, 2, 3)  # [Hkv, rows, G, D]
            scores = torch.matmul(q.reshape(hkv, -1, d), k) * scale  # [Hkv, rows*G, K]
            if softcap > 0:
                scores = torch.tanh(scores / softcap) * softcap
            qpos = torch.arange(first, first + c1 - c0).repeat_interleave(g)  # [rows*G]
            visible = pos[None, :] <= qpos[:, None]  # [rows*G, K]
            if window > 0:
                visible &= qpos[:, None] - pos[None, :] < window
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            o = torch.matmul(probs, v)  # [Hkv, rows*G, D]
            out[c0:c1] = o.view(hkv, c1 - c0, g, d).permute(1, 0, 2, 3).reshape(c1 - c0, hq, d).to(query.dtype)
    return out


def windowed_decode_torch(query, k_cache, v_cache, block_tables, seq_lens, scale: float, window: int) -> torch.Tensor:
    """Decode with a sliding window and no soft cap, the whole batch at once: each sequence's last
    ``window`` positions gathered (not all of them) and one SDPA call with a padding mask.
    query [B, Hq, D] -> [B, Hq, D]; rows with seq_len 0 give zeros."""
    b, hq, d = query.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    lens = seq_lens.to(torch.int64)
    start = (lens - window).clamp_min(0)  # [B] first visible position
    width = int((lens - start).max())
    pos = start[:, None] + torch.arange(width, device=lens.device)  # [B, W] (on the device: CUDA too)
    valid = pos < lens[:, None]
    pos = torch.where(valid, pos, start[:, None])  # padding reads a real slot, masked out
    slots = block_tables.to(torch.int64).gather(1, pos // bs) * bs + pos % bs  # [B, W]
    k = k_cache.flatten(0, 1).index_select(0, slots.view(-1)).view(b, width, hkv, d).transpose(1, 2)
    v = v_cache.flatten(0, 1).index_select(0, slots.view(-1)).view(b, width, hkv, d).transpose(1, 2)
    q = query.view(b, hkv, hq // hkv, d)  # the G heads of a KV group act as G query positions
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(b, hq, d).masked_fill((lens <= 0)[:, None, None], 0.0)


def decode_as_prefill(seq_lens: torch.Tensor) -> torch.Tensor:
    """query_start_loc of a decode batch: one query row per sequence."""
    return torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)


__all__ = ["check_window_softcap", "window_or_softcap_applies", "masked_paged_attention_torch", "windowed_decode_torch",
           "decode_as_prefill"]

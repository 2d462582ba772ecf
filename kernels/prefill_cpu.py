"""The CPU path of kernels.paged_attention_prefill_torch: each sequence's attention as flash-attention
calls over parts of its keys, merged by their log-sum-exps, and a shared cached prefix attended once
for every sequence of the step that starts with it.

    keys of sequence i:  [ shared prefix: c full blocks | own cached: .. offset | new: q_len, causal ]
                           one call per group          one call, no mask      one call, causal
    out = sum_parts o_part * exp(lse_part - logsumexp(lse_parts))

No part needs a mask (the cached ones are visible to every query, the new one is square causal), so
the G query heads of a KV head become G times the rows against K/V that are not broadcast, and a
group's questions over one system prompt share one larger product. Measured (2-core Intel Xeon with
AMX, bfloat16, SmolLM2 on the GSP workload, `benchmarks/profile_gsp.py`): prefill attention 1.35 s
(results/intel-xeon-amx/profile_gsp.json) where one masked SDPA per sequence took 1.94 s
(an earlier run of it, in git history).
"""
from __future__ import annotations

import os

import torch

# A shared prefix shorter than this many full blocks is attended per sequence (a gather and one
# more call per group cost more than they save below it).
MIN_SHARED_BLOCKS = 16


def prefill_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                qsl: list[int], lens: list[int], scale: float, out: torch.Tensor) -> torch.Tensor:
    """Writes out [T, Hq, D] for sequences whose queries are the last q_len of their lens (validated
    by the caller); returns out."""
    _, bs, hkv, d = k_cache.shape
    hq = query.shape[1]
    g = hq // hkv
    kf, vf = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [NB*BS, Hkv, D]
    arange_bs = torch.arange(bs)
    table = block_tables.to(torch.int64)

    def slots(i: int, start: int, end: int) -> torch.Tensor:
        first, last = start // bs, -(-end // bs)
        s = (table[i, first:last].unsqueeze(1) * bs + arange_bs).view(-1)
        return s[start - first * bs:end - first * bs]

    def kv(i: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:  # [1, Hkv, end-start, D] each
        idx = slots(i, start, end)
        return kf.index_select(0, idx).transpose(0, 1)[None], vf.index_select(0, idx).transpose(0, 1)[None]

    def rows(i: int) -> torch.Tensor:  # [1, Hkv, G*q_len, D]: query heads of a KV head as rows
        q_len = qsl[i + 1] - qsl[i]
        return query[qsl[i]:qsl[i + 1]].reshape(q_len, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * q_len, d)

    # per sequence in a group: (tokens of its prefix attended with the group, that part's ([Hkv, G*q_len, D], [Hkv, G*q_len]))
    shared: dict[int, tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for members, c in _shared_prefixes(table, qsl, lens, bs):
        k, v = kv(members[0], 0, c * bs)
        q = torch.cat([rows(i) for i in members], dim=2)  # [1, Hkv, sum G*q_len, D]
        o, lse = _flash(q, k, v, False, scale)
        sizes = [g * (qsl[i + 1] - qsl[i]) for i in members]
        for i, oi, li in zip(members, o[0].split(sizes, dim=1), lse[0].split(sizes, dim=1)):
            shared[i] = (c * bs, (oi, li))
    for i in range(len(lens)):
        q_len = qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        start, prefix_part = shared.get(i, (0, None))
        seq_parts = [] if prefix_part is None else [prefix_part]
        offset = lens[i] - q_len
        q = rows(i)  # [1, Hkv, G*q_len, D]
        if offset > start:  # cached keys of its own: no mask
            k, v = kv(i, start, offset)
            o, lse = _flash(q, k, v, False, scale)
            seq_parts.append((o[0], lse[0]))
        k, v = kv(i, offset, lens[i])  # the new tokens: square causal, per query head
        o, lse = _flash(q[0].view(hkv, g, q_len, d), k[0].unsqueeze(1).expand(hkv, g, q_len, d),
                        v[0].unsqueeze(1).expand(hkv, g, q_len, d), True, scale)
        seq_parts.append((o.reshape(hkv, g * q_len, d), lse.reshape(hkv, g * q_len)))
        merged = _merge(seq_parts).to(out.dtype)  # [Hkv, G*q_len, D]
        out[qsl[i]:qsl[i + 1]] = merged.view(hkv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, hq, d)
    return out


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """torch's CPU flash attention, which also returns the log-sum-exp: 4-D [B, H, L, D] in and out."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None,
                                                                      scale=scale)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Parts' outputs [Hkv, R, D] weighted by their share of the softmax mass, two at a time:
    o = lerp(o_b, o_a, sigmoid(lse_a - lse_b)), lse = logaddexp(lse_a, lse_b)."""
    o, lse = parts[0]
    for o_b, lse_b in parts[1:]:
        o = torch.lerp(o_b.float(), o.float(), torch.sigmoid(lse - lse_b).unsqueeze(-1))
        lse = torch.logaddexp(lse, lse_b)
    return o


def _shared_prefixes(table: torch.Tensor, qsl: list[int], lens: list[int], bs: int) -> list[tuple[list[int], int]]:
    """Groups of >= 2 sequences with queries whose first c >= MIN_SHARED_BLOCKS block ids are equal
    and cached for every member (c * bs <= lens - q_len): (members, c) each."""
    by_first: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        cached = n - (qsl[i + 1] - qsl[i])
        if qsl[i + 1] > qsl[i] and cached >= MIN_SHARED_BLOCKS * bs:
            by_first.setdefault(int(table[i, 0]), []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min((lens[i] - (qsl[i + 1] - qsl[i])) // bs for i in members)
        c = len(os.path.commonprefix([table[i, :limit].tolist() for i in members]))
        if c >= MIN_SHARED_BLOCKS:
            groups.append((members, c))
    return groups

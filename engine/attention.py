"""AttentionMetadata: what every attention layer of one forward pass needs, built once per step
by the model runner and passed down as an argument (never stored in modules).

Token layout of a step (decodes first, so the decode path is one contiguous slice):

    tokens:   [ d_0 d_1 ... d_{D-1} | p_0 p_0 p_0 ... p_1 p_1 ... ]
               `-- num_decode_tokens --'`-- prefill chunks, query_start_loc --'

A "decode" here is any sequence with exactly one new token this step (a real decode, or the
last prompt token after a prefix-cache hit); everything else is a prefill chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of every new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [D] int32, KV length including the new token
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_seq_lens: torch.Tensor  # [P] int32
    prefill_query_start_loc: torch.Tensor  # [P+1] int32, offsets into the prefill slice
    scale: float
    # Rows that are prompt tokens (decode rows included: a prompt's last token computed alone after a cache hit).
    # In a step with none, the forward runs the op set's decode_ops, which may trade precision for speed (the
    # int4 CPU linears' one activation digit): a prompt's tokens, and so its first output token, never do.
    num_prompt_tokens: int = 0

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])

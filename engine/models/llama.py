"""Llama-family decoder (Llama, Mistral, Qwen2) with attention read through block tables.

Module names match Hugging Face's checkpoints so weights load by name. The KV cache is one
tensor for all layers, [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; each
layer writes its new K/V into slots and reads all K/V through the block tables.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.linear import Linear
from kernels.elementwise import add_rms_norm, rope, silu_mul


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None  # [T, hidden] each
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the residual add fused in; without a residual,
        (rms_norm(x), x). Rounds as HF does (kernels/elementwise.py)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v in one GEMM (the loader concatenates the checkpoint's q_proj, k_proj, v_proj).
        self.qkv_proj = Linear(
            cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=cfg.attention_bias
        )
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D/2]
        sin: torch.Tensor,  # [T, D/2]
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2*Hkv) * D]
        qk = rope(qkv[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D), cos, sin)  # [T, Hq+Hkv, D] (in place on CPU)
        q, k = qk[:, :Hq], qk[:, Hq:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)  # [T, Hkv, D]

        k_cache, v_cache = kv_cache[self.layer_idx, 0], kv_cache[self.layer_idx, 1]
        attn.ops.store_kv(k, v, k_cache, v_cache, attn.slot_mapping)

        nd = attn.num_decode_tokens
        outs = []
        if nd:
            outs.append(attn.ops.paged_attention_decode(
                q[:nd], k_cache, v_cache, attn.decode_block_tables, attn.decode_seq_lens, attn.scale
            ))  # [nd, Hq, D]
        if nd < T:
            outs.append(attn.ops.paged_attention_prefill(
                q[nd:], k_cache, v_cache, attn.prefill_block_tables, attn.prefill_seq_lens,
                attn.prefill_query_start_loc, attn.scale,
            ))  # [T-nd, Hq, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one GEMM (the loader concatenates the checkpoint's gate_proj and up_proj).
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, kv_cache, attn):
        # x: the previous layer's MLP output, not yet added to the residual stream (at layer 0: the
        # embeddings, with residual None). Each norm adds first, in one fused pass (as vLLM does).
        h, residual = self.input_layernorm(x, residual)  # residual = x + residual
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, attn), residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2ForCausalLM and MistralForCausalLM: they differ only in config flags."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [D/2]
        self.rope_scaling = rope_scaling

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float32 once per step and shared by all layers (HF does the same math per layer).
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        return (freqs.cos() * self.rope_scaling).to(dtype), (freqs.sin() * self.rope_scaling).to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, kv_cache, attn)
        return self.model.norm(x, residual)[0]  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]

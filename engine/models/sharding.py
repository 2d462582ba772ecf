"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style, as vLLM).

    column-parallel  qkv_proj (by heads: q heads, then kv heads, GQA-aware), gate_up_proj (by
                     intermediate rows): each rank computes its own heads / rows;
    row-parallel     o_proj, down_proj (by input columns): partial sums, added by all_reduce; their
                     biases live on rank 0 only (zeros elsewhere) so they are added once;
    vocab-parallel   embed_tokens, lm_head (by vocab rows, the last slice zero-padded);
    replicated       the norms (and Qwen3's per-head q/k norms).

``local_config`` is the model a rank builds: its heads, kv heads, intermediate size and vocab slice.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.errors import InvalidConfigError
from engine.models.config import ModelConfig
from engine.models.parallel import TPGroup


def check_divisible(cfg: ModelConfig, size: int) -> None:
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size)):
        if n % size:
            raise InvalidConfigError(
                f"tensor_parallel_size {size} must divide the model's {what} ({n}); "
                f"{cfg.architecture} has {cfg.num_heads} attention heads and {cfg.num_kv_heads} KV heads.")


def local_vocab(cfg: ModelConfig, size: int) -> int:
    return -(-cfg.vocab_size // size)


def local_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    if tp.size == 1:
        return cfg
    check_divisible(cfg, tp.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=cfg.num_kv_heads // tp.size,
                               intermediate_size=cfg.intermediate_size // tp.size,
                               vocab_size=local_vocab(cfg, tp.size))


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup) -> dict[str, torch.Tensor]:
    """The rank's slices of a fused state dict (loader.fuse_projections already ran)."""
    if tp.size == 1:
        return state
    r, n = tp.rank, tp.size
    hq, hkv, d, inter = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.head_dim, cfg.intermediate_size // n
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
            q, k, v = t.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
            out[name] = torch.cat([q[r * hq * d:(r + 1) * hq * d], k[r * hkv * d:(r + 1) * hkv * d],
                                   v[r * hkv * d:(r + 1) * hkv * d]]).contiguous()
        elif name.endswith("mlp.gate_up_proj.weight") or name.endswith("mlp.gate_up_proj.bias"):
            gate, up = t.split([cfg.intermediate_size, cfg.intermediate_size])
            out[name] = torch.cat([gate[r * inter:(r + 1) * inter], up[r * inter:(r + 1) * inter]]).contiguous()
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = t[:, r * hq * d:(r + 1) * hq * d].contiguous()
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = t[:, r * inter:(r + 1) * inter].contiguous()
        elif name.endswith("self_attn.o_proj.bias") or name.endswith("mlp.down_proj.bias"):
            out[name] = t if r == 0 else torch.zeros_like(t)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = local_vocab(cfg, n)
            part = t[r * rows:(r + 1) * rows]
            if part.shape[0] < rows:  # the last slice: pad with zero rows (their logits are cut off)
                part = torch.cat([part, part.new_zeros(rows - part.shape[0], t.shape[1])])
            out[name] = part.contiguous()
        else:
            out[name] = t
    return out

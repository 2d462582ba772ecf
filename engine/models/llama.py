"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) with attention read through block tables.

Module names match Hugging Face's checkpoints so weights load by name; the modules only hold
weights. The forward is written once, over a backend's op set (kernels.KernelOps) bound at load
with ``bind_ops``: the torch references, Triton, or the CPU C kernels differ only in the ops.

The KV cache is one tensor for all layers, [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]; each layer writes its new K/V into slots and reads all K/V through the block tables.

    per layer:  h, res = add_rms_norm(x, res)          (layer 0: res = embeddings)
                qkv = linear(h, Wqkv, b); [Qwen3, Gemma: rms_norm(q), rms_norm(k) per head]
                rope(q, k); K, V -> cache slots (store_kv)
                x = linear(attention(q, window_i, softcap), Wo, b); [Gemma: x = rms_norm(x)]
                h, res = add_rms_norm(x, res)
                x = linear(act_mul(linear(h, Wgu, b)), Wd, b);      [Gemma: x = rms_norm(x)]
                    (SwiGLU where the ops fuse it: linear_silu_mul(h, Wgu, b), the same values)
    then:       out = add_rms_norm(x, res)

act_mul is silu_mul, or gelu_tanh_mul for Gemma; Gemma's flags (engine/models/gemma.py) also scale
the embeddings, give sliding-window layers (window_i > 0) their own rope, and soft-cap the logits.

Tensor parallel (engine/models/sharding.py): each rank holds its heads, its MLP rows and its vocab
slice; the forward adds three collectives (``tp``): all_reduce after the vocab-parallel embedding and
after each row-parallel linear (o_proj, down_proj), and all_gather of the vocab-parallel logits.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.parallel import SINGLE, TPGroup
from kernels import KernelOps
from engine.models.packed_weights import release_layer, release_module, release_tied_embedding, restore
from engine.progress import PROGRESS_DELAY_S, tqdm
from kernels.quant_linear import QuantizedWeight, quantized_logits, with_quantized_linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # q, k and v in one GEMM (the loader concatenates the checkpoint's q_proj, k_proj, v_proj).
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: every head's q and k are RMS-normalised (one [D] weight each) before rope
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one GEMM (the loader concatenates the checkpoint's gate_proj and up_proj).
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama's pre-MLP norm; with sandwich norms (Gemma) the attention output's norm.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class LayerWeights:
    """One layer's tensors, gathered once at bind so the forward reads no module attributes."""

    norm1: torch.Tensor  # [hidden], the attention's input norm
    qkv: torch.Tensor  # [(Hq+2Hkv)*D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, Hq*D]
    o_bias: torch.Tensor | None
    norm2: torch.Tensor  # [hidden], the MLP's input norm
    gate_up: torch.Tensor  # [2I, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, I]
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [D] (Qwen3's per-head q/k norms; None elsewhere)
    k_norm: torch.Tensor | None = None  # [D]
    attn_out_norm: torch.Tensor | None = None  # [hidden] (Gemma's sandwich norms; None elsewhere)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    # An fp8 KV cache's per-tensor scales (kernels/kv_quant.py, vLLM's k_scale / v_scale): stored = x / scale. 1.0,
    # as vLLM without checkpoint scales; a model-dtype cache ignores them.
    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def of(cls, layer: DecoderLayer, pack: Callable[[torch.Tensor], torch.Tensor],
           pack_gate_up: Callable[[torch.Tensor], torch.Tensor]) -> LayerWeights:
        """The layer's tensors, linear weights in the layout the bound ops' linear reads (`pack`; gate_up:
        `pack_gate_up`, the layout of the op the forward runs it through)."""
        a, m = layer.self_attn, layer.mlp
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        return cls(layer.input_layernorm.weight, pack(a.qkv_proj.weight), a.qkv_proj.bias, pack(a.o_proj.weight),
                   a.o_proj.bias, mlp_norm.weight, pack_gate_up(m.gate_up_proj.weight),
                   m.gate_up_proj.bias, pack(m.down_proj.weight), m.down_proj.bias,
                   getattr(getattr(a, "q_norm", None), "weight", None), getattr(getattr(a, "k_norm", None), "weight", None),
                   layer.post_attention_layernorm.weight if sandwich else None,
                   layer.post_feedforward_layernorm.weight if sandwich else None)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2, Qwen3, Mistral and Gemma 3 (its text model): they differ only in config flags."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0,
                 tp: TPGroup = SINGLE, vocab_size: int | None = None) -> None:
        """``cfg`` is this rank's model (sharding.local_config); ``vocab_size`` the full vocabulary
        when the embedding and LM head hold a vocab slice (tensor parallel). Sliding-window layers
        with their own rope (Gemma 3) read ``local_inv_freq``, which the loader sets."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.vocab_size = vocab_size or cfg.vocab_size
        self.quantization = "none"  # the loader sets "gguf" / "compressed-tensors" / "gptq" / "awq" when linears stay quantized
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [D/2]
        self.local_inv_freq: torch.Tensor | None = None  # [D/2]: the sliding-window layers' own rope (Gemma 3)
        self.rope_scaling = rope_scaling
        self.ops: KernelOps | None = None  # bound once at load (bind_ops)
        self._fused_mlp = False  # gate_up and SiLU-and-multiply through ops.linear_silu_mul (bind_ops)
        self._layers: tuple[LayerWeights, ...] = ()
        self._lm_head: torch.Tensor | None = None  # lm_head.weight as the bound ops' linear reads it
        self._embed_from = None  # fn(ids) -> embedding rows from the tied head's bound form (bind_ops)

    def bind_ops(self, ops: KernelOps) -> None:
        """Bind the backend's ops (once, at load) and gather each layer's tensors. The model is for
        inference only: its weights stop requiring grad. Bound CPU ops read raw pointers: they need
        every weight contiguous in one dtype, which is checked here, once. Linear weights are packed
        into the ops' own layout here too (ops.pack_weight; on CPU a second, blocked copy of each)."""
        if self.ops is not None:  # bound before: the released plain weights come back from those forms
            restore(self, self.ops)
        self._embed_from = None  # fn(ids) -> embedding rows read from the tied head's bound form (CPU lanes)
        self.requires_grad_(False)
        dtype = self.model.norm.weight.dtype
        if self.quantized:  # the same ops, with a linear that also takes QuantizedWeight
            ops = with_quantized_linear(ops)
        if ops.name == "cpu" and any(p.dtype != dtype or not p.is_contiguous() for p in self.parameters()):
            raise ValueError("the cpu ops need every weight contiguous in the model dtype")
        self.ops = ops
        # SwiGLU in one op where the backend fuses it (CPU lanes kernels); Gemma's GELU MLP in two.
        self._fused_mlp = ops.linear_silu_mul is not None and self.config.hidden_act == "silu"
        pack_gate_up = ops.pack_gate_up if self._fused_mlp else ops.pack_weight
        layers = []
        # Each layer's plain weights released once packed (packed_weights.py); a bar where packing takes a while
        for layer in tqdm(self.model.layers, desc="packing weights", unit="layer", delay=PROGRESS_DELAY_S,
                          leave=False):
            layers.append(LayerWeights.of(layer, ops.pack_weight, pack_gate_up))
            release_layer(layer, layers[-1])
        self._layers = tuple(layers)
        head = self.lm_head.weight
        if isinstance(head, QuantizedWeight):  # an int8 table: its logits kernel measured where the ops can
            self._lm_head = ops.pack_lm_head(head) if ops.pack_lm_head else head
        else:
            self._lm_head = (ops.pack_lm_head or ops.pack_weight)(head.detach())  # no Parameter
            if not self.config.tie_word_embeddings:
                release_module(self.lm_head, self._lm_head)
            elif self.tp.size == 1 and ops.row_reader is not None:  # tied: embed from the head's form if it can
                self._embed_from = ops.row_reader(self._lm_head)
                if self._embed_from is not None:
                    release_tied_embedding(self)

    @property
    def quantized(self) -> bool:
        """Whether any linear is a QuantizedWeight (quantized GGUF, compressed-tensors, GPTQ or AWQ; a GGUF file
        can mix quantized and float tensors)."""
        return any(isinstance(getattr(layer.get_submodule(path), "weight", None), QuantizedWeight)
                   for layer in self.model.layers for path in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                               "mlp.gate_up_proj", "mlp.down_proj"))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor | None = None,
             scaling: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed in float32 once per step and shared by all layers (HF does the same math per layer).
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        scaling = self.rope_scaling if scaling is None else scaling
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
        return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) [T, D/2]: one rope for all, or the local one on sliding-window layers."""
        rope = self.rope(positions, dtype)
        if self.local_inv_freq is None:
            return [rope] * self.config.num_layers
        local = self.rope(positions, dtype, self.local_inv_freq, 1.0)
        return [local if self.config.window(i) else rope for i in range(self.config.num_layers)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        cfg, nd = self.config, attn.num_decode_tokens
        T, Hq, Hkv, D = input_ids.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ops = (self.ops.decode_ops or self.ops) if not attn.num_prompt_tokens else self.ops  # see AttentionMetadata
        eps = cfg.rms_norm_eps
        x = self._embed(input_ids)  # [T, hidden]
        ropes = self._ropes(positions, x.dtype)  # per layer: (cos, sin) [T, D/2] each
        act_mul = ops.gelu_tanh_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_mul
        softcap = cfg.attn_softcap
        residual = None  # x is the previous layer's MLP output, not yet added to the residual stream
        for i, w in enumerate(self._layers):
            window = cfg.window(i)
            h, residual = ops.add_rms_norm(x, residual, w.norm1, eps)  # residual = x + residual
            qkv = ops.linear(h, w.qkv, w.qkv_bias)  # [T, (Hq + 2*Hkv) * D]
            qk = ops.rope(self._qk(ops, qkv, w, T), *ropes[i])  # [T, Hq+Hkv, D]
            q, k = qk[:, :Hq], qk[:, Hq:]  # [T, Hq, D], [T, Hkv, D]
            v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)  # [T, Hkv, D]
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]  # [NB, BS, Hkv, D]
            ops.store_kv(k, v, k_cache, v_cache, attn.slot_mapping, k_scale=w.k_scale, v_scale=w.v_scale)
            if nd == T:  # decode-only step (beams, samples, batches of decodes)
                out = ops.paged_attention_decode(q, k_cache, v_cache, attn.decode_block_tables, attn.decode_seq_lens,
                                                 attn.scale, window=window, softcap=softcap, k_scale=w.k_scale,
                                                 v_scale=w.v_scale)  # [T, Hq, D]
            else:
                out = self._mixed_attention(ops, q, k_cache, v_cache, attn, window, softcap, w)
            x = self.tp.all_reduce(ops.linear(out.reshape(T, Hq * D), w.o, w.o_bias))  # [T, hidden]
            if w.attn_out_norm is not None:  # Gemma: normalise the attention output before the residual add
                x = ops.add_rms_norm(x, None, w.attn_out_norm, eps)[0]
            h, residual = ops.add_rms_norm(x, residual, w.norm2, eps)
            if self._fused_mlp:
                gated = ops.linear_silu_mul(h, w.gate_up, w.gate_up_bias)  # [T, I]
            else:
                gated = act_mul(ops.linear(h, w.gate_up, w.gate_up_bias))  # [T, I]
            x = self.tp.all_reduce(ops.linear(gated, w.down, w.down_bias))  # [T, hidden]
            if w.mlp_out_norm is not None:
                x = ops.add_rms_norm(x, None, w.mlp_out_norm, eps)[0]
        return ops.add_rms_norm(x, residual, self.model.norm.weight, eps)[0]  # [T, hidden]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self._embed_rows(input_ids)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), rounded to the model dtype as in HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self._embed_from is not None:
            return self._embed_from(input_ids)
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        rows = self.config.vocab_size  # this rank's slice of the vocabulary
        local = input_ids - self.tp.rank * rows
        mine = (local >= 0) & (local < rows)
        x = self.model.embed_tokens(local.clamp(0, rows - 1)) * mine[:, None].to(self.model.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    def _qk(self, ops: KernelOps, qkv: torch.Tensor, w: LayerWeights, T: int) -> torch.Tensor:
        """The q and k heads of a qkv projection, RMS-normalised per head where the model does (Qwen3),
        ready for rope: [T, Hq+Hkv, D] (a view into qkv when there are no q/k norms)."""
        cfg = self.config
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if w.q_norm is None:
            return qkv[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D)
        q = ops.add_rms_norm(qkv[:, : Hq * D].reshape(T * Hq, D), None, w.q_norm, cfg.rms_norm_eps)[0]  # [T*Hq, D]
        k = ops.add_rms_norm(qkv[:, Hq * D: (Hq + Hkv) * D].reshape(T * Hkv, D), None, w.k_norm,
                             cfg.rms_norm_eps)[0]  # [T*Hkv, D]
        return torch.cat((q.view(T, Hq, D), k.view(T, Hkv, D)), dim=1)  # [T, Hq+Hkv, D]

    @staticmethod
    def _mixed_attention(ops: KernelOps, q, k_cache, v_cache, attn: AttentionMetadata, window: int,
                         softcap: float, w: LayerWeights) -> torch.Tensor:
        """Decodes (the first num_decode_tokens rows) and prefill chunks (the rest): [T, Hq, D]."""
        nd = attn.num_decode_tokens
        prefill = ops.paged_attention_prefill(q[nd:], k_cache, v_cache, attn.prefill_block_tables,
                                              attn.prefill_seq_lens, attn.prefill_query_start_loc, attn.scale,
                                              window=window, softcap=softcap, k_scale=w.k_scale, v_scale=w.v_scale)
        if not nd:
            return prefill
        decode = ops.paged_attention_decode(q[:nd], k_cache, v_cache, attn.decode_block_tables,
                                            attn.decode_seq_lens, attn.scale, window=window, softcap=softcap,
                                            k_scale=w.k_scale, v_scale=w.v_scale)
        return torch.cat((decode, prefill))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        cap = self.config.final_softcap
        if isinstance(self._lm_head, QuantizedWeight):  # an int8 table: refined in float32 where sampling looks
            logits = quantized_logits(hidden, self._lm_head)  # [N, vocab]
        else:
            logits = self.ops.linear(hidden, self._lm_head)  # [N, vocab or this rank's slice]
            if self.tp.size > 1:
                logits = self.tp.all_gather_last(logits)[:, : self.vocab_size]  # [N, vocab]
        if cap:  # HF caps in the model dtype and then upcasts; float32 here (the same in fp32 models)
            return torch.tanh(logits.float() / cap) * cap
        return logits.float()

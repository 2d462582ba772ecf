"""CpuDecodeStack: the decoder stack of a decode-only step on CPU, calling the C kernels directly.

Decoding a few sequences (beams, n>1 samples, small batches) costs little arithmetic per layer, so
Python's share shows: through the modules, each layer pays ~200 us of module dispatch and of the
launchers' per-call checks (nine module calls, ~60 stride reads, shape and dtype checks) on top of
its kernels. Measured on SmolLM2 in float32, a 4-row decode forward took 30.3 ms through the
modules and 24.1 ms through this stack, most of the rest being the weight read.

The arithmetic is LlamaForCausalLM.forward's with the "cpu" attention ops: the same kernels on the
same operands in the same order, so hidden states are bit-identical (tests compare them). What
the launchers check per call is checked here once: at build (dtypes, contiguity, the kernels'
limits; anything else gets None and the modules run) and once per step (the batch's row count and
block tables). The decode kernel still checks every block id it reads.

    per layer:  h, res = add_rms_norm(x, res)          (layer 0: res = embeddings)
                qkv = h Wqkv (+b); rope(q, k) in place; K, V -> cache slots (store_kv)
                x = attention(q) Wo (+b);  h, res = add_rms_norm(x, res)
                x = silu_mul(h Wgu (+b)) Wd (+b)
    then:       out = add_rms_norm(x, res)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForCausalLM
from kernels import NativeKernels, native_kernels
from kernels.linear_cpu import rows_covered
from kernels import onednn_linear


@dataclass(frozen=True)
class _Layer:
    index: int
    norm1: torch.Tensor  # [hidden]
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # weight [(Hq+2Hkv)*D, hidden], bias
    o: tuple[torch.Tensor, torch.Tensor | None]
    norm2: torch.Tensor
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]


class CpuDecodeStack:
    def __init__(self, model: LlamaForCausalLM, native: NativeKernels, dtype: torch.dtype) -> None:
        cfg = model.config
        self.model, self.dtype = model, dtype
        self.hq, self.hkv, self.d, self.hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.eps, self.final_norm = model.model.norm.eps, model.model.norm.weight
        self.norm_fn = native.elementwise_for("add_rms_norm", dtype)
        self.silu_mul_fn = native.elementwise_for("silu_mul", dtype)
        self.rope_fn = native.elementwise_for("rope", dtype)
        self.decode_fn = native.decode_for(dtype)
        self.linear_fn = native.linear_for(dtype)
        self.store_kv_fn = native.store_kv
        self.linear_rows = rows_covered(native, dtype)  # Linear's policy; other row counts go to other_linear
        # Decided once, not per layer: the stack's weights are contiguous (see build) and it runs
        # under the runner's inference mode, so oneDNN covers every float32 call when it is here.
        use_onednn = dtype == torch.float32 and onednn_linear.onednn_linear_available()
        self.other_linear = onednn_linear.linear_covered if use_onednn else F.linear

        def proj(linear):
            return linear.weight, linear.bias

        self.layers = [
            _Layer(layer.self_attn.layer_idx, layer.input_layernorm.weight, proj(layer.self_attn.qkv_proj),
                   proj(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
                   proj(layer.mlp.gate_up_proj), proj(layer.mlp.down_proj))
            for layer in model.model.layers
        ]

    @classmethod
    def build(cls, model: LlamaForCausalLM, attention_backend: str, device: torch.device) -> CpuDecodeStack | None:
        """The stack for this model, or None where the modules must run: off CPU, without the C
        kernels, with another attention backend, or outside the kernels' limits."""
        native = native_kernels()
        dtype = model.model.embed_tokens.weight.dtype
        cfg = model.config
        if device.type != "cpu" or attention_backend != "cpu" or native is None or not native.has_dtype(dtype):
            return None
        if cfg.num_heads // cfg.num_kv_heads > native.max_group or cfg.head_dim > native.max_head_dim:
            return None
        if any(p.dtype != dtype or not p.is_contiguous() for p in model.parameters()):
            return None
        return cls(model, native, dtype)

    def covers(self, attn: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step (every scheduled sequence has exactly one new token)."""
        return 0 < num_tokens == attn.num_decode_tokens

    # -- the step -------------------------------------------------------------------------
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t, hq, hkv, d, hidden = input_ids.shape[0], self.hq, self.hkv, self.d, self.hidden
        nthreads = torch.get_num_threads()
        x = self.model.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.model.rope(positions, self.dtype)  # [T, D/2] each
        table, lens = self._checked_tables(attn, kv_cache.shape[3])
        nb, bs = kv_cache.shape[2], kv_cache.shape[3]
        slots = attn.slot_mapping.to(torch.int64).contiguous()  # [T], no copy when already so
        size = kv_cache.element_size()
        qkv_row, kv_row, slot_bytes = (hq + 2 * hkv) * d * size, hkv * d * size, kv_cache.stride(3) * size  # bytes
        residual = x  # updated in place from layer 0's second norm on (x is rebound every layer)
        h = torch.empty_like(x)
        use_c_linear = t in self.linear_rows
        for i, layer in enumerate(self.layers):
            # h = norm1(x + residual), residual updated in place (layer 0: norm1(x), residual = x)
            self.norm_fn(x.data_ptr(), None if i == 0 else residual.data_ptr(), layer.norm1.data_ptr(),
                         residual.data_ptr(), h.data_ptr(), t, hidden, hidden, hidden, hidden, hidden,
                         self.eps, nthreads)
            qkv = self._linear(h, layer.qkv, use_c_linear, nthreads)  # [T, (Hq+2Hkv)*D]
            self.rope_fn(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, hq + hkv, d, qkv.shape[1],
                         cos.shape[1], nthreads)
            k_cache, v_cache = kv_cache[layer.index, 0], kv_cache[layer.index, 1]  # [NB, BS, Hkv, D]
            k_new = qkv.data_ptr() + hq * d * size  # row layout: [q heads | k heads | v heads]
            if self.store_kv_fn(k_new, k_new + kv_row, k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t,
                                kv_row, qkv_row, qkv_row, slot_bytes, slot_bytes, nb * bs):
                raise IndexError(f"store_kv: slot_mapping holds slots outside [0, {nb * bs})")
            out = torch.empty((t, hq, d), dtype=self.dtype)
            bad = self.decode_fn(
                qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(),
                out.data_ptr(), t, hq, hkv, d, bs, table.stride(0), nb, qkv.shape[1], d,
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), hq * d, d, attn.scale, nthreads)
            if bad:
                raise IndexError(f"paged_attention_decode: block_tables holds block ids outside [0, {nb})")
            x = self._linear(out.view(t, hq * d), layer.o, use_c_linear, nthreads)
            self.norm_fn(x.data_ptr(), residual.data_ptr(), layer.norm2.data_ptr(), residual.data_ptr(),
                         h.data_ptr(), t, hidden, hidden, hidden, hidden, hidden, self.eps, nthreads)
            gate_up = self._linear(h, layer.gate_up, use_c_linear, nthreads)  # [T, 2I]
            act = torch.empty((t, gate_up.shape[1] // 2), dtype=self.dtype)
            self.silu_mul_fn(gate_up.data_ptr(), act.data_ptr(), t, act.shape[1], gate_up.shape[1], act.shape[1],
                             nthreads)
            x = self._linear(act, layer.down, use_c_linear, nthreads)
        final = torch.empty_like(x)
        self.norm_fn(x.data_ptr(), residual.data_ptr(), self.final_norm.data_ptr(), residual.data_ptr(),
                     final.data_ptr(), t, hidden, hidden, hidden, hidden, hidden, self.eps, nthreads)
        return final

    def _linear(self, x: torch.Tensor, proj: tuple[torch.Tensor, torch.Tensor | None], use_c: bool,
                nthreads: int) -> torch.Tensor:
        weight, bias = proj
        if not use_c:
            return self.other_linear(x, weight, bias)
        n, k = weight.shape
        out = torch.empty((x.shape[0], n), dtype=self.dtype)
        self.linear_fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                       x.shape[0], n, k, x.stride(0), n, nthreads)
        return out

    def _checked_tables(self, attn: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's block tables and lengths as the kernel reads them, checked once for all layers."""
        table, lens = attn.decode_block_tables, attn.decode_seq_lens
        if table.dtype != torch.int32 or table.stride(-1) != 1:
            table = table.to(torch.int32).contiguous()
        lens = lens.to(torch.int32).contiguous()
        longest = int(lens.max())
        if -(-longest // block_size) > table.shape[1]:
            raise ValueError(f"paged_attention_decode: seq_len {longest} needs more blocks than block_tables has "
                             f"({table.shape[1]} columns)")
        return table, lens

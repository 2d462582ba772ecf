"""DecodeGraphs: the model's decode-only forward captured as CUDA graphs, one per padded batch size.

Eagerly, a decode step issues every kernel from Python: ~570 launches for a 16-layer model and ~1,100 for
a 32-layer one, 17 and 32 ms a step at batch 64 on an H200 while the GPU computed for ~2 and ~7 ms
(the first H200 run of benchmarks/gpu/check.sh; benchmarks/results/h200/check.json is the second, with the
graphs). Replaying a graph issues them all at once.

As vLLM does: graphs are captured at start-up for batch sizes 1, 2, 4 and multiples of 8 up to
``max_num_seqs``; a decode-only step of B sequences replays the smallest graph of at least B rows.
The graphs read fixed input buffers, which each step fills before the replay:

    input_ids [S], positions [S], slot_mapping [S], block_tables [S, W], seq_lens [S]   (S = the largest size)

W = max_model_len / block_size columns, so any sequence's table fits. Rows past B are padding: their slot
is -1 (store_kv writes nothing) and their seq_len 0 (attention reads nothing and returns zeros); their
hidden states are computed and never read. Mixed steps (any prefill chunk) and steps wider than the
largest graph run eagerly, as do CPU devices, the torch reference ops (they read lengths on the host),
tensor parallelism (collectives inside a graph would need NCCL's capture) and ``enforce_eager=True``
(vLLM's switch).

Invariant: the forward a graph replays reads nothing from the host: every op it binds takes its launch
shapes from tensor shapes (the Triton decode launcher bounds the KV length by the table's width, W
here), never from tensor values.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from engine.attention import AttentionMetadata

logger = logging.getLogger("prefixserve")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to (and including) max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


class CudaGraphCapture:
    """``capture(fn) -> (replay, output)``: ``fn`` run once eagerly on a side stream (Triton compiles, cuBLAS
    picks its kernels), then captured as a CUDA graph; every graph of one capturer shares a memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph.replay, output


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, scale: float, sizes: list[int], max_blocks_per_seq: int,
                 capture: Callable | None = None, burst_block_size: int | None = None) -> None:
        """``model(input_ids, positions, kv_cache, attn) -> hidden [T, H]``; one graph per size, made by
        ``capture`` (a CudaGraphCapture unless a test gives a stand-in). ``burst_block_size``: also capture each
        size's decode-burst step (forward, greedy choice, ``advance`` in one graph; engine/decode_burst.py) for
        KV blocks of that many tokens."""
        self.model, self.kv_cache, self.scale = model, kv_cache, scale
        self.burst_block_size = burst_block_size
        self.sizes = sorted(sizes)
        self.width = max_blocks_per_seq
        self.enabled = True  # a benchmark switch: False runs every step eagerly (the same results)
        device, largest = kv_cache.device, self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self._empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        self._zero_i32 = torch.zeros(1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._burst_graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.fused_bursts = burst_block_size is not None  # a benchmark switch: False runs bursts op by op
        t0 = time.perf_counter()
        capture = capture or CudaGraphCapture()
        with torch.inference_mode():  # as the steps that replay them (ModelRunner.execute)
            for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
                # Every row is padding while capturing (slot -1, seq_len 0): the KV pool is never written.
                self._graphs[size] = capture(lambda size=size: self._forward(size))
                if burst_block_size is not None:
                    self._burst_graphs[size] = capture(lambda size=size: self._burst_step(size))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs of the decode forward%s for %d batch sizes (%s) in %.1f s",
                    " and the decode-burst step" if self._burst_graphs else "", len(self.sizes),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - t0)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._metadata(size))

    def _burst_step(self, size: int) -> torch.Tensor:
        """One decode-burst step over ``size`` rows: the forward, each row's argmax (the sampler's greedy choice),
        and the inputs of the next step (``advance``; padding rows stay padding). -> next token ids [size]."""
        next_ids = self.model.compute_logits(self._forward(size)).max(dim=-1).indices
        self._advance_rows(next_ids, self.burst_block_size, live=self.seq_lens[:size] > 0)
        return next_ids

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size], decode_seq_lens=self.seq_lens[:size],
            prefill_block_tables=self._empty_i32.view(0, 1), prefill_seq_lens=self._empty_i32,
            prefill_query_start_loc=self._zero_i32, scale=self.scale,
        )

    def fits(self, num_tokens: int, attn: AttentionMetadata) -> bool:
        """Whether this step replays a graph: decode-only, at most the largest size, tables within W."""
        return (self.enabled and num_tokens == attn.num_decode_tokens and 0 < num_tokens <= self.sizes[-1]
                and attn.decode_block_tables.shape[1] <= self.width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The model's forward for a step that ``fits``: [T, hidden] (a view of the graph's output)."""
        self.load(input_ids, positions, attn)
        return self.replay(input_ids.shape[0])

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> None:
        """Fill the graphs' input buffers for a step of T rows that ``fits`` (rows past T: padding)."""
        t = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(attn.slot_mapping)
        self.slot_mapping[t:size].fill_(-1)
        self.seq_lens[:t].copy_(attn.decode_seq_lens)
        self.seq_lens[t:size].fill_(0)
        tables = attn.decode_block_tables
        self.block_tables[:t, : tables.shape[1]].copy_(tables)  # columns past a row's length are never read

    def replay(self, t: int) -> torch.Tensor:
        """Replay the graph of ``t`` rows over the buffers as they are (filled by ``forward`` or ``advance``)."""
        replay, hidden = self._graphs[next(s for s in self.sizes if s >= t)]
        replay()
        return hidden[:t]

    @property
    def has_burst_graphs(self) -> bool:
        return bool(self._burst_graphs) and self.fused_bursts

    def burst_step(self, t: int) -> torch.Tensor:
        """Replay the decode-burst step of ``t`` rows (inputs from ``load`` or the previous burst step): the next
        token ids [t], a view of the graph's output that the next replay overwrites."""
        replay, next_ids = self._burst_graphs[next(s for s in self.sizes if s >= t)]
        replay()
        return next_ids[:t]

    def advance(self, next_ids: torch.Tensor, block_size: int) -> None:
        """A decode burst's next step (engine/decode_burst.py), on the device: rows [0, t) take ``next_ids`` [t]
        as their token at the next position, attend one more key, and write it to its slot in their block
        table (the burst reserved the blocks). Padding rows stay padding."""
        self._advance_rows(next_ids, block_size)

    def _advance_rows(self, next_ids: torch.Tensor, block_size: int, live: torch.Tensor | None = None) -> None:
        """``live`` [t] bool: only those rows advance (the captured burst step, where padding rows have seq_len 0).
        The block index is clamped to the table: the step after a burst's last may point past max_model_len."""
        t = next_ids.shape[0]
        self.input_ids[:t].copy_(next_ids)
        positions = self.positions[:t]
        step = 1 if live is None else live.long()
        positions.add_(step)
        self.seq_lens[:t].add_(step if live is None else live.int())
        column = (positions // block_size).clamp_(max=self.width - 1).unsqueeze(1)
        slots = self.block_tables[:t].gather(1, column).squeeze(1).long() * block_size + positions % block_size
        self.slot_mapping[:t].copy_(slots if live is None else torch.where(live, slots, -1))

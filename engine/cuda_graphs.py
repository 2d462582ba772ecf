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
                 capture: Callable | None = None) -> None:
        """``model(input_ids, positions, kv_cache, attn) -> hidden [T, H]``; one graph per size, made by
        ``capture`` (a CudaGraphCapture unless a test gives a stand-in)."""
        self.model, self.kv_cache, self.scale = model, kv_cache, scale
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
        t0 = time.perf_counter()
        capture = capture or CudaGraphCapture()
        with torch.inference_mode():  # as the steps that replay them (ModelRunner.execute)
            for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
                # Every row is padding while capturing (slot -1, seq_len 0): the KV pool is never written.
                attn = self._metadata(size)
                self._graphs[size] = capture(
                    lambda size=size, attn=attn: self.model(self.input_ids[:size], self.positions[:size], kv_cache, attn))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        logger.info("captured CUDA graphs of the decode forward for %d batch sizes (%s) in %.1f s",
                    len(self.sizes), ", ".join(map(str, self.sizes)), time.perf_counter() - t0)

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
        replay, hidden = self._graphs[size]
        replay()
        return hidden[:t]

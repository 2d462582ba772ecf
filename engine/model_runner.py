"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

The only component that builds tensors. It owns the KV pool and the per-sequence random
generators; it never decides anything about scheduling or block ownership.
"""
from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.decode_burst import DeviceBurst
from engine.kv_tiers import KVMover
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.sampler import SampleResult, SampleRow, Sampler, seeded_race_key
from engine.scheduler_output import SampleSpec, ScheduledRow, SchedulerOutput
from engine.speculative.verify import verify_drafts
from engine.structured_output import GrammarMask, StructuredOutputManager
from kernels import KernelOps
from prefix_cache import TransferTimings

logger = logging.getLogger("prefixserve")


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros for the KV pool. On CPU (Linux) the pool is an anonymous memory map populated by
    the kernel at creation (MAP_POPULATE): zero pages in bulk at ~0.27 s/GiB measured, 4-5x faster
    than torch.zeros' fill, and every page is resident before the first step. (Mapped lazily
    instead, the first steps to touch each block paid its page faults: ~0.65 ms per fresh float32
    block, 31 -> 34 s over the offline benchmark.) Stale slots are therefore always finite (zeros)."""
    populate = getattr(mmap, "MAP_POPULATE", None)
    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    if device.type != "cpu" or populate is None or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The tensor keeps the map alive (torch.frombuffer holds a reference to it).
    pool = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return torch.frombuffer(pool, dtype=dtype).view(shape)


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of prompt tokens [first_position, first_position + len(token_logprobs))."""

    first_position: int
    token_logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


@dataclass(frozen=True)
class RunnerOutput:
    sampled_seq_ids: tuple[str, ...]  # aligned with `samples` rows (forks included)
    samples: SampleResult | None  # None: no row sampled this step
    prompt_logprobs: dict[str, PromptLogprobs]  # seq_id -> this step's prompt logprobs
    transfer_timings: TransferTimings | None = None  # the step's KV tier moves, when it had any
    forward_seconds: float = 0.0  # the step's time without its tier transfers (feeds the tier cost model)
    num_accepted: dict[str, int] = field(default_factory=dict)  # seq_id -> drafts accepted (rows with drafts)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        ops: KernelOps,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        structured: StructuredOutputManager | None = None,
        num_host_kv_slots: int = 0,
        kv_heads: tuple[int, int] | None = None,
        total_kv_heads: int | None = None,
        cuda_graph_sizes: list[int] | None = None,
        max_blocks_per_seq: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
        decode_bursts: bool = True,
    ) -> None:
        """``kv_heads`` (first, count) of ``total_kv_heads``: this tensor-parallel rank's KV heads.
        ``kv_cache_dtype``: the pool's element type (None: the model dtype; float8 e4m3: kernels/kv_quant.py).
        ``cuda_graph_sizes``: decode batch sizes to capture as CUDA graphs (engine/cuda_graphs.py; None:
        every step runs eagerly), for block tables of up to ``max_blocks_per_seq`` blocks; ``decode_bursts``: with
        each size's decode-burst step too (engine/decode_burst.py)."""
        self.model, self.cfg, self.ops = model, model_config, ops
        self.structured = structured  # grammar masks of structured-output sequences (owned by the engine)
        self.block_size, self.device, self.dtype = block_size, device, dtype
        cfg = model_config
        t0 = time.perf_counter()
        self.kv_cache = zeroed_pool(  # [L, 2, NB, BS, Hkv, D]
            (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim), kv_cache_dtype or dtype, device
        )
        self.stage_seconds = {"kv pool": time.perf_counter() - t0}  # start-up stages (the engine logs them)
        self.kv_mover = KVMover(self.kv_cache, num_host_kv_slots, kv_heads, total_kv_heads)  # tier transfers
        self.scale = cfg.attention_scale
        t0 = time.perf_counter()
        model.bind_ops(ops)  # the backend's ops, bound once: the one forward calls only these
        self.stage_seconds["weights packed (kernels chosen)"] = time.perf_counter() - t0
        self.sampler = Sampler(torch.Generator(device="cpu").manual_seed(seed))
        self._burst_host: torch.Tensor | None = None  # pinned tokens of decode bursts (launch_burst)
        t0 = time.perf_counter()
        self.graphs = self._capture_graphs(cuda_graph_sizes, max_blocks_per_seq, decode_bursts) \
            if cuda_graph_sizes else None
        if self.graphs is not None:
            self.stage_seconds["CUDA graphs"] = time.perf_counter() - t0

    def _capture_graphs(self, sizes: list[int], max_blocks_per_seq: int, bursts: bool) -> DecodeGraphs | None:
        try:
            return DecodeGraphs(self.model, self.kv_cache, self.scale, sizes, max_blocks_per_seq,
                                burst_block_size=self.block_size if bursts else None)
        except Exception as exc:  # a model or op that cannot be captured still serves, eagerly
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
            return None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        """Run one step: tier moves, block copies, the forward over every row, sampling."""
        start = time.perf_counter()
        # Tier moves first: a block demoted this step may be a copy target or get new KV below.
        timings = self.kv_mover.apply(batch.transfers) if batch.transfers else None
        if batch.copies:
            self.ops.copy_blocks(self.kv_cache, torch.tensor(batch.copies, dtype=torch.long, device=self.device))
        if not batch.rows:
            return RunnerOutput((), None, {}, timings)
        rows = batch.rows  # decodes first (the scheduler's order)
        input_ids, positions, attn = self._prepare(rows, batch.num_decode_rows)
        hidden = self._forward(input_ids, positions, attn)  # [T, hidden]

        # Only the last position of a row that reaches the end of its tokens needs logits (a row with k
        # drafts: its last k + 1). The samples forking from a row (n>1) are extra rows of the same
        # logits, each drawn with its own params and generator.
        ends = torch.tensor([r.num_new_tokens for r in rows]).cumsum(0) - 1
        row_positions, specs, offsets = self._sampled_positions(rows, ends.tolist())
        samples, accepted = None, {}
        if specs:
            logits = self.model.compute_logits(hidden[torch.tensor(row_positions, dtype=torch.long, device=self.device)])
            samples = self.sampler(logits, [self._sample_row(s, j) for s, j in zip(specs, offsets)],
                                   self._grammar_mask(rows, specs))
            if batch.num_draft_tokens:
                specs, samples, accepted = verify_drafts(rows, specs, samples)
        prompt_lp = self._prompt_logprobs(rows, hidden, ends)
        moved = 0.0 if timings is None else timings.device_to_host_s + timings.host_to_device_s + timings.remote_to_device_s
        return RunnerOutput(tuple(s.seq_id for s in specs), samples, prompt_lp, timings,
                            time.perf_counter() - start - moved, accepted)

    def burst_rows(self) -> int:
        """The most rows a decode burst (engine/decode_burst.py) may have here: the largest graph's; 0 without
        graphs (bursts replay them)."""
        return self.graphs.sizes[-1] if self.graphs is not None and self.graphs.enabled else 0

    @torch.inference_mode()
    def launch_burst(self, batch: SchedulerOutput, num_steps: int) -> DeviceBurst:
        """Queue ``num_steps`` decode steps of ``batch`` (plain greedy decodes, blocks reserved for every step) on
        the device, each fed the previous one's argmax; returns at once (engine/decode_burst.py)."""
        rows = batch.rows
        input_ids, positions, attn = self._prepare(rows, len(rows), table_lookahead=num_steps - 1)
        if not self.graphs.fits(len(rows), attn):
            raise ValueError(f"a decode burst of {len(rows)} rows does not fit the CUDA graphs")
        on_device = self.device.type != "cpu"
        t, graphs = len(rows), self.graphs
        host = self._burst_host_buffer(num_steps) if on_device else torch.empty((num_steps, t), dtype=torch.long)
        events: list | None = [] if on_device else None
        graphs.load(input_ids, positions, attn)
        for k in range(num_steps):
            if graphs.has_burst_graphs:  # forward, argmax and the next step's inputs: one graph
                next_ids = graphs.burst_step(t)  # [t], overwritten by the next replay: copied out below
            else:
                next_ids = self.model.compute_logits(graphs.replay(t)).max(dim=-1).indices  # the sampler's argmax
                if k + 1 < num_steps:
                    graphs.advance(next_ids, self.block_size)
            host[k, :t].copy_(next_ids, non_blocking=on_device)
            if on_device:
                events.append(torch.cuda.Event())
                events[-1].record()
        return DeviceBurst(tuple(r.seq_id for r in rows), host, events)

    def _burst_host_buffer(self, num_steps: int) -> torch.Tensor:
        """Pinned [K, rows] for a burst's tokens, kept: a later burst's copies queue behind an earlier one's."""
        buf = self._burst_host
        if buf is None or buf.shape[0] < num_steps:
            buf = torch.empty((max(num_steps, 8), self.graphs.sizes[-1]), dtype=torch.long, pin_memory=True)
            self._burst_host = buf
        return buf

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(input_ids.shape[0], attn):
            return self.graphs.forward(input_ids, positions, attn)
        return self.model(input_ids, positions, self.kv_cache, attn)

    # -- tensors ------------------------------------------------------------------------
    def _prepare(self, rows: tuple[ScheduledRow, ...], num_decodes: int, table_lookahead: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``table_lookahead``: decode rows' block tables also cover that many positions past their end (a
        decode burst's later steps)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for r in rows:
            ids.extend(r.token_ids)
            for p in range(r.start, r.end):
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            pos.extend(range(r.start, r.end))
        decodes, prefills = rows[:num_decodes], rows[num_decodes:]
        # A decoding row with k drafts is k + 1 decode queries over the same blocks, the i-th seeing the
        # first start + i + 1 positions: the decode kernel (shared blocks attended once for all of them)
        # instead of the prefill one, which is ~4x slower per query at these lengths (measured, Zen 5).
        decode_ends = [(r.block_ids, p + 1) for r in decodes for p in range(r.start, r.end)]
        qsl = [0]
        for r in prefills:
            qsl.append(qsl[-1] + r.num_new_tokens)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=len(decode_ends),
            decode_block_tables=self._block_table([(ids, end + table_lookahead) for ids, end in decode_ends]),
            decode_seq_lens=torch.tensor([end for _, end in decode_ends], dtype=torch.int32, device=dev),
            prefill_block_tables=self._block_table([(r.block_ids, r.end) for r in prefills]),
            prefill_seq_lens=torch.tensor([r.end for r in prefills], dtype=torch.int32, device=dev),
            prefill_query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            scale=self.scale,
            num_prompt_tokens=sum(r.num_prompt_tokens for r in rows),
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            attn,
        )

    def _block_table(self, entries: list[tuple[tuple[int, ...], int]]) -> torch.Tensor:
        """(block_ids, end) per query row -> [rows, width]. Only the blocks covering [0, end) are read; pad
        with 0 (never read past seq_len)."""
        width = max((-(-end // self.block_size) for _, end in entries), default=1)
        table = [list(ids[:width]) + [0] * (width - min(len(ids), width)) for ids, _ in entries]
        return torch.tensor(table, dtype=torch.int32, device=self.device).reshape(len(entries), width)

    # -- sampling -----------------------------------------------------------------------
    @staticmethod
    def _sample_row(spec: SampleSpec, offset: int = 0) -> SampleRow:
        """``offset``: the row's position after its last known token (a row with drafts samples several). A
        seeded row's draw is keyed by (seed, output index) alone, so the same seed gives the same tokens
        whatever the batch, the step the token falls in, or how many drafts were verified with it."""
        p = spec.params
        key = None if p.seed is None else seeded_race_key(p.seed, spec.output_index + offset)
        return SampleRow(p, spec.history, spec.num_prompt_tokens, None, spec.banned_token_ids,
                         spec.num_top_logprobs, key)

    @staticmethod
    def _sampled_positions(rows: tuple[ScheduledRow, ...], ends: list[int]
                           ) -> tuple[list[int], list[SampleSpec], list[int]]:
        """Per sampled position: its row in the forward's output, its spec, and its offset after the row's
        last known token (a row with k drafts is sampled at its last k + 1 positions, each of its specs)."""
        positions, specs, offsets = [], [], []
        for r, end in zip(rows, ends):
            k = r.num_draft_tokens
            for spec in r.samples:
                for j in range(k + 1):
                    positions.append(end - k + j)
                    specs.append(spec)
                    offsets.append(j)
        return positions, specs, offsets

    def _grammar_mask(self, rows: tuple[ScheduledRow, ...], specs: list[SampleSpec]) -> GrammarMask | None:
        """Position j of a row with drafts is masked by the grammar's state after the row's first j drafts."""
        if self.structured is None or all(s.params.structured_outputs is None for s in specs):
            return None  # the common case costs one attribute check per row
        drafted = [r.draft_token_ids[:j] for r in rows for _ in r.samples for j in range(r.num_draft_tokens + 1)]
        return self.structured.grammar_mask([s.seq_id for s in specs], drafted)

    def _prompt_logprobs(
        self, rows: tuple[ScheduledRow, ...], hidden: torch.Tensor, ends: torch.Tensor
    ) -> dict[str, PromptLogprobs]:
        result: dict[str, PromptLogprobs] = {}
        for i, r in enumerate(rows):
            spec = r.prompt_logprobs
            if spec is None:
                continue
            # The row's hidden state at position p scores token p + 1.
            first_row = int(ends[i]) - r.num_new_tokens + 1 + (spec.first_position - 1 - r.start)
            rows_h = hidden[first_row:first_row + len(spec.targets)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows_h).cpu(), dim=-1)  # [n, V]
            targets = torch.tensor(spec.targets)
            chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
            ranks = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
            k = spec.num_top
            top_v, top_i = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
            top = [list(zip(ti, tv)) for ti, tv in zip(top_i.tolist(), top_v.tolist())]
            result[r.seq_id] = PromptLogprobs(spec.first_position, chosen.tolist(), ranks.tolist(), top)
        return result

"""Engine: requests in, RequestOutputs out, one `step()` at a time.

    step():  schedule -> run the model -> postprocess (append tokens, stop checks, free blocks)
"""
from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from engine.beam_search import BeamSearch
from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from engine.detokenizer import Detokenizer, stream_safe_text
from engine.errors import ContextLengthExceededError, InvalidConfigError, InvalidRequestError
from engine.host_malloc import tune_host_malloc
from engine.kv_tiers import build_kv_tiers, tier_stats
from engine.model_runner import ModelRunner, RunnerOutput
from engine.models.config import ModelConfig, load_model_config
from engine.models.loader import load_model
from engine.models.resolve import model_fingerprint, resolve_model
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.structured_output import StructuredOutputManager
from kernels import get_attention_ops
from prefix_cache import BlockManager

logger = logging.getLogger("prefixserve")

PromptInput = str | list[int] | dict


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]  # samples in index order (n>1 forks included); the root beam for beam search
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    beam: BeamSearch | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)

    def live_seqs(self) -> list[Sequence]:
        return self.beam.beams() if self.beam is not None else [s for s in self.seqs if not s.is_finished]


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = _resolve_device(config.device)
        self.dtype = getattr(torch, config.dtype)
        folder = resolve_model(config.model)
        self.model_path = folder
        self.model_config: ModelConfig = load_model_config(folder)
        self.max_model_len = _max_model_len(config, self.model_config)
        self.tokenizer = _load_tokenizer(folder)
        _freeze_import_time_objects()
        if self.device.type == "cpu":
            tune_host_malloc()
        self.detokenizer = Detokenizer(self.tokenizer)
        model = load_model(folder, self.model_config, self.dtype, self.device)
        num_blocks = self._num_kv_blocks()
        fingerprint = model_fingerprint(folder)
        self.blocks = BlockManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            extra_keys=(fingerprint, config.dtype),
        )
        # Host-memory and Redis KV tiers (None when both are off).
        self.tiers = build_kv_tiers(config, self.blocks, self.model_config, fingerprint)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy), self.blocks,
            tiers=self.tiers, preemption_mode=config.preemption_mode,
        )
        ops = get_attention_ops(config.attention_backend, self.device)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.runner = ModelRunner(
            model, self.model_config, num_blocks, config.block_size, ops, self.device, self.dtype, config.seed,
            structured=self.structured,
            num_host_kv_slots=self.tiers.host.num_slots if self.tiers is not None and self.tiers.host else 0,
        )
        self.requests: dict[str, RequestState] = {}
        self.counters = EngineCounters()
        self._arrivals = itertools.count()
        self._beam_ids = itertools.count(1)
        kv_bytes = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        logger.info(
            "model %s (%s, %d layers, %d/%d heads) dtype=%s device=%s attention=%s; KV cache: %d blocks x %d tokens "
            "= %d tokens, %.1f MiB; max_model_len=%d",
            config.model, self.model_config.architecture, self.model_config.num_layers, self.model_config.num_heads,
            self.model_config.num_kv_heads, config.dtype, self.device, ops.name, num_blocks, config.block_size,
            num_blocks * config.block_size, kv_bytes / 2**20, self.max_model_len,
        )
        if self.tiers is not None:
            logger.info(
                "KV tiers: host memory %s; Redis %s; preemption=%s; load policy=%s",
                f"{self.tiers.host.num_slots} blocks" if self.tiers.host else "off",
                config.kv_redis_url or "off", config.preemption_mode, config.kv_tier_policy,
            )

    # -- public API ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.", param="request_id")
        text, token_ids = self._tokenize(prompt)
        params = self._effective_params(params, len(token_ids))
        # Compiled (or found in the cache) before anything is created: a bad grammar fails alone.
        grammar = (
            self.structured.compile(params.structured_outputs) if params.structured_outputs is not None else None
        )
        state = RequestState(request_id, text, token_ids, [], arrival_time or time.monotonic())
        order = next(self._arrivals)
        # n>1 samples and beams are all one prompt: only the first sequence computes it; the
        # others fork from it (sharing its blocks) when its first token is sampled.
        num_seqs = 1 if params.use_beam_search else params.n
        for i in range(num_seqs):
            state.seqs.append(Sequence(
                seq_id=f"{request_id}#{i}", request_id=request_id, index=i, params=params.for_sample(i),
                token_ids=list(token_ids), num_prompt_tokens=len(token_ids), arrival_order=order,
                priority=priority, cache_salt=cache_salt,
                logprobs=[] if params.logprobs is not None else None,
                prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            ))
        if grammar is not None:  # every sample parses on its own, forks included
            self.structured.add([s.seq_id for s in state.seqs], grammar)
        root = state.seqs[0]
        root.pending_forks = state.seqs[1:]
        root.group_size = params.n
        if params.use_beam_search:
            state.beam = BeamSearch(
                root, width=params.n, max_tokens=params.max_tokens, length_penalty=params.length_penalty,
                early_stopping=params.early_stopping, stop_token_ids=self._stop_token_ids(params),
            )
        self.requests[request_id] = state
        self.scheduler.add(root)
        self.counters.prompt_tokens += len(token_ids)

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        result = self._run(batch)
        if result is None:  # nothing to run, or only KV moves between tiers
            return []
        outputs = self._postprocess(batch, result)
        self._write_through()
        return outputs

    def _run(self, batch: SchedulerOutput) -> RunnerOutput | None:
        ok = False
        try:
            result = self._execute(batch)
            ok = True
            return result
        finally:  # copy sources and tier pins are held only until this step's run, failed or not
            self.blocks.release_copy_sources()
            if self.tiers is not None:
                self.tiers.end_step(ok)

    def _execute(self, batch: SchedulerOutput) -> RunnerOutput | None:
        if batch.is_empty:
            return None
        if not batch.chunks:
            self.tiers.record_step(0.0, 0, self.runner.apply_transfers(batch.transfers))
            return None
        start = time.perf_counter()
        result = self.runner.execute(batch)
        if self.tiers is not None:  # feed the load-vs-recompute estimates
            t = result.transfer_timings
            moved = 0.0 if t is None else t.device_to_host_s + t.host_to_device_s + t.remote_to_device_s
            self.tiers.record_step(time.perf_counter() - start - moved, batch.num_batched_tokens, t)
        return result

    def _write_through(self) -> None:
        """Blocks cached this step go to Redis: read their bytes now, while they are immutable."""
        writes = self.tiers.take_writes() if self.tiers is not None else None
        if writes:
            self.tiers.submit_writes(writes, self.runner.kv_mover.read_blocks([w.block_id for w in writes]))

    def flush_kv_writes(self, timeout: float = 5.0) -> bool:
        """Wait until queued Redis writes are written (True) or ``timeout`` passed (False)."""
        return self.tiers.flush(timeout) if self.tiers is not None else True

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued Redis writes (up to ``timeout``) and stop the tier's writer. Idempotent."""
        if self.tiers is not None:
            self.tiers.close(timeout)

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.live_seqs():
            seq.finish_reason = "abort"
            self._finish(seq)
        if state.beam is not None:
            state.beam.done = True
        return True

    def abort_running(self) -> list[str]:
        """After a failed step: abort the requests that were running (all of them if none was,
        since then scheduling itself failed and would fail again). Returns their ids."""
        running = {seq.request_id for seq in self.scheduler.running}
        victims = sorted(running or self.requests)
        for request_id in victims:
            self.abort(request_id)
        return victims

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_tokenizer(self):
        return self.tokenizer

    def kv_cache_usage(self) -> dict[str, int]:
        return self.blocks.usage()

    def stats(self) -> dict:
        """Numbers for /metrics: queue sizes, KV usage, prefix cache, token counters."""
        usage = self.blocks.usage()
        cache = self.blocks.stats()
        return {
            "num_requests_running": len({s.request_id for s in self.scheduler.running}),
            "num_requests_waiting": len({s.request_id for s in self.scheduler.waiting}),
            "kv_cache_usage_perc": usage["num_in_use"] / max(usage["num_blocks"], 1),
            "prefix_cache_queries": cache.queries,
            # device hits plus tokens loaded from the host / Redis tiers
            "prefix_cache_hits": cache.hits + (self.tiers.counters.loaded_tokens if self.tiers is not None else 0),
            "prefix_cache_evictions": cache.evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.counters.prompt_tokens,
            "generation_tokens": self.counters.generation_tokens,
            "request_success": dict(self.counters.requests_finished),
            **tier_stats(self.tiers),
        }

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        live = {s.seq_id for s in self.scheduler.running}
        for seq in self.scheduler.waiting:
            assert not self.blocks.has_seq(seq.seq_id), f"waiting {seq.seq_id} holds blocks"
        for seq_id in live:
            assert self.blocks.has_seq(seq_id), f"running {seq_id} holds no blocks"
        self.structured.check_integrity({s.seq_id for st in self.requests.values() for s in st.live_seqs()})

    # -- admission ------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'.", param="prompt")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}).", param="prompt")
        else:
            raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}.", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty.", param="prompt")
        return text, ids

    def _effective_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens < 1 or prompt_len + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, {max(max_tokens, 1)} "
                f"for the completion). Please reduce the prompt or the completion length.",
                param="max_tokens" if prompt_len < self.max_model_len else "prompt",
            )
        # KV is stored for every token but the last sampled one.
        blocks_needed = -(-(prompt_len + max_tokens - 1) // self.config.block_size)
        if blocks_needed > self.blocks.num_blocks:
            raise ContextLengthExceededError(
                f"the request needs {blocks_needed} KV blocks but the pool has {self.blocks.num_blocks}; "
                f"reduce the prompt or max_tokens, or enlarge the KV cache.",
                param="max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens exceeds the {max_tokens} tokens available.", param="min_tokens")
        return params if params.max_tokens == max_tokens else replace(params, max_tokens=max_tokens)

    # -- postprocess ----------------------------------------------------------------------
    def _postprocess(self, batch: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for chunk in batch.chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            state = self.requests[seq.request_id]
            state.first_scheduled_time = state.first_scheduled_time or now
            if seq.seq_id in result.prompt_logprobs:
                self._append_prompt_logprobs(seq, result.prompt_logprobs[seq.seq_id])
        samples = result.samples
        self._fork_samples(result.sampled_seqs)
        for row, seq in enumerate(result.sampled_seqs):
            state = self.requests[seq.request_id]
            if state.beam is not None:
                state.beam.record(seq, samples.top_logprobs[row])
            else:
                self._append_token(seq, row, samples)
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.beam is not None:
                if not state.beam.ready():
                    continue
                self._advance_beams(state)
                if not state.beam.done:
                    continue
            outputs.append(self._request_output(state))
        return outputs

    # -- forks ------------------------------------------------------------------------------
    def _fork_samples(self, sampled: tuple[Sequence, ...]) -> None:
        """n>1: the prompt is computed; every other sample takes the root's block table (shared,
        copy-on-write) before each appends its own first token."""
        for root in sampled:
            for child in root.pending_forks:
                child.num_cached_tokens = root.num_cached_tokens
                self._fork_seq(root, child)
            root.pending_forks = []

    def _fork_seq(self, parent: Sequence, child: Sequence) -> None:
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        if self.blocks.has_seq(parent.seq_id):
            self.blocks.fork(parent.seq_id, child.seq_id)
            self.scheduler.adopt(child)
        else:  # the parent was preempted after its step: the child recomputes (mostly cache hits)
            child.num_computed_tokens = 0
            self.scheduler.add(child)

    def _advance_beams(self, state: RequestState) -> None:
        """Apply one beam-search decision: reuse each chosen parent once, fork it for further
        choices, free beams nobody chose."""
        group = state.beam
        before = group.beams()
        chosen = group.step()
        if group.done:
            for seq in before:
                self._finish(seq)
            return
        reused: set[str] = set()
        beams: list[tuple[Sequence, int]] = []
        for c in chosen:
            if c.parent.seq_id in reused:
                child = self._new_beam(c.parent)
                self._fork_seq(c.parent, child)  # copies the parent's tokens before it appends
                beams.append((child, c.token_id))
            else:
                reused.add(c.parent.seq_id)
                beams.append((c.parent, c.token_id))
        for seq in before:
            if seq.seq_id not in reused:
                self._finish(seq)
        for seq, token in beams:
            seq.token_ids.append(token)
            self.counters.generation_tokens += 1
        group.running = [(seq, c.cumulative_logprob) for (seq, _), c in zip(beams, chosen)]

    def _new_beam(self, parent: Sequence) -> Sequence:
        return Sequence(
            seq_id=f"{parent.request_id}#b{next(self._beam_ids)}", request_id=parent.request_id, index=0,
            params=parent.params, token_ids=[], num_prompt_tokens=parent.num_prompt_tokens,
            arrival_order=parent.arrival_order, priority=parent.priority, cache_salt=parent.cache_salt,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids.update(self.model_config.eos_token_ids)
        return frozenset(ids)

    def _append_token(self, seq: Sequence, row: int, samples) -> None:
        token = samples.token_ids[row]
        previous_len = len(seq.text)
        seq.token_ids.append(token)
        self.counters.generation_tokens += 1
        if seq.logprobs is not None:
            seq.cumulative_logprob += samples.logprobs[row]
            entry = {tid: Logprob(lp, rank + 1, self.detokenizer.decode_token(tid))
                     for rank, (tid, lp) in enumerate(samples.top_logprobs[row])}
            entry.setdefault(token, Logprob(samples.logprobs[row], samples.ranks[row],
                                            self.detokenizer.decode_token(token)))
            seq.logprobs.append(entry)
        p = seq.params
        stop = self.detokenizer.update(seq, previous_len)
        grammar_done = p.structured_outputs is not None and self.structured.accept(seq.seq_id, token)
        if p.stop_token_ids and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.model_config.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop.stop
        elif grammar_done:  # the output is complete and the grammar allows nothing more
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._finish(seq)

    def _append_prompt_logprobs(self, seq: Sequence, lp) -> None:
        for j, (chosen, rank, top) in enumerate(zip(lp.token_logprobs, lp.ranks, lp.top)):
            token = seq.token_ids[lp.first_position + j]
            entry = {tid: Logprob(v, r + 1, self.detokenizer.decode_token(tid)) for r, (tid, v) in enumerate(top)}
            entry.setdefault(token, Logprob(chosen, rank, self.detokenizer.decode_token(token)))
            seq.prompt_logprobs.append(entry)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.runner.release(seq.seq_id)
        self.structured.release(seq.seq_id)

    def _request_output(self, state: RequestState) -> RequestOutput:
        finished = state.finished
        outputs = self._beam_outputs(state) if state.beam is not None else []
        for seq in state.seqs if state.beam is None else ():
            text = seq.text if seq.is_finished else stream_safe_text(seq.text, seq.params.stop_strings)
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        first = state.seqs[0]
        if finished:
            self.requests.pop(state.request_id, None)
            reason = (outputs[0].finish_reason if outputs else None) or "stop"
            self.counters.requests_finished[reason] = self.counters.requests_finished.get(reason, 0) + 1
        metrics = {"arrival_time": state.arrival_time}
        for name in ("first_scheduled_time", "first_token_time", "last_token_time"):
            if getattr(state, name) is not None:
                metrics[name] = getattr(state, name)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=finished, num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            metrics=metrics,
        )

    def _beam_outputs(self, state: RequestState) -> list[CompletionOutput]:
        outputs = []
        for i, hyp in enumerate(state.beam.finished):
            text = self.tokenizer.decode(list(hyp.token_ids), skip_special_tokens=True)
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=list(hyp.token_ids), cumulative_logprob=hyp.cumulative_logprob,
                finish_reason=hyp.finish_reason,
            ))
        return outputs

    # -- sizing ---------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        per_block = cfg.block_size * self.model_config.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1.0 - cfg.gpu_memory_utilization))
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise InvalidConfigError(f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes.")
        return int(num_blocks)


def _freeze_import_time_objects() -> None:
    """Move what exists so far (the ~10^6 objects of torch, transformers and the tokenizer) out of
    the cyclic GC's sight, once per process, as vLLM does after start-up: the full collections
    that steps trigger by allocating outputs then no longer traverse them (measured 0.3-1.2 s of a
    13 s offline bfloat16 run). Done before the model and KV pool exist, so an engine that is
    dropped later is still collected whole."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
        # At exit, hand them back: interpreter teardown then finalises them as usual (frozen ones
        # would be reported as leaks by nanobind-based extensions such as triton's).
        atexit.register(gc.unfreeze)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError("device 'cuda' was requested but no CUDA device is available.")
    return device


def _max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if model.sliding_window is not None and model.sliding_window < limit:
        # Sliding-window attention is not implemented: stay inside the window, where full
        # attention and windowed attention agree.
        limit = model.sliding_window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise InvalidConfigError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit}.")
    return config.max_model_len


def _load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

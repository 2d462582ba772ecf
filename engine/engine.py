"""Engine: requests in, RequestOutputs out, one `step()` at a time.

    step():  schedule -> execute -> update from the output (scheduler) -> outputs (detokenize, stops)
"""
from __future__ import annotations

import itertools
import logging
import time

import torch
import torch.distributed as dist

from engine.admission import PromptInput, effective_params, tokenize_prompt
from engine.auto_dtype import resolve_dtype
from engine.beam_search import BeamSearch
from engine.config import EngineConfig
from engine.cuda_graphs import capture_sizes
from engine.decode_burst import DEFAULT_DECODE_BURST, burst_length
from engine.detokenizer import Detokenizer
from engine.errors import InvalidConfigError, InvalidRequestError
from engine.executor import ParallelRunner, TensorParallelWorkers, init_group, threads_per_rank
from engine.kv_budget import available_memory_bytes, default_cpu_kv_budget
from engine.kv_events import KVEvents
from engine.kv_tiers import build_kv_tiers, tier_stats
from engine.model_runner import ModelRunner, RunnerOutput
from engine.models.config import ModelConfig, load_model_config
from engine.models.loader import effective_quantization, load_model
from engine.models.packed_weights import resident_bytes_by_layout
from engine.models.parallel import SINGLE, TPGroup
from engine.models.sharding import local_config
from engine.models.resolve import model_fingerprint, resolve_model
from engine.output_processor import OutputProcessor, RequestState
from engine.outputs import RequestOutput
from engine.retention import RetentionPolicy
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import build_drafter
from engine.speed_check import check_speed
from engine.structured_output import StructuredOutputManager
from kernels import get_ops
from kernels.kv_quant import kv_cache_ops, kv_cache_torch_dtype
from kernels.cpu.dispatch import Dispatcher
from prefix_cache import BlockManager

logger = logging.getLogger("prefixserve")


__all__ = ["Engine", "PromptInput"]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.device = _resolve_device(config.device)
        folder = resolve_model(config.model)
        self.config = config = resolve_dtype(config, folder, self.device)  # "auto": engine/auto_dtype.py
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)  # the model dtype, or float8 e4m3
        self.model_path = folder
        self.model_config: ModelConfig = load_model_config(folder)
        self.max_model_len = _max_model_len(config, self.model_config)
        self.tokenizer = _load_tokenizer(folder)
        self.detokenizer = Detokenizer(self.tokenizer)
        # Tensor parallel: the other ranks start first and meet this one when it joins the group.
        self.workers = TensorParallelWorkers.spawn(config, config.tensor_parallel_size, str(self.device)) \
            if config.tensor_parallel_size > 1 else None
        tp = init_tp(config, self.workers, self.device)
        # Kernels with several implementations here are chosen by measuring them (kernels/cpu/dispatch.py).
        self.dispatch = Dispatcher()
        t0 = time.perf_counter()
        model = load_model(folder, self.model_config, self.dtype, self.device, tp=tp,
                           quantization=effective_quantization(config.quantization, config.model),
                           dispatch=self.dispatch)
        stages = {"model resolved": t0 - started, "weights loaded": time.perf_counter() - t0}
        self.quantization = model.quantization
        shard_config = local_config(self.model_config, tp)  # this rank's heads and KV heads
        num_blocks = self._num_kv_blocks()
        fingerprint = model_fingerprint(folder)
        self.blocks = BlockManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            extra_keys=(fingerprint, config.dtype, *kv_cache_key(config)),
            max_retained_blocks=int(num_blocks * config.kv_retention_max_fraction),
        )
        # Host-memory and Redis KV tiers (a KVTiers with neither when both are off).
        self.tiers = build_kv_tiers(config, self.blocks, self.model_config, fingerprint)
        # vLLM-format KV events for KV-aware routers (a null object unless --kv-events-config enables them).
        self.kv_events = KVEvents(config.kv_events_config, self.blocks, self.tiers)
        ops = kv_cache_ops(get_ops(config.attention_backend, self.device, self.dtype, dispatch=self.dispatch),
                           self.kv_dtype, self.dtype)  # an fp8 pool's KV ops on CPU; the same set otherwise
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        num_host_slots = self.tiers.host.num_slots if self.tiers.host else 0
        if self.workers is not None:  # every rank sizes its pools alike
            dist.broadcast_object_list([num_blocks, num_host_slots], src=0)
        self.runner = ModelRunner(
            model, shard_config, num_blocks, config.block_size, ops, self.device, self.dtype, config.seed,
            structured=self.structured, num_host_kv_slots=num_host_slots, kv_heads=(0, shard_config.num_kv_heads),
            total_kv_heads=self.model_config.num_kv_heads, cuda_graph_sizes=self._cuda_graph_sizes(ops),
            max_blocks_per_seq=-(-self.max_model_len // config.block_size), kv_cache_dtype=self.kv_dtype,
            decode_bursts=config.num_scheduler_steps != 1,
        )
        # Once bound: each weight in the form its kernels read, once
        self.weight_bytes_by_layout = resident_bytes_by_layout(model)
        self.weight_bytes = sum(self.weight_bytes_by_layout.values())
        if self.dispatch.choices:
            logger.info("kernels chosen by measurement here (cached in %s): %s", self.dispatch.cache_dir,
                        self.dispatch.summary())
        # One decode step and one prefill chunk against this machine's floor (a WARNING where far off).
        t0 = time.perf_counter()
        self.speed_report = check_speed(self.runner, self.dtype, self.weight_bytes, self.dispatch.cache_dir) \
            if self.workers is None else None
        stages.update(self.runner.stage_seconds, **{"speed check": time.perf_counter() - t0})
        logger.info("start-up in %.1f s: %s", time.perf_counter() - started,
                    ", ".join(f"{name} {s:.1f} s" for name, s in stages.items() if s >= 0.05))
        # Speculative decoding: drafts sized by this machine's measured step cost (before any request).
        self.drafter = build_drafter(config.speculative_config, self.runner, self.max_model_len,
                                     parallel=self.workers is not None, grammar_check=self.structured.valid_drafts)
        if self.workers is not None:
            self.runner = ParallelRunner(self.runner, self.workers)
        # the pool's bytes of cached blocks, for Redis writes (every rank's heads under tensor parallelism)
        self._read_kv_blocks = self.runner.read_blocks if self.workers else self.runner.kv_mover.read_blocks
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy), self.blocks,
            self.tiers, eos_token_ids=self.model_config.eos_token_ids, preemption_mode=config.preemption_mode,
            read_kv_blocks=self._read_kv_blocks, drafter=self.drafter,
            retention=RetentionPolicy(self.blocks, idle_ttl_s=config.prompt_cache_ttl, tiers=self.tiers),
        )
        # Decode steps per host round for plain greedy decode batches (engine/decode_burst.py): only where
        # decode steps replay CUDA graphs.
        replays_graphs = self.workers is None and self.runner.burst_rows() > 0
        self.burst_steps = (config.num_scheduler_steps or DEFAULT_DECODE_BURST) if replays_graphs else 1
        self.outputs = OutputProcessor(
            self.scheduler, self.detokenizer, self.structured, tuple(self.model_config.eos_token_ids),
            self.max_model_len, fast_forward=config.grammar_fast_forward,
        )
        self._arrivals = itertools.count()
        kv_bytes = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        logger.info(
            "model %s (%s, %d layers, %d/%d heads) dtype=%s device=%s attention=%s; weights %.1f MiB (%s); "
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB in %s; max_model_len=%d",
            config.model, self.model_config.architecture, self.model_config.num_layers, self.model_config.num_heads,
            self.model_config.num_kv_heads, config.dtype, self.device, ops.name, self.weight_bytes / 2**20,
            "dense" if self.quantization == "none" else f"quantized: int4/int8 from {self.quantization}", num_blocks,
            config.block_size, num_blocks * config.block_size, kv_bytes / 2**20, config.kv_dtype_name,
            self.max_model_len,
        )
        if self.tiers.enabled:
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
        if request_id in self.outputs.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.", param="request_id")
        text, token_ids = tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)
        params = effective_params(params, len(token_ids), self.max_model_len, self.config.block_size,
                                  self.blocks.num_blocks)
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
                # Only the root computes (and so scores) the prompt; forks start after it.
                prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else None,
            ))
        if grammar is not None:  # every sample parses on its own, forks included
            self.structured.add([s.seq_id for s in state.seqs], grammar, max_tokens=params.max_tokens,
                                stop_on_repeated_block=params.structured_outputs.stop_on_repeated_block)
        root = state.seqs[0]
        root.pending_forks = state.seqs[1:]
        root.group_size = params.n
        if params.use_beam_search:
            state.beam = BeamSearch(
                root, width=params.n, max_tokens=params.max_tokens, length_penalty=params.length_penalty,
                early_stopping=params.early_stopping, stop_token_ids=self._stop_token_ids(params),
            )
        self.outputs.requests[request_id] = state
        self.scheduler.add(root)
        self.outputs.counters.prompt_tokens += len(token_ids)

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids.update(self.model_config.eos_token_ids)
        return frozenset(ids)

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self.outputs.scheduled(scheduler_output)
        scheduler_output, num_steps = self._plan_burst(scheduler_output)
        if num_steps > 1:
            outputs = self._decode_burst(scheduler_output, num_steps)
        else:
            runner_output = self._execute(scheduler_output)
            self.scheduler.update_from_output(scheduler_output, runner_output)
            outputs = self.outputs.process(scheduler_output, runner_output)
        self.kv_events.publish()  # this step's cache changes, for KV-aware routers
        return outputs

    def _plan_burst(self, scheduler_output: SchedulerOutput) -> tuple[SchedulerOutput, int]:
        """Decode steps this output runs in one host round (engine/decode_burst.py), with its blocks grown for
        them; 1 (the output as it is): an ordinary step."""
        if self.burst_steps <= 1 or self.scheduler.waiting:
            return scheduler_output, 1
        num_steps = burst_length(scheduler_output, self.burst_steps, self.max_model_len, self.runner.burst_rows())
        return self.scheduler.reserve_burst(scheduler_output, num_steps)

    def _decode_burst(self, scheduler_output: SchedulerOutput, num_steps: int) -> list[RequestOutput]:
        """Every step of a burst is queued on the device first; then each step's tokens are appended as they
        arrive, while the device computes the next ones. A request's output comes once per burst (its last
        step's), or when it finishes."""
        try:
            burst = self.runner.launch_burst(scheduler_output, num_steps)
        except BaseException:
            self.scheduler.end_step(ok=False)
            raise
        outputs: list[RequestOutput] = []
        for k in range(num_steps):
            if k:
                scheduler_output = self.scheduler.continue_burst(scheduler_output)
                if not scheduler_output.rows:
                    break
                self.outputs.scheduled(scheduler_output)
            runner_output = burst.output(k, scheduler_output)
            self.scheduler.update_from_output(scheduler_output, runner_output)
            outputs += self.outputs.process(scheduler_output, runner_output, emit_unfinished=k == num_steps - 1)
        return outputs

    def _execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        try:
            return self.runner.execute(scheduler_output)
        except BaseException:
            self.scheduler.end_step(ok=False)  # the forward may not have run: nothing is committed
            raise

    def flush_kv_writes(self, timeout: float = 5.0) -> bool:
        """Wait until queued Redis writes are written (True) or ``timeout`` passed (False), including the
        blocks of long retentions that Redis turned out to lack (read from the device pool and written)."""
        deadline = time.monotonic() + timeout
        done = self.tiers.flush(timeout)
        if done and self.tiers.has_pending_retained:
            self.write_retained_blocks()
            done = self.tiers.flush(max(deadline - time.monotonic(), 0.0))
        return done

    def write_retained_blocks(self) -> int:
        """Between steps: queue the Redis writes of long-retained blocks that Redis reported absent (each step
        does it at its end; an idle engine loop calls this). Returns how many; nothing without a Redis tier."""
        if not self.tiers.has_pending_retained:
            return 0
        writes = self.tiers.take_retained_writes()
        if writes:
            self.tiers.submit_writes(writes, self._read_kv_blocks([w.block_id for w in writes]))
        return len(writes)

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued Redis writes (up to ``timeout``), stop the tier's writer, the KV-event
        publisher and the tensor-parallel workers. Idempotent."""
        deadline = time.monotonic() + timeout
        if self.tiers.remote is not None and self.tiers.remote.available:
            self.flush_kv_writes(timeout)  # a long retention's blocks Redis lacked are written too
        self.tiers.close(max(deadline - time.monotonic(), 0.0))
        self.kv_events.close()
        self.stop_workers()

    def stop_workers(self) -> None:
        """Stop the tensor-parallel worker processes (nothing with one rank). Idempotent."""
        if isinstance(self.runner, ParallelRunner):
            self.runner.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block of the device pool and the host tier (not Redis: replicas share
        it), as vLLM's reset_prefix_cache: only while no request holds blocks; returns whether it
        did. Subscribers to KV events get AllBlocksCleared; suffix drafts forget earlier requests."""
        if self.has_unfinished() or not self.blocks.reset_prefix_cache():
            return False
        if self.tiers.host is not None:
            self.tiers.host.clear_cached()
        if self.drafter is not None:  # suffix drafts come from earlier requests: forgotten with them
            self.drafter.forget_requests()
        self.kv_events.cleared()
        self.kv_events.publish()
        return True

    def abort(self, request_id: str) -> bool:
        return self.outputs.abort(request_id)

    # -- retention (engine/retention.py): the operator's view and controls ----------------------------
    def cache_lookup(self, token_ids: list[int], *, cache_salt: str | None = None, remote: bool = True
                     ) -> dict[str, int | None]:
        """How much of ``token_ids``' prefix is cached, in whole KV blocks' tokens: on the device
        (``device_tokens``; ``retained_tokens`` of those retained), continuing it in the host tier
        (``host_tokens``), and continuing both in Redis (``remote_tokens``: present there, by one pipelined
        EXISTS with the tier's timeout; None without a Redis tier, when it does not answer, or with
        ``remote=False``). device + host + remote tokens is the longest prefix some tier holds."""
        found, keys = self.cache_lookup_local(token_ids, cache_salt=cache_salt)
        found["remote_tokens"] = self.remote_cached_tokens(keys) if remote else None
        return found

    def cache_lookup_local(self, token_ids: list[int], *, cache_salt: str | None = None
                           ) -> tuple[dict[str, int | None], list]:
        """cache_lookup's device and host part (engine thread), and the block keys after them for
        ``remote_cached_tokens`` (any thread)."""
        bs = self.blocks.block_size
        device = self.blocks.cached_chain(token_ids, cache_salt=cache_salt)
        host = 0
        keys = []
        if self.tiers.enabled:
            keys = self.blocks.block_keys(token_ids, cache_salt=cache_salt)[len(device):]
            if self.tiers.host is not None:
                while host < len(keys) and self.tiers.host.lookup(keys[host]) is not None:
                    host += 1
            keys = keys[host:] if self.tiers.remote is not None else []
        found = {"device_tokens": len(device) * bs, "retained_tokens": sum(map(self.blocks.is_retained, device)) * bs,
                 "host_tokens": host * bs, "remote_tokens": None}
        return found, keys

    def remote_cached_tokens(self, keys: list) -> int | None:
        """Tokens of the whole blocks of ``keys``, from the first, present in Redis; None without a Redis tier or
        when it does not answer (its timeout). Touches no engine state: safe off the engine thread."""
        if self.tiers.remote is None:
            return None
        n = self.tiers.count_remote(keys)
        return None if n is None else n * self.blocks.block_size

    def cache_release(self, token_ids: list[int], *, cache_salt: str | None = None) -> int:
        """End the retention of ``token_ids``' cached prefix; the tokens (whole blocks) that were retained."""
        return self.blocks.release_tokens(token_ids, cache_salt=cache_salt) * self.blocks.block_size

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.outputs.requests

    def abort_running(self) -> list[str]:
        """After a failed step: abort the requests that were running (all of them if none was,
        since then scheduling itself failed and would fail again). Returns their ids."""
        running = {seq.request_id for seq in self.scheduler.running}
        victims = sorted(running or self.outputs.requests)
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
            "prefix_cache_hits": cache.hits + self.tiers.counters.loaded_tokens,
            "prefix_cache_evictions": cache.evictions,
            "kv_retained_blocks": usage["num_retained"],
            "kv_retention_expired": usage["num_retention_expired"],
            "kv_retained_evicted": usage["num_retained_evicted"],
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.outputs.counters.prompt_tokens,
            "generation_tokens": self.outputs.counters.generation_tokens,
            "request_success": dict(self.outputs.counters.requests_finished),
            "iteration_tokens": self.outputs.counters.iteration_tokens.snapshot(),
            "grammar_fast_forward_tokens": self.outputs.counters.fast_forward_tokens,
            **tier_stats(self.tiers),
            **(self.drafter.counters.snapshot() if self.drafter is not None else {}),
        }

    def integrity_report(self) -> dict:
        """check_integrity() as data, for an operator (POST /v1/cache/check) or a soak: whether every
        invariant holds (``error`` says which did not) and the block counts beside it."""
        try:
            self.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "an invariant does not hold"
        usage = self.blocks.usage()
        return {"ok": error is None, "error": error, "blocks_in_use": usage["num_in_use"],
                "retained_blocks": usage["num_retained"], "free_blocks": usage["num_free"],
                "evictable_blocks": usage["num_evictable"], "num_blocks": usage["num_blocks"],
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        self.tiers.check_integrity()
        live = {s.seq_id for s in self.scheduler.running}
        for seq in self.scheduler.waiting:
            assert not self.blocks.has_seq(seq.seq_id), f"waiting {seq.seq_id} holds blocks"
        for seq_id in live:
            assert self.blocks.has_seq(seq_id), f"running {seq_id} holds no blocks"
        live_ids = {s.seq_id for st in self.outputs.requests.values() for s in st.live_seqs()}
        # n>1 samples wait as their root's pending forks until its prompt is computed: unknown to the
        # scheduler and holding no blocks until then
        pending = {f.seq_id for st in self.outputs.requests.values() for s in st.seqs for f in s.pending_forks}
        assert live_ids - pending <= set(self.scheduler.seqs), "a live sequence is unknown to the scheduler"
        for seq_id in pending:
            assert seq_id not in self.scheduler.seqs and not self.blocks.has_seq(seq_id), f"pending fork {seq_id} started"
        self.structured.check_integrity(live_ids)
        if self.drafter is not None:
            self.drafter.check_integrity(set(self.scheduler.seqs))

    def _cuda_graph_sizes(self, ops) -> list[int] | None:
        """Decode batch sizes captured as CUDA graphs (engine/cuda_graphs.py): on one CUDA device with the
        Triton ops, unless enforce_eager; tensor parallelism runs eagerly (its collectives are not captured)."""
        cfg = self.config
        if (self.device.type != "cuda" or ops.name != "triton" or cfg.enforce_eager
                or cfg.tensor_parallel_size > 1):
            return None
        return capture_sizes(cfg.max_num_seqs)

    # -- sizing ---------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        # bytes per element of the pool: 1 for an fp8 cache, so a budget holds 2x bfloat16's / 4x float32's blocks
        per_block = cfg.block_size * self.model_config.kv_bytes_per_token * torch.finfo(self.kv_dtype).bits // 8
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1.0 - cfg.gpu_memory_utilization))
        else:
            chosen = default_cpu_kv_budget(block_bytes=per_block, block_size=cfg.block_size,
                                           max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                                           available_bytes=available_memory_bytes())
            logger.info(chosen.describe(per_block, cfg.kv_dtype_name))
            return chosen.num_blocks
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise InvalidConfigError(f"the KV cache budget ({budget} bytes) holds no block of {per_block} bytes.")
        return int(num_blocks)


def kv_cache_key(config: EngineConfig) -> tuple[str, ...]:
    """What an fp8 cache adds to every block's extra keys (its KV differs from the model dtype's for the same
    tokens); nothing for "auto", whose keys stay as they were."""
    return () if config.kv_cache_dtype == "auto" else (f"kv_cache_dtype={config.kv_dtype_name}",)


def init_tp(config: EngineConfig, workers: TensorParallelWorkers | None, device: torch.device) -> TPGroup:
    """Rank 0's place in the tensor-parallel group (a single rank without workers)."""
    if workers is None:
        return SINGLE
    torch.set_num_threads(threads_per_rank(config.tensor_parallel_size))
    return init_group(0, config.tensor_parallel_size, workers.port, device)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError("device 'cuda' was requested but no CUDA device is available.")
    return device


def _max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise InvalidConfigError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit}.")
    return config.max_model_len


def _load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

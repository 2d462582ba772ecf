"""EngineConfig: everything an Engine is built from, validated once.

Frozen: derived values (resolved device, dtype, KV pool size) live in new objects
(ModelConfig, CacheConfig), never in mutated fields of this one.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidConfigError
from engine.kv_events import KVEventsConfig
from engine.models.resolve import DEFAULT_MODEL
from engine.speculative.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")  # "auto": engine/auto_dtype.py
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
PREEMPTION_MODES = ("recompute", "swap")
KV_TIER_POLICIES = ("auto", "always")
# vLLM's kv_cache_dtype values we serve (kernels/kv_quant.py maps them): "auto" is the model dtype, "fp8" and
# "fp8_e4m3" the same float8 e4m3 cache with per-tensor scales of 1.0 (no e5m2 cache)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # vLLM's default: bfloat16 for a quantized GGUF served int4 on AVX512-BF16 / AMX, else float32
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    block_size: int = 16
    # The KV pool's element type, vLLM's kv_cache_dtype: "auto" (the model dtype) or "fp8" / "fp8_e4m3" (one
    # byte per element: twice bfloat16's blocks, four times float32's, in the same memory; docs/kv-cache.md)
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # explicit pool size; overrides the memory budgets
    kv_cache_memory: int | None = None  # bytes for the KV pool (None: engine/kv_budget.py on CPU)
    gpu_memory_utilization: float = 0.9  # fraction of device memory (CUDA only)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    attention_backend: str = "auto"
    # Slower KV tiers (prefix_cache/tiers.py). Host memory: bytes for evicted and swapped-out blocks
    # (0 = off). Redis: shared by replicas (None = off); TTL in seconds (None = keep); per-call
    # timeout in seconds; key prefix (separates deployments sharing one Redis).
    host_kv_cache_memory: int = 0
    kv_redis_url: str | None = None
    kv_redis_ttl: int | None = None
    kv_redis_timeout: float = 0.25
    kv_redis_key_prefix: str = "prefixserve"
    kv_tier_policy: str = "auto"  # "auto": load vs recompute from measured costs; "always": load every hit
    # Retention (engine/retention.py): a request's prompt_cache_key keeps its context cached this many seconds
    # past its end ("in_memory"); retained blocks are evicted after every other evictable block, and at most
    # this fraction of the pool is retained (past it, the retention that expires first lapses).
    prompt_cache_ttl: float = 300.0
    kv_retention_max_fraction: float = 0.5
    # vLLM's KV events (engine/kv_events.py): a KVEventsConfig, its JSON text (the CLI flag) or a dict.
    kv_events_config: KVEventsConfig | str | dict | None = None
    # Ranks (one process each) the model's heads, MLP and vocabulary are split across (engine/executor.py).
    tensor_parallel_size: int = 1
    # Weights of a quantized GGUF: "gguf" kept quantized (int4 / int8 linears, engine/models/quantized.py),
    # "none" dequantized to the model dtype; None / "auto": quantized when the model names a quantized
    # GGUF (a .gguf file or a builtin name such as the default model), as vLLM and llama.cpp do.
    quantization: str | None = None
    # CUDA: decode steps replay CUDA graphs captured at start-up (engine/cuda_graphs.py); True runs every
    # step eagerly, as vLLM's flag of the same name.
    enforce_eager: bool = False
    # Decode bursts (engine/decode_burst.py, vLLM v0's multi-step scheduling): where every running sequence is
    # a plain greedy decode and the step replays a CUDA graph, the device runs up to this many decode steps
    # back to back, feeding each argmax to the next, while the host appends the tokens of the earlier ones.
    # None: DEFAULT_DECODE_BURST where decode steps replay CUDA graphs, 1 (off) elsewhere.
    num_scheduler_steps: int | None = None
    # Draft-free speculative decoding (engine/speculative/): a SpeculativeConfig, its JSON text (the CLI
    # flag) or a dict, as vLLM's: {"method": "ngram" | "suffix", "num_speculative_tokens": k, ...}; None or
    # "off": off. "auto": suffix decoding on one CPU process, where it measured never slower; off elsewhere.
    speculative_config: SpeculativeConfig | str | dict | None = "auto"
    # Structured outputs: where the grammar allows only one continuation (a JSON schema's keys and
    # punctuation), its tokens are appended without sampling and computed with the next row.
    grammar_fast_forward: bool = True

    @property
    def kv_dtype_name(self) -> str:
        """The KV pool's element type: the model dtype's name, or "float8_e4m3fn" for an fp8 cache."""
        return self.dtype if self.kv_cache_dtype == "auto" else "float8_e4m3fn"

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidConfigError(msg)

        if self.dtype not in DTYPES:
            bad(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}.")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            bad(f"block_size must be a power of two in [1, 128], got {self.block_size}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            bad(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= 64:
            bad(f"num_scheduler_steps must be in [1, 64] or None (auto), got {self.num_scheduler_steps}.")
        if self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            bad(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}.")
        if self.preemption_mode not in PREEMPTION_MODES:
            bad(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if self.host_kv_cache_memory < 0:
            bad(f"host_kv_cache_memory must be >= 0 bytes (0 = off), got {self.host_kv_cache_memory}.")
        if self.preemption_mode == "swap" and self.host_kv_cache_memory == 0:
            bad("preemption_mode='swap' needs host memory to swap into: set host_kv_cache_memory > 0.")
        if self.kv_redis_url is not None and not self.kv_redis_url.startswith(REDIS_URL_SCHEMES):
            bad(f"kv_redis_url must start with one of {REDIS_URL_SCHEMES}, got {self.kv_redis_url!r}.")
        if self.kv_redis_ttl is not None and self.kv_redis_ttl < 1:
            bad(f"kv_redis_ttl must be a positive number of seconds or None, got {self.kv_redis_ttl}.")
        if not 0.0 < self.kv_redis_timeout <= 60.0:
            bad(f"kv_redis_timeout must be in (0, 60] seconds, got {self.kv_redis_timeout}.")
        if not self.kv_redis_key_prefix or any(c in self.kv_redis_key_prefix for c in ": \t\n"):
            bad(f"kv_redis_key_prefix must be non-empty without ':' or whitespace, got {self.kv_redis_key_prefix!r}.")
        if not 0.0 < self.prompt_cache_ttl <= 24 * 3600:
            bad(f"prompt_cache_ttl must be in (0, 86400] seconds, got {self.prompt_cache_ttl}.")
        if not 0.0 <= self.kv_retention_max_fraction <= 1.0:
            bad(f"kv_retention_max_fraction must be in [0, 1], got {self.kv_retention_max_fraction}.")
        if self.kv_tier_policy not in KV_TIER_POLICIES:
            bad(f"kv_tier_policy must be one of {KV_TIER_POLICIES}, got {self.kv_tier_policy!r}.")
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.quantization not in (None, "auto", "gguf", "none"):
            bad(f"quantization must be one of 'auto', 'gguf', 'none', got {self.quantization!r}.")
        if self.tensor_parallel_size < 1:
            bad(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.tensor_parallel_size > 1 and self.quantization == "gguf":
            bad("quantized GGUF weights run in one process for now: quantization='gguf' needs tensor_parallel_size=1.")


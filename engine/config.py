"""EngineConfig: everything an Engine is built from, validated once.

Frozen: derived values (resolved device, dtype, KV pool size) live in new objects
(ModelConfig, CacheConfig), never in mutated fields of this one.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidConfigError
from engine.models.resolve import DEFAULT_MODEL

DTYPES = ("float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
PREEMPTION_MODES = ("recompute",)
# On CPU there is no "fraction of device memory" to take: the KV pool gets a fixed budget.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size; overrides the memory budgets
    kv_cache_memory: int | None = None  # bytes for the KV pool
    gpu_memory_utilization: float = 0.9  # fraction of device memory (CUDA only)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidConfigError(msg)

        if self.dtype not in DTYPES:
            bad(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            bad(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}.")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            bad(f"block_size must be a power of two in [1, 128], got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            bad(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            bad(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
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

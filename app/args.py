"""EngineConfig <-> command-line flags, shared by the CLI (app/cli.py) and the server (app/server.py)."""
from __future__ import annotations

import argparse
import dataclasses

from engine.config import EngineConfig


ALIASES = {"tensor_parallel_size": ("-tp",)}  # vLLM's short forms

# Every EngineConfig field's flag: (group, what it does, with its unit), grouped as vLLM groups its engine
# arguments. tests/server/test_cli_help.py checks that every field has one.
HELP = {
    "model": ("model", "a builtin model name, a Hugging Face folder, or a .gguf file (nothing is downloaded)"),
    "dtype": ("model", "auto (bfloat16 for a quantized GGUF served in int4 on a CPU with AVX512-BF16 or AMX, "
                       "float32 otherwise), float32, bfloat16 (half the weight bytes: faster decode everywhere, faster "
                       "prefill where the CPU has AVX512-BF16 or AMX, and on GPUs) or float16"),
    "device": ("model", "auto (cuda where a GPU is present), cpu, cuda or cuda:N"),
    "quantization": ("model", "auto: a quantized GGUF runs quantized; none: dequantize it; gguf: insist on "
                              "quantized weights"),
    "max_model_len": ("model", "tokens of prompt + output a request may hold (default: the model's context)"),
    "seed": ("model", "the engine's sampling seed (requests can carry their own)"),
    "attention_backend": ("model", "auto (Triton on CUDA, the C kernels on CPU), triton, cpu, or torch "
                                   "(the references)"),
    "enforce_eager": ("model", "CUDA: run every decode step eagerly instead of replaying CUDA graphs"),
    "tensor_parallel_size": ("parallel", "processes (ranks) the model's heads, MLP and vocabulary are split across"),
    "block_size": ("cache", "tokens per KV block (a power of two, 1-128)"),
    "kv_cache_dtype": ("cache", "auto (the model dtype) or fp8 / fp8_e4m3: K and V stored as float8 e4m3 with "
                                "per-layer scales of 1.0, one byte per element (twice bfloat16's blocks, four times "
                                "float32's; greedy output may drift, docs/kv-cache.md)"),
    "num_kv_blocks": ("cache", "KV blocks in the pool (overrides the memory budgets)"),
    "kv_cache_memory": ("cache", "bytes for the KV pool (default on CPU: 1/8 of available memory, capped at what "
                                 "max-num-seqs x max-model-len tokens use)"),
    "gpu_memory_utilization": ("cache", "CUDA: fraction (0-1] of GPU memory the weights and KV pool may take"),
    "enable_prefix_caching": ("cache", "reuse the KV of any prefix computed before (on by default)"),
    "host_kv_cache_memory": ("cache", "bytes of host memory for KV blocks evicted or swapped out (0: off)"),
    "kv_redis_url": ("cache", "redis:// URL of a KV tier shared by replicas (off by default)"),
    "kv_redis_ttl": ("cache", "seconds KV blocks live in Redis (default: kept); a longer retention keeps its "
                              "blocks longer"),
    "kv_redis_timeout": ("cache", "seconds a Redis call may take before it counts as a miss"),
    "kv_redis_key_prefix": ("cache", "prefix of this deployment's Redis keys"),
    "kv_tier_policy": ("cache", "auto: load a slower tier's hit only where that beats recomputing it (measured); "
                                "always: load every hit"),
    "prompt_cache_ttl": ("cache", "seconds a request's prompt_cache_key keeps its context cached past its end "
                                  "(\"in_memory\" retention; \"24h\" asks for a day); longer retentions are "
                                  "also kept in Redis when it is configured"),
    "kv_retention_max_fraction": ("cache", "fraction [0-1] of the KV pool that retained contexts may hold (retained "
                                           "blocks are evicted after all others, never refusing a request)"),
    "kv_events_config": ("cache", "JSON of vLLM's KV events config (publish block stored / removed events over "
                                  "ZMQ for KV-aware routers)"),
    "speculative_config": ("speculative", "JSON as vLLM's: {\"method\": \"ngram\" or \"suffix\", "
                                          "\"num_speculative_tokens\": 5, ...}: draft tokens from the context and "
                                          "earlier requests, verified in one forward; default auto: suffix decoding on one CPU process, off "
                                          "on a GPU and under tensor parallelism; off turns it off"),
    "grammar_fast_forward": ("speculative", "structured outputs: tokens the grammar forces (a JSON schema's keys "
                                            "and punctuation) appended without sampling"),
    "max_num_seqs": ("scheduler", "sequences in one step at most"),
    "max_num_batched_tokens": ("scheduler", "tokens in one step at most (prefill chunks beside decodes)"),
    "num_scheduler_steps": ("scheduler", "CUDA: decode steps a batch of plain greedy decodes runs on the GPU per "
                                         "host round (default: 8 where decode steps replay CUDA graphs; 1: off)"),
    "scheduling_policy": ("scheduler", "fcfs, or priority (a request's priority field; lower runs first)"),
    "preemption_mode": ("scheduler", "when the pool runs dry: recompute (release the newest sequence's blocks) or "
                                     "swap (to host memory; needs --host-kv-cache-memory)"),
}
GROUPS = {"model": "model", "parallel": "parallel", "cache": "KV cache", "scheduler": "scheduler",
          "speculative": "speculative decoding"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a flag named like the LLM argument (--max-num-seqs ...), in vLLM's groups."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for f in dataclasses.fields(EngineConfig):
        group, text = HELP[f.name]
        target = groups[group]
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            target.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{text} (default: {'on' if f.default else 'off'})")
            continue
        kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
        flags = [flag, *ALIASES.get(f.name, ())]
        default = "" if "default" in text else f" (default: {f.default})"
        target.add_argument(*flags, dest=f.name, type=kind, default=None, help=text + default)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in values.items() if v is not None})

"""``dtype="auto"`` (the default, vLLM's name): the model dtype chosen for the weights being served.

    resolve_dtype(config, folder, device) -> config with a concrete dtype (unchanged where one is given)

bfloat16 where a quantized GGUF is served quantized (int4 / int8 linears, one CPU process) on a CPU with bfloat16
pair instructions (AVX512-BF16 or AMX); float32 everywhere else, dense models included. Why: the int4 kernel
multiplies int8 activations whatever the model dtype, so bfloat16 only halves the bytes of the KV cache, the
activations and the elementwise ops. Measured with SmolLM2's Q4_1 GGUF on a 2-core AMD EPYC Zen 4
(results/amd-zen4-avx512bf16/quantized.json): decode 147.6 against 132.7 tokens/s single stream, 703 against 487 at
batch 8; perplexity 25.99 against 25.98, and the README's answers unchanged. Dense float32 keeps its measured
leads elsewhere (bfloat16 GEMMs run at half the float32 rate on a Xeon without AMX: issue 36).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kernels.cpu.native import cpu_has_amx, cpu_has_bf16_pairs

from .config import EngineConfig
from .models.loader import effective_quantization, quantized_source

AUTO = "auto"


def resolve_dtype(config: EngineConfig, folder: Path, device: torch.device) -> EngineConfig:
    if config.dtype != AUTO:
        return config
    return dataclasses.replace(config, dtype="bfloat16" if _serves_int4_on_bf16_cpu(config, folder, device)
                               else "float32")


def _serves_int4_on_bf16_cpu(config: EngineConfig, folder: Path, device: torch.device) -> bool:
    """The loader's own test (quantized_source; quantized GGUFs load dense on CUDA and across ranks)."""
    if device.type != "cpu" or config.tensor_parallel_size > 1 or not (cpu_has_bf16_pairs() or cpu_has_amx()):
        return False
    return quantized_source(folder, effective_quantization(config.quantization, config.model)) is not None

"""`prefixserve collect-env` (as `vllm collect-env`): what a bug report about speed or a wrong answer needs
to know about the machine, in one report.

    collect_env(model=None) -> dict          the facts; with a model, it is loaded and its kernels chosen
    format_report(facts) -> str              the text the command prints

CPU model, family/model/stepping and the flags the kernels choose by; what the OS grants (AMX tiles); torch,
oneDNN (and the ISA oneDNN says it runs), transformers and triton versions; the C kernels' build; the kernel
choices measured on this machine (kernels/cpu/dispatch.py: every cached one, or the given model's); memory
and the KV budget the engine would take; GPUs.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def collect_env(model: str | None = None) -> dict:
    import torch

    from kernels.cpu import native
    from kernels.cpu.dispatch import Dispatcher, machine_fingerprint, onednn_version

    facts = {
        "prefixserve": _version(), "python": sys.version.split()[0], "platform": platform.platform(),
        "cpu": _cpu(native), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "onednn": onednn_version(), "onednn_isa": _onednn_isa(), "transformers": _package_version("transformers"),
        "triton": _package_version("triton"),
        "c_kernels": {"build": native.native_build_id(), "compiler": native._compiler() or "none",
                      "loaded": native.native_kernels() is not None},
        "machine_fingerprint": machine_fingerprint(), "memory": _memory(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }
    dispatch = Dispatcher()
    facts["kernel_cache"] = str(dispatch.cache_dir)
    if model is not None:
        from engine.llm import LLM

        llm = LLM(model)
        engine = llm.engine
        facts["model"] = {"name": model, "dtype": engine.config.dtype, "quantization": engine.quantization,
                          "weight_bytes": engine.weight_bytes, "kv_cache_dtype": engine.config.kv_dtype_name,
                          "kv_blocks": engine.blocks.num_blocks,
                          "kv_cache_bytes": engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()}
        choices = [c.describe() for c in engine.dispatch.choices.values()]
    else:
        choices = _cached_choices(dispatch.cache_dir, machine_fingerprint())
    facts["kernel_choices"] = choices
    return facts


def format_report(facts: dict) -> str:
    lines = []
    for key, value in facts.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {v}" for k, v in value.items()]
        elif isinstance(value, list):
            lines.append(f"{key}:" + ("" if value else " none"))
            lines += [f"  - {v}" for v in value]
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def _version() -> str:
    return _package_version("prefixserve")


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _cpu(native) -> dict:
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.pop("flags", "").split())
    return {"model_name": info.get("model name", platform.processor()), "family": info.get("cpu family"),
            "model": info.get("model"), "stepping": info.get("stepping"), "logical_cpus": os.cpu_count(),
            "flags": " ".join(f for f in FLAGS_OF_INTEREST if f in flags) or "none of " + ", ".join(FLAGS_OF_INTEREST),
            "os_grants_amx": native.os_grants_amx()}


def _onednn_isa() -> str:
    """The instruction set oneDNN says it runs (ONEDNN_VERBOSE on one small matmul in a child process: the
    variable is read once, at oneDNN's first use)."""
    code = ("import torch; w = torch.randn(16, 16); "
            "torch.ops.mkldnn._linear_pointwise(torch.randn(2, 16), torch.ops.mkldnn._reorder_linear_weight(w, 2), "
            "None, 'none', [], '')")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "ONEDNN_VERBOSE": "1"}).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return next((line.split("isa:", 1)[1].strip() for line in out.splitlines() if ",isa:" in line), "unknown")


def _memory() -> dict:
    from engine.kv_budget import available_memory_bytes

    total = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        pass
    available = available_memory_bytes()
    return {"total_gib": round(total / 2**30, 1), "available_gib": round(available / 2**30, 1),
            "default_cpu_kv_budget_gib": round(available / 8 / 2**30, 2)}


def _cached_choices(cache_dir: Path, fingerprint: str) -> list[str]:
    """The choices measured earlier on this machine (every model and shape), one line each."""
    from kernels.cpu.dispatch import Choice

    lines = []
    for path in sorted(cache_dir.glob("*.json")) if cache_dir.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            if data.get("machine") != fingerprint:
                continue
            choice = Choice(data["op"], data["key"], tuple((int(u), n) for u, n in data["by_rows"]),
                            data.get("times_ms", {}), data.get("rejected", {}), "cached")
            lines.append(choice.describe() + " " + _times(choice))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return lines


def _times(choice) -> str:
    """Each candidate's measured ms at the smallest and largest row counts."""
    parts = []
    for name, times in choice.times_ms.items():
        rows = sorted(times, key=int)
        if rows:
            parts.append(f"{name} {times[rows[0]]:.3g} ms at {rows[0]} rows, {times[rows[-1]]:.3g} at {rows[-1]}")
    return f"[{'; '.join(parts)}]" if parts else ""

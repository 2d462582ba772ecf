"""The env step: the device, the versions that ran, and the device's floor figures, measured here:
memory bandwidth (a device-to-device copy, bytes read + written per second, best of 10) and the
bf16 matmul rate (8192^3, mean of 10 after 3 warm-ups). The workload steps divide by these."""
from __future__ import annotations

import platform
import subprocess
import time


def env_step(ctx, result: dict) -> dict:
    import torch
    import transformers

    result.update(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__)
    try:
        import triton

        result["triton"] = triton.__version__
    except Exception as exc:  # reported, and the kernel steps will say why they fail
        result["triton"] = f"not importable: {exc!r}"
    if ctx.dry_run:
        result["device"] = "cpu (dry run)"
        size, n = 1 << 26, 512
    else:
        props = torch.cuda.get_device_properties(0)
        result.update(device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                      multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                      nvidia_smi=_nvidia_smi())
        size, n = 4 << 30, 8192
    ctx.save(result)
    result["memory_bytes_per_s"] = copy_bandwidth(ctx.device, size)
    result["bf16_flops_per_s"] = matmul_rate(ctx.device, n, torch.bfloat16)
    result["fp32_flops_per_s"] = matmul_rate(ctx.device, n // 2, torch.float32)
    print(f"{result['device']}: copy {result['memory_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{result['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, fp32 {result['fp32_flops_per_s'] / 1e12:.1f} TFLOP/s")
    return ctx.save(result)


def _nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:
        return f"nvidia-smi failed: {exc!r}"


def _timer(device: str):
    """(start, seconds since start) with the device synchronised at both ends."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def start():
        sync()
        return time.perf_counter()

    def since(t0):
        sync()
        return time.perf_counter() - t0

    return start, since


def copy_bandwidth(device: str, nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    start, since = _timer(device)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        t0 = start()
        dst.copy_(src)
        best = min(best, since(t0))
    del src, dst
    return 2 * nbytes / best


def matmul_rate(device: str, n: int, dtype) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    start, since = _timer(device)
    for _ in range(3):
        a @ b
    t0 = start()
    for _ in range(10):
        a @ b
    return 10 * 2 * n**3 / since(t0)

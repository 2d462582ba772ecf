"""Shared helpers for benchmarks: the results folder of this machine, JSON + PNG writing, environment facts."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import torch
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": _commit(),
        "machine": machine_id(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "cpu": cpu_model(),
    }


def _commit() -> str:
    """The commit the benchmark ran at (with "+changes" where the tree differed from it)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head + ("+changes" if dirty else "") if head else "unknown"


def cpu_model() -> str:
    """The CPU's model name and the features our CPU paths choose by (ratios differ between them:
    MKL's float32 GEMM takes an AVX2 path on AMD; bfloat16 uses AMX where there is one)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(features)})"


# AMD families by model ranges (/proc/cpuinfo "cpu family" / "model"), the names machines are known by.
_AMD = {25: ((range(0x00, 0x10), "zen3"), (range(0x20, 0x30), "zen3"), (range(0x40, 0x60), "zen3"),
             (range(0x10, 0x20), "zen4"), (range(0x60, 0x80), "zen4"), (range(0xA0, 0xB0), "zen4")),
        26: ((range(0x00, 0x100), "zen5"),)}


def machine_id(cpuinfo: str | None = None) -> str:
    """The results folder of this machine: vendor, core family (or family/model numbers) and the ISA level
    the kernels choose by, e.g. "amd-zen5-avx512bf16", "intel-f6m207-amx", "amd-zen3-avx2"; "h200" and the
    like for a GPU run (benchmarks/gpu)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.machine() or "unknown"
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(fields.get("vendor_id", ""), "cpu")
    family, model = int(fields.get("cpu family", "0") or 0), int(fields.get("model", "0") or 0)
    core = next((name for rng, name in _AMD.get(family, ()) if model in rng), None) if vendor == "amd" else None
    flags = set(fields.get("flags", "").split())
    isa = ("amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags else
           "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "x86")
    return f"{vendor}-{core or f'f{family}m{model}'}-{isa}"


def results_dir() -> Path:
    """benchmarks/results/<machine_id()>/: one current file per benchmark per machine."""
    path = RESULTS / machine_id()
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(name: str, payload: dict) -> Path:
    path = results_dir() / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2) + "\n")
    return path


def bar_plot(name: str, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, name)


def save_figure(fig, name: str) -> Path:
    """benchmarks/results/<name>.png; closes the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = results_dir() / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

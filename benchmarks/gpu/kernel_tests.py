"""The kernels step: the Triton kernels' tests (tests/kernels) on the device, each against its torch
reference, every dtype they claim (float32, bfloat16, float16): the full (G, head_dim, block_size, dtype)
grid on CUDA. Under the dry run, the Triton interpreter on a few cases, so the plumbing stays tested."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRITON_TESTS = ("test_paged_attention_decode.py", "test_paged_attention_prefill.py", "test_store_kv.py",
                "test_elementwise_triton.py", "test_kv_fp8_kernels.py",
                "test_copy_blocks.py", "test_attention_ops.py", "test_masked_attention.py")
# The interpreter runs a kernel a thousand times slower: the dry run takes the cheap kernels' Triton cases.
DRY_RUN_TESTS = ("test_store_kv.py", "test_copy_blocks.py")
DRY_RUN_SELECTION = "triton"
# The CPU C kernels' cases in these files are CI's: they would only compile C on the GPU machine's CPU.
GPU_SELECTION = "not cpu and not test_c_"
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def kernels_step(ctx, result: dict) -> dict:
    files = DRY_RUN_TESTS if ctx.dry_run else TRITON_TESTS
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--timeout", "100",
           *(str(Path("tests") / "kernels" / f) for f in files)]
    env = dict(os.environ)
    if ctx.dry_run:
        env["TRITON_INTERPRET"] = "1"
        cmd += ["-q", "-k", DRY_RUN_SELECTION]
    else:
        cmd += ["-v", "-k", GPU_SELECTION]  # a line per test, so a run cut off at its limit still counts what finished
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", str(min(12, os.cpu_count() or 1))]  # Triton compiles on the CPU: one per worker
    print(" ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
        if re.search(r"\b(PASSED|FAILED|ERROR)\b", line):  # keep the counts current for a cut-off run
            result["counts"] = count_outcomes(lines)
            if len(lines) % 50 == 0:
                ctx.save(result)
    proc.wait()
    result["counts"] = count_outcomes(lines)
    result["failures"] = [ln.strip() for ln in lines if ln.startswith(("FAILED ", "ERROR "))][:40]
    result["pytest_exit"] = proc.returncode
    result["ok"] = proc.returncode == 0 and result["counts"].get("passed", 0) > 0
    return ctx.save(result)


def count_outcomes(lines: list[str]) -> dict:
    """pytest's final tally when it printed one, else the per-test lines of -v so far."""
    for line in reversed(lines):
        if re.search(r"\b\d+ (passed|failed|errors?)\b.* in [\d.]+s", line):
            found = {(k if k in OUTCOMES else k.rstrip("s")): int(n) for n, k in re.findall(r"(\d+) (\w+)", line)}
            return {k: n for k, n in found.items() if k in OUTCOMES}
    counts: dict[str, int] = {}
    for line in lines:
        m = re.search(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
        if m and "::" in line:
            key = {"XFAIL": "xfailed", "XPASS": "xpassed"}.get(m.group(1), m.group(1).lower())
            counts[key] = counts.get(key, 0) + 1
    return counts

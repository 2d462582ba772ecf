"""benchmarks/gpu/check.sh --dry-run: the GPU check's every step on the CPU (the Triton interpreter, tiny
models), so that the script a lent GPU runs never rots. Packages the GPU machine lacks are refused here as
they would be there (benchmarks/gpu/check.py ABSENT_ON_GPU_MACHINE)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOBS = {"gsp", "unique_prompts", "n8", "beam4", "cached_ttft", "single_stream_decode"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the check sets it for its own steps
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "check.sh"), str(out), "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    return proc, out


def test_every_step_runs_and_reports(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "check.json").read_text())
    steps = report["steps"]
    assert report["dry_run"] and list(steps) == ["env", "kernels", "parity", "llama-1b", "serve"]
    assert all(s["status"] == "ok" for s in steps.values()), {k: s["status"] for k, s in steps.items()}
    assert steps["env"]["memory_bytes_per_s"] > 0 and steps["env"]["bf16_flops_per_s"] > 0
    assert steps["kernels"]["counts"]["passed"] > 0 and not steps["kernels"]["counts"].get("failed")
    assert {"llama", "gemma3"} <= set(steps["parity"]["models"])
    assert steps["llama-1b"]["kv_fp8"]["fp8"]["kv_dtype"] == "torch.float8_e4m3fn"
    assert all(m["ok"] and m["identical"] == m["prompts"] for m in steps["parity"]["models"].values())
    for shape in ("llama-1b",):  # the 8B step is the same code at another shape (skipped on the CPU)
        assert set(steps[shape]["workloads"]) == JOBS
        assert all(r["ours_s"] > 0 and r["hf_s"] > 0 for r in steps[shape]["workloads"].values())
        assert steps[shape]["decode64"]["step_s"] > 0
    assert set(steps["serve"]["checks"]) == {"models", "chat", "chat_stream", "completion_n2", "bad_request",
                                             "metrics"}
    assert all(c["ok"] for c in steps["serve"]["checks"].values())
    log = (out / "check.log").read_text()
    assert "==== step serve: ok" in log and proc.stdout.strip().splitlines()[-1].startswith("gpu check on cpu")


def test_a_failing_step_is_reported_and_the_next_runs(tmp_path):
    """A step that cannot import what it needs fails alone, with its error in check.json."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    (tmp_path / "httpx.py").write_text("raise ImportError('httpx is broken here')\n")  # the serve step's client
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check.py"), "--dry-run", "--out",
                           str(tmp_path / "out"), "--steps", "env", "serve"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    report = json.loads((tmp_path / "out" / "check.json").read_text())
    assert proc.returncode == 1
    assert report["steps"]["env"]["status"] == "ok"
    assert report["steps"]["serve"]["status"].startswith("failed")
    assert "httpx is broken here" in report["steps"]["serve"]["error"]


def test_pytest_tallies_are_read_from_the_summary_or_the_lines():
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.kernel_tests import count_outcomes

    assert count_outcomes(["=== 29 failed, 526 passed, 13 warnings in 59.94s ===\n"]) == {"failed": 29, "passed": 526}
    assert count_outcomes(["43 passed, 62 deselected in 1.66s\n"]) == {"passed": 43}
    assert count_outcomes(["1 error in 2.0s\n"]) == {"error": 1}
    cut_off = ["[gw1] [ 1%] PASSED tests/kernels/test_store_kv.py::test_a[x]\n",
               "[gw2] [ 2%] FAILED tests/kernels/test_store_kv.py::test_b[y]\n",
               "[gw2] [ 3%] PASSED tests/kernels/test_store_kv.py::test_c\n"]
    assert count_outcomes(cut_off) == {"passed": 2, "failed": 1}

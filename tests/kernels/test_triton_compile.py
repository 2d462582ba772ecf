import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernels_testlib import needs_triton


def _nvidia_backend() -> bool:
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception:
        return False
    return True


@needs_triton
@pytest.mark.skipif(not _nvidia_backend(), reason="triton has no nvidia backend here")
def test_kernels_compile_for_h100():
    """AOT-compile every kernel for sm_90 (no GPU needed), in a process without TRITON_INTERPRET."""
    script = Path(__file__).with_name("kernels_aot_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

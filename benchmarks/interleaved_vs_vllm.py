"""Rounds that alternate the engines: vLLM-CPU, then prefixserve, on the same workloads, N times, and the
median of each side's rounds. For VMs whose speed drifts for minutes at a time, where
benchmarks/versus_vllm.py (each engine's workloads as one block) can put the two sides in different
phases. Prints one summary line; writes results/<machine>/<name>.json + .png.

    python benchmarks/interleaved_vs_vllm.py [--dtype float32] [--workloads gsp cached_ttft] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._peer_jobs import make_jobs, run_ours, run_vllm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workloads", nargs="+", default=["gsp", "cached_ttft"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default=None, help="results file (default: interleaved_vs_vllm_<dtype>)")
    args = ap.parse_args()
    from transformers import AutoConfig

    from benchmarks.shapes import model_path

    path = str(model_path(args.model))
    jobs = make_jobs(AutoConfig.from_pretrained(path).vocab_size, workloads=tuple(args.workloads))
    rounds = {"vllm": [], "prefixserve": []}
    for _ in range(args.rounds):
        rounds["vllm"].append({k: v["seconds"] for k, v in run_vllm(path, args.dtype, jobs)["jobs"].items()})
        rounds["prefixserve"].append({k: v["seconds"] for k, v in run_ours(path, args.dtype, jobs)["jobs"].items()})
    rows = {}
    for w in args.workloads:
        ours = statistics.median(r[w] for r in rounds["prefixserve"])
        vllm = statistics.median(r[w] for r in rounds["vllm"])
        rows[w] = {"prefixserve_s": ours, "vllm_s": vllm, "speedup_vs_vllm": vllm / ours,
                   "rounds_prefixserve_s": [r[w] for r in rounds["prefixserve"]],
                   "rounds_vllm_s": [r[w] for r in rounds["vllm"]]}
    name = args.name or f"interleaved_vs_vllm_{args.dtype}"
    write_json(name, {"model": args.model, "dtype": args.dtype, "rounds": args.rounds, "results": rows})
    bar_plot(name, f"{args.model} {args.dtype}: x vLLM-CPU, median of {args.rounds} alternating rounds",
             list(rows), {"prefixserve": [r["speedup_vs_vllm"] for r in rows.values()]}, "x vLLM (higher is faster)")
    print(f"{name}: " + ", ".join(f"{w} {r['speedup_vs_vllm']:.2f}x (ours {r['rounds_prefixserve_s']}, "
                                  f"vLLM {r['rounds_vllm_s']})" for w, r in rows.items()))


if __name__ == "__main__":
    main()

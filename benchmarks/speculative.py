"""Speculative decoding on the traffic it is for (issue 38): real English text from documents that ship
with the environment (the Python standard library's own docstrings and sources), never random tokens.

    rag        3 passages of 300-600 tokens and a question whose answer quotes them
    code_edit  a standard-library function and "return it with one change"
    repeat     two RAG and two code-edit requests asked again after a first, untimed round (suffix
               drafts come from the earlier answers); the others start with the prefix cache and the
               suffix index reset

Beside them a guard that is not real text: 48 unique random-token prompts (64 tokens each, as versus_vllm's
unique-prompt workload) at batches of 1, 16 and 48, where speculation must not cost time.

Each mode (speculation off, ngram, suffix) serves the same requests greedily, at concurrency 1 (one at a
time) and 4 (four at once), for SmolLM2 as served (int4) and, with --dense, float32. Reported: output
tokens/s, the ratio to speculation off, acceptance (accepted / draft tokens) and tokens per forward of a
drafting row. Greedy outputs are checked equal to speculation off.

vLLM-CPU with its ngram speculation and llama.cpp's lookup are not run here yet (the peers are not
installed by this script; see PEERS.md).

    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py [--dense] [--max-tokens 256]

Run on a quiet machine. Prints one summary line; writes results/<machine>/speculative.json + .png.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

MODES = {"off": None, "ngram": {"method": "ngram"}, "suffix": {"method": "suffix"}}


def _passages() -> list[tuple[str, str]]:
    """(module, text) passages of real documentation: standard-library module docstrings."""
    import argparse as m1
    import pickle as m2
    import subprocess as m3
    import logging as m4
    import heapq as m5
    import textwrap as m6

    out = []
    for m in (m1, m2, m3, m4, m5, m6):
        text = " ".join((m.__doc__ or "").split())
        if len(text) > 400:
            out.append((m.__name__, text[:2400]))
    return out


def _functions() -> list[str]:
    import json.encoder
    import shlex
    import textwrap

    return [inspect.getsource(f) for f in (textwrap.dedent, shlex.split, textwrap.indent, json.encoder.py_encode_basestring)]


def _chat(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


def workloads(tokenizer) -> dict[str, list[str]]:
    passages = _passages()
    rag = []
    for i in range(4):
        chosen = [passages[(i + j) % len(passages)] for j in range(3)]
        docs = "\n\n".join(f"[{j + 1}] ({name}) {text}" for j, (name, text) in enumerate(chosen))
        rag.append(_chat(tokenizer, f"Passages:\n\n{docs}\n\nQuestion: what does passage [1] say the "
                                    f"{chosen[0][0]} module is for? Answer by quoting its first sentences."))
    edits = [_chat(tokenizer, "Return this function with one change: rename its first parameter to `value`. "
                              f"Reply with the whole function only.\n\n```python\n{src}```") for src in _functions()]
    return {"rag": rag, "code_edit": edits, "repeat": rag[:2] + edits[:2]}


def guard_prompts(n: int = 48, seed: int = 0) -> list[list[int]]:
    """The never-slower guard: unique random-token prompts (as versus_vllm's unique-prompt workload), where
    drafts find little to copy and speculation must cost nothing."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(128, 512))] for _ in range(n)]


def run_guard(model_kwargs: dict, spec, prompts: list[list[int]], batch: int) -> float:
    llm = LLM(speculative_config=spec, max_num_seqs=batch, enable_prefix_caching=False, **model_kwargs)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0


def run_mode(model_kwargs: dict, spec, prompts_by_workload: dict[str, list[str]], max_tokens: int) -> dict:
    llm = LLM(speculative_config=spec, max_num_seqs=8, **model_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts_by_workload["rag"][:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    out = {}
    for workload, prompts in prompts_by_workload.items():
        for concurrency in (1, 4):
            llm.reset_prefix_cache()  # no earlier run's KV, nor (suffix) its answers
            if workload == "repeat":  # asked before: the first answers are the earlier requests
                llm.generate(prompts, params, use_tqdm=False)
            before = llm.engine.stats()
            t0 = time.perf_counter()
            results = []
            for i in range(0, len(prompts), concurrency):
                results += llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            after = llm.engine.stats()
            tokens = sum(len(r.outputs[0].token_ids) for r in results)
            drafts = after.get("spec_decode_num_draft_tokens", 0) - before.get("spec_decode_num_draft_tokens", 0)
            accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get("spec_decode_num_accepted_tokens", 0)
            rows = after.get("spec_decode_num_drafts", 0) - before.get("spec_decode_num_drafts", 0)
            out[f"{workload}@{concurrency}"] = {
                "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                "draft_tokens": drafts, "accepted_tokens": accepted,
                "acceptance": accepted / drafts if drafts else None,
                "tokens_per_drafting_row": (rows + accepted) / rows if rows else None,
                "outputs": [r.outputs[0].token_ids for r in results],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", action="store_true", help="also SmolLM2 dense in float32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--guard-only", action="store_true", help="only the random-token never-slower guard")
    args = ap.parse_args()
    guard = {}
    prompts_guard = guard_prompts()
    for batch in (1, 16, 48):
        times = {mode: [] for mode in MODES}
        for _ in range(2):  # interleaved rounds; the least time of each
            for mode, spec in MODES.items():
                times[mode].append(run_guard({}, spec, prompts_guard[:4] if batch == 1 else prompts_guard, batch))
        guard[f"random@{batch}"] = {mode: min(t) for mode, t in times.items()}
        print("guard", batch, {m: round(v, 2) for m, v in guard[f"random@{batch}"].items()}, flush=True)
    if args.guard_only:
        write_json("speculative_guard", {"guard_seconds": guard})
        return
    models = {"int4": {}}
    if args.dense:
        models["fp32"] = {"quantization": "none", "dtype": "float32"}
    from transformers import AutoTokenizer
    from engine.models.resolve import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")), local_files_only=True)
    prompts = workloads(tokenizer)
    results: dict = {}
    for model, kwargs in models.items():
        for mode, spec in MODES.items():
            results[f"{model}/{mode}"] = run_mode(kwargs, spec, prompts, args.max_tokens)
            print(mode, model, {k: round(v["tokens_per_s"], 1) for k, v in results[f"{model}/{mode}"].items()},
                  flush=True)
    summary = {}
    for model in models:
        off = results[f"{model}/off"]
        for mode in ("ngram", "suffix"):
            r = results[f"{model}/{mode}"]
            for key in r:
                same = r[key]["outputs"] == off[key]["outputs"]
                summary[f"{model}/{mode}/{key}"] = {
                    "x_off": r[key]["tokens_per_s"] / off[key]["tokens_per_s"], "greedy_equal": same,
                    "acceptance": r[key]["acceptance"], "tokens_per_drafting_row": r[key]["tokens_per_drafting_row"]}
    for r in results.values():
        for v in r.values():
            v.pop("outputs")
    write_json("speculative", {"max_tokens": args.max_tokens, "results": results, "summary": summary,
                               "guard_seconds": guard})
    keys = list(results["int4/off"])
    bar_plot("speculative", "SmolLM2 int4: output tokens/s by speculation mode", keys,
             {mode: [results[f"int4/{mode}"][k]["tokens_per_s"] for k in keys] for mode in MODES}, "tokens/s")
    line = ", ".join(f"{k.split('/', 1)[1]} {v['x_off']:.2f}x" for k, v in summary.items() if k.startswith("int4/"))
    worst = max(g[m] / g["off"] for g in guard.values() for m in ("ngram", "suffix"))
    print(f"speculative (int4, x speculation off): {line}; all greedy equal: "
          f"{all(v['greedy_equal'] for v in summary.values())}; random-token guard: at worst {worst:.2f}x the time")
    print(json.dumps({k: round(v["x_off"], 2) for k, v in summary.items()}))


if __name__ == "__main__":
    main()

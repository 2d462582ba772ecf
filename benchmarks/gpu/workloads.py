"""The llama-1b / llama-8b steps: the benchmark workloads (benchmarks/_peer_jobs.py: GSP, unique prompts,
n=8, beam 4, cached TTFT, single stream) in bfloat16 on random weights of Llama-3.2-1B / Llama-3.1-8B
shape, written by the step on the machine (16 GB for the 8B do not travel), beside HF transformers'
generate on the same model and device, each as x the device's floor (benchmarks/floor.py's
workload_floor with the bandwidth and matmul rate the env step measured); then decode steps at batch 64
against the HBM floor (every weight and each sequence's KV read once a step).

HF generate runs each prompt set as one batch (left-padded; n=8 as num_return_sequences, beams as
num_beams), its best use without a serving engine; it has no prefix cache, so cached TTFT is a full
prefill for it."""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

VOCAB = 128256  # Llama 3's
SHAPES = {"llama-1b": "llama-3.2-1b", "llama-8b": "llama-3.1-8b"}  # benchmarks/shapes.py
DRY_RUN_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
DRY_RUN_VOCAB = 512
MAX_MODEL_LEN = 4096
DECODE_BATCH, DECODE_PROMPT, DECODE_STEPS = 64, 128, 48


def workloads_step(ctx, result: dict, shape_name: str) -> dict:
    """Each job runs twice in the engine on fresh token ids (no prefix of the first is cached for the
    second): the first run pays for what a server pays once (Triton compiling a new specialisation), the
    second is the one compared. HF generate runs the second prompt set once, after its own warm-up."""
    from benchmarks._peer_jobs import make_jobs, run_jobs
    from benchmarks.gpu.steps import free_device_memory

    dry = ctx.dry_run
    clock = Clock()
    vocab = DRY_RUN_VOCAB if dry else VOCAB
    folder = ctx.work / shape_name
    hf = write_random_llama(folder, DRY_RUN_SHAPE if dry else SHAPES[shape_name], ctx.device)
    result["model"] = {"shape": shape_name, "written_s": clock.lap("model written"),
                       "params": sum(p.numel() for p in hf.parameters())}
    jobs = make_jobs(vocab, repeats=2, beam_repeats=2)
    if dry:
        jobs = [shrink(j) for j in jobs]
    result["hf"] = {}
    ctx.save(result)
    for job in jobs:
        result["hf"][job["name"]] = hf_job(hf, {**job, "prompt_sets": job["prompt_sets"][-1:]}, ctx.device)
        clock.lap(f"HF generate {job['name']}: {result['hf'][job['name']]['seconds']:.3f} s")
        ctx.save(result)
    del hf
    free_device_memory()
    llm, startup = start_engine(folder, ctx.device, dry)
    graphs = llm.engine.runner.graphs
    result["ours"] = {"startup_s": round(startup, 1), "cuda_graph_sizes": graphs.sizes if graphs else None}
    clock.lap(f"engine started (CUDA graphs: {graphs.sizes if graphs else 'none'})")
    for job in jobs:
        ours = run_jobs(llm, [job])[job["name"]]
        ours.pop("token_ids", None)
        first, last = ours["runs_s"][0], ours["runs_s"][-1]
        ours["first_s"], ours["seconds"] = (first[1], last[1]) if job["kind"] == "ttft" else (first, last)
        result["ours"][job["name"]] = ours
        result["workloads"] = compare(result, folder, ctx.env_result(), dry)
        clock.lap(f"prefixserve {job['name']}: {ours['seconds']:.3f} s (first run {ours['first_s']:.3f} s)")
        ctx.save(result)
    result["decode64"] = decode_steps(llm, vocab, folder, ctx.env_result(), dry)
    clock.lap(f"decode at batch {DECODE_BATCH}: {result['decode64']}")
    ctx.save(result)
    if shape_name == FP8_SHAPE:
        del llm, graphs  # the graphs hold the pool too: both must go before another engine sizes its own
        free_device_memory()
        result["kv_fp8"] = fp8_kv_check(folder, vocab, ctx, dry)
        clock.lap(f"fp8 KV cache: {result['kv_fp8']}")
    return ctx.save(result)


FP8_SHAPE = "llama-1b"  # the fp8 KV cache is checked on the smaller shape (its start-up is seconds)
FP8_POOL_BYTES = 8 << 30


def fp8_kv_check(folder: Path, vocab: int, ctx, dry: bool) -> dict:
    """The engine with ``kv_cache_dtype="fp8"`` on the device: its KV blocks against the bf16 pool's, greedy
    tokens of 8 prompts beside the bf16 cache's (random weights: near-ties flip, so reported, not judged),
    and decode steps at batch 64."""
    from benchmarks.gpu.steps import free_device_memory
    from engine import SamplingParams

    prompts = [{"prompt_token_ids": [random.Random(i).randrange(100, vocab) for _ in range(48)]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8 if dry else 32, ignore_eos=True)
    out: dict = {}
    tokens = {}
    for kv in ("fp8",) if dry else ("auto", "fp8"):  # the dry run: the fp8 path's plumbing alone
        # A fixed pool (not a share of free memory): the same bytes hold twice the blocks in fp8
        llm, startup = start_engine(folder, ctx.device, dry, kv_cache_dtype=kv,
                                    **({} if dry else {"kv_cache_memory": FP8_POOL_BYTES}))
        out[kv] = {"startup_s": round(startup, 1), "num_kv_blocks": llm.engine.runner.kv_cache.shape[2],
                   "kv_dtype": str(llm.engine.runner.kv_cache.dtype)}
        tokens[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if kv == "fp8":
            out[kv]["decode64"] = decode_steps(llm, vocab, folder, ctx.env_result(), dry)
        del llm
        free_device_memory()
    if dry:
        return out
    same = [a == b for a, b in zip(tokens["auto"], tokens["fp8"])]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(tokens["auto"], tokens["fp8"])]
    out["greedy_identical"] = f"{sum(same)}/{len(same)}"
    out["tokens_before_first_difference"] = prefix
    out["blocks_x"] = round(out["fp8"]["num_kv_blocks"] / out["auto"]["num_kv_blocks"], 2)
    return out


class Clock:
    """Prints each phase with the seconds since the step began (the log of a run cut off says where)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()

    def lap(self, what: str) -> float:
        now = time.perf_counter()
        took, self.last = now - self.last, now
        print(f"  [{now - self.t0:6.1f} s] {what}", flush=True)
        return round(took, 1)


def shrink(job: dict) -> dict:
    """A dry run's job: the same kinds and parameters on a few short prompts."""
    sets = [[p[:24] for p in s[:3]] for s in job["prompt_sets"][:2]]
    params = {**job["params"]}
    if "max_tokens" in params:
        params["max_tokens"] = min(params["max_tokens"], 3)
    return {**job, "prompt_sets": sets, "params": params}


# -- the model ------------------------------------------------------------------------------------
def write_random_llama(folder: Path, shape: str | dict, device: str):
    """A random bf16 Llama (``shape``: a benchmarks/shapes.py name, or config fields) built on ``device`` (HF's
    own init), saved with a word-level tokenizer of its vocabulary into ``folder``; returns the HF model,
    still on the device. The weights go out through safetensors directly (transformers' save_pretrained took
    28 s for the 8B on an H200)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.shapes import LLAMA3_ROPE, config_of, write_word_tokenizer

    if isinstance(shape, str):
        config = config_of(shape)
    else:
        config = LlamaConfig(max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE),
                             bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.02, **shape)
        config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    state = {name: t.detach().cpu() for name, t in model.state_dict().items()
             if not (config.tie_word_embeddings and name == "lm_head.weight")}  # tied: the embedding serves
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_word_tokenizer(folder, config.vocab_size, MAX_MODEL_LEN)
    return model


def start_engine(folder: Path, device: str, dry: bool, **options):
    from benchmarks._peer_jobs import MAX_NUM_SEQS
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    sizing = {"num_kv_blocks": 512, "attention_backend": "triton"} if dry else {"gpu_memory_utilization": 0.85}
    # Speculation off, as "auto" leaves it on a GPU (on the dry run's CPU it would measure step costs through
    # the Triton interpreter); options may still name a speculative_config.
    options = {"speculative_config": None, **options}
    llm = LLM(str(folder), dtype="bfloat16", device=device, max_num_seqs=MAX_NUM_SEQS,
              max_model_len=256 if dry else MAX_MODEL_LEN, **sizing, **options)
    # Warm-up: compile the Triton kernels for this shape (prefill and decode) before anything is timed.
    llm.generate([{"prompt_token_ids": list(range(100, 116 + i))} for i in range(4)], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    return llm, time.perf_counter() - t0


# -- HF generate ----------------------------------------------------------------------------------
def hf_job(model, job: dict, device: str) -> dict:
    """One job through HF generate: every prompt set timed as a batch, the median reported."""
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine's jobs
    model.generation_config.pad_token_id = 0
    _hf_generate(model, [list(range(100, 116))], max_new_tokens=2)  # warm-up
    runs = []
    for prompt_set in job["prompt_sets"]:
        if job["kind"] == "ttft":
            times = []
            for prompt in prompt_set:
                t = _now(device)
                _hf_generate(model, [prompt], max_new_tokens=1)
                times.append(_now(device) - t)
            runs.append(times)
            continue
        p = job["params"]
        kwargs = {"max_new_tokens": p["max_tokens"], "min_new_tokens": p["max_tokens"]}
        if job["kind"] == "beam":
            kwargs.update(num_beams=p["beam_width"], num_return_sequences=p["beam_width"], do_sample=False)
        elif p.get("temperature", 1.0) > 0:
            kwargs.update(do_sample=True, temperature=p["temperature"], top_p=p.get("top_p", 1.0),
                          num_return_sequences=p.get("n", 1))
        t = _now(device)
        _hf_generate(model, prompt_set, **kwargs)
        runs.append(_now(device) - t)
    if job["kind"] == "ttft":
        return {"runs_s": runs, "seconds": statistics.median(r[1] for r in runs)}
    return {"runs_s": runs, "seconds": statistics.median(runs)}


def _hf_generate(model, prompts: list[list[int]], **kwargs):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kwargs.setdefault("do_sample", False)
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, **kwargs).cpu()


def _now(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


# -- x floor --------------------------------------------------------------------------------------
def machine(env: dict) -> dict | None:
    """benchmarks/floor.py's machine figures from the env step's measurements."""
    if "bf16_flops_per_s" not in env:
        return None
    return {"gemm_flops_per_s": {"bfloat16": {"8192": env["bf16_flops_per_s"]}},
            "memory_bytes_per_s": env["memory_bytes_per_s"]}


def compare(result: dict, folder: Path, env: dict, dry: bool) -> dict:
    from benchmarks.floor import WORKLOADS, ModelShape, workload_floor

    mach = machine(env)
    shape = ModelShape.from_config(folder)
    floors = {w.name: workload_floor(w, shape, mach, "bfloat16")["floor_s"] for w in WORKLOADS} if mach else {}
    rows = {}
    for name, ours in result["ours"].items():
        if not isinstance(ours, dict) or name not in result["hf"] or "first_s" not in ours:
            continue
        hf_s, ours_s = result["hf"][name]["seconds"], ours["seconds"]
        floor = None if dry else floors.get(name)  # a dry run's shrunk jobs have no floor
        rows[name] = {"ours_s": round(ours_s, 4), "ours_first_s": round(ours["first_s"], 4), "hf_s": round(hf_s, 4),
                      "x_hf": round(hf_s / ours_s, 2),
                      "floor_s": floor and round(floor, 4),
                      "ours_x_floor": floor and round(ours_s / floor, 2), "hf_x_floor": floor and round(hf_s / floor, 2)}
    return rows


def decode_steps(llm, vocab: int, folder: Path, env: dict, dry: bool) -> dict:
    """Seconds per decode position with DECODE_BATCH sequences decoding (prefill done before the clock): the
    wall time for every sequence to gain ``steps`` tokens, over ``steps``. Modes (BURST_MODES): decode bursts of
    several lengths (engine/decode_burst.py: K steps per host round, each step one captured graph, or with
    ``-ops`` the forward's graph and the choice and next inputs op by op), single steps replaying CUDA graphs,
    and eager steps; each against the HBM floor of such a step at the mode's own mean context (the weights and
    every sequence's KV read once)."""
    from engine import SamplingParams

    batch, prompt_len, steps = (4, 16, 4) if dry else (DECODE_BATCH, DECODE_PROMPT, DECODE_STEPS)
    engine = llm.engine
    graphs = engine.runner.graphs
    rng = random.Random(7)
    modes = [m for m in BURST_MODES if graphs or m[0] == "eager"]
    longest = max(k for _, k, _, _ in modes)
    per_mode = 3 + 2 * steps + 4 + 3 * longest  # warm-up, timed, phases, profiler, and what bursts overshoot
    params = SamplingParams(temperature=0, max_tokens=len(modes) * per_mode + 32, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(prompt_len)]},
                           params)
    while engine.scheduler.waiting:  # prefill everything before the clock
        engine.step()
    out = {"batch": len(engine.scheduler.running), "cuda_graph_sizes": graphs.sizes if graphs else None}
    burst_steps = engine.burst_steps
    mach = machine(env)
    shape = None
    if mach and not dry:
        from benchmarks.floor import ModelShape

        shape = ModelShape.from_config(folder)
    for mode, burst, enabled, fused in modes:
        if graphs:
            graphs.enabled, graphs.fused_bursts = enabled, fused
        engine.burst_steps = burst
        decode_tokens(engine, 3)  # untimed: the last prefill chunks, the first steps of this mode
        context = mean_context(engine)
        t0 = _now(engine.device.type)
        gained = decode_tokens(engine, steps)
        out[mode] = {"step_s": round((_now(engine.device.type) - t0) / gained, 6),
                     "context": round((context + mean_context(engine)) / 2)}
        out[mode].update(**device_busy(engine, engine.device.type), phases_ms=step_phases(engine, steps))
        if shape is not None:
            floor = (shape.weight_bytes(2) + shape.kv_bytes(batch * out[mode]["context"], 2)) / mach["memory_bytes_per_s"]
            out[mode].update(floor_step_s=round(floor, 6), x_floor=round(out[mode]["step_s"] / floor, 2))
    if graphs:
        graphs.enabled, graphs.fused_bursts = True, graphs.burst_block_size is not None
    engine.burst_steps = burst_steps
    for request_id in ids:
        engine.abort(request_id)
    best = min((m[0] for m in modes), key=lambda m: out[m].get("x_floor") or out[m]["step_s"])
    out.update(best=best, step_s=out[best]["step_s"], floor_step_s=out[best].get("floor_step_s"),
               x_floor=out[best].get("x_floor"))
    return out


# (name, engine.burst_steps, graphs replayed, burst steps as one graph): the engine's default is burst8
BURST_MODES = (("burst8", 8, True, True), ("burst16", 16, True, True), ("burst32", 32, True, True),
               ("burst16-ops", 16, True, False), ("graphs", 1, True, True), ("eager", 1, False, False))


def mean_context(engine) -> float:
    running = engine.scheduler.running
    return sum(s.num_tokens for s in running) / max(len(running), 1)


def decode_tokens(engine, n: int) -> int:
    """Engine steps until every running sequence has at least ``n`` more tokens (a burst gives several per step);
    returns the tokens each gained."""
    batch = len(engine.scheduler.running)
    start = engine.outputs.counters.generation_tokens
    while engine.outputs.counters.generation_tokens < start + n * batch:
        engine.step()
    return (engine.outputs.counters.generation_tokens - start) // max(batch, 1)


PHASES = (("schedule", "scheduler", "schedule"), ("execute", "runner", "execute"),
          ("launch", "runner", "launch_burst"), ("update", "scheduler", "update_from_output"),
          ("outputs", "outputs", "process"))


def step_phases(engine, steps: int) -> dict:
    """Milliseconds a decode position spends in each of Engine.step's phases (execute ends when the sampled
    tokens reach the host, so it holds the device's time; a burst's launch returns at once and its update
    waits for each step's tokens); what the host does outside them is the rest."""
    spent = {name: 0.0 for name, _, _ in PHASES}
    originals = []
    for name, owner_attr, method in PHASES:
        owner = getattr(engine, owner_attr)
        original = getattr(owner, method)
        originals.append((owner, method, original))

        def timed(*args, _name=name, _original=original, **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(owner, method, timed)
    try:
        t0 = _now(engine.device.type)
        steps = decode_tokens(engine, steps)
        wall = _now(engine.device.type) - t0
    finally:
        for owner, method, _ in originals:
            delattr(owner, method)  # the instance attribute goes; the class's method shows again
    phases = {name: round(s / steps * 1e3, 3) for name, s in spent.items()}
    phases["other"] = round(wall / steps * 1e3 - sum(phases.values()), 3)
    return phases


def device_busy(engine, device: str, steps: int = 4) -> dict:
    """Where a decode position's time goes: the device's kernel time per position (torch.profiler) against the
    wall time, and the ops that take most of it; {} where the profiler cannot run."""
    if device != "cuda":
        return {}
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = _now(device)
            steps = decode_tokens(engine, steps)  # per decode position: a burst's engine step holds several
            wall = (_now(device) - t0) / steps
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_s = sum(e.self_device_time_total for e in events) / 1e6 / steps
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:8]
        return {"profiled_step_s": round(wall, 6), "kernel_s_per_step": round(kernel_s, 6),
                "kernel_launches_per_step": sum(e.count for e in events) // steps,
                "top_kernels_ms_per_step": {e.key[:80]: round(e.self_device_time_total / 1e3 / steps, 3) for e in top}}
    except Exception as exc:  # a measurement aid: never the step's failure
        return {"profiler_error": repr(exc)}

"""Quantized weights served quantized (issue 19): the default model's Q4_1 GGUF run as int4 / int8
(quantization="gguf") against the same file dequantized to float32 (quantization="none") and
against llama.cpp's server on the same GGUF (the anchor; benchmarks/peers/install_llama_cpp.sh).

    weight memory      ModelInfo.weight_bytes, quantized vs dequantized
    decode tokens/s    single stream and a batch of 8, 128-token prompts, 64 greedy tokens each,
                       decode only (the 1-token run's time subtracted; llama.cpp: its own timings)
    accuracy           mean log-likelihood per token of a fixed held-out text (prompt logprobs),
                       quantized vs dequantized float32; and perplexity by llama-perplexity's protocol
                       (chunks of PPL_CTX tokens, the second half of each scored) for ours and for
                       llama.cpp's own llama-perplexity on the same file and text

    PYTHONPATH=. .venv/bin/python benchmarks/quantized.py [--model llama-3.2-1b]

--model llama-3.2-1b: that shape as a Q4_0 GGUF of random weights (benchmarks/shapes.py gguf_checkpoint,
SmolLM2's tokenizer and vocabulary), speed only; results/<machine>/quantized_llama-3.2-1b.json.

Run on a quiet machine. Prints one summary line; writes results/<machine>/quantized.json + .png.
"""
from __future__ import annotations

import concurrent.futures
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import bar_plot, write_json  # noqa: E402
from benchmarks._llama_cpp import LLAMA_SERVER, installed, llama_server  # noqa: E402
import torch  # noqa: E402

from engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from engine.auto_dtype import resolve_dtype  # noqa: E402
from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf, resolve_model  # noqa: E402

TOKENS = 64
HELD_OUT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "visitors were gulls and the men who brought oil and bread once a fortnight. The keeper kept a "
    "log of every ship that passed, the state of the weather at each watch, and the hours the lamp "
    "burned. In winter the storms came from the north-west and the spray reached the gallery more "
    "than a hundred feet above the sea. He did not mind the storms; what he minded was the fog, "
    "which came without warning in the spring and lay on the water for days, so that he had to "
    "sound the horn every two minutes and could not sleep. When the relief keeper arrived in May "
    "he found the log complete to the last entry, written in a steady hand, and a pot of coffee "
    "still warm on the stove. "
    "The relief keeper was a younger man who had served on ships before, and he read the log the "
    "way a sailor reads a chart, looking for the places where the writer had been afraid. He found "
    "none. The entries for the worst nights were the same length as the entries for the calm ones: "
    "wind, sea, visibility, the hours of the lamp, the ships that passed and the ships that did not. "
    "Only once, in February, had the old keeper written something more, a single line at the foot "
    "of the page saying that a schooner had gone onto the reef to the south and that he had watched "
    "her lights until they went out. The relief keeper closed the book and went up to the gallery, "
    "where the wind was already rising, and began to clean the glass."
)
PPL_CTX = 128  # llama-perplexity -c: each chunk's second half is scored with its first half as context


def prompts(n: int) -> list[list[int]]:
    return [[1000 + 13 * i + j for j in range(128)] for i in range(n)]


def decode_rate(llm: LLM, batch: int) -> float:
    """Generated tokens per second of decode steps alone (a 1-token run's time subtracted)."""
    ps = [{"prompt_token_ids": p} for p in prompts(batch)]
    llm.generate(ps, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm; prompts cached after
    best = 0.0
    for _ in range(2):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        first = time.perf_counter() - start
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
        full = time.perf_counter() - start
        best = max(best, batch * (TOKENS - 1) / (full - first))
    return best


def mean_loglik(llm: LLM) -> float:
    ids = llm.get_tokenizer()(HELD_OUT).input_ids
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    scores = [lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    return sum(scores) / len(scores)


def chunk_ppl(llm: LLM, ids: list[int]) -> float:
    """Perplexity as llama-perplexity computes it (no BOS: this GGUF sets add_bos_token false): the
    text in chunks of PPL_CTX tokens, each chunk's tokens PPL_CTX/2+1 .. PPL_CTX-1 scored."""
    nll, count = 0.0, 0
    for c in range(len(ids) // PPL_CTX):
        chunk = ids[c * PPL_CTX:(c + 1) * PPL_CTX]
        out = llm.generate([{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        for j in range(PPL_CTX // 2 + 1, PPL_CTX):
            nll -= out.prompt_logprobs[j][chunk[j]].logprob
            count += 1
    return math.exp(nll / count)


def llama_perplexity(gguf: Path, text_file: Path) -> float | None:
    binary = LLAMA_SERVER.parent / "llama-perplexity"
    if not binary.exists():
        return None
    run = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(PPL_CTX), "-b", str(PPL_CTX),
                          "-t", str(len(os.sched_getaffinity(0)))], capture_output=True, text=True, timeout=600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    return float(found.group(1)) if found else None


def llama_cpp_tokens(base: str) -> list[int]:
    return httpx.post(f"{base}/tokenize", json={"content": HELD_OUT}, timeout=60).json()["tokens"]


def llama_cpp(gguf: Path) -> dict | None:
    if not installed():
        return None
    with llama_server(gguf, slots=8, ctx_per_slot=512) as base:

        def one(p: list[int]) -> dict:
            r = httpx.post(f"{base}/completion", json={"prompt": p, "n_predict": TOKENS, "temperature": 0,
                                                       "cache_prompt": False, "ignore_eos": True}, timeout=300)
            return r.json()["timings"]

        one(prompts(1)[0])  # warm
        single = max(one(prompts(1)[0])["predicted_per_second"] for _ in range(2))
        batch = 0.0
        for _ in range(2):
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                timings = list(pool.map(one, prompts(8)))
            batch = max(batch, sum(t["predicted_n"] for t in timings) / max(t["predicted_ms"] for t in timings) * 1e3)
        return {"single_stream_tok_s": single, "batch8_tok_s": batch, "held_out_tokens": llama_cpp_tokens(base)}


def main() -> None:
    import argparse

    from benchmarks.shapes import SHAPES, gguf_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="the default model's shipped GGUF, or a llama shape of benchmarks/shapes.py (llama-3.2-1b) "
                         "written as a Q4_0 GGUF of random weights: speed only, no accuracy")
    args = ap.parse_args()
    shape = args.model if args.model in SHAPES else None
    gguf = gguf_checkpoint(shape, "Q4_0") if shape else _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL])
    name = f"quantized_{shape}" if shape else "quantized"
    results: dict[str, dict] = {}
    # the default (dtype "auto", engine/auto_dtype.py) is one of the first two on every CPU: which one is recorded
    model = str(gguf) if shape else DEFAULT_MODEL
    default_dtype = resolve_dtype(EngineConfig(model=model, quantization="gguf"), resolve_model(model),
                                  torch.device("cpu")).dtype
    runs = (("prefixserve int4", "gguf", "float32"), ("prefixserve int4, bf16 activations", "gguf", "bfloat16"),
            ("prefixserve dequantized fp32", "none", "float32"))
    ours_ids: list[int] = []
    for run, quantization, dtype in runs:
        # Speculation off: this compares kernels, and llama.cpp runs without its lookup decoding.
        llm = LLM(model=model, quantization=quantization, dtype=dtype,
                  num_kv_blocks=512, speculative_config=None)
        ours_ids = llm.get_tokenizer()(HELD_OUT).input_ids
        accuracy = {"mean_loglik": mean_loglik(llm), "ppl": chunk_ppl(llm, ours_ids)} if not shape else {}
        results[run] = {"weight_bytes": llm.model_info.weight_bytes, **accuracy,
                        "single_stream_tok_s": decode_rate(llm, 1), "batch8_tok_s": decode_rate(llm, 8)}
        del llm
    peer = llama_cpp(gguf)
    if peer is not None:
        held_out_tokens = peer.pop("held_out_tokens")
        if not shape:  # random weights have no accuracy to compare
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(HELD_OUT)
            peer["ppl"] = llama_perplexity(gguf, Path(f.name))
            os.unlink(f.name)
            peer["same_tokens_as_ours"] = held_out_tokens == ours_ids
        results["llama.cpp server"] = peer
    write_json(name, {"model": gguf.name, "results": results, "ppl_ctx": PPL_CTX, "default_dtype": default_dtype,
                      "note": "ppl: llama-perplexity's protocol on the held-out text, for llama.cpp its own "
                              "llama-perplexity binary; same_tokens_as_ours: llama.cpp's /tokenize of the text "
                              "equals our tokenizer's ids; speculative decoding off on both sides"})
    names = list(results)
    bar_plot(name, f"{gguf.name}: decode tokens/s", ["single stream", "batch 8"],
             {n: [results[n]["single_stream_tok_s"], results[n]["batch8_tok_s"]] for n in names}, "tokens/s")
    q, d = results["prefixserve int4"], results["prefixserve dequantized fp32"]
    line = (f"quantized: weights {q['weight_bytes'] / 2**20:.1f} vs {d['weight_bytes'] / 2**20:.1f} MiB "
            f"({d['weight_bytes'] / q['weight_bytes']:.1f}x less); decode single {q['single_stream_tok_s']:.1f} vs "
            f"{d['single_stream_tok_s']:.1f} tok/s, batch 8 {q['batch8_tok_s']:.1f} vs {d['batch8_tok_s']:.1f}")
    if not shape:
        line += (f"; mean loglik {q['mean_loglik']:.4f} vs {d['mean_loglik']:.4f}, "
                 f"ppl {q['ppl']:.2f} vs {d['ppl']:.2f}")
    if peer is not None:
        b = results["prefixserve int4, bf16 activations"]
        line += (f"; llama.cpp single {peer['single_stream_tok_s']:.1f}, batch 8 {peer['batch8_tok_s']:.1f} tok/s "
                 f"(ours in float32 {q['single_stream_tok_s'] / peer['single_stream_tok_s']:.2f}x, "
                 f"{q['batch8_tok_s'] / peer['batch8_tok_s']:.2f}x; bf16 activations "
                 f"{b['single_stream_tok_s'] / peer['single_stream_tok_s']:.2f}x, "
                 f"{b['batch8_tok_s'] / peer['batch8_tok_s']:.2f}x; default here: {default_dtype})"
                 + (f", ppl {peer['ppl']}" if not shape else ""))
    print(f"{name}: " + line.removeprefix("quantized: "))


if __name__ == "__main__":
    main()

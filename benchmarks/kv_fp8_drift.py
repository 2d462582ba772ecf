"""What the fp8 KV cache (kv_cache_dtype="fp8", docs/kv-cache.md) costs in accuracy and gains in capacity, on
the default model as served (SmolLM2-135M-Instruct, int4 weights), in float32 and bfloat16. No timings.

    capacity     KV blocks the same kv_cache_memory holds, auto vs fp8
    greedy       16 chat prompts, 64 greedy tokens each: sequences identical to auto's, tokens before the
                 first difference, and teacher-forced agreement: auto's sequences scored by the fp8 engine
                 (prompt logprobs), the share of their generated tokens that are fp8's argmax too (a flip
                 there is a near-tie flip; free-running outputs diverge after the first one)
    likelihood   mean log-likelihood per token of benchmarks/quantized.py's held-out text, auto vs fp8

    PYTHONPATH=. .venv/bin/python benchmarks/kv_fp8_drift.py

Prints one summary line per dtype; writes results/<machine>/kv_fp8_drift.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import write_json  # noqa: E402
from benchmarks.quantized import HELD_OUT  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

TOKENS = 64
POOL_BYTES = 256 << 20
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give me a recipe for pancakes.", "Translate 'good morning' into Spanish.",
    "Summarize the plot of Romeo and Juliet.", "What is the difference between a virus and a bacterium?",
    "Write a short poem about autumn leaves.", "Why is the sky blue?", "What are the benefits of regular exercise?",
    "Describe how a bicycle works.", "Name the planets of the solar system in order.",
    "What is machine learning? Answer briefly.",
]


def greedy_drift(auto: LLM, fp8: LLM) -> dict:
    """Free-running and teacher-forced agreement of fp8 with auto on QUESTIONS."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    ours = [o.outputs[0].token_ids for o in auto.chat(convs, params, use_tqdm=False)]
    theirs = [o.outputs[0].token_ids for o in fp8.chat(convs, params, use_tqdm=False)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS) for x, y in zip(ours, theirs)]
    prompts = [auto.apply_chat_template(c, True, None) for c in convs]
    agree = total = 0
    for prompt, out, scored in zip(prompts, ours, _scores(fp8, [p + o for p, o in zip(prompts, ours)])):
        ranks = [entry[token].rank for token, entry in zip(out, scored[len(prompt):])]
        agree, total = agree + sum(r == 1 for r in ranks), total + len(ranks)
    return {"prompts": len(QUESTIONS), "tokens": TOKENS, "identical_sequences": sum(f == TOKENS for f in first),
            "mean_tokens_before_first_difference": sum(first) / len(first), "first_difference": first,
            "teacher_forced_top1_agreement": agree / total}


def _scores(llm: LLM, sequences: list[list[int]]) -> list:
    """Each sequence's prompt logprobs (position p: the token at p given those before), prefix caching off."""
    llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [o.prompt_logprobs for o in outs]


def loglik(llm: LLM) -> float:
    """Mean log-likelihood per token of the held-out text."""
    ids = llm.engine.tokenizer(HELD_OUT)["input_ids"]
    (scored,) = _scores(llm, [ids])
    values = [entry[t].logprob for t, entry in zip(ids[1:], scored[1:])]
    return sum(values) / len(values)


def main() -> None:
    results = {}
    for dtype in ("float32", "bfloat16"):
        # no prefix caching: every score and output is computed, none read back from another request's blocks
        common = dict(dtype=dtype, kv_cache_memory=POOL_BYTES, enable_prefix_caching=False)
        auto, fp8 = LLM(**common), LLM(kv_cache_dtype="fp8", **common)
        row = {"blocks_auto": auto.engine.blocks.num_blocks, "blocks_fp8": fp8.engine.blocks.num_blocks,
               **greedy_drift(auto, fp8), "loglik_auto": loglik(auto), "loglik_fp8": loglik(fp8)}
        results[dtype] = row
        print(f"{dtype}: {POOL_BYTES >> 20} MiB holds {row['blocks_auto']} -> {row['blocks_fp8']} blocks; "
              f"{row['identical_sequences']}/{row['prompts']} sequences identical over {TOKENS} tokens, "
              f"{row['mean_tokens_before_first_difference']:.1f} tokens before the first difference, "
              f"teacher-forced top-1 {100 * row['teacher_forced_top1_agreement']:.1f}%; held-out log-likelihood "
              f"{row['loglik_auto']:.4f} -> {row['loglik_fp8']:.4f} nat/token")
        del auto, fp8
    write_json("kv_fp8_drift", {"model": "smollm2-135m-instruct (int4 GGUF as served)", "pool_bytes": POOL_BYTES,
                                "results": results})


if __name__ == "__main__":
    main()

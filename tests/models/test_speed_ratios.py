"""Speed that travels: ratios measured in one process on whatever CPU runs the suite, with wide margins,
never absolute times. A kernel chosen by CPU flags once ran oneDNN's reference int8 matmul for the default
model's LM head (4 tokens/s on a Zen 5, 1.4-1.9 on an Intel VM, where the dense model decodes at ~100 and
~30); measured choices (kernels/cpu/dispatch.py) are what these guard."""
from __future__ import annotations

import statistics
import time

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.real_model

TOKENS = 64


def _tokens_per_s(llm: LLM, offset: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate({"prompt_token_ids": list(range(300 + offset, 332 + offset))}, params, use_tqdm=False)
    return TOKENS / (time.perf_counter() - t0)


@pytest.fixture(scope="module")
def served_and_dense():
    # Speculation off: it is on by default on the CPU, and its drafts' acceptance follows each model's own
    # (different) greedy text, so tokens/s would measure the text, not the kernels (CI on an Intel Xeon:
    # quantized 67-130 tok/s, dense 68-82, where a quantized step costs 10.7 ms and a dense one 24.8).
    quantized = LLM(max_num_seqs=4, speculative_config=None)  # as served: int4 layers, int8 LM head
    dense = LLM(quantization="none", max_num_seqs=4, speculative_config=None)  # dequantized, float32
    for llm in (quantized, dense):
        _tokens_per_s(llm, 0)  # warm: the first step compiles nothing, but faults pages in
    return quantized, dense


def test_the_default_model_decodes_at_least_as_fast_as_it_does_dense(served_and_dense):
    quantized, dense = served_and_dense
    rates: dict[str, list[float]] = {"quantized": [], "dense": []}
    for i in range(3):  # interleaved, so a slow spell of the machine hits both
        rates["quantized"].append(_tokens_per_s(quantized, 1 + i))
        rates["dense"].append(_tokens_per_s(dense, 11 + i))
    q, d = statistics.median(rates["quantized"]), statistics.median(rates["dense"])
    assert q >= d, f"single stream: quantized {q:.1f} tok/s, dense float32 {d:.1f} tok/s ({rates})"


def test_every_bound_choice_is_within_1_5x_of_the_fastest_it_measured(served_and_dense):
    for llm in served_and_dense:
        choices = llm.engine.dispatch.choices
        assert choices, "the CPU ops measured nothing"
        for choice in choices.values():
            assert choice.slowdown() <= 1.5, choice.describe() + f" {choice.times_ms}"

"""What the engine stamps and counts for /metrics: first scheduling vs first token, aborts, tokens per step."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    # A 16-token step budget: a 40-token prompt takes three steps of chunked prefill before its first token.
    # Speculation off: the tests count one token per decode step (suffix drafts from the earlier requests'
    # identical prompts would take several a step).
    return LLM(model=str(tiny_model_factory("llama")), block_size=8, num_kv_blocks=64, max_num_batched_tokens=16,
               max_num_seqs=4, enable_prefix_caching=False, speculative_config=None)


def _run(engine, request_id: str, prompt_len: int, max_tokens: int):
    engine.add_request(request_id, {"prompt_token_ids": list(range(300, 300 + prompt_len))},
                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    steps, final = 0, None
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final, steps


@pytest.mark.parametrize("prompt_len", [10, 40])  # one prefill step; three chunked steps
def test_queue_time_ends_at_first_scheduling_not_at_first_token(llm, prompt_len):
    final, _ = _run(llm.engine, f"timing-{prompt_len}", prompt_len, 2)
    m = final.metrics
    # Stamped before the forward that computes the prompt, so strictly before the first token even
    # when the whole prompt is one step (queue time + prefill time == TTFT, neither is zero).
    assert m["arrival_time"] <= m["first_scheduled_time"] < m["first_token_time"] < m["last_token_time"]


def test_iteration_tokens_count_every_scheduled_token_per_step(llm):
    engine = llm.engine
    before = engine.stats()["iteration_tokens"]
    _, steps = _run(engine, "iter", 40, 3)
    after = engine.stats()["iteration_tokens"]
    # 40 prompt tokens in chunks of 16, 16, 8, then two decode steps of one token each.
    assert steps == 5
    assert after.count - before.count == 5 and after.sum - before.sum == 42
    le = dict(after.buckets)
    prev = dict(before.buckets)
    assert le[1.0] - prev[1.0] == 2  # the decode steps
    assert le[8.0] - prev[8.0] == 3 and le[16.0] - prev[16.0] == 5  # the 8-token chunk, then the 16s


def test_abort_is_counted_as_a_finished_request(llm):
    engine = llm.engine
    before = engine.stats()["request_success"].get("abort", 0)
    engine.add_request("gone", "a prompt to abandon", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort("gone")
    assert not engine.abort("gone")  # a second abort of the same request counts nothing
    assert engine.stats()["request_success"]["abort"] == before + 1
    assert not engine.has_unfinished()

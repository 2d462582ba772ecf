"""Engine behaviour on a tiny random model: integrity every step, seeds, stops, abort, errors."""
from __future__ import annotations

import pytest

from engine_testlib import run_checked

from engine import (
    ContextLengthExceededError, EngineConfig, InvalidConfigError, InvalidRequestError, LLM, SamplingParams,
)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=str(tiny_path), block_size=8, num_kv_blocks=128, max_num_batched_tokens=48, max_num_seqs=4)


def test_integrity_every_step_and_all_blocks_free(llm):
    engine = llm.engine
    for i, n in enumerate([3, 40, 100, 7, 60, 1]):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(200, 200 + n))},
                           SamplingParams(temperature=0.8, max_tokens=10, seed=i))
    finals = run_checked(engine)
    assert len(finals) == 6
    assert all(len(o.outputs[0].token_ids) == 10 for o in finals.values())
    usage = engine.kv_cache_usage()
    assert usage["num_in_use"] == 0 and usage["peak_in_use"] > 0
    assert usage["num_free"] + usage["num_evictable"] == usage["num_blocks"]


def test_seed_reproduces_whatever_shares_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate("hello there", p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True)] * 3
    batch = llm.generate(["x y z", "hello there", "a b c d e f", "q"], [others[0], p, others[1], others[2]],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate("hello there", SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12,
                                                            seed=99, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_string_excluded_unless_asked(llm):
    base = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert len(text) > 4
    stop = text[2:4]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, stop=stop, ignore_eos=True,
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    stop_tok = ids[3]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok],
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first = ids.index(stop_tok)
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens bans stop tokens until reached
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok], min_tokens=8,
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8 and stop_tok not in out.token_ids[:8]


def test_length_finish_and_logprobs(llm):
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) >= 3
        assert entry[tok].rank == 1  # greedy picks the most likely raw token
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_prompt_logprobs(llm):
    out = llm.generate({"prompt_token_ids": list(range(300, 340))},
                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == 40
    for pos in range(1, 40):
        assert 300 + pos in out.prompt_logprobs[pos]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("keep", {"prompt_token_ids": list(range(100, 130))}, SamplingParams(max_tokens=8))
    engine.add_request("drop", {"prompt_token_ids": list(range(100, 160))}, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.abort("drop")
    assert not engine.abort("drop")
    engine.check_integrity()
    finals = run_checked(engine)
    assert set(finals) == {"keep"}
    assert engine.kv_cache_usage()["num_in_use"] == 0


def test_priority_policy_runs_important_first(tiny_path):
    llm = LLM(model=str(tiny_path), block_size=8, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    e = llm.engine
    e.add_request("low", "aaa", SamplingParams(max_tokens=3, ignore_eos=True), priority=5)
    e.add_request("high", "bbb", SamplingParams(max_tokens=3, ignore_eos=True), priority=-1)
    first_finished = None
    while e.has_unfinished():
        for out in e.step():
            if out.finished and first_finished is None:
                first_finished = out.request_id
    assert first_finished == "high"


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"n": 0}, {"max_tokens": 0}, {"max_tokens": -3},
    {"top_k": -2}, {"min_p": 2.0}, {"logprobs": 100}, {"stop": [""]}, {"min_tokens": 5, "max_tokens": 2},
    {"repetition_penalty": 0.0}, {"best_of": 3},
])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_requests_raise_clear_errors(llm):
    e = llm.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        e.add_request("e1", "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        e.add_request("e2", {"prompt_token_ids": [-1, 5]}, SamplingParams())
    with pytest.raises(ContextLengthExceededError, match="maximum context length"):
        e.add_request("e3", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=e.max_model_len))
    small_pool = LLM(model=str(e.model_path), block_size=8, num_kv_blocks=16).engine  # 128 tokens
    with pytest.raises(ContextLengthExceededError, match="KV blocks"):
        small_pool.add_request("e4", {"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=100))
    assert not small_pool.has_unfinished()
    e.add_request("dup", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        e.add_request("dup", "hi", SamplingParams(max_tokens=1))
    run_checked(e)
    assert not e.has_unfinished()


@pytest.mark.parametrize("kwargs", [
    {"dtype": "float64"}, {"block_size": 12}, {"num_kv_blocks": 0}, {"max_num_seqs": 0},
    {"scheduling_policy": "lifo"}, {"attention_backend": "cuda-magic"}, {"device": "tpu"},
    {"num_scheduler_steps": 0}, {"num_scheduler_steps": 65},
])
def test_bad_engine_config_raises(kwargs):
    with pytest.raises(InvalidConfigError):
        EngineConfig(**kwargs)


def test_missing_model_fails_fast(tmp_path):
    from engine.models.resolve import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        LLM(model=str(tmp_path / "nope"))


def test_generate_orders_outputs_and_accepts_forms(llm):
    outs = llm.generate(["one", {"prompt": "two"}, {"prompt_token_ids": [300, 301]}],
                        SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == ["one", "two", None]
    assert outs[2].prompt_token_ids == [300, 301]

"""Grammar fast-forward: where a structured output's grammar allows only one continuation, its tokens are
appended without sampling and computed with the next row, so forced text costs no steps of its own."""
from __future__ import annotations

import json

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams

CHOICE = "The quick brown fox jumps over the lazy dog near the river bank"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 12}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def _steps(llm: LLM, prompt: str, params: SamplingParams):
    engine = llm.engine
    engine.add_request("r", prompt, params)
    steps, final = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
        steps += 1
        engine.check_integrity()
    return final.outputs[0], steps


def test_forced_text_is_appended_without_sampling(tiny_model_factory):
    path = tiny_model_factory("llama")
    params = SamplingParams(temperature=0, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(choice=[CHOICE, "No"]))
    on = LLM(model=str(path), num_kv_blocks=64)
    off = LLM(model=str(path), num_kv_blocks=64, grammar_fast_forward=False)
    out_on, steps_on = _steps(on, "Say it:", params)
    out_off, steps_off = _steps(off, "Say it:", params)
    assert out_off.text == CHOICE  # the tiny model picks the sentence; after its first token all is forced
    assert out_on.text == CHOICE and steps_on <= 3 < steps_off
    assert on.engine.stats()["grammar_fast_forward_tokens"] >= len(out_on.token_ids) - 2
    assert out_on.text == out_off.text and out_on.finish_reason == out_off.finish_reason == "stop"
    assert off.engine.stats()["grammar_fast_forward_tokens"] == 0


def test_a_json_schema_forces_its_keys_and_stays_valid(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = LLM(model=str(path), num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out, steps = _steps(llm, "A person as JSON:", params)
    value = json.loads(out.text)
    assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)
    forced = llm.engine.stats()["grammar_fast_forward_tokens"]
    assert forced >= 3  # at least the keys after the first: `"age": ` and `"city": ` need no sampling
    assert steps <= len(out.token_ids) - forced + 2  # forced tokens took no step of their own
    assert llm.kv_cache_usage()["num_in_use"] == 0


def test_drafts_under_a_grammar_are_cut_to_what_it_accepts_and_masked_per_position(tiny_model_factory):
    """Speculation with structured outputs: drafts are validated by the grammar, each verified position is
    masked by the grammar's state after the drafts before it, and the output is exactly that of decoding
    without speculation (fast-forward off on both sides, so tokens line up one for one)."""
    path = tiny_model_factory("llama", tie_word_embeddings=True, init_std=0.1)  # half copies its context
    regex = r"(red|green|blue)( (red|green|blue)){10,30}"
    params = SamplingParams(temperature=0, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    prompt = "red green blue red green blue red green blue red green"
    plain = LLM(model=str(path), num_kv_blocks=128, grammar_fast_forward=False)
    spec = LLM(model=str(path), num_kv_blocks=128, grammar_fast_forward=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    a, _ = _steps(plain, prompt, params)
    b, steps = _steps(spec, prompt, params)
    assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
    stats = spec.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert steps < len(b.token_ids)

"""Constrained outputs end cleanly (engine/json_schemas.py, engine/grammar_budget.py,
engine/repeated_blocks.py): on a tiny random-weight model, whose garbage runs strings and digits as
long as the grammar lets it, JSON outputs parse at every max_tokens that can hold the schema's
shortest value, numbers stay bounded, and forced tool calls report only complete calls; on the real
SmolLM2, the reported repeat-the-same-call loop ends with one call and finish_reason "tool_calls"."""
from __future__ import annotations

import json
import re

import pytest
from fixtures.json_schemas import validate

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.json_schemas import SAFE_INTEGER, bound_json_numbers
from engine.repeated_blocks import RepeatedBlocks
from engine.tool_calls import CALL_OPEN, ToolChat

CITY = {  # what clients send: nothing bounds the integer, the strings or the array
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "population": {"type": "integer"},
        "area_km2": {"type": "number"},
        "districts": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "population", "area_km2"],
}
SHORTEST_CITY = '{"city": "", "population": 0, "area_km2": 0}'
WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=512, max_num_seqs=16, max_model_len=1024)


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _check_numbers(text: str, value) -> None:
    for number in _numbers(value):
        assert abs(number) <= SAFE_INTEGER, text
    for fraction in re.findall(r"(?<![\w\"])-?\d+\.(\d+)", text):
        assert len(fraction) <= 9, text


# -- JSON: response_format / structured_outputs / guided_json share this path --------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11, "n": 4}])
def test_json_schema_parses_at_small_max_tokens(llm, sampling):
    shortest = len(llm.get_tokenizer()(SHORTEST_CITY, add_special_tokens=False).input_ids)
    for max_tokens in (shortest + 2, 24, 32, 48, 96):
        params = SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=CITY),
                                **sampling)
        [out] = llm.generate("Describe a city as JSON:", params, use_tqdm=False)
        for c in out.outputs:
            assert c.finish_reason == "stop" and len(c.token_ids) <= max_tokens, (max_tokens, c.text)
            value = json.loads(c.text)
            validate(value, CITY)
            _check_numbers(c.text, value)


def test_json_object_parses_at_small_max_tokens(llm):
    for max_tokens in (8, 16, 40):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3, n=4,
                                structured_outputs=StructuredOutputsParams(json_object=True))
        [out] = llm.generate("Any JSON object:", params, use_tqdm=False)
        for c in out.outputs:
            assert c.finish_reason == "stop", (max_tokens, c.text)
            value = json.loads(c.text)
            assert isinstance(value, dict)
            _check_numbers(c.text, value)


def test_bound_json_numbers_keeps_what_the_schema_says():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "age": {"type": "integer", "minimum": 0},
        "big": {"type": "integer", "minimum": 10**20}, "step": {"type": "number", "multipleOf": 0.5},
        "s": {"type": "string"}}, "$defs": {"d": {"type": "number", "exclusiveMaximum": 1}}}
    bounded = bound_json_numbers(schema)
    props = bounded["properties"]
    assert props["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert props["x"] == {"type": ["number", "null"], "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER,
                          "multipleOf": 1e-9}
    assert props["age"] == {"type": "integer", "minimum": 0, "maximum": SAFE_INTEGER}
    assert props["big"] == {"type": "integer", "minimum": 10**20}  # a bound would contradict it
    assert props["step"]["multipleOf"] == 0.5 and props["s"] == {"type": "string"}
    assert bounded["$defs"]["d"] == {"type": "number", "exclusiveMaximum": 1, "minimum": -SAFE_INTEGER,
                                     "multipleOf": 1e-9}
    assert schema["properties"]["n"] == {"type": "integer"}  # the input is not modified


# -- tool calls ------------------------------------------------------------------------------------
def _forced_calls(llm, max_tokens: int, **sampling):
    prepared = ToolChat(llm.get_tokenizer()).prepare(PARIS, WEATHER_TOOLS, "required")  # parallel: default
    params = prepared.apply(SamplingParams(max_tokens=max_tokens, **sampling))
    [out] = llm.generate({"prompt_token_ids": prepared.prompt_token_ids}, params, use_tqdm=False)
    return [(prepared.parse(c.text), c) for c in out.outputs]


def test_forced_parallel_calls_report_only_complete_calls(llm):
    reasons = set()
    for max_tokens in (6, 12, 20, 30, 45, 80):
        for message, c in _forced_calls(llm, max_tokens, temperature=1.0, seed=max_tokens, n=4):
            reason = message.finish_reason(c.finish_reason)
            reasons.add(reason)
            assert CALL_OPEN not in (message.content or ""), c.text
            if message.tool_calls:
                assert reason == "tool_calls" and not message.content, c.text
                for call in message.tool_calls:
                    arguments = json.loads(call.arguments)
                    validate(arguments, WEATHER_TOOLS[0]["function"]["parameters"])
                    _check_numbers(call.arguments, arguments)
                assert len({(t.name, t.arguments) for t in message.tool_calls}) == len(message.tool_calls)
            else:  # max_tokens too small for one call: nothing half-written is shown
                assert reason == "length" and message.content == "", c.text
    assert reasons == {"length", "tool_calls"}


def test_repeated_block_ends_only_on_an_exact_repeat():
    check = RepeatedBlocks(("<b>", "</b>"))
    feed = ["x<b>1", "</b>", "<b>2</b>", "<b>1</b", ">"]
    assert [check.repeated(p.encode(), grammar_complete=True) for p in feed] == [False, False, False, False, True]
    # A closing marker inside an incomplete grammar (a JSON string) does not end a block.
    check = RepeatedBlocks(("<b>", "</b>"))
    assert not check.repeated(b"<b>a</b>", grammar_complete=False)
    assert not check.repeated(b"</b>", grammar_complete=True)
    assert not check.repeated(b"<b>a</b>", grammar_complete=True)


# -- the reported case, on the real model -------------------------------------------------------------
@pytest.fixture(scope="module")
def real_llm(smollm2_path):
    return LLM(model=str(smollm2_path), num_kv_blocks=256, max_num_seqs=4, max_model_len=2048)


@pytest.mark.real_model
@pytest.mark.parametrize("max_tokens", [200, 45])
def test_real_model_repeated_call_ends_with_one_call(real_llm, max_tokens):
    """SmolLM2 writes get_weather(Paris) again and again under tool_choice "required" with parallel
    calls: the repeat ends the output (200), or max_tokens cuts the second copy, which is dropped (45)."""
    [(message, c)] = _forced_calls(real_llm, max_tokens, temperature=0.0)
    assert message.finish_reason(c.finish_reason) == "tool_calls", c.text
    assert not message.content and CALL_OPEN not in (message.content or "")
    [call] = message.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    if max_tokens == 200:
        assert c.finish_reason == "stop" and len(c.token_ids) < 100, c.text


def test_repeated_block_markers_are_validated():
    from engine import InvalidRequestError

    for markers in (("<b>",), ("<b>", ""), ["<b>", "</b>"]):
        with pytest.raises(InvalidRequestError) as info:
            StructuredOutputsParams(grammar='start: "a"', stop_on_repeated_block=markers)
        assert info.value.param == "structured_outputs"

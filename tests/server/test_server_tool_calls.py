"""Tool calling over /v1/chat/completions with the official openai client: tools, tool_choice
(none / auto / required / a named tool), parallel_tool_calls, tool-call and tool-result messages,
non-streaming and streaming (reassembled by the client's own stream helper), n>1, errors; then the
real SmolLM2 model: a forced call with usable arguments and a conversation continuing from a result."""
from __future__ import annotations

import json

import openai
import pytest
from fixtures.json_schemas import validate

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "description": "Check the connection"}},
]
SCHEMAS = {"get_weather": WEATHER, "ping": {"type": "object", "properties": {}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def _check_call(call, names=tuple(SCHEMAS)) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_named_tool_is_called_with_valid_arguments(oai, idle_engine):
    out = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=NAMED,
                                      max_tokens=200, temperature=0)
    [choice] = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.role == "assistant"
    [call] = choice.message.tool_calls
    _check_call(call, ["get_weather"])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_with_n_samples(oai, idle_engine, parallel):
    out = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=3,
                                      parallel_tool_calls=parallel, max_tokens=200, temperature=1.0, seed=11)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        if not parallel:
            assert len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            _check_call(call)
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_none_and_auto_answer_in_text_or_valid_calls(oai, idle_engine):
    none = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)
    assert none.choices[0].finish_reason in ("stop", "length")
    auto = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=30, temperature=1.0,
                                       seed=2, n=4)
    for choice in auto.choices:
        for call in choice.message.tool_calls or []:
            _check_call(call)
        assert choice.finish_reason == ("tool_calls" if choice.message.tool_calls else choice.finish_reason)


def test_stream_reassembles_with_the_client_helper(oai, idle_engine):
    with oai.chat.completions.stream(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=2,
                                     max_tokens=200, temperature=1.0, seed=5) as stream:
        final = stream.get_final_completion()
    whole = oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=2,
                                        max_tokens=200, temperature=1.0, seed=5)
    assert len(final.choices) == 2
    for streamed, plain in zip(sorted(final.choices, key=lambda c: c.index), whole.choices):
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in plain.message.tool_calls]
        for call in streamed.message.tool_calls:
            _check_call(call)


def test_stream_chunks_have_openai_shape(oai, idle_engine):
    chunks = list(oai.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=NAMED,
                                              max_tokens=200, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    [[call]] = deltas  # one whole call in one delta
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    validate(json.loads(call.function.arguments), WEATHER)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_conversation_with_tool_results(oai, client, idle_engine):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}},
            {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "pong"},
    ]
    out = oai.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # /tokenize renders tools, calls and results exactly as the chat endpoint did.
    tokenized = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokenized["count"] == out.usage.prompt_tokens
    text = client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<|im_start|>tool\npong<|im_end|>" in text


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "tool_choice"),
])
def test_bad_tool_requests_are_400(oai, idle_engine, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=USER, max_tokens=3, **kwargs)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_bad_tool_call_message_is_400(client, idle_engine):
    messages = USER + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "f"}]}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[1].tool_calls[0]"


# -- the real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_oai(smollm2_path):
    from litestar.testing import TestClient
    from server_testlib import shutdown_engine

    from app.server import create_app
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(smollm2_path), num_kv_blocks=128, block_size=16,
                                                  max_num_seqs=4, max_model_len=2048))
    engine.start()
    try:
        with TestClient(create_app(engine, served_model_names=["smollm2"]), timeout=120) as test_client:
            yield openai.OpenAI(base_url=f"{test_client.base_url}/v1", api_key="x", http_client=test_client,
                                max_retries=0)
    finally:
        shutdown_engine(engine)


REAL_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]


@pytest.mark.real_model
def test_real_model_forced_call_then_answer_from_result(real_oai):
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    first = real_oai.chat.completions.create(model="smollm2", messages=messages, tools=REAL_TOOLS,
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                             temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert set(arguments) <= {"city", "unit"} and isinstance(arguments["city"], str) and arguments["city"]
    assert arguments.get("unit") in (None, "celsius", "fahrenheit")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    second = real_oai.chat.completions.create(model="smollm2", messages=messages, tools=REAL_TOOLS,
                                              tool_choice="none", max_tokens=40, temperature=0)
    answer = second.choices[0].message
    assert answer.tool_calls is None and answer.content and second.choices[0].finish_reason in ("stop", "length")
    # The second turn's prompt starts with the first one's: the prefix cache serves it.
    assert second.usage.prompt_tokens_details.cached_tokens >= 16

"""Constrained outputs end cleanly over HTTP, through the official openai client on a real uvicorn
(127.0.0.1): response_format json_schema with an unbounded integer parses at small max_tokens (tiny
random model, chat and completions), and the real SmolLM2's repeat-the-same-call loop under
tool_choice "required" comes back as one complete call with finish_reason "tool_calls"."""
from __future__ import annotations

import json

import openai
import pytest
from fixtures.json_schemas import validate
from server_testlib import run_uvicorn, shutdown_engine, wait_for_idle

from app.server import create_app

POPULATION = {  # the reported schema: nothing bounds the integer or the string
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "population", "schema": POPULATION}}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_client(tiny_app, tiny_engine):
    with run_uvicorn(tiny_app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    wait_for_idle(tiny_engine)


@pytest.mark.parametrize("max_tokens", [20, 32, 64])
def test_json_schema_with_unbounded_integer_parses(tiny_client, max_tokens):
    chat = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Population of Paris as JSON."}], n=3, seed=max_tokens,
        temperature=1.0, max_tokens=max_tokens, response_format=RESPONSE_FORMAT)
    completion = tiny_client.completions.create(
        model="tiny", prompt="Population of Paris as JSON:", n=3, seed=max_tokens, temperature=1.0,
        max_tokens=max_tokens, extra_body={"response_format": RESPONSE_FORMAT})
    texts = [(c.message.content, c.finish_reason) for c in chat.choices]
    texts += [(c.text, c.finish_reason) for c in completion.choices]
    for text, reason in texts:
        assert reason == "stop", text
        answer = json.loads(text)
        validate(answer, POPULATION)
        assert abs(answer["population"]) < 2**53, text


# -- the real model: the reported repeat-the-same-call loop ------------------------------------------
@pytest.fixture(scope="module")
def real_client(smollm2_path):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(smollm2_path), num_kv_blocks=256, block_size=16,
                                                  max_num_seqs=4, max_model_len=2048))
    engine.start()
    try:
        with run_uvicorn(create_app(engine, served_model_names=["smollm2"])) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    finally:
        shutdown_engine(engine)


@pytest.mark.real_model
def test_required_tool_choice_returns_the_complete_call(real_client):
    out = real_client.chat.completions.create(model="smollm2", messages=PARIS, tools=WEATHER, tool_choice="required",
                                              max_tokens=200, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert out.usage.completion_tokens < 100  # the repeat ended it, not max_tokens

    # Streamed, with max_tokens cutting the second copy off: it is dropped, the first call stands.
    stream = real_client.chat.completions.create(model="smollm2", messages=PARIS, tools=WEATHER,
                                                 tool_choice="required", max_tokens=45, temperature=0, stream=True)
    content, calls, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and content == ""
    [call] = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

"""The Anthropic Messages API through the real `anthropic` SDK over real HTTP: create, stream,
count_tokens, a tool-use round trip, and Anthropic's error shapes and x-api-key auth."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from app.server import create_app
from server_testlib import run_uvicorn, wait_for_idle

TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                           "required": ["city"]}}]


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    with run_uvicorn(create_app(tiny_engine, served_model_names=["tiny"], api_key="sk-test")) as url:
        yield url


@pytest.fixture
def client(base_url, idle_engine):
    return anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)


def test_create_answers_in_anthropic_shape_with_cache_usage(client, tiny_engine):
    system = "You answer questions about hardware. " * 8
    first = client.messages.create(model="tiny", max_tokens=8, system=system, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Do you sell hammers?"}])
    assert first.type == "message" and first.role == "assistant" and first.model == "tiny"
    assert first.content[0].type == "text" and first.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= first.usage.output_tokens <= 8 and first.id.startswith("msg_")
    count = client.messages.count_tokens(model="tiny", system=system,
                                         messages=[{"role": "user", "content": "Do you sell hammers?"}])
    assert count.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    again = client.messages.create(model="tiny", max_tokens=4, system=system, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Do you sell nails?"}])
    assert again.usage.cache_read_input_tokens >= 48  # the system prompt, from the prefix cache
    assert again.usage.cache_creation_input_tokens == 0


def test_stream_sends_anthropics_events_and_the_same_text(client):
    kwargs = dict(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Count: one two"}])
    whole = client.messages.create(**kwargs)
    kinds = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_use_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.messages.create(model="tiny", max_tokens=60, extra_body={"temperature": 0}, tools=TOOLS,
                                   tool_choice={"type": "any"}, messages=messages)
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input.get("city"), str)
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}]}]
    final = client.messages.create(model="tiny", max_tokens=6, extra_body={"temperature": 0}, tools=TOOLS, messages=messages,
                                   tool_choice={"type": "none"})
    assert final.content and final.content[0].type == "text"
    with client.messages.stream(model="tiny", max_tokens=60, extra_body={"temperature": 0}, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=messages[:1]) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].type == "tool_use"


def test_errors_come_in_anthropics_shape(client, base_url):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "robot", "content": "hi"}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "role" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(f"{base_url}/v1/messages", headers={"x-api-key": "sk-test"},
                     json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raw.json()["error"]["message"]
    # The OpenAI routes keep OpenAI's shape, with the same key as a bearer token.
    raw = httpx.post(f"{base_url}/v1/chat/completions", headers={"Authorization": "Bearer sk-test"},
                     json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert raw.status_code == 404 and "message" in raw.json()["error"] and "type" in raw.json()["error"]

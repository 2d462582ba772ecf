"""LangChain's ChatAnthropic (langchain-anthropic) pointed at a real server on 127.0.0.1 (issue 39): invoke and
ainvoke, stream, token counting, a tool-call round trip through bind_tools (created and streamed), and
usage_metadata's input_token_details after a cache_control breakpoint is sent twice."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from app.server import create_app
from server_testlib import run_uvicorn

SYSTEM = "You keep the inventory of a garden centre: seeds, soil, pots and tools. Answer in one line. " * 5


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "Sunny"


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    with run_uvicorn(create_app(tiny_engine, served_model_names=["tiny"], api_key="sk-test")) as url:
        yield url


@pytest.fixture
def chat(base_url, idle_engine) -> ChatAnthropic:
    return ChatAnthropic(model="tiny", base_url=base_url, api_key="sk-test", max_tokens=8, temperature=0,
                         max_retries=0)


def test_invoke_ainvoke_and_stream_agree(chat):
    reply = chat.invoke("Count: one two")
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    meta = reply.response_metadata
    assert meta["model_name"] == "tiny" and meta["model_provider"] == "anthropic"
    assert meta["stop_reason"] in ("max_tokens", "end_turn") and meta["id"].startswith("msg_")
    usage = reply.usage_metadata
    assert 1 <= usage["output_tokens"] <= 8 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] == chat.get_num_tokens_from_messages([HumanMessage("Count: one two")])

    chunks = list(chat.stream("Count: one two"))
    assert len(chunks) > 2
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.content == reply.content  # greedy: the same text, streamed
    assert whole.usage_metadata["output_tokens"] == usage["output_tokens"]
    assert whole.usage_metadata["input_tokens"] == usage["input_tokens"]  # usage arrives once, not per chunk

    again = asyncio.run(chat.ainvoke("Count: one two"))
    assert again.content == reply.content


def test_a_tool_call_round_trip_through_bind_tools(chat):
    tooled = chat.bind_tools([get_weather], tool_choice="any")
    question = HumanMessage("What is the weather in Paris?")
    call = tooled.invoke([question], max_tokens=60)
    assert call.response_metadata["stop_reason"] == "tool_use"
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and isinstance(tool_call["args"]["city"], str)
    assert tool_call["id"].startswith("toolu_")

    result = ToolMessage(content=get_weather.invoke(tool_call["args"]), tool_call_id=tool_call["id"])
    answer = chat.bind_tools([get_weather], tool_choice={"type": "none"}).invoke([question, call, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    assert answer.response_metadata["stop_reason"] in ("max_tokens", "end_turn")

    streamed = None
    for chunk in chat.bind_tools([get_weather], tool_choice="get_weather").stream([question], max_tokens=60):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    assert isinstance(streamed.tool_calls[0]["args"]["city"], str)


def test_cache_control_breakpoint_reports_creation_then_read(chat, base_url):
    r = httpx.post(f"{base_url}/reset_prefix_cache", headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 200, r.text
    system = SystemMessage(content=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}])
    first = chat.invoke([system, HumanMessage("Do you sell terracotta pots?")])
    details = first.usage_metadata["input_token_details"]
    assert details["cache_creation"] >= 64 and details["cache_read"] == 0
    assert first.usage_metadata["input_tokens"] == chat.get_num_tokens_from_messages(
        [system, HumanMessage("Do you sell terracotta pots?")])  # LangChain's input_tokens: every prompt token

    second = chat.invoke([system, HumanMessage("Do you sell tomato seeds?")])
    again = second.usage_metadata["input_token_details"]
    assert again["cache_read"] >= details["cache_creation"] and again["cache_creation"] == 0

    streamed = None
    for chunk in chat.stream([system, HumanMessage("And compost?")]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.usage_metadata["input_token_details"]["cache_read"] >= details["cache_creation"]
    assert streamed.usage_metadata["input_token_details"]["cache_creation"] == 0

"""/v1/responses end to end on the real SmolLM2-135M-Instruct behind a real uvicorn (the session's shared
LangChain server): the openai client (answers, previous_response_id, a forced call and its result,
streaming), LangChain's own `ChatOpenAI(use_responses_api=True)`: invoke, stream, cache hits, and
bind_tools with a tool-call round trip, and the OpenAI Agents SDK running a tool and streaming an answer."""
from __future__ import annotations

import json

import openai
import pytest
from langchain_testlib import SERVED_NAMES, wait_idle

pytestmark = pytest.mark.real_model

MODEL = SERVED_NAMES[0]
GEOGRAPHY = "You are a concise geography assistant. Answer in one short sentence."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                               "required": ["city"]}, "strict": True}


@pytest.fixture
def oai(lc_server_url, lc_engine):
    wait_idle(lc_engine)
    yield openai.OpenAI(base_url=lc_server_url, api_key="unused", max_retries=0)
    wait_idle(lc_engine)


def test_answers_and_continues_with_previous_response_id(oai):
    first = oai.responses.create(model=MODEL, instructions=GEOGRAPHY, input="What is the capital of France?",
                                 max_output_tokens=16, temperature=0)
    assert first.status == "completed" and "Paris" in first.output_text
    second = oai.responses.create(model=MODEL, instructions=GEOGRAPHY, previous_response_id=first.id,
                                  input="What is the capital of Italy?", max_output_tokens=16, temperature=0)
    assert "Rome" in second.output_text
    # The whole first turn is the new prompt's prefix: served from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_streamed_answer_matches_the_whole_one(oai):
    kwargs = {"model": MODEL, "instructions": GEOGRAPHY, "input": "What is the capital of Spain?",
              "max_output_tokens": 16, "temperature": 0}
    with oai.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "Madrid" in final.output_text
    assert "".join(deltas) == final.output_text == oai.responses.create(**kwargs).output_text


def test_forced_call_then_answer_from_its_output(oai):
    question = "What is the weather in Paris?"
    first = oai.responses.create(model=MODEL, input=question, tools=[WEATHER_TOOL], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and "Paris" in json.loads(call.arguments)["city"]
    result = "It is 18 degrees and sunny in Paris."
    # "none": the tools stay in the prompt (the cached prefix is the same), the answer is text.
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL], tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
                                  max_output_tokens=32, temperature=0)
    assert not [i for i in second.output if i.type == "function_call"] and second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    # Exactly the conversation /v1/chat/completions sees with the call and its result in the history.
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    chat = oai.chat.completions.create(model=MODEL, tools=[chat_tool], tool_choice="none", max_tokens=32,
                                       temperature=0, messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


# -- LangChain's ChatOpenAI over the Responses API -------------------------------------------------
@pytest.fixture
def chat(oai, lc_server_url):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=lc_server_url, api_key="unused", model=MODEL, use_responses_api=True,
                      temperature=0, max_tokens=48, max_retries=0)


def test_langchain_invoke_and_cache_read(chat):
    from langchain_core.messages import HumanMessage, SystemMessage

    first = chat.invoke([SystemMessage(GEOGRAPHY), HumanMessage("What is the capital of France?")])
    assert "Paris" in first.text
    assert first.response_metadata["model_name"] == MODEL and first.response_metadata["status"] == "completed"
    second = chat.invoke([SystemMessage(GEOGRAPHY), HumanMessage("What is the capital of Germany?")])
    assert "Berlin" in second.text
    usage = second.usage_metadata
    assert usage["output_tokens"] > 0 and usage["input_token_details"]["cache_read"] > 0


def test_langchain_stream(chat):
    from langchain_core.messages import HumanMessage, SystemMessage

    messages = [SystemMessage(GEOGRAPHY), HumanMessage("What is the capital of Spain?")]
    chunks = list(chat.stream(messages))
    assert len(chunks) > 2
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.text == chat.invoke(messages).text and "Madrid" in whole.text
    assert whole.usage_metadata["output_tokens"] > 0


def test_langchain_bind_tools_round_trip(chat):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"It is 18 degrees and sunny in {city}."

    messages = [HumanMessage("What is the weather in Paris?")]
    reply = chat.bind_tools([get_weather], tool_choice="any").invoke(messages)
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and "Paris" in call["args"]["city"]
    assert call["id"].startswith("call_")
    messages += [reply, get_weather.invoke(call)]  # the AIMessage (function_call item) and a ToolMessage
    answer = chat.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert not answer.tool_calls and answer.text
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0
    # The same history over /v1/chat/completions (LangChain's other wire format): the same prompt and text.
    plain = ChatOpenAI(base_url=chat.openai_api_base, api_key="unused", model=MODEL, temperature=0, max_tokens=48,
                       max_retries=0).bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert answer.usage_metadata["input_tokens"] == plain.usage_metadata["input_tokens"]
    assert answer.text == plain.text


# -- the OpenAI Agents SDK (its OpenAIResponsesModel streams every turn) ---------------------------
def test_agents_sdk_runs_a_tool_and_answers(oai, lc_server_url):
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    def model() -> OpenAIResponsesModel:
        return OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=lc_server_url,
                                                                                  api_key="unused", max_retries=0))

    # A 135M model keeps calling tools under "auto": stop at the first tool result, which is then the answer.
    weather = Agent(name="weather", instructions="Answer weather questions with the tool.", model=model(),
                    model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required",
                                                 parallel_tool_calls=False),
                    tools=[get_weather], tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(weather, "What is the weather in Paris?", max_turns=2))
    assert calls and "Paris" in calls[0] and result.final_output == f"It is 18 degrees and sunny in {calls[0]}."

    geography = Agent(name="geography", instructions=GEOGRAPHY, model=model(),
                      model_settings=ModelSettings(temperature=0, max_tokens=24))

    async def streamed() -> tuple[list[str], str]:
        run = Runner.run_streamed(geography, "What is the capital of France?", max_turns=1)
        kinds = [event.data.type async for event in run.stream_events() if event.type == "raw_response_event"]
        return kinds, run.final_output

    kinds, answer = asyncio.run(streamed())
    assert "Paris" in answer and kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds

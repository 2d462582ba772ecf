"""POST /v1/responses (OpenAI's Responses API) against a real uvicorn on 127.0.0.1, with the official
openai client's `responses.create` / `responses.stream` / `responses.retrieve`: text and message input,
instructions, max_output_tokens -> incomplete, text.format (json_schema, json_object), function tools
with every tool_choice and a function_call_output round trip, previous_response_id and the store,
streaming events and their order, cached-token usage, and the 400s / 404s. Tiny random model: shapes,
not answers (the real model: tests/integrations/test_responses_real_model.py)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from fixtures.json_schemas import validate
from server_testlib import run_uvicorn

from app.server import create_app

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather forecast for a city", "parameters": WEATHER,
     "strict": True},
    {"type": "function", "name": "ping", "description": "Check the connection", "parameters": None, "strict": False},
]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer",
        "minimum": 1, "maximum": 9}}, "required": ["city", "rank"], "additionalProperties": False}


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    app = create_app(tiny_engine, served_model_names=["tiny"], max_stored_responses=4)
    with run_uvicorn(app) as url:
        yield url


@pytest.fixture
def oai(base_url, idle_engine):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _text_items(response) -> list:
    return [item for item in response.output if item.type == "message"]


# -- plain text ------------------------------------------------------------------------------
def test_text_input_has_openai_shape(oai):
    out = oai.responses.create(model="tiny", input="Tell me a story", max_output_tokens=200, temperature=0)
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "tiny"
    assert out.status in ("completed", "incomplete") and isinstance(out.created_at, (int, float))
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert out.output_text == part.text  # the client's convenience joins the output_text parts
    usage = out.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens >= 0


def test_messages_and_instructions_render_like_chat(oai, base_url):
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    out = oai.responses.create(model="tiny", input=messages, instructions="Answer briefly.", max_output_tokens=3,
                               temperature=0)
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color."}]
    tokenized = httpx.post(f"{base_url}/tokenize", json={"messages": chat}).json()
    assert out.usage.input_tokens == tokenized["count"]
    same = oai.chat.completions.create(model="tiny", messages=chat, max_tokens=3, temperature=0)
    assert out.output_text == same.choices[0].message.content
    assert out.instructions == "Answer briefly."


def test_max_output_tokens_makes_it_incomplete(oai):
    out = oai.responses.create(model="tiny", input="Count to one hundred", max_output_tokens=2, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2 and out.max_output_tokens == 2
    assert out.output[0].status == "incomplete"


def test_repeated_prefix_reports_cached_tokens(oai):
    prompt = "A long shared system prompt about shipping policies. " * 6
    oai.responses.create(model="tiny", instructions=prompt, input="First question?", max_output_tokens=2)
    second = oai.responses.create(model="tiny", instructions=prompt, input="Second question?", max_output_tokens=2)
    assert second.usage.input_tokens_details.cached_tokens >= 32


# -- structured output -----------------------------------------------------------------------
def test_json_schema_text_format_parses(oai):
    out = oai.responses.create(model="tiny", input="A city as JSON", max_output_tokens=60, temperature=0,
                               text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                "strict": True}})
    assert out.status == "completed"
    validate(json.loads(out.output_text), CITY)
    assert out.text.format.type == "json_schema" and out.text.format.name == "city"


def test_json_object_text_format(oai):
    out = oai.responses.create(model="tiny", input="JSON please", max_output_tokens=60, temperature=0,
                               text={"format": {"type": "json_object"}}, extra_body={"seed": 3})
    if out.status == "completed":  # a random model may fill an object until the limit
        assert isinstance(json.loads(out.output_text), dict)
    assert out.output_text.lstrip().startswith("{")


# -- tools ----------------------------------------------------------------------------------
def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_choice_returns_a_function_call(oai, choice):
    out = oai.responses.create(model="tiny", input="Weather in Paris for 3 days?", tools=TOOLS, tool_choice=choice,
                               parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    assert out.status == "completed" and not _text_items(out)
    [call] = _calls(out)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert call.name in ("get_weather", "ping")
    if call.name == "get_weather":
        validate(json.loads(call.arguments), WEATHER)
    assert out.tools[0].name == "get_weather" and out.parallel_tool_calls is False


def test_tool_choice_none_answers_in_text(oai):
    out = oai.responses.create(model="tiny", input="Weather?", tools=TOOLS, tool_choice="none",
                               max_output_tokens=5, temperature=0)
    assert not _calls(out) and _text_items(out)


def test_function_call_output_round_trip(oai):
    first = oai.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120,
                                 temperature=0, store=False)
    [call] = _calls(first)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    second = oai.responses.create(model="tiny", input=history, tools=TOOLS, tool_choice="none",
                                  max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > first.usage.input_tokens and _text_items(second)
    # The same turn continued from the stored first response instead of resent: the same prompt.
    stored = oai.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120,
                                  temperature=0)
    [again] = _calls(stored)
    follow = oai.responses.create(model="tiny", previous_response_id=stored.id, tools=TOOLS, tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": again.call_id,
                                          "output": "18 C and sunny"}], max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens == second.usage.input_tokens
    assert follow.output_text == second.output_text


# -- previous_response_id and the store ---------------------------------------------------------
def test_previous_response_id_continues_the_conversation(oai):
    first = oai.responses.create(model="tiny", input="My name is Ada.", instructions="Be brief.",
                                 max_output_tokens=4, temperature=0)
    assert first.store is True
    second = oai.responses.create(model="tiny", previous_response_id=first.id, input="What is my name?",
                                  max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    resent = oai.responses.create(model="tiny", input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], max_output_tokens=4, temperature=0)
    # Instructions are not carried over (as on OpenAI); the rest is the same prompt, mostly cached.
    assert second.usage.input_tokens == resent.usage.input_tokens
    assert second.output_text == resent.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert oai.responses.retrieve(second.id).output_text == second.output_text


def test_unknown_previous_response_id_is_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.create(model="tiny", previous_response_id="resp_missing", input="Hi", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id" and "resp_missing" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_missing")


def test_store_false_cannot_be_continued(oai):
    out = oai.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="tiny", previous_response_id=out.id, input="Again", max_output_tokens=2)


def test_store_is_a_bounded_lru(oai):
    ids = [oai.responses.create(model="tiny", input=f"Hi {i}", max_output_tokens=1).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):  # capacity 4: the oldest went
        oai.responses.retrieve(ids[0])
    assert [oai.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    assert oai.responses.delete(ids[1]) is None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(ids[1])


# -- streaming ------------------------------------------------------------------------------
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def test_stream_events_in_order_and_deltas_make_the_text(oai):
    with oai.responses.stream(model="tiny", input="Tell me a story", max_output_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True}) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    # Cut off by max_output_tokens: the last event is response.incomplete (as on OpenAI), not completed.
    assert collapsed == TEXT_EVENTS[:-1] + ["response.incomplete"]
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = oai.responses.create(model="tiny", input="Tell me a story", max_output_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert deltas == whole.output_text == final.output[0].content[0].text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas and final.usage.output_tokens == 12


def test_stream_completes_with_the_final_response(oai):
    # A bounded JSON schema makes even the random model finish (stop) well before the limit.
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    with oai.responses.stream(model="tiny", input="A city as JSON", text=fmt, max_output_tokens=60,
                              temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == TEXT_EVENTS
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    validate(json.loads(final.output_text), CITY)
    assert final.usage.output_tokens > 0 and oai.responses.retrieve(final.id).output_text == final.output_text


def test_stream_function_call_events(oai):
    with oai.responses.stream(model="tiny", input="Weather in Rome?", tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=120, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    [call] = _calls(final)
    assert events[4].arguments == call.arguments and json.loads(call.arguments) is not None
    assert events[2].item.type == "function_call" and events[2].item.call_id == call.call_id


def test_dropped_stream_aborts_and_is_not_stored(base_url, idle_engine):
    body = {"model": "tiny", "input": "Tell me everything " * 10, "max_output_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        response_id = json.loads(first[6:])["response"]["id"]
    # Leaving the block closed the connection: the run is aborted (idle_engine checks every block is
    # free afterwards) and the unfinished response was never stored.
    assert httpx.get(f"{base_url}/v1/responses/{response_id}").status_code == 404


# -- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"input": []}, "input"),
    ({"truncation": "auto"}, "truncation"),
])
def test_bad_requests_are_400_naming_the_field(base_url, idle_engine, fields, param):
    body = {"model": "tiny", "input": "Hi", **fields}
    response = httpx.post(f"{base_url}/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_reasoning_effort_is_ignored_and_openai_client_sees_bad_request(oai):
    out = oai.responses.create(model="tiny", input="Hi", max_output_tokens=1, reasoning={"effort": "low"})
    assert out.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="tiny", input="Hi", tools=[{"type": "file_search", "vector_store_ids": ["x"]}])


# -- the store and its flag, directly ----------------------------------------------------------
def test_response_store_bounds_and_flag():
    from app.cli import build_parser
    from app.responses_protocol import ResponseObject
    from app.responses_store import ResponseStore

    with pytest.raises(ValueError):
        ResponseStore(-1)
    none = ResponseStore(0)
    none.put(ResponseObject(id="resp_a", created_at=0, model="m", status="completed", output=[]), [])
    assert len(none) == 0 and none.get("resp_a") is None
    store = ResponseStore(2)
    for name in "abc":
        store.put(ResponseObject(id=f"resp_{name}", created_at=0, model="m", status="completed", output=[]),
                  [{"role": "user", "content": name}])
        store.get("resp_a")  # recently used: kept over b
    assert store.get("resp_b") is None and store.get("resp_a").messages == ({"role": "user", "content": "a"},)
    args = build_parser().parse_args(["serve", "--max-stored-responses", "8"])
    assert args.max_stored_responses == 8
    assert build_parser().parse_args(["serve"]).max_stored_responses == 1024

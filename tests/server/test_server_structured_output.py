"""Structured outputs over HTTP: OpenAI's response_format, vLLM's structured_outputs and guided_*
fields, their 400s, and (real model) a json_schema chat through the official openai client."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from fixtures.json_schemas import validate
from server_testlib import run_uvicorn, shutdown_engine, wait_for_idle, wait_until

from app.server import create_app

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "Describe a city as JSON."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
        "capital": {"type": "boolean"},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "population", "capital", "districts"],
    "additionalProperties": False,
}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


# -- tiny random model: valid whatever the weights ---------------------------------------------
@pytest.mark.usefixtures("idle_engine")
class TestTinyModel:
    def test_response_format_json_schema(self, oai):
        out = oai.chat.completions.create(model="tiny", messages=USER, response_format=_json_schema(CITY),
                                          max_tokens=300, temperature=1.0, seed=3, n=3)
        assert len(out.choices) == 3
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            validate(json.loads(choice.message.content), CITY)

    def test_response_format_json_object(self, oai, tiny_engine):
        tok = tiny_engine.engine.tokenizer
        closers = {str(tok.convert_tokens_to_ids(t)): 100 for t in ('"', "}", "]")}  # see the engine test
        out = oai.chat.completions.create(model="tiny", messages=USER, response_format={"type": "json_object"},
                                          logit_bias=closers, max_tokens=200, temperature=0)
        assert isinstance(json.loads(out.choices[0].message.content), dict)

    def test_response_format_text_is_unconstrained(self, oai):
        out = oai.chat.completions.create(model="tiny", messages=USER, response_format={"type": "text"},
                                          max_tokens=8, temperature=0)
        free = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
        assert out.choices[0].message.content == free.choices[0].message.content

    def test_streamed_json_schema(self, client):
        body = {"model": "tiny", "messages": USER, "response_format": _json_schema(CITY), "max_tokens": 300,
                "temperature": 0.8, "seed": 1, "stream": True}
        response = client.post(CHAT, json=body)
        assert response.status_code == 200
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in response.content.split(b"\n\n")[:-1]
                  if e != b"data: [DONE]"]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        validate(json.loads(text), CITY)

    @pytest.mark.parametrize("path", [COMP, CHAT])
    def test_vllm_extension_fields(self, client, path):
        base = {"model": "tiny", "max_tokens": 60, "temperature": 1.0, "seed": 2}
        base.update({"prompt": "Answer:"} if path == COMP else {"messages": USER})

        def text(**fields):
            response = client.post(path, json={**base, **fields})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return choice["text"] if path == COMP else choice["message"]["content"]

        pattern = r"[0-9]{2}:[0-9]{2}"
        assert re.fullmatch(pattern, text(structured_outputs={"regex": pattern}))
        assert re.fullmatch(pattern, text(guided_regex=pattern))
        assert text(structured_outputs={"choice": ["left", "right"]}) in ("left", "right")
        assert text(guided_choice=["up", "down"]) in ("up", "down")
        validate(json.loads(text(guided_json=CITY, max_tokens=300)), CITY)
        validate(json.loads(text(structured_outputs={"json": json.dumps(CITY)}, max_tokens=300)), CITY)
        assert text(guided_grammar='start: "a" "b"+', max_tokens=5).startswith("ab")
        assert text(structured_outputs={"grammar": 'start: "yes" | "no"'}) in ("yes", "no")

    def test_response_format_on_completions(self, client):
        response = client.post(COMP, json={"model": "tiny", "prompt": "City:", "max_tokens": 300, "temperature": 0,
                                           "response_format": _json_schema(CITY)})
        assert response.status_code == 200
        validate(json.loads(response.json()["choices"][0]["text"]), CITY)


BAD = [
    ("rf-unknown-type", CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    ("rf-not-object", CHAT, {"response_format": "json"}, "response_format"),
    ("rf-schema-missing", CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("rf-invalid-schema", CHAT, {"response_format": _json_schema({"type": "strin"})}, "response_format"),
    ("rf-bad-properties", CHAT, {"response_format": _json_schema({"type": "object", "properties": 3})},
     "response_format"),
    ("so-bad-regex", COMP, {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("so-two-kinds", CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("so-none", COMP, {"structured_outputs": {}}, "structured_outputs"),
    ("so-bad-grammar", CHAT, {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
    ("so-schema-text", COMP, {"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ("guided-bad-json", COMP, {"guided_json": {"type": "object", "required": 5}}, "guided_json"),
    ("guided-bad-regex", CHAT, {"guided_regex": "[z-a]"}, "guided_regex"),
    ("guided-empty-choice", COMP, {"guided_choice": []}, "guided_choice"),
    ("two-constraints", CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("beam-search", COMP, {"guided_regex": "a+", "use_beam_search": True, "n": 2, "temperature": 0},
     "structured_outputs"),
]


@pytest.mark.usefixtures("idle_engine")
@pytest.mark.parametrize("name,path,fields,param", BAD, ids=[case[0] for case in BAD])
def test_bad_constraints_are_400(client, name, path, fields, param):
    body = {"model": "tiny", "max_tokens": 4, **fields}
    body.update({"prompt": "x"} if path == COMP else {"messages": USER})
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_openai_client_gets_bad_request(oai, idle_engine):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=USER, response_format=_json_schema({"type": "strin"}))
    assert info.value.param == "response_format"


def test_bad_constraint_leaves_running_requests_alone(client, idle_engine):
    pattern = r"[a-z]{300,310}"
    long = {"model": "tiny", "prompt": "letters:", "max_tokens": 400, "temperature": 1.0, "seed": 9,
            "structured_outputs": {"regex": pattern}}
    overlapped = []
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.post, COMP, json=long)
        assert wait_until(lambda: idle_engine.engine.has_unfinished(), 20)
        for _, path, fields, _ in BAD:
            body = {"model": "tiny", "max_tokens": 4, **fields}
            body.update({"prompt": "x"} if path == COMP else {"messages": USER})
            assert client.post(path, json=body).status_code == 400
            overlapped.append(not running.done())
        response = running.result(timeout=120)
    assert overlapped[0], "the long request finished before the bad ones arrived; lengthen it"
    assert response.status_code == 200
    assert re.fullmatch(pattern, response.json()["choices"][0]["text"])
    wait_for_idle(idle_engine)
    assert idle_engine.engine.structured.num_active == 0


# -- the real model through the official client ------------------------------------------------
@pytest.fixture(scope="module")
def real_url(smollm2_path):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(smollm2_path), num_kv_blocks=128, max_model_len=2048))
    engine.start()
    try:
        with run_uvicorn(create_app(engine, served_model_names=["smollm2"])) as url:
            yield url
    finally:
        shutdown_engine(engine)


@pytest.mark.real_model
def test_real_model_json_schema_chat(real_url):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population_millions": {"type": "number", "minimum": 0},
            "landmarks": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "country", "population_millions", "landmarks"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=f"{real_url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=120,
        messages=[{"role": "system", "content": "You answer with JSON only."},
                  {"role": "user", "content": "Describe Paris, the capital of France."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    answer = json.loads(choice.message.content)
    validate(answer, schema)
    assert "paris" in answer["city"].lower()

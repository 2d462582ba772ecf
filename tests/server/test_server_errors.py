"""Bad input, auth, overload, draining: each gets its OpenAI error and the server keeps serving."""
from __future__ import annotations

import json

import openai
import pytest
from litestar.testing import TestClient

from app.server import create_app

pytestmark = pytest.mark.usefixtures("idle_engine")

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields):
    return json.dumps({"model": "tiny", "messages": USER, **fields}).encode()


def _comp(**fields):
    return json.dumps({"model": "tiny", "prompt": "hi", **fields}).encode()


# (id, path, raw body, status, param, code)
BAD_INPUTS = [
    ("malformed-json", COMP, b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("not-json", CHAT, b"hello", 400, None, "invalid_json"),
    ("empty-body", CHAT, b"", 400, None, None),
    ("array-body", COMP, b"[1, 2]", 400, None, None),
    ("missing-prompt", COMP, b'{"model": "tiny"}', 400, "prompt", None),
    ("missing-messages", CHAT, b'{"model": "tiny"}', 400, "messages", None),
    ("max-tokens-string", COMP, _comp(max_tokens="8"), 400, "max_tokens", None),
    ("temperature-string", CHAT, _chat(temperature="hot"), 400, "temperature", None),
    ("messages-not-list", CHAT, json.dumps({"model": "tiny", "messages": "hi"}).encode(), 400, "messages", None),
    ("message-without-role", CHAT, json.dumps({"messages": [{"content": "x"}]}).encode(), 400, "messages[0].role",
     None),
    ("stream-options-type", CHAT, _chat(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage", None),
    ("negative-max-tokens", COMP, _comp(max_tokens=-1), 400, "max_tokens", None),
    ("zero-max-tokens", CHAT, _chat(max_tokens=0), 400, "max_tokens", None),
    ("huge-max-tokens", COMP, _comp(max_tokens=10**6), 400, "max_tokens", "context_length_exceeded"),
    ("giant-max-tokens", CHAT, _chat(max_completion_tokens=10**30), 400, "max_tokens", "context_length_exceeded"),
    ("negative-temperature", CHAT, _chat(temperature=-0.5), 400, "temperature", None),
    ("n-zero", CHAT, _chat(n=0), 400, "n", None),
    ("n-huge", COMP, _comp(n=100000), 400, "n", None),
    ("top-p-zero", COMP, _comp(top_p=0), 400, "top_p", None),
    ("presence-penalty-range", CHAT, _chat(presence_penalty=5), 400, "presence_penalty", None),
    ("seed-beyond-int64", CHAT, _chat(seed=2**64 - 1), 400, "seed", None),
    ("best-of-not-n", COMP, _comp(best_of=3), 400, "best_of", None),
    ("beam-search-with-temperature", COMP, _comp(use_beam_search=True, n=2, temperature=0.7), 400, "temperature",
     None),
    ("logit-bias-key", CHAT, _chat(logit_bias={"abc": 1}), 400, "logit_bias", None),
    ("echo-logprobs-range", COMP, _comp(echo=True, logprobs=21, max_tokens=0), 400, "logprobs", None),
    ("logprobs-negative", COMP, _comp(logprobs=-1), 400, "logprobs", None),
    ("prompt-logprobs-range", COMP, _comp(prompt_logprobs=21), 400, "prompt_logprobs", None),
    ("chat-prompt-logprobs-negative", CHAT, _chat(prompt_logprobs=-1), 400, "prompt_logprobs", None),
    ("echo-max-tokens-negative", COMP, _comp(echo=True, max_tokens=-1), 400, "max_tokens", None),
    ("echo-with-suffix", COMP, _comp(echo=True, logprobs=1, suffix="x"), 400, "suffix", None),
    ("logit-bias-range", CHAT, _chat(logit_bias={"5": 1000}), 400, "logit_bias", None),
    ("top-logprobs-range", CHAT, _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", None),
    ("completion-logprobs-range", COMP, _comp(logprobs=30), 400, "logprobs", None),
    ("empty-stop", COMP, _comp(stop=[""]), 400, "stop", None),
    ("prompt-over-max-model-len", COMP, _comp(prompt="hello " * 600), 400, "prompt", "context_length_exceeded"),
    ("prompt-plus-output-over-len", COMP, _comp(prompt="hello " * 500, max_tokens=100), 400, "max_tokens",
     "context_length_exceeded"),
    ("empty-prompt-list", COMP, _comp(prompt=[]), 400, "prompt", None),
    ("empty-prompt", COMP, _comp(prompt=""), 400, "prompt", None),
    ("mixed-prompt-list", COMP, _comp(prompt=["a", 5]), 400, "prompt", None),
    ("token-out-of-vocab", COMP, _comp(prompt=[1, 10**9]), 400, "prompt", None),
    ("suffix", COMP, _comp(suffix="tail"), 400, "suffix", None),
    ("empty-messages", CHAT, _chat(messages=[]), 400, "messages", None),
    ("bad-role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    ("image-part", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages[0].content[0]", None),
    ("unknown-model", CHAT, json.dumps({"model": "gpt-9", "messages": USER}).encode(), 404, "model",
     "model_not_found"),
    ("oversized-body", COMP, _comp(prompt="x" * 300_000), 413, None, "request_too_large"),
]


def _check_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 429 else error["type"])
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input(client, name, path, body, status, param, code):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    _check_error(response, status, param, code)
    if path == CHAT and name in ("negative-temperature", "empty-messages"):  # streamed: still a plain 400
        streamed = json.loads(body)
        streamed["stream"] = True
        _check_error(client.post(path, json=streamed), status, param, code)


def test_server_keeps_serving_after_bad_input(client):
    for _, path, body, *_ in BAD_INPUTS:
        client.post(path, content=body, headers={"content-type": "application/json"})
    ok = client.post(COMP, json={"model": "tiny", "prompt": "still alive?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
    assert client.get("/health").status_code == 200


def test_openai_client_exceptions(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="tiny", prompt="hello " * 600, max_tokens=4)
    assert info.value.code == "context_length_exceeded" and info.value.status_code == 400
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="nope", messages=USER)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=USER, temperature=-1)
    assert info.value.param == "temperature"


def test_unknown_route_and_method(client):
    _check_error(client.get("/v1/nothing-here"), 404, code="not_found")
    _check_error(client.post("/v2/completions", json={}), 404)
    _check_error(client.get(COMP), 405, code="method_not_allowed")
    _check_error(client.get("/v1/models/not-a-model"), 404, "model", "model_not_found")


def test_api_key(tiny_engine):
    app = create_app(tiny_engine, served_model_names=["tiny"], api_key="sekret")
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            error = _check_error(c.post(COMP, json={"prompt": "x", "max_tokens": 1}, headers=headers), 401,
                                 code="invalid_api_key")
            assert "API key" in error["message"]
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        ok = c.post(COMP, json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        good = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="sekret", http_client=c, max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        bad = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="nope", http_client=c, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_overload_gets_429_with_retry_after(client, tiny_engine, monkeypatch):
    state = client.app.state.server
    capacity = tiny_engine.engine.config.max_num_seqs + state.max_waiting_requests
    monkeypatch.setattr(tiny_engine, "num_in_flight", lambda: capacity)
    for path, body in ((COMP, {"prompt": "x", "max_tokens": 1}), (CHAT, {"messages": USER, "stream": True})):
        response = client.post(path, json=body)
        _check_error(response, 429, code="rate_limit_exceeded")
        assert response.headers["retry-after"] == "1"
    monkeypatch.undo()
    assert client.post(COMP, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_draining_and_loading_answer_503(client, tiny_engine):
    state = client.app.state.server
    state.draining = True
    try:
        for response in (client.get("/health"), client.post(COMP, json={"prompt": "x", "max_tokens": 1})):
            _check_error(response, 503, code="service_unavailable")
            assert response.headers["retry-after"]
    finally:
        state.draining = False
    assert client.get("/health").status_code == 200

    loading = create_app(None, served_model_names=["tiny"])
    with TestClient(loading) as c:
        error = _check_error(c.get("/health"), 503)
        assert "loading" in error["message"]
        _check_error(c.post(CHAT, json={"messages": USER}), 503)
        assert c.get("/metrics").status_code == 200
        c.app.state.server.attach(tiny_engine)
        assert c.get("/health").status_code == 200
        assert c.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200

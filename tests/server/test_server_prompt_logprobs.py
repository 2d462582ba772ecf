"""Prompt logprobs over HTTP: `echo` + `logprobs` (the legacy shape lm-evaluation-harness reads),
`max_tokens: 0`, vLLM's `prompt_logprobs` on both endpoints, streamed echo, and the prefix cache."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("idle_engine")

PROMPT = "The quick brown fox jumps over the lazy dog because"


def _post(client, path, **body):
    response = client.post(path, json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def _tokens(client, text):
    return client.post("/tokenize", json={"model": "tiny", "prompt": text}).json()["tokens"]


def _check_legacy_shape(lp, k):
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    offset = 0
    for token, chosen, top, at in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]):
        assert at == offset
        offset += len(token)
        if chosen is None:
            assert top is None
            continue
        assert token in top and top[token] == chosen  # the actual token is always listed
        assert 1 <= len(top) <= k + 1 and max(top.values()) >= chosen


def test_echo_logprobs_with_max_tokens_0_returns_the_scored_prompt(client):
    ids = _tokens(client, PROMPT)
    out = _post(client, "/v1/completions", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    _check_legacy_shape(lp, 2)
    # The same numbers as vLLM's prompt_logprobs field of the same request.
    scored = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=1, temperature=0, prompt_logprobs=2)
    entries = scored["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    assert lp["token_logprobs"][1:] == [entries[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]


def test_echo_logprobs_then_the_generated_tokens(client):
    plain = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                  ignore_eos=True)["choices"][0]
    out = _post(client, "/v1/completions", prompt=PROMPT, echo=True, max_tokens=4, temperature=0, logprobs=1,
                ignore_eos=True)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT + plain["text"] and out["usage"]["completion_tokens"] == 4
    lp = choice["logprobs"]
    n = len(lp["tokens"]) - 4
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert lp["text_offset"][n] == len(PROMPT)
    _check_legacy_shape(lp, 1)


def test_echo_without_logprobs_and_max_tokens_0_without_echo(client):
    echoed = _post(client, "/v1/completions", prompt=PROMPT, echo=True, max_tokens=2, temperature=0)
    plain = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, temperature=0)
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None
    empty = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=0)
    assert empty["choices"][0]["text"] == "" and empty["choices"][0]["finish_reason"] == "length"
    assert empty["usage"]["completion_tokens"] == 0


def test_batch_of_token_prompts_as_lm_eval_sends_them(client):
    # lm-evaluation-harness' local-completions loglikelihood request, verbatim in its fields.
    prompts = [_tokens(client, "Paris is the capital of France"), _tokens(client, "Two plus two is four")]
    out = _post(client, "/v1/completions", prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234,
                echo=True)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(prompts, out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
        assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
        _check_legacy_shape(lp, 1)
        alone = _post(client, "/v1/completions", prompt=ids, temperature=0, max_tokens=0, logprobs=1, echo=True)
        assert alone["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:-1],
                                                                                  abs=1e-5)


def test_streamed_echo_comes_in_the_first_chunk(client):
    whole = _post(client, "/v1/completions", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3, temperature=0,
                  ignore_eos=True)["choices"][0]
    response = client.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "stream": True})
    chunks = [json.loads(e[6:]) for e in response.content.split(b"\n\n") if e.startswith(b"data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["text"].startswith(PROMPT) and "prompt_logprobs" not in choices[0]
    assert "".join(c["text"] for c in choices) == whole["text"]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [t for c in choices if c["logprobs"] for t in c["logprobs"]["text_offset"]]
    streamed = [t for c in choices if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert streamed == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5, nan_ok=True)
    zero = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1,
                                                "max_tokens": 0, "stream": True})
    chunks = [json.loads(e[6:]) for e in zero.content.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == PROMPT
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == len(_tokens(client, PROMPT))


def test_prompt_logprobs_field_on_completions(client):
    ids = _tokens(client, PROMPT)
    out = _post(client, "/v1/completions", prompt=[PROMPT, PROMPT + " again"], max_tokens=2, n=2, temperature=1,
                seed=3, prompt_logprobs=2)
    assert len(out["choices"]) == 4
    entries = out["choices"][0]["prompt_logprobs"]
    assert out["choices"][1]["prompt_logprobs"] == entries  # both samples of one prompt
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2]
        assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
    assert len(out["choices"][2]["prompt_logprobs"]) > len(ids)
    plain = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=1)
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_on_chat(client, oai):
    messages = [{"role": "user", "content": "Name a prime number."}]
    out = _post(client, "/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=0)
    entries = out["prompt_logprobs"]
    assert len(entries) == out["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
    assert _post(client, "/v1/chat/completions", messages=messages, max_tokens=1)["prompt_logprobs"] is None
    via_openai = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                             extra_body={"prompt_logprobs": 0})
    assert via_openai.model_extra["prompt_logprobs"] == entries


def test_openai_client_echo_with_max_tokens_0(oai):
    out = oai.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.top_logprobs[1]) in (3, 4)


def test_prefix_cache_with_prompt_logprobs(client):
    prompt = "Cache me: " + " ".join(f"word{i}" for i in range(40))  # several full 16-token blocks
    body = dict(prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    first = _post(client, "/v1/completions", **body)
    plain = _post(client, "/v1/completions", prompt=prompt + " and more", max_tokens=1)
    again = _post(client, "/v1/completions", **body)
    # Scoring needs every position's logits: the cached blocks are not read for it ...
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    # ... but the scored request's blocks serve the next request that needs no prompt logprobs.
    n = first["usage"]["prompt_tokens"]
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0

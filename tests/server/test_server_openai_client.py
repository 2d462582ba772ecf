"""The official `openai` client against the app in-process (httpx transport through Litestar's TestClient)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("idle_engine")

SYSTEM = ("You are a meticulous assistant for a library. Always answer briefly, cite the shelf number, and never "
          "invent books that are not in the catalogue. The catalogue has three floors and forty shelves.")


def test_completion(oai):
    out = oai.completions.create(model="tiny", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == "tiny"
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    assert out.usage.completion_tokens <= 6 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_default_max_tokens_is_16(oai):
    out = oai.completions.create(model="tiny", prompt="Count:", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_chat(oai):
    out = oai.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=5, temperature=0,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 5


def test_chat_content_parts_names_and_same_role_messages(oai, client):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
        {"role": "user", "name": "alice", "content": "Hello"},
        {"role": "user", "content": "Are you there?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "developer", "content": "Answer now."},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3, temperature=0,
                                      tools=tools, response_format={"type": "text"}, user="u1")
    assert out.usage.completion_tokens <= 3
    # The template saw the flattened text parts and every message.
    tokenized = client.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    text = client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert "Be\nbrief." in text and "Are you there?" in text and "Answer now." in text and "42" in text
    assert tokenized["count"] == out.usage.prompt_tokens


def test_completion_stream_with_usage(oai):
    chunks = list(oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 7
    assert all(c.usage is None for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in text_chunks)
    whole = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert streamed == whole.choices[0].text


def test_chat_stream_with_usage(oai):
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                                         max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert finals in (["stop"], ["length"])
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    whole = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                                        max_tokens=6, temperature=0)
    assert streamed == whole.choices[0].message.content


def test_stream_without_usage_has_no_usage_chunk(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=3, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_sse_framing_is_openai_exact(client):
    response = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.content
    assert body.endswith(b"data: [DONE]\n\n") and b"\r" not in body
    events = body.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_n3_non_stream_and_stream(oai):
    out = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick a word"}], n=3,
                                      max_tokens=5, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1  # seed + index: distinct samples
    stream = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick a word"}],
                                              n=3, max_tokens=5, temperature=1.0, seed=7, stream=True,
                                              stream_options={"include_usage": True}))
    texts = {0: "", 1: "", 2: ""}
    roles = set()
    for chunk in stream[:-1]:
        [choice] = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        texts[choice.index] += choice.delta.content or ""
    assert roles == {0, 1, 2}
    assert texts == {c.index: c.message.content for c in out.choices}  # same seed -> same samples
    assert stream[-1].usage.completion_tokens == out.usage.completion_tokens


def test_completion_n3_multiple_prompts(oai):
    out = oai.completions.create(model="tiny", prompt=["alpha beta", "gamma delta"], n=3, max_tokens=4, seed=1,
                                 extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == 24
    chunks = list(oai.completions.create(model="tiny", prompt=["alpha beta", "gamma delta"], n=3, max_tokens=4,
                                         seed=1, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in out.choices}
    assert chunks[-1].usage.completion_tokens == 24


def test_token_prompts(oai, client):
    ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    by_ids = oai.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    by_text = oai.completions.create(model="tiny", prompt="hello world", max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_seed_reproducibility(oai):
    def sample(seed):
        return oai.completions.create(model="tiny", prompt="Random:", max_tokens=8, temperature=1.0, top_p=0.95,
                                      seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_chat_logprobs(oai):
    out = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                      temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: chosen = best
    plain = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None
    streamed = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True))
    tokens = [t.token for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_completion_logprobs(oai):
    out = oai.completions.create(model="tiny", prompt="The sky is", max_tokens=5, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)


def test_cached_tokens_on_repeated_system_prompt(oai):
    def ask(question):
        return oai.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=2)

    first = ask("Where are the atlases?")
    second = ask("Where is the poetry?")
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32  # at least two full 16-token blocks
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens


def test_stop_strings_and_echo(oai):
    base = oai.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:6]
    assert stop.strip()
    cut = oai.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == base[: base.index(stop)]
    echoed = oai.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("abc")


def test_vllm_extensions_and_unknown_fields(oai):
    out = oai.completions.create(model="tiny-alias", prompt="x", max_tokens=5, best_of=1, extra_body={
        "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5, "ignore_eos": True,
        "stop_token_ids": [], "cache_salt": "tenant-a", "priority": 0, "some_future_field": {"x": 1}})
    assert out.usage.completion_tokens == 5 and out.model == "tiny-alias"


def test_cache_salt_isolates_prefix_cache(oai):
    prompt = SYSTEM + " Question: salt?"
    oai.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    other = oai.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "b"})
    same = oai.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0


def test_models_and_misc_endpoints(oai, client):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert oai.models.retrieve("tiny").id == "tiny"
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    tokens = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 512
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "hello world"
    schema = client.get("/schema/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["properties"]


def test_metrics(oai, client):
    oai.completions.create(model="tiny", prompt="metrics please", max_tokens=3)
    text = client.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'prefixserve:{name}{{model_name="tiny"}}' in text
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f"prefixserve:{name}" in text
    assert 'prefixserve:request_success_total{finished_reason="length",model_name="tiny"}' in text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        count = [line for line in text.splitlines() if line.startswith(f"prefixserve:{name}_count")]
        assert count and float(count[0].split()[-1]) >= 1, name
    generation = [line for line in text.splitlines() if line.startswith("prefixserve:generation_tokens_total")]
    assert float(generation[0].split()[-1]) >= 3


def test_beam_search_through_both_endpoints(oai, tiny_path, tiny_engine):
    """use_beam_search + length_penalty reach the engine's beam search: the same ranked beams as
    an offline LLM, through /v1/completions and /v1/chat/completions, streamed per choice."""
    from engine import LLM, SamplingParams

    offline = LLM(model=str(tiny_path), num_kv_blocks=64)
    prompt_ids = offline.get_tokenizer()("Beam me up").input_ids
    params = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=5, length_penalty=0.7,
                            ignore_eos=True)
    expected = [c.text for c in offline.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs]
    extra = {"use_beam_search": True, "length_penalty": 0.7, "ignore_eos": True}
    comp = oai.completions.create(model="tiny", prompt=prompt_ids, n=3, max_tokens=5, temperature=0, extra_body=extra)
    assert [c.text for c in sorted(comp.choices, key=lambda c: c.index)] == expected
    assert comp.usage.completion_tokens == 15

    stream = oai.completions.create(model="tiny", prompt=prompt_ids, n=3, max_tokens=5, temperature=0, stream=True,
                                    extra_body=extra)
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == expected

    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Beam me up"}], n=2,
                                       max_tokens=4, temperature=0, extra_body=extra)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.content is not None for c in chat.choices)
    assert tiny_engine.engine.kv_cache_usage()["num_in_use"] == 0

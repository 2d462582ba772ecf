"""End to end on the real SmolLM2-135M-Instruct behind a real uvicorn: correctness, 64 concurrent
streaming clients, prefix-cache hits, and a dropped client freeing its blocks."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_testlib import blocks_in_use, run_uvicorn, shutdown_engine, wait_for_idle

from app.server import create_app

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def real_engine(smollm2_path):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(smollm2_path), num_kv_blocks=320, block_size=16, max_num_seqs=64, max_model_len=2048,
    ))
    engine.start()
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def real_url(real_engine):
    with run_uvicorn(create_app(real_engine, served_model_names=["smollm2"])) as url:
        yield url


@pytest.fixture
def real(real_engine):
    wait_for_idle(real_engine)
    yield real_engine
    wait_for_idle(real_engine)


def test_chat_answers_and_reports_cached_tokens(real_url, real):
    client = openai.OpenAI(base_url=f"{real_url}/v1", api_key="x", max_retries=0)
    system = {"role": "system", "content": "You are a concise geography assistant. Answer in one short sentence."}
    first = client.chat.completions.create(
        model="smollm2", messages=[system, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert "Paris" in first.choices[0].message.content
    second = client.chat.completions.create(
        model="smollm2", messages=[system, {"role": "user", "content": "What is the capital of Italy?"}],
        max_tokens=16, temperature=0)
    assert "Rome" in second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_64_concurrent_streaming_clients(real_url, real):
    tokenizer = real.engine.tokenizer
    prompts = [f"Fact number {i} about the ocean:" for i in range(64)]

    async def one(client: openai.AsyncOpenAI, prompt: str):
        stream = await client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0.7,
                                                 seed=1, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, reasons = "", None, []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.text
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        return text, usage, reasons

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{real_url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, (text, usage, reasons) in zip(prompts, results):
        assert reasons == ["length"]
        assert usage.completion_tokens == 8
        assert usage.prompt_tokens == len(tokenizer(prompt).input_ids)
        assert usage.total_tokens == usage.prompt_tokens + 8
        assert text
    wait_for_idle(real)
    assert real.engine.kv_cache_usage()["num_in_use"] == 0


def test_dropped_client_frees_blocks(real_url, real):
    # Long and sampled, so it is still running when the client leaves: a 400-token greedy stream (suffix drafts
    # accepted on its repetitions) once ended before a loaded test client read its first chunk.
    body = {"model": "smollm2", "prompt": "Write a very long essay about the history of tea.", "max_tokens": 1900,
            "temperature": 1.0, "seed": 7, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{real_url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
            assert blocks_in_use(real) > 0, (real.engine.kv_cache_usage(), real.engine.has_unfinished(), real.num_in_flight(), line)
    wait_for_idle(real, timeout=10)
    assert real.engine.kv_cache_usage()["num_in_use"] == 0

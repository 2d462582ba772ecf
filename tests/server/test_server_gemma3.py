"""A Gemma 3 model served as users run it: a real uvicorn on 127.0.0.1 and the openai client. Prompts run
past the sliding window (16 tokens), repeats read their prefix from the cache, and the served text
equals the in-process engine's greedy output for the same request."""
from __future__ import annotations

import openai
import pytest
from server_testlib import run_uvicorn, shutdown_engine

from app.server import create_app

MESSAGES = [{"role": "system", "content": "You answer in one short sentence. " * 6},
            {"role": "user", "content": "Which sea is the saltiest, and why?"}]


@pytest.fixture(scope="module")
def gemma_url(tiny_model_factory):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_model_factory("gemma3")), num_kv_blocks=128,
                                                  block_size=16, max_num_seqs=4))
    engine.start()
    with run_uvicorn(create_app(engine, served_model_names=["gemma-tiny"])) as url:
        yield url
    shutdown_engine(engine)


def test_gemma3_chat_over_http_with_windows_and_cache_hits(gemma_url, tiny_model_factory):
    from engine import LLM, SamplingParams

    client = openai.OpenAI(base_url=f"{gemma_url}/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model="gemma-tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    again = client.chat.completions.create(model="gemma-tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens > 3 * 16  # well past the window
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    assert again.choices[0].message.content == first.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="gemma-tiny", messages=MESSAGES, max_tokens=12, temperature=0, stream=True))
    assert streamed == first.choices[0].message.content
    llm = LLM(model=str(tiny_model_factory("gemma3")), num_kv_blocks=64)
    local = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert local == first.choices[0].message.content

"""Retention over HTTP with the real clients: the openai SDK's prompt_cache_key, the anthropic SDK's
cache_control breakpoints and usage numbers, and the operator's /v1/cache endpoints (issue 39)."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from app.server import create_app
from server_testlib import run_uvicorn

SYSTEM = "You are a careful assistant for a hardware store. Answer briefly and politely. " * 6


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    with run_uvicorn(create_app(tiny_engine, served_model_names=["tiny"], api_key="sk-test")) as url:
        yield url


@pytest.fixture
def fresh(base_url, idle_engine):
    """An idle engine whose cache holds nothing (so hits and retention are this test's own)."""
    r = httpx.post(f"{base_url}/reset_prefix_cache", headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 200, r.text
    return idle_engine


def _lookup(base_url, **body) -> dict:
    r = httpx.post(f"{base_url}/v1/cache/lookup", json=body, headers={"Authorization": "Bearer sk-test"})
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_prompt_cache_key_retains_the_session(base_url, fresh):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell hammers?"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                   prompt_cache_key="agent-7")
    looked = _lookup(base_url, messages=messages)
    assert looked["retained_tokens"] >= 64 and looked["retained_tokens"] == looked["device_tokens"]
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       prompt_cache_key="agent-7", extra_body={"prompt_cache_retention": "1y"})


def test_anthropic_cache_control_reports_creation_then_read(base_url, fresh):
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = client.messages.create(model="tiny", max_tokens=4, system=system, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Do you sell hammers?"}])
    u = first.usage
    assert u.cache_creation_input_tokens >= 64 and u.cache_read_input_tokens == 0
    total = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
    assert total == client.messages.count_tokens(model="tiny", system=system, messages=[
        {"role": "user", "content": "Do you sell hammers?"}]).input_tokens
    second = client.messages.create(model="tiny", max_tokens=4, system=system, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": "Do you sell nails?"}])
    assert second.usage.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    with client.messages.stream(model="tiny", max_tokens=4, system=system, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "And screws?"}]) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens >= u.cache_creation_input_tokens
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"


def test_the_operator_retains_looks_up_and_releases_a_prefix(base_url, fresh):
    headers = {"Authorization": "Bearer sk-test"}
    body = {"prompt": SYSTEM, "ttl": 600}
    r = httpx.post(f"{base_url}/v1/cache/retain", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    warmed = r.json()
    assert warmed["retained_tokens"] >= 64 and warmed["computed_tokens"] == warmed["prompt_tokens"]
    assert _lookup(base_url, prompt=SYSTEM)["retained_tokens"] == warmed["retained_tokens"]
    r = httpx.post(f"{base_url}/v1/cache/release", json={"prompt": SYSTEM}, headers=headers)
    assert r.json() == {"released_tokens": warmed["retained_tokens"]}
    assert _lookup(base_url, prompt=SYSTEM)["retained_tokens"] == 0
    assert httpx.post(f"{base_url}/v1/cache/lookup", json={"prompt": "x"}).status_code == 401
    r = httpx.post(f"{base_url}/v1/cache/retain", json={"prompt": "x", "ttl": -1}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl"
    r = httpx.post(f"{base_url}/v1/cache/lookup", json={"prompt": "x", "messages": []}, headers=headers)
    assert r.status_code == 400


def test_the_operator_checks_the_cache_invariants_and_counts(base_url, fresh):
    """POST /v1/cache/check: check_integrity on the engine thread, and the counts a leak check reads."""
    headers = {"Authorization": "Bearer sk-test"}
    assert httpx.post(f"{base_url}/v1/cache/check").status_code == 401
    r = httpx.post(f"{base_url}/v1/cache/retain", json={"prompt": SYSTEM, "ttl": 600}, headers=headers, timeout=60)
    retained = r.json()["retained_tokens"]
    report = httpx.post(f"{base_url}/v1/cache/check", headers=headers).json()
    assert report["ok"] and report["error"] is None
    assert report["blocks_in_use"] == 0 and report["running"] == report["waiting"] == 0  # nothing in flight
    assert report["retained_blocks"] * 16 == retained  # the tiny engine's 16-token blocks
    assert report["free_blocks"] + report["evictable_blocks"] == report["num_blocks"]
    httpx.post(f"{base_url}/v1/cache/release", json={"prompt": SYSTEM}, headers=headers)
    assert httpx.post(f"{base_url}/v1/cache/check", headers=headers).json()["retained_blocks"] == 0

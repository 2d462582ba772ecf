"""One failing request never takes the engine loop down; leaving a request early frees its blocks."""
from __future__ import annotations

import asyncio
import json

import pytest

from server_testlib import blocks_in_use, wait_for_idle
from engine import ContextLengthExceededError, InvalidRequestError, SamplingParams
from engine.async_engine import EngineStepError

pytestmark = pytest.mark.usefixtures("idle_engine")


def _fail_execute(monkeypatch, engine, after_calls: int = 0, times: int = 1):
    """Make the model runner raise on its (after_calls+1)-th call, `times` times; then behave again."""
    runner = engine.engine.runner
    original = runner.execute
    calls = {"n": 0, "failed": 0}

    def execute(batch):
        calls["n"] += 1
        if calls["n"] > after_calls and calls["failed"] < times:
            calls["failed"] += 1
            raise RuntimeError("injected model failure")
        return original(batch)

    monkeypatch.setattr(runner, "execute", execute)
    return calls


def test_step_failure_gives_500_and_next_request_succeeds(client, tiny_engine, monkeypatch):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "boom"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).status_code == 200  # cached: the retry shares blocks
    calls = _fail_execute(monkeypatch, tiny_engine)
    response = client.post("/v1/chat/completions", json=body)
    assert calls["failed"] == 1
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "injected model failure" in error["message"]
    wait_for_idle(tiny_engine)  # the failed request's blocks were freed
    tiny_engine.engine.check_integrity()
    assert tiny_engine.is_running and tiny_engine.num_step_failures >= 1
    ok = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "ok"}],
                                                    "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    assert client.get("/health").status_code == 200


def test_failure_mid_stream_is_one_error_event(client, tiny_engine, monkeypatch):
    _fail_execute(monkeypatch, tiny_engine, after_calls=3)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "a long story", "max_tokens": 40,
                                                     "ignore_eos": True, "stream": True})
    assert response.status_code == 200
    events = response.content.split(b"\n\n")[:-1]
    assert b"[DONE]" not in response.content
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert set(last) == {"error"} and "injected model failure" in last["error"]["message"]
    assert all("choices" in json.loads(e.removeprefix(b"data: ")) for e in events[:-1])
    assert len(events) >= 2  # some text was streamed before the failure
    wait_for_idle(tiny_engine)
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 3, "stream": True})
    assert ok.content.endswith(b"data: [DONE]\n\n")


async def test_async_engine_survives_step_failures(tiny_engine, monkeypatch):
    _fail_execute(monkeypatch, tiny_engine, times=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(2):
        with pytest.raises(EngineStepError, match="injected"):
            async for _ in tiny_engine.generate("first", params):
                pass
    outs = [o async for o in tiny_engine.generate("second", params)]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert blocks_in_use(tiny_engine) == 0


async def test_submit_raises_admission_errors_before_any_output(tiny_engine):
    with pytest.raises(ContextLengthExceededError):
        await tiny_engine.submit("hi " * 1000, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError) as info:
        await tiny_engine.submit({"prompt_token_ids": []}, SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"
    stream = await tiny_engine.submit("fine", SamplingParams(max_tokens=2))
    outs = [o async for o in stream]
    assert outs[-1].finished
    assert tiny_engine.num_in_flight() == 0


async def test_leaving_early_aborts_and_frees_blocks(tiny_engine):
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    stream = tiny_engine.generate("x " * 100, params)
    async for out in stream:
        assert not out.finished
        break
    assert blocks_in_use(tiny_engine) > 0
    await stream.aclose()
    for _ in range(200):
        if blocks_in_use(tiny_engine) == 0 and not tiny_engine.engine.has_unfinished():
            break
        await asyncio.sleep(0.02)
    assert blocks_in_use(tiny_engine) == 0

    task = asyncio.ensure_future(_consume(tiny_engine.generate("y " * 100, params)))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if blocks_in_use(tiny_engine) == 0 and not tiny_engine.engine.has_unfinished():
            break
        await asyncio.sleep(0.02)
    assert blocks_in_use(tiny_engine) == 0 and tiny_engine.num_in_flight() == 0


async def _consume(stream):
    async for _ in stream:
        pass

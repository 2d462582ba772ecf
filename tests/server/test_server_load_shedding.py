"""Load shedding (--max-queued-requests, issue 39) over real HTTP with the real clients: with one sequence
running and one request waiting, every new generation request is refused before it is queued, on the
OpenAI routes with 503 + Retry-After (the openai SDK's InternalServerError), on the Anthropic routes with
529 overloaded_error (the anthropic SDK's OverloadedError); the refused requests harm neither the running
nor the queued one, both finish normally, and /metrics counts the refusals."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_testlib import TINY_MAX_MODEL_LEN, run_uvicorn, shutdown_engine, wait_for_idle, wait_until

from app.cli import build_parser
from app.server import create_app

USER = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def one_seq_engine(tiny_path):
    """The tiny model running one sequence at a time: a second request waits, deterministically."""
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_path), num_kv_blocks=128, block_size=16,
                                                  max_model_len=TINY_MAX_MODEL_LEN, max_num_seqs=1))
    engine.start()
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def base_url(one_seq_engine):
    app = create_app(one_seq_engine, served_model_names=["tiny"], api_key="sk-test", max_queued_requests=1)
    with run_uvicorn(app) as url:
        yield url


@pytest.fixture
def held(one_seq_engine, monkeypatch):
    """While set, each engine step takes >= 50 ms, so a long request keeps running through the test."""
    wait_for_idle(one_seq_engine)
    hold = threading.Event()
    runner = one_seq_engine.engine.runner
    original = runner.execute

    def execute(batch):
        if hold.is_set():
            time.sleep(0.05)
        return original(batch)

    monkeypatch.setattr(runner, "execute", execute)
    yield hold
    hold.clear()
    wait_for_idle(one_seq_engine, timeout=60)


def _shed(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    [sample] = [s for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "prefixserve:num_requests_shed_total"]
    assert sample.labels == {"model_name": "tiny"}
    return sample.value


def _counts(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["num_requests_running"], stats["num_requests_waiting"]


def test_a_full_queue_sheds_new_requests_and_harms_none(base_url, one_seq_engine, held):
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0)
    claude = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    before = _shed(base_url)
    held.set()
    # A runs (streamed: its first chunk says it is running), B waits behind it (max_num_seqs=1).
    running = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=400, stream=True,
                                     stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = iter(running)
    first = next(chunks)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(oai.chat.completions.create, model="tiny", messages=USER, max_tokens=4)
        assert wait_until(lambda: _counts(one_seq_engine) == (1, 1), 20.0), _counts(one_seq_engine)

        # Every new generation request is refused: 503 + Retry-After in OpenAI's shape ...
        refusals = [
            lambda: oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4),
            lambda: oai.chat.completions.create(model="tiny", messages=USER, max_tokens=4, stream=True),
            lambda: oai.completions.create(model="tiny", prompt="hi", max_tokens=4),
            lambda: oai.responses.create(model="tiny", input="hi", max_output_tokens=4),
        ]
        for call in refusals:
            with pytest.raises(openai.InternalServerError) as info:
                call()
            assert info.value.status_code == 503
            assert info.value.response.headers["retry-after"] == "1"
            error = info.value.body
            assert error["code"] == "overloaded" and error["type"] == "server_error"
            assert "overloaded" in error["message"] and "--max-queued-requests 1" in error["message"]
        # ... and 529 overloaded_error in Anthropic's, created or streamed.
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            claude.messages.create(model="tiny", max_tokens=4, messages=USER)
        assert overloaded.value.status_code == 529
        assert overloaded.value.body["type"] == "error"
        assert overloaded.value.body["error"]["type"] == "overloaded_error"
        assert overloaded.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.OverloadedError):
            with claude.messages.stream(model="tiny", max_tokens=4, messages=USER) as stream:
                stream.get_final_message()
        # Counting tokens queues nothing: still served.
        assert claude.messages.count_tokens(model="tiny", messages=USER).input_tokens > 0
        assert _counts(one_seq_engine) == (1, 1)  # nothing refused reached the engine
        assert _shed(base_url) - before == 6

        held.clear()
        rest = [first, *chunks]
        reply = queued.result(timeout=60)
    # Both finished normally: the running one all its 400 tokens, the queued one after it.
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert rest[-1].usage.completion_tokens == 400
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    wait_for_idle(one_seq_engine)
    # The queue is empty again: new requests are served.
    assert claude.messages.create(model="tiny", max_tokens=2, messages=USER).stop_reason in ("max_tokens", "end_turn")


def test_a_batch_refused_part_way_leaves_nothing_behind(base_url, one_seq_engine, held):
    """A /v1/completions call with two prompts while one sequence runs: the first prompt is queued, the
    second refused, so the whole call is refused and the first prompt withdrawn from the queue."""
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0)
    held.set()
    running = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=400, stream=True,
                                     extra_body={"ignore_eos": True})
    chunks = iter(running)
    next(chunks)
    with pytest.raises(openai.InternalServerError) as info:
        oai.completions.create(model="tiny", prompt=["first", "second"], max_tokens=4)
    assert info.value.status_code == 503
    assert wait_until(lambda: _counts(one_seq_engine) == (1, 0), 10.0), _counts(one_seq_engine)
    ok = oai.chat.completions.create  # one request may wait again: accepted, finishes once A does
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(ok, model="tiny", messages=USER, max_tokens=4)
        assert wait_until(lambda: _counts(one_seq_engine) == (1, 1), 20.0), _counts(one_seq_engine)
        held.clear()
        assert sum(1 for _ in chunks) >= 1
        assert queued.result(timeout=60).choices[0].finish_reason in ("stop", "length")


def test_the_flag_and_its_bounds():
    args = build_parser().parse_args(["serve", "--max-queued-requests", "4"])
    assert args.max_queued_requests == 4
    assert build_parser().parse_args(["serve"]).max_queued_requests is None  # no limit by default
    with pytest.raises(ValueError, match="max-queued-requests"):
        create_app(None, served_model_names=["tiny"], max_queued_requests=0)


def test_no_limit_by_default_queues_everything(one_seq_engine, held):
    """Without the flag nothing is shed (the engine queues, as vLLM's does)."""
    with run_uvicorn(create_app(one_seq_engine, served_model_names=["tiny"])) as url:
        bodies = [{"model": "tiny", "prompt": f"story {i}", "max_tokens": 3} for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=60), bodies))
        assert [r.status_code for r in replies] == [200] * 4

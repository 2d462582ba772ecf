"""Server test fixtures: one tiny-model AsyncEngine for the session, apps over it, clients, uvicorn.

The tiny model (random weights, real SmolLM2 tokenizer and chat template) keeps these fast; the
real-model tests build their own engine.
"""
from __future__ import annotations

import time

import pytest
from server_testlib import TINY_MAX_MODEL_LEN, shutdown_engine, wait_for_idle


@pytest.fixture(scope="session")
def tiny_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_engine(tiny_path):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(tiny_path), num_kv_blocks=256, block_size=16, max_model_len=TINY_MAX_MODEL_LEN, max_num_seqs=16,
    ))
    engine.start()
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def tiny_app(tiny_engine):
    from app.server import create_app

    return create_app(tiny_engine, served_model_names=["tiny", "tiny-alias"], max_body_bytes=256 * 1024)


@pytest.fixture(scope="module")
def client(tiny_app):
    from litestar.testing import TestClient

    with TestClient(tiny_app, timeout=60) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def oai(client):
    import openai

    return openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)


@pytest.fixture
def idle_engine(tiny_engine):
    """Every test leaves no request in flight and no KV block in use."""
    wait_for_idle(tiny_engine)
    yield tiny_engine
    wait_for_idle(tiny_engine)


@pytest.fixture
def slow_engine(idle_engine, monkeypatch):
    """idle_engine with each step taking >= 10 ms, so a long request is reliably still running
    mid-test (a client that leaves it, a SIGTERM that drains it)."""
    runner = idle_engine.engine.runner
    original = runner.execute

    def execute(batch):
        time.sleep(0.01)
        return original(batch)

    monkeypatch.setattr(runner, "execute", execute)
    return idle_engine

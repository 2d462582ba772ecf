"""LangChain test fixtures: one real SmolLM2 AsyncEngine for the session, served in-process and by a
real uvicorn on 127.0.0.1 (both modes share the engine, so one model load serves every test)."""
from __future__ import annotations

import asyncio

import pytest
from langchain_testlib import LC_MAX_MODEL_LEN, SERVED_NAMES, run_uvicorn


@pytest.fixture(scope="session")
def lc_engine(smollm2_path):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(smollm2_path), num_kv_blocks=384, block_size=16, max_model_len=LC_MAX_MODEL_LEN, max_num_seqs=16,
    ))
    engine.start()
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="session")
def lc_server_url(lc_engine):
    """The OpenAI base URL of a real server over the shared engine."""
    from app.server import create_app

    with run_uvicorn(create_app(lc_engine, served_model_names=list(SERVED_NAMES))) as url:
        yield f"{url}/v1"


@pytest.fixture(autouse=True)
def _no_idle_engines_between_tests():
    """Engines a test leased and released stay up, idle (shared_engines.py): stop them after each test, so
    a worker's memory holds what its current test uses, not every engine an earlier one built."""
    yield
    from integrations.langchain.shared_engines import shared_engines

    shared_engines().close_idle()

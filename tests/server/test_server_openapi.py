"""The API docs and the spec against a real uvicorn on 127.0.0.1: /docs, /redoc and /schema load no
external URL and every asset they reference is served; the spec documents every response, and
schemathesis finds no 5xx, hang, undocumented status or response off its schema."""
from __future__ import annotations

import re
import time

import httpx
import pytest
from server_testlib import run_uvicorn, shutdown_engine, wait_for_idle

from app.server import create_app

schemathesis = pytest.importorskip("schemathesis")

ERROR_STATUSES = ("400", "401", "404", "413", "429", "503")
_ASSET = re.compile(r"""(?:src|href)\s*=\s*['"]([^'"]+)['"]""")


@pytest.fixture(scope="module")
def small_engine(tiny_path):
    """Small limits keep every generated request short: 128-token context, 4 sequences at a time."""
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_path), num_kv_blocks=128, block_size=16,
                                                  max_model_len=128, max_num_seqs=4))
    engine.start()
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def base_url(small_engine):
    app = create_app(small_engine, served_model_names=["tiny"], max_waiting_requests=8, max_body_bytes=64 * 1024)
    with run_uvicorn(app) as url:
        yield url


@pytest.mark.parametrize("page", ["/docs", "/redoc", "/schema", "/schema/swagger"])
def test_docs_pages_load_nothing_from_outside(base_url, page):
    with httpx.Client(base_url=base_url, timeout=10) as http:
        response = http.get(page)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        html = response.text
        assert not re.findall(r"https?://", html), "the page references an external URL"
        assets = _ASSET.findall(html)
        assert any(a.endswith(".js") for a in assets)
        for asset in assets:
            assert asset.startswith("/"), asset
            served = http.get(asset)
            assert served.status_code == 200 and len(served.content) > 100, asset
        assert http.get("/docs/assets/index.html").status_code == 404  # only the listed files are served


def test_spec_at_vllm_paths_documents_responses_and_errors(base_url):
    spec = httpx.get(f"{base_url}/openapi.json", timeout=10).json()
    assert spec == httpx.get(f"{base_url}/schema/openapi.json", timeout=10).json()
    operations = {(path, method): op for path, item in spec["paths"].items() for method, op in item.items()}
    for (path, method), op in operations.items():
        ok = op["responses"]["200"]
        if path not in ("/health", "/reset_prefix_cache"):  # 200 with an empty body
            assert ok["content"], (path, method)
        for media in ok.get("content", {}).values():
            assert media["schema"] != {}, (path, method)
    chat = operations[("/v1/chat/completions", "post")]["responses"]
    assert set(ERROR_STATUSES) <= set(chat)
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "choices" in chat["200"]["content"]["application/json"]["schema"]["properties"]
    for status in ERROR_STATUSES:
        error = chat[status]["content"]["application/json"]["schema"]["properties"]["error"]
        assert set(error["required"]) == {"message", "type", "param", "code"}
    assert "Retry-After" in chat["429"]["headers"] and "Retry-After" in chat["503"]["headers"]


def run_schemathesis(base_url: str, *, post_examples: int, get_examples: int) -> None:
    """Every operation of the served spec: generated and example cases, each checked for 5xx, hangs
    (a timeout), undocumented statuses, undocumented content types and bodies off their schema."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance, response_schema_conformance, status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:
        post = operation.method.upper() == "POST"
        # Bodies that fit the schema (mostly invalid in meaning: 400s), the spec's own examples (200s)
        # and, for bodies, ones that break the schema (wrong types, missing fields: 400s).
        strategies = [operation.as_strategy(), *schema.get_strategies_from_examples(operation)]
        if post:
            strategies.append(operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

        @settings(max_examples=post_examples if post else get_examples, deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(*strategies))
        def check(case):
            case.call_and_validate(base_url=base_url, checks=checks, timeout=20)

        check()


def test_schemathesis_finds_no_undocumented_behaviour(base_url, small_engine):
    started = time.monotonic()
    run_schemathesis(base_url, post_examples=40, get_examples=5)
    wait_for_idle(small_engine, timeout=10)
    assert time.monotonic() - started < 120


def test_schemathesis_with_an_api_key(small_engine):
    """Without the key every API route answers 401, documented, with the OpenAI error body."""
    app = create_app(small_engine, served_model_names=["tiny"], api_key="secret")
    with run_uvicorn(app) as url:
        spec = httpx.get(f"{url}/openapi.json", timeout=10).json()
        assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert {"bearer": []} in spec["paths"]["/v1/chat/completions"]["post"]["security"]
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        run_schemathesis(url, post_examples=5, get_examples=2)

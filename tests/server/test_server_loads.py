"""GET /v1/loads (SGLang's shape, what the SGLang Model Gateway polls) and GET /server_info."""
from __future__ import annotations

import threading

import msgspec
from server_testlib import wait_until

from app.loads import LoadsResponse


def _loads(client, path="/v1/loads") -> LoadsResponse:
    resp = client.get(path)
    assert resp.status_code == 200, resp.text
    return msgspec.json.decode(resp.content, type=LoadsResponse)


def test_idle_worker_reports_capacity_and_no_load(client, idle_engine):
    report = _loads(client)
    assert report.dp_rank_count == 1 and len(report.loads) == 1
    load = report.loads[0]
    info = idle_engine.model_info
    assert (load.num_running_reqs, load.num_waiting_reqs, load.num_used_tokens) == (0, 0, 0)
    assert load.max_total_num_tokens == info.block_size * info.num_kv_blocks == 256 * 16
    assert load.max_running_requests == info.max_num_seqs == 16
    assert load.token_usage == 0.0 and load.utilization == 0.0
    # The gateway also asks /loads?model=NAME: the same report.
    assert _loads(client, "/loads?model=tiny").loads[0].max_total_num_tokens == load.max_total_num_tokens


def test_busy_worker_reports_running_requests_and_kv_usage(client, slow_engine):
    done = threading.Event()

    def long_request() -> None:
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x " * 40, "max_tokens": 200,
                                              "ignore_eos": True, "n": 3})
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        assert wait_until(lambda: _loads(client).loads[0].num_running_reqs == 1, 20)
        load = _loads(client).loads[0]
        assert load.num_used_tokens > 0 and 0 < load.token_usage < 1
        assert load.utilization == 1 / 16
    finally:
        thread.join(60)
    assert done.is_set()
    # The response can arrive before the loop refreshes its stats snapshot after the last step (a loaded
    # machine running the whole suite saw 1 running request here): wait for it.
    assert wait_until(lambda: _loads(client).loads[0].num_running_reqs == 0, 10)
    assert _loads(client).loads[0].gen_throughput >= 0


def test_cache_hit_rate_follows_the_prefix_cache(client, idle_engine):
    prompt = "The same long system prompt, sent twice. " * 8
    hits_before = idle_engine.stats().get("prefix_cache_hits", 0)
    for _ in range(2):
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).status_code == 200
    # The response can arrive before the loop refreshes its stats snapshot after that step: wait for it.
    assert wait_until(lambda: idle_engine.stats()["prefix_cache_hits"] > hits_before, 10)
    stats = idle_engine.stats()
    expected = stats["prefix_cache_hits"] / stats["prefix_cache_queries"]
    assert _loads(client).loads[0].cache_hit_rate == expected > 0


def test_server_info(client, idle_engine):
    resp = client.get("/server_info")
    assert resp.status_code == 200
    info = resp.json()
    assert info["served_model_name"] == "tiny" and info["served_model_names"] == ["tiny", "tiny-alias"]
    assert info["max_model_len"] == info["context_length"] == idle_engine.model_info.max_model_len
    assert info["max_total_num_tokens"] == 256 * 16 and info["max_running_requests"] == 16

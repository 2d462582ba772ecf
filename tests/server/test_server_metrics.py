"""/metrics over a real uvicorn on 127.0.0.1, parsed with prometheus_client's own parser: values after
known traffic (official openai client), an aborted stream, the content type, `--metrics-namespace vllm`."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from server_testlib import run_uvicorn, wait_for_idle

from app.cli import build_parser
from app.server import create_app

REQUEST_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_inference_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                      "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens")


def scrape(base_url: str) -> dict[str, float]:
    """Every sample as 'name{label="value",...}' -> value (labels sorted, model_name included)."""
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    labels = {"model_name": "tiny", **labels}
    return samples[name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"]


@pytest.fixture(scope="module")
def base_url(tiny_engine):
    with run_uvicorn(create_app(tiny_engine, served_model_names=["tiny"])) as url:
        yield url


@pytest.fixture(scope="module")
def vllm_url(tiny_engine):
    with run_uvicorn(create_app(tiny_engine, served_model_names=["tiny"], metrics_namespace="vllm")) as url:
        yield url


def test_content_type_is_prometheus_exactly_once(base_url):
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.headers.get_list("content-type") == [CONTENT_TYPE_LATEST]


def test_request_histograms_after_known_traffic(base_url, idle_engine):
    p = "prefixserve:"
    before = scrape(base_url)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    # Three requests of known sizes, one after the other (prompts under one 16-token block: no cache hits).
    for prompt_len, max_tokens in ((5, 3), (7, 4), (9, 5)):
        out = client.completions.create(model="tiny", prompt=list(range(1000 + prompt_len, 1000 + 2 * prompt_len)),
                                        max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens == prompt_len and out.usage.completion_tokens == max_tokens
    after = scrape(base_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, p + name, **labels) - value(before, p + name, **labels)

    for name in REQUEST_HISTOGRAMS:
        assert delta(name + "_count") == 3, name
    assert delta("request_prompt_tokens_sum") == 5 + 7 + 9
    assert delta("request_generation_tokens_sum") == 3 + 4 + 5
    assert delta("request_params_max_tokens_sum") == 3 + 4 + 5
    assert delta("request_params_n_sum") == 3
    assert delta("request_prompt_tokens_bucket", le="5.0") == 1 and delta("request_prompt_tokens_bucket", le="10.0") == 3
    assert delta("request_generation_tokens_bucket", le="2.0") == 0
    assert delta("request_generation_tokens_bucket", le="5.0") == 3
    assert delta("request_success_total", finished_reason="length") == 3
    assert delta("prompt_tokens_total") == 21 and delta("generation_tokens_total") == 12
    # One prefill step per request (its whole prompt), then one step per further token.
    assert delta("iteration_tokens_total_count") == 3 + (2 + 3 + 4)
    assert delta("iteration_tokens_total_sum") == 21 + (2 + 3 + 4)
    # Queue time ends at the first scheduling, TTFT at the first token: queue + prefill == TTFT.
    queue, prefill, ttft = (delta(f"{n}_sum") for n in ("request_queue_time_seconds",
                                                        "request_prefill_time_seconds",
                                                        "time_to_first_token_seconds"))
    assert 0 <= queue < ttft and prefill > 0
    assert queue + prefill == pytest.approx(ttft, rel=1e-6, abs=1e-9)
    decode, inference = delta("request_decode_time_seconds_sum"), delta("request_inference_time_seconds_sum")
    assert decode > 0 and prefill + decode == pytest.approx(inference, rel=1e-6, abs=1e-9)
    assert delta("e2e_request_latency_seconds_sum") >= ttft


def test_client_disconnect_is_counted_as_abort(base_url, slow_engine):
    before = scrape(base_url)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "talk"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
    wait_for_idle(slow_engine, timeout=5.0)
    after = scrape(base_url)
    for reason, expected in (("abort", 1), ("stop", 0), ("length", 0)):
        name = "prefixserve:request_success_total"
        assert value(after, name, finished_reason=reason) - value(before, name, finished_reason=reason) == expected
    # An unfinished request is in no latency histogram.
    name = "prefixserve:e2e_request_latency_seconds_count"
    assert value(after, name) == value(before, name)


def test_vllm_namespace_publishes_vllm_names(vllm_url, idle_engine):
    client = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                   extra_body={"ignore_eos": True})
    samples = scrape(vllm_url)
    assert not [name for name in samples if name.startswith("prefixserve:")]
    # The gauges gateways and dashboards read, and the per-request histograms.
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(samples, f"vllm:{gauge}") >= 0
    for name in REQUEST_HISTOGRAMS + ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert value(samples, f"vllm:{name}_count") >= 1, name
    assert value(samples, "vllm:request_generation_tokens_sum") == 3
    assert value(samples, "vllm:request_success_total", finished_reason="length") >= 1
    assert value(samples, "vllm:iteration_tokens_total_count") >= 1
    assert value(samples, "vllm:prompt_tokens_total") > 0


def test_namespace_flag_and_validation(tiny_engine):
    args = build_parser().parse_args(["serve", "--metrics-namespace", "vllm"])
    assert args.metrics_namespace == "vllm"
    assert build_parser().parse_args(["serve"]).metrics_namespace == "prefixserve"
    with pytest.raises(ValueError, match="metrics namespace"):
        create_app(tiny_engine, served_model_names=["tiny"], metrics_namespace="vllm:")

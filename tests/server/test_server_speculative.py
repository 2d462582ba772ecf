"""Speculative decoding as a server user turns it on: the flag's JSON, a streamed OpenAI chat answer that
is token for token the one without it (chunks may carry several tokens), and vLLM's spec-decode metrics."""
from __future__ import annotations

import argparse

import httpx
import openai

from app.args import add_engine_args, engine_config_from_args
from app.server import create_app
from server_testlib import run_uvicorn, shutdown_engine


def _engine(path, spec: str | None):
    from engine import AsyncEngine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--model", str(path), "--num-kv-blocks", "256", "--max-model-len", "512"]
    if spec is not None:
        argv += ["--speculative-config", spec]
    engine = AsyncEngine.from_config(engine_config_from_args(parser.parse_args(argv)))
    engine.start()
    return engine


def _stream(url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "red green blue red green blue red green blue"}],
        max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def test_streamed_chat_with_speculation_matches_and_is_counted(tiny_model_factory):
    path = tiny_model_factory("llama", tie_word_embeddings=True, init_std=0.1)  # a model that half copies
    results = {}
    for spec in (None, '{"method": "ngram", "num_speculative_tokens": 4}'):
        engine = _engine(path, spec)
        try:
            with run_uvicorn(create_app(engine, served_model_names=["tiny"])) as url:
                results[spec] = _stream(url)
                metrics = httpx.get(f"{url}/metrics").text
        finally:
            shutdown_engine(engine)
    plain, spec = results[None], results['{"method": "ngram", "num_speculative_tokens": 4}']
    assert spec == plain and plain[1] == 48
    accepted = [line for line in metrics.splitlines() if line.startswith("prefixserve:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert 'prefixserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in metrics

"""Host-memory and Redis KV tiers inside the engine, and swap preemption.

Real parts throughout: the engine on a tiny random model (SmolLM2 where marked), the shared Redis
at 127.0.0.1:6379 under a unique key prefix per test, private redis-server processes that are
killed and paused, and separate engine processes."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import redis

from engine import LLM, EngineConfig, SamplingParams
from engine.errors import InvalidConfigError
from fixtures.redis_servers import SHARED_URL, RedisServer

from engine_testlib import assert_greedy_match, hf_greedy, random_ids, run_checked

ROOT = pathlib.Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HOST_MEMORY = 1 << 20  # 128 tiny-model blocks of 8 KiB


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _llm(path, **kw) -> LLM:
    args = dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    args.update(kw)
    return LLM(model=str(path), **args)


def _run(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"q{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    order = list(engine.requests)
    finals = run_checked(engine)  # block and tier integrity after every step
    return [finals[r] for r in order]


# -- host tier and swap ----------------------------------------------------------------------
def test_host_tier_hits_after_device_eviction(tiny, hf_model_loader):
    llm = _llm(tiny, num_kv_blocks=12, host_kv_cache_memory=HOST_MEMORY)
    first = random_ids(50, 1)
    (a,) = _run(llm, [first])
    _run(llm, [random_ids(50, 10 + i) for i in range(4)])  # 12 device blocks: `first` is evicted
    stats = llm.engine.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["kv_host_stores"] >= 3
    (again,) = _run(llm, [first])
    assert again.num_cached_tokens == 48  # 3 full blocks back from host memory
    stats = llm.engine.stats()
    assert stats["kv_host_hits"] == 3 and stats["kv_tier_loaded_tokens"] == 48
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert_greedy_match(again.outputs[0].token_ids, hf_greedy(hf_model_loader(tiny), [first], 8)[0], "host hit")


def test_a_failed_step_leaves_no_untrusted_host_blocks(tiny):
    llm = _llm(tiny, num_kv_blocks=8, max_num_batched_tokens=128, host_kv_cache_memory=HOST_MEMORY)
    engine = llm.engine
    first = random_ids(50, 30)
    (ref,) = _run(llm, [first])
    execute = engine.runner.execute
    failed = []

    def failing(batch):  # fails before any transfer of the step ran
        if batch.transfers.device_to_host and not failed:
            failed.append(len(batch.transfers.device_to_host))
            raise RuntimeError("injected failure")
        return execute(batch)

    engine.runner.execute = failing
    engine.add_request("victim", {"prompt_token_ids": random_ids(120, 31)}, GREEDY)  # all 8 blocks: demotes `first`
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert failed and engine.abort_running() == ["victim"]
    engine.check_integrity()
    assert engine.tiers.host.num_cached == 0  # the demotion copies never ran: nothing kept
    (again,) = _run(llm, [first])
    assert again.outputs[0].token_ids == ref.outputs[0].token_ids


def _count_computed_tokens(llm: LLM) -> list[int]:
    """Test instrumentation: total tokens the model computed (sums each step's batch)."""
    total = [0]
    execute = llm.engine.runner.execute

    def counting(batch):
        total[0] += batch.num_batched_tokens
        return execute(batch)

    llm.engine.runner.execute = counting
    return total


def test_swap_preemption_resumes_without_recomputation(tiny):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [random_ids(40, 100 + i) for i in range(4)]  # 4 x 5 blocks at the end > 12 blocks
    roomy = _llm(tiny)
    roomy_computed = _count_computed_tokens(roomy)
    reference = [o.outputs[0].token_ids for o in _run(roomy, prompts, params)]
    assert roomy.engine.stats()["num_preemptions"] == 0

    tight = _llm(tiny, num_kv_blocks=12, preemption_mode="swap", host_kv_cache_memory=HOST_MEMORY)
    computed = _count_computed_tokens(tight)
    outs = _run(tight, prompts, params)
    stats = tight.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_swapped_in_blocks"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert computed[0] == roomy_computed[0]  # every token computed exactly once
    assert tight.engine.tiers.host.num_swap == 0  # every swap slot was given back


def test_swap_without_host_room_falls_back_to_recompute(tiny):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [random_ids(40, 200 + i) for i in range(4)]
    reference = [o.outputs[0].token_ids for o in _run(_llm(tiny), prompts, params)]
    tight = _llm(tiny, num_kv_blocks=12, preemption_mode="swap", host_kv_cache_memory=8192)  # one block
    outs = _run(tight, prompts, params)
    assert tight.engine.stats()["kv_swap_failures"] > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


# -- Redis -------------------------------------------------------------------------------------
_REPLICA = """
import json, sys
from engine import LLM, SamplingParams
path, url, prefix, prompt = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
llm = LLM(model=path, block_size=16, num_kv_blocks=64, kv_redis_url=url, kv_redis_key_prefix=prefix)
out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)[0]
stats = llm.engine.stats()
print(json.dumps({"cached": out.num_cached_tokens, "tokens": out.outputs[0].token_ids,
                  "redis_hits": stats["kv_redis_hits"]}))
# no explicit flush: queued writes are flushed when the process exits
"""


def _replica(path, prefix: str, prompt: list[int]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _REPLICA, str(path), SHARED_URL, prefix, json.dumps(prompt)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_engine_process_hits_what_the_first_computed(tiny, prefix):
    prompt = random_ids(70, 7)  # 4 full reusable blocks
    first = _replica(tiny, prefix, prompt)
    assert first["cached"] == 0
    # A new process -- another replica, or this one restarted -- on the same Redis.
    second = _replica(tiny, prefix, prompt)
    assert second["cached"] == 64 and second["redis_hits"] == 4
    assert second["tokens"] == first["tokens"]


def test_corrupted_value_is_detected_and_recomputed(tiny, prefix):
    prompt = random_ids(70, 8)
    a = _llm(tiny, kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix, kv_redis_ttl=600)
    (ref,) = _run(a, [prompt])
    assert a.engine.flush_kv_writes() and a.engine.stats()["kv_redis_writes"] == 4
    a.engine.close()
    client = redis.Redis.from_url(SHARED_URL)
    store = a.engine.tiers.remote
    keys = a.engine.blocks.block_keys(prompt[:64])
    name = store.key_for(keys[2])
    assert 0 < client.ttl(name) <= 600
    value = client.get(name)
    client.setrange(name, len(value) - 100, bytes([value[-100] ^ 0x01]))  # one flipped bit in the KV

    b = _llm(tiny, kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix)
    (out,) = _run(b, [prompt])
    stats = b.engine.stats()
    assert out.num_cached_tokens == 32  # blocks 0 and 1; block 2 is corrupt, so 2 and 3 are recomputed
    assert stats["kv_redis_corrupt_values"] == 1 and stats["kv_redis_hits"] == 2
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # the recomputed blocks were written back over the bad value
    assert b.engine.flush_kv_writes() and stats["kv_redis_hits"] == 2
    b.engine.close()
    c = _llm(tiny, kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix)
    (out,) = _run(c, [prompt])
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == ref.outputs[0].token_ids
    c.engine.close()


def test_redis_killed_or_hung_mid_run_every_request_completes(tiny):
    system = random_ids(48, 9)
    prompts = [system + random_ids(10, 300 + i) for i in range(9)]
    reference = [o.outputs[0].token_ids for o in _run(_llm(tiny), prompts)]
    server = RedisServer().start()
    try:
        # a small device pool keeps the shared prefix going in and out, so Redis is asked often
        llm = _llm(tiny, num_kv_blocks=8, kv_redis_url=server.url, kv_redis_timeout=0.1)
        engine = llm.engine
        step_times = []
        step = engine.step

        def timed_step():
            start = time.monotonic()
            try:
                return step()
            finally:
                step_times.append(time.monotonic() - start)

        engine.step = timed_step
        outs = _run(llm, prompts[:3])
        assert engine.flush_kv_writes() and engine.stats()["kv_redis_writes"] > 0
        server.kill()
        outs += _run(llm, prompts[3:6])
        engine.flush_kv_writes()  # the writer thread has tried (and failed) every queued write by now
        assert engine.stats()["kv_redis_failures"] >= 1
        server.start()  # back, on the same port
        server.pause()  # ... but hung
        outs += _run(llm, prompts[6:])
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert max(step_times) < 2.0  # bounded by the socket timeout; the breaker skips Redis after that
        server.resume()
        writes = engine.stats()["kv_redis_writes"]
        deadline = time.monotonic() + 15  # reconnects by itself once the backoff has passed
        while engine.stats()["kv_redis_writes"] == writes and time.monotonic() < deadline:
            _run(llm, [random_ids(40, int(time.monotonic_ns() % 10**6))])
            engine.flush_kv_writes(1.0)
            time.sleep(0.2)
        assert engine.stats()["kv_redis_writes"] > writes
        engine.close()
    finally:
        server.kill()


@pytest.mark.real_model
def test_smollm2_replicas_share_prefixes_through_redis(smollm2_path, prefix):
    a = LLM(model=str(smollm2_path), num_kv_blocks=64, kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix)
    tok = a.get_tokenizer()
    prompt = tok("Reference notes for the support team: " + "Orders ship within two days. " * 12
                 + "Question: when do orders ship?").input_ids
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = a.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert a.engine.flush_kv_writes()
    a.engine.close()
    b = LLM(model=str(smollm2_path), num_kv_blocks=64, kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix)
    out = b.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    b.engine.close()


# -- configuration and surfaces -------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    {"preemption_mode": "swap"},  # no host memory to swap into
    {"host_kv_cache_memory": -1},
    {"kv_redis_url": "http://127.0.0.1:6379"},
    {"kv_redis_ttl": 0},
    {"kv_redis_timeout": 0},
    {"kv_redis_key_prefix": "a:b"},
    {"kv_tier_policy": "never"},
])
def test_invalid_tier_config(bad):
    with pytest.raises(InvalidConfigError):
        EngineConfig(**bad)


def test_cli_flags_reach_the_config():
    from app.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args([
        "serve", "--kv-redis-url", SHARED_URL, "--host-kv-cache-memory", "1048576", "--preemption-mode", "swap",
        "--kv-redis-ttl", "3600",
    ])
    config = engine_config_from_args(args)
    assert (config.kv_redis_url, config.host_kv_cache_memory, config.preemption_mode, config.kv_redis_ttl) == (
        SHARED_URL, 1 << 20, "swap", 3600)


def test_tier_counters_in_prometheus_metrics():
    from app.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: {"kv_redis_hits": 5, "kv_host_hits": 2, "kv_redis_failures": 1}, "m")
    text = metrics.render()[0].decode()
    assert 'prefixserve:kv_redis_hits_total{model_name="m"} 5.0' in text
    assert 'prefixserve:kv_host_hits_total{model_name="m"} 2.0' in text
    assert 'prefixserve:kv_redis_failures_total{model_name="m"} 1.0' in text

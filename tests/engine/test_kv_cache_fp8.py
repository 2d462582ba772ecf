"""The fp8 KV cache in the engine (kv_cache_dtype="fp8", kernels/kv_quant.py): the config, the capacity a budget
buys, serving with integrity checked after every step, prefix-cache hits and forks, the host tier and Redis
storing the one-byte blocks (and never mixing them with a model-dtype engine's), and greedy drift against
the model-dtype cache on the real model."""
from __future__ import annotations

import itertools

import pytest
import redis
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.errors import InvalidConfigError
from fixtures.redis_servers import SHARED_URL

from engine_testlib import random_ids, run_checked, tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
FP8 = torch.float8_e4m3fn
_IDS = itertools.count()


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen2")  # GQA: 4 query heads over 2 KV heads, head_dim 16


def _run(llm: LLM, prompts, params=GREEDY) -> list:
    engine = llm.engine
    ids = [f"r{next(_IDS)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    finals = run_checked(engine)  # block (and tier) integrity after every step
    return [finals[r] for r in ids]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_config_takes_vllms_names_and_refuses_the_rest():
    assert EngineConfig(kv_cache_dtype="fp8").kv_dtype_name == "float8_e4m3fn"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_dtype_name == "float8_e4m3fn"
    assert EngineConfig(dtype="bfloat16").kv_dtype_name == "bfloat16"  # auto: the model dtype
    for bad in ("fp8_e5m2", "int8", "float8", ""):
        with pytest.raises(InvalidConfigError, match="'auto', 'fp8', 'fp8_e4m3'"):
            EngineConfig(kv_cache_dtype=bad)


def test_the_flag_reaches_the_config():
    import argparse

    from app.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8"])).kv_cache_dtype == "fp8"
    assert engine_config_from_args(parser.parse_args([])).kv_cache_dtype == "auto"


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2)])
def test_the_same_budget_holds_more_blocks(tiny, dtype, ratio):
    per_block_auto = 16 * 2 * 2 * 2 * 16 * (4 if dtype == "float32" else 2)  # BS x K,V x layers x Hkv x D x bytes
    budget = 40 * per_block_auto
    auto = tiny_llm(tiny, dtype=dtype, num_kv_blocks=None, kv_cache_memory=budget)
    fp8 = tiny_llm(tiny, dtype=dtype, num_kv_blocks=None, kv_cache_memory=budget, kv_cache_dtype="fp8")
    assert auto.engine.blocks.num_blocks == 40 and fp8.engine.blocks.num_blocks == 40 * ratio
    pool = fp8.engine.runner.kv_cache
    assert pool.dtype == FP8 and pool.numel() * pool.element_size() == budget


@pytest.fixture(scope="module")
def smooth(tiny_model_factory):
    """A tiny model whose attention is not near one-hot: at the default init std (0.5) its scores are tens apart,
    so e4m3's 3-bit mantissa (K within 2^-4) moves them by ~1 and flips a third of its first tokens (measured:
    17/24 equal, and 1 of 24 8-token sequences); at 0.1, 23/24 and 19/24."""
    return tiny_model_factory("qwen2", init_std=0.1)


def test_fp8_serves_close_to_the_model_dtype_cache(smooth):
    prompts = [random_ids(10 + 7 * i, i) for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    auto = _tokens(_run(tiny_llm(smooth, num_kv_blocks=256), prompts, params))
    by_backend = {}
    for backend in ("cpu", "torch"):  # the C kernels, and the torch references any device runs
        llm = tiny_llm(smooth, num_kv_blocks=256, kv_cache_dtype="fp8", attention_backend=backend)
        assert llm.engine.runner.kv_cache.dtype == FP8
        by_backend[backend] = fp8 = _tokens(_run(llm, prompts, params))
        assert sum(a[0] == b[0] for a, b in zip(auto, fp8)) >= 20, (backend, auto, fp8)  # first tokens: prefill
        assert sum(a == b for a, b in zip(auto, fp8)) >= 14, (backend, auto, fp8)  # whole sequences: decode too
    same = sum(a == b for x, y in zip(by_backend["cpu"], by_backend["torch"]) for a, b in zip(x, y))
    assert same >= 0.95 * 24 * 8  # the C kernels and the references read the same bytes


def test_prefix_hits_and_forks_read_the_fp8_blocks(tiny):
    shared = random_ids(64, 3)  # 4 full blocks
    cold = tiny_llm(tiny, kv_cache_dtype="fp8")
    (expected,) = _run(cold, [shared + random_ids(9, 4)])
    llm = tiny_llm(tiny, kv_cache_dtype="fp8")
    _run(llm, [shared + random_ids(5, 5)])
    (hit,) = _run(llm, [shared + random_ids(9, 4)])
    assert hit.num_cached_tokens == 64 and hit.outputs[0].token_ids == expected.outputs[0].token_ids
    # n > 1 and beams fork the prompt's blocks and copy a shared half-filled block on write (copy_blocks)
    # (through generate: run_checked's per-step check refuses n > 1 on a fresh engine in either cache dtype, a
    # check_integrity issue of its own)
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    prompt = {"prompt_token_ids": shared + random_ids(7, 6)}
    (a,) = llm.generate(prompt, sampled, use_tqdm=False)
    (b,) = tiny_llm(tiny, kv_cache_dtype="fp8").generate(prompt, sampled, use_tqdm=False)
    assert a.num_cached_tokens == 64 and [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    beams = llm.generate({"prompt_token_ids": shared + random_ids(3, 8)},
                         SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert len(beams[0].outputs) == 3
    llm.engine.check_integrity()


def test_host_tier_demotes_and_promotes_fp8_blocks(tiny):
    llm = tiny_llm(tiny, num_kv_blocks=12, kv_cache_dtype="fp8", host_kv_cache_memory=1 << 20)
    assert llm.engine.runner.kv_mover.host.dtype == FP8
    first = random_ids(50, 1)
    (a,) = _run(llm, [first])
    _run(llm, [random_ids(50, 10 + i) for i in range(4)])  # 12 device blocks: `first` is evicted to host memory
    assert llm.engine.stats()["kv_host_stores"] >= 3
    (again,) = _run(llm, [first])
    assert again.num_cached_tokens == 48 and llm.engine.stats()["kv_host_hits"] == 3
    assert again.outputs[0].token_ids == a.outputs[0].token_ids


def test_redis_shares_fp8_blocks_and_never_mixes_them_with_the_model_dtypes(tiny, prefix):
    prompt = random_ids(70, 7)  # 4 full blocks
    redis_args = dict(kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix)
    writer = tiny_llm(tiny, kv_cache_dtype="fp8", **redis_args)
    (ref,) = _run(writer, [prompt])
    assert writer.engine.flush_kv_writes() and writer.engine.stats()["kv_redis_writes"] == 4
    writer.engine.close()
    client = redis.Redis.from_url(SHARED_URL)
    names = sorted(client.scan_iter(match=f"{prefix}:*"))
    assert len(names) == 4 and all(b":float32-float8_e4m3fn:" in n for n in names)
    value = client.get(names[0])
    assert b"float8_e4m3fn" in value and len(value) < 16 * 2 * 2 * 2 * 16 + 512  # one byte per element, + header

    reader = tiny_llm(tiny, kv_cache_dtype="fp8", **redis_args)  # another replica, or this one restarted
    (hit,) = _run(reader, [prompt])
    assert hit.num_cached_tokens == 64 and reader.engine.stats()["kv_redis_hits"] == 4
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    reader.engine.close()

    # A float32-cache engine on the same Redis: other keys, so no hit...
    auto = tiny_llm(tiny, **redis_args)
    (out,) = _run(auto, [prompt])
    assert out.num_cached_tokens == 0 and auto.engine.stats()["kv_redis_hits"] == 0
    # ...and fp8 values copied under its keys are refused (their header names another layout), then recomputed
    store, expected = auto.engine.tiers.remote, out.outputs[0].token_ids
    assert auto.engine.flush_kv_writes()  # its own values are written: ours replace them below
    for name, key in zip(names, auto.engine.blocks.block_keys(prompt[:64])):
        client.set(store.key_for(key), client.get(name))
    auto.reset_prefix_cache()
    (out,) = _run(auto, [prompt])
    stats = auto.engine.stats()
    assert out.num_cached_tokens == 0 and stats["kv_redis_hits"] == 0 and stats["kv_redis_corrupt_values"] >= 1
    assert out.outputs[0].token_ids == expected
    auto.engine.close()


@pytest.mark.real_model
def test_greedy_drift_on_smollm2():
    """The default model as served (int4 weights, float32): auto's greedy continuations of a few chat prompts,
    scored by an fp8 engine (prompt logprobs), are nearly all its argmax too; a flip is a near-tie. Measured on
    16 prompts x 64 tokens (benchmarks/kv_fp8_drift.py, docs/kv-cache.md): 95.4% on a Zen 4, 94.7% on an Intel
    Xeon with AMX (float32). These 4 x 32 tokens gave 89% on that Xeon (auto scoring its own greedy: 100%), so the
    bound is 85%, which a broken fp8 path (a wrong scale, a lost bit) falls far below."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    convs = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Why is the sky blue?",
                                                        "Write a haiku about the sea.", "How do I sort a list in Python?")]
    auto = LLM(num_kv_blocks=256, enable_prefix_caching=False)
    fp8 = LLM(num_kv_blocks=256, enable_prefix_caching=False, kv_cache_dtype="fp8")
    ours = [o.outputs[0].token_ids for o in auto.chat(convs, params, use_tqdm=False)]
    prompts = [auto.apply_chat_template(c, True, None) for c in convs]
    scored = fp8.generate([{"prompt_token_ids": p + o} for p, o in zip(prompts, ours)],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ranks = [entry[t].rank for p, o, s in zip(prompts, ours, scored) for t, entry in zip(o, s.prompt_logprobs[len(p):])]
    agreement = sum(r == 1 for r in ranks) / len(ranks)
    theirs = [o.outputs[0].token_ids for o in fp8.chat(convs, params, use_tqdm=False)]
    print(f"fp8 vs auto on SmolLM2: teacher-forced top-1 {agreement:.3f}; identical sequences "
          f"{sum(a == b for a, b in zip(ours, theirs))}/{len(convs)}")
    assert agreement >= 0.85
    fp8.engine.check_integrity()

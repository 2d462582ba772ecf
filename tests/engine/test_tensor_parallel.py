"""Tensor parallelism (engine/executor.py, engine/models/sharding.py): greedy output identical to one
rank, with prefix caching, n>1 forks, beam search and preemption unchanged; each rank holds its
share of the KV pool; clear errors for heads that do not divide; a dead worker fails the engine
with EngineDeadError instead of hanging."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import EngineDeadError, InvalidConfigError
from engine.models.config import load_model_config
from engine.models.parallel import TPGroup
from engine.models.sharding import local_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, length: int, base: int = 100) -> list[dict]:
    return [{"prompt_token_ids": [base + 37 * i + j for j in range(length + 5 * i)]} for i in range(n)]


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def tiny_gqa(tiny_model_factory):
    # 4 query heads, 2 KV heads (GQA), q/k/v biases: every sharded tensor kind is exercised.
    return tiny_model_factory("qwen2")


def test_two_ranks_match_one_rank_greedy_forks_beams_and_cache(tiny_gqa):
    kwargs = dict(model=str(tiny_gqa), block_size=8, num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=8)
    one = LLM(**kwargs)
    two = LLM(tensor_parallel_size=2, **kwargs)
    try:
        assert two.engine.runner.kv_cache.shape[-2] == one.engine.runner.kv_cache.shape[-2] // 2  # its KV heads
        prompts = _prompts(6, 20) + [{"prompt_token_ids": list(range(200, 330))}]  # chunked prefill too
        assert _tokens(two.generate(prompts, GREEDY, use_tqdm=False)) == _tokens(one.generate(prompts, GREEDY,
                                                                                            use_tqdm=False))
        # The same prompts again: prefix-cache hits on both, same tokens.
        again = two.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert again[0].num_cached_tokens > 0
        assert _tokens(again) == _tokens(one.generate(prompts[:2], GREEDY, use_tqdm=False))
        # n>1 forks with seeded sampling: the same draws on both.
        sampled = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=8)
        assert _tokens(two.generate(prompts[:2], sampled, use_tqdm=False)) == _tokens(
            one.generate(prompts[:2], sampled, use_tqdm=False))
        beams = [[b.tokens for b in o.sequences] for o in two.beam_search(prompts[:1], _beam_params())]
        assert beams == [[b.tokens for b in o.sequences] for o in one.beam_search(prompts[:1], _beam_params())]
        two.engine.check_integrity()
    finally:
        two.engine.close()


def _beam_params():
    from engine.llm import BeamSearchParams

    return BeamSearchParams(beam_width=3, max_tokens=8)


def test_preemption_under_two_ranks_gives_the_same_tokens(tiny_gqa):
    kwargs = dict(model=str(tiny_gqa), block_size=8, num_kv_blocks=12, max_num_seqs=6)
    prompts = _prompts(6, 25)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(**kwargs).generate(prompts, params, use_tqdm=False)
    two = LLM(tensor_parallel_size=2, **kwargs)
    try:
        assert _tokens(two.generate(prompts, params, use_tqdm=False)) == _tokens(one)
        assert two.engine.scheduler.num_preemptions > 0
    finally:
        two.engine.close()


def test_shards_reassemble_the_checkpoint(tiny_gqa):
    """Concatenating the ranks' slices gives back every fused weight (no row lost or duplicated)."""
    from safetensors.torch import load_file

    from engine.models.loader import fuse_projections
    from engine.models.sharding import shard_state

    cfg = load_model_config(tiny_gqa)
    full = fuse_projections(load_file(str(tiny_gqa / "model.safetensors")), cfg.num_layers)
    shards = [shard_state(dict(full), cfg, TPGroup(r, 2)) for r in range(2)]
    name = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full[name])
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full[name])
    emb = torch.cat([s["model.embed_tokens.weight"] for s in shards])
    assert torch.equal(emb[: cfg.vocab_size], full["model.embed_tokens.weight"])
    assert local_config(cfg, TPGroup(1, 2)).num_kv_heads == cfg.num_kv_heads // 2


def test_heads_that_do_not_divide_fail_clearly(tiny_gqa):
    cfg = load_model_config(tiny_gqa)  # 4 heads, 2 KV heads
    with pytest.raises(InvalidConfigError, match="must divide the model's KV heads"):
        local_config(cfg, TPGroup(0, 4))
    with pytest.raises(InvalidConfigError, match="tensor_parallel_size must be at least 1"):
        LLM(model=str(tiny_gqa), tensor_parallel_size=0)
    with pytest.raises(InvalidConfigError, match="quantization='gguf'"):
        LLM(model=str(tiny_gqa), tensor_parallel_size=2, quantization="gguf")


def test_redis_tier_is_shared_across_tensor_parallel_sizes(tiny_gqa):
    """Values hold whole blocks (rank 0 gathers every rank's heads): what TP=2 wrote, TP=1 and another
    TP=2 engine read, and every engine gives the same tokens as one without Redis."""
    from fixtures.redis_servers import SHARED_URL, delete_prefix, unique_prefix

    prefix = unique_prefix()
    redis = dict(kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix, kv_tier_policy="always")
    prompts = [{"prompt_token_ids": list(range(300 + 50 * i, 300 + 50 * i + 41))} for i in range(2)]
    expected = _tokens(LLM(model=str(tiny_gqa), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False))
    try:
        writer = LLM(model=str(tiny_gqa), tensor_parallel_size=2, num_kv_blocks=64, **redis)
        try:
            assert _tokens(writer.generate(prompts, GREEDY, use_tqdm=False)) == expected
            assert writer.engine.flush_kv_writes() and writer.engine.stats()["kv_redis_writes"] >= 4
        finally:
            writer.engine.close()
        for tp in (1, 2):
            reader = LLM(model=str(tiny_gqa), tensor_parallel_size=tp, num_kv_blocks=64, **redis)
            try:
                outs = reader.generate(prompts, GREEDY, use_tqdm=False)
                assert _tokens(outs) == expected, tp
                assert reader.engine.stats()["kv_redis_hits"] >= 4 and outs[0].num_cached_tokens >= 32, tp
            finally:
                reader.engine.close()
    finally:
        delete_prefix(SHARED_URL, prefix)


def test_a_dead_worker_fails_the_engine_not_hangs(tiny_gqa):
    llm = LLM(model=str(tiny_gqa), tensor_parallel_size=2, num_kv_blocks=32)
    try:
        llm.generate(_prompts(1, 10), GREEDY, use_tqdm=False)
        worker = llm.engine.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(EngineDeadError, match="exited"):
            llm.generate(_prompts(1, 10), GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()


@pytest.mark.real_model
def test_smollm2_three_ranks_match_one(smollm2_path):
    """SmolLM2-135M: 9 query heads and 3 KV heads split over 3 ranks (one KV head each)."""
    prompts = [{"prompt_token_ids": list(range(500 + 11 * i, 560 + 11 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    one = LLM(model=str(smollm2_path), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    three = LLM(model=str(smollm2_path), tensor_parallel_size=3, num_kv_blocks=64)
    try:
        assert _tokens(three.generate(prompts, params, use_tqdm=False)) == _tokens(one)
    finally:
        three.engine.close()

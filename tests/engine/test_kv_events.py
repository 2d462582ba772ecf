"""KV events in vLLM's format over ZMQ, read by a real ZMQ subscriber decoding with vLLM 0.32's event
schema (tests/fixtures/kv_events_subscriber.py): stored chains with parent links, removals on
eviction, the host tier's medium, sequence numbers, replay, and AllBlocksCleared on a reset."""
from __future__ import annotations

import socket

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidConfigError
from engine.kv_events import KVEventsConfig
from prefix_cache.events import external_hash
from fixtures.kv_events_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber

pytest.importorskip("zmq")

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=1)


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def events_llm(tiny_model_factory):
    """An LLM publishing KV events, a subscriber on it, and the config; closed afterwards."""
    made = []

    def make(**kwargs):
        pub, replay = _ports(2)
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
        llm = LLM(model=str(tiny_model_factory("llama")), block_size=BS, kv_events_config=config, **kwargs)
        sub = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv")
        made.append((llm, sub))
        _wait_connected(llm, sub)
        return llm, sub

    yield make
    for llm, sub in made:
        sub.close()
        llm.engine.close()


def _wait_connected(llm, sub) -> None:
    """PUB drops what it sends before the SUB has joined: publish resets until one arrives."""
    for _ in range(50):
        assert llm.reset_prefix_cache()
        got = sub.receive(100)
        if got is not None:
            sub.drain(100)
            return
    raise AssertionError("the subscriber never received a batch")


def _events(sub) -> list:
    return [e for _, batch in sub.drain() for e in batch.events]


def test_a_prompt_is_stored_as_one_chain_with_its_tokens(events_llm):
    llm, sub = events_llm(num_kv_blocks=64)
    prompt = list(range(100, 100 + 3 * BS + 5))  # 3 full blocks and a partial one
    llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    stored = [e for e in _events(sub) if isinstance(e, BlockStored)]
    assert len(stored) == 1
    event = stored[0]
    keys = llm.engine.blocks.block_keys(prompt[: 3 * BS])
    assert event.block_hashes == [external_hash(k) for k in keys]
    assert event.parent_block_hash is None and event.token_ids == prompt[: 3 * BS]
    assert (event.block_size, event.medium, event.lora_id, event.locality) == (BS, "GPU", None, "LOCAL")

    # A continuation sharing the prefix stores only its new blocks, linked to the cached parent.
    longer = prompt[: 3 * BS] + list(range(500, 500 + BS + 1))
    llm.generate([{"prompt_token_ids": longer}], GREEDY, use_tqdm=False)
    stored = [e for e in _events(sub) if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].parent_block_hash == external_hash(keys[-1])
    assert stored[0].token_ids == longer[3 * BS: 4 * BS]


def test_eviction_is_removed_and_sequence_numbers_count_up_and_replay(events_llm):
    llm, sub = events_llm(num_kv_blocks=8, max_num_seqs=1)
    seqs = []
    for i in range(4):  # 4 prompts of 3 full blocks into 8 blocks: later ones evict earlier ones
        llm.generate([{"prompt_token_ids": [1000 * (i + 1) + j for j in range(3 * BS + 1)]}], GREEDY,
                     use_tqdm=False)
    got = sub.drain()
    seqs = [n for n, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one batch per step, no gaps
    events = [e for _, b in got for e in b.events]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert removed and set(removed) <= set(stored)
    assert all(e.medium == "GPU" for e in events if isinstance(e, BlockRemoved))
    # What the device still caches is exactly what was stored and not removed.
    cached = {external_hash(llm.engine.blocks._pool.index.key_of(b)) for b in llm.engine.blocks._pool.index.block_ids()}
    assert cached == set(stored) - set(removed)
    # Replay from the middle returns the same batches, then the end marker.
    replayed = sub.replay(seqs[2])
    assert [n for n, _ in replayed][:len(seqs) - 2] == seqs[2:]
    assert [b.events for _, b in replayed][:len(seqs) - 2] == [b.events for _, b in got[2:]]


def test_host_tier_moves_carry_the_cpu_medium(events_llm):
    llm, sub = events_llm(num_kv_blocks=8, max_num_seqs=1, host_kv_cache_memory=1 << 20)
    for i in range(4):
        llm.generate([{"prompt_token_ids": [1000 * (i + 1) + j for j in range(3 * BS + 1)]}], GREEDY,
                     use_tqdm=False)
    events = _events(sub)
    demoted = [h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes]
    evicted = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes]
    assert demoted and set(demoted) == set(evicted)  # every block evicted from the device went to host memory


def test_redis_write_through_is_reported_as_remote_storage(events_llm):
    from fixtures.redis_servers import SHARED_URL, delete_prefix, unique_prefix

    prefix = unique_prefix()
    try:
        llm, sub = events_llm(num_kv_blocks=32, kv_redis_url=SHARED_URL, kv_redis_key_prefix=prefix)
        llm.generate([{"prompt_token_ids": list(range(700, 700 + 3 * BS + 1))}], GREEDY, use_tqdm=False)
        events = _events(sub)
        device = [h for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes]
        storage = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert storage and all(e.locality == "REMOTE" for e in storage)
        assert [h for e in storage for h in e.block_hashes] == device  # every new block, written through
    finally:
        delete_prefix(SHARED_URL, prefix)


def test_reset_prefix_cache_publishes_all_blocks_cleared(events_llm):
    llm, sub = events_llm(num_kv_blocks=32)
    llm.generate([{"prompt_token_ids": list(range(100, 100 + 2 * BS + 1))}], GREEDY, use_tqdm=False)
    sub.drain()
    assert llm.engine.blocks.usage()["num_evictable"] > 0
    assert llm.reset_prefix_cache()
    events = _events(sub)
    assert [type(e) for e in events] == [AllBlocksCleared]
    assert llm.engine.blocks.usage()["num_evictable"] == 0
    llm.engine.check_integrity()
    # Nothing cached any more: the same prompt computes every block again.
    out = llm.generate([{"prompt_token_ids": list(range(100, 100 + 2 * BS + 1))}], GREEDY, use_tqdm=False)
    assert out[0].num_cached_tokens == 0


def test_reset_is_refused_while_a_request_holds_blocks(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), block_size=BS, num_kv_blocks=32)
    llm.engine.add_request("r", {"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=4))
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.reset_prefix_cache()
    llm.engine.check_integrity()


def test_config_is_vllms_and_bad_configs_fail_clearly():
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.topic) == (
        "zmq", "tcp://*:5557", None, 10_000, "")
    assert KVEventsConfig.parse({"enable_kv_cache_events": False}).publisher == "null"
    with pytest.raises(InvalidConfigError, match="unknown keys"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}')
    with pytest.raises(InvalidConfigError, match="JSON"):
        KVEventsConfig.parse("{not json")
    with pytest.raises(InvalidConfigError, match="publisher"):
        KVEventsConfig.parse({"publisher": "kafka"})

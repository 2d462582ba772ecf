"""Speculative decoding end to end (engine/speculative/): greedy outputs are exactly those of decoding one
token a step, drafts are verified and counted, rejected drafts leave no block behind, and the features a
request can carry (stops, max_tokens, n>1, logprobs, seeds, streaming through the server) still hold."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidConfigError

REPEATING = "one two three four five six seven eight nine ten " * 6
PROMPTS = [REPEATING, "abc def ghi " * 10 + "abc", "The list: red, green, blue, red, green, blue, red, green"]


@pytest.fixture
def copying(tiny_model_factory):
    """A tiny model that half copies: tied embeddings and small weights make it repeat runs of its context
    (measured: 97 ngram drafts over these prompts, 67 accepted), so drafts are both accepted and rejected."""
    return tiny_model_factory("llama", tie_word_embeddings=True, init_std=0.1)


def _llm(path, spec=None, **kwargs):
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(model=str(path), speculative_config=spec, max_num_seqs=8, **kwargs)


def _run_checked(llm: LLM, prompts, params):
    """generate() one step at a time, checking every allocator and index after each step, and that no
    sequence holds a block past the tokens with KV plus the step's new ones."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
        bs = engine.config.block_size
        for seq in engine.scheduler.running:
            assert len(engine.blocks.block_ids(seq.seq_id)) <= -(-seq.num_tokens // bs) + 1
    return [finals[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_are_exactly_those_without_speculation(copying, method):
    path = copying
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = _run_checked(_llm(path), PROMPTS, params)
    llm = _llm(path, {"method": method, "num_speculative_tokens": 4})
    spec = _run_checked(llm, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    stats = llm.engine.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # some rejected
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert llm.kv_cache_usage()["num_in_use"] == 0


def test_stops_max_tokens_logprobs_and_samples_match_plain_decoding(copying):
    path = copying
    plain, spec = _llm(path), _llm(path, {"method": "ngram", "num_speculative_tokens": 5})
    cases = [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, stop=["seven eight"]),
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=3),
    ]
    for params in cases:
        a = _run_checked(plain, PROMPTS, params)
        b = _run_checked(spec, PROMPTS, params)
        for x, y in zip(a, b):
            for ox, oy in zip(x.outputs, y.outputs):
                assert oy.token_ids == ox.token_ids and oy.text == ox.text
                assert oy.finish_reason == ox.finish_reason and len(oy.token_ids) <= params.max_tokens
                if params.logprobs:
                    assert len(oy.logprobs) == len(oy.token_ids)
                    for lx, ly in zip(ox.logprobs, oy.logprobs):
                        assert lx.keys() == ly.keys()
                        assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-3 for t in lx)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible_with_speculation(copying):
    """A seeded draw is keyed by (seed, output index) alone: the same tokens with or without speculation,
    whatever drafts each run chose to verify (the drafts depend on timings measured at start-up)."""
    path = copying
    params = SamplingParams(temperature=0.2, max_tokens=40, ignore_eos=True, seed=11)
    plain = _run_checked(_llm(path), PROMPTS, params)
    first = _run_checked(_llm(path, {"method": "ngram"}), PROMPTS, params)
    llm = _llm(path, {"method": "ngram"})
    again = _run_checked(llm, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats()["spec_decode_num_drafts"] > 0


def test_suffix_drafts_come_from_earlier_requests_of_the_same_salt_only(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = _llm(path, {"method": "suffix", "num_speculative_tokens": 8})
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine = llm.engine

    def run(request_id, salt):
        engine.add_request(request_id, "tell me the story again", params, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        return engine.stats()["spec_decode_num_accepted_tokens"]

    before = run("a", "tenant-a")
    other_tenant = run("b", "tenant-b") - before  # the same text under another salt: only its own tokens
    same_tenant = run("c", "tenant-a") - before - other_tenant  # follows request a's output
    assert same_tenant > other_tenant
    assert same_tenant >= 30


def test_the_config_is_vllms_and_bad_keys_are_refused(tiny_model_factory):
    from engine.speculative import SpeculativeConfig

    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24  # vLLM: the tree depth
    assert SpeculativeConfig.parse({}) is None and SpeculativeConfig.parse("") is None
    with pytest.raises(InvalidConfigError, match="unknown keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(InvalidConfigError, match="draft models"):
        SpeculativeConfig.parse({"method": "eagle", "model": "x"})
    with pytest.raises(InvalidConfigError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(InvalidConfigError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"prompt_lookup_min": 5, "prompt_lookup_max": 2})


@pytest.mark.real_model
def test_smollm2_greedy_long_outputs_are_unchanged_and_faster_per_step(smollm2_path):
    """The real model, float32: long greedy answers, copy-heavy and not, token for token."""
    text = (smollm2_path / "README.md").read_text()[:1200] if (smollm2_path / "README.md").exists() else REPEATING
    prompts = [
        f"<|im_start|>user\nCopy this text word for word:\n\n{text}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nList the numbers from 1 to 40, comma separated.<|im_end|>\n<|im_start|>assistant\n",
    ]
    params = SamplingParams(temperature=0, max_tokens=256)
    plain = _llm(smollm2_path, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = _llm(smollm2_path, {"method": "ngram"}, dtype="float32")
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 40, stats
    llm.engine.check_integrity()


def test_engine_config_takes_the_flag_json():
    from engine.config import EngineConfig

    c = EngineConfig(speculative_config='{"method": "suffix", "suffix_decoding_max_cached_requests": 5}')
    assert c.speculative_config.method == "suffix" and c.speculative_config.suffix_decoding_max_cached_requests == 5
    with pytest.raises(InvalidConfigError):
        EngineConfig(speculative_config=[1, 2])


def test_the_default_is_suffix_on_one_cpu_process_and_off_elsewhere(copying):
    """"auto" (the default) resolves where the engine knows its device: suffix where the step cost is
    measured (one CPU process), off on a GPU or tensor-parallel ranks; "off", None and {} turn it off."""
    from engine.config import EngineConfig
    from engine.speculative import SpeculativeConfig

    assert EngineConfig().speculative_config == "auto"
    for off in (None, "off", "OFF", "none", "", "{}", {}):
        assert EngineConfig(speculative_config=off).speculative_config is None, off
    assert SpeculativeConfig.resolve("auto", measured=True).method == "suffix"
    assert SpeculativeConfig.resolve("auto", measured=False) is None
    ngram = SpeculativeConfig(method="ngram")
    assert SpeculativeConfig.resolve(ngram, measured=False) is ngram  # an explicit choice is kept anywhere
    default = LLM(model=str(copying), num_kv_blocks=64)
    assert default.engine.drafter is not None and default.engine.drafter.config.method == "suffix"
    assert LLM(model=str(copying), num_kv_blocks=64, speculative_config="off").engine.drafter is None


def test_the_cli_flag_turns_it_off_or_picks_the_method():
    import argparse

    from app.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).speculative_config == "auto"
    assert engine_config_from_args(parser.parse_args(["--speculative-config", "off"])).speculative_config is None
    picked = engine_config_from_args(parser.parse_args(["--speculative-config", '{"method": "ngram"}']))
    assert picked.speculative_config.method == "ngram"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts_gives_the_same_tokens(copying, mode):
    """A pool too small for every sequence at once: sequences with drafts in flight are preempted and
    resumed (recomputed or swapped back), and still give the tokens of decoding one at a time."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [p + f" {i}" for i, p in enumerate(PROMPTS * 2)]
    swap = {"host_kv_cache_memory": 1 << 22} if mode == "swap" else {}
    plain = _run_checked(_llm(copying, num_kv_blocks=256), prompts, params)
    llm = _llm(copying, {"method": "ngram"}, num_kv_blocks=24, preemption_mode=mode, **swap)
    spec = _run_checked(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


def test_two_tensor_parallel_ranks_with_drafts_give_the_same_tokens(copying):
    """Under tensor parallelism a row of drafts goes to every rank like any multi-token row: both methods
    give the tokens of one rank decoding one token a step, and drafts are both accepted and rejected."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = _run_checked(_llm(copying), PROMPTS, params)
    for method in ("ngram", "suffix"):
        llm = _llm(copying, {"method": method, "num_speculative_tokens": 4}, tensor_parallel_size=2)
        try:
            spec = _run_checked(llm, PROMPTS, params)
            assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain], method
            stats = llm.engine.stats()
            assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], method
            assert llm.kv_cache_usage()["num_in_use"] == 0
        finally:
            llm.engine.close()

"""Decode bursts (engine/decode_burst.py) on the CPU, through DecodeGraphs with a stand-in capturer (as
tests/engine/test_cuda_graphs.py): several decode steps queued per host round must give exactly the tokens,
texts, finish reasons and block accounting of ordinary steps, and step aside for anything they cannot run."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.decode_burst import burst_length
from engine.scheduler_output import SampleSpec, ScheduledRow, SchedulerOutput


class Rerun:
    """capture(fn) -> (replay, output): replay reruns fn over the same buffers into the first output."""

    def __call__(self, fn):
        output = fn()
        return (lambda: output.copy_(fn())), output


def _llm(path, burst: int | None, num_kv_blocks: int = 256, fused: bool = True):
    llm = LLM(model=str(path), attention_backend="torch", block_size=8, num_kv_blocks=num_kv_blocks, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=512, speculative_config=None)
    if burst is not None:
        engine = llm.engine
        runner = engine.runner
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.scale, capture_sizes(8), 512 // 8,
                                     capture=Rerun(), burst_block_size=8 if fused else None)
        assert runner.graphs.has_burst_graphs == fused
        engine.burst_steps = burst
        launches = []
        launch = runner.launch_burst

        def counted(batch, num_steps):
            launches.append((len(batch.rows), num_steps))
            return launch(batch, num_steps)

        runner.launch_burst = counted
        llm.launches = launches
    return llm


def _prompts(vocab, lengths=(5, 17, 70, 1, 33, 9)):
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]} for n in lengths]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("arch,fused", [("llama", True), ("llama", False), ("gemma3", True)])
def test_bursts_give_the_tokens_of_single_steps(tiny_model_factory, arch, fused):
    """fused: each step one captured graph (forward, argmax, next inputs); else the forward's graph and ops."""
    path = tiny_model_factory(arch)
    plain = _llm(path, None)
    prompts = _prompts(plain.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 3, 29, 6, 1, 15)]
    expected = _run(plain, prompts, params)
    # Stops inside a burst: a stop token and a stop string taken from the single-step outputs.
    stop_token = expected[0][0][0][4]
    params[0] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token])
    stop_text = expected[2][0][1][-6:-2]
    if stop_text.strip():
        params[2] = SamplingParams(temperature=0, max_tokens=29, ignore_eos=True, stop=[stop_text])
    expected = _run(plain, prompts, params)
    for steps in (2, 8):
        llm = _llm(path, steps, fused=fused)
        assert _run(llm, prompts, params) == expected
        assert llm.launches and max(k for _, k in llm.launches) == steps, llm.launches
        assert llm.kv_cache_usage()["num_in_use"] == 0
        llm.engine.check_integrity()


def test_a_burst_streams_each_request_once_per_burst_and_on_finishing(tiny_model_factory):
    llm = _llm(tiny_model_factory("llama"), 4)
    engine = llm.engine
    for i, p in enumerate(_prompts(engine.model_config.vocab_size, (9, 12))):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10 if i else 6, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        outs = engine.step()
        seen.append([(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in outs])
        assert len({o.request_id for o in outs}) == len(outs)  # one output per request per step
        engine.check_integrity()
    # prefill (1 token each), a burst of 4 (5), one of 1 for r0 finishing at 6 with r1 going on...
    assert seen[0] == [("r0", 1, False), ("r1", 1, False)]
    assert seen[1] == [("r0", 5, False), ("r1", 5, False)]
    assert ("r0", 6, True) in seen[2] and seen[-1][-1] == ("r1", 10, True)
    assert llm.kv_cache_usage()["num_in_use"] == 0


def test_what_a_burst_cannot_run_takes_single_steps(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = _prompts(512, (7, 11))
    cases = [
        SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=9, max_tokens=9),  # EOS banned to the end
    ]
    for params in cases:
        expected = _run(_llm(path, None), prompts, [params, params])
        llm = _llm(path, 8)
        assert _run(llm, prompts, [params, params]) == expected
        assert not llm.launches, params
        llm.engine.check_integrity()


def test_greedy_samples_burst_once_forked(tiny_model_factory):
    """n=2 greedy: the samples fork (copy-on-write of the shared block in an ordinary step), then burst alone."""
    path = tiny_model_factory("llama")
    params = SamplingParams(n=2, temperature=0, max_tokens=19, ignore_eos=True)
    prompts = _prompts(512, (7, 11))
    expected = _run(_llm(path, None), prompts, [params, params])
    llm = _llm(path, 8)
    assert _run(llm, prompts, [params, params]) == expected
    assert llm.launches and llm.launches[0][0] == 4
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


def test_a_pool_too_small_for_the_lookahead_takes_single_steps(tiny_model_factory):
    path = tiny_model_factory("llama")
    prompts = _prompts(512, (14, 14))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = _run(_llm(path, None, num_kv_blocks=6), prompts, [params, params])
    llm = _llm(path, 16, num_kv_blocks=6)  # 2 x 24 tokens fit; 2 x (15 + 16) do not
    assert _run(llm, prompts, [params, params]) == expected
    assert not any(k == 16 for _, k in llm.launches)
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


def _row(start=10, params=None, **spec):
    params = params or SamplingParams(temperature=0, max_tokens=50)
    return ScheduledRow("s#0", start, (7,), (0, 1), (SampleSpec("s#0", params, (), None, output_index=spec.pop("k", 3)),))


def test_burst_length_takes_the_least_room_and_the_most_wanted():
    one = SchedulerOutput((_row(),), (), ())
    assert burst_length(one, 8, 512, 64) == 8
    assert burst_length(one, 1, 512, 64) == 1
    assert burst_length(one, 8, 14, 64) == 4  # positions 10..13 fit under max_model_len 14
    assert burst_length(one, 8, 512, 0) == 1  # no graphs
    short = _row(params=SamplingParams(temperature=0, max_tokens=5), k=3)  # 2 tokens still wanted
    assert burst_length(SchedulerOutput((short,), (), ()), 8, 512, 64) == 2
    assert burst_length(SchedulerOutput((short, _row()), (), ()), 8, 512, 64) == 8
    prefill = ScheduledRow("p#0", 0, (1, 2, 3), (0,))
    assert burst_length(SchedulerOutput((_row(), prefill), (), ()), 8, 512, 64) == 1
    assert burst_length(SchedulerOutput((_row(),), ((1, 2),), ()), 8, 512, 64) == 1  # a block copy first


def test_a_burst_runs_to_the_end_of_the_context(tiny_model_factory):
    """The last steps before max_model_len: the fused step's next inputs point past the table (clamped)."""
    path = tiny_model_factory("llama")
    prompts = _prompts(512, (500, 20))
    # 500 + 12 = 512 = max_model_len: the first burst stops 12 positions on, where the other row still wants more
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 30)]
    expected = _run(_llm(path, None), prompts, params)
    llm = _llm(path, 16)
    assert _run(llm, prompts, params) == expected
    assert (2, 11) in llm.launches, llm.launches
    llm.engine.check_integrity()

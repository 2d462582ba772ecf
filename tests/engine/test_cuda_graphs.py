"""DecodeGraphs (engine/cuda_graphs.py) on the CPU: a stand-in capturer "replays" by running the captured
forward again over the same fixed buffers, so everything but the CUDA capture itself runs here: filling
the buffers, padding a batch to the next size (slot -1, seq_len 0), stale block-table columns, and the
choice between a replay and an eager step. benchmarks/gpu/check.py runs the real capture on a GPU."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, capture_sizes


class Rerun:
    """capture(fn) -> (replay, output): replay writes fn()'s fresh result into the first output, as a
    graph's replay rewrites its output tensor; counts the replays by the rows of the output."""

    def __init__(self) -> None:
        self.replays: dict[int, int] = {}

    def __call__(self, fn):
        output = fn()

        def replay():
            self.replays[output.shape[0]] = self.replays.get(output.shape[0], 0) + 1
            output.copy_(fn())

        return replay, output


def test_capture_sizes_follow_vllm():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def _llm(path, graphs: Rerun | None):
    llm = LLM(model=str(path), attention_backend="torch", block_size=8, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=512)
    if graphs is not None:
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.scale, capture_sizes(8), 512 // 8,
                                     capture=graphs)
    return llm


def _requests(vocab):
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in (5, 17, 70, 1, 33, 9)]
    # Different lengths: the decode batch shrinks as they end, so steps pad to 4, 2 and 1 rows.
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 3, 9, 6, 1, 15)]
    return [{"prompt_token_ids": p} for p in prompts], params


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_replayed_decode_gives_the_eager_tokens(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    eager = _llm(path, None)
    prompts, params = _requests(eager.engine.model_config.vocab_size)
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params, use_tqdm=False)]
    rerun = Rerun()
    llm = _llm(path, rerun)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert {4, 2, 1} <= set(rerun.replays), rerun.replays  # shrinking batches: padded rows replayed too
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


def test_samples_and_beams_replay_as_eager(tiny_model_factory):
    """Forks share blocks and copy on write before the forward; a replay must see the copies."""
    path = tiny_model_factory("qwen2")
    sampled = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)
    beams = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 141))}
    results = []
    for graphs in (None, Rerun()):
        llm = _llm(path, graphs)
        outs = llm.generate([prompt, prompt], [sampled, beams], use_tqdm=False)
        results.append([[list(c.token_ids) for c in o.outputs] for o in outs])
        if graphs is not None:
            assert graphs.replays
        llm.engine.check_integrity()
    assert results[0] == results[1]


def test_mixed_and_oversized_steps_run_eagerly(tiny_model_factory):
    llm = _llm(tiny_model_factory("llama"), Rerun())
    graphs = llm.engine.runner.graphs
    from engine.attention import AttentionMetadata
    import torch

    def meta(nd, width=4):
        z = torch.zeros(0, dtype=torch.int32)
        return AttentionMetadata(torch.zeros(nd, dtype=torch.long), nd, torch.zeros((nd, width), dtype=torch.int32),
                                 torch.ones(nd, dtype=torch.int32), z.view(0, 1), z, torch.zeros(1, dtype=torch.int32),
                                 1.0)

    assert graphs.fits(3, meta(3))
    assert not graphs.fits(5, meta(3))  # a prefill chunk beside the decodes
    assert not graphs.fits(9, meta(9))  # more rows than the largest graph
    assert not graphs.fits(3, meta(3, width=65))  # a table wider than max_model_len allows
    graphs.enabled = False
    assert not graphs.fits(3, meta(3))

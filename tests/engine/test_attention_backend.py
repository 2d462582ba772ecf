"""The engine picks its attention ops by config: torch references on CPU by default, Triton when
forced (here through the Triton interpreter, as on a GPU-less CI machine)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def test_default_backend_on_cpu_is_cpu(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=32)
    assert llm.engine.runner.ops.name == "cpu"  # the C attention and KV-store kernels


def test_forced_triton_backend_gives_the_same_tokens(tiny_model_factory):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    path = str(tiny_model_factory("mistral"))  # MQA: 4 query heads share 1 KV head
    prompts = [{"prompt_token_ids": list(range(300, 300 + n))} for n in (3, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu", "triton"):
        # block_size 8 with a 24-token budget: chunked prefill over a cached prefix, prefix hits
        # with a copy-on-write block, and decodes all go through the chosen kernels.
        llm = LLM(model=path, attention_backend=backend, block_size=8, num_kv_blocks=64, max_num_batched_tokens=24)
        assert llm.engine.runner.ops.name == backend
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[2:], params, use_tqdm=False)  # 39 of 40 prompt tokens cached
        assert again[0].num_cached_tokens == 39
        outs[backend] = [o.outputs[0].token_ids for o in first + again]
    assert outs["triton"] == outs["torch"] == outs["cpu"]

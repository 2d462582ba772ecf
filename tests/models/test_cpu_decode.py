"""CpuDecodeStack: decode-only steps through the C kernels directly give the modules' bits."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.cpu_decode import CpuDecodeStack


def _llm(path, dtype, **kwargs):
    return LLM(model=str(path), dtype=dtype, num_kv_blocks=96, max_num_seqs=16, enable_prefix_caching=False,
               **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])  # MHA; GQA with q/k/v biases; MQA
@pytest.mark.parametrize("batch", [1, 3, 12])  # 1: F.linear; 3: C linears; 12: past bf16's 8 C rows
def test_decode_steps_match_the_modules_bit_for_bit(tiny_model_factory, monkeypatch, arch, dtype, batch):
    llm = _llm(tiny_model_factory(arch), dtype)
    runner = llm.engine.runner
    if runner.decode_stack is None:
        pytest.skip("no C kernels on this machine: the modules run every step")
    checked = []
    modules_forward = runner._forward

    def both(input_ids, positions, attn):
        if not runner.decode_stack.covers(attn, input_ids.shape[0]):
            return modules_forward(input_ids, positions, attn)
        before = runner.kv_cache.clone()
        ref = runner.model(input_ids, positions, runner.kv_cache, attn)
        ref_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        out = runner.decode_stack(input_ids, positions, runner.kv_cache, attn)
        assert torch.equal(out, ref)
        assert torch.equal(runner.kv_cache, ref_cache)  # the same K/V in the same slots
        checked.append(input_ids.shape[0])
        return out

    monkeypatch.setattr(runner, "_forward", both)
    prompts = [{"prompt_token_ids": [7 + 11 * i + j for j in range(3 + 5 * i)]} for i in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * batch
    assert checked and max(checked) == batch
    llm.engine.check_integrity()
    assert llm.kv_cache_usage()["num_in_use"] == 0  # every block back once the requests end


def test_only_decode_only_steps_on_the_cpu_backend_take_the_stack(tiny_model_factory):
    path = tiny_model_factory("llama")
    llm = _llm(path, "float32")
    stack = llm.engine.runner.decode_stack
    if stack is None:
        pytest.skip("no C kernels on this machine")
    model = llm.engine.runner.model
    assert CpuDecodeStack.build(model, "torch", torch.device("cpu")) is None  # the reference backend
    assert CpuDecodeStack.build(model, "cpu", torch.device("meta")) is None
    assert _llm(path, "float32", attention_backend="torch").engine.runner.decode_stack is None
    # A mixed step (a prefill chunk beside decodes) runs through the modules.
    taken = []
    original = stack.__class__.__call__
    try:
        stack.__class__.__call__ = lambda self, *a: taken.append(a[0].shape[0]) or original(self, *a)
        llm.generate([{"prompt_token_ids": list(range(10, 40))}, {"prompt_token_ids": list(range(50, 53))}],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        stack.__class__.__call__ = original
    assert taken and all(n <= 2 for n in taken)

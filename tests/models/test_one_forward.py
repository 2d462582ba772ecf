"""One forward, several op sets: the model's single forward under the bound CPU ops gives the bits of
the checking CPU launchers and agrees with the torch references, on decode-only and mixed steps."""
import pytest
import torch

from engine import LLM, SamplingParams
from kernels import native_kernels
from kernels.cpu.ops import checked_cpu_ops
from kernels.ops import reference_ops

# bfloat16: the C kernels and the references round at different points; a few KV elements land one
# bfloat16 step apart after several layers (measured: 3 of 393,216 by 0.13).
TOL = {"float32": {"atol": 1e-4, "rtol": 1e-4}, "bfloat16": {"atol": 0.25, "rtol": 0.1}}


def _llm(path, dtype, **kwargs):
    return LLM(model=str(path), dtype=dtype, num_kv_blocks=96, max_num_seqs=16, enable_prefix_caching=False,
               **kwargs)


def _run_with(model, ops, input_ids, positions, kv_cache, attn):
    bound = model.ops
    model.bind_ops(ops)
    try:
        return model(input_ids, positions, kv_cache, attn)
    finally:
        model.bind_ops(bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])  # MHA; GQA + biases; GQA + q/k norms; MQA
@pytest.mark.parametrize("batch", [1, 3, 12])  # 1: oneDNN / F.linear; 3: C linears; 12: past bf16's 8 C rows
def test_bound_cpu_ops_match_checked_launchers_and_references(tiny_model_factory, monkeypatch, arch, dtype, batch):
    if native_kernels() is None:
        pytest.skip("no C compiler: the cpu set is the checking launchers (references)")
    # The bound ops measure which form takes which row count, the checking launchers follow the flags: bind
    # the flags' forms here so both run the same kernels (on AVX2 the measured split lands anywhere from 8 to
    # 16 float32 rows; tests/kernels/test_dispatch.py covers the measuring)
    import kernels.cpu.ops as ops_mod
    from kernels.cpu.dispatch import EVERY
    from kernels.cpu.linear import c_kernel_rows

    def flags_rows(dispatch, weight, *, gated, small, large, limit, rows=None):
        upto = c_kernel_rows(weight.dtype)
        return EVERY if upto >= EVERY else min(upto, limit)

    monkeypatch.setattr(ops_mod, "linear_small_rows", flags_rows)
    monkeypatch.setattr(ops_mod, "gemm_form", lambda dispatch, weight, candidates, rows=None: next(iter(candidates)))
    llm = _llm(tiny_model_factory(arch), dtype)
    runner = llm.engine.runner
    assert runner.model.ops.name == "cpu"
    live_forward = runner._forward
    steps = {"decode": 0, "mixed": 0}

    def compare(input_ids, positions, attn):
        before = runner.kv_cache.clone()
        results = {}
        for name, ops in (("checked", checked_cpu_ops()), ("reference", reference_ops())):
            runner.kv_cache.copy_(before)
            out = _run_with(runner.model, ops, input_ids, positions, runner.kv_cache, attn)
            results[name] = (out, runner.kv_cache.clone())
        runner.kv_cache.copy_(before)
        out = live_forward(input_ids, positions, attn)
        assert torch.equal(out, results["checked"][0])  # the same kernels on the same operands
        assert torch.equal(runner.kv_cache, results["checked"][1])
        torch.testing.assert_close(out, results["reference"][0], **TOL[dtype])
        torch.testing.assert_close(runner.kv_cache, results["reference"][1], **TOL[dtype])
        steps["decode" if attn.num_decode_tokens == input_ids.shape[0] else "mixed"] += 1
        return out

    monkeypatch.setattr(runner, "_forward", compare)
    prompts = [{"prompt_token_ids": [7 + 11 * i + j for j in range(3 + 5 * i)]} for i in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * batch
    assert steps["decode"] and steps["mixed"]
    llm.engine.check_integrity()
    assert llm.kv_cache_usage()["num_in_use"] == 0


def test_backends_bind_their_op_sets(tiny_model_factory):
    path = tiny_model_factory("llama")
    assert _llm(path, "float32", attention_backend="torch").engine.runner.model.ops.name == "torch"
    model = _llm(path, "float32").engine.runner.model
    assert model.ops.name == "cpu" and not any(p.requires_grad for p in model.parameters())
    norm = model.model.layers[0].input_layernorm
    with pytest.raises(ValueError, match="contiguous"):
        norm.weight = torch.nn.Parameter(torch.randn(2 * norm.weight.shape[0])[::2], requires_grad=False)
        model.bind_ops(model.ops)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_vocabulary_is_held_once(tiny_model_factory, dtype, monkeypatch):
    """A tied LM head packed in the lanes layout serves the embedding lookup too: the table is released, the
    model gives the tokens of the same kernels reading the table, and binding again brings it back exactly."""
    import kernels.cpu.ops as ops_mod

    if native_kernels() is None:
        pytest.skip("no C compiler: the cpu set packs nothing")
    path = tiny_model_factory("llama", tie_word_embeddings=True)
    llm = _llm(path, dtype)
    model = llm.engine.runner.model
    if not getattr(model._lm_head, "lanes", False):
        pytest.skip("the head's form here is not the lanes layout")
    assert model.model.embed_tokens.weight.device.type == "meta" and model.lm_head.weight is model.model.embed_tokens.weight
    monkeypatch.setattr(ops_mod, "row_reader", lambda form: None)  # the same kernels, the table kept
    fresh = _llm(path, dtype)
    assert fresh.engine.runner.model.model.embed_tokens.weight.device.type == "cpu"
    prompts = [{"prompt_token_ids": list(range(100 + 9 * i, 120 + 9 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    theirs = [o.outputs[0].token_ids for o in fresh.generate(prompts, params, use_tqdm=False)]
    assert ours == theirs
    model.bind_ops(reference_ops())
    table = fresh.engine.runner.model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, table) and model.lm_head.weight is model.model.embed_tokens.weight


def _second_forms_bytes(llm, dtype: str) -> int:
    """Bytes of the second forms the dispatcher keeps on purpose: a weight whose measured choice binds one kernel
    to small row counts and another above (each its own form) where that saves >= 10% (kernels/cpu/dispatch.py).
    On an Intel Xeon with AMX the tiny model's bfloat16 head kept lanes up to 8 rows and oneDNN above."""
    size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    total = 0
    for choice in llm.engine.dispatch.choices.values():
        if choice.op in ("linear", "linear_silu_mul") and len(choice.names()) > 1:
            n, k = map(int, choice.key.split()[-1].split("x"))
            total += n * k * size
    return total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_are_held_once_and_come_back_exactly_to_bind_again(tiny_model_factory, dtype):
    """The CPU ops pack each linear into their own form and the module's plain tensor is released; binding the
    torch references unpacks them exactly (the same forward as a model that never released them)."""
    from engine.models.packed_weights import resident_bytes

    if native_kernels() is None:
        pytest.skip("no C compiler: the cpu set packs nothing")
    path = tiny_model_factory("qwen2")  # biases: kept beside their released weights
    llm = _llm(path, dtype)
    model = llm.engine.runner.model
    linears = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)]
    released = [m.weight.device.type == "meta" for m in linears]
    packs_copies = any(type(w.qkv).__name__ == "CpuLinearWeight" and w.qkv.lanes for w in model._layers)
    assert all(released) == packs_copies and (any(released) or not packs_copies)
    fresh = _llm(path, dtype, attention_backend="torch").engine.runner.model  # never packed, never released
    plain = sum(p.numel() * p.element_size() for p in fresh.parameters())
    if packs_copies:  # lanes padding aside, one copy (a tied head would add its table once: qwen2's is not tied)
        assert resident_bytes(model) < 1.1 * plain + _second_forms_bytes(llm, dtype)
    model.bind_ops(reference_ops())
    for a, b in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]

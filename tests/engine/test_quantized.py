"""Quantized GGUF weights served quantized (engine/models/quantized.py): GGUF files written here with
the `gguf` package round-trip, the quantized model tracks the dequantized one, weights shrink, the
default model answers in 4 bits, and what cannot run quantized fails at load, by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.gguf_weights import GGUFTensors, UnsupportedQuantizationError, layout_of
from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf
from fixtures.gguf_writer import write_tiny_gguf
from kernels.quant_linear import QuantizedWeight, dequantize

pytest.importorskip("gguf")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """GGUF files and their conversions in a private cache (the user's cache stays untouched)."""
    folder = tmp_path_factory.mktemp("gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFIXSERVE_CACHE_DIR", str(folder / "cache"))
    yield folder
    mp.undo()


def _tiny(gguf_dir, kind: str):
    path = gguf_dir / f"tiny.{kind}.gguf"
    if not path.exists():
        write_tiny_gguf(path, _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL]), linear_type=kind)
    return path


# Every type the gguf package can write at these shapes (TQ1_0 / TQ2_0 need rows of 256; the K-quants are read
# but not written by it: tests/engine/test_gemma3_gguf.py serves a real Q4_K_M file's Q4_K and Q6_K).
WRITABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"]
MIXED = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "MXFP4", "attn_output": "F16", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_1", "ffn_down": "Q5_1"}


@pytest.mark.parametrize("kind", WRITABLE)
def test_every_written_type_round_trips_through_its_layout(gguf_dir, kind):
    from gguf.quants import dequantize as gguf_dequantize

    tensors = GGUFTensors(_tiny(gguf_dir, kind))
    assert tensors.type_of("blk.0.ffn_up.weight") == kind
    raw = tensors._tensors["blk.0.ffn_up.weight"]
    reference = torch.from_numpy(np.asarray(gguf_dequantize(raw.data, raw.tensor_type))).float()
    form = tensors.quantized("blk.0.ffn_up.weight")
    layout = layout_of(kind)
    if layout == "dense":
        assert isinstance(form, torch.Tensor) and torch.equal(form.float(), reference)
        return
    assert isinstance(form, QuantizedWeight) and form.layout.startswith(layout)
    ours = dequantize(form)
    row_max = reference.abs().amax(1, keepdim=True)
    if layout == "int4":  # Q4_0 / Q4_1 exactly, up to bfloat16 scales
        assert ((ours - reference).abs() <= 0.02 * row_max).all()
    else:  # one scale per row: half a step of 1/127 of the row's largest magnitude, and the scale's bfloat16
        assert ((ours - reference).abs() <= row_max * (1 / 254 + 2**-8) + 1e-6).all()


def test_a_mixed_type_file_serves_each_tensor_in_its_layout(gguf_dir, caplog):
    """As llama.cpp writes Q4_K_M: types mixed by tensor. Each is served in its type's layout (a fused group
    in its finest), the log says what went where, and the model tracks its dequantized self."""
    import logging

    from transformers import AutoModelForCausalLM

    from engine.models.resolve import resolve_model
    from engine_testlib import assert_quantized_tracks_hf

    path = gguf_dir / "tiny.mixed.gguf"
    write_tiny_gguf(path, _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL]), linear_type="Q4_0", types=MIXED)
    with caplog.at_level(logging.INFO, logger="prefixserve"):
        # float32: "auto" would serve this int4 file in bfloat16 on a CPU with AVX512-BF16, and HF tracks in float32
        quant = LLM(model=str(path), quantization="gguf", dtype="float32", num_kv_blocks=64)
    layouts = quant.model_info.weight_bytes_by_layout
    assert {"int4", "int8", "float32"} <= set(layouts), layouts  # gate/up int4, q/k/v and down int8, o dense
    logged = " ".join(r.getMessage() for r in caplog.records)
    for kind in ("Q5_0 -> int8", "MXFP4 -> int8", "F16 -> dense", "Q4_1 -> int4", "Q5_1 -> int8"):
        assert kind in logged, logged
    layer = quant.engine.runner.model.model.layers[0]
    assert type(layer.self_attn.o_proj).__name__ == "DenseLinear"
    assert layer.mlp.gate_up_proj.weight.layout.startswith("int4") and layer.self_attn.qkv_proj.weight.layout == "int8"
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(str(path)), dtype=torch.float32).eval()
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(4)]
    assert_quantized_tracks_hf(quant, hf, prompts)


def test_a_type_nothing_reads_fails_at_load_naming_tensor_and_type(gguf_dir, monkeypatch):
    import engine.models.gguf_weights as gw

    path = _tiny(gguf_dir, "Q5_0")
    monkeypatch.setattr(gw, "readable", lambda kind: kind != "Q5_0")  # as a type the gguf package cannot read
    with pytest.raises(UnsupportedQuantizationError, match=r"tensor blk\.0\.attn_q\.weight is Q5_0"):
        LLM(model=str(path), quantization="gguf", num_kv_blocks=16)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_model_tracks_the_dequantized_one(gguf_dir, kind, monkeypatch):
    path = _tiny(gguf_dir, kind)
    # The LM head's logits through the int8 table alone (a machine may measure a bfloat16 copy faster and keep
    # it beside: tests/kernels/test_dispatch.py), so the bytes below are the quantized tables'
    monkeypatch.setenv("PREFIXSERVE_KERNELS", "lm_head=int8pack")
    quant = LLM(model=str(path), quantization="gguf", num_kv_blocks=64)
    dense = LLM(model=str(path), quantization="none", num_kv_blocks=64)
    assert quant.model_info.quantization == "gguf" and dense.model_info.quantization == "none"
    assert quant.model_info.weight_bytes * 3 <= dense.model_info.weight_bytes
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 7 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    q_out = quant.generate(prompts, params, use_tqdm=False)
    d_out = dense.generate(prompts, params, use_tqdm=False)
    # The next-token distributions track each other: the same top tokens with close logprobs (the
    # argmax itself may flip where two tokens are within ~0.1 nat: bfloat16 activations, 4-bit scales).
    # Q8_0 is requantized to one scale per row (torch has no grouped int8 kernel): a second rounding,
    # measured up to 0.3 nat on this random model, whose large weights amplify it.
    tolerance = 0.5 if kind == "Q8_0" else 0.25
    for q, d in zip(q_out, d_out):
        q_top, d_top = q.outputs[0].logprobs[0], d.outputs[0].logprobs[0]
        shared = set(q_top) & set(d_top)
        assert len(shared) >= 4, (q_top, d_top)
        assert all(abs(q_top[t].logprob - d_top[t].logprob) < tolerance for t in shared), (q_top, d_top)
    # Caching, forks and chunked prefill run unchanged on quantized weights.
    again = quant.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens > 0
    quant.engine.check_integrity()


def test_steps_without_prompt_tokens_take_one_activation_digit(gguf_dir, monkeypatch):
    """The C int4 kernel's precision per step: a step holding prompt tokens with two int8 digits per input (so a
    prompt's first output token is as precise as before), a step of generated tokens alone with one (half the
    multiply-adds at batch 8), at every row count; a prompt's last token computed alone after a cache hit is a
    prompt token."""
    from kernels.cpu import int4_linear as il

    if not il.supports(16, 32, 32):
        pytest.skip("no C int4 kernel on this CPU")
    calls: list[tuple[int, bool]] = []
    kernel = il.int4_linear_unchecked

    def recorded(x, packed, scales, group_size, two_digits=True):
        calls.append((x.shape[0], two_digits))
        return kernel(x, packed, scales, group_size, two_digits)

    quant = LLM(model=str(_tiny(gguf_dir, "Q4_0")), quantization="gguf", num_kv_blocks=64, speculative_config=None)
    monkeypatch.setattr(il, "int4_linear_unchecked", recorded)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 7 * i))} for i in range(3)]
    outs = quant.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    prefill = {two for rows, two in calls if rows > 3}
    decode = {(rows, two) for rows, two in calls if rows <= 3}
    assert prefill == {True}  # the prompts' chunks: 40+ rows
    assert decode == {(3, False)}  # the three sequences' decode steps
    # 33 tokens: again, its first 32 come from the cache and the 33rd runs alone, as a decode row of the kernels
    prompt = {"prompt_token_ids": list(range(300, 333))}
    quant.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    calls.clear()
    again = quant.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    per_step = len(calls) // 2  # two forwards of one row: the prompt's last token, then a decode
    assert {two for _, two in calls[:per_step]} == {True} and {two for _, two in calls[per_step:]} == {False}
    quant.engine.check_integrity()


def test_gguf_quantization_needs_a_quantized_gguf(tiny_model_factory):
    with pytest.raises(UnsupportedQuantizationError, match="no quantized GGUF"):
        LLM(model=str(tiny_model_factory("llama")), quantization="gguf", num_kv_blocks=16)
    with pytest.raises(Exception, match="quantization must be one of"):
        LLM(model=str(tiny_model_factory("llama")), quantization="int3")


@pytest.mark.real_model
def test_default_model_in_four_bits_answers_and_is_small(smollm2_path):
    quant = LLM(quantization="gguf", num_kv_blocks=128)
    dense_bytes = sum(4 * int(np.prod(s.get_shape())) for s in _dense_param_shapes(smollm2_path))
    info = quant.model_info
    assert info.quantization == "gguf" and info.weight_bytes * 3 <= dense_bytes
    params = SamplingParams(temperature=0, max_tokens=24)
    # Q4_1 answers "What is the capital of France?" from a near-tie ("The" -1.92 / "L" -2.01 as its first token,
    # AVX2 CPU): attention differing at float32 rounding (the C kernel vs SDPA: 6e-6 apart in the dense model's
    # logprobs) moved them by ~0.05 through the 4-bit linears and flipped it. This one leads by 1.4 there.
    answer = quant.chat([{"role": "user", "content": "Name the capital of France."}], params, use_tqdm=False)
    assert "Paris" in answer[0].outputs[0].text
    assert "Paris" in quant.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text


def _dense_param_shapes(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return [f.get_slice(k) for k in f.keys()]


def test_a_file_with_a_type_the_gguf_package_cannot_read_is_refused_before_converting(gguf_dir, monkeypatch):
    """Q8_1 (llama.cpp's activation type) in a weight: nothing here reads it, and the refusal names it, before
    transformers' converter would fail on it deeper down."""
    import gguf
    from gguf import quants

    write = quants.quantize

    def raw_q8_1(a, qtype):  # the gguf package writes no Q8_1: its bytes, zeros
        if qtype == gguf.GGMLQuantizationType.Q8_1:
            return np.zeros((a.shape[0], a.shape[1] // 32 * 40), dtype=np.uint8)
        return write(a, qtype)

    monkeypatch.setattr(quants, "quantize", raw_q8_1)
    path = write_tiny_gguf(gguf_dir / "tiny.q8_1.gguf", _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL]),
                           linear_type="Q4_0", types={"ffn_down": "Q8_1"})
    with pytest.raises(UnsupportedQuantizationError, match=r"tensor blk\.0\.ffn_down\.weight is Q8_1"):
        LLM(model=str(path), num_kv_blocks=16)

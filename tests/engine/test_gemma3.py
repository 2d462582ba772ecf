"""Gemma 3 through the one Llama-family forward: greedy parity with HF transformers (eager) in float32
on tiny random-weight models whose sliding window (16) is far shorter than the prompts, so the
local layers' window, their own rope, the sandwich norms, the +1 norm offset, the scaled embeddings
and the GELU-tanh MLP all decide tokens. Chunked prefill, prefix-cache hits and preemption run
through the same block tables."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidConfigError
from engine.models.config import load_model_config

from engine_testlib import assert_greedy_match, hf_greedy

LENGTHS = [5, 17, 150, 1, 64, 33, 90, 8]


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def _hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len, vocab]
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _our_prompt_logprobs(out, ids: list[int]) -> list[float]:
    return [getattr(out.prompt_logprobs[i][ids[i]], "logprob", out.prompt_logprobs[i][ids[i]])
            for i in range(1, len(ids))]


def test_config_reads_gemma3(tiny_model_factory):
    cfg = load_model_config(tiny_model_factory("gemma3"))
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_windows == (16, 16, 0) and [cfg.window(i) for i in range(3)] == [16, 16, 0]
    assert cfg.hidden_act == "gelu_tanh" and cfg.sandwich_norms and cfg.norm_offset and cfg.qk_norm
    assert cfg.embed_scale == pytest.approx(8.0) and cfg.attention_scale == pytest.approx(16 ** -0.5)
    assert cfg.sliding_window is None  # per layer: no cap on max_model_len


def test_old_style_config_with_sliding_window_pattern(tiny_model_factory, tmp_path):
    """Configs written before layer_types (Gemma 3's release) give the pattern and the local base."""
    src = tiny_model_factory("gemma3")
    raw = json.loads((src / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw.update(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(tmp_path)
    assert cfg.layer_windows == (16, 16, 0)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("final_softcap", [None, 2.0])
def test_gemma3_matches_hf(block_size, final_softcap, tiny_model_factory, hf_model_loader):
    path = tiny_model_factory("gemma3", final_softcap=final_softcap)
    llm = LLM(model=str(path), block_size=block_size, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = _prompts(llm.engine.model_config.vocab_size, LENGTHS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    refs = hf_greedy(hf_model_loader(path), prompts, 12)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"gemma3 block {block_size} prompt {i}")
    assert llm.kv_cache_usage()["num_in_use"] == 0
    llm.engine.check_integrity()


def test_gemma3_prompt_logprobs_with_cache_hits_and_chunks(tiny_model_factory, hf_model_loader):
    """Every position's logprob equals HF's (1e-4) for a 200-token prompt computed in 48-token chunks,
    and for a second prompt that reads its first 160 tokens (10x the window) from the prefix cache."""
    path = tiny_model_factory("gemma3")
    hf = hf_model_loader(path)
    llm = LLM(model=str(path), block_size=16, num_kv_blocks=128, max_num_batched_tokens=48, max_num_seqs=4)
    first = _prompts(llm.engine.model_config.vocab_size, [200], seed=5)[0]
    second = first[:160] + _prompts(llm.engine.model_config.vocab_size, [40], seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out1 = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0]
    llm.generate([{"prompt_token_ids": first}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": second}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 144  # read from the cache, not recomputed
    torch.testing.assert_close(torch.tensor(_our_prompt_logprobs(out1, first)),
                               torch.tensor(_hf_prompt_logprobs(hf, first)), atol=1e-4, rtol=0)
    ref = hf_greedy(hf, [second], 4)[0]
    assert_greedy_match(hit.outputs[0].token_ids, ref, "cache hit")
    llm.engine.check_integrity()


def test_gemma3_bfloat16_tracks_float32(tiny_model_factory):
    path = tiny_model_factory("gemma3")
    prompts = [{"prompt_token_ids": p} for p in _prompts(49152, [40, 90], seed=7)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(path), dtype=dtype, num_kv_blocks=64, max_num_seqs=2)
        runs[dtype] = [_our_prompt_logprobs(o, p["prompt_token_ids"]) for o, p in
                       zip(llm.generate(prompts, params, use_tqdm=False), prompts)]
        del llm
    for a, b in zip(runs["float32"], runs["bfloat16"]):  # the random model's logprobs are ~ -35: relative
        a, b = torch.tensor(a), torch.tensor(b)
        assert (a - b).abs().mean() < 0.01 * a.abs().mean()  # measured 0.16 of 33 (0.5%)


def test_unsupported_gemma_settings_are_refused(tiny_model_factory, tmp_path):
    src = tiny_model_factory("gemma3")
    for key, value, match in (("hidden_activation", "relu", "hidden_activation"),
                              ("use_bidirectional_attention", True, "bidirectional")):
        raw = json.loads((src / "config.json").read_text())
        raw[key] = value
        (tmp_path / "config.json").write_text(json.dumps(raw))
        with pytest.raises(InvalidConfigError, match=match):
            load_model_config(tmp_path)


def test_gemma3_vision_language_checkpoint_serves_its_text_model(tiny_model_factory, hf_model_loader, tmp_path):
    """Gemma3ForConditionalGeneration: the language model's weights (model.language_model.*, and
    Google's original language_model.model.* names) are served, the vision tower is not loaded; greedy
    text output equals HF's multimodal model and our run of the same weights as Gemma3ForCausalLM."""
    from safetensors.torch import load_file, save_file

    path = tiny_model_factory("gemma3_mm")
    assert load_model_config(path).architecture == "Gemma3ForConditionalGeneration"
    prompts = _prompts(49152, [5, 40, 90], seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refs = hf_greedy(hf_model_loader(path), prompts, 8)
    text_only = LLM(model=str(tiny_model_factory("gemma3")), num_kv_blocks=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in text_only.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                    use_tqdm=False)]
    del text_only
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (legacy / f.name).write_bytes(f.read_bytes())
    state = load_file(str(path / "model.safetensors"))
    save_file({k.replace("model.language_model.", "language_model.model.").replace("model.vision_tower.", "vision_tower.")
               .replace("model.multi_modal_projector.", "multi_modal_projector."): v for k, v in state.items()},
              str(legacy / "model.safetensors"))
    for folder in (path, legacy):
        llm = LLM(model=str(folder), num_kv_blocks=64, max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert_greedy_match(out.outputs[0].token_ids, ref, f"{folder.name} prompt {i}")
            assert out.outputs[0].token_ids == expected[i]
        del llm


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory, tiny_model_factory, smollm2_path):
    """(HF folder, {kind: GGUF written from it as llama.cpp writes Gemma 3}), converted in a private cache
    (smollm2_path first: the default model's conversion stays in the user's cache)."""
    pytest.importorskip("gguf")
    from engine.models.resolve import BUILTIN_MODELS, DEFAULT_MODEL, _builtin_gguf
    from fixtures.gguf_writer import write_gemma3_gguf

    src = tiny_model_factory("gemma3", layer_types=["sliding_attention"] * 5 + ["full_attention"],
                             tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFIXSERVE_CACHE_DIR", str(folder / "cache"))
    files = {kind: write_gemma3_gguf(folder / f"tiny-gemma3.{kind}.gguf", src,
                                     _builtin_gguf(BUILTIN_MODELS[DEFAULT_MODEL]), kind) for kind in ("F32", "Q8_0")}
    yield src, files
    mp.undo()


def test_gemma3_gguf_runs_as_its_hf_source(gemma3_gguf, hf_model_loader):
    """An unquantized GGUF (norms stored 1 + w, no query_pre_attn_scalar, llama.cpp's layer pattern)
    gives HF's logprobs at every position; Q8_0 served quantized tracks them."""
    src, files = gemma3_gguf
    prompt = _prompts(49152, [120], seed=11)[0]
    ref = torch.tensor(_hf_prompt_logprobs(hf_model_loader(src), prompt))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    dense = LLM(model=str(files["F32"]), num_kv_blocks=64)
    assert dense.engine.model_config.layer_windows == (16,) * 5 + (0,)
    assert dense.engine.model_config.attention_scale == pytest.approx(16 ** -0.5)
    got = torch.tensor(_our_prompt_logprobs(dense.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0],
                                            prompt))
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
    del dense
    quant = LLM(model=str(files["Q8_0"]), num_kv_blocks=64)
    assert quant.model_info.quantization == "gguf"
    got = torch.tensor(_our_prompt_logprobs(quant.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0],
                                            prompt))
    assert (got - ref).abs().mean() < 0.02 * ref.abs().mean()

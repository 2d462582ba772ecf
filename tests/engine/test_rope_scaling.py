"""RoPE scaling types as Llama 3.x, Qwen and Mistral checkpoints carry them: greedy parity with HF
transformers in float32 for every static type (frequencies fixed at load), and a clear error
naming the supported types for the ones whose frequencies follow the running length."""
from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidConfigError
from engine.models.config import STATIC_ROPE_TYPES, load_model_config

from engine_testlib import assert_greedy_match, hf_greedy

# Short original contexts, so prompts of a few hundred tokens run past them (where llama3 and yarn
# change the low frequencies and yarn scales the attention).
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in (9, 140, 300)]


@pytest.mark.parametrize("rope", sorted(SCALINGS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_rope_types_match_hf(arch, rope, tiny_model_factory, hf_model_loader):
    path = tiny_model_factory(arch, rope_scaling=SCALINGS[rope])
    assert load_model_config(path).rope_type == rope
    llm = LLM(model=str(path), num_kv_blocks=128, max_num_batched_tokens=128, max_num_seqs=4)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy(hf_model_loader(path), prompts, 10))):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"{arch}/{rope} prompt {i}")


def _rewrite_config(src, dst, edit) -> None:
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))


def test_legacy_rope_scaling_key_is_read(tiny_model_factory, hf_model_loader, tmp_path):
    """A Llama 3.1-style config.json (rope_scaling + rope_theta, no rope_parameters) gives the same
    frequencies and tokens as the transformers >= 5 spelling."""
    path = tiny_model_factory("llama", rope_scaling=SCALINGS["llama3"])

    def legacy(raw):
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = params

    _rewrite_config(path, tmp_path / "legacy", legacy)
    assert load_model_config(tmp_path / "legacy").rope_type == "llama3"
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = [{"prompt_token_ids": _prompts(49152)[2]}]
    new = LLM(model=str(path), num_kv_blocks=64).generate(prompt, params, use_tqdm=False)
    old = LLM(model=str(tmp_path / "legacy"), num_kv_blocks=64).generate(prompt, params, use_tqdm=False)
    assert old[0].outputs[0].token_ids == new[0].outputs[0].token_ids


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_length_dependent_rope_types_are_refused(rope, tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")

    def edit(raw):
        raw["rope_parameters"].update({"rope_type": rope, "factor": 2.0})

    _rewrite_config(path, tmp_path / rope, edit)
    with pytest.raises(InvalidConfigError, match=rope) as err:
        load_model_config(tmp_path / rope)
    assert all(t in str(err.value) for t in STATIC_ROPE_TYPES)
    with pytest.raises(InvalidConfigError):
        LLM(model=str(tmp_path / rope), num_kv_blocks=16)


def test_partial_rotary_factor_is_refused(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")
    _rewrite_config(path, tmp_path / "partial", lambda raw: raw.update(partial_rotary_factor=0.5))
    with pytest.raises(InvalidConfigError, match="partial_rotary_factor"):
        load_model_config(tmp_path / "partial")

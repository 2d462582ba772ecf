"""Shared by engine tests: the HF reference, the near-tie comparison rule, a checked step loop."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# THE NEAR-TIE RULE. Our greedy tokens must equal HF transformers' greedy tokens on the same
# float32 weights. Batched and chunked computation reorders floating-point sums, so where the two
# top logits are almost equal the argmax may legitimately flip. A difference is accepted only at
# a step where HF's top-2 logit gap is below NEAR_TIE (1e-3); after such a flip the continuations
# are unrelated, so comparison stops there. Any other difference fails the test.
NEAR_TIE = 1e-3


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at each generated step


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_ids=()) -> list[Reference]:
    """HF `generate()` greedy, one prompt at a time (no padding), with per-step logits, on the model's device.

    EOS is unset for the run (our `ignore_eos`): HF's `min_new_tokens` would instead *mask* EOS
    and so pick a different token than an unconstrained greedy step."""
    refs = []
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        outs = [model.generate(
            torch.tensor([ids], device=model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        ) for ids in prompts]
    finally:
        model.generation_config.eos_token_id = saved_eos
    for ids, out in zip(prompts, outs):
        tokens = out.sequences[0, len(ids):].tolist()
        gaps = []
        for step_logits in out.logits:
            top2 = step_logits[0].float().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        refs.append(Reference(tokens, gaps))
    return refs


def assert_greedy_match(ours: list[int], ref: Reference, label: str = "") -> None:
    for j, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a != b:
            assert ref.gaps[j] < NEAR_TIE, (
                f"{label}: token {j} differs ({a} vs HF {b}) and HF's top-2 gap {ref.gaps[j]:.2e} "
                f"is not a near-tie (< {NEAR_TIE})"
            )
            return
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens vs HF {len(ref.tokens)}"


def assert_dequantized_matches_hf(folder, hf_reference, prompts: list[list[int]], max_tokens: int = 10):
    """A quantized checkpoint served with quantization="none": greedy tokens as HF's on the dequantized
    weights (``hf_reference``: a float32 transformers model), under the near-tie rule."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(folder), quantization="none", num_kv_blocks=64)
    assert llm.model_info.quantization == "none"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy(hf_reference, prompts, max_tokens))):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"prompt {i}")


def assert_quantized_tracks_hf(llm, hf_reference, prompts: list[list[int]], bound: float = 0.5) -> dict:
    """The served quantized model's first-token top-5 against HF's float32 on the dequantized weights:
    at least 4 of 5 shared, each shared logprob within ``bound`` nat; the differences by token."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    diffs = {}
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        with torch.no_grad():
            ref = hf_reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        ours = out.outputs[0].logprobs[0]
        top = set(ref.topk(5).indices.tolist())
        assert len(top & set(ours)) >= 4
        diffs.update({t: round(abs(ours[t].logprob - float(ref[t])), 3) for t in top & set(ours)})
    assert all(d < bound for d in diffs.values()), diffs
    llm.engine.check_integrity()
    return diffs


def linear_weight_bytes(llm) -> tuple[int, int]:
    """(bytes of the decoder layers' linear weights as held, their count of weights): quantized tables
    at their packed size, dense ones at their dtype's."""
    from engine.models.quantized import QuantizedLinear

    held = count = 0
    for layer in llm.engine.runner.model.model.layers:
        for m in layer.modules():
            if isinstance(m, QuantizedLinear):
                held, count = held + m.qweight.nbytes, count + m.qweight.out_features * m.qweight.in_features
            elif isinstance(m, torch.nn.Linear):
                held, count = held + m.weight.numel() * m.weight.element_size(), count + m.weight.numel()
    return held, count


def run_checked(engine) -> dict:
    """Step to completion, checking block integrity after every step; final outputs by request id."""
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    return finals


def random_ids(n: int, seed: int) -> list[int]:
    """n random token ids (away from the special tokens), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def tiny_llm(path, **kw):
    """An LLM on a tiny model with a small pool and small steps (chunked prefill shows up early)."""
    from engine import LLM

    args = dict(block_size=16, num_kv_blocks=128, max_num_batched_tokens=64, max_num_seqs=8)
    args.update(kw)
    return LLM(model=str(path), **args)

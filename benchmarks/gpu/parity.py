"""The parity step: greedy tokens of the engine (float32, Triton attention on the device, decode steps
replaying its CUDA graphs) against HF
transformers' own greedy generate on the same device in float32, under the tests' near-tie rule
(tests/engine/engine_testlib.py): a token may differ only where HF's top-2 logit gap is below 1e-3.

Models: the tests' tiny random models of each architecture (tests/fixtures/tiny_models.py), and a
random-weight model of SmolLM2-135M's shape with its real tokenizer (its weights, 98 MB even as Q4_1,
do not fit the 64 MiB that travels to the GPU machine). Prompts of mixed lengths, some longer than the
token budget, so chunked prefill runs beside decodes as in tests/engine/test_parity.py."""
from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT / "tests", ROOT / "tests" / "engine"):
    sys.path.insert(0, str(extra))

# SmolLM2-135M-Instruct's config (the converted GGUF's config.json), random weights.
SMOLLM2_SHAPE = dict(hidden_size=576, num_layers=30, num_heads=9, head_dim=64, num_kv_heads=3, intermediate_size=1536,
                     tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=2048)
MODELS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}), "mistral": ("mistral", {}),
          "gemma3": ("gemma3", {}), "smollm2-shape": ("llama", SMOLLM2_SHAPE)}
DRY_RUN_MODELS = ("llama", "gemma3")
PROMPT_LENGTHS = (5, 17, 150, 1, 64, 33, 90, 8)
MAX_TOKENS = 12


def model_folder(ctx, name: str) -> Path:
    """The step's model ``name`` (MODELS), written once per run into the shared work folder."""
    from fixtures.tiny_models import make_tiny_model

    folder = ctx.work / name
    if not (folder / "config.json").exists():
        arch, kwargs = MODELS[name]
        make_tiny_model(folder, arch, tokenizer_dir=ctx.tokenizer_dir(), **kwargs)
    return folder


def parity_step(ctx, result: dict) -> dict:
    result["models"] = {}
    names = DRY_RUN_MODELS if ctx.dry_run else tuple(MODELS)
    for name in names:
        try:
            result["models"][name] = compare_model(ctx, name)
        except Exception as exc:  # the next model still runs
            import traceback

            traceback.print_exc()
            result["models"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {result['models'][name]}", flush=True)
        ctx.save(result)
    result["ok"] = all(m.get("ok") for m in result["models"].values())
    return ctx.save(result)


def compare_model(ctx, name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu.steps import free_device_memory
    from engine import LLM, SamplingParams
    from engine_testlib import assert_greedy_match, hf_greedy

    folder = model_folder(ctx, name)
    # Speculation off, as the default leaves it on a GPU: on the dry run's CPU "auto" would turn it on and
    # measure a step's cost at up to 256 tokens through the Triton interpreter (a minute per engine).
    llm = LLM(model=str(folder), device=ctx.device, dtype="float32", attention_backend="triton", block_size=16,
              num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8, speculative_config=None)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    lengths = PROMPT_LENGTHS[:4] if ctx.dry_run else PROMPT_LENGTHS
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]
    max_tokens = 4 if ctx.dry_run else MAX_TOKENS
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    graphs = llm.engine.runner.graphs  # decode steps replay CUDA graphs on a GPU (engine/cuda_graphs.py)
    graph_sizes = graphs.sizes if graphs else None
    llm.engine.check_integrity()
    in_use = llm.kv_cache_usage()["num_in_use"]
    del llm, outs, graphs
    free_device_memory()
    # Eager attention: the one HF path with Gemma's soft caps (as tests/engine/conftest.py).
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    hf = hf.to(ctx.device).eval()
    refs = hf_greedy(hf, prompts, max_tokens)
    del hf
    free_device_memory()
    verdicts = []
    for i, (tokens, ref) in enumerate(zip(ours, refs)):
        try:
            assert_greedy_match(tokens, ref, f"{name} prompt {i}")
            verdicts.append("same" if tokens == ref.tokens else "near-tie")
        except AssertionError as exc:
            verdicts.append(str(exc))
    identical = sum(v == "same" for v in verdicts)
    return {"ok": all(v in ("same", "near-tie") for v in verdicts) and in_use == 0, "prompts": len(prompts),
            "identical": identical, "verdicts": verdicts, "blocks_in_use_after": in_use,
            "cuda_graph_sizes": graph_sizes}

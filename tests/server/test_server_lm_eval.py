"""lm-evaluation-harness' `local-completions` model against a real server on the real SmolLM2 (fp32):
a multiple-choice task (loglikelihoods from echo + logprobs over token-id prompts) whose numbers
must equal the engine's own prompt logprobs, and a generate_until task that must return text.
The tasks and their data are tests/fixtures/lm_eval_tasks/."""
from __future__ import annotations

import math
import pathlib

import pytest
from server_testlib import run_uvicorn, shutdown_engine, wait_for_idle

from app.server import create_app
from engine import LLM, SamplingParams

pytestmark = pytest.mark.real_model

TASKS = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_tasks"
TOL = 1e-4  # float32: the server's and a second in-process engine's numbers


@pytest.fixture(scope="module")
def lm_eval_server(smollm2_path):
    from engine import AsyncEngine, EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(
        model=str(smollm2_path), dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=8,
        max_model_len=2048,
    ))
    engine.start()
    try:
        with run_uvicorn(create_app(engine, served_model_names=["smollm2"])) as url:
            yield engine, url
    finally:
        shutdown_engine(engine)


@pytest.fixture(scope="module")
def evaluation(lm_eval_server, smollm2_path, tmp_path_factory):
    """simple_evaluate over both tasks, run from the tasks' folder (their data_files are relative)."""
    engine, url = lm_eval_server
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    mp.chdir(TASKS)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager

        model_args = (f"base_url={url}/v1/completions,model=smollm2,tokenizer={smollm2_path},"
                      "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args, tasks=["prefixserve_mc", "prefixserve_gen"],
            task_manager=TaskManager(include_path=str(TASKS)), log_samples=True, random_seed=0,
            numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
        )
        wait_for_idle(engine)
        lm = lm_eval.api.registry.get_model("local-completions").create_from_arg_string(model_args)
        yield results, lm
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """A second engine in this process (no HTTP) over the same weights."""
    return LLM(model=str(smollm2_path), dtype="float32", num_kv_blocks=64, max_model_len=2048)


def _requests(sample: dict) -> list[tuple[str, str]]:
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def test_loglikelihoods_equal_the_engines_prompt_logprobs(evaluation, reference):
    results, lm = evaluation
    samples = results["samples"]["prefixserve_mc"]
    assert len(samples) == 5
    compared = 0
    for sample in samples:
        pairs = _requests(sample)
        assert len(pairs) == len(sample["doc"]["choices"]) == len(sample["resps"])
        for (context, continuation), resp in zip(pairs, sample["resps"]):
            loglikelihood, _greedy = resp[0]
            ctx, cont = lm._encode_pair(context, continuation)
            out = reference.generate({"prompt_token_ids": ctx + cont},
                                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                     use_tqdm=False)[0]
            ours = sum(entry[t].logprob for t, entry in zip(cont, out.prompt_logprobs[len(ctx):]))
            assert math.isfinite(loglikelihood) and loglikelihood < 0
            assert float(loglikelihood) == pytest.approx(ours, abs=TOL)
            compared += 1
    assert compared == sum(len(s["doc"]["choices"]) for s in samples) == 17
    accuracy = results["results"]["prefixserve_mc"]["acc,none"]
    assert 0.0 <= accuracy <= 1.0


def test_generate_until_returns_text(evaluation, reference):
    results, lm = evaluation
    samples = results["samples"]["prefixserve_gen"]
    assert len(samples) == 3
    for sample in samples:
        (context, gen_kwargs), = [(a[0], a[1]) for a in _gen_args(sample)]
        text = sample["resps"][0][0]
        assert isinstance(text, str) and text.strip()
        # The same greedy continuation as the engine in-process, cut at the same stop strings.
        ours = reference.generate({"prompt_token_ids": lm.tok_encode(context)}, SamplingParams(
            temperature=0, max_tokens=gen_kwargs["max_gen_toks"], stop=gen_kwargs["until"]), use_tqdm=False)[0]
        assert text == ours.outputs[0].text
    assert "exact_match,none" in results["results"]["prefixserve_gen"]


def _gen_args(sample: dict) -> list[tuple[str, dict]]:
    args = sample["arguments"]
    if isinstance(args, dict):
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]

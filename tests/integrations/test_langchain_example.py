"""The LangChain page's example (docs/langchain.md): its code is the example script's, and the script runs (on
the session engine, so the model is not loaded again) with the cache hits it promises."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from integrations.langchain import ChatPrefixServe

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "langchain_rag_agent.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("langchain_rag_agent", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_code_is_the_example_script():
    page = (REPO / "docs" / "langchain.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    script_lines = [line.strip() for line in SCRIPT.read_text().splitlines()]
    for line in code.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            assert any(line in s for s in script_lines), f"docs/langchain.md line not in {SCRIPT.name}: {line}"


@pytest.mark.real_model
def test_example_runs_and_hits_the_cache(lc_engine, capsys):
    example = _load_example()
    chat = ChatPrefixServe(engine=lc_engine, cache_salt="readme-example", **example.SETTINGS)
    answers, steps = example.run(chat)
    printed = capsys.readouterr().out
    assert printed.count("prompt tokens from cache") == len(answers) + len(steps)
    first, *later = [a.usage_metadata for a in answers]
    assert first["input_token_details"]["cache_read"] < 32  # a fresh cache namespace
    for usage in later:  # the system prompt and the retrieved context come from the cache
        assert usage["input_token_details"]["cache_read"] >= usage["input_tokens"] - 32
    assert steps[0].tool_calls[0]["name"] == "get_order_status"
    assert steps[0].tool_calls[0]["args"] == {"order_number": 1042}
    for step in steps[1:]:  # each step re-sends the conversation so far
        assert step.usage_metadata["input_token_details"]["cache_read"] > 0.8 * step.usage_metadata["input_tokens"]

"""ChatPrefixServe beyond the standard suites: prefix-cache hits, n>1, logprobs, errors as LangChain
types, timeouts and early exits that free the engine, the offline-LLM mode, per-call models.

Real SmolLM2 (the session engine, served in-process and by uvicorn) where the model matters; a tiny
random-weight model where only the mechanics do.
"""
from __future__ import annotations

import asyncio
import time

import openai
import pytest
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelInvalidRequestError,
    ModelNotFoundError,
    ModelRateLimitError,
    ModelTimeoutError,
)
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_testlib import run_uvicorn, wait_idle

import engine
from integrations.langchain import ChatPrefixServe

MODES = ("inprocess", "remote")
LONG_SYSTEM = "You answer questions about the prefixserve inference engine in one short sentence. " * 20


@pytest.fixture
def make_chat(request, lc_engine, lc_server_url):
    """make_chat(mode, **fields) -> a ChatPrefixServe over the session engine, in-process or remote."""
    made = []

    def make(mode: str, **fields) -> ChatPrefixServe:
        fields = {"temperature": 0, "max_tokens": 4, **fields}
        if mode == "inprocess":
            chat = ChatPrefixServe(engine=lc_engine, model="smollm2", **fields)
        else:
            chat = ChatPrefixServe(base_url=lc_server_url, model="smollm2", max_retries=0, **fields)
        made.append(chat)
        return chat

    yield make
    for chat in made:
        chat.close()
    wait_idle(lc_engine)


# -- the real model, both modes ---------------------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
async def test_second_call_reads_shared_system_prompt_from_cache(make_chat, mode):
    chat = make_chat(mode, cache_salt=f"cache-read-{mode}")  # a fresh namespace: nothing cached yet
    first = chat.invoke([SystemMessage(LONG_SYSTEM), HumanMessage("What is a KV cache?")])
    details = first.usage_metadata["input_token_details"]
    assert details["cache_read"] < 32  # at most the chat template's opening block
    second = None
    async for chunk in chat.astream([SystemMessage(LONG_SYSTEM), HumanMessage("What is paged attention?")]):
        second = chunk if second is None else second + chunk
    usage = second.usage_metadata
    # Everything up to the question is shared; full blocks of it are served from the cache.
    assert usage["input_tokens"] > 300
    assert usage["input_tokens"] - 32 <= usage["input_token_details"]["cache_read"] < usage["input_tokens"]
    assert second.response_metadata["model_provider"] == "prefixserve"


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
def test_n_returns_n_generations_with_one_usage(make_chat, mode):
    chat = make_chat(mode, n=3, temperature=1.0, seed=7, max_tokens=3)
    result = chat.generate([[HumanMessage("Name a color.")]])
    generations = result.generations[0]
    assert len(generations) == 3
    usage = generations[0].message.usage_metadata
    assert 3 <= usage["output_tokens"] <= 9  # one usage for the request: all three samples' tokens
    assert all(g.message.usage_metadata == usage for g in generations)
    assert len({g.text for g in generations}) > 1  # distinct seeds: distinct samples
    with pytest.raises(ModelInvalidRequestError):
        next(iter(chat.stream("Hi")))


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
def test_logprobs_in_response_metadata(make_chat, mode):
    chat = make_chat(mode, logprobs=True, top_logprobs=2, max_tokens=3)
    message = chat.invoke("Say hi.")
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == message.usage_metadata["output_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)
    assert "".join(entry["token"] for entry in content) == message.content
    streamed = None
    for chunk in chat.stream("Say hi."):
        streamed = chunk if streamed is None else streamed + chunk
    assert [e["token"] for e in streamed.response_metadata["logprobs"]["content"]] == [e["token"] for e in content]
    plain = chat.invoke("Say hi.", logprobs=False)  # a per-call override
    assert "logprobs" not in plain.response_metadata


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
async def test_request_errors_are_langchain_types(make_chat, mode):
    chat = make_chat(mode)
    backend_error = engine.ContextLengthExceededError if mode == "inprocess" else openai.BadRequestError
    with pytest.raises(ContextOverflowError) as info:
        chat.invoke("overflow " * 2500)
    assert isinstance(info.value, backend_error)
    with pytest.raises(ContextOverflowError):
        async for _ in chat.astream("overflow " * 2500):
            pass
    with pytest.raises(ModelInvalidRequestError):
        await chat.ainvoke("Hi", temperature=-1.0)
    with pytest.raises(ModelInvalidRequestError):  # tool_choice names a tool that is not bound
        chat.invoke("Hi", tools=[{"type": "function", "function": {"name": "a"}}],
                    tool_choice={"type": "function", "function": {"name": "b"}})
    with pytest.raises(ModelNotFoundError):
        chat.invoke("Hi", model="no-such-model")


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
async def test_timeout_and_early_exit_free_the_engine(make_chat, lc_engine, mode):
    chat = make_chat(mode, max_tokens=400, model_kwargs={"ignore_eos": True}, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ModelTimeoutError):
        await chat.ainvoke("Tell me a long story.")
    assert time.monotonic() - started < 5
    wait_idle(lc_engine)  # the request was aborted, its KV blocks freed
    with pytest.raises(ModelTimeoutError):
        chat.invoke("Tell me a long story.")
    wait_idle(lc_engine)
    for chunk in chat.stream("Tell me a long story.", timeout=None):
        assert chunk.content
        break  # leaving the stream aborts the request
    wait_idle(lc_engine)


# -- in-process specifics ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.mark.real_model
def test_per_call_model_builds_and_closes_another_engine(lc_engine, tiny_path):
    chat = ChatPrefixServe(engine=lc_engine, model="smollm2", max_tokens=3, temperature=0,
                           engine_kwargs={"num_kv_blocks": 32, "max_model_len": 256})
    assert chat.invoke("Hi").response_metadata["model_name"] == "smollm2"
    # The engine's own model (as it was loaded) addresses the same engine.
    same = chat.invoke("Hi", model=str(lc_engine.engine.config.model))
    assert same.usage_metadata["input_token_details"]["cache_read"] > 0
    other = chat.invoke("Hi", model=str(tiny_path))
    assert other.response_metadata["model_name"] == str(tiny_path)
    built = chat._get_backend()._runners[str(tiny_path)].engine
    assert built is not lc_engine and built.is_running
    chat.close()
    assert built.is_running and lc_engine.is_running  # the leased one idles (shared_engines.py); given ones are the owner's
    from integrations.langchain.shared_engines import shared_engines

    shared_engines().close_idle()
    assert not built.is_running and lc_engine.is_running


def test_offline_llm_mode_shares_steps_and_frees_blocks(tiny_path):
    llm = engine.LLM(model=str(tiny_path), num_kv_blocks=64, max_model_len=512)
    chat = ChatPrefixServe(llm=llm, max_tokens=6, temperature=0)
    first = chat.invoke("Hello there")
    assert first.usage_metadata["output_tokens"] >= 1
    assert chat.invoke("Hello there").usage_metadata["input_token_details"]["cache_read"] > 0
    streamed = list(chat.stream("Hello there"))
    assert streamed[-1].chunk_position == "last" and streamed[-1].usage_metadata["output_tokens"] >= 1
    assert "".join(c.content for c in streamed) == first.content  # greedy: the same text

    async def concurrent():
        return await chat.abatch([f"question {i}" for i in range(4)], max_tokens=5)

    answers = asyncio.run(concurrent())
    assert len(answers) == 4 and all(a.usage_metadata["output_tokens"] >= 1 for a in answers)
    for _ in chat.stream("Tell me more", max_tokens=200, ignore_eos=True):
        break  # an abandoned stream aborts its request
    # The LLM is driven through its AsyncEngine, as the server drives its engine: the abort reaches
    # the engine loop within a step or two.
    deadline = time.monotonic() + 5
    while llm.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.engine.has_unfinished() and llm.kv_cache_usage()["num_in_use"] == 0
    with pytest.raises(ContextOverflowError):
        chat.invoke("word " * 600)


def test_mode_validation():
    with pytest.raises(ValueError):
        ChatPrefixServe(base_url="http://127.0.0.1:9/v1", engine=object())
    with pytest.raises(ValueError):
        ChatPrefixServe(llm=object(), engine=object())
    chat = ChatPrefixServe(model="smollm2-135m-instruct", max_completion_tokens=5, stop_sequences="x", n=2)
    assert (chat.max_tokens, chat.stop, chat.n) == (5, "x", 2)  # nothing is built before a call
    assert chat._get_ls_params(stop=None, model="override")["ls_model_name"] == "override"


# -- remote specifics: HTTP status codes -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    small = engine.AsyncEngine.from_config(engine.EngineConfig(model=str(tiny_path), num_kv_blocks=64,
                                                               max_model_len=512, max_num_seqs=1))
    small.start()
    yield small
    asyncio.run(small.shutdown())


def test_http_statuses_map_to_langchain_errors(tiny_engine):
    from app.server import create_app

    app = create_app(tiny_engine, served_model_names=["tiny"], api_key="right", max_waiting_requests=0)
    with run_uvicorn(app) as url:
        fields = {"base_url": url, "model": "tiny", "max_retries": 0, "temperature": 0}
        with pytest.raises(ModelAuthenticationError) as info:
            ChatPrefixServe(api_key="wrong", **fields).invoke("Hi")
        assert isinstance(info.value, openai.AuthenticationError)
        chat = ChatPrefixServe(api_key="right", **fields)
        busy = chat.stream("Tell me everything", max_tokens=400, ignore_eos=True)
        assert next(busy).content is not None  # holding the engine's only slot (max_num_seqs=1, no queue)
        with pytest.raises(ModelRateLimitError):
            chat.invoke("Hi", max_tokens=2)
        busy.close()
        wait_idle(tiny_engine)
        assert chat.invoke("Hi", max_tokens=2).usage_metadata["output_tokens"] >= 1
    loading = create_app(None, served_model_names=["tiny"])  # the model is still loading: 503
    with run_uvicorn(loading) as url:
        with pytest.raises(ModelAPIError) as info:
            ChatPrefixServe(base_url=url, model="tiny", max_retries=0).invoke("Hi")
        assert isinstance(info.value, openai.InternalServerError)
    with pytest.raises(ModelConnectionError):  # nothing listens there any more
        ChatPrefixServe(base_url=url, model="tiny", max_retries=0, timeout=2).invoke("Hi")


def test_integrations_use_only_the_engine_public_api():
    """integrations -> engine's public API (names exported by engine/__init__.py), never app."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "integrations"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for module in modules:
                top = module.split(".")[0]
                assert top not in ("app", "kernels", "prefix_cache"), f"{path.name} imports {module}"
                if top == "engine":
                    assert module == "engine", f"{path.name} imports {module}: use engine's exports"
                    names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                    assert set(names) <= set(engine.__all__), f"{path.name} imports non-public {names}"


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
def test_forced_tool_choice_ends_with_the_complete_call(make_chat, mode):
    """The reported case: tool_choice "any" (OpenAI's "required") with parallel calls allowed, where
    SmolLM2 repeats the same call; the repeat ends the output, invoked and streamed."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    chat = make_chat(mode, max_tokens=200).bind_tools([get_weather], tool_choice="any")
    question = [HumanMessage("What's the weather in Paris?")]
    message = chat.invoke(question)
    streamed = None
    for chunk in chat.stream(question):
        streamed = chunk if streamed is None else streamed + chunk
    for result in (message, streamed):
        assert result.response_metadata["finish_reason"] == "tool_calls"
        assert result.content == "" and not result.invalid_tool_calls
        assert [(c["name"], c["args"]) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.real_model
@pytest.mark.parametrize("mode", MODES)
def test_prompt_cache_key_retains_the_session_between_turns(make_chat, mode, lc_engine):
    """An agent's session: the first turn's context is retained (in-process usage says how much was newly
    retained), the next turn reads it back; the key travels as a request field remotely."""
    chat = make_chat(mode, cache_salt=f"retain-{mode}", prompt_cache_key="agent-session")
    turn = [SystemMessage(LONG_SYSTEM), HumanMessage("What is a KV cache?")]
    first = chat.invoke(turn)
    details = first.usage_metadata["input_token_details"]
    if mode == "inprocess":
        assert details["cache_creation"] >= first.usage_metadata["input_tokens"] - 32 - details["cache_read"]
    second = chat.invoke(turn + [first, HumanMessage("And paged attention?")])
    assert second.usage_metadata["input_token_details"]["cache_read"] >= first.usage_metadata["input_tokens"] - 32

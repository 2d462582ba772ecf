"""LangChain's standard chat-model suites, for both modes of ChatPrefixServe, on the real SmolLM2.

In-process runs on the session's AsyncEngine; remote goes through a real uvicorn on 127.0.0.1 serving
that same engine. Test model parameters (both modes):
- max_tokens 64 keeps the ~45 generations per suite short on a CPU, yet fits a short joke as JSON;
- temperature 0 + frequency_penalty 1.0: greedy SmolLM2-135M loops ("A cat is a cat, right? A cat
  is ...") until max_tokens, which cuts JSON strings off; a penalty on tokens it already generated
  breaks the loops (repetition_penalty would also penalize the prompt: the "3" of magic_function(3),
  and the end-of-turn token, so answers would never end);
- parallel_tool_calls False: under tool_choice "required" the grammar allows further calls, and a
  135M model repeats the same call until max_tokens; one call per turn is what the suite expects.
"""
from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from integrations.langchain import ChatPrefixServe

pytestmark = pytest.mark.real_model

GENERATION_PARAMS = {"max_tokens": 64, "temperature": 0, "frequency_penalty": 1.0, "parallel_tool_calls": False}


class _Declared:
    """Capabilities declared by both modes."""

    @property
    def chat_model_class(self) -> type[ChatPrefixServe]:
        return ChatPrefixServe

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        """Two calls sharing a long system prompt: the second reads it from the prefix cache."""
        from langchain_core.messages import HumanMessage, SystemMessage

        model = self.chat_model_class(**{**self.chat_model_params, "max_tokens": 4})
        system = SystemMessage("You are a terse assistant for a cat shelter. " * 24)
        last = None
        for question in ("Name one cat breed.", "Name one cat toy."):
            messages = [system, HumanMessage(question)]
            if stream:
                last = None
                for chunk in model.stream(messages):
                    last = chunk if last is None else last + chunk
            else:
                last = model.invoke(messages)
        assert last.usage_metadata["input_token_details"]["cache_read"] > 0
        return last


# Standard tests SmolLM2-135M fails by capability, whatever the adapter does (checked on both modes):
_JSON_MODE = ("json_mode guarantees a JSON object, not its keys: SmolLM2-135M nests them "
              '({"setup": {"punchline": ...}}), which the parser rejects')
_AUTO_TOOLS = ('under tool_choice "auto" (the model decides) SmolLM2-135M answers in prose ("The weather in San '
               'Francisco is mostly sunny") instead of calling get_weather: it was not trained for tool use')
_UNICODE = ("SmolLM2-135M copies the placeholder '<string>' as customer_name instead of the Chinese name; the "
            "grammar only guarantees a string")


class _CapabilityXfails:
    @pytest.mark.xfail(reason=_JSON_MODE)
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason=_AUTO_TOOLS)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=_UNICODE)
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)


# -- unit suites (no generation) ----------------------------------------------------------------
class TestInProcessUnit(_Declared, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m-instruct"}  # the engine is built on first use: never here


class TestRemoteUnit(_Declared, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"base_url": "http://127.0.0.1:9/v1", "model": "smollm2"}  # nothing is contacted

    @property
    def init_from_env_params(self):
        env = {"PREFIXSERVE_BASE_URL": "http://127.0.0.1:8000/v1", "PREFIXSERVE_API_KEY": "secret"}
        return env, {"model": "smollm2"}, {"base_url": "http://127.0.0.1:8000/v1", "api_key": "secret"}


# -- integration suites (real generation) -----------------------------------------------------------
# ~45 generations each: about 2 minutes per suite on a busy 2-core CPU, so also marked slow.
@pytest.mark.slow
class TestInProcessIntegration(_CapabilityXfails, _Declared, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _engine(self, lc_engine) -> None:
        self.engine = lc_engine

    @property
    def chat_model_params(self) -> dict:
        # `model` labels the given engine; the model it was loaded from (its folder) also addresses it.
        return {"engine": self.engine, "model": "smollm2", **GENERATION_PARAMS}

    @property
    def model_override_value(self) -> str:
        return str(self.engine.engine.config.model)


@pytest.mark.slow
class TestRemoteIntegration(_CapabilityXfails, _Declared, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _server(self, lc_server_url) -> None:
        self.base_url = lc_server_url

    @property
    def chat_model_params(self) -> dict:
        return {"base_url": self.base_url, "model": "smollm2", "api_key": "unused", **GENERATION_PARAMS}

    @property
    def model_override_value(self) -> str:
        return "smollm2-alias"

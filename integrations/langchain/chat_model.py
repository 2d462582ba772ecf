"""ChatPrefixServe: a LangChain chat model over prefixserve, in-process or remote.

One class, two backends chosen by the fields given:

    ChatPrefixServe(model="smollm2-135m-instruct")          # builds an engine in this process
    ChatPrefixServe(engine=async_engine) / (llm=offline_llm) # uses an engine you already have
    ChatPrefixServe(base_url="http://127.0.0.1:8000/v1", api_key=..., model="smollm2")  # a server

Why not subclass langchain_openai's `BaseChatOpenAI` for the remote mode: that class *is* an OpenAI
HTTP client (its fields, validators and request building all assume one), so the in-process mode
would have to override nearly all of it, and the two modes would differ in fields and defaults. Here
both modes share every field, the per-call overrides, the message conversion, the result shaping
(usage with cache hits, metadata, one final stream chunk) and the error types; only a small backend
object differs (inprocess.py: the engine's public API; remote.py: the official `openai` client, which
also gives timeouts, retries with backoff and the OpenAI error types). langchain_openai is not needed.

Behaviour both modes share:
- `usage_metadata.input_token_details.cache_read` = prompt tokens served from the prefix cache
  (engine: RequestOutput.num_cached_tokens; server: usage.prompt_tokens_details.cached_tokens).
- `response_metadata`: finish_reason ("stop" | "length" | "tool_calls"), model_name, model_provider
  ("prefixserve"), and logprobs (OpenAI's `{"content": [...]}`) when `logprobs=True`.
- Streaming yields one chunk per text delta (tool calls as `tool_call_chunks`) and exactly one final
  chunk with `chunk_position="last"` carrying usage and metadata (LangChain sums chunk metadata, so
  nothing is repeated on other chunks). Streaming needs n == 1; `invoke` with n > 1 returns n
  generations (`generate` / `ChatResult`; `invoke` returns the first).
- Tool calling (`bind_tools`) and structured output (`with_structured_output`) are constrained by a
  grammar in the engine, so a forced call or a schema output is valid JSON whatever the model.
  tool_choice "auto" lets the model choose (native template format when the template has one, else a
  system-prompt section in the Hermes <tool_call> format: see engine/tool_calls.py).
- Errors are `langchain_core.exceptions` types that also subclass the backend's own (errors.py).
"""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from engine import close_json_schema
from integrations.langchain._types import PROVIDER, CallOptions, Completion, Delta, StreamEnd, Usage
from integrations.langchain.errors import InvalidOptionError, from_engine_error, from_openai_error

# Sampling fields passed on when set (OpenAI names); anything else goes to the backend as `extra`.
_SAMPLING_FIELDS = ("temperature", "top_p", "max_tokens", "seed", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")
_ALIASES = {"max_tokens": ("max_completion_tokens",), "model": ("model_name",), "stop": ("stop_sequences",),
            "timeout": ("request_timeout",)}
_REASONING_BLOCKS = frozenset({"thinking", "reasoning", "redacted_thinking"})


class ChatPrefixServe(BaseChatModel):
    """prefixserve chat model (see the module docstring).

    In-process: `model` (a builtin name, HF folder or .gguf; default SmolLM2-135M-Instruct) builds an
    `AsyncEngine` from `EngineConfig(model=..., **engine_kwargs)` on first use; or pass `engine=` (an
    `engine.AsyncEngine`) or `llm=` (an `engine.LLM`) to use one you built (then `model` is only the
    name reported, unless a call names another model, which builds another engine). Remote:
    `base_url` (env PREFIXSERVE_BASE_URL) and `api_key` (env PREFIXSERVE_API_KEY).

    Every sampling field can be overridden per call: `chat.invoke(msgs, temperature=0, model="x")`.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, protected_namespaces=())

    model_name: str | None = Field(default=None, alias="model")
    """Model name: in-process, what to load (or the label of a given engine); remote, the served name
    (None: the server's default)."""
    llm: Any = Field(default=None, exclude=True)
    """An `engine.LLM` to run in-process (its Engine is driven by the callers' threads)."""
    engine: Any = Field(default=None, exclude=True)
    """An `engine.AsyncEngine` to run in-process."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """`EngineConfig` options for engines this model builds (dtype, num_kv_blocks, max_model_len, ...)."""
    base_url: str | None = Field(default_factory=from_env("PREFIXSERVE_BASE_URL", default=None))
    """The server's OpenAI base URL ("http://host:8000/v1"; a bare "http://host:8000" gets /v1)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("PREFIXSERVE_API_KEY", default=None))
    """The server's --api-key (remote mode only)."""
    temperature: float | None = None
    max_tokens: int | None = Field(default=None, alias="max_completion_tokens")
    """Most tokens to generate; None: up to the end of the context window."""
    stop: list[str] | str | None = Field(default=None, alias="stop_sequences")
    seed: int | None = None
    n: int = 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool | None = None
    """Return token logprobs in response_metadata["logprobs"]."""
    top_logprobs: int | None = None
    streaming: bool = False
    """Make `invoke` stream internally (callbacks get tokens as they come)."""
    timeout: float | None = Field(default=None, alias="request_timeout")
    """Seconds a call may take; in-process the request is then aborted (its KV blocks freed)."""
    max_retries: int = 2
    """Retries of a remote request on connection errors, 429 and 5xx (with backoff). In-process there is
    nothing transient to retry."""
    parallel_tool_calls: bool | None = None
    """Whether one turn may call several tools (None: yes, as OpenAI). False makes a forced call exactly
    one call, which suits small models that would otherwise repeat the call."""
    cache_salt: str | None = None
    """Prefix-cache namespace: requests share cached KV only with requests of the same salt."""
    prompt_cache_key: str | None = None
    """A session (OpenAI's field): the context of its latest call stays cached past the call (retained: evicted
    after everything else) for the server's --prompt-cache-ttl, so an agent's next turn after a tool call reads
    it back. ``usage_metadata.input_token_details.cache_creation``: prompt tokens newly retained (in-process)."""
    prompt_cache_retention: str | None = None
    """"in_memory" (the default) or "24h"."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other request fields: SamplingParams fields in-process, request-body fields (extra_body) remote."""
    http_client: Any = Field(default=None, exclude=True)
    """An httpx.Client for the remote mode (e.g. a Litestar TestClient)."""
    http_async_client: Any = Field(default=None, exclude=True)

    _backend: Any = PrivateAttr(default=None)
    _backend_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="after")
    def _check_mode(self) -> ChatPrefixServe:
        if self.base_url and (self.llm is not None or self.engine is not None):
            raise ValueError("Give either base_url (remote) or llm/engine (in-process), not both.")
        if self.llm is not None and self.engine is not None:
            raise ValueError("Give either llm= (an engine.LLM) or engine= (an engine.AsyncEngine), not both.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        return self

    # -- identity ---------------------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "prefixserve-chat"

    @property
    def is_remote(self) -> bool:
        return bool(self.base_url)

    @property
    def _default_model(self) -> str:
        """The model name a call without `model=` reports (no engine is built, nothing is fetched)."""
        if self.model_name:
            return self.model_name
        source = self.engine if self.engine is not None else self.llm
        if source is not None:
            return source.model_info.model
        if self.is_remote:
            return "default"  # the server's first served name
        from engine import EngineConfig

        return EngineConfig().model

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params = {"model_name": self._default_model, "base_url": self.base_url, "n": self.n,
                  "cache_salt": self.cache_salt}
        params.update({name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None})
        return params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider=PROVIDER, ls_model_name=kwargs.get("model") or self._default_model,
                                 ls_model_type="chat")
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = _stop_list(stop if stop is not None else kwargs.get("stop", self.stop))
        if stops:
            params["ls_stop"] = stops
        return params

    # -- backend ----------------------------------------------------------------------------------
    def _get_backend(self):
        with self._backend_lock:
            if self._backend is None:
                if self.is_remote:
                    from integrations.langchain.remote import RemoteBackend

                    self._backend = RemoteBackend(
                        base_url=self.base_url, api_key=self.api_key.get_secret_value() if self.api_key else None,
                        timeout=self.timeout, max_retries=self.max_retries, default_model=self.model_name,
                        http_client=self.http_client, http_async_client=self.http_async_client,
                    )
                else:
                    from integrations.langchain.inprocess import InProcessBackend

                    self._backend = InProcessBackend(model=self.model_name, llm=self.llm, engine=self.engine,
                                                     engine_kwargs=self.engine_kwargs)
            return self._backend

    def close(self) -> None:
        """Shut down the engines this model built (in-process) or its HTTP clients (remote)."""
        with self._backend_lock:
            backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def _raise(self, exc: Exception) -> None:
        """Re-raise `exc` as its LangChain-typed error."""
        mapped = from_openai_error(exc) if self.is_remote else from_engine_error(exc)
        if mapped is exc:
            raise exc
        raise mapped from exc

    # -- per-call options -------------------------------------------------------------------------
    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> CallOptions:
        kw = dict(kwargs)
        kw.pop("stream", None)  # LangChain's own flag; streaming is chosen by the method called

        def take(name: str) -> Any:
            value, found = None, False
            for key in (name, *_ALIASES.get(name, ())):
                if key in kw:
                    candidate = kw.pop(key)
                    if not found:
                        value, found = candidate, True
            return value if found else getattr(self, name if name != "model" else "model_name")

        model = take("model") or self.model_name
        sampling = {}
        for name in _SAMPLING_FIELDS:
            value = take(name)
            if value is not None:
                sampling[name] = value
        n = take("n")
        call_stop = take("stop")
        stops = _stop_list(stop if stop is not None else call_stop)
        response_format = kw.pop("response_format", None)
        if isinstance(response_format, type):
            response_format = _response_format(response_format, strict=None)
        return CallOptions(
            model=model, sampling=sampling, stop=stops, n=1 if n is None else n,
            logprobs=bool(take("logprobs")), top_logprobs=take("top_logprobs"), cache_salt=take("cache_salt"),
            timeout=take("timeout"), tools=kw.pop("tools", None) or None, tool_choice=kw.pop("tool_choice", None),
            parallel_tool_calls=take("parallel_tool_calls"), response_format=response_format,
            extra={**self._retention_fields(), **self.model_kwargs, **kw},
        )

    def _retention_fields(self) -> dict[str, Any]:
        """prompt_cache_key / prompt_cache_retention where set: SamplingParams fields in-process, request-body
        fields remote (as model_kwargs travel)."""
        return {name: getattr(self, name) for name in ("prompt_cache_key", "prompt_cache_retention")
                if getattr(self, name) is not None}

    # -- generation -------------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        try:
            options = self._options(stop, kwargs)
            completion = self._get_backend().complete(_openai_messages(messages), options)
        except Exception as exc:
            self._raise(exc)
        return _chat_result(completion)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        try:
            options = self._options(stop, kwargs)
            completion = await self._get_backend().acomplete(_openai_messages(messages), options)
        except Exception as exc:
            self._raise(exc)
        return _chat_result(completion)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        try:
            options = self._stream_options(stop, kwargs)
            for event in self._get_backend().stream(_openai_messages(messages), options):
                chunk = _chunk(event)
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        except Exception as exc:
            self._raise(exc)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        try:
            options = self._stream_options(stop, kwargs)
            events = self._get_backend().astream(_openai_messages(messages), options)
            try:
                async for event in events:
                    chunk = _chunk(event)
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
            finally:
                await events.aclose()
        except Exception as exc:
            self._raise(exc)

    def _stream_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> CallOptions:
        options = self._options(stop, kwargs)
        if options.n != 1:
            raise InvalidOptionError(f"Streaming returns one generation; n must be 1, got {options.n}.")
        return options

    # -- tools and structured output --------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (OpenAI function format). tool_choice: None/"auto" (the model decides), "none",
        "any"/"required"/True (must call one; under a grammar), or a tool name (must call that one)."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, tool_choice=_tool_choice(tool_choice, formatted), **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Outputs that match `schema` (a Pydantic class, TypedDict, or JSON Schema dict).

        json_schema: the engine decodes under the schema (response_format json_schema): always valid.
        function_calling: a forced call of one tool whose parameters are the schema (also constrained).
        json_mode: any JSON object (response_format json_object); the prompt must ask for the keys.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method {method!r} needs a schema.")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, parallel_tool_calls=False,
                                  ls_structured_output_format=ls_format)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                response_format = _response_format(schema, strict)
            else:
                response_format = {"type": "json_object"}
                ls_format = {"kwargs": {"method": method}, "schema": schema}
            llm = self.bind(response_format=response_format, ls_structured_output_format=ls_format)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}.")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


# -- helpers -------------------------------------------------------------------------------------
def _stop_list(stop: Any) -> list[str] | None:
    if not stop:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


def _tool_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> Any:
    """LangChain's tool_choice spellings as OpenAI's."""
    if tool_choice is None or isinstance(tool_choice, dict):
        return tool_choice
    if tool_choice is True or tool_choice == "any":
        return "required"
    if tool_choice is False:
        return "none"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, str):
        return {"type": "function", "function": {"name": tool_choice}}
    raise ValueError(f"Unrecognized tool_choice {tool_choice!r}.")


def _response_format(schema: Any, strict: bool | None) -> dict[str, Any]:
    """response_format json_schema for `schema`. Unless strict=False, objects that list their properties
    are closed (additionalProperties false, as OpenAI's strict mode requires): under a grammar, an open
    object lets a small model append invented keys until max_tokens cuts the JSON off."""
    json_schema = convert_to_json_schema(schema)
    if strict is not False:
        json_schema = close_json_schema(json_schema)
    spec: dict[str, Any] = {"name": json_schema.get("title") or "response", "schema": json_schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def _text_of(content: Any) -> Any:
    """Content parts as text: text parts joined, reasoning parts dropped; anything else is left for the
    backend to reject with its own typed error."""
    if not isinstance(content, list):
        return content
    parts = [p for p in content if not (isinstance(p, dict) and p.get("type") in _REASONING_BLOCKS)]
    if all(isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in parts):
        return "".join(p if isinstance(p, str) else p.get("text", "") for p in parts)
    return parts


def _openai_messages(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    converted = convert_to_openai_messages(messages)
    for message in converted:
        message["content"] = _text_of(message.get("content"))
    return converted


def _usage_metadata(usage: Usage) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        input_token_details=InputTokenDetails(cache_read=usage.cached_tokens,
                                              cache_creation=usage.cache_creation_tokens),
    )


def _tool_calls(calls) -> tuple[list, list]:
    import json

    valid, invalid = [], []
    for call in calls:
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except ValueError as exc:
            invalid.append(invalid_tool_call(name=call.name, args=call.arguments, id=call.id, error=str(exc)))
            continue
        if isinstance(args, dict):
            valid.append(tool_call(name=call.name, args=args, id=call.id))
        else:
            invalid.append(invalid_tool_call(name=call.name, args=call.arguments, id=call.id,
                                             error="the arguments are not a JSON object"))
    return valid, invalid


def _chat_result(completion: Completion) -> ChatResult:
    usage = _usage_metadata(completion.usage)
    generations = []
    for choice in completion.choices:
        valid, invalid = _tool_calls(choice.tool_calls)
        info: dict[str, Any] = {"finish_reason": choice.finish_reason}
        if choice.logprobs is not None:
            info["logprobs"] = {"content": choice.logprobs}
        metadata = {**info, "model_name": completion.model, "model_provider": PROVIDER}
        if completion.id:
            metadata["id"] = completion.id
        message = AIMessage(content=choice.text, tool_calls=valid, invalid_tool_calls=invalid, usage_metadata=usage,
                            response_metadata=metadata)
        generations.append(ChatGeneration(message=message, generation_info=info))
    token_usage = {"prompt_tokens": completion.usage.prompt_tokens,
                   "completion_tokens": completion.usage.completion_tokens,
                   "total_tokens": completion.usage.total_tokens,
                   "prompt_tokens_details": {"cached_tokens": completion.usage.cached_tokens}}
    return ChatResult(generations=generations, llm_output={"token_usage": token_usage, "model_name": completion.model,
                                                           "model_provider": PROVIDER})


def _chunk(event: Delta | StreamEnd) -> ChatGenerationChunk:
    if isinstance(event, StreamEnd):
        info = {"finish_reason": event.finish_reason}
        metadata = {**info, "model_name": event.model, "model_provider": PROVIDER}
        message = AIMessageChunk(content="", chunk_position="last", usage_metadata=_usage_metadata(event.usage),
                                 response_metadata=metadata)
        return ChatGenerationChunk(message=message, generation_info=info)
    calls = [tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=c.index) for c in event.tool_calls]
    metadata = {"logprobs": {"content": event.logprobs}} if event.logprobs else {}
    return ChatGenerationChunk(message=AIMessageChunk(content=event.text, tool_call_chunks=calls,
                                                      response_metadata=metadata))

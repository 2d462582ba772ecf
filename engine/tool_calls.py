"""Tool calling over chat templates, for the server and the LangChain chat model alike.

Validates OpenAI `tools` / `tool_choice`, renders a conversation (with tools, assistant tool calls
and tool results) into a prompt, constrains decoding so a forced call is always valid, and parses
the generated text back into OpenAI-shaped tool calls:

    chat = ToolChat(tokenizer)  # once per model; probes the chat template lazily
    prepared = chat.prepare(messages, tools=tools, tool_choice="auto")
    params = prepared.apply(SamplingParams(max_tokens=256))
    [out] = llm.generate({"prompt_token_ids": prepared.prompt_token_ids}, params)
    message = prepared.parse(out.outputs[0].text)  # ParsedMessage(content, tool_calls)
    finish_reason = message.finish_reason(out.outputs[0].finish_reason)

The call format is Hermes style, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that renders `tools` itself in this format (Qwen2/2.5, Hermes, ...) is "native": it
gets the tools, assistant tool calls and tool results as structured data. Any other template
(SmolLM2's has no tool support; Llama 3.1 and Mistral templates use other formats) gets a
system-prompt section describing the tools and the format instead, and assistant tool calls written out
as blocks; tool results stay "tool" turns where the template writes that role, else become user turns
wrapped in <tool_response> tags.

The constraint is an llguidance lark grammar (StructuredOutputsParams(grammar=...)):
- "none": the tools are described, but there is no constraint and no parsing: plain text.
- "auto": free text; but once the text contains "<tool_call>", the block must be a well-formed call of
  a known tool whose arguments validate against its parameters schema.
- "required": only call blocks, at least one (exactly one when parallel_tool_calls is false).
- a named tool: exactly one call of that tool.
Arguments are JSON with ", " / ": " separators and no free whitespace, and an object schema that lists
`properties` without saying anything of `additionalProperties` is closed (as OpenAI's strict mode
does): the grammar leaves a model no room to ramble, and whatever it writes validates against the
original schema. A call cut off by max_tokens cannot be valid: it stays in `content` as text and the
finish reason stays "length".
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import llguidance

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output import close_json_schema

TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
# Every argument object is written like json.dumps writes it; the grammar allows no other whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_PROBE_NAME = "prefixserve_template_probe"


# -- the request -----------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI function tool; `parameters` is its JSON Schema (an object schema)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}},
                                          hash=False)

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """Validated `tools` + `tool_choice` + `parallel_tool_calls` of one request.

    Invariants: tool names are unique; `choice` is "none", "auto", "required" or "function", and
    `function_name` names one of `tools` exactly when `choice` is "function".
    """

    tools: tuple[FunctionTool, ...]
    choice: str = "auto"
    function_name: str | None = None
    parallel: bool = True

    @property
    def callable_tools(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call under this choice."""
        if self.choice == "none":
            return ()
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function_name)
        return self.tools

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def tool(self, name: str) -> FunctionTool | None:
        return next((t for t in self.tools if t.name == name), None)


def parse_tool_request(tools: Sequence[Any] | None, tool_choice: Any = None,
                       parallel_tool_calls: bool | None = None) -> ToolRequest | None:
    """Validate OpenAI `tools` / `tool_choice` / `parallel_tool_calls`; None when no tools are involved.

    Raises InvalidRequestError(param="tools..." or "tool_choice") for a malformed tool, a duplicate
    name, an unknown named tool, or a tool_choice that needs tools when there are none.
    """
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list of function tools.", param="tools")
    parsed = tuple(_parse_tool(tool, i) for i, tool in enumerate(tools or ()))
    names = [t.name for t in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise InvalidRequestError(f"tools contains two functions named {duplicate!r}.", param="tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean.", param="parallel_tool_calls")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls

    function_name = None
    if tool_choice is None:
        choice = "auto" if parsed else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a named function "
                                      f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}.",
                                      param="tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError('A named tool_choice must be {"type": "function", "function": {"name": ...}}.',
                                      param="tool_choice")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools "
                                      f"({', '.join(names) or 'none given'}).", param="tool_choice")
        choice, function_name = "function", name
    else:
        raise InvalidRequestError("tool_choice must be a string or an object.", param="tool_choice")
    if not parsed:
        if choice != "none":
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs a non-empty tools list.",
                                      param="tool_choice")
        return None
    return ToolRequest(parsed, choice, function_name, parallel)


def _parse_tool(tool: Any, i: int) -> FunctionTool:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}.', param=where)
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"{where}.function must be an object with a name.", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}.",
                                  param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string.",
                                  param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:  # OpenAI: omitted means "no arguments"
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object.",
                                  param=f"{where}.function.parameters")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(f"{where}.function.parameters must describe an object (type 'object'), got "
                                  f"{kind!r}.", param=f"{where}.function.parameters")
    _check_schema(parameters, f"{where}.function.parameters")
    return FunctionTool(name, description, dict(parameters))


def _check_schema(schema: Mapping[str, Any], param: str) -> None:
    """Compile the arguments' schema now, so a bad one is the caller's 400 naming the tool."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_argument_schema(schema)))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{param} is not a usable JSON Schema: {exc}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{param} is not a usable JSON Schema: {error}", param=param)


# -- the constraint --------------------------------------------------------------------------
def _argument_schema(parameters: Mapping[str, Any]) -> dict[str, Any]:
    schema = close_json_schema(parameters)
    schema.setdefault("x-guidance", JSON_STYLE)
    return schema


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid lark string literal


def tool_call_grammar(request: ToolRequest) -> str | None:
    """The lark grammar (llguidance syntax) that constrains the output of `request`; None for "none".

    Each tool's arguments are their own `%json` rule, so `$ref`s inside a parameters schema resolve as
    they would in the original; the surrounding `{"name": ..., "arguments": ...}` is literal text.
    """
    tools = request.callable_tools
    if not tools:
        return None
    lines = []
    calls = []
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        lines.append(f"call_{i}: {_lark_string(head)} args_{i} \"}}\"")
        lines.append(f"args_{i}: %json {json.dumps(_argument_schema(tool.parameters))}")
        calls.append(f"call_{i}")
    lines.append("call: " + " | ".join(calls))
    lines.append(f"block: {_lark_string(CALL_OPEN + chr(10))} call {_lark_string(chr(10) + CALL_CLOSE)}")
    if request.forced:
        many = request.parallel and request.choice == "required"
        start = 'start: block ("\\n" block)*' if many else "start: block"
    else:
        # Free text until "<tool_call>" appears (the lazy head ends right there), then a forced call;
        # the tail may not contain "<tool_call>", so no call escapes the grammar.
        lines.append(f"head[lazy]: TEXT {_lark_string(CALL_OPEN)}")
        lines.append(f"called: head {_lark_string(chr(10))} call {_lark_string(chr(10) + CALL_CLOSE)}")
        lines.append("TEXT: /(?s:.*)/")
        lines.append(f"TAIL: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/")
        start = "start: called* TAIL" if request.parallel else "start: called? TAIL"
    return "\n".join([start, *lines]) + "\n"


# -- parsing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One parsed call, OpenAI-shaped by `to_openai()`; `arguments` is JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedMessage:
    """An assistant message: text content (None when it is only tool calls) and its tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    def finish_reason(self, engine_finish_reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" when the model stopped after calling tools."""
        if self.tool_calls and engine_finish_reason == "stop":
            return "tool_calls"
        return engine_finish_reason

    def to_openai(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message


class ToolCallStreamParser:
    """Splits generated text, as it streams, into content pieces (str) and complete ToolCalls.

    `feed(delta)` returns what is certain so far; text that might still become "<tool_call>" is held
    back. A block that does not parse as a call of a known tool (never the case under a grammar) is
    content. Whitespace next to a call block is dropped; other text comes through verbatim, and
    without callable tools ("none", or no request) everything does. `finish()` flushes the rest (an
    unfinished block is content).
    """

    def __init__(self, request: ToolRequest | None) -> None:
        self.request = request
        self._active = request is not None and bool(request.callable_tools)
        self._buffer = ""
        self._in_call = False
        self._scan = 0  # inside a block: where to look for the next closing tag
        self._pending_ws = ""  # trailing whitespace of the text so far: dropped if a call follows
        self._after_call = False

    def feed(self, delta: str) -> list[str | ToolCall]:
        if not self._active:
            return [delta] if delta else []
        events: list[str | ToolCall] = []
        self._buffer += delta
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, CALL_OPEN)
                    self._text(self._take(len(self._buffer) - keep), events)
                    return events
                self._text(self._take(start), events)
                self._pending_ws = ""
                self._take(len(CALL_OPEN))
                self._in_call = True
            else:
                # The arguments may contain "</tool_call>" inside a JSON string: the block ends at the
                # first closing tag after which the body parses.
                end = self._buffer.find(CALL_CLOSE, self._scan)
                if end < 0:
                    self._scan = max(self._scan, len(self._buffer) - len(CALL_CLOSE) + 1)
                    return events
                call = self._call(self._buffer[:end])
                if call is None:
                    self._scan = end + 1
                    continue
                self._take(end + len(CALL_CLOSE))
                self._in_call, self._scan = False, 0
                events.append(call)
                self._after_call = True

    def finish(self) -> list[str | ToolCall]:
        if not self._active:
            return []
        events = self.feed("")
        rest = self._take(len(self._buffer))
        self._text((CALL_OPEN if self._in_call else "") + rest, events)
        self._in_call, self._scan = False, 0
        pending, self._pending_ws = self._pending_ws, ""
        self._append(pending, events)
        return events

    def _take(self, n: int) -> str:
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        return taken

    def _text(self, text: str, events: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        self._append(body, events)

    @staticmethod
    def _append(text: str, events: list[str | ToolCall]) -> None:
        if not text:
            return
        if events and isinstance(events[-1], str):
            events[-1] += text
        else:
            events.append(text)

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if self.request is None or self.request.tool(value["name"]) is None:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def parse_tool_calls(text: str, request: ToolRequest | None) -> ParsedMessage:
    """Split a whole generated text into content and tool calls (what streaming yields, joined)."""
    parser = ToolCallStreamParser(request)
    events = parser.feed(text) + parser.finish()
    calls = tuple(e for e in events if isinstance(e, ToolCall))
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedMessage(content if content or not calls else None, calls)


# -- rendering -------------------------------------------------------------------------------
def message_text(content: Any, param: str = "messages") -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, Mapping) else None
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind not in ("text", "input_text") or not isinstance(text, str):
                raise InvalidRequestError(f"Content parts of type {kind!r} are not supported; only text parts are.",
                                          param=f"{param}.content[{j}]")
            texts.append(text)
        return "\n".join(texts)
    raise InvalidRequestError("content must be a string, null or a list of text parts.", param=f"{param}.content")


def _function_of(call: Any, param: str) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequestError('Each tool call must be {"id", "type": "function", "function": {"name", '
                                  '"arguments"}}.', param=param)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as text: a client may replay whatever a model wrote
    return function["name"], arguments


def tools_system_prompt(tools: Sequence[FunctionTool]) -> str:
    """The system-prompt section that teaches a template without tool support the call format."""
    signatures = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. Their signatures, as JSON, are:\n"
        f"<tools>\n{signatures}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call> tags, one block per call:\n"
        f"{CALL_OPEN}\n"
        '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}\n'
        f"{CALL_CLOSE}\n"
        "If no function is needed, answer in plain text."
    )


def render_call_block(name: str, arguments: Any) -> str:
    """One call written exactly as the grammar makes the model write it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def merge_same_role(conversation: list[dict]) -> list[dict]:
    """Consecutive messages of one role (without tool calls) joined, for templates that insist on
    alternating roles."""
    merged: list[dict] = []
    for entry in conversation:
        if merged and merged[-1]["role"] == entry["role"] and not entry.get("tool_calls") \
                and not merged[-1].get("tool_calls"):
            joined = (merged[-1].get("content") or "") + "\n\n" + (entry.get("content") or "")
            merged[-1] = {**merged[-1], "content": joined}
        else:
            merged.append(dict(entry))
    return merged


def apply_chat_template(tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template_kwargs: Mapping | None = None,
                        tools: list[dict] | None = None) -> list[int]:
    """The template applied to `conversation`, as token ids without extra special tokens (the template has
    them). A template that rejects consecutive same-role messages gets them merged."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("This model has no chat template; use /v1/completions.", param="messages")
    if not conversation:
        raise InvalidRequestError("messages must contain at least one message.", param="messages")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("tokenize", "conversation", "messages", "tools"):
        kwargs.pop(reserved, None)
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        if conversation[-1]["role"] != "assistant":
            raise InvalidRequestError("continue_final_message needs a final assistant message.", param="messages")
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    error: Exception | None = None
    for attempt in (conversation, merge_same_role(conversation)):
        try:
            text = tokenizer.apply_chat_template(attempt, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **kwargs)
            return tokenizer(text, add_special_tokens=False).input_ids
        except Exception as exc:  # jinja TemplateError, TypeError, ValueError from the template
            error = exc
    raise InvalidRequestError(f"The chat template could not render these messages: {error}", param="messages")


@dataclass(frozen=True)
class PreparedChat:
    """A rendered chat request: the prompt, its tool request and the matching constraint."""

    prompt_token_ids: list[int]
    tool_request: ToolRequest | None
    structured_outputs: StructuredOutputsParams | None

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tool-call constraint; a request cannot carry two constraints."""
        if self.structured_outputs is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequestError("A structured output format cannot be combined with tools unless tool_choice "
                                      "is 'none'.", param="tool_choice")
        if params.use_beam_search:
            raise InvalidRequestError("Tool calling cannot be combined with beam search.", param="tool_choice")
        return replace(params, structured_outputs=self.structured_outputs)

    def parse(self, text: str) -> ParsedMessage:
        return parse_tool_calls(text, self.tool_request)

    def stream_parser(self) -> ToolCallStreamParser:
        """A fresh parser for one streamed choice (use one per choice when n > 1)."""
        return ToolCallStreamParser(self.tool_request)


class ToolChat:
    """The chat template of one tokenizer, with tool calling. Build once per model and reuse."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @cached_property
    def native_tools(self) -> bool:
        """Whether the template renders `tools` itself and in the Hermes <tool_call> format."""
        if not getattr(self.tokenizer, "chat_template", None):
            return False
        probe = FunctionTool(_PROBE_NAME, "probe", {"type": "object", "properties": {}}).to_openai()
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                                      tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that breaks on tools has no (usable) tool support
            return False
        return _PROBE_NAME in text and CALL_OPEN in text

    @cached_property
    def renders_tool_role(self) -> bool:
        """Whether the template writes a message of role "tool" (ChatML-style templates write any role;
        strict ones raise, and some drop roles they do not know)."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                 {"role": "tool", "content": _PROBE_NAME}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:
            return False
        return _PROBE_NAME in text

    def conversation(self, messages: Sequence[Mapping[str, Any]], request: ToolRequest | None
                     ) -> tuple[list[dict], list[dict] | None]:
        """(the messages as the template should see them, the `tools` argument for the template)."""
        # "none" still describes the tools (as OpenAI and vLLM do): the prompt, and so its cached
        # prefix, stays the same whatever each turn's tool_choice; only the constraint differs.
        offered = request.tools if request is not None else ()
        native = self.native_tools
        out: list[dict] = []
        for i, message in enumerate(messages):
            param = f"messages[{i}]"
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidRequestError(f"{param} must be an object with a role.", param=param)
            role = "system" if message["role"] == "developer" else message["role"]
            text = message_text(message.get("content"), param)
            calls = message.get("tool_calls") or []
            if role == "assistant" and calls:
                named = [_function_of(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
                if native:
                    out.append({"role": "assistant", "content": text, "tool_calls": [
                        {**c, "function": {**c["function"], "arguments": args}} for c, (_, args) in zip(calls, named)]})
                else:
                    blocks = "\n".join(render_call_block(name, args) for name, args in named)
                    out.append({"role": "assistant", "content": f"{text}\n{blocks}" if text else blocks})
            elif role in ("tool", "function") and not native:
                if self.renders_tool_role:  # small models answer from a "tool" turn far better
                    out.append({"role": "tool", "content": text})
                else:
                    out.append({"role": "user", "content": f"{RESULT_OPEN}\n{text}\n{RESULT_CLOSE}"})
            else:
                entry: dict[str, Any] = {"role": role, "content": text}
                for key in ("name", "tool_call_id"):
                    if message.get(key) is not None:
                        entry[key] = message[key]
                out.append(entry)
        if not offered:
            return out, None
        if native:
            return out, [t.to_openai() for t in offered]
        section = tools_system_prompt(offered)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section}
        else:
            out.insert(0, {"role": "system", "content": section})
        return out, None

    def render(self, messages: Sequence[Mapping[str, Any]], request: ToolRequest | None = None, *,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: Mapping | None = None) -> list[int]:
        """The prompt token ids of `messages` (OpenAI message dicts) offering `request`'s tools."""
        conversation, tools = self.conversation(messages, request)
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs, tools=tools)

    def prepare(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                tool_choice: Any = None, parallel_tool_calls: bool | None = None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Mapping | None = None) -> PreparedChat:
        """Validate the tools, render the prompt and build the constraint of one chat request."""
        request = parse_tool_request(tools, tool_choice, parallel_tool_calls)
        ids = self.render(messages, request, add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
        grammar = tool_call_grammar(request) if request is not None else None
        constraint = StructuredOutputsParams(grammar=grammar) if grammar is not None else None
        return PreparedChat(ids, request, constraint)

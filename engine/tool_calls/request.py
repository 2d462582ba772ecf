"""OpenAI `tools` / `tool_choice` validated into a ToolRequest, and the call format's markers
(the policy is in engine/tool_calls/__init__.py)."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance

from engine.errors import InvalidRequestError
from engine.json_schemas import bound_json_numbers, close_json_schema

TOOL_CHOICES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
# Every argument object is written like json.dumps writes it; the grammar allows no other whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PROBE_NAME = "prefixserve_template_probe"

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


def argument_schema(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as the grammar enforces it: closed objects, bounded numbers
    (engine/json_schemas.py), json.dumps spacing."""
    schema = bound_json_numbers(close_json_schema(parameters))
    schema.setdefault("x-guidance", JSON_STYLE)
    return schema


def _check_schema(schema: Mapping[str, Any], param: str) -> None:
    """Compile the arguments' schema now, so a bad one is the caller's 400 naming the tool."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(argument_schema(schema)))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{param} is not a usable JSON Schema: {exc}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{param} is not a usable JSON Schema: {error}", param=param)

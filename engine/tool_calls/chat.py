"""ToolChat: one model's tool layer; PreparedChat: one request rendered, constrained and parsed."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any


from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.tool_calls.grammar import tool_call_grammar
from engine.tool_calls.parsing import ParsedMessage, ToolCallStreamParser, parse_tool_calls
from engine.tool_calls.rendering import _function_of, apply_chat_template, message_text, render_call_block, tools_system_prompt
from engine.tool_calls.request import (
    CALL_CLOSE, CALL_OPEN, PROBE_NAME, RESULT_CLOSE, RESULT_OPEN, FunctionTool, ToolRequest, parse_tool_request,
)

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
        probe = FunctionTool(PROBE_NAME, "probe", {"type": "object", "properties": {}}).to_openai()
        try:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                                      tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that breaks on tools has no (usable) tool support
            return False
        return PROBE_NAME in text and CALL_OPEN in text

    @cached_property
    def renders_tool_role(self) -> bool:
        """Whether the template writes a message of role "tool" (ChatML-style templates write any role;
        strict ones raise, and some drop roles they do not know)."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                 {"role": "tool", "content": PROBE_NAME}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        except Exception:
            return False
        return PROBE_NAME in text

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
        # Parallel calls: a call repeated exactly ends the output (engine/repeated_blocks.py).
        markers = (CALL_OPEN, CALL_CLOSE) if request is not None and request.parallel else None
        constraint = (StructuredOutputsParams(grammar=grammar, stop_on_repeated_block=markers)
                      if grammar is not None else None)
        return PreparedChat(ids, request, constraint)

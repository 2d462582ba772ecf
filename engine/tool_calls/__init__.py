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
original schema; unbounded numbers are bounded (engine/json_schemas.py).

How an output ends (the policy OpenAI clients handle best: LangChain and the openai SDK run the calls
of a "tool_calls" message and never see half a call):
- With parallel calls, a call identical (name and arguments, byte for byte) to one already written
  ends the output (engine/repeated_blocks.py) and is not reported twice: small models under
  "required" otherwise repeat the same call until max_tokens.
- The token reserve (engine/grammar_budget.py) closes an unfinished call before max_tokens runs out
  (its strings ended early, missing required arguments given their shortest values), and ends the
  output after a call when another as long would not fit.
- A block max_tokens still cuts off (a budget below one call) is dropped, never shown as `content`.
  Complete calls are reported with finish_reason "tool_calls" whether the engine stopped or ran out
  of tokens; with none complete, content is what text there was (empty for a forced call) and the
  finish reason stays "length".
"""
from engine.tool_calls.chat import PreparedChat, ToolChat
from engine.tool_calls.grammar import tool_call_grammar
from engine.tool_calls.parsing import ParsedMessage, ToolCall, ToolCallStreamParser, parse_tool_calls
from engine.tool_calls.rendering import apply_chat_template, merge_same_role, message_text, render_call_block, tools_system_prompt
from engine.tool_calls.request import (
    CALL_CLOSE, CALL_OPEN, JSON_STYLE, RESULT_CLOSE, RESULT_OPEN, TOOL_CHOICES, TOOL_NAME, FunctionTool, ToolRequest,
    parse_tool_request,
)

__all__ = [
    "CALL_CLOSE", "CALL_OPEN", "JSON_STYLE", "RESULT_CLOSE", "RESULT_OPEN", "TOOL_CHOICES", "TOOL_NAME", "FunctionTool",
    "ParsedMessage", "PreparedChat", "ToolCall", "ToolCallStreamParser", "ToolChat", "ToolRequest", "apply_chat_template",
    "merge_same_role", "message_text", "parse_tool_calls", "parse_tool_request", "render_call_block",
    "tool_call_grammar", "tools_system_prompt",
]

"""The llguidance lark grammar that constrains decoding to valid tool calls (the policy is in __init__)."""
from __future__ import annotations

import json
import re


from engine.tool_calls.request import CALL_CLOSE, CALL_OPEN, ToolRequest, argument_schema

# -- the constraint --------------------------------------------------------------------------
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
        lines.append(f"args_{i}: %json {json.dumps(argument_schema(tool.parameters))}")
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

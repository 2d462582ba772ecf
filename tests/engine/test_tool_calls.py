"""Tool calling (engine/tool_calls.py): request validation, prompt rendering with and without a
template tool format, parsing (whole and streamed), and the grammar: forced calls are valid calls
whose arguments validate against the tool's schema, whatever chooses the tokens (random walks
through the grammar's token masks, and a tiny random-weight model)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from fixtures.json_schemas import json_schemas, validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.tool_calls import (
    ParsedMessage, ToolCall, ToolCallStreamParser, ToolChat, parse_tool_calls, parse_tool_request, render_call_block,
    tool_call_grammar,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters at all
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}}) for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _request(choice="auto", parallel=None, tools=TOOLS):
    return parse_tool_request(tools, choice, parallel)


def _check_calls(message: ParsedMessage, names=tuple(SCHEMAS)) -> None:
    for call in message.tool_calls:
        assert call.name in names and call.id.startswith("call_")
        validate(json.loads(call.arguments), SCHEMAS.get(call.name) or {"type": "object"})


# -- validation ------------------------------------------------------------------------------
def _tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ("get_weather", None, None, "tools"),
    ([{"type": "retrieval"}], None, None, "tools[0]"),
    ([{"type": "function"}], None, None, "tools[0].function"),
    ([_tool("bad name!")], None, None, "tools[0].function.name"),
    ([_tool("a" * 65)], None, None, "tools[0].function.name"),
    ([_tool(description=3)], None, None, "tools[0].function.description"),
    ([_tool(parameters=[])], None, None, "tools[0].function.parameters"),
    ([_tool(parameters={"type": "array"})], None, None, "tools[0].function.parameters"),
    ([_tool(parameters={"type": "object", "properties": {"a": {"type": "strin"}}})], None, None,
     "tools[0].function.parameters"),
    ([_tool(), _tool("g"), _tool()], None, None, "tools"),
    ([_tool()], "sometimes", None, "tool_choice"),
    ([_tool()], {"type": "function", "function": {"name": "g"}}, None, "tool_choice"),
    ([_tool()], {"type": "function"}, None, "tool_choice"),
    ([_tool()], 3, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    ([], "auto", None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "f"}}, None, "tool_choice"),
    ([_tool()], "auto", "yes", "parallel_tool_calls"),
])
def test_bad_tool_requests_name_the_parameter(tools, choice, parallel, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_tool_request(tools, choice, parallel)
    assert info.value.param == param


def test_tool_request_defaults():
    assert parse_tool_request(None) is None and parse_tool_request([], "none") is None
    auto = _request(None)
    assert auto.choice == "auto" and auto.parallel and [t.name for t in auto.callable_tools] == list(SCHEMAS)
    assert auto.tool("ping").parameters == {"type": "object", "properties": {}}
    none = _request("none")
    assert none.choice == "none" and none.callable_tools == () and tool_call_grammar(none) is None
    named = _request(NAMED, parallel=False)
    assert named.forced and [t.name for t in named.callable_tools] == ["get_weather"] and not named.parallel


def test_bad_messages_name_the_message(tokenizer):
    chat = ToolChat(tokenizer)
    with pytest.raises(InvalidRequestError) as info:
        chat.prepare(USER + [{"role": "assistant", "tool_calls": [{"id": "x", "function": "f"}]}], TOOLS)
    assert info.value.param == "messages[1].tool_calls[0]"
    with pytest.raises(InvalidRequestError) as info:
        chat.prepare([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert info.value.param == "messages[0].content[0]"


# -- parsing ---------------------------------------------------------------------------------
def _block(name, arguments) -> str:
    return render_call_block(name, arguments)


def test_parse_plain_text_is_untouched():
    text = "  The weather is fine.\n"
    assert parse_tool_calls(text, _request()) == ParsedMessage(text)
    # Without callable tools nothing is parsed, even text that looks like a call.
    call = _block("get_weather", {"city": "Paris", "days": 1})
    for request in (None, _request("none")):
        message = parse_tool_calls(call, request)
        assert message.content == call and message.tool_calls == ()
        assert message.finish_reason("stop") == "stop"


def test_parse_calls_and_text():
    text = ("Let me check.\n" + _block("get_weather", {"city": "Paris", "days": 2}) + "\n"
            + _block("ping", {}) + "\nDone.")
    message = parse_tool_calls(text, _request())
    assert message.content == "Let me check.Done."  # whitespace next to a call block is dropped
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
    assert len({c.id for c in message.tool_calls}) == 2
    # Complete calls are reported as such even when max_tokens ended the output after them.
    assert message.finish_reason("stop") == "tool_calls" and message.finish_reason("length") == "tool_calls"
    assert ParsedMessage("text").finish_reason("length") == "length"
    only = parse_tool_calls(_block("ping", {}), _request("required"))
    assert only.content is None and only.to_openai() == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": only.tool_calls[0].id, "type": "function",
                        "function": {"name": "ping", "arguments": "{}"}}]}


def test_parse_keeps_what_is_not_a_call_as_text():
    request = _request()
    for text in ("<tool_call>\n{not json}\n</tool_call>", _block("unknown_tool", {}),
                 '<tool_call>\n{"name": "ping", "arguments": [1]}\n</tool_call>'):
        message = parse_tool_calls(text, request)
        assert message.tool_calls == () and message.content == text
    # A block cut off by max_tokens is dropped: no raw markup in the content.
    cut = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse_tool_calls(cut, request) == ParsedMessage("Checking.")
    assert parse_tool_calls(cut[len("Checking. "):], request) == ParsedMessage("")
    # A closing tag inside an argument string does not end the block.
    tricky = _block("get_weather", {"city": "</tool_call>", "days": 1})
    [call] = parse_tool_calls(tricky, request).tool_calls
    assert json.loads(call.arguments)["city"] == "</tool_call>"
    # Models that write "parameters" or JSON-string arguments are understood.
    loose = ('<tool_call>{"name": "get_time", "parameters": {"zone": "utc"}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"cet\\"}"}</tool_call>')
    assert [json.loads(c.arguments) for c in parse_tool_calls(loose, request).tool_calls] == [
        {"zone": "utc"}, {"zone": "cet"}]


STREAM_TEXTS = [
    "Hello there, no tools needed.",
    _block("ping", {}),
    "Sure <tool_ I mean, sure. " + _block("get_weather", {"city": "Oslo <x>", "days": 3}) + " and "
    + _block("get_time", {"zone": "utc"}) + "\n",
    _block("get_weather", {"city": "</tool_call>", "days": 1}) + "\n" + _block("ping", {}),
    "Truncated: " + _block("ping", {})[:-3],
    "  \n",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_parse_equals_whole_parse(text):
    whole = parse_tool_calls(text, _request())
    rng = random.Random(0)
    for _ in range(20):
        parser = ToolCallStreamParser(_request())
        events = []
        cut = 0
        while cut < len(text):
            step = rng.randint(1, 6)
            events += parser.feed(text[cut:cut + step])
            cut += step
        events += parser.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert (content or None if calls else content) == whole.content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


# -- rendering -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(ids)


HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_template_without_tools_gets_a_system_section(tokenizer):
    chat = ToolChat(tokenizer)
    assert not chat.native_tools  # SmolLM2's template ignores `tools`
    text = _text(tokenizer, chat.prepare(HISTORY, TOOLS).prompt_token_ids)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    # The history: the call written exactly as the grammar would write it, the result as a tool turn.
    assert chat.renders_tool_role
    assert "<|im_start|>assistant\n" + _block("get_weather", {"city": "Paris", "days": 1}) + "<|im_end|>" in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # A system prompt of the user's stays first; the section follows it.
    system = [{"role": "system", "content": "Be brief."}] + HISTORY
    assert _text(tokenizer, chat.prepare(system, TOOLS).prompt_token_ids).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools")
    # "none" renders the same prompt (a shared prefix across turns); only the constraint differs.
    assert chat.prepare(HISTORY, TOOLS, "none").prompt_token_ids == chat.prepare(HISTORY, TOOLS).prompt_token_ids
    # Without tools, the history still renders.
    plain = _text(tokenizer, chat.prepare(HISTORY).prompt_token_ids)
    assert "# Tools" not in plain and "tool\n18 C, sunny" in plain
    # The same conversation without tools renders as before tool support existed.
    before = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert chat.prepare(USER).prompt_token_ids == tokenizer(before, add_special_tokens=False).input_ids


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "Answer with <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OTHER_FORMAT_TEMPLATE = (
    "{%- if tools %}Functions: {{ tools | tojson }}. Reply with [CALL]name(args).\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def template_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    def make(template):
        tok = AutoTokenizer.from_pretrained(str(smollm2_path))
        tok.chat_template = template
        return tok

    return make


def test_native_template_renders_tools_and_history_itself(template_tokenizer):
    tokenizer = template_tokenizer(HERMES_TEMPLATE)
    chat = ToolChat(tokenizer)
    assert chat.native_tools
    text = _text(tokenizer, chat.prepare(HISTORY, TOOLS).prompt_token_ids)
    assert text.startswith("<|im_start|>system\nTOOLS:") and "# Tools" not in text
    assert json.dumps(TOOLS[0]) in text
    # Arguments reach the template as an object, not as a JSON string inside JSON.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text  # tool messages keep their role
    assert "TOOLS:" not in _text(tokenizer, chat.prepare(HISTORY).prompt_token_ids)


def test_template_with_another_tool_format_gets_the_section(template_tokenizer):
    tokenizer = template_tokenizer(OTHER_FORMAT_TEMPLATE)
    chat = ToolChat(tokenizer)
    assert not chat.native_tools  # it renders tools, but its calls are not <tool_call> blocks
    text = _text(tokenizer, chat.prepare(USER, TOOLS).prompt_token_ids)
    assert "Functions:" not in text and "# Tools" in text


STRICT_TEMPLATE = (
    "{%- for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_strict_template_gets_tool_results_as_user_turns(template_tokenizer):
    tokenizer = template_tokenizer(STRICT_TEMPLATE)
    chat = ToolChat(tokenizer)
    assert not chat.native_tools and not chat.renders_tool_role
    text = _text(tokenizer, chat.prepare(HISTORY, TOOLS).prompt_token_ids)
    assert "[user] <tool_response>\n18 C, sunny\n</tool_response>\n[assistant] " in text


def test_no_chat_template_is_an_invalid_request(template_tokenizer):
    chat = ToolChat(template_tokenizer(None))
    with pytest.raises(InvalidRequestError) as info:
        chat.prepare(USER, TOOLS)
    assert info.value.param == "messages" and not chat.native_tools


# -- the grammar, walked by random tokens ------------------------------------------------------
@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def _random_walk(tokenizer, ll_tokenizer, grammar: str, seed: int, eos_p: float = 0.3, prefix: str = "",
                 max_steps: int = 400) -> str:
    """Tokens drawn uniformly from what the grammar allows: the most adversarial 'model' there is."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    rng = np.random.default_rng(seed)
    tokens = tokenizer(prefix, add_special_tokens=False).input_ids if prefix else []
    assert matcher.consume_tokens(tokens)
    eos = tokenizer.eos_token_id
    for _ in range(max_steps):
        if matcher.is_stopped():
            break
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[:len(tokenizer)])
        token = eos if mask[eos] and rng.random() < eos_p else int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        if token == eos:
            break
        tokens.append(token)
    assert matcher.is_accepting(), "the walk did not finish"
    return tokenizer.decode(tokens)


@pytest.mark.parametrize("choice, parallel", [(NAMED, True), ("required", True), ("required", False)])
def test_forced_calls_are_always_valid(tokenizer, ll_tokenizer, choice, parallel):
    request = _request(choice, parallel)
    grammar = tool_call_grammar(request)
    for seed in range(12):
        text = _random_walk(tokenizer, ll_tokenizer, grammar, seed)
        message = parse_tool_calls(text, request)
        assert message.content is None and message.tool_calls, text
        _check_calls(message, [t.name for t in request.callable_tools])
        if choice == NAMED or not parallel:
            assert len(message.tool_calls) == 1


def test_auto_allows_text_and_forces_valid_calls(tokenizer, ll_tokenizer):
    request = _request("auto")
    grammar = tool_call_grammar(request)
    for seed in range(8):
        # Free text parses as content; once "<tool_call>" is written, a valid call must follow.
        text = _random_walk(tokenizer, ll_tokenizer, grammar, seed, prefix="Checking. <tool_call>")
        message = parse_tool_calls(text, request)
        assert message.tool_calls and message.content.startswith("Checking."), text
        _check_calls(message)
        assert "<tool_call>" not in message.content
    one = _request("auto", parallel=False)
    text = _random_walk(tokenizer, ll_tokenizer, tool_call_grammar(one), 0, eos_p=0.05, prefix="<tool_call>")
    assert len(parse_tool_calls(text, one).tool_calls) == 1


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=json_schemas(), seed=st.integers(0, 2**32 - 1), parallel=st.booleans())
def test_random_schemas_forced_calls_validate(tokenizer, ll_tokenizer, schema, seed, parallel):
    tools = [{"type": "function", "function": {"name": "tool", "parameters": schema}}, TOOLS[2]]
    request = parse_tool_request(tools, "required", parallel)
    message = parse_tool_calls(_random_walk(tokenizer, ll_tokenizer, tool_call_grammar(request), seed, max_steps=600),
                               request)
    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        validate(json.loads(call.arguments), schema if call.name == "tool" else {"type": "object"})


def test_schema_refs_and_open_objects(tokenizer, ll_tokenizer):
    """$refs resolve against the tool's own schema; objects listing properties are closed, free-form ones not."""
    parameters = {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
                  "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
                                      "required": ["x"]}}}
    request = parse_tool_request([_tool("f", parameters=parameters)], "required", False)
    for seed in range(5):
        [call] = parse_tool_calls(_random_walk(tokenizer, ll_tokenizer, tool_call_grammar(request), seed),
                                  request).tool_calls
        arguments = json.loads(call.arguments)
        assert list(arguments) == ["p"] and list(arguments["p"]) == ["x"] and 0 <= arguments["p"]["x"] <= 9


# -- end to end on a tiny random-weight model ----------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=512, max_num_seqs=16, max_model_len=1024)


@pytest.mark.parametrize("choice, parallel", [(NAMED, True), ("required", False), ("required", True)])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3, "n": 3}])
def test_random_model_forced_calls_validate(llm, choice, parallel, sampling):
    prepared = ToolChat(llm.get_tokenizer()).prepare(USER, TOOLS, choice, parallel)
    params = prepared.apply(SamplingParams(max_tokens=300, **sampling))
    [out] = llm.generate({"prompt_token_ids": prepared.prompt_token_ids}, params, use_tqdm=False)
    assert len(out.outputs) == sampling.get("n", 1)
    for c in out.outputs:
        message = prepared.parse(c.text)
        assert message.content is None and message.tool_calls, c.text
        assert message.finish_reason(c.finish_reason) == "tool_calls"
        _check_calls(message, ["get_weather"] if choice == NAMED else SCHEMAS)
        if choice == NAMED or not parallel:
            assert len(message.tool_calls) == 1


def test_random_model_auto_and_none(llm):
    chat = ToolChat(llm.get_tokenizer())
    for choice in ("auto", "none"):
        prepared = chat.prepare(HISTORY, TOOLS, choice)
        assert (prepared.structured_outputs is None) == (choice == "none")
        params = prepared.apply(SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=4))
        [out] = llm.generate({"prompt_token_ids": prepared.prompt_token_ids}, params, use_tqdm=False)
        for c in out.outputs:
            message = prepared.parse(c.text)
            _check_calls(message)
            if choice == "none":
                assert message == ParsedMessage(c.text)


def test_one_constraint_per_request():
    prepared_params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    from engine.tool_calls import PreparedChat

    forced = PreparedChat([1], _request("required"), StructuredOutputsParams(grammar=tool_call_grammar(
        _request("required"))))
    with pytest.raises(InvalidRequestError) as info:
        forced.apply(prepared_params)
    assert info.value.param == "tool_choice"
    assert PreparedChat([1], _request("none"), None).apply(prepared_params) is prepared_params

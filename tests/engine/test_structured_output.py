"""Structured outputs on a tiny random-weight model: whatever the weights prefer, the output follows
the grammar (JSON Schema, any JSON object, regex, choice, lark), for greedy and sampled rows, n>1
forks, preemption and concurrent bad requests; logprobs stay the model's own."""
from __future__ import annotations

import json
import re

import pytest
import torch
from engine_testlib import run_checked
from fixtures.json_schemas import json_schemas, validate
from hypothesis import HealthCheck, given, settings

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.structured_output import StructuredOutputManager, disallowed_tokens

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "admin": {"type": "boolean"},
        "role": {"enum": ["user", "staff", "root"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "score", "admin", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=512, max_num_seqs=16, max_model_len=1024)


def _params(spec: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=spec, **{"max_tokens": 400, **kwargs})


def _texts(llm, prompt, params) -> list[tuple[str, str]]:
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return [(c.text, c.finish_reason) for c in out.outputs]


# -- every kind of constraint, greedy and sampled, n > 1 ---------------------------------------
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 4}])
def test_json_schema_output_validates(llm, sampling):
    for text, reason in _texts(llm, "Describe a user:", _params(StructuredOutputsParams(json=PERSON), **sampling)):
        assert reason == "stop", text
        validate(json.loads(text), PERSON)
        # The random model loves whitespace; each gap is capped (no string here holds 17 characters).
        assert not re.search(r"\s{17,}", text), text
    assert llm.engine.structured.num_active == 0


def test_schema_as_json_text_and_top_k_top_p(llm):
    spec = StructuredOutputsParams(json=json.dumps(PERSON))
    for text, _ in _texts(llm, "x", _params(spec, temperature=1.3, top_k=50, top_p=0.9, seed=3, n=3)):
        validate(json.loads(text), PERSON)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11, "n": 4}])
def test_json_object(llm, sampling):
    # A random model never chooses to close a string among ~49k allowed tokens; a bias toward the
    # closing characters makes the output finish. The grammar alone makes it valid JSON.
    tok = llm.get_tokenizer()
    closers = {tok.convert_tokens_to_ids(t): 100.0 for t in ('"', "}", "]")}
    params = _params(StructuredOutputsParams(json_object=True), logit_bias=closers, **sampling)
    for text, reason in _texts(llm, "Some JSON:", params):
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5, "n": 4}])
def test_regex(llm, sampling):
    pattern = r"[0-9]{3}-[a-z]{2,4}( [A-Z][a-z]{0,5})?"
    for text, reason in _texts(llm, "Code:", _params(StructuredOutputsParams(regex=pattern), **sampling)):
        assert reason == "stop"
        assert re.fullmatch(pattern, text), text


def test_choice_with_sampled_forks(llm):
    choices = ["red", "green", "blue", "dark magenta"]
    params = _params(StructuredOutputsParams(choice=choices), temperature=1.5, seed=1, n=16)
    texts = [t for t, reason in _texts(llm, "Colour:", params) if reason == "stop"]
    assert len(texts) == 16 and set(texts) <= set(choices)
    assert len(set(texts)) > 1  # the forks sampled on their own, each through its own matcher


def test_lark_grammar(llm):
    grammar = 'start: "(" expr ")"\nexpr: NUMBER | expr "+" expr\nNUMBER: /[0-9]{1,3}/\n'
    for text, reason in _texts(llm, "Sum:", _params(StructuredOutputsParams(grammar=grammar), temperature=1.0,
                                                    seed=2, n=3)):
        assert reason == "stop" and re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text


def test_finishes_when_grammar_allows_nothing_more(llm):
    # "ab" fully determines the output: the sequence stops right after it, without sampling EOS.
    out = llm.generate("x", _params(StructuredOutputsParams(regex="ab"), ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert (c.text, c.finish_reason) == ("ab", "stop")
    assert llm.get_tokenizer().eos_token_id not in c.token_ids


def test_eos_only_when_complete_and_min_tokens(llm):
    eos = llm.get_tokenizer().eos_token_id
    # A strong bias toward EOS: the grammar still refuses it until the pattern is complete.
    params = _params(StructuredOutputsParams(regex=r"[a-z]{3,30}"), logit_bias={eos: 100.0}, temperature=0)
    c = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert len(c.text) >= 3 and c.finish_reason == "stop" and c.token_ids[-1] == eos
    assert re.fullmatch(r"[a-z]{3,30}", c.text)
    # min_tokens bans EOS, but once the grammar allows only EOS the grammar wins.
    params = _params(StructuredOutputsParams(choice=["yes"]), min_tokens=5, temperature=0)
    c = llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert c.text == "yes" and c.finish_reason == "stop"


def test_logprobs_stay_raw(llm):
    prompt = "The answer is"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    top_free = free.outputs[0].logprobs[0]
    best = free.outputs[0].token_ids[0]
    forced = _params(StructuredOutputsParams(choice=["zzzz"]), temperature=0, logprobs=5)
    c = llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0]
    first = c.logprobs[0]
    assert best != c.token_ids[0]
    # The model's favourite stays rank 1 with its unconstrained logprob; the forced token is ranked lower.
    assert first[best].rank == 1 and first[best].logprob == pytest.approx(top_free[best].logprob, abs=1e-5)
    assert first[c.token_ids[0]].rank > 1


# -- engine life cycle -----------------------------------------------------------------------
def test_invalid_constraints_refused_alone(llm):
    engine = llm.engine
    engine.add_request("good", "hello", _params(StructuredOutputsParams(json=PERSON), temperature=0))
    engine.step()  # the good request is running when the bad ones arrive
    bad = [StructuredOutputsParams(json={"type": "object", "properties": 5}),
           StructuredOutputsParams(json={"type": "strin"}), StructuredOutputsParams(json="{not json"),
           StructuredOutputsParams(regex="a(b"), StructuredOutputsParams(grammar="start: missing_rule")]
    for i, spec in enumerate(bad):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(f"bad{i}", "hello", _params(spec))
        assert info.value.param == "structured_outputs"
        assert f"bad{i}" not in engine.requests
    finals = run_checked(engine)
    validate(json.loads(finals["good"].outputs[0].text), PERSON)
    assert engine.structured.num_active == 0


def test_params_validation():
    with pytest.raises(InvalidRequestError, match="exactly one") as info:
        StructuredOutputsParams(json={}, regex="a")
    assert info.value.param == "structured_outputs"
    for bad in ({}, {"choice": []}, {"choice": "ab"}, {"json": 5}, {"grammar": ""}, {"json_object": "yes"}):
        with pytest.raises(InvalidRequestError):
            StructuredOutputsParams(**bad)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(n=2, use_beam_search=True, temperature=0, structured_outputs=StructuredOutputsParams(regex="a"))
    assert info.value.param == "structured_outputs"
    # Hashable and comparable although a schema is a dict.
    a, b = StructuredOutputsParams(json={"type": "object"}), StructuredOutputsParams(json={"type": "object"})
    assert a == b and hash(SamplingParams(structured_outputs=a)) == hash(SamplingParams(structured_outputs=b))


def test_abort_releases_matchers_and_cache_is_shared(llm):
    engine = llm.engine
    before = engine.structured.num_compiled
    spec = StructuredOutputsParams(regex=r"[a-z]{50,60}")
    engine.add_request("a", "x", _params(spec, n=3, temperature=1.0, seed=1))
    engine.add_request("b", "y", _params(spec, temperature=1.0, seed=2))
    assert engine.structured.num_compiled <= before + 1  # one compilation for both requests
    assert engine.structured.num_active == 4  # n=3 forks each hold a matcher from the start
    engine.step()
    engine.step()
    assert engine.abort("a")
    assert engine.structured.num_active == 1
    engine.check_integrity()
    finals = run_checked(engine)
    assert re.fullmatch(r"[a-z]{50,60}", finals["b"].outputs[0].text)
    assert engine.structured.num_active == 0


def test_preemption_keeps_the_matcher(tiny_model_factory):
    # 12 blocks of 8 tokens for 6 requests that each need ~5: the scheduler must preempt
    # (recompute), and every resumed sequence continues its parse where it stopped.
    llm = LLM(model=str(tiny_model_factory("llama")), block_size=8, num_kv_blocks=12, max_num_seqs=6,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = llm.engine
    pattern = r"\[[0-9]{2}(,[0-9]{2}){6,9}\]"
    for i in range(6):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(300 + i, 310 + i))},
                           _params(StructuredOutputsParams(regex=pattern), temperature=1.0, seed=i, max_tokens=30))
    finals = run_checked(engine)
    assert engine.scheduler.num_preemptions > 0
    for out in finals.values():
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert engine.structured.num_active == 0


def test_chat(llm):
    messages = [{"role": "user", "content": "Describe a user as JSON."}]
    out = llm.chat(messages, _params(StructuredOutputsParams(json=PERSON), temperature=0.7, seed=4, n=2),
                   use_tqdm=False)[0]
    for c in out.outputs:
        validate(json.loads(c.text), PERSON)


# -- the mask itself -------------------------------------------------------------------------
def test_mask_covers_lm_head_rows_beyond_the_tokenizer(llm):
    tok = llm.get_tokenizer()
    vocab = len(tok) + 100  # an lm_head with padding rows the tokenizer does not have
    manager = StructuredOutputManager(tok, vocab, [tok.eos_token_id])
    manager.add(["s"], manager.compile(StructuredOutputsParams(choice=["hello"])))
    mask = manager.grammar_mask([None, "s"])
    assert mask.rows.tolist() == [1]
    allowed = ~disallowed_tokens(mask.bitmask, vocab)  # [1, V]
    assert allowed.shape == (1, vocab) and not allowed[0, len(tok):].any()
    assert 0 < int(allowed.sum()) < 10  # a few ways to start "hello"
    # Narrower masks than the logits (a tokenizer smaller than the mask's width) are padded with "no".
    assert disallowed_tokens(mask.bitmask, mask.bitmask.shape[1] * 32 + 64)[0, -64:].all()
    logits = torch.zeros(2, vocab)
    logits[1, len(tok):] = 100.0  # the padding rows would win without the mask
    sampled = llm.engine.runner.sampler(logits, [_row(), _row()], mask)
    assert sampled.token_ids[1] < len(tok) and tok.decode([sampled.token_ids[1]]) in "hello"
    manager.release("s")
    manager.check_integrity(set())


def test_bitmask_unpacking_matches_bit_by_bit():
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)  # [3, W=4]
    expected = torch.tensor([[not (int(word) >> b) & 1 for word in row for b in range(32)] for row in bitmask])
    assert torch.equal(disallowed_tokens(bitmask, 128), expected)
    assert torch.equal(disallowed_tokens(bitmask, 100), expected[:, :100])


def _row():
    from engine.sampler import SampleRow

    return SampleRow(SamplingParams(temperature=0), [1], 1, None, ())


# -- many random schemas ---------------------------------------------------------------------
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=json_schemas())
def test_random_schemas_always_validate(llm, schema):
    params = _params(StructuredOutputsParams(json=schema), temperature=1.0, seed=len(json.dumps(schema)), n=2,
                     max_tokens=600)
    for text, reason in _texts(llm, "JSON:", params):
        assert reason == "stop", f"did not finish: {text!r}"
        validate(json.loads(text), schema)


def test_close_json_schema_closes_every_object_that_lists_properties():
    from engine import close_json_schema

    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                       "b": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
        "$defs": {"item": {"type": "object", "properties": {"y": {"type": "string"}}}},
        "anyOf": [{"type": "object", "properties": {"z": {}}, "additionalProperties": True}],
        "patternProperties": {"^p": {"type": "object", "properties": {}}},
    }
    closed = close_json_schema(schema)
    assert "additionalProperties" not in closed  # patternProperties: left as the user wrote it
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["item"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is True  # an explicit choice is kept
    assert closed["patternProperties"]["^p"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]  # the input is not mutated

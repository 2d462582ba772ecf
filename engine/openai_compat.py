"""The OpenAI API's request and response conventions, once, for every front-end: the HTTP app and the
in-process LangChain chat model. Pure mapping, no I/O and no HTTP types; bad values raise
InvalidRequestError naming the field (the server turns that into a 400).

    sampling_params(fields, max_tokens=, logprobs=, vocab_size=)   request fields -> SamplingParams
    structured_outputs(fields)          response_format / structured_outputs / guided_* -> constraint
    response_format_constraint(value)   OpenAI's response_format alone
    chat_logprobs(...)                  outputs -> `choices[].logprobs.content` (chat)
    completion_logprobs(...)            outputs -> the legacy completions logprobs object
    finish_reason(output)               the engine's reason as OpenAI reports it
    completion_sampling_params(...)     /v1/completions: sampling_params plus echo and max_tokens 0
    echoed_tokens(output, choice)       the prompt's tokens and logprobs ahead of a choice's (echo)
    without_generation(output)          max_tokens 0: the output as if nothing had been generated
    prompt_logprobs(...)                vLLM's `prompt_logprobs` response field
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.json_schemas import close_json_schema
from engine.structured_output import check_structured_outputs

MAX_N = 128
INT64 = (-(2**63), 2**63 - 1)
_FINITE = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "length_penalty")
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) report for -inf: JSON has no infinity


# -- requests -------------------------------------------------------------------------------------
def sampling_params(fields: Mapping[str, Any], *, max_tokens: int | None, logprobs: int | None,
                    vocab_size: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The SamplingParams of a completion or chat request's fields (OpenAI names and vLLM's
    extensions; absent or None fields take OpenAI's defaults). `prompt_logprobs`, when given,
    replaces the field's value (completions with echo need more than the field asks)."""
    get = fields.get
    n = 1 if get("n") is None else get("n")
    if n > MAX_N:
        raise InvalidRequestError(f"n must be at most {MAX_N}, got {n}.", param="n")
    for name in _FINITE:
        value = get(name)
        if value is not None and not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number.", param=name)
    seed = get("seed")
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise InvalidRequestError("seed must be a 64-bit signed integer.", param="seed")
    return SamplingParams(  # its own checks raise InvalidRequestError(param=...)
        n=n,
        best_of=get("best_of"),
        temperature=1.0 if get("temperature") is None else get("temperature"),
        top_p=1.0 if get("top_p") is None else get("top_p"),
        top_k=0 if get("top_k") is None else get("top_k"),
        min_p=0.0 if get("min_p") is None else get("min_p"),
        presence_penalty=get("presence_penalty") or 0.0,
        frequency_penalty=get("frequency_penalty") or 0.0,
        repetition_penalty=1.0 if get("repetition_penalty") is None else get("repetition_penalty"),
        seed=seed,
        stop=get("stop"),
        stop_token_ids=get("stop_token_ids"),
        max_tokens=max_tokens,
        min_tokens=get("min_tokens") or 0,
        logprobs=logprobs,
        prompt_logprobs=get("prompt_logprobs") if prompt_logprobs is None else prompt_logprobs,
        ignore_eos=bool(get("ignore_eos")),
        include_stop_str_in_output=bool(get("include_stop_str_in_output")),
        skip_special_tokens=True if get("skip_special_tokens") is None else get("skip_special_tokens"),
        spaces_between_special_tokens=(True if get("spaces_between_special_tokens") is None
                                       else get("spaces_between_special_tokens")),
        logit_bias=_logit_bias(get("logit_bias"), vocab_size),
        use_beam_search=bool(get("use_beam_search")),
        length_penalty=1.0 if get("length_penalty") is None else get("length_penalty"),
        early_stopping=False if get("early_stopping") is None else get("early_stopping"),
        structured_outputs=structured_outputs(fields),
        prompt_cache_key=get("prompt_cache_key"),
        prompt_cache_retention=get("prompt_cache_retention"),
    )


def _logit_bias(value: Mapping[Any, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    if not value:
        return None
    bias = {}
    for key, b in value.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size}).",
                                      param="logit_bias")
        if not math.isfinite(b):
            raise InvalidRequestError("logit_bias values must be finite.", param="logit_bias")
        bias[token] = b
    return bias


def structured_outputs(fields: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The output constraint of a request: OpenAI's `response_format`, vLLM's `structured_outputs`
    or its older `guided_*` fields (at most one of them). A malformed or non-compiling constraint
    is an error naming the field it came from."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    spec = response_format_constraint(fields.get("response_format"))
    if spec is not None:
        found.append(("response_format", spec))
    given = fields.get("structured_outputs")
    if given is not None:
        keys = {k: v for k, v in given.items() if k in _STRUCTURED_KEYS and v is not None}
        found.append(("structured_outputs", _structured("structured_outputs", **keys)))
    for name, key in _GUIDED_FIELDS.items():
        if fields.get(name) is not None:
            found.append((name, _structured(name, **{key: fields[name]})))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(f"Give one output constraint, not several ({', '.join(n for n, _ in found)}).",
                                  param=found[1][0])
    param, spec = found[0]
    check_structured_outputs(spec, param=param)  # tokenizer-free compile: fails here, not in the engine
    return spec


def _structured(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param=param) from None


def response_format_constraint(value: Any) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text or absent (no constraint), json_object, json_schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        json_schema = value.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, (dict, str)):
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema, a JSON Schema "
                                      "object.", param="response_format")
        # The output always follows the schema; strict mode (as OpenAI's) also closes every object.
        if json_schema.get("strict") is True and isinstance(schema, dict):
            schema = close_json_schema(schema)
        return StructuredOutputsParams(json=schema)
    raise InvalidRequestError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                              "{\"type\": \"json_schema\", \"json_schema\": {...}}.", param="response_format")


# -- responses ------------------------------------------------------------------------------------
def finish_reason(output: CompletionOutput) -> str | None:
    if output.finish_reason in ("stop", "length"):
        return output.finish_reason
    return None


def _sorted_top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30))
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def _token_text(decode: Callable[[int], str], tid: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else decode(tid)


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], k: int,
                  decode: Callable[[int], str]) -> list[dict[str, Any]]:
    """`logprobs.content` of a chat choice: per token its text, logprob, bytes and the top k alternatives."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid) or Logprob(float("nan"))
        text = _token_text(decode, tid, chosen)
        top = [{"token": _token_text(decode, t, lp), "logprob": lp.logprob,
                "bytes": list(_token_text(decode, t, lp).encode())} for t, lp in _sorted_top(entry, k)]
        content.append({"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return content


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], k: int,
                        decode: Callable[[int], str], offset: int) -> dict[str, list]:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset.
    A None entry (an echoed prompt's first token, which nothing scores) gives null logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            text = decode(tid)
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen = entry.get(tid) or Logprob(float("nan"))
            text = _token_text(decode, tid, chosen)
            token_logprobs.append(_finite(chosen.logprob))
            top = {_token_text(decode, t, lp): _finite(lp.logprob) for t, lp in _sorted_top(entry, k)}
            top.setdefault(text, _finite(chosen.logprob))  # OpenAI: the sampled token is always listed
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


# -- echo, max_tokens 0, prompt logprobs ----------------------------------------------------------
def completion_sampling_params(fields: Mapping[str, Any], *, max_tokens: int, vocab_size: int | None
                               ) -> SamplingParams:
    """/v1/completions' SamplingParams. `echo` with `logprobs` scores the prompt too (its top
    `logprobs`, or more when `prompt_logprobs` asks for more). `max_tokens` 0 (OpenAI: echo only)
    samples one token that `without_generation` then hides, as vLLM does: the prompt's logits are
    computed either way."""
    if max_tokens < 0:
        raise InvalidRequestError(f"max_tokens must be at least 0, got {max_tokens}.", param="max_tokens")
    logprobs, scored = fields.get("logprobs"), fields.get("prompt_logprobs")
    if fields.get("echo") and logprobs is not None and isinstance(logprobs, int):
        scored = logprobs if scored is None or not isinstance(scored, int) else max(scored, logprobs)
    return sampling_params(fields, max_tokens=max(max_tokens, 1), logprobs=logprobs, vocab_size=vocab_size,
                           prompt_logprobs=scored)


def without_generation(output: RequestOutput) -> RequestOutput:
    """The output of a max_tokens 0 request: no text, no tokens, finish_reason "length" (an abort
    stays an abort)."""
    outputs = [CompletionOutput(c.index, "", [], 0.0 if c.cumulative_logprob is not None else None,
                                [] if c.logprobs is not None else None,
                                c.finish_reason if c.finish_reason in (None, "abort") else "length")
               for c in output.outputs]
    return replace(output, outputs=outputs)


def echoed_tokens(output: RequestOutput, choice: CompletionOutput, start: int = 0, end: int | None = None
                  ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """(token ids, logprob entries) of an echoed choice: the prompt's, then the choice's tokens
    [start, end). Without prompt logprobs the prompt's entries are None."""
    prompt = list(output.prompt_token_ids)
    scored = output.prompt_logprobs if output.prompt_logprobs is not None else [None] * len(prompt)
    generated = choice.logprobs or []
    return prompt + choice.token_ids[start:end], list(scored) + list(generated[start:end])


def prompt_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None] | None, k: int
                    ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} with the top k and the prompt token itself."""
    if entries is None:
        return None
    result: list[dict[str, dict[str, Any]] | None] = []
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            result.append(None)
            continue
        kept = dict(_sorted_top(entry, k))
        if tid in entry:
            kept.setdefault(tid, entry[tid])
        result.append({str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                       for t, lp in kept.items()})
    return result

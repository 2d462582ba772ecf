"""What add_request checks before a request exists: prompt -> token ids, and the sampling params
the engine will really use (max_tokens filled in, the context and the KV pool checked)."""
from __future__ import annotations

from dataclasses import replace

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


def tokenize_prompt(tokenizer, vocab_size: int, prompt: PromptInput) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a string, a token-id list or a {"prompt" | "prompt_token_ids"} dict."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'.", param="prompt")
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer(prompt).input_ids
    elif isinstance(prompt, (list, tuple)):
        text, ids = None, list(prompt)
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}).", param="prompt")
    else:
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}.", param="prompt")
    if not ids:
        raise InvalidRequestError("the prompt is empty.", param="prompt")
    return text, ids


def effective_params(
    params: SamplingParams, prompt_len: int, max_model_len: int, block_size: int, num_blocks: int
) -> SamplingParams:
    room = max_model_len - prompt_len
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens < 1 or prompt_len + max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, {max(max_tokens, 1)} "
            f"for the completion). Please reduce the prompt or the completion length.",
            param="max_tokens" if prompt_len < max_model_len else "prompt",
        )
    # KV is stored for every token but the last sampled one.
    blocks_needed = -(-(prompt_len + max_tokens - 1) // block_size)
    if blocks_needed > num_blocks:
        raise ContextLengthExceededError(
            f"the request needs {blocks_needed} KV blocks but the pool has {num_blocks}; "
            f"reduce the prompt or max_tokens, or enlarge the KV cache.",
            param="max_tokens",
        )
    if params.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens exceeds the {max_tokens} tokens available.", param="min_tokens")
    return params if params.max_tokens == max_tokens else replace(params, max_tokens=max_tokens)

"""/v1/completions choices: the generated text and its logprobs, `echo` (the prompt, with its
logprobs when `logprobs` is set, ahead of the completion), `max_tokens: 0` (nothing generated:
the echo alone, finish_reason "length") and vLLM's `prompt_logprobs` field. The shapes follow
vLLM's serving_completion: a stream echoes the prompt in each choice's first chunk; streamed
chunks carry no `prompt_logprobs` (vLLM's stream choices have no such field).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.protocol import CompletionChoice, CompletionLogprobs, PromptLogprob
from app.serving import ChoiceCursor, completion_logprobs, finish_reason
from engine import openai_compat
from engine.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class CompletionChoices:
    echo: bool
    generate: bool  # False: max_tokens 0, the one token the engine samples is never shown
    logprobs: int | None  # the request's `logprobs` (None: no logprobs object)
    prompt_logprobs: int | None  # the request's `prompt_logprobs` (None: field not returned)
    decode: Callable[[int], str]
    prompt_text: Callable[[RequestOutput], str]

    def visible(self, out: RequestOutput) -> RequestOutput:
        """The engine's output as the client sees it (max_tokens 0: nothing generated)."""
        return out if self.generate else openai_compat.without_generation(out)

    def choice(self, index: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
        """A whole choice of a non-streamed response (`out` already `visible`)."""
        text = self.prompt_text(out) + c.text if self.echo else c.text
        lp = None
        if self.logprobs is not None:
            ids, entries = (openai_compat.echoed_tokens(out, c) if self.echo
                            else (c.token_ids, c.logprobs or []))
            lp = completion_logprobs(ids, entries, self.logprobs, self.decode, 0)
        return CompletionChoice(index, text, lp, finish_reason(c), c.stop_reason, self._prompt_logprobs(out))

    def delta(self, out: RequestOutput, c: CompletionOutput, cursor: ChoiceCursor
              ) -> tuple[str, CompletionLogprobs | None]:
        """(text, logprobs) a stream sends for choice `c` since the cursor's last call; the first
        call echoes the prompt ahead of the new text when asked."""
        first = cursor.num_tokens == 0 and cursor.text_len == 0
        text, start, end = cursor.advance(c)
        echo = self.echo and first
        if echo:
            text = self.prompt_text(out) + text
        if self.logprobs is None or not (echo or (end > start and c.logprobs is not None)):
            return text, None
        ids, entries = (openai_compat.echoed_tokens(out, c, start, end) if echo
                        else (c.token_ids[start:end], c.logprobs[start:end]))
        lp = completion_logprobs(ids, entries, self.logprobs, self.decode, cursor.text_offset)
        cursor.text_offset += sum(len(t) for t in lp.tokens)
        return text, lp

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict[str, PromptLogprob] | None] | None:
        if self.prompt_logprobs is None:
            return None
        entries = openai_compat.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.prompt_logprobs)
        return prompt_logprob_structs(entries)


def prompt_logprob_structs(entries: list[dict[str, dict]] | None) -> list[dict[str, PromptLogprob] | None] | None:
    """openai_compat.prompt_logprobs' plain dicts as the wire structs."""
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(**v) for t, v in e.items()} for e in entries]

"""SamplingParams: what one request asks of the sampler and the stop checker.

Field names and defaults follow vLLM's SamplingParams so users can switch without surprises.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError

# Temperatures below this are treated as greedy (same threshold as vLLM).
SAMPLING_EPS = 1e-5
RETENTION_MAX_S = 24 * 3600.0  # the longest retention a request may ask for (OpenAI's "24h")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Grammar-constrained decoding (vLLM's name): exactly one constraint per request.

    `json` is a JSON Schema (a dict or its JSON text), `json_object` asks for any JSON object,
    `regex` a regular expression the whole output matches, `choice` one of the given strings,
    `grammar` a lark grammar in llguidance's syntax. The engine compiles the constraint once
    per request (engine/structured_output.py) and masks every sampled token with it.

    `stop_on_repeated_block` (an engine extension, not a constraint): (open, close) markers; the
    sequence finishes as soon as it repeats a complete open...close block it already wrote
    (engine/repeated_blocks.py). The tool-call layer sets it for parallel calls.
    """

    json: dict | str | None = field(default=None, hash=False)
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = field(default=None, hash=False)
    grammar: str | None = None
    stop_on_repeated_block: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg, param="structured_outputs")

        markers = self.stop_on_repeated_block
        if markers is not None and (not isinstance(markers, tuple) or len(markers) != 2
                                    or not all(isinstance(m, str) and m for m in markers)):
            bad("stop_on_repeated_block must be a pair of non-empty strings (open, close).")

        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is True:
            kinds.append("json_object")
        elif self.json_object is not False:
            bad(f"json_object must be a boolean, got {self.json_object!r}.")
        if len(kinds) != 1:
            bad(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {kinds or 'none'}."
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            bad(f"json must be a JSON Schema (a dict or JSON text), got {type(self.json).__name__}.")
        if self.regex is not None and not isinstance(self.regex, str):
            bad(f"regex must be a string, got {type(self.regex).__name__}.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            bad("grammar must be a non-empty lark grammar string.")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                bad("choice must be a list of strings.")
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                bad("choice must be a non-empty list of strings.")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    # Beam search (engine-side; see issue on forks). Width = n.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Grammar-constrained decoding (engine/structured_output.py); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # What stays cached past the request's end (engine/retention.py): OpenAI's prompt_cache_key names a
    # session whose latest context is retained, for the engine's idle TTL ("in_memory") or 24 hours ("24h");
    # cache_breakpoints are Anthropic's cache_control: ((prompt tokens, TTL seconds), ...).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    cache_breakpoints: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.", "n")
        if self.best_of is not None and self.best_of != self.n:
            bad(f"best_of must equal n ({self.n}) when given, got {self.best_of}.", "best_of")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}.", "repetition_penalty")
        if not self.temperature >= 0.0:
            bad(f"temperature must be >= 0, got {self.temperature}.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}.", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}.", "seed")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                bad(f"{name} must be an integer in [0, 20], got {value!r}.", name)
        if self.stop is not None and not isinstance(self.stop, str):
            if not all(isinstance(s, str) for s in self.stop):
                bad("stop must be a string or a list of strings.", "stop")
        if any(s == "" for s in self.stop_strings):
            bad("stop strings must not be empty.", "stop")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids must be non-negative integers.", "stop_token_ids")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or not -100.0 <= float(bias) <= 100.0:
                    bad("logit_bias maps token ids to values in [-100, 100].", "logit_bias")
        if self.use_beam_search and self.temperature > SAMPLING_EPS and self.temperature != 1.0:
            # Beam search is deterministic; a sampling temperature would be silently ignored.
            bad("use_beam_search requires temperature 0 (or the default).", "temperature")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams.", "structured_outputs")
            if self.use_beam_search:
                bad("structured_outputs cannot be combined with use_beam_search.", "structured_outputs")
        if self.prompt_cache_key is not None and (not isinstance(self.prompt_cache_key, str)
                                                  or not 0 < len(self.prompt_cache_key) <= 1024):
            bad("prompt_cache_key must be a string of 1-1024 characters.", "prompt_cache_key")
        if self.prompt_cache_retention not in (None, "in_memory", "24h"):
            bad(f"prompt_cache_retention must be 'in_memory' or '24h', got {self.prompt_cache_retention!r}.",
                "prompt_cache_retention")
        if not isinstance(self.cache_breakpoints, tuple) or not all(
                isinstance(b, tuple) and len(b) == 2 and isinstance(b[0], int) and b[0] > 0
                and isinstance(b[1], (int, float)) and 0 < b[1] <= RETENTION_MAX_S for b in self.cache_breakpoints):
            bad("cache_breakpoints must be a tuple of (prompt tokens > 0, TTL seconds in (0, 24 h]) pairs.",
                "cache_breakpoints")

    # Derived views: computed, never stored, so the dataclass stays a plain value.
    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of an n>1 request: seed + index keeps samples distinct and reproducible."""
        if self.seed is None:
            return self
        return replace(self, seed=self.seed + index)

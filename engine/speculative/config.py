"""SpeculativeConfig: draft-free speculative decoding, spelled as vLLM spells it.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                   "prompt_lookup_max": 5, "prompt_lookup_min": 2})
    prefixserve serve --speculative-config '{"method": "suffix"}'

"ngram": prompt lookup in the sequence's own tokens. "suffix": the longest earlier occurrence of the
sequence's last tokens in its own tokens or in earlier requests' prompts and outputs (same cache_salt
only), as SuffixDecoding (arXiv 2411.04975) does with its suffix trees.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.config_json import from_keys, json_object
from engine.errors import InvalidConfigError

METHODS = ("ngram", "suffix")
# The default: suffix decoding where a step's cost is measured (one CPU process), off elsewhere (a GPU or
# tensor-parallel ranks take every draft unmeasured, and no run there has shown it never slower).
AUTO = "auto"
OFF = ("", "off", "none", "null", "{}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # None: 5 for ngram, suffix_decoding_max_tree_depth for suffix
    # Drafts of a sequence whose drafts are mostly rejected pause (engine/speculative/drafter.py); a step
    # drafts only as many tokens as the measured step cost says pay (engine/speculative/cost.py).
    # ngram: the longest and shortest run of the sequence's last tokens looked up in its earlier tokens
    prompt_lookup_max: int | None = None  # None: prompt_lookup_min, or 5 with neither (vLLM)
    prompt_lookup_min: int | None = None  # None: prompt_lookup_max, or 2 with neither
    # suffix (vLLM's names and defaults): the longest match plus draft followed; finished requests indexed
    # (oldest forgotten first); draft tokens at most this factor x the matched length; a continuation
    # seen in fewer than this share of the matches stops the draft.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidConfigError(f"speculative_config: {msg}")

        if self.method not in METHODS:
            bad(f"method must be one of {METHODS} (draft models are not served here), got {self.method!r}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (2, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if not 1 <= lo <= hi:
            bad(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}.")
        if self.num_speculative_tokens is None:
            default = 5 if self.method == "ngram" else self.suffix_decoding_max_tree_depth
            object.__setattr__(self, "num_speculative_tokens", default)
        if not 1 <= self.num_speculative_tokens <= 64:
            bad(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}.")
        if self.suffix_decoding_max_tree_depth < 2:
            bad(f"suffix_decoding_max_tree_depth must be at least 2, got {self.suffix_decoding_max_tree_depth}.")
        if self.suffix_decoding_max_cached_requests < 0:
            bad("suffix_decoding_max_cached_requests must be >= 0 (0: only the sequence's own tokens).")
        if self.suffix_decoding_max_spec_factor <= 0:
            bad(f"suffix_decoding_max_spec_factor must be positive, got {self.suffix_decoding_max_spec_factor}.")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            bad(f"suffix_decoding_min_token_prob must be in [0, 1], got {self.suffix_decoding_min_token_prob}.")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | str | None:
        """From the JSON text of the flag, a dict, or itself; None, "", "off" and {} mean off; "auto" stays
        "auto" until the engine knows its device (`resolve`)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and value.strip().lower() in OFF:
            return None
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        value = json_object(value, "speculative_config")
        if not value:
            return None
        if value.get("method", "ngram") not in METHODS:  # named first: a draft model's keys follow from it
            raise InvalidConfigError(f"speculative_config: method must be one of {METHODS} (draft models are "
                                     f"not served here), got {value.get('method')!r}.")
        return from_keys(cls, value, "speculative_config")

    @classmethod
    def resolve(cls, value: SpeculativeConfig | str | None, *, measured: bool) -> SpeculativeConfig | None:
        """What "auto" means on this engine: suffix decoding with vLLM's defaults where the step cost is
        measured (``measured``: one CPU process), off elsewhere. Measured on a 2-core AMD EPYC Zen 4, fresh
        processes, least of 3 rounds (benchmarks/results/amd-zen4-avx512bf16/speculative_versus_workloads.json):
        random-token workloads 0.98-1.03x the time of speculation off, single stream 0.21x; real text
        (speculative.json) 1.2-4.3x the output tokens/s at concurrency 1."""
        if value == AUTO:
            return cls(method="suffix") if measured else None
        return value

"""Draft-free speculative decoding: draft tokens guessed from the context (ngram) and from earlier
requests (suffix), verified in one forward with the row they extend.

    config.py   SpeculativeConfig (vLLM's keys)
    index.py    where runs of tokens occurred: a sequence's own, and finished requests' per cache_salt
    drafter.py  each decoding sequence's drafts, per-sequence backoff, the per-step choice
    cost.py     a step's measured cost by token count, and which drafts pay
    verify.py   the accepted prefix of each row's drafts (exact for greedy, rejection sampling otherwise)
"""
from __future__ import annotations

import logging

from engine.speculative.config import SpeculativeConfig
from engine.speculative.cost import StepCost
from engine.speculative.drafter import Drafter

logger = logging.getLogger("prefixserve")

__all__ = ["Drafter", "SpeculativeConfig", "StepCost", "build_drafter"]


def build_drafter(config: SpeculativeConfig | None, runner, max_model_len: int, parallel: bool = False,
                  grammar_check=None) -> Drafter | None:
    """The engine's drafter (None when speculation is off). On one CPU process the step cost is measured
    now; a GPU, or ranks that must run every forward together, take every draft (a flat cost)."""
    measure = runner.device.type == "cpu" and not parallel
    config = SpeculativeConfig.resolve(config, measured=measure)
    if config is None:
        return None
    cost = StepCost.measure(runner) if measure else StepCost.flat()
    if measure:
        base = cost.seconds[0]
        logger.info("speculative decoding (%s, up to %d draft tokens): step cost by tokens %s", config.method,
                    config.num_speculative_tokens,
                    ", ".join(f"{n}: {s / base:.2f}x" for n, s in zip(cost.tokens, cost.seconds)))
    return Drafter(config, cost, max_model_len, grammar_check)

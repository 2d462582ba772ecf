"""Beam search for one request, run inside the engine as forks and frees of sequences.

It follows HF transformers' `_beam_search` (generation/utils.py) step for step, so that with the
same logprobs it keeps the same beams and returns the same hypotheses:

  * each step, every running beam offers its best 2·width continuations; the best 2·width of
    all of them by cumulative logprob are the candidates;
  * a candidate "hits" when its token stops (EOS / stop token) or it reaches max_tokens;
  * the best `width` candidates that did not hit run on; those among the top `width` that hit
    become finished hypotheses scored cumulative / generated_len ** length_penalty, and the
    best `width` hypotheses are kept;
  * the search stops when no candidate can continue, when `early_stopping=True` and `width`
    hypotheses exist, or when (the heuristic) the best running beam can no longer beat the
    worst kept hypothesis.

The engine owns the sequences and their blocks; this object only decides. A continuation of a
beam that is chosen twice becomes a fork (shared blocks, copy-on-write), a beam not chosen is
freed; no beam ever recomputes its prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence

_NEG = -1.0e9  # HF's penalty for candidates that hit a stopping criterion


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # generated tokens (the stop token included when it ended on one)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty; ranks hypotheses
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class Continuation:
    parent: Sequence
    token_id: int
    cumulative_logprob: float


class BeamSearch:
    def __init__(
        self,
        root: Sequence,
        *,
        width: int,
        max_tokens: int,
        length_penalty: float,
        early_stopping: bool | str,
        stop_token_ids: frozenset[int],
    ) -> None:
        self.width = width
        self.prompt_len = root.num_prompt_tokens
        self.max_length = root.num_prompt_tokens + max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_token_ids = stop_token_ids
        self.running: list[tuple[Sequence, float]] = [(root, 0.0)]  # (beam, cumulative logprob)
        self.finished: list[Hypothesis] = []  # best first, at most width
        self._candidates: dict[str, list[tuple[int, float]]] = {}
        self._cur_len = root.num_prompt_tokens
        self._improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    # -- engine side ---------------------------------------------------------------------------
    def record(self, beam: Sequence, top: list[tuple[int, float]]) -> None:
        """The beam's best continuations (token, raw logprob) after its last token."""
        self._candidates[beam.seq_id] = top

    def ready(self) -> bool:
        return not self.done and all(b.seq_id in self._candidates for b, _ in self.running)

    def beams(self) -> list[Sequence]:
        return [b for b, _ in self.running]

    # -- the decision --------------------------------------------------------------------------
    def step(self) -> list[Continuation]:
        """Choose the next beams; returns them as (parent beam, token) continuations, best first.
        Sets `done` when the search is over (the continuations are then to be dropped)."""
        k, keep = self.width, 2 * self.width
        pool = [
            (score + lp, beam, token)
            for beam, score in self.running
            for token, lp in self._candidates[beam.seq_id]
        ]
        pool.sort(key=lambda c: -c[0])  # stable: ties keep beam order, like topk over beams*vocab
        candidates = pool[:keep]
        self._candidates.clear()
        reached_max = self._cur_len + 1 >= self.max_length
        hits = [reached_max or token in self.stop_token_ids for _, _, token in candidates]

        self._add_finished(candidates[:k], hits[:k])
        ranked = sorted(range(len(candidates)), key=lambda j: -(candidates[j][0] + _NEG * hits[j]))[:k]
        self._cur_len += 1
        best_running = candidates[ranked[0]][0] + _NEG * hits[ranked[0]]
        self._update_heuristic(best_running)
        full = len(self.finished) == k
        self.done = not self._improvable or (full and self.early_stopping is True) or all(hits)
        continuations = [Continuation(candidates[j][1], candidates[j][2], candidates[j][0]) for j in ranked]
        self.running = [] if self.done else [(c.parent, c.cumulative_logprob) for c in continuations]
        return continuations

    def _add_finished(self, top: list, hits: list[bool]) -> None:
        full = len(self.finished) == self.width
        if (full and self.early_stopping is True) or not self._improvable:
            return
        gen_len = self._cur_len + 1 - self.prompt_len
        for (cum, beam, token), hit in zip(top, hits):
            if hit:
                tokens = tuple(beam.token_ids[self.prompt_len:]) + (token,)
                reason = "stop" if token in self.stop_token_ids else "length"
                self.finished.append(Hypothesis(tokens, cum, cum / gen_len ** self.length_penalty, reason))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]

    def _update_heuristic(self, best_running: float) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self._cur_len - self.prompt_len
        best_possible = best_running / best_len ** self.length_penalty
        worst = min(h.score for h in self.finished) if len(self.finished) == self.width else _NEG
        self._improvable = self._improvable and best_possible > worst

"""Sampler: logits of the rows that need a token -> chosen tokens (+ logprobs).

Order (as vLLM v1): raw logprobs from the model's logits; then logit bias, min_tokens masking,
penalties and the grammar mask of structured outputs (-inf on disallowed tokens); greedy rows
take the argmax; the others are scaled by temperature, filtered by min_p, top_k and top_p (kernels/sampling.py:
a radix select in C, no sort), and sampled by the exponential race (argmax p/q, q ~ Exp(1), also
kernels/sampling.py) keyed, for a seeded request, by its seed and the index of the output token drawn
(`seeded_race_key`), so a seeded row's draw depends on neither its batch nor the step it falls in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarMask, apply_grammar_mask
from kernels.sampling import race, top_k_top_p_probs


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    token_ids: list[int]  # all tokens so far (prompt + output), for penalties
    num_prompt_tokens: int
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...]  # EOS / stop tokens while below min_tokens
    num_top_logprobs: int | None = None  # None: no logprobs wanted for this row
    race_key: int | None = None  # a seeded row's key for its race (else one draw from its generator)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # raw logprob of the chosen token (None if not needed)
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), best first
    ranks: list[int | None]  # rank of the chosen token under the raw distribution (1 = best)


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows without their own seed

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], grammar: GrammarMask | None = None) -> SampleResult:
        # logits: [N, V] float32, consumed: the grammar mask is written into them (a 3 MB copy per
        # step at N=16 cost more than the mask itself). On a GPU, plain greedy rows take their argmax
        # there; anything else is chosen on the CPU (64 rows of Llama 3's vocabulary are 33 MB: copying
        # them took 3-5 ms of a 17-32 ms decode step on an H200, benchmarks/results/h200).
        if logits.device.type != "cpu":
            if grammar is None and all(_plain_greedy(r) for r in rows):
                n = len(rows)
                return SampleResult(logits.max(dim=-1).indices.tolist(), [None] * n, [None] * n, [None] * n)
            logits = logits.cpu()
        want_logprobs = any(r.num_top_logprobs is not None for r in rows)
        # Logprobs stay the model's own (as vLLM): computed before any processor or grammar mask.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [N, V]
        model_logits = logits
        logits = self._apply_processors(logits, rows)
        if grammar is not None:
            logits = self._apply_grammar(logits, model_logits, rows, grammar)
        tokens = self._choose(logits, rows)  # [N]
        return self._result(tokens, raw_logprobs, rows)

    # -- logits processors ----------------------------------------------------------
    def _apply_processors(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        if not any(r.banned_token_ids or r.params.logit_bias or r.params.needs_penalties for r in rows):
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
                if ids.numel():
                    logits[i, ids] += torch.tensor([float(p.logit_bias[int(t)]) for t in ids])
            if p.needs_penalties:
                self._penalize(logits[i], row, vocab)
            if row.banned_token_ids:
                logits[i, [t for t in row.banned_token_ids if t < vocab]] = float("-inf")
        return logits

    @staticmethod
    def _apply_grammar(
        logits: torch.Tensor, model_logits: torch.Tensor, rows: list[SampleRow], grammar: GrammarMask
    ) -> torch.Tensor:
        apply_grammar_mask(logits, grammar)  # in place (on a processors' copy if there was one)
        banned = [j for j, r in enumerate(grammar.rows.tolist()) if rows[r].banned_token_ids]
        if banned:
            # min_tokens banned the only tokens the grammar allows (EOS once it is complete): the
            # grammar wins, so such a row keeps a choice. (Bans made _apply_processors copy the
            # logits, so model_logits are still unmasked.)
            idx = grammar.rows[banned]
            dead = torch.isneginf(logits[idx]).all(dim=-1)  # [b]
            if bool(dead.any()):
                keep = GrammarMask(idx[dead], grammar.bitmask[torch.tensor(banned)[dead]])
                logits[keep.rows] = model_logits[keep.rows]
                apply_grammar_mask(logits, keep)
        return logits

    @staticmethod
    def _penalize(row_logits: torch.Tensor, row: SampleRow, vocab: int) -> None:
        p = row.params
        all_ids = torch.tensor(row.token_ids, dtype=torch.long)
        if p.repetition_penalty != 1.0:
            # HF/vLLM rule: over prompt and output tokens, divide positive logits, multiply negative.
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[all_ids] = True
            penalized = torch.where(row_logits > 0, row_logits / p.repetition_penalty, row_logits * p.repetition_penalty)
            row_logits.copy_(torch.where(seen, penalized, row_logits))
        if p.frequency_penalty or p.presence_penalty:
            # OpenAI rule: over output tokens only.
            counts = torch.bincount(all_ids[row.num_prompt_tokens:], minlength=vocab)[:vocab].float()
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    # -- choosing ---------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        # Greedy for everyone, overwritten for sampling rows. max(dim).indices is argmax (the first
        # maximal index, NaN counting as maximal) at ~2.5x the speed on CPU (1.1 vs 2.7 ms at [64, 49152]).
        tokens = logits.max(dim=-1).indices
        sampling = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not sampling:
            return tokens
        idx = torch.tensor(sampling, dtype=torch.long)
        params = [rows[i].params for i in sampling]
        sub = logits[idx] / torch.tensor([p.temperature for p in params]).unsqueeze(1)  # [S, V]
        min_p = torch.tensor([p.min_p for p in params])
        if bool((min_p > 0).any()):
            probs = sub.softmax(-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            sub = sub.masked_fill(probs < threshold, float("-inf"))
        probs = self._sampling_probs(sub, params)  # [S, V]
        seeds = torch.tensor([rows[i].race_key if rows[i].race_key is not None
                              else _race_seed(rows[i].generator or self.generator) for i in sampling])  # [S]
        drawn = race(probs, seeds)  # [S]; -1 for a row without a positive probability (NaN logits)
        tokens[idx] = torch.where(drawn >= 0, drawn, tokens[idx])  # such a row keeps its argmax
        return tokens

    @staticmethod
    def _sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[-1]
        ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).clamp(max=vocab)
        ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        if bool((ks >= vocab).all()) and bool((ps >= 1.0).all()):
            return logits.softmax(-1)
        return top_k_top_p_probs(logits, ks, ps)

    # -- logprobs ---------------------------------------------------------------------
    @staticmethod
    def _result(tokens: torch.Tensor, raw: torch.Tensor | None, rows: list[SampleRow]) -> SampleResult:
        token_list = tokens.tolist()
        n = len(rows)
        if raw is None:
            return SampleResult(token_list, [None] * n, [None] * n, [None] * n)
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [N]
        ranks = (raw > chosen.unsqueeze(1)).sum(-1) + 1  # [N]
        k_max = max((r.num_top_logprobs or 0) for r in rows)
        top_vals, top_ids = raw.topk(k_max, dim=-1) if k_max else (None, None)
        tops: list[list[tuple[int, float]] | None] = []
        for i, row in enumerate(rows):
            k = row.num_top_logprobs
            if k is None:
                tops.append(None)
            else:
                tops.append(list(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist())) if k else [])
        return SampleResult(token_list, chosen.tolist(), tops, ranks.tolist())


def _plain_greedy(row: SampleRow) -> bool:
    """The argmax of the model's own logits: greedy, no logprobs, nothing that edits the logits."""
    p = row.params
    return (p.is_greedy and row.num_top_logprobs is None and not row.banned_token_ids and not p.logit_bias
            and not p.needs_penalties)


def seeded_race_key(seed: int, output_index: int) -> int:
    """The race key of a seeded request's ``output_index``-th token: splitmix64 of the pair, in [0, 2^62)."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 2


def _race_seed(generator: torch.Generator) -> int:
    """The key of one row's race this step: one draw from its generator, which the draw advances
    (so the next step's key differs, and a seeded row replays the same keys)."""
    return int(torch.randint(0, 2**62, (), generator=generator))

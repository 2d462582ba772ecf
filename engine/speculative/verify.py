"""Verifying drafts: a row with drafts d_1..d_k was sampled at each of its k + 1 last positions, giving
t_0..t_k (t_i drawn from the model's distribution after the tokens before d_{i+1}, drafts included). The
drafts agreeing with the samples are kept, d_1..d_a = t_0..t_{a-1}, then t_a: the row yields a + 1 tokens.

Why this is exact: greedy rows give the argmax at each position, so the tokens are those of decoding one at
a time. For sampled rows this is rejection sampling with a draft that has no probabilities (a point mass,
as vLLM's n-gram drafts): d_i is kept with probability p_i(d_i), and on a rejection t_i is a draw from p_i
conditioned on not being d_i -- the residual distribution (p - q)+ normalized. A seeded request's draw for
its j-th output token is keyed by (seed, j) (engine/sampler.py seeded_race_key), not taken from a generator
in order, so it is the same draw whether or not a draft was verified there, whichever drafts the step chose.
"""
from __future__ import annotations

from engine.sampler import SampleResult
from engine.scheduler_output import SampleSpec, ScheduledRow


def verify_drafts(rows: tuple[ScheduledRow, ...], specs: list[SampleSpec], samples: SampleResult
                  ) -> tuple[list[SampleSpec], SampleResult, dict[str, int]]:
    """Keep each row's accepted samples: (specs, samples) in order, one entry per emitted token, and the
    number of drafts accepted per sequence that drafted."""
    keep: list[int] = []
    accepted: dict[str, int] = {}
    i = 0
    for row in rows:
        for _ in row.samples:
            k = row.num_draft_tokens
            drafts = row.draft_token_ids
            a = 0
            while a < k and samples.token_ids[i + a] == drafts[a]:
                a += 1
            keep.extend(range(i, i + a + 1))
            if k:
                accepted[row.seq_id] = a
            i += k + 1
    pick = lambda xs: [xs[j] for j in keep]  # noqa: E731
    return (pick(specs), SampleResult(pick(samples.token_ids), pick(samples.logprobs), pick(samples.top_logprobs),
                                      pick(samples.ranks)), accepted)

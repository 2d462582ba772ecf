"""The parts of speculative decoding: verification keeps the sampling distribution, the indexes find the
longest earlier match and never cross a cache_salt, the step-cost rule, and trimming blocks."""
from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SampleRow
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SampleSpec, ScheduledRow
from engine.speculative.cost import StepCost, worth_drafting
from engine.speculative.drafter import _ngram_draft, _suffix_draft
from engine.speculative.index import SequenceIndex, SharedIndex
from engine.speculative.verify import verify_drafts
from prefix_cache import BlockManager


def test_verification_keeps_the_sampling_distribution():
    """One draft token d after a known token: the first emitted token must be distributed as p, and d kept
    with probability p(d) (rejection sampling of a draft without probabilities)."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    logits = p.log().expand(2, -1)  # both positions: the same distribution (a stateless model)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    draft = 2
    trials = 20000
    rows, specs, logit_rows = [], [], []
    for i in range(trials):
        rows.append(ScheduledRow(f"s{i}", 10, (7, draft), (0,), (SampleSpec(f"s{i}", params, (), None),), None, 1))
    for i in range(trials):
        specs += [rows[i].samples[0]] * 2
        logit_rows.append(logits)
    sampler = Sampler(torch.Generator().manual_seed(0))
    samples = sampler(torch.cat(logit_rows), [SampleRow(params, [], 0, None, ()) for _ in specs])
    kept_specs, kept, accepted = verify_drafts(tuple(rows), specs, samples)
    first = torch.tensor([kept.token_ids[j] for j in range(len(kept_specs))
                          if j == 0 or kept_specs[j].seq_id != kept_specs[j - 1].seq_id])
    freq = torch.bincount(first, minlength=5).float() / trials
    assert (freq - p).abs().max() < 0.015, freq  # ~4 standard errors at 20,000 draws
    acceptance = sum(accepted.values()) / trials
    assert abs(acceptance - p[draft].item()) < 0.015
    assert len(kept_specs) == trials + sum(accepted.values())  # a + 1 tokens per row


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_next_sample():
    params = SamplingParams(temperature=0, max_tokens=8)
    spec = SampleSpec("s", params, (), None)
    row = ScheduledRow("s", 4, (9, 1, 2, 3), (0,), (spec,), None, 3)
    logits = torch.full((4, 6), -5.0)
    for pos, token in enumerate([1, 2, 5, 4]):  # the model says 1, 2, then 5 where the draft says 3
        logits[pos, token] = 5.0
    samples = Sampler(torch.Generator())(logits, [SampleRow(params, [], 0, None, ())] * 4)
    specs, kept, accepted = verify_drafts((row,), [spec] * 4, samples)
    assert kept.token_ids == [1, 2, 5] and accepted == {"s": 2} and len(specs) == 3


def test_sequence_index_finds_the_longest_then_newest_match():
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3, 4, 0, 1, 2, 3]
    index = SequenceIndex(2)
    matches = index.candidates(tokens, 5)
    assert sorted((m.end, m.length) for m in matches) == [(3, 3), (7, 2), (12, 3)]
    assert _ngram_draft(matches, 2) == (4, 0)  # [1, 2, 3] twice: the newest, ending at 12
    tokens += [4]  # grows: only the new position is indexed
    assert [(m.end, m.length) for m in index.candidates(tokens, 5)] == [(13, 4)] and index.indexed == len(tokens)


def test_suffix_follows_the_majority_and_stops_below_the_min_probability():
    docs = SharedIndex(2, max_requests=10)
    for tail in ([7, 8, 9], [7, 8, 6], [7, 5, 5]):
        docs.add(None, [1, 2, 3] + tail)
    matches = docs.candidates(None, [0, 1, 2, 3], 24)
    assert _suffix_draft(matches, room=8, spec_factor=1.0, min_prob=0.1) == (7, 8, 9)  # 3/3, 2/3, 1/2
    assert _suffix_draft(matches, room=8, spec_factor=1.0, min_prob=0.6) == (7, 8)
    assert _suffix_draft(matches, room=8, spec_factor=0.4, min_prob=0.1) == (7,)  # 0.4 x 3 matched


def test_shared_index_is_bounded_and_keeps_tenants_apart():
    docs = SharedIndex(2, max_requests=2, max_tokens=100)
    docs.add("a", [1, 2, 3, 4])
    assert docs.candidates("b", [1, 2], 8) == [] and docs.candidates(None, [1, 2], 8) == []
    assert [m.end for m in docs.candidates("a", [1, 2], 8)] == [2]
    docs.add("a", [5, 6, 7])
    docs.add("a", [8, 9, 10])  # the first is forgotten
    docs.check_integrity()
    assert docs.candidates("a", [1, 2], 8) == [] and len(docs.docs) == 2 and docs.num_tokens == 6
    docs.add("a", list(range(200)))  # longer than the whole budget: not held
    docs.check_integrity()
    assert docs.num_tokens == 6


def test_drafts_are_verified_only_while_they_raise_tokens_per_second():
    cost = StepCost((1, 8, 64), (1.0, 1.2, 4.0))  # flat-ish to 8 tokens, then compute-bound
    assert worth_drafting(cost, 1, 1.0, [(5, 3.0)]) == [0]
    assert worth_drafting(cost, 1, 1.0, [(5, 0.05)]) == []  # a draft nobody accepts costs 13% for nothing
    assert worth_drafting(cost, 64, 64.0, [(5, 2.0)]) == []  # at 64 rows 5 more tokens cost more than 2 yield
    assert worth_drafting(StepCost.flat(), 64, 64.0, [(5, 0.1)]) == [0]
    assert cost.seconds_for(36) == 1.2 + 2.8 * 28 / 56 and cost.seconds_for(128) == 4.0 + (2.8 / 56) * 64


def test_trim_releases_only_the_blocks_past_the_kept_tokens():
    blocks = BlockManager(16, 4, enable_caching=True)
    tokens = list(range(9))
    blocks.allocate("s", 9, token_ids=tokens)
    blocks.commit("s", tokens, 8)
    blocks.allocate("s", 14)  # 9 known + 5 drafts
    assert len(blocks.block_ids("s")) == 4
    assert blocks.trim("s", 10) == 1 and len(blocks.block_ids("s")) == 3
    blocks.check_integrity()
    try:
        blocks.trim("s", 4)
    except ValueError as exc:
        assert "committed" in str(exc)
    else:
        raise AssertionError("trimmed a committed block")
    blocks.free("s")
    blocks.check_integrity()


@pytest.mark.parametrize("mask", [None, 7])
def test_shared_index_finds_exactly_the_true_matches_even_when_keys_collide(monkeypatch, mask):
    """Every candidate is a real earlier occurrence in the asker's namespace; with an honest hash they are
    the newest such occurrences, and with 3-bit keys (every key collides) still never a wrong or foreign one.
    Forgetting keeps the index exact (check_integrity compares it with the documents held)."""
    import random

    from engine.speculative import index as index_module

    if mask is not None:
        monkeypatch.setattr(index_module, "_MASK", mask)
    rng = random.Random(0)
    docs = SharedIndex(2, max_requests=6)
    held: list[tuple[str, list[int]]] = []
    for i in range(20):
        namespace, tokens = "ab"[i % 2], [rng.randrange(6) for _ in range(rng.randint(3, 40))]
        docs.add(namespace, tokens)
        held = (held + [(namespace, tokens)])[-6:]
        docs.check_integrity()
        for namespace in "ab":
            query = [rng.randrange(6) for _ in range(5)]
            found = [(m.tokens.tolist(), m.end, m.length) for m in docs.candidates(namespace, query, 8)]
            truth = [(t, end) for ns, t in held if ns == namespace
                     for end in range(2, len(t)) if t[end - 2:end] == query[-2:]]
            for tokens, end, length in found:
                assert (tokens, end) in truth and length >= 2 and tokens[end - length:end] == query[-length:]
            if mask is None:
                assert [(t, e) for t, e, _ in found] == truth[-8:]
    own, tokens = SequenceIndex(2), []
    for _ in range(60):  # a sequence's own index, grown a token at a time and then by a long run
        tokens += [rng.randrange(6) for _ in range(1 if len(tokens) < 40 else 40)]
        found = [(m.end, m.length) for m in own.candidates(tokens, 8)]
        truth = [end for end in range(2, len(tokens)) if tokens[end - 2:end] == tokens[-2:]]
        assert all(end in truth and length >= 2 for end, length in found)
        if mask is None:
            assert [end for end, _ in found] == truth[-8:]

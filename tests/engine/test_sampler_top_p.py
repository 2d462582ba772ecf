"""The top-k / top-p filter (kernels/sampling.py: the C kernel's radix select of the cut values) keeps
exactly the reference's set (a torch sort and a scatter, as vLLM does) and gives its probabilities."""
import pytest
import torch

from kernels.cpu.native import native_kernels
from kernels.sampling import race, top_k_top_p_probs, top_k_top_p_probs_torch


def _assert_same_distribution(fast: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor | None = None,
                              ks: torch.Tensor | None = None, ps: torch.Tensor | None = None) -> None:
    """The same kept set token for token, except a token at the top-p cut itself (with `logits`, `ks`, `ps`):
    the reference's float32 cumsum may put it either side (flat rows of 49,152 tokens: 0.50000042 in the
    reference where float64 gives 0.49999987 for p = 0.5), the kernel's double sums the other."""
    differ = (fast > 0) != (ref > 0)
    for row, token in differ.nonzero().tolist():
        assert logits is not None, f"row {row}: token {token} kept by one side only"
        assert _at_the_cut(logits[row], int(ks[row]), float(ps[row]), token), f"row {row}: token {token} off the cut"
    torch.testing.assert_close(fast * ~differ, ref * ~differ, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(fast.sum(-1), torch.ones(fast.shape[0]))


def _at_the_cut(logits: torch.Tensor, k: int, p: float, token: int) -> bool:
    """Whether `token`'s cumulative probability (ascending, over the top-k set, in float64) is 1 - p to
    within float32 summation error."""
    x = logits.double()
    kept = x >= torch.topk(x, min(k, x.numel())).values[-1]
    probs = torch.softmax(x.masked_fill(~kept, float("-inf")), 0)
    order = torch.argsort(x, stable=True)
    cumulative = torch.cumsum(probs[order], 0)[(order == token).nonzero().item()]
    return abs(float(cumulative) - (1.0 - p)) < 2e-6


def _logits(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if kind == "peaked":  # a real model: a few tokens hold most of the mass
        x = x * 4.0
    elif kind == "flat":  # nearly uniform: the nucleus spills past the candidates
        x = x * 0.01
    return x


@pytest.mark.parametrize("kind", ["peaked", "normal", "flat"])
@pytest.mark.parametrize("vocab", [300, 5000, 49152])
@pytest.mark.parametrize("k, p", [(0, 0.9), (0, 0.5), (40, 1.0), (40, 0.8), (2000, 0.95), (2000, 1.0), (0, 1e-6)])
def test_fast_filter_keeps_the_reference_set(kind, vocab, k, p):
    logits = _logits(kind, 6, vocab, seed=vocab + k)
    ks = torch.full((6,), k if k > 0 else vocab).clamp(max=vocab)
    ps = torch.full((6,), p)
    _assert_same_distribution(top_k_top_p_probs(logits, ks, ps), top_k_top_p_probs_torch(logits, ks, ps), logits, ks,
                              ps)


def test_rows_with_different_settings_in_one_batch():
    logits = torch.cat([_logits("peaked", 2, 49152, 1), _logits("flat", 2, 49152, 2)])
    ks = torch.tensor([49152, 30, 49152, 3000])
    ps = torch.tensor([0.9, 1.0, 0.95, 0.7])
    fast = top_k_top_p_probs(logits, ks, ps)
    _assert_same_distribution(fast, top_k_top_p_probs_torch(logits, ks, ps))
    kept = (fast > 0).sum(-1)
    assert int(kept[2]) > 10_000 and int(kept[0]) < 1_000  # a flat row's nucleus is most of the vocabulary


def test_ties_masked_rows_and_declined_rows():
    """Tied logits at the cut are all kept (as the reference's "values >= the smallest kept"); -inf
    tokens (min_p, grammar) never are; a row with a NaN or no finite logit goes to the reference."""
    ties = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 3.0], [0.0] * 6])
    ks, ps = torch.tensor([2, 6]), torch.tensor([1.0, 0.5])
    fast = top_k_top_p_probs(ties, ks, ps)
    _assert_same_distribution(fast, top_k_top_p_probs_torch(ties, ks, ps))
    assert (fast[0] > 0).tolist() == [False, True, True, True, False, True]
    assert bool((fast[1] > 0).all())  # one value: the cut falls inside the tie, which is kept whole
    masked = torch.randn(3, 1000)
    masked[:, ::3] = float("-inf")
    masked[2] = float("-inf")
    masked[2, 7] = 1.0  # one finite token
    ks, ps = torch.full((3,), 1000), torch.tensor([0.9, 1.0, 0.9])
    fast = top_k_top_p_probs(masked, ks, ps)
    assert not bool((fast[:2, ::3] > 0).any()) and fast[2, 7] == 1.0
    _assert_same_distribution(fast, top_k_top_p_probs_torch(masked, ks, ps))
    nan = torch.randn(2, 500)
    nan[1, 3] = float("nan")
    out = top_k_top_p_probs(nan, torch.tensor([500, 500]), torch.tensor([0.9, 0.9]))
    torch.testing.assert_close(out[0], top_k_top_p_probs_torch(nan[:1], torch.tensor([500]), torch.tensor([0.9]))[0])
    assert torch.equal(out[1].isnan(), top_k_top_p_probs_torch(nan[1:], torch.tensor([500]), torch.tensor([0.9]))[0].isnan())


def test_bad_arguments_are_rejected():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="float32"):
        top_k_top_p_probs(x.double(), torch.tensor([10, 10]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="shape"):
        top_k_top_p_probs(x, torch.tensor([10]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        top_k_top_p_probs(x, torch.tensor([10, 10]), torch.tensor([0.0, 0.5]))


def test_the_kernel_is_built_here():
    assert native_kernels() is not None  # CI has a C compiler: the tests above ran the kernel


def test_the_sampler_race_draws_from_the_distribution_and_replays_a_seed():
    from engine.sampler import _race_seed

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]])
    g = torch.Generator().manual_seed(0)

    def draw(p, gen):
        return int(race(p, torch.tensor([_race_seed(gen)]))[0])

    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(6000)]), minlength=5).float() / 6000
    assert counts[1] == 0 and counts[4] == 0  # a token with p = 0 never wins
    assert torch.allclose(counts, probs[0], atol=0.025)
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs, a) for _ in range(50)] == [draw(probs, b) for _ in range(50)]  # seeded
    edge = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])  # zero mass first and last
    assert {draw(edge, g) for _ in range(2000)} == {1, 3}


def test_the_sampler_draws_each_sampling_row_by_its_own_seed_and_keeps_greedy_rows():
    from engine.sampler import Sampler, SampleRow
    from engine.sampling_params import SamplingParams

    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    nan_row = torch.full((1, 300), float("nan"))

    def rows(seed_a: int):
        sampled = SamplingParams(temperature=1.0, top_p=0.9)
        return [SampleRow(sampled, [1], 1, torch.Generator().manual_seed(seed_a), ()),
                SampleRow(SamplingParams(temperature=0), [1], 1, None, ()),
                SampleRow(sampled, [1], 1, torch.Generator().manual_seed(99), ())]

    sampler = Sampler(torch.Generator().manual_seed(0))
    first = sampler(logits.clone(), rows(5)).token_ids
    assert first == sampler(logits.clone(), rows(5)).token_ids  # the row seeds alone decide
    assert first[1] == int(logits[1].argmax())  # greedy row untouched
    kept = top_k_top_p_probs(logits[[0, 2]], torch.tensor([300, 300]), torch.tensor([0.9, 0.9]))
    assert kept[0, first[0]] > 0 and kept[1, first[2]] > 0  # drawn among the kept tokens
    draws = {sampler(logits.clone(), rows(s)).token_ids[0] for s in range(40)}
    assert len(draws) > 1 and draws <= set(kept[0].nonzero().squeeze(1).tolist())
    # NaN logits (a broken model): no row to draw from; the step still answers, with the argmax
    out = sampler(torch.cat([nan_row, logits[1:]]), rows(5)).token_ids
    assert out[1:] == first[1:] and 0 <= out[0] < 300

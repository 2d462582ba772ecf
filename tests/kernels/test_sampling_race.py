"""The exponential race (kernels/sampling.py `race`, C in kernels/cpu/csrc/top_p.c): the C kernel picks
the reference's token, draws each token with its probability, and replays a seed."""
import pytest
import torch

from kernels.cpu.native import native_kernels
from kernels.sampling import race, race_torch, race_uniforms


def _rows(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(rows, vocab, generator=g)
    if kind == "peaked":
        p = p**8
    elif kind == "top_p":  # most tokens cut away, as after a top-p filter
        p[p < 0.9] = 0.0
    elif kind == "one":  # a single token kept
        p = torch.zeros(rows, vocab)
        p[:, vocab // 2] = 1.0
    return p / p.sum(-1, keepdim=True).clamp(min=1e-30)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
@pytest.mark.parametrize("kind", ["flat", "peaked", "top_p", "one"])
def test_the_kernel_picks_the_reference_token(vocab, kind):
    probs = _rows(kind, 6, vocab, seed=vocab)
    seeds = torch.tensor([0, 1, -1, 2**62, -(2**63), 123456789], dtype=torch.int64)
    assert torch.equal(race(probs, seeds), race_torch(probs, seeds))


def test_the_kernel_is_built_here():
    assert native_kernels() is not None  # CI has a C compiler: the tests above ran the kernel


def test_uniforms_stay_inside_the_open_interval():
    u = race_uniforms(5, 1 << 16)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("seeds", ["random", "consecutive"])
def test_each_token_wins_with_its_probability(seeds):
    expected = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    n = 40000
    keys = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(1)) if seeds == "random" \
        else torch.arange(n)  # nearby seeds must not correlate
    freq = torch.bincount(race(expected.expand(n, 5).contiguous(), keys), minlength=5).float() / n
    assert freq[1] == 0  # p = 0 never wins
    chi2 = float((((freq - expected) ** 2) / expected.clamp(min=1e-9) * n)[expected > 0].sum())
    assert chi2 < 16.3  # 3 degrees of freedom: p = 0.001


def test_a_flat_row_over_many_tokens_is_uniform_enough():
    vocab, n = 500, 100000
    probs = torch.full((n, vocab), 1.0 / vocab)
    freq = torch.bincount(race(probs, torch.arange(n) * 7 + 3), minlength=vocab).float() / n
    chi2 = float(((freq - 1.0 / vocab) ** 2 * vocab * n).sum())
    assert chi2 < 499 + 5 * (2 * 499) ** 0.5  # mean dof, + 5 sigma


def test_the_same_seed_replays_the_same_token_and_scale_does_not_matter():
    probs = _rows("flat", 4, 3000, seed=9)
    seeds = torch.tensor([11, 12, 13, 14])
    assert torch.equal(race(probs, seeds), race(probs, seeds))
    assert torch.equal(race(probs * 7.5, seeds), race(probs, seeds))  # argmax of p / E: scale-free
    assert not torch.equal(race(probs, seeds + 1000), race(probs, seeds))


def test_rows_without_positive_probability_get_minus_one():
    probs = torch.tensor([[0.0, 0.0, 0.0], [float("nan")] * 3, [0.0, 0.5, float("nan")]])
    assert race(probs, torch.tensor([1, 2, 3])).tolist() == [-1, -1, 1]
    assert race_torch(probs, torch.tensor([1, 2, 3])).tolist() == [-1, -1, 1]


def test_strided_rows_and_an_empty_batch():
    probs = _rows("flat", 4, 64, seed=2)
    wide = torch.zeros(4, 100)
    wide[:, :64] = probs
    view = wide[:, :64]  # row stride 100
    seeds = torch.tensor([5, 6, 7, 8])
    assert torch.equal(race(view, seeds), race_torch(probs, seeds))
    assert race(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64)).shape == (0,)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="float32"):
        race(torch.zeros(2, 5, dtype=torch.float64), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="seeds"):
        race(torch.zeros(2, 5), torch.tensor([1]))
    with pytest.raises(ValueError, match="seeds"):
        race(torch.zeros(2, 5), torch.tensor([1.0, 2.0]))

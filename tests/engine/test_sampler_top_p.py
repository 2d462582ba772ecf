"""The fast top-k / top-p filter (numpy's value sort and a threshold) keeps exactly the reference's
set (a torch sort and a scatter, as vLLM does)."""
import pytest
import torch

from engine.sampler import top_k_top_p, top_k_top_p_sorted


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
    fast, ref = top_k_top_p(logits, ks, ps), top_k_top_p_sorted(logits, ks, ps)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(ref))
    assert torch.equal(fast[torch.isfinite(fast)], ref[torch.isfinite(ref)])


def test_rows_with_different_settings_in_one_batch():
    logits = torch.cat([_logits("peaked", 2, 49152, 1), _logits("flat", 2, 49152, 2)])
    ks = torch.tensor([49152, 30, 49152, 3000])
    ps = torch.tensor([0.9, 1.0, 0.95, 0.7])
    fast, ref = top_k_top_p(logits, ks, ps), top_k_top_p_sorted(logits, ks, ps)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(ref))
    kept = torch.isfinite(fast).sum(-1)
    assert int(kept[2]) > 10_000 and int(kept[0]) < 1_000  # a flat row's nucleus is most of the vocabulary


def test_the_race_over_kept_tokens_draws_from_the_distribution():
    from engine.sampler import _race

    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([_race(probs, g) for _ in range(6000)]), minlength=5).float() / 6000
    assert counts[1] == 0 and counts[4] == 0  # a token with p = 0 never wins
    assert torch.allclose(counts, probs, atol=0.025)
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [int(_race(probs, a)) for _ in range(50)] == [int(_race(probs, b)) for _ in range(50)]  # seeded
    edge = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])  # zero mass first and last
    assert {int(_race(edge, g)) for _ in range(2000)} == {1, 3}

import pytest
import torch

from inference_engine.engine.sampling import SamplingParams, sample, target_distribution
from inference_engine.errors import InvalidArgument


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(), None) == 1


def test_top_k_keeps_only_k_tokens():
    p = target_distribution(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert torch.count_nonzero(p) == 2 and p[1] > p[2] > 0


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.count_nonzero(p) == 2
    assert torch.allclose(p[:2], torch.tensor([0.5, 0.3]) / 0.8)


def _top_p_by_full_sort(x, top_p):
    """The definition, by sorting the whole vocabulary: drop a token once the mass before it reaches top_p."""
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    p = torch.softmax(sorted_x, -1)
    drop = (torch.cumsum(p, -1) - p) >= top_p
    return x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat to peaked: kept sets from thousands of tokens to a few
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_over_a_large_vocabulary_keeps_what_the_definition_keeps(scale, top_p):
    """top_p_filter takes the best 256 (then 4x as many while their mass is short of top_p), not a whole sort: the
    tokens the definition keeps (computed in float64), with their logits, batched rows too, whether the set is 3
    tokens or most of the vocabulary."""
    from inference_engine.engine.sampling import top_p_filter

    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(int(scale * 10 + top_p * 1000))) * scale
    got, want = top_p_filter(x, top_p), _top_p_by_full_sort(x.double(), top_p)  # the definition in float64
    assert torch.equal(got[torch.isfinite(got)], x[torch.isfinite(got)])  # kept tokens keep their logits
    differ = torch.isfinite(got) ^ torch.isfinite(want)
    if top_p < 0.99:
        assert not differ.any()
    else:  # tens of thousands of tiny probabilities summed in fp32: the boundary may move by a few tokens whose mass
        # is below the sum's rounding (sorting it all in fp32 moved it by 30-36 tokens, 1.7e-5 of mass, here)
        p = torch.softmax(x.double(), -1)
        sorted_p, order = torch.sort(p, -1, descending=True)
        mass_before = torch.empty_like(p).scatter(-1, order, torch.cumsum(sorted_p, -1) - sorted_p)
        assert differ.sum() <= 10 and ((mass_before[differ] - top_p).abs() < 1e-5).all()
    kept = torch.isfinite(got).sum(-1)
    assert (kept >= 1).all()
    if scale == 0.5 and top_p == 0.999:
        assert (kept > 1024).all()  # grew past the first 256 and 1,024 to reach the mass
    # tokens already masked by top_k (-inf) stay out
    masked = x.masked_fill(x < x.topk(10, -1).values[..., -1:], float("-inf"))
    assert torch.equal(torch.isfinite(top_p_filter(masked, top_p)),
                       torch.isfinite(_top_p_by_full_sort(masked.double(), top_p)))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    def draw(seed):
        return [sample(logits, params, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_draw_follows_the_distribution_and_never_draws_a_zero_probability_token():
    """sampling.draw (inverse CDF in float64, what sample and speculative acceptance draw with): seeded draws follow the
    probabilities (chi-square), unnormalized weights too, and tokens of zero probability never come up, at either end."""
    from scipy.stats import chisquare

    from inference_engine.engine.sampling import draw

    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])
    g = torch.Generator().manual_seed(11)
    counts = torch.bincount(torch.tensor([draw(probs * 3.0, g) for _ in range(4000)]), minlength=7)
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    assert chisquare(counts[keep].numpy(), (probs[keep] / probs.sum() * 4000).numpy()).pvalue > 1e-3
    assert draw(torch.tensor([0.0, 0.0, 1.0, 0.0]), g) == 2
    assert draw(torch.tensor([1.0, 0.0, 0.0]), torch.Generator().manual_seed(0)) == 0


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=1.5)])
def test_bad_params_are_invalid_argument(kw):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kw).validate()

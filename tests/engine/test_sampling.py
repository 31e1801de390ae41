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


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    def draw(seed):
        return [sample(logits, params, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=1.5)])
def test_bad_params_are_invalid_argument(kw):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kw).validate()

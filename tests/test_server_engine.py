"""The sampler of ``polar-train serve``: exact distributions for top-k / top-p / temperature, and
seeded determinism (checked on small logit vectors, no model needed)."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from polar_train.server.engine import Engine, SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])


def _freq(params: SamplingParams, n: int = 6000) -> dict[int, float]:
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(LOGITS, -1)
    c = collections.Counter(Engine._sample(LOGITS, lp, params, g) for _ in range(n))
    return {k: v / n for k, v in c.items()}


def _expected(logits: torch.Tensor) -> list[float]:
    return torch.softmax(logits, -1).tolist()


@pytest.mark.parametrize("params, keep, temperature", [
    (SamplingParams(1), [0, 1, 2, 3, 4], 1.0),
    (SamplingParams(1, top_k=2), [0, 1], 1.0),
    (SamplingParams(1, top_p=0.7), [0, 1], 1.0),  # 0.64 < 0.7: the second token joins
    (SamplingParams(1, top_p=0.5), [0], 1.0),
    (SamplingParams(1, temperature=0.5, top_k=3), [0, 1, 2], 0.5),
])
def test_sampling_frequencies_match_the_filtered_softmax(params, keep, temperature):
    want = _expected(LOGITS[keep] / temperature)
    got = _freq(params)
    assert set(got) <= set(keep)
    for i, p in zip(keep, want):
        assert abs(got.get(i, 0.0) - p) < 4 * math.sqrt(p * (1 - p) / 6000) + 1e-3


def test_greedy_and_logit_bias():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(LOGITS, -1)
    assert Engine._sample(LOGITS, lp, SamplingParams(1, temperature=0.0), g) == 0
    biased = SamplingParams(1, temperature=0.0, logit_bias={4: 100.0})
    assert Engine._sample(Engine._process(LOGITS, [], [], biased), lp, biased, g, True) == 4


def test_penalties_follow_vllms_sampler():
    """Repetition penalty on prompt + output tokens (divide positive logits, multiply negative
    ones), frequency and presence penalties on output tokens only."""
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 0.0])
    p = SamplingParams(1, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = Engine._process(logits, [0, 1], [2, 2], p)
    assert out.tolist() == [1.0, -4.0, 0.5 - 1.0 - 0.25, 0.5, 0.0]
    masked = Engine._process(logits, [], [], SamplingParams(1, allowed_token_ids=[3], min_tokens=1,
                                                            stop_token_ids=[2]))
    assert torch.isfinite(masked).tolist() == [False, False, False, True, False]


def test_top_p_over_a_large_vocabulary_uses_the_exact_nucleus():
    torch.manual_seed(0)
    logits = torch.randn(50_000)
    masked = Engine._top_p_mask(logits, 0.9)
    kept = torch.isfinite(masked)
    probs = torch.softmax(logits, -1)
    sorted_p = torch.sort(probs, descending=True).values
    n = int(torch.searchsorted(torch.cumsum(sorted_p, 0), torch.tensor([0.9]))) + 1
    assert int(kept.sum()) == n  # > 1024: the full-sort path
    assert float(probs[kept].min()) >= float(probs[~kept].max())

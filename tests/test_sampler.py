"""The samplers against Hugging Face's own logits processors, and the counter-based draws."""
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    SuppressTokensLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from tts_cli.model.sampler import (RowSampling, SamplerSettings, TalkerLogitsProcessor, apply_top_k, choose,
                                   bits_to_unit, gumbel_draw, gumbel_noise, uniform_noise, warp)

VOCAB, EOS = 3072, 2150


def _history(batch, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (batch, steps), generator=g)


@pytest.mark.parametrize("steps", [0, 1, 5])
def test_talker_processors_equal_hf_in_official_order(steps):
    g = torch.Generator().manual_seed(steps)
    logits = torch.randn(3, VOCAB, generator=g) * 3
    history = _history(3, steps)
    suppress = [i for i in range(VOCAB - 1024, VOCAB) if i != EOS]
    hf = logits.clone()
    for p in (RepetitionPenaltyLogitsProcessor(1.05),
              MinNewTokensLengthLogitsProcessor(0, 2, torch.tensor([EOS])),
              SuppressTokensLogitsProcessor(suppress),
              TemperatureLogitsWarper(0.9), TopKLogitsWarper(50), TopPLogitsWarper(0.8)):
        hf = p(history, hf)
    seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    seen.scatter_(1, history, True)
    rows = RowSampling.uniform(SamplerSettings(True, 0.9, 50, 0.8, 1.05), 3, "cpu")
    processed = TalkerLogitsProcessor(VOCAB, EOS, "cpu")(logits, seen, torch.full((3,), steps < 2),
                                                          rows.repetition_penalty)
    assert torch.isinf(processed[:, EOS]).all() == (steps < 2)
    ours = warp(processed, rows)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    finite = torch.isfinite(hf)
    torch.testing.assert_close(ours[finite], hf[finite], rtol=1e-6, atol=1e-6)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0]])
    kept = torch.isfinite(apply_top_k(logits, torch.tensor([3])))
    assert kept.tolist() == [[True, True, True, True, True, False]]
    hf = TopKLogitsWarper(3)(torch.zeros(1, 0, dtype=torch.long), logits.clone())
    assert torch.equal(kept, torch.isfinite(hf))


def test_noise_is_a_pure_function_of_seed_frame_group_token():
    a = uniform_noise(torch.tensor([7, 8, 9]), frame=3, groups=range(2, 3), vocab=100)[0]
    alone = uniform_noise(torch.tensor([8]), frame=3, groups=range(2, 3), vocab=100)[0]
    assert torch.equal(a[1], alone[0])                       # batch mates do not matter
    assert not torch.equal(a[0], a[1])                       # seeds differ
    assert not torch.equal(a, uniform_noise(torch.tensor([7, 8, 9]), 4, range(2, 3), 100)[0])   # frames differ
    assert not torch.equal(a, uniform_noise(torch.tensor([7, 8, 9]), 3, range(1, 2), 100)[0])   # groups differ
    several = uniform_noise(torch.tensor([7, 8, 9]), 3, range(1, 4), 100)
    assert torch.equal(several[1], a)                         # one group's noise, alone or with others
    big = uniform_noise(torch.tensor([2**40 + 1, 1]), 0, range(0, 1), 10)[0]
    assert not torch.equal(big[0], big[1])                   # the high 32 bits of a seed count
    assert 0 < a.min() and a.max() < 1


def test_gumbel_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seeds = torch.arange(40000)
    logits = probs.log().expand(len(seeds), -1)
    draws = gumbel_draw(logits, gumbel_noise(seeds, 0, range(0, 1), 4)[0])
    freq = torch.bincount(draws, minlength=4).float() / len(seeds)
    assert torch.allclose(freq, probs, atol=0.01), freq


def test_gumbel_never_draws_a_masked_token():
    logits = torch.full((500, 6), float("-inf"))
    logits[:, 2] = 0.0
    logits[:, 4] = 0.0
    draws = gumbel_draw(logits, gumbel_noise(torch.arange(500), 1, range(1, 2), 6)[0])
    assert set(draws.tolist()) == {2, 4}


def test_rows_of_one_batch_can_use_different_settings():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    rows = RowSampling.stack([SamplerSettings(True, 1.0, 0, 1.0),
                              SamplerSettings(False, 1.0, 0, 1.0),      # greedy
                              SamplerSettings(True, 0.5, 1, 1.0),       # top-1: always the argmax
                              SamplerSettings(True, 1.0, 0, 0.3)], "cpu")  # nucleus
    seeds = torch.arange(4)
    draws = choose(logits, rows, seeds, frame=torch.tensor([0, 1, 2, 3]), group=0)
    argmax = logits.argmax(-1)
    assert draws[1] == argmax[1] and draws[2] == argmax[2]
    hf_top_p = TopPLogitsWarper(0.3)(torch.zeros(1, 0, dtype=torch.long), logits[3:4].clone())
    assert torch.isfinite(hf_top_p[0, draws[3]])
    alone = choose(logits[0:1], RowSampling.uniform(SamplerSettings(True, 1.0, 0, 1.0), 1, "cpu"),
                   seeds[0:1], frame=0, group=0)
    assert draws[0] == alone[0]                                    # per-row frame index as a tensor


def test_noise_never_reaches_zero_or_one_in_fp32():
    edges = bits_to_unit(torch.tensor([0, 0xFFFFFFFF], dtype=torch.int64))
    assert 0 < edges[0] and edges[1] < 1
    assert torch.isfinite(gumbel_noise(torch.arange(64), frame=3, groups=range(0, 6), vocab=3072)).all()

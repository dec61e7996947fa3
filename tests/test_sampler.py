"""The samplers against Hugging Face's own logits processors, and the counter-based draws."""
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    SuppressTokensLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from tts_cli.model.sampler import (RowSampling, SamplerSettings, TalkerLogitsProcessor, bits_to_unit, choose,
                                   gumbel_noise, uniform_noise, warp)

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
    kept = torch.isfinite(warp(logits, RowSampling.uniform(SamplerSettings(True, 1.0, 3, 1.0), 1, "cpu")))
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


def _plain_sampling(rows):
    """Rows that draw from softmax(logits) as they are: no temperature, top-k or top-p."""
    return RowSampling.uniform(SamplerSettings(True, 1.0, 0, 1.0), rows, "cpu")


def test_gumbel_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seeds = torch.arange(40000)
    logits = probs.log().expand(len(seeds), -1)
    draws = choose(logits, _plain_sampling(len(seeds)), seeds, frame=0, group=0)
    freq = torch.bincount(draws, minlength=4).float() / len(seeds)
    assert torch.allclose(freq, probs, atol=0.01), freq


def test_gumbel_never_draws_a_masked_token():
    logits = torch.full((500, 6), float("-inf"))
    logits[:, 2] = 0.0
    logits[:, 4] = 0.0
    draws = choose(logits, _plain_sampling(500), torch.arange(500), frame=1, group=1)
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


# -- one sort of the row serves top-k and top-p: the same kept sets and draws as before -------------

def _two_sort_warp(logits, rows, stable=False):
    """Two sorts, as the sampler had them: one of the row for top-k, one of the top-k'd row for top-p
    (HF's steps; stable=True ranks equal logits by id, as CUDA's sort does)."""
    logits = logits / rows.temperature
    vocab = logits.shape[-1]
    k = torch.where((rows.top_k <= 0) | (rows.top_k > vocab), vocab, rows.top_k)
    kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, stable=stable)
    remove_sorted = (sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= rows.top_p_tail) & (rows.top_p_tail > 0)
    remove_sorted[..., -1:] = False
    return logits.masked_fill(remove_sorted.scatter(-1, order, remove_sorted), float("-inf"))


def _two_sort_choose(logits, rows, noise):
    drawn = torch.argmax(_two_sort_warp(logits, rows) + noise, dim=-1)
    return torch.where(rows.do_sample, drawn, torch.argmax(logits, dim=-1))


def _hf_warp(scaled_row, s: SamplerSettings):
    """HF's warpers on one temperature-scaled row, as generate() builds them (none for top-k 0
    or top-p 1)."""
    x, ids = scaled_row[None].clone(), torch.zeros(1, 0, dtype=torch.long)
    if s.top_k > 0:
        x = TopKLogitsWarper(s.top_k)(ids, x)
    if s.top_p < 1:
        x = TopPLogitsWarper(s.top_p)(ids, x)
    return x[0]


def _random_logits(kind, rows, vocab, g, device="cpu"):
    if kind == "continuous":
        logits = torch.randn(rows, vocab, generator=g) * 3
    elif kind == "bf16":                   # the model's logits: many equal values among the largest
        logits = (torch.randn(rows, vocab, generator=g) * 3).bfloat16().float()
    else:                                  # ties everywhere
        logits = torch.randint(0, 8, (rows, vocab), generator=g).float()
    return logits.to(device)


def _random_settings(rows, g):
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]
    return [SamplerSettings(pick([True, True, False]), pick([0.7, 1.0, 1.3]), pick([0, 1, 2, 5, 50, 10**6]),
                            pick([1.0, 0.95, 0.9, 0.8, 0.75, 0.5, 0.2, 0.0])) for _ in range(rows)]


@pytest.mark.parametrize("kind", ["continuous", "bf16", "small integers"])
@pytest.mark.parametrize("vocab", [60, 2048, 3072])
def test_warp_keeps_what_two_sorts_and_hf_keep(kind, vocab):
    g = torch.Generator().manual_seed(vocab + len(kind))
    for _ in range(10):
        settings = _random_settings(8, g)
        rows = RowSampling.stack(settings, "cpu")
        logits = _random_logits(kind, 8, vocab, g)
        ours = warp(logits, rows)
        assert torch.equal(ours, _two_sort_warp(logits, rows, stable=True))
        if all(s.top_p >= 1 for s in settings):
            assert torch.equal(warp(logits, rows, top_p=False), ours)
        scaled = logits / rows.temperature
        for row, s in enumerate(settings):
            hf = _hf_warp(scaled[row], s)
            if kind == "continuous":
                assert torch.equal(ours[row], hf)
            else:
                # HF's sort on CPU is not stable: which of equal logits at the top-p cut stay may
                # differ, not how many
                assert torch.equal(ours[row].sort().values, hf.sort().values)


def test_top_p_drops_what_hf_drops_at_a_mass_of_exactly_1_minus_p():
    # five equal logits: the cumulative mass after the first is 0.2 as a float32, which HF drops
    # for p = 0.8 (1 - 0.8 as a Python float rounds to that float32; 1 - float32(0.8) is below it)
    logits = torch.zeros(1, 5)
    rows = RowSampling.stack([SamplerSettings(True, 1.0, 0, 0.8)], "cpu")
    hf = TopPLogitsWarper(0.8)(torch.zeros(1, 0, dtype=torch.long), logits.clone())
    assert torch.isinf(hf).sum() == 1
    assert torch.equal(warp(logits, rows), hf)


def test_top_p_cuts_through_equal_logits_by_id():
    # top-k 2 keeps the 3.0s at ids 1, 3, 4; top-p keeps the 5.0 and two of them, dropping the
    # lowest id first, as a stable ascending sort ranks them
    logits = torch.tensor([[5.0, 3.0, 1.0, 3.0, 3.0, 0.0]])
    probs = torch.tensor([5.0, 3.0, 3.0, 3.0]).softmax(-1)
    rows = RowSampling.stack([SamplerSettings(True, 1.0, 2, float(1 - probs[1] * 1.5))], "cpu")
    assert torch.isfinite(warp(logits, rows)).tolist() == [[True, False, False, True, True, False]]
    assert torch.equal(warp(logits, rows), _two_sort_warp(logits, rows, stable=True))


def test_draws_equal_the_two_sort_draws_and_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(5)
    rows = RowSampling.stack(_random_settings(64, g), "cpu")
    seeds = torch.arange(64)
    for vocab in (2048, 3072):
        logits = _random_logits("continuous", 64, vocab, g)
        draws = choose(logits, rows, seeds, 3, 2)
        assert torch.equal(draws, _two_sort_choose(logits, rows, gumbel_noise(seeds, 3, range(2, 3), vocab)[0]))
        assert torch.equal(draws[~rows.do_sample], logits.argmax(-1)[~rows.do_sample])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [2048, 3072])
def test_captured_draws_on_cuda_equal_the_two_sort_sampler(vocab):
    # The engine's case, 64 rows drawn inside a CUDA graph, against the sampler as it was with
    # HF's unstable sorts: on CUDA those rank equal logits by id too.
    g = torch.Generator().manual_seed(vocab)
    rows = RowSampling.stack(_random_settings(64, g), "cuda")
    seeds, frame = torch.arange(64, device="cuda"), torch.zeros(64, dtype=torch.int64, device="cuda")
    static_logits = torch.zeros(64, vocab, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        choose(static_logits, rows, seeds, frame, 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        draws = choose(static_logits, rows, seeds, frame, 1)
        warped = warp(static_logits, rows)
    noise = gumbel_noise(seeds, frame, range(1, 2), vocab)[0]
    for kind in ("bf16", "small integers", "continuous"):
        for _ in range(5):
            logits = _random_logits(kind, 64, vocab, g, "cuda")
            static_logits.copy_(logits)
            graph.replay()
            assert torch.equal(warped, _two_sort_warp(logits, rows)), kind
            assert torch.equal(draws, _two_sort_choose(logits, rows, noise)), kind

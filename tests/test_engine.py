"""The slot engine computes what the plain model computes (CPU, fp32, no graphs): same codes for
greedy and for seeded sampling, whatever the slot and the batch mates; streamed PCM equals the
full decode of those codes, and decoding every K steps over K frames gives what K = 1 gives."""
import copy
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tts_cli.engine import codec_gemm_scale, codec_stream_for, prefill_head_rows, prefill_tiles_for, tail_rows_for
from tts_cli.engine.prefill import Chunk, chunk_rounds, pack
from tts_cli.engine.step import PaddedGEMMs
from tts_cli.engine.runner import Engine, EngineRequest, PromptSource
from tts_cli.engine.slots import talker_kv_bytes
from tts_cli.errors import NonFiniteError, RequestError
from tts_cli.model.generate import RowInput, generate
from tts_cli.model.prompt import prompt_embeddings
from tts_cli.request import Request
from tts_cli.synthesizer import STEP_BYTES_PER_SLOT, Synthesizer, code_predictor_settings, talker_settings

TINY = Path(__file__).resolve().parents[1] / "tts_cli" / "assets" / "tiny-1.7b-customvoice"
TEXTS = [
    ("The birch canoe slid on the smooth planks.", "vivian", "english"),
    ("Glue the sheet to the dark blue background.", "ryan", "auto"),
    ("今天天气很好，我们去公园散步吧。Let's go!", "dylan", "chinese"),
    ("It's easy to tell the depth of a well.", "serena", "english"),
    ("These days a chicken leg is a rare dish.", "aiden", "auto"),
    ("Rice is often served in round bowls.", "eric", "auto"),
]


@pytest.fixture(scope="module")
def synth():
    return Synthesizer.from_pretrained(TINY)


def _embeds(synth, i):
    text, speaker, language = TEXTS[i]
    return prompt_embeddings(synth.model.talker,
                             synth.prompt(Request(id=str(i), text=text, speaker=speaker, language=language)))


def _forced(synth, frames: list[int]) -> list[EngineRequest]:
    """Request i: TEXTS' prompt i (cycling), seed 100 + i, forced to frames[i] frames."""
    return [EngineRequest(key=i, prompt_embeds=_embeds(synth, i % len(TEXTS)), seed=100 + i, max_frames=f,
                          min_new_tokens=f + 1) for i, f in enumerate(frames)]


def _plain(synth, i, seed, frames, greedy, min_new_tokens):
    sampling = synth.ckpt.sampling.greedy() if greedy else synth.ckpt.sampling
    return generate(synth.model, [RowInput(_embeds(synth, i), seed, frames)], talker_settings(sampling),
                    code_predictor_settings(sampling), min_new_tokens=min_new_tokens)[0]


def _engine(synth, rows, greedy, codec_window=1):
    sampling = synth.ckpt.sampling.greedy() if greedy else synth.ckpt.sampling
    return Engine(synth.model, synth.codec, rows=rows, context=192, talker_defaults=talker_settings(sampling),
                  cp_defaults=code_predictor_settings(sampling), top_p=True, codec_window=codec_window)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_engine_equals_the_plain_model_with_slot_refill(synth, greedy):
    # 6 requests through 4 slots, different lengths: slots are refilled while others run.
    frames = [12, 30, 7, 20, 25, 9]
    requests = _forced(synth, frames)
    engine = _engine(synth, rows=4, greedy=greedy)
    results = engine.run(requests)
    for i, (result, f) in enumerate(zip(results, frames)):
        plain = _plain(synth, i, 100 + i, f, greedy, f + 1)
        assert result.codes.shape == (f, 16) and result.hit_cap
        assert np.array_equal(result.codes, plain.codes.numpy()), f"row {i}"
        full = synth.decode([plain.codes])[0]
        assert np.linalg.norm(result.pcm - full) / np.linalg.norm(full) < 1e-5


EOS_CAP = 120


@pytest.fixture(scope="module")
def eos_case(synth):
    """Unforced greedy: the official EOS rule ends some rows (the tiny model draws EOS at frame 115
    for the Chinese prompt, see the golden records), the others hit the cap. 3 requests, 2 slots."""
    requests = [EngineRequest(key=i, prompt_embeds=_embeds(synth, i), seed=0, max_frames=EOS_CAP) for i in range(3)]
    plain = [_plain(synth, i, 0, EOS_CAP, True, 2) for i in range(3)]
    return requests, plain, _engine(synth, rows=2, greedy=True).run(requests)


def test_engine_stops_rows_on_eos_like_the_plain_model(eos_case):
    _, plain, results = eos_case
    for i, (result, p) in enumerate(zip(results, plain)):
        assert np.array_equal(result.codes, p.codes.numpy()), f"row {i}"
        assert result.hit_cap == p.hit_cap
    assert min(len(r.codes) for r in results) < EOS_CAP       # at least one row ended by EOS


def test_eos_drawn_right_after_the_cap_frame_is_no_cap_as_in_the_plain_model(synth, eos_case):
    """A request capped at exactly the frames after which it draws EOS ended at its EOS, not at its
    cap: the plain model says so (hit_cap False), and so must the engine, which learns of both at
    the same step."""
    _, plain, _ = eos_case
    i, frames = next((i, len(p.codes)) for i, p in enumerate(plain) if len(p.codes) < EOS_CAP)
    capped_there = _plain(synth, i, 0, frames, True, 2)
    assert len(capped_there.codes) == frames and not capped_there.hit_cap
    request = EngineRequest(key=0, prompt_embeds=_embeds(synth, i), seed=0, max_frames=frames)
    one_less = EngineRequest(key=1, prompt_embeds=_embeds(synth, i), seed=0, max_frames=frames - 1)
    results = _engine(synth, rows=2, greedy=True).run([request, one_less])
    assert np.array_equal(results[0].codes, capped_there.codes.numpy()) and not results[0].hit_cap
    assert len(results[1].codes) == frames - 1 and results[1].hit_cap


def test_a_result_holds_its_own_frames_only(synth, eos_case):
    """The engine fills arrays sized for the cap; a row that ended early gives its result arrays of
    its frames that own their memory, not views that keep the cap's."""
    _, _, results = eos_case
    spf = synth.codec.samples_per_frame
    for r in results:
        assert r.codes.base is None and r.pcm.base is None
        assert r.codes.shape == (len(r.codes), 16) and r.pcm.shape == (len(r.codes) * spf,)
        assert r.codes.dtype == np.int64 and r.pcm.dtype == np.float32


# -- codec window: the codec runs every K steps over the last K frames -----------------------------

def _run_counting_closes(engine, requests):
    """The engine's results, and the column count of each window it closed early."""
    closed = []
    close_window = engine.step.close_window
    engine.step.close_window = lambda columns: (closed.append(columns), close_window(columns))
    return engine.run(requests), closed


def _assert_same_audio(windowed, per_frame):
    """Same codes; same PCM up to float summation order (the codec's linear layers then see
    rows x K frames at once instead of rows x 1, and BLAS blocks such sums differently)."""
    for i, (w, f) in enumerate(zip(windowed, per_frame)):
        assert np.array_equal(w.codes, f.codes), f"request {i}"
        assert w.hit_cap == f.hit_cap and w.pcm.shape == f.pcm.shape, f"request {i}"
        assert np.linalg.norm(w.pcm - f.pcm) <= 1e-6 * np.linalg.norm(f.pcm), f"request {i}"


# Lengths chosen so that each run below closes a window early for K = 3, 4 and 16 (one slot: a
# request that ends mid-window, while the next one waits). At K = 2 no window closes early: the
# host learns of a request that ends on a window's first column a step late, and that step ends
# the window (one that ends on the last column it learns of at the boundary).
WINDOW_CASES = {"4 slots, refilled": (4, [12, 30, 7, 20, 25, 5]), "1 slot": (1, [5, 10, 6])}


@pytest.fixture(scope="module", params=list(WINDOW_CASES))
def window_case(synth, request):
    rows, frames = WINDOW_CASES[request.param]
    requests = _forced(synth, frames)
    plain = [_plain(synth, i, 100 + i, f, False, f + 1) for i, f in enumerate(frames)]
    return rows, requests, plain, _engine(synth, rows, greedy=False).run(requests)


def test_codec_stream_by_default_on_cuda_up_to_64_rows_only():
    """Above 64 rows the codec's blocks slowed the code predictor's loop (docs/bench.md): in line there."""
    assert codec_stream_for(1, cuda=True) and codec_stream_for(64, cuda=True)
    assert not codec_stream_for(65, cuda=True) and not codec_stream_for(256, cuda=True)
    assert not codec_stream_for(64, cuda=False)


@pytest.mark.parametrize("window", [2, 3, 4, 16])
def test_codec_window_gives_the_audio_of_window_1(synth, window_case, window):
    rows, requests, plain, per_frame = window_case
    for result, p in zip(per_frame, plain):
        assert np.array_equal(result.codes, p.codes.numpy())
    windowed, closed = _run_counting_closes(_engine(synth, rows, greedy=False, codec_window=window), requests)
    _assert_same_audio(windowed, per_frame)
    assert all(0 < columns < window for columns in closed) and (closed or window == 2)


def test_the_codec_window_is_16_at_one_row_else_4_unless_given(synth):
    """One row never keeps a window open for others (it closes when the row stops), so there the
    engine decodes 16 frames per codec call; elsewhere 4 (docs/bench.md)."""
    assert [_engine(synth, rows, greedy=True, codec_window=None).codec_window for rows in (1, 2, 64)] == [16, 4, 4]
    assert _engine(synth, 1, greedy=True, codec_window=3).codec_window == 3


@pytest.mark.parametrize("window", [2, 3, 4])
def test_codec_window_stops_on_eos_mid_window(synth, eos_case, window):
    requests, _, per_frame = eos_case
    windowed, _ = _run_counting_closes(_engine(synth, rows=2, greedy=True, codec_window=window), requests)
    _assert_same_audio(windowed, per_frame)
    # Admitted at a window boundary, a request's frame j lies in column j mod K.
    assert any(len(r.codes) % window for r in windowed if not r.hit_cap)


@pytest.mark.parametrize("window", [1, 4])
def test_a_slot_freed_at_a_window_end_is_refilled_for_the_next_step(synth, window):
    """The step that emits a request's last frame also says that the slot emits no more; at a
    window boundary the host waits for that step's flags before admitting, so a request that
    ends on a window's last column leaves no idle step (before, the host learnt it a step late:
    one step, and a window closed early, per request)."""
    frames = [4, 12, 8]
    requests = _forced(synth, frames)
    engine = _engine(synth, rows=1, greedy=False, codec_window=window)
    results, closed = _run_counting_closes(engine, requests)
    assert [len(r.codes) for r in results] == frames
    assert engine.stats.steps == sum(frames) and closed == []


def test_the_engine_counts_its_time_in_row_callbacks_and_gpu_waits(synth):
    """EngineStats: the time spent in on_result is counted (here 0.2 s a row, slept) within the
    run's wall, once; on CPU nothing is waited for (the work is done when queued)."""
    import time
    frames = [4, 6, 5]
    requests = [EngineRequest(key=i, prompt_embeds=_embeds(synth, i), seed=i, max_frames=f, min_new_tokens=f + 1)
                for i, f in enumerate(frames)]
    engine = _engine(synth, rows=2, greedy=True)
    engine.reset_stats()
    engine.run(requests, on_result=lambda result: time.sleep(0.2))
    assert 0.6 <= engine.stats.callback_s < engine.stats.wall_s
    assert engine.stats.gpu_wait_s == 0
    # the rows it ends are handed over inside the PCM copies: their 0.6 s not counted there too
    assert engine.stats.pcm_s < 0.3


class _LateEvent:
    """A CUDA event's stand-in on CPU, where the work is done when queued: it says it has not passed
    until the host waits for it, so the engine reads each window's PCM as late as it can."""

    def __init__(self, counts: dict):
        self.counts = counts

    def query(self) -> bool:
        self.counts["not yet"] += 1
        return False

    def synchronize(self) -> None:
        self.counts["waited"] += 1


@pytest.mark.parametrize("window", [1, 4])
def test_windows_read_late_give_the_same_requests_the_same_audio(synth, window):
    """With the codec on its own stream the host reads a window's PCM when that stream's event
    says it is there, which may be windows later: the requests end with the same codes and PCM,
    bit for bit. 6 requests of different lengths through 4 slots, so slots are refilled while an
    earlier request's windows are still unread."""
    frames = [12, 30, 7, 20, 25, 9]
    requests = _forced(synth, frames)
    in_time = _engine(synth, rows=4, greedy=False, codec_window=window).run(requests)
    engine = _engine(synth, rows=4, greedy=False, codec_window=window)
    counts = {"not yet": 0, "waited": 0}
    engine._record_event = lambda: _LateEvent(counts)
    late = engine.run(requests)
    assert counts["not yet"] > 0 and counts["waited"] > 0
    assert [len(r.codes) for r in late] == frames
    for a, b in zip(late, in_time):
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm)
        assert a.pcm.shape == (len(a.codes) * synth.codec.samples_per_frame,)


def test_tail_steps_give_each_request_the_codes_and_audio_of_the_full_step(synth):
    """Once the queue is empty the requests still speaking move into the first slots of a step of
    fewer rows (8 -> 4 -> 2 here): the same codes as the 8-row step alone gives them and the same
    audio within float rounding (torch's CPU convolutions may sum differently at another batch size;
    on CUDA, where tails run, tests/test_gpu.py holds it bit for bit), in fewer slot-steps. The longer
    requests hold slots 3, 4, 5 and 7 when the queue empties, so they move. A second run of the same
    engine (as the bench's timed run follows its warm-up) starts from the full step again and gives
    the same audio as its first."""
    frames = [5, 5, 5, 5, 5, 5, 5, 40, 6, 6, 6, 14, 14, 30]
    requests = _forced(synth, frames)
    sampling = synth.ckpt.sampling

    def run(tail_rows):
        engine = Engine(synth.model, synth.codec, rows=8, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), codec_window=4, tail_rows=tail_rows)
        return engine, engine.run(requests)
    full, full_results = run(())
    tails, tail_results = run((4, 2))
    assert full.stats.steps_by_rows == {8: full.stats.steps}
    assert tails.stats.steps == full.stats.steps and set(tails.stats.steps_by_rows) == {8, 4, 2}
    assert tails.stats.slot_steps < full.stats.slot_steps
    for i, (a, b) in enumerate(zip(tail_results, full_results)):
        assert len(a.codes) == frames[i]
        assert np.array_equal(a.codes, b.codes), f"request {i}"
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=1e-5, atol=1e-6, err_msg=f"request {i}")
    steps = dict(tails.stats.steps_by_rows)
    again = tails.run(requests)
    assert {rows: n - steps[rows] for rows, n in tails.stats.steps_by_rows.items()} == steps
    for a, b in zip(again, tail_results):
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm), f"request {a.key}"


def test_an_engine_without_row_slots_is_refused(synth):
    sampling = synth.ckpt.sampling
    for rows in (0, -64):
        with pytest.raises(ValueError, match=f"an engine needs at least one row slot, got rows={rows}"):
            Engine(synth.model, synth.codec, rows=rows, context=192, talker_defaults=talker_settings(sampling),
                   cp_defaults=code_predictor_settings(sampling))


def test_tail_rows_that_the_engine_cannot_run_are_refused(synth):
    sampling = synth.ckpt.sampling
    for tail_rows in ((2, 4), (8,), (4, 4), (0,), (3,)):
        with pytest.raises(ValueError, match="tail_rows must decrease, each a divisor of rows"):
            Engine(synth.model, synth.codec, rows=8, context=192, talker_defaults=talker_settings(sampling),
                   cp_defaults=code_predictor_settings(sampling), tail_rows=tail_rows)


def test_slots_past_the_kernels_int32_offsets_are_refused(synth, monkeypatch):
    """The kernels address a cache's elements with int32 offsets (slot x slot stride + ...): at the
    real 1.7B shapes (8 KV heads x 128), 2048 rows x 1024 positions would wrap them and write other
    slots' keys. An engine's slots are refused before anything is allocated (meta tensors: no
    memory), with what to change; 1024 rows pass. `--rows auto` and the KV budget give a call at most
    the positions the offsets address, so that longer requests fail alone, with their reason."""
    from types import SimpleNamespace

    from tts_cli import synthesizer
    from tts_cli.engine.random_model import random_config
    from tts_cli.engine.slots import SlotState, most_positions

    cfg, sampling = random_config("1.7b"), synth.ckpt.sampling
    codec = SimpleNamespace(new_state=lambda rows: None, samples_per_frame=1920)

    def slots(rows, trailing_text=False):
        return SlotState(cfg, rows, 1024, codec, "meta", torch.float16, talker_settings(sampling),
                         code_predictor_settings(sampling), trailing_text=trailing_text)
    assert (most_positions(cfg, 2048), most_positions(cfg, 1024), most_positions(cfg, 1024, True)) == (1023, 2047, 1023)
    with pytest.raises(ValueError, match="2048 rows x 1024 positions: past the 1023 positions a slot's caches may hold "
                                         "at that many rows .the kernels' offsets are int32.; use fewer rows or "
                                         "shorter segments"):
        slots(2048)
    assert slots(1024).talker_kv[0].k.shape == (1024, 8, 1024, 128)
    with pytest.raises(ValueError, match="1024 rows x 1024 positions: past the 1023 positions"):
        slots(1024, trailing_text=True)   # a cloned voice's trailing text: 2048 values a position
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2)
    through_engine.kv_budget_bytes = 10**12   # the memory would hold far more
    monkeypatch.setattr(synthesizer, "most_positions", lambda cfg, rows, trailing_text=False: 100)
    assert through_engine._most_context(2, False, None) == 96   # the offsets' 100, in whole 32-position tile columns


class _GEMMShapes(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen, self.nan_rows = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.mm, F.linear, torch.addmm):
            x = args[1 if func is torch.addmm else 0]
            self.seen.append((func.__name__, tuple(x.shape)))
            self.nan_rows.append(int(x.isnan().flatten(1).all(1).sum()))
        return func(*args, **(kwargs or {}))


def test_padded_gemms_run_on_rows_added_and_give_the_rows_their_outputs():
    """What a tail step's GEMMs see (recorded below the padding): torch.mm padded to min_rows rows
    (to scale times its rows where that is fewer: the full step's), F.linear and addmm to scale
    times theirs; the outputs are the unpadded rows', whatever the padding rows hold (they are not
    written: here NaN). With `cublas`, the projections take no few-row kernel inside it."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    flat = x.flatten(0, 1)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)   # with fill_uninitialized_memory: torch.empty's floats are NaN
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with _GEMMShapes() as shapes, PaddedGEMMs(min_rows=32, scale=4):
            outputs = [torch.mm(flat, w.t()), F.linear(x, w, b), torch.addmm(b, flat, w.t()),
                       torch.mm(flat[:1], w.t())]
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert shapes.seen == [("mm", (32, 8)), ("linear", (12, 5, 8)), ("addmm", (60, 8)), ("mm", (4, 8))]
    assert shapes.nan_rows == [17, 9, 45, 3]
    expected = [flat @ w.t(), F.linear(x, w, b), b + flat @ w.t(), flat[:1] @ w.t()]
    for out, want in zip(outputs, expected):
        assert out.shape == want.shape and torch.allclose(out, want, atol=1e-5)
    with _GEMMShapes() as shapes, PaddedGEMMs(min_rows=4):
        torch.mm(flat, w.t()), F.linear(x, w, b)
    assert shapes.seen == [("mm", (15, 8)), ("linear", (3, 5, 8))]
    import tts_kernels.linear as linear
    assert linear._few_row_kernels
    tail = PaddedGEMMs(min_rows=4, cublas=True)
    with tail:
        with tail:   # entered again inside itself: still no few-row kernels until the outer exit
            assert not linear._few_row_kernels
        assert not linear._few_row_kernels
    with PaddedGEMMs(min_rows=4):
        assert linear._few_row_kernels
    assert linear._few_row_kernels


def test_codec_gemms_of_an_engine_above_codec_gemm_rows_run_in_equal_blocks_of_them():
    """A full step of 1024 rows runs the codec's F.linear and addmm in two blocks of 512 rows (what
    cuBLAS is held to in every position: tts_cli.engine.CODEC_GEMM_ROWS), one of 1000 rows in two
    with the second padded, a tail of 256 rows of 1024 pads to 512, and 512 rows or fewer run as they
    are; the outputs are the whole product's."""
    assert codec_gemm_scale(1024, 1024) == Fraction(1, 2) and codec_gemm_scale(2048, 2048) == Fraction(1, 4)
    assert codec_gemm_scale(1024, 512) == 1 and codec_gemm_scale(1024, 256) == 2
    assert codec_gemm_scale(512, 512) == 1 and codec_gemm_scale(512, 128) == 4 and codec_gemm_scale(64, 64) == 1
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(8, 5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    flat = x.flatten(0, 1)
    with _GEMMShapes() as shapes, PaddedGEMMs(scale=Fraction(1, 2)):
        outputs = [F.linear(x, w, b), torch.addmm(b, flat, w.t()), torch.mm(flat, w.t())]
    assert shapes.seen == [("linear", (4, 5, 8)), ("linear", (4, 5, 8)), ("addmm", (20, 8)), ("addmm", (20, 8)),
                           ("mm", (40, 8))]
    for out, want in zip(outputs, [F.linear(x, w, b), b + flat @ w.t(), flat @ w.t()]):
        assert out.shape == want.shape and torch.allclose(out, want, atol=1e-5)
    # 1000 rows: blocks of 512, the second padded (here 10 rows in blocks of 4)
    x = torch.randn(10, 5, 8, generator=g)
    with _GEMMShapes() as shapes, PaddedGEMMs(scale=codec_gemm_scale(4, 10)):
        out = F.linear(x, w, b)
    assert shapes.seen == [("linear", (4, 5, 8))] * 3 and torch.allclose(out, F.linear(x, w, b), atol=1e-5)
    with pytest.raises(ValueError, match="5 GEMM rows cannot run in blocks of 5/2"):
        with PaddedGEMMs(scale=Fraction(1, 2)):
            F.linear(x[:5], w, b)


def test_tail_steps_by_default_on_cuda_from_128_rows_only():
    assert tail_rows_for(512, cuda=True) == (256, 128, 64)
    assert tail_rows_for(256, cuda=True) == (128, 64)
    assert tail_rows_for(128, cuda=True) == (64,)
    assert tail_rows_for(64, cuda=True) == ()
    assert tail_rows_for(512, cuda=False) == ()


def _sourced(synth, i, built: list, **fields) -> EngineRequest:
    """Request i with its prompt as a PromptSource that notes each build in `built`."""
    text, speaker, language = TEXTS[i]
    prompt = synth.prompt(Request(id=str(i), text=text, speaker=speaker, language=language))

    def build():
        built.append(i)
        return prompt_embeddings(synth.model.talker, prompt), None
    return EngineRequest(key=i, prompt_embeds=None, source=PromptSource(len(prompt), False, build), **fields)


class _PassingEvent:
    """An event that has not passed for its first `late` queries."""

    def __init__(self, late: int):
        self.late, self.waited = late, 0

    def query(self) -> bool:
        self.late -= 1
        return self.late < 0

    def synchronize(self) -> None:
        self.waited += 1


@pytest.mark.parametrize("late", [False, True], ids=["at-admission", "while-waiting"])
def test_prompts_the_engine_builds_give_the_audio_of_prompts_given(synth, late):
    """Requests with a PromptSource end with the codes and PCM of the same requests with their prompts
    given, each prompt built once, in queue order; on CPU at admission, with events that have not
    passed (a GPU still working) while the engine waits."""
    frames = [12, 30, 7, 20, 25, 9]
    given = _engine(synth, rows=4, greedy=False, codec_window=4).run(
        [EngineRequest(key=i, prompt_embeds=_embeds(synth, i), seed=100 + i, max_frames=f, min_new_tokens=f + 1)
         for i, f in enumerate(frames)])
    built = []
    requests = [_sourced(synth, i, built, seed=100 + i, max_frames=f, min_new_tokens=f + 1)
                for i, f in enumerate(frames)]
    engine = _engine(synth, rows=4, greedy=False, codec_window=4)
    if late:
        counts = {"not yet": 0, "waited": 0}
        engine._record_event = lambda: _LateEvent(counts)
    engine.reset_stats()
    results = engine.run(requests)
    assert built == list(range(6))
    assert 0 < engine.stats.prompt_s < engine.stats.wall_s
    for a, b in zip(results, given):
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm)


def test_while_the_gpu_works_the_engine_builds_the_next_queued_prompts(synth):
    built = []
    engine = _engine(synth, rows=2, greedy=True)
    engine._unbuilt.extend(_sourced(synth, i, built, seed=0, max_frames=4) for i in range(4))
    event = _PassingEvent(late=2)
    engine._wait(event)
    assert built == [0, 1] and event.waited == 1   # the two built while it had not passed, then waited
    engine._wait(_PassingEvent(late=5))
    assert built == [0, 1, 2, 3]                   # nothing left to build: it waits


def test_windows_read_a_few_slots_at_a_time_while_the_gpu_works_give_the_same_audio(synth, monkeypatch):
    """While the host waits for a step it copies the PCM of windows that are there, WAIT_SLOTS slots at
    a time (here 1, events that pass after two queries): the requests end with the codes and PCM of
    a run that read every window at once, bit for bit, and windows were read in pieces."""
    from tts_cli.engine import runner
    frames = [12, 30, 7, 20, 25, 9]
    requests = _forced(synth, frames)
    at_once = _engine(synth, rows=4, greedy=False, codec_window=4).run(requests)
    monkeypatch.setattr(runner, "WAIT_SLOTS", 1)
    engine = _engine(synth, rows=4, greedy=False, codec_window=4)
    engine._record_event = lambda: _PassingEvent(late=2)
    read_in_waits = []
    read_windows = engine._read_windows

    def counted(run, wait=False, freeing=None, slots=None):
        copied = read_windows(run, wait, freeing, slots)
        if slots is not None and copied:
            read_in_waits.append(run.windows[0].read if run.windows else None)
        return copied
    engine._read_windows = counted
    engine.reset_stats()
    results = engine.run(requests)
    assert any(read not in (None, 0) for read in read_in_waits)   # a window left part-read between two queries
    assert 0 < engine.stats.pcm_s < engine.stats.wall_s
    assert [len(r.codes) for r in results] == frames
    for a, b in zip(results, at_once):
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm)


def test_a_prompt_built_unlike_its_source_or_without_one_is_refused(synth):
    request = _sourced(synth, 0, [], seed=0, max_frames=4)
    request.source.length += 1
    with pytest.raises(ValueError, match="request 0: its prompt was built with"):
        _engine(synth, rows=2, greedy=True).run([request])
    with pytest.raises(ValueError, match="request 1 has neither prompt_embeds nor a PromptSource"):
        _engine(synth, rows=2, greedy=True).run([EngineRequest(key=1, prompt_embeds=None, seed=0, max_frames=4)])


def test_a_request_that_cannot_fit_a_slot_is_refused(synth):
    engine = _engine(synth, rows=2, greedy=True)
    too_long = EngineRequest(key=0, prompt_embeds=_embeds(synth, 0), seed=0, max_frames=170)
    with pytest.raises(RequestError, match="needs 196 talker positions; this engine's slots hold 192"):
        engine.run([too_long])


def test_nan_logits_refuse_the_run_with_the_count(synth):
    """A NaN upstream of a draw (what an activation beyond fp16's range becomes) would make codes
    that mean nothing: the run is refused, saying how many logits were NaN or infinite."""
    model = copy.deepcopy(synth.model)
    with torch.no_grad():
        model.code_predictor.heads[3].weight[5, 0] = float("nan")   # one logit of codebook 4, every row
    sampling = synth.ckpt.sampling.greedy()
    engine = Engine(model, synth.codec, rows=2, context=192, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling))
    requests = [EngineRequest(key=i, prompt_embeds=_embeds(synth, i), seed=i, max_frames=6) for i in range(2)]
    with pytest.raises(NonFiniteError, match=r"produced 2 NaN or infinite logits: this audio would be wrong$"):
        engine.run(requests)


@pytest.mark.parametrize("failure", ["nan", "on_result"])
def test_a_run_that_fails_part_way_leaves_the_next_run_of_the_engine_as_a_new_engine_would(synth, failure):
    """A row's NaN refuses its run (or the caller's on_result raises) mid-window: that run's state (the
    window's column, the row's NaN in its slot, which the next run's steps compute too) must not reach
    the next run, which the job runs on the same engine to fail only the row at fault."""
    good = _forced(synth, [9])[0]
    expected = _engine(synth, rows=2, greedy=False, codec_window=4).run([good])[0]
    engine = _engine(synth, rows=2, greedy=False, codec_window=4)
    if failure == "nan":
        poisoned = _embeds(synth, 1).clone()
        poisoned[-1, 0] = float("nan")
        first = [EngineRequest(key=1, prompt_embeds=poisoned, seed=2, max_frames=9, min_new_tokens=10), good]
        with pytest.raises(NonFiniteError):
            engine.run(first)
    else:
        first = [EngineRequest(key=1, prompt_embeds=_embeds(synth, 1), seed=2, max_frames=0), good]

        def refuse(result):
            raise RuntimeError("the caller failed")

        with pytest.raises(RuntimeError, match="the caller failed"):
            engine.run(first, on_result=refuse)
    assert int(engine.state.window_column) != 0   # the failure left a window half-filled
    again = engine.run([good])[0]
    assert np.array_equal(again.codes, expected.codes) and np.array_equal(again.pcm, expected.pcm)


def test_synthesizer_through_the_engine_equals_the_plain_path(synth):
    # What `tts synth` does on a GPU (there with CUDA graphs), here eagerly on CPU.
    # Its engine keeps engine_rows slots whatever a call holds (3 requests into 4 slots here), fewer
    # only when the caller caps them (the out-of-memory fallback: max_rows).
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=4)
    assert through_engine.uses_engine and not synth.uses_engine
    requests = [Request(id=str(i), text=t, speaker=s, language=lang, seed=3 + i)
                for i, (t, s, lang) in enumerate(TEXTS[:3])]
    for greedy, max_rows in ((True, None), (False, None), (False, 2)):
        fast = through_engine.synthesize(requests, greedy=greedy, max_frames=18, min_new_tokens=19, max_rows=max_rows)
        plain = synth.synthesize(requests, greedy=greedy, max_frames=18, min_new_tokens=19)
        for a, b in zip(fast, plain):
            assert a.id == b.id and torch.equal(a.codes, b.codes) and a.hit_cap == b.hit_cap
            assert np.linalg.norm(a.audio - b.audio) / np.linalg.norm(b.audio) < 1e-5
    assert through_engine._engine_now.rows == 2   # rebuilt for the capped call


def test_synthesizer_queues_the_longest_texts_first(synth):
    # The results still come back in request order: test_synthesizer_through_the_engine_equals_the_plain_path.
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2)
    texts = ["Hi.", "The birch canoe slid on the smooth planks, and the juice of lemons makes fine punch.",
             "Glue the sheet.", "The birch canoe slid on the smooth planks."]
    requests = [Request(id=str(i), text=t, speaker="vivian", seed=i) for i, t in enumerate(texts)]
    through_engine.synthesize(requests[:1], max_frames=2)   # builds the engine
    queued = []
    run = through_engine._engine_now.run
    through_engine._engine_now.run = lambda queue, **kw: (queued.extend(r.key for r in queue), run(queue, **kw))[1]
    results = through_engine.synthesize(requests, max_frames=4, min_new_tokens=5)
    assert queued == [1, 3, 2, 0]
    assert [r.id for r in results] == ["0", "1", "2", "3"] and all(len(r.codes) == 4 for r in results)


def test_synthesizer_refuses_a_request_its_kv_budget_cannot_hold(synth):
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2)
    through_engine.kv_budget_bytes = 64 * talker_kv_bytes(through_engine.cfg, 2, 1, torch.float32)
    short = Request(id="short", text="Hi.", speaker="vivian", seed=1)
    long = Request(id="long", text="Hi.", speaker="vivian", seed=2)
    assert len(through_engine.synthesize([short], max_frames=10, min_new_tokens=11)[0].codes) == 10
    assert through_engine._engine_now.context == 64   # the call's 256-position bucket, cut to the budget
    engine = through_engine._engine_now
    with pytest.raises(RequestError, match=r"long: its prompt and frame cap need \d+ talker positions; within "
                                           r"the GPU memory budget 2 slots hold 64 each"):
        through_engine.synthesize([long], max_frames=100)
    assert through_engine._engine_now is engine   # not rebuilt: its 64 positions are all the budget holds
    # With on_result, the call's other rows are synthesized and delivered first (job.py then retries the
    # refused one alone), not the whole call refused (its rows would each run alone).
    delivered = {}
    wordy = Request(id="wordy", text="The birch canoe slid on the smooth planks. " * 6, speaker="vivian", seed=3)
    with pytest.raises(RequestError, match="wordy: its prompt and frame cap need"):
        through_engine.synthesize([short, wordy, short], max_frames=10, min_new_tokens=11,
                                  on_result=lambda i, result: delivered.setdefault(i, result))
    assert sorted(delivered) == [0, 2] and all(len(r.codes) == 10 for r in delivered.values())
    assert through_engine._engine_now is engine


def test_a_segment_its_slots_cannot_hold_fails_alone_and_the_call_runs_the_rest_together():
    """Through the job's batches (job.synthesize_batch): the segment that needs more talker positions than
    the engine holds fails with its reason, the others are made in one engine run, not one run each."""
    from tts_cli.job import RowLimit, Segment, synthesize_batch

    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=2)
    through_engine.kv_budget_bytes = 64 * talker_kv_bytes(through_engine.cfg, 2, 1, torch.float32)
    requests = [Request(id="a", text="Hi.", speaker="vivian", seed=1),
                Request(id="wordy", text="The birch canoe slid on the smooth planks. " * 6, speaker="vivian", seed=3),
                Request(id="b", text="Glue the sheet.", speaker="vivian", seed=2)]
    found = {}
    synthesize_batch(through_engine, requests, greedy=False, max_frames=10, limit=RowLimit(3),
                     on_outcome=found.__setitem__)
    assert isinstance(found[0], Segment) and isinstance(found[2], Segment) and found[0].frames == 10
    assert "wordy: its prompt and frame cap need" in str(found[1])
    assert through_engine.timing.calls == 1


def test_rows_auto_builds_one_engine_for_a_call_with_segments_no_slots_hold(monkeypatch):
    """`--rows auto` with a KV budget of 64 slots x 64 positions: two segments need more, and no slot
    count holds them. The others run together; each of those fails alone on the same engine (it was
    built, identical, for each before)."""
    from tts_cli import synthesizer
    from tts_cli.job import RowLimit, Segment, synthesize_batch

    built = []
    monkeypatch.setattr(synthesizer, "Engine", lambda *args, **kw: built.append(Engine(*args, **kw)) or built[-1])
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=None)
    through_engine.kv_budget_bytes = talker_kv_bytes(through_engine.cfg, 64, 64, torch.float32)
    wordy = "The birch canoe slid on the smooth planks. " * 6
    requests = [Request(id=str(i), text=wordy if i % 2 else "Glue the sheet.", speaker="vivian", seed=i)
                for i in range(4)]
    found = {}
    synthesize_batch(through_engine, requests, greedy=False, max_frames=10, limit=RowLimit(64),
                     on_outcome=found.__setitem__)
    assert [isinstance(found[i], Segment) for i in range(4)] == [True, False, True, False]
    assert [(engine.rows, engine.context) for engine in built] == [(64, 64)]


def test_rows_auto_takes_the_most_slots_the_call_fills_and_the_memory_holds():
    # `--rows auto`: per call, the first of AUTO_ROWS (1024, 512, 256, 128, 64) that the call's
    # segments fill with at most one 64-row tile empty and whose keys and values the budget holds.
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=None)
    per_position = talker_kv_bytes(through_engine.cfg, 1, 1, torch.float32)
    through_engine.kv_budget_bytes = 256 * 512 * per_position   # 256 slots x 512 positions
    assert through_engine._slots(segments=10, needs=[100])[0] == 64
    assert through_engine._slots(segments=65, needs=[100])[0] == 128
    assert through_engine._slots(segments=300, needs=[100])[0] == 256   # fills 320: not 512
    assert through_engine._slots(segments=600, needs=[100])[0] == 512   # fills 640: not 1024
    assert through_engine._slots(segments=5000, needs=[100])[0] == 1024   # 1024 x 128 positions fit
    assert through_engine._slots(segments=5000, needs=[200])[0] == 512   # 1024 x 256 do not, 512 x 256 do
    assert through_engine._slots(segments=5000, needs=[300])[0] == 256   # 512 x 512 positions do not
    assert through_engine._slots(segments=5000, needs=[2000])[0] == 64   # 128 x 1024 do not, 64 x 2048 do
    # segments that not even 64 slots hold fail on their own: they do not choose the slots
    assert through_engine._slots(segments=5000, needs=[100] * 4999 + [3000]) == (1024, 100)
    assert through_engine.notes[0] == "--rows auto: 64 engine slots for calls of 10 segments (up to 100 talker positions)"
    assert len(through_engine.notes) == 8
    # and whose steps' working set the rest of the memory holds
    through_engine.step_budget_bytes = 1023 * STEP_BYTES_PER_SLOT
    assert through_engine._slots(segments=5000, needs=[100])[0] == 512   # the KV would hold 1024 x 128 positions
    # An earlier call's engine is kept while a call fills no more slots than it was chosen for: after a
    # row retried alone (64 slots), a large call chooses again.
    through_engine.step_budget_bytes = None
    assert through_engine._slots(segments=1, needs=[100])[0] == 64
    through_engine._engine_now = kept = SimpleNamespace(rows=64, context=128)
    assert through_engine._slots(segments=40, needs=[100])[0] == 64 and through_engine._engine_now is kept
    assert through_engine._slots(segments=1, needs=[3000]) == (64, 0) and through_engine._engine_now is kept
    assert through_engine._slots(segments=5000, needs=[100])[0] == 1024 and through_engine._engine_now is None
    fixed = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=32)
    assert fixed._slots(segments=5000, needs=[100])[0] == 32 and fixed.notes == []


def test_free_gpu_memory_is_read_once_per_choice_after_released_engines_are_collected(monkeypatch):
    """An engine's buffers and CUDA graphs sit in reference cycles, freed by a collection only: read
    before one, the free memory left out what an engine that had run out of it held, and `--rows
    auto` chose 64 slots for the retry (H100, 2026-12-06). Here the earlier engine, released by the
    choice, is the memory beyond 1 GiB: held, the choice would be 64 slots (25 MiB each for the step)."""
    import gc

    from tts_cli import synthesizer

    collected = []

    class InACycle:   # as a released engine
        rows, context = 64, 128

        def __init__(self):
            self.me = self

        def __del__(self):
            collected.append(True)

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30 + 2**37 * len(collected), 2**38))
    monkeypatch.setattr(Synthesizer, "_device", property(lambda self: torch.device("cuda")))
    through_engine = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=None)
    through_engine._engine_now, through_engine._chosen_for = InACycle(), (64, None)   # chosen for a row alone
    was_enabled = gc.isenabled()
    gc.disable()   # (else an automatic collection might come first)
    try:
        assert synthesizer.free_gpu_bytes(torch.device("cuda")) == 2**30   # nothing released yet
        assert through_engine._slots(segments=5000, needs=[100]) == (1024, 100) and collected
    finally:
        if was_enabled:
            gc.enable()
    assert synthesizer.free_gpu_bytes(torch.device("cpu")) is None
    reads = []
    monkeypatch.setattr(synthesizer, "free_gpu_bytes", lambda device: reads.append(device))
    assert through_engine._slots(segments=3000, needs=[100])[0] == 1024 and len(reads) == 1   # 5 choices weighed


def test_rows_auto_synthesizes_as_the_chosen_rows_do(synth):
    # The choice only sets the slots: a call of 3 segments runs as engine_rows=64 would.
    requests = [Request(id=str(i), text=t, speaker=s, language=lang, seed=3 + i)
                for i, (t, s, lang) in enumerate(TEXTS[:3])]
    auto = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=None)
    fixed = Synthesizer.from_pretrained(TINY, engine=True, engine_rows=64)
    for a, b in zip(auto.synthesize(requests, max_frames=6), fixed.synthesize(requests, max_frames=6)):
        assert torch.equal(a.codes, b.codes) and np.array_equal(a.audio, b.audio)
    assert auto._engine_now.rows == 64 and auto.notes


def test_prefill_tiles_of_several_sizes_give_each_request_the_codes_and_audio_of_one_size(synth):
    """An engine of 16 slots prefills in packed tiles of 64 tokens (rows x 4) or, given, of 128, 96, 64
    and 32: a request's codes are the same, its audio within float rounding (torch's CPU GEMMs may sum
    another shape's rows differently; on CUDA tests/test_gpu.py holds it bit for bit), with fewer tile
    calls. Admissions of 16 prompts, then of one or a few; TEXTS' prompts after the first 32 positions
    run a second round."""
    frames = [6, 9, 6, 6, 7, 6, 12, 6, 6, 8, 6, 6, 6, 10, 6, 6, 9, 6, 6, 6]
    requests = _forced(synth, frames)
    assert max(r.prompt_length for r in requests) > 32
    sampling = synth.ckpt.sampling

    def run(prefill_tiles):
        engine = Engine(synth.model, synth.codec, rows=16, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), codec_window=4, prefill_tiles=prefill_tiles)
        tiles, tile = [], engine.prefill._tile
        engine.prefill._tile = lambda size, inputs: (tiles.append(size), tile(size, inputs))[1]
        return tiles, engine.run(requests)
    one_tiles, one = run(None)
    tiles, sized = run((128, 96, 64, 32))
    assert set(tiles) == {128, 96, 64}
    assert len(tiles) < len(one_tiles) and sum(tiles) < sum(one_tiles)
    for i, (a, b) in enumerate(zip(sized, one)):
        assert len(a.codes) == frames[i]
        assert np.array_equal(a.codes, b.codes), f"request {i}"
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=1e-5, atol=1e-6, err_msg=f"request {i}")


def test_packing_cuts_prompts_into_rounds_of_chunks_and_rounds_into_tiles():
    lengths = [5, 40, 32, 70, 1]
    rounds = chunk_rounds(lengths)
    assert [[(c.prompt, c.first, c.count, c.last) for c in r] for r in rounds] == [
        [(0, 0, 5, True), (1, 0, 32, False), (2, 0, 32, True), (3, 0, 32, False), (4, 0, 1, True)],
        [(1, 32, 8, True), (3, 32, 32, False)],
        [(3, 64, 6, True)]]
    sizes = (256, 128, 64, 32)
    tiles = pack(rounds[0], sizes)
    assert [(size, [c.prompt for c in tile]) for size, tile in tiles] == [(128, [0, 1, 2, 3, 4])]
    many = [Chunk(i, 0, 30, True) for i in range(20)]   # 600 tokens: two full tiles of 8, then 120 in 128
    assert [(size, len(tile)) for size, tile in pack(many, sizes)] == [(256, 8), (256, 8), (128, 4)]
    short = [Chunk(i, 0, 1, True) for i in range(40)]   # at most a tile's tokens / 8 chunks
    assert [(size, len(tile)) for size, tile in pack(short, sizes)] == [(256, 32), (64, 8)]


def test_voice_prefixes_give_the_codes_and_audio_of_whole_prompts(synth):
    """With voice prefixes, a named speaker's leading positions (8 or 9 here: with a language id)
    are computed once per speaker and language (where two requests of an admission share them; then
    kept) and copied into each slot; its prompt's rest is prefilled from the prefix on (one of TEXTS'
    6 in two rounds). Requests with a voice prefix (keys other than 3 mod 4) and without, among each
    other: the codes and audio of the engine without voice prefixes."""
    frames = [6, 9, 6, 7, 6, 12, 6, 8, 6, 6, 10, 6, 9, 6, 7, 6, 6, 11, 6, 6]
    prompts = [synth.prompt(Request(id=str(i), text=t, speaker=s, language=lang))
               for i, (t, s, lang) in enumerate(TEXTS)]
    requests = [EngineRequest(key=i, prompt_embeds=prompt_embeddings(synth.model.talker, prompts[i % len(TEXTS)]),
                              seed=100 + i, max_frames=f, min_new_tokens=f + 1,
                              voice_prefix=prompts[i % len(TEXTS)].voice_prefix() if i % 4 != 3 else None)
                for i, f in enumerate(frames)]
    assert [len(p) - p.voice_positions for p in prompts] == [16, 15, 34, 19, 18, 13]
    sampling = synth.ckpt.sampling

    def run(voice_prefixes):
        engine = Engine(synth.model, synth.codec, rows=16, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), codec_window=4, voice_prefixes=voice_prefixes)
        tokens, skipped = [], []   # (a tile's; the positions before its prompts' first chunks)
        inputs = engine.prefill._inputs

        def counted(size, tile, prompts, slots, starts):
            tokens.append(sum(c.count for c in tile))
            skipped.append(sum(starts[c.prompt] for c in tile if c.first == 0))
            return inputs(size, tile, prompts, slots, starts)
        engine.prefill._inputs = counted
        results = engine.run(requests)
        return engine, sum(skipped), sum(tokens), results
    plain_engine, plain_skipped, plain_tokens, plain = run(False)
    engine, skipped, tokens, voiced = run(True)
    assert not plain_engine.prefill.voices and plain_skipped == 0
    # a voice prefix is computed where two requests of an admission share it, then kept: the voices of
    # TEXTS[3] and TEXTS[5] have one request with a prefix in each admission (16, then 4): prefilled whole
    assert set(engine.prefill.voices) == {prompts[i].voice_prefix() for i in (0, 1, 2, 4)}
    # the prompts' positions less their prefixes', plus each prefix's once
    prefixes = [len(r.voice_prefix[0]) for r in requests if r.voice_prefix in engine.prefill.voices]
    assert skipped == sum(prefixes)
    assert tokens == plain_tokens - skipped + sum(len(key[0]) for key in engine.prefill.voices)
    for i, (a, b) in enumerate(zip(voiced, plain)):
        assert len(a.codes) == frames[i]
        assert np.array_equal(a.codes, b.codes), f"request {i}"
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=1e-5, atol=1e-6, err_msg=f"request {i}")


def test_the_voice_prefixes_kept_are_the_most_recently_used(synth, monkeypatch):
    """A corpus may clone a voice per row: the prefill keeps VOICES_KEPT voice prefixes (their keys and
    values), evicting the least recently used."""
    from tts_cli.engine import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "VOICES_KEPT", 2)
    sampling = synth.ckpt.sampling
    engine = Engine(synth.model, synth.codec, rows=4, context=64, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), voice_prefixes=True)
    embeds = prompt_embeddings(synth.model.talker, synth.prompt(Request(id="a", text="Hi.", speaker="vivian")))
    for key in ("a", "b", "a", "c"):
        engine.prefill.voice_prefix(key, embeds[:8], [0, 2])
    assert list(engine.prefill.voices) == ["a", "c"]
    assert torch.equal(engine.state.talker_cache[:, :, 2, :, :8], engine.prefill.voices["c"])


def test_voice_prefixes_keep_a_prompt_near_the_context_within_its_slot(synth):
    """A prompt of 52 positions (44 after its 8-position voice prefix) with a cap of 11 frames needs
    exactly the 64 positions of an engine's slots: its chunks from position 8 (32 and 12 positions)
    must write nothing past its last (as right-padded 32-column chunks would, to 72: on CUDA into the
    next head's or the next slot's keys). It and a short prompt of another voice beside it: the codes
    and audio of the engine without voice prefixes."""
    long_text = ("The birch canoe slid on the smooth planks and glue the sheet to the dark blue background "
                 "quickly, then rice is often served in round bowls.")
    prompts = [synth.prompt(Request(id="long", text=long_text, speaker="vivian")),
               synth.prompt(Request(id="short", text=TEXTS[5][0], speaker="ryan"))]
    assert [len(p) for p in prompts] == [52, 21] and prompts[0].voice_positions == 8
    frames = [64 - len(prompts[0]) - 1, 9]
    requests = [EngineRequest(key=i, prompt_embeds=prompt_embeddings(synth.model.talker, p), seed=7 + i,
                              max_frames=f, min_new_tokens=f + 1, voice_prefix=p.voice_prefix())
                for i, (p, f) in enumerate(zip(prompts, frames))]
    sampling = synth.ckpt.sampling

    def run(voice_prefixes):
        engine = Engine(synth.model, synth.codec, rows=4, context=64, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), voice_prefixes=voice_prefixes)
        return engine.run(requests)
    for i, (a, b) in enumerate(zip(run(True), run(False))):
        assert a.error is None and len(a.codes) == frames[i]
        assert np.array_equal(a.codes, b.codes), f"request {i}"
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=1e-5, atol=1e-6, err_msg=f"request {i}")


def test_a_prompt_after_its_voice_prefix_prefills_to_the_numbers_of_the_whole_prompt(synth):
    """After its voice prefix (TEXTS': starts 8 and 9, one rest of two rounds) each prompt gets the
    hidden state, logits and cached keys and values of the whole prompt's prefill, bit for bit."""
    prompts = [synth.prompt(Request(id=str(i), text=t, speaker=s, language=lang))
               for i, (t, s, lang) in enumerate(TEXTS)]
    embeds = [prompt_embeddings(synth.model.talker, p) for p in prompts]
    requests = [EngineRequest(key=i, prompt_embeds=e, seed=i, max_frames=4, voice_prefix=p.voice_prefix())
                for i, (p, e) in enumerate(zip(prompts, embeds))]
    sampling = synth.ckpt.sampling
    engine = Engine(synth.model, synth.codec, rows=16, context=192, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), voice_prefixes=True)
    assert {engine.prefill_start(r) for r in requests} == {8, 9}
    whole = engine.prefill(embeds, list(range(6)), [0] * 6)
    voiced = engine._prefill_tiles(requests, list(range(6, 12)))
    for a, b in zip(voiced, whole):
        assert torch.equal(a, b)
    for i, length in enumerate(e.shape[0] for e in embeds):
        for kv in engine.state.talker_kv:
            assert torch.equal(kv.k[6 + i, :, :length], kv.k[i, :, :length]), f"prompt {i}"
            assert torch.equal(kv.v[6 + i, :, :length], kv.v[i, :, :length]), f"prompt {i}"


def test_a_prompt_that_is_only_its_voice_prefix_prefills_whole_and_an_empty_prompt_is_refused(synth):
    """The prefill's last position must be the prompt's own: a prompt no longer than its voice prefix
    starts at 0 (its hidden state and logits then come from its last position, not from nothing)."""
    prompt = synth.prompt(Request(id="p", text=TEXTS[0][0], speaker="vivian"))
    embeds, prefix = prompt_embeddings(synth.model.talker, prompt), prompt.voice_prefix()
    sampling = synth.ckpt.sampling
    engine = Engine(synth.model, synth.codec, rows=16, context=192, talker_defaults=talker_settings(sampling),
                    cp_defaults=code_predictor_settings(sampling), voice_prefixes=True)
    whole = EngineRequest(key=0, prompt_embeds=embeds, seed=0, max_frames=4, voice_prefix=prefix)
    only = EngineRequest(key=1, prompt_embeds=embeds[:len(prefix[0])], seed=0, max_frames=4, voice_prefix=prefix)
    assert engine.prefill_start(whole) == len(prefix[0]) == 8 and engine.prefill_start(only) == 0
    assert [len(r.codes) for r in engine.run([whole, only])] == [4, 4]
    with pytest.raises(ValueError, match="at least one position from their start, got \\[5, 0\\]"):
        engine.prefill([embeds[:5], embeds[:0]], [0, 1], [0, 8])


def test_a_voice_prefix_is_the_speaker_and_language_part_of_a_prompt(synth):
    """The same speaker and language: one prefix, whatever the text; another speaker or language:
    another; an instruct: none (tts_cli.model.prompt.Prompt.voice_prefix). A cloned voice: its x-vector's
    (by content) and, with ICL, its transcript's positions too, streamed beside the first reference
    frames (those by content as well); none for an x-vector the host would wait for (not on the CPU)."""
    from tts_cli.model.prompt import REFERENCE_FRAME, assistant_text, build_prompt, reference_text

    def prefix(text="Rice is often served in round bowls.", **fields):
        return synth.prompt(Request(id="p", text=text, **{"speaker": "vivian", **fields})).voice_prefix()
    assert prefix() == prefix(text="Glue the sheet to the dark blue background.")
    assert prefix() != prefix(speaker="ryan") and prefix() != prefix(language="english")
    assert len(prefix()[0]) == len(prefix()[1]) == 8 and len(prefix(language="english")[0]) == 9
    assert prefix(instruct="Speak softly.") is None
    g = torch.Generator().manual_seed(0)
    x_vector, codes = torch.randn(8, generator=g), torch.randint(0, 100, (40, 16), generator=g)
    transcript = synth.tokenize(reference_text("The juice of lemons makes fine punch."))

    def cloned(text="Rice is often served in round bowls.", vector=x_vector, icl=None, reference_codes=codes):
        prompt = build_prompt(synth.cfg, synth.tokenize(assistant_text(text)), None, "auto",
                              non_streaming_mode=icl != "streaming", speaker_embedding=vector,
                              reference_ids=transcript if icl else None,
                              reference_codes=reference_codes if icl else None)
        return prompt, prompt.voice_prefix()
    prompt, key = cloned()
    assert len(key[0]) == prompt.voice_positions == 8 and key == cloned(text="Glue the sheet.")[1]
    assert key != cloned(vector=x_vector + 1)[1] and key == cloned(vector=x_vector.clone())[1]
    assert cloned(vector=torch.zeros(8, device="meta"))[1] is None
    for icl in ("whole", "streaming"):
        prompt, key = cloned(icl=icl)
        transcript_positions = len(key[0]) - 8
        assert key == cloned(text="Glue the sheet.", icl=icl)[1]
        assert list(key[0][8:]) == transcript[3:-2]   # the transcript's tokens, all (fewer than the frames)
        frames = key[1].count(REFERENCE_FRAME)
        assert frames == (0 if icl == "whole" else transcript_positions - 1)   # (after codec_bos)
        other = codes.clone()
        other[-1] += 1   # a frame past the prefix
        assert key == cloned(icl=icl, reference_codes=other)[1]
        other[0] += 1    # the first frame, within it when streamed
        assert (key == cloned(icl=icl, reference_codes=other)[1]) == (icl == "whole")


def test_prefill_tiles_on_cuda_are_the_multiples_of_256_tokens_up_to_rows_x_4_and_2048():
    assert prefill_tiles_for(1024, cuda=True) == (2048, 1792, 1536, 1280, 1024, 768, 512, 256)
    assert prefill_tiles_for(512, cuda=True) == prefill_tiles_for(1024, cuda=True)
    assert prefill_tiles_for(256, cuda=True) == (1024, 768, 512, 256)
    assert prefill_tiles_for(128, cuda=True) == (512, 256) and prefill_tiles_for(64, cuda=True) == (256,)
    assert prefill_tiles_for(16, cuda=True) == (64,) and prefill_tiles_for(1, cuda=True) == (32,)
    assert prefill_tiles_for(2048, cuda=False) == (2048,) and prefill_tiles_for(4, cuda=False) == (32,)
    assert prefill_head_rows(1) == 1 and prefill_head_rows(64) == 8 and prefill_head_rows(1024) == 64


def test_prefill_tiles_that_the_engine_cannot_run_are_refused(synth):
    sampling = synth.ckpt.sampling
    for tiles in ((), (32, 64), (64, 64), (64, 16)):
        with pytest.raises(ValueError, match="tile sizes must decrease from the largest and hold a chunk of 32"):
            Engine(synth.model, synth.codec, rows=8, context=192, talker_defaults=talker_settings(sampling),
                   cp_defaults=code_predictor_settings(sampling), prefill_tiles=tiles)

"""The slot engine clones and designs voices as the plain model does (CPU, fp32, no graphs): Base
rows (ICL and x-vector only, both text modes) and VoiceDesign rows, mixed in one call, give the
plain path's codes and waveforms (tests/test_engine.py holds CustomVoice to the same), whatever
their batch mates and slots."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from clone_cases import (CUT_KEEPS_A_SAMPLE, FIXTURES, SHORT_REFERENCE, TINY_BASE, TINY_BASE_06, TINY_VOICE_DESIGN,
                         clone_requests, design_requests)
from tts_cli import bench, cli
from tts_cli.bench_clone import bench_reference, model_kind, synthetic_voice, transcript
from tts_cli.checkpoint import BASE
from tts_cli.engine.random_model import random_config, random_encoders
from tts_cli.engine.runner import Engine, EngineRequest
from tts_cli.errors import RequestError
from tts_cli.model.prompt import trailing_text_embeddings
from tts_cli.request import Request
from tts_cli.synthesizer import Synthesizer, code_predictor_settings, icl_cut, icl_codes, talker_settings

LONG_REFERENCE = 70   # frames: the ICL prompt spans 3+ of the prefill's chunks of 32 positions (rounds)


@pytest.fixture(scope="module")
def base():
    return Synthesizer.from_pretrained(TINY_BASE)


def _assert_engine_equals_plain(plain: Synthesizer, requests, greedy: bool, frames: int, rows: int = 4):
    """The synthesizer's engine path (rows slots) against its plain path: same codes and cap, the
    same waveform up to float summation order (as tests/test_engine.py)."""
    through_engine = Synthesizer(plain.ckpt, plain.model, plain.tokenizer, plain.codec, engine=True, engine_rows=rows)
    fast = through_engine.synthesize(requests, greedy=greedy, max_frames=frames, min_new_tokens=frames + 1)
    slow = plain.synthesize(requests, greedy=greedy, max_frames=frames, min_new_tokens=frames + 1)
    for a, b in zip(fast, slow):
        assert a.id == b.id and torch.equal(a.codes, b.codes) and a.hit_cap == b.hit_cap, a.id
        assert a.audio.shape == b.audio.shape, a.id
        assert np.linalg.norm(a.audio - b.audio) / np.linalg.norm(b.audio) < 1e-5, a.id
    return through_engine, fast


@pytest.mark.parametrize("size, greedy", [("1.7b", True), ("1.7b", False), ("0.6b", False)],
                         ids=["1.7b-greedy", "1.7b-sampled", "0.6b-sampled"])
def test_cloned_rows_through_the_engine_equal_the_plain_path(base, size, greedy):
    """ICL and x-vector rows in both text modes through 4 slots (6 rows: slots refilled, a primed
    codec state copied into a slot that held another row), 1.7B- and 0.6B-shaped Base models."""
    if size == "0.6b":
        base = Synthesizer.from_pretrained(TINY_BASE_06)
    requests = clone_requests(base.cfg, LONG_REFERENCE)
    assert max(len(base.prompt(r)) for r in requests) > 3 * 32
    assert {len(base.prompt(r).trailing_text_ids) > 0 for r in requests} == {True, False}
    engine, results = _assert_engine_equals_plain(base, requests, greedy, CUT_KEEPS_A_SAMPLE)
    spf = base.codec.samples_per_frame
    # the official cut keeps the short reference's last sample: the engine's reference tail gives it
    total = SHORT_REFERENCE + CUT_KEEPS_A_SAMPLE
    assert icl_cut(SHORT_REFERENCE, total, total * spf) == SHORT_REFERENCE * spf - 1
    assert [r.audio.shape[0] - CUT_KEEPS_A_SAMPLE * spf for r in results] == [1, 0, 0, 0, 1, 0]
    assert len(engine._engine_now._primed) == 2   # one primed codec state per distinct reference


def test_designed_voices_through_the_engine_equal_the_plain_path():
    _assert_engine_equals_plain(Synthesizer.from_pretrained(TINY_VOICE_DESIGN), design_requests(), greedy=False,
                                frames=12)


def _engine_requests(synth, requests, frames):
    return [EngineRequest(key=i, prompt_embeds=row.prompt_embeds, seed=row.seed, max_frames=frames,
                          min_new_tokens=frames + 1, trailing_text=row.trailing_text,
                          codec_prime=icl_codes(r.reference))
            for i, (r, row) in enumerate(zip(requests, (synth.row_input(r, frames) for r in requests)))]


def _engine(synth, rows, trailing_text=True):
    sampling = synth.ckpt.sampling
    return Engine(synth.model, synth.codec, rows=rows, context=192, talker_defaults=talker_settings(sampling),
                  cp_defaults=code_predictor_settings(sampling), top_p=True, codec_window=4,
                  trailing_text=trailing_text)


def test_cloned_row_is_bit_identical_whatever_its_batch_mates_and_slot(base):
    """A seeded streaming-text ICL row alone, with other rows, and in another slot and prefill
    tile: the same codes and PCM, bit for bit, and again run to run."""
    requests = _engine_requests(base, clone_requests(base.cfg, LONG_REFERENCE), frames=10)

    def run(order):
        return {r.key: r for r in _engine(base, rows=4).run([requests[i] for i in order])}

    alone = run([0])
    assert requests[0].codec_prime is not None and requests[0].trailing_text is not None
    for other in (run([0, 5, 1, 2]), run([1, 2, 3, 4, 5, 0]), run([0])):   # in slot 0, a refilled one, 0
        assert np.array_equal(other[0].codes, alone[0].codes)
        assert np.array_equal(other[0].pcm, alone[0].pcm)
        assert np.array_equal(other[0].reference_tail, alone[0].reference_tail)


def test_cloned_voices_prefixes_give_the_codes_and_audio_of_whole_prompts(base):
    """With voice prefixes (the engine's from 64 slots on CUDA), a cloned voice's leading positions
    (its x-vector's, and with ICL its transcript's, streamed beside the first reference frames in the
    streaming text mode) are computed once per voice, mode and language and copied into each slot that
    shares them: the codes and reference tails of the engine without voice prefixes, its PCM within
    float rounding. Each of the six kinds of Base row twice, with other texts, and the first kind's
    voice with another x-vector (its prefix must not be the first's)."""
    kinds = clone_requests(base.cfg, LONG_REFERENCE)
    # and the first kind's with another x-vector (the same transcript, frames, mode and language)
    other = dataclasses.replace(kinds[0].reference, speaker_embedding=kinds[0].reference.speaker_embedding + 0.5)
    kinds.append(dataclasses.replace(kinds[0], id="other-x-vector", reference=other, seed=40))
    cloned = [request for i, r in enumerate(kinds)   # each next to its twin of the same frames: admitted together
              for request in (r, dataclasses.replace(r, id=f"{r.id}-again", text=kinds[(i + 3) % 6].text, seed=30 + i))]
    prompts = [base.prompt(r) for r in cloned]
    requests = [dataclasses.replace(r, voice_prefix=p.voice_prefix(), max_frames=6 + i // 2 % 5, min_new_tokens=40)
                for i, (r, p) in enumerate(zip(_engine_requests(base, cloned, frames=1), prompts))]
    keys = {r.voice_prefix for r in requests}
    assert None not in keys and len(keys) == 7
    assert max(len(key[0]) for key in keys) > 8   # an ICL transcript's positions

    def run(voice_prefixes):
        sampling = base.ckpt.sampling
        engine = Engine(base.model, base.codec, rows=4, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), top_p=True, codec_window=4,
                        trailing_text=True, voice_prefixes=voice_prefixes)
        return engine, engine.run(requests)
    _, plain = run(False)
    engine, voiced = run(True)
    assert set(engine.prefill.voices) == keys
    for a, b in zip(voiced, plain):
        assert np.array_equal(a.codes, b.codes), f"request {a.key}"
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=1e-5, atol=1e-6, err_msg=f"request {a.key}")
        assert (a.reference_tail is None) == (b.reference_tail is None)
        assert a.reference_tail is None or np.array_equal(a.reference_tail, b.reference_tail)


def test_cloned_rows_moved_into_tail_steps_keep_their_codes_and_audio(base):
    """Streaming-text and ICL rows (trailing text, primed codec states) through 4 slots with tail steps
    of 2 and 1 rows: the longest, a streaming-text row 12 frames into its 17 text vectors, moves from slot
    2 to slot 0 (runner._enter_tail) and runs on alone; every
    row's codes and reference tail as without tails, its PCM within float rounding (torch's CPU
    convolutions may sum differently at another batch size; on CUDA, where tails run, tests/test_gpu.py
    holds the PCM bit for bit)."""
    requests = _engine_requests(base, clone_requests(base.cfg, LONG_REFERENCE), frames=1)
    requests = [dataclasses.replace(r, max_frames=f, min_new_tokens=f + 1)
                for r, f in zip(requests, [4, 4, 20, 4, 6, 18])]
    assert requests[2].trailing_text.shape[0] == 17 and requests[5].codec_prime is not None

    def run(tail_rows):
        sampling = base.ckpt.sampling
        engine = Engine(base.model, base.codec, rows=4, context=192, talker_defaults=talker_settings(sampling),
                        cp_defaults=code_predictor_settings(sampling), top_p=True, codec_window=4,
                        trailing_text=True, tail_rows=tail_rows)
        return engine.run(requests), engine.stats.steps_by_rows
    full, full_steps = run(())
    tails, tail_steps = run((2, 1))
    assert set(full_steps) == {4} and set(tail_steps) == {4, 2, 1}
    for a, b in zip(tails, full):
        assert np.array_equal(a.codes, b.codes), f"request {a.key}"
        np.testing.assert_allclose(a.pcm, b.pcm, rtol=1e-5, atol=1e-6)
        assert (a.reference_tail is None) == (b.reference_tail is None)
        assert a.reference_tail is None or np.array_equal(a.reference_tail, b.reference_tail)


def test_trailing_text_reaches_the_talker_frame_by_frame(base):
    """The streaming text mode's text vectors change the row (a run without them differs), and
    only while they last: a row whose trailing text ends at frame 3 follows the full-text row up
    to frame 3 and then differs."""
    request = next(r for r in clone_requests(base.cfg, LONG_REFERENCE) if r.id == "x-vector-streaming")
    row = base.row_input(request, 12)
    text = trailing_text_embeddings(base.model.talker, base.prompt(request))
    assert text.shape[0] > 5
    greedy = base.ckpt.sampling.greedy()
    engine = Engine(base.model, base.codec, rows=1, context=192, talker_defaults=talker_settings(greedy),
                    cp_defaults=code_predictor_settings(greedy), trailing_text=True)

    def codes(trailing):
        return engine.run([EngineRequest(key=0, prompt_embeds=row.prompt_embeds, seed=0, max_frames=12,
                                         min_new_tokens=13, trailing_text=trailing)])[0].codes

    full, cut, none = codes(text), codes(text[:3]), codes(None)
    # frame f's codes come from the talker input of frames < f (frame 0's from the prompt alone)
    assert np.array_equal(cut[:4], full[:4]) and not np.array_equal(cut[4:], full[4:])
    assert np.array_equal(none[:1], full[:1]) and not np.array_equal(none, full)


def test_an_engine_without_trailing_text_refuses_a_streaming_text_row(base):
    request = next(r for r in clone_requests(base.cfg, LONG_REFERENCE) if r.id == "x-vector-streaming")
    streaming = _engine_requests(base, [request], frames=4)
    with pytest.raises(RequestError, match=r"trailing text \(the streaming text mode\), but this engine was built "
                                           r"without \(Engine\(trailing_text=True\) holds it\)"):
        _engine(base, rows=2, trailing_text=False).run(streaming)


# -- tts bench --workload: one cloned voice for every request ----------------------------------------

@pytest.mark.parametrize("workload, ref_frames", [("clone-icl", 25), ("clone-xvector", None)])
def test_bench_clone_workload_encodes_one_reference_and_runs_the_engine(tmp_path, workload, ref_frames):
    """The tiny Base checkpoint's own encoders encode the 2 s synthetic reference once (25 frames of
    codes for ICL); every request clones it through the engine, in the streaming text mode."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli.app, ["bench", "--device", "cpu", "--model", str(TINY_BASE), "--concurrency", "2",
                                          "--requests", "3", "--frames", "4", "--workload", workload,
                                          "--ref-seconds", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert (report["workload"], report["ref_seconds"], report["ref_frames"]) == (workload, 2, ref_frames)
    assert report["ref_encoders"] == "the checkpoint's" and report["ref_encode_s"] > 0
    assert report["rows"][0]["frames"] == 3 * 4
    assert f"workload {workload}: one voice cloned from a 2 s reference" in result.output


def test_bench_clone_requests_carry_the_reference_and_the_trailing_text():
    synth = Synthesizer.from_pretrained(TINY_BASE)
    sentences = bench.read_sentences(bench.SENTENCES)
    reference, info = bench_reference(synth, "clone-icl", None, 2.0, sentences)
    requests = bench.make_requests(synth, sentences[:3], 3, 5, "vivian", reference)
    assert reference.text == sentences[0] and info["ref_text_chars"] == len(sentences[0])   # one sentence at least
    assert all(torch.equal(r.codec_prime, reference.codes) for r in requests)
    assert all(r.trailing_text is not None for r in requests)   # the texts outlast the 26 codec positions
    assert reference.speaker_embedding.device.type == "cpu"   # as tts synth's reference cache holds it
    assert len({r.voice_prefix for r in requests}) == 1 and len(requests[0].voice_prefix[0]) > 8   # transcript
    expected = synth.row_input(Request(id="1", text=sentences[1], reference=reference), 5)
    assert torch.equal(requests[1].prompt_embeds, expected.prompt_embeds)
    assert torch.equal(requests[1].trailing_text, expected.trailing_text)


def test_synthetic_reference_voice_is_fixed_and_voiced():
    a, b = synthetic_voice(1.5), synthetic_voice(1.5)
    assert a.shape == (36000,) and torch.equal(a, b) and a.abs().max() == pytest.approx(0.5)
    spectrum = torch.fft.rfft(a).abs()
    peak_hz = spectrum[50:].argmax().item() / 1.5 + 50 / 1.5   # the strongest component: the pitch, 100-160 Hz
    assert 95 < peak_hz < 165


def test_reference_transcript_is_as_long_as_the_reference_speaks():
    sentences = ["A" * 30, "B" * 40, "C" * 20, "D" * 50]
    assert transcript(sentences, 6) == "A" * 30 + " " + "B" * 40       # 71 chars; with C 92 > 6 s x 14/s
    assert transcript(sentences, 1) == "A" * 30                         # one sentence at least
    assert transcript(sentences, 20) == " ".join(sentences + sentences[:3])   # the list again from its start


def test_bench_refuses_an_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload 'clone': one of customvoice, clone-icl, clone-xvector"):
        model_kind("clone")


def test_random_base_model_has_the_released_base_shapes():
    """random:0.6b for the clone workloads: a Base config with no speakers, and encoders whose every
    tensor has the released shape (tests/fixtures/golden/encoders/encoders.json, from the official
    configs); a second of the synthetic voice encodes to an x-vector of the talker's width and 13
    frames of codes spread over the codebooks."""
    cfg = random_config("0.6b", BASE)
    assert cfg.model_type == BASE and cfg.speakers == [] and cfg.speaker_encoder.enc_dim == 1024
    speaker, codec = random_encoders("0.6b", "cpu")
    released = json.loads((FIXTURES / "golden" / "encoders" / "encoders.json").read_text())
    assert {k: list(v.shape) for k, v in speaker.state_dict().items()} == \
        released["real_speaker_encoders"]["0.6b"]["parameters"]
    codec_tensors = released["real_codec_encoder"]["encoder_tensors"]
    assert {k: list(v.shape) for k, v in codec.state_dict().items()} == \
        {k: codec_tensors["encoder." + k] for k in codec.state_dict()}
    voice = synthetic_voice(1.0)
    embedding, codes = speaker.embed(voice), codec.encode(voice)
    assert embedding.shape == (1024,) and torch.isfinite(embedding).all()
    assert codes.shape == (13, 16) and len(codes.unique()) > 13

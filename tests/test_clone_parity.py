"""Voice cloning (Base) and voice design (VoiceDesign) in the plain model: equal to the official
Qwen3-TTS on tiny random checkpoints (fp32), fed the official x-vector and reference codes recorded
with them; the prompts' layouts and text modes; the rows a checkpoint cannot synthesize.

Stored records: tools/make_golden.py (the official generate_voice_clone / generate_voice_design).
Live: the same recorder runs the official code now, when it is importable."""
import inspect
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tts_cli import cli
from tts_cli.checkpoint import open_checkpoint
from tts_cli.errors import CheckpointError, RequestError
from tts_cli.model.prompt import REFERENCE_FRAME, SPEAKER_EMBEDDING
from tts_cli.quality import reference
from tts_cli.quality.golden import compare, load_records, prompt_requests
from tts_cli.request import Request, VoiceReference
from tts_cli.synthesizer import Synthesizer, icl_cut

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CUSTOM_VOICE = ROOT / "tts_cli" / "assets" / "tiny-1.7b-customvoice"
BASE_17, BASE_06 = FIXTURES / "tiny-1.7b-base", FIXTURES / "tiny-0.6b-base"
DESIGN = FIXTURES / "tiny-1.7b-voicedesign"
GOLDEN = FIXTURES / "golden"


@pytest.fixture(scope="module")
def base06():
    return Synthesizer.from_pretrained(BASE_06, dtype=torch.float32)


@pytest.fixture(scope="module")
def recorded_voice():
    tensors, meta = load_records(GOLDEN / "tiny-0.6b-base")
    return tensors["ref.speaker_embedding"], tensors["ref.codes"], meta["reference"]["text"]


def _assert_all_pass(checks):
    failed = [f"{c.name}: {c.value_text()} vs {c.threshold_text()}" for c in checks if c.failed]
    assert not failed, "\n".join(failed)
    unavailable = [c.name for c in checks if c.value is None]
    assert all(name.startswith("depth kernel vs loop") for name in unavailable), unavailable   # it needs Hopper


@pytest.mark.parametrize("name", ["tiny-1.7b-base", "tiny-1.7b-voicedesign"])
def test_equal_to_stored_official_records(name):
    synth = Synthesizer.from_pretrained(FIXTURES / name, dtype=torch.float32)
    tensors, meta = load_records(GOLDEN / name)
    checks = compare(synth, tensors, meta)
    _assert_all_pass(checks)
    names = [c.name for c in checks]
    # the streaming prompts' trailing text ends within the forced frames: the teacher-forced logits
    # cover the text steps and the tts_pad steps after them
    trailing = [len(synth.prompt(r).trailing_text_ids) for r in prompt_requests(meta, tensors)]
    assert 0 < max(trailing) < meta["generation"]["forced_frames"]
    if name.endswith("base"):   # ICL and x-vector only, both text modes, EOS stops, both batch modes
        modes = {(p["clone"], p.get("non_streaming_mode", False)) for p in meta["prompts"]}
        assert modes == {("icl", False), ("icl", True), ("x_vector", False), ("x_vector", True)}
        assert "p0 waveform (ICL: after the reference's codes, cut at its end)" in names
        assert [p["natural_stopped_by_eos"] for p in meta["prompts"]] == [True, True, True, False, True]
        assert {"batch of 5, non_streaming_mode True: greedy codes",
                "batch of 5, non_streaming_mode False: greedy codes"} <= set(names)
    else:
        assert [p.get("non_streaming_mode") for p in meta["prompts"]] == [None, False, None]
        assert any(p["natural_stopped_by_eos"] for p in meta["prompts"])


def test_verify_golden_passes_a_base_record_set():
    result = CliRunner().invoke(cli.app, ["verify-golden", "--model", str(BASE_06), "--golden",
                                          str(GOLDEN / "tiny-0.6b-base")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "p0 reference text token ids" in result.output
    assert "p2 greedy codes, official EOS rule (8 frames, EOS)" in result.output
    assert "batch of 4, non_streaming_mode False: greedy codes" in result.output
    assert result.output.rstrip().endswith("38 checks pass, 0 fail, 2 not available")


def test_verify_golden_fails_on_other_reference_codes(tmp_path):
    """The first prompt only (ICL, streaming text), one reference code changed: the prompt and
    the primed waveform fail."""
    shutil.copytree(GOLDEN / "tiny-0.6b-base", tmp_path, dirs_exist_ok=True)
    records = load_file(str(tmp_path / "records.safetensors"))
    records["ref.codes"][7, 3] = (records["ref.codes"][7, 3] + 1) % 16
    save_file(records, str(tmp_path / "records.safetensors"))
    meta = json.loads((tmp_path / "records.json").read_text())
    meta["prompts"] = meta["prompts"][:1]   # a batch of one row equals the recorded batch's row (row-independent)
    (tmp_path / "records.json").write_text(json.dumps(meta))
    result = CliRunner().invoke(cli.app, ["verify-golden", "--model", str(BASE_06), "--golden", str(tmp_path)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    failing = [line.split("│")[1].strip() for line in result.output.splitlines() if "FAIL" in line]
    assert "p0 prompt embeddings" in failing and "p0 waveform (ICL: after the reference's codes, cut at its end)" \
        in failing, result.output


def test_equal_to_the_official_code_live(base06):
    try:
        reference.import_official()
    except ImportError as e:
        pytest.skip(f"the official implementation is not importable here: {e}")
    tensors, meta = reference.record(BASE_06, frames=6, natural_max_new_tokens=7)
    stored, _ = load_records(GOLDEN / "tiny-0.6b-base")
    assert torch.equal(tensors["ref.codes"], stored["ref.codes"])
    assert torch.allclose(tensors["ref.speaker_embedding"], stored["ref.speaker_embedding"], rtol=0, atol=1e-5)
    _assert_all_pass(compare(base06, tensors, meta))


def test_the_reference_voice_file_is_what_the_records_cloned():
    audio, rate = sf.read(str(FIXTURES / "reference-voice-24k.wav"), dtype="float32")
    assert rate == 24000 and audio.ndim == 1
    assert np.array_equal(audio, reference.reference_voice())
    assert round(len(audio) / 1920 + 0.5) == load_records(GOLDEN / "tiny-0.6b-base")[1]["reference"]["frames"] == 31


def test_text_mode_defaults_are_the_official_ones(base06):
    assert base06.cfg.default_non_streaming_mode is False
    assert open_checkpoint(DESIGN).config.default_non_streaming_mode is True
    assert open_checkpoint(CUSTOM_VOICE).config.default_non_streaming_mode is True
    try:
        qwen_tts = reference.import_official()
    except ImportError:
        return
    official = qwen_tts.Qwen3TTSModel
    defaults = {name: inspect.signature(getattr(official, name)).parameters["non_streaming_mode"].default
                for name in ("generate_voice_clone", "generate_voice_design", "generate_custom_voice")}
    assert defaults == {"generate_voice_clone": False, "generate_voice_design": True, "generate_custom_voice": True}


def test_prompt_layouts(base06, recorded_voice):
    embedding, codes, ref_text = recorded_voice
    cfg = base06.cfg
    icl = VoiceReference(embedding, codes, ref_text)
    long_text = reference.LONG_TEXT
    # Streaming ICL: a text track longer than the reference's codec track continues as trailing text...
    prompt = base06.prompt(Request(id="a", text=long_text, language="auto", reference=icl))
    ref_tokens = len(base06.tokenize(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")) - 5
    text_tokens = prompt.text_tokens
    paired = codes.shape[0] + 1
    assert prompt.codec_ids.count(REFERENCE_FRAME) == codes.shape[0] and prompt.codec_ids.count(SPEAKER_EMBEDDING) == 1
    assert len(prompt.trailing_text_ids) == ref_tokens + text_tokens + 1 - paired > 0
    assert prompt.trailing_text_ids[-1] == cfg.tts_eos_id
    # ... a shorter one is padded with tts_pad and leaves none.
    short = base06.prompt(Request(id="b", text="Hi.", language="auto", reference=icl))
    assert short.trailing_text_ids == [] and short.text_ids[-1] == cfg.tts_pad_id and len(short) == len(prompt)
    # Non-streaming ICL: every text token first, then codec_bos and the reference frames beside tts_pad.
    whole = base06.prompt(Request(id="c", text=long_text, language="auto", reference=icl, non_streaming_mode=True))
    assert whole.trailing_text_ids == [] and len(whole) == len(prompt) - paired + ref_tokens + text_tokens + 1 + paired
    # x-vector only, streaming: the first text token beside codec_bos, the rest (and tts_eos) trailing.
    xvec = base06.prompt(Request(id="d", text=long_text, language="english", reference=VoiceReference(embedding)))
    assert xvec.codec_ids[-1] == cfg.codec_bos_id and len(xvec.trailing_text_ids) == text_tokens
    assert REFERENCE_FRAME not in xvec.codec_ids and xvec.codec_ids.count(SPEAKER_EMBEDDING) == 1


def test_icl_waveform_starts_where_the_reference_ends(base06, recorded_voice):
    embedding, codes, ref_text = recorded_voice
    requests = [Request(id="icl", text="Rice is often served in round bowls.", language="english",
                        reference=VoiceReference(embedding, codes, ref_text)),
                Request(id="xvec", text="Rice is often served in round bowls.", language="english",
                        reference=VoiceReference(embedding))]
    icl, xvec = base06.synthesize(requests, greedy=True, max_frames=20, min_new_tokens=21)
    assert icl.frames == xvec.frames == 20 and len(xvec.audio) == 20 * 1920
    total = (31 + 20) * 1920
    assert len(icl.audio) == total - icl_cut(31, 51, total) == 20 * 1920 + 1   # the official cut, 1 sample early
    primed = base06.decode([torch.cat((codes, icl.codes))])[0]   # alone, not in a batch of two: 1e-6 apart
    assert np.allclose(icl.audio, primed[icl_cut(31, 51, total):], rtol=0, atol=1e-5)
    assert not np.allclose(icl.audio[1:], base06.decode([icl.codes])[0], atol=1e-3)   # the priming matters


def test_rows_of_mixed_voices_and_text_modes_in_one_batch_equal_each_alone(base06, recorded_voice):
    """The official API takes one text mode per call; ours takes one per row, and a row's codes
    do not depend on its batch mates (left-padded prompts, trailing text per row)."""
    embedding, codes, ref_text = recorded_voice
    rows = [Request(id="a", text=reference.LONG_TEXT, language="auto",
                    reference=VoiceReference(embedding, codes, ref_text)),
            Request(id="b", text="Two blue fish swam in the tank.", language="english",
                    reference=VoiceReference(embedding), non_streaming_mode=True),
            Request(id="c", text="Cut the pie into large parts.", language="english",
                    reference=VoiceReference(embedding, codes, ref_text), non_streaming_mode=True)]
    together = base06.synthesize(rows, greedy=True, max_frames=10, min_new_tokens=11)
    for row, result in zip(rows, together):
        alone = base06.synthesize([row], greedy=True, max_frames=10, min_new_tokens=11)[0]
        assert torch.equal(result.codes, alone.codes), row.id
        assert np.allclose(result.audio, alone.audio, rtol=0, atol=1e-5), row.id


def test_rows_a_checkpoint_cannot_synthesize_fail_with_the_reason(base06, recorded_voice):
    embedding, codes, ref_text = recorded_voice
    voice = VoiceReference(embedding, codes, ref_text, name="ref.wav")
    custom = Synthesizer.from_pretrained(CUSTOM_VOICE)
    design = Synthesizer.from_pretrained(DESIGN)
    cases = [
        (custom, Request(id="r", text="Hi.", speaker="vivian", reference=voice),
         "a reference voice \\(ref_audio\\) needs a Base checkpoint: this is a CustomVoice checkpoint"),
        (design, Request(id="r", text="Hi.", reference=voice), "needs a Base checkpoint: this is a VoiceDesign"),
        (design, Request(id="r", text="Hi.", speaker="vivian", instruct="Calm."),
         "speaker 'vivian': a VoiceDesign checkpoint has no named speakers; it takes the voice from instruct"),
        (base06, Request(id="r", text="Hi.", speaker="vivian", reference=voice),
         "speaker 'vivian': a Base checkpoint has no named speakers; it clones the reference voice"),
        (base06, Request(id="r", text="Hi.", instruct="Whisper.", reference=voice),
         "instruct: a Base checkpoint takes no instruction"),
        (base06, Request(id="r", text="Hi."), "a Base checkpoint clones a voice: the row needs a reference"),
        (base06, Request(id="r", text="Hi.", reference=replace(voice, text="  ")),
         "reference ref.wav: ICL needs the reference's transcript \\(ref_text\\)"),
        (base06, Request(id="r", text="Hi.", reference=replace(voice, speaker_embedding=torch.zeros(7))),
         "speaker embedding of shape \\(7,\\).*takes a float x-vector of 16"),
        (base06, Request(id="r", text="Hi.", reference=replace(voice, speaker_embedding=embedding * float("nan"))),
         "reference ref.wav: its speaker embedding is not finite \\(NaN or infinity\\)"),
        (base06, Request(id="r", text="Hi.", reference=replace(voice, codes=codes[:, :8])),
         "codes of shape \\(31, 8\\).*\\[frames >= 1, 16\\]"),
        (base06, Request(id="r", text="Hi.", reference=replace(voice, codes=codes + 2048)), "codes outside 0..2047"),
        (base06, Request(id="r", text="Hi.", language="sichuan_dialect", reference=voice),
         "unknown language 'sichuan_dialect'"),
    ]
    for synth, request, message in cases:
        with pytest.raises(RequestError, match=message):
            synth.validate(request)
    base06.validate(Request(id="ok", text="Hi.", reference=replace(voice, codes=None, text=None)))   # x-vector only
    design.validate(Request(id="ok", text="Hi."))   # no instruct: allowed, as the official


def test_base_checkpoint_loading(tmp_path, base06):
    tensors = base06.ckpt.speaker_encoder_tensors()
    assert "fc.weight" in tensors and tensors["fc.weight"].shape[0] == base06.cfg.speaker_encoder.enc_dim == 16
    assert base06.cfg.speaker_encoder.enc_channels == (16, 16, 16, 16, 48)
    with pytest.raises(CheckpointError, match="a CustomVoice checkpoint has no speaker encoder"):
        open_checkpoint(CUSTOM_VOICE).speaker_encoder_tensors()
    ckpt = Path(shutil.copytree(BASE_06, tmp_path / "ckpt"))
    weights = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("speaker_encoder.")},
              str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="a Base checkpoint without speaker_encoder.\\* tensors"):
        Synthesizer.from_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["speaker_encoder_config"]["enc_dim"] = 32
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="enc_dim 32 differs from the talker's hidden_size 16"):
        open_checkpoint(ckpt)


def test_recorded_requests_carry_the_official_voice():
    tensors, meta = load_records(GOLDEN / "tiny-1.7b-base")
    requests = prompt_requests(meta, tensors)
    assert [r.reference.x_vector_only for r in requests] == [False, False, False, True, True]
    assert all(r.speaker is None and r.reference.speaker_embedding is tensors["ref.speaker_embedding"]
               for r in requests)


def test_a_long_cloned_row_keeps_its_voice_and_text_mode_in_every_segment(recorded_voice):
    from tts_cli.job import segment_requests
    voice = VoiceReference(*recorded_voice)
    row = Request(id="long", text="The birch canoe slid on the smooth planks. " * 12, reference=voice,
                  non_streaming_mode=True, seed=3)
    segments = segment_requests(row, 120)
    assert len(segments) > 1 and [s.id for s in segments[:2]] == ["long#1", "long#2"]
    assert all(s.reference is voice and s.non_streaming_mode is True for s in segments)

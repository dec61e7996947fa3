"""Speaker encoder and codec encoder against the official code's outputs
(tests/fixtures/golden/encoders, recorded by tools/make_encoder_golden.py on tiny random models)."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tts_cli.errors import CheckpointError
from tts_cli.model.codec_encoder import CodecEncoder, CodecEncoderConfig, load_codec_encoder
from tts_cli.model.speaker_encoder import (SpeakerEncoder, SpeakerEncoderConfig, load_speaker_encoder,
                                           log_mel_spectrogram, slaney_mel_filterbank)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from make_encoder_golden import seeded_state  # noqa: E402

GOLDEN_DIR = REPO / "tests/fixtures/golden/encoders"
GOLDEN = load_file(str(GOLDEN_DIR / "encoders.safetensors"))
INFO = json.loads((GOLDEN_DIR / "encoders.json").read_text())
CLIPS = ("short", "even", "long")
TINY_CUSTOMVOICE_TOKENIZER = REPO / "tts_cli/assets/tiny-1.7b-customvoice/speech_tokenizer"


def _seeded(model_class, config, prefix: str = "") -> dict[str, torch.Tensor]:
    """The fixture's weights for a module of `model_class`, drawn from its own parameter names."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in model_class(config).state_dict().items()}
    return {prefix + name: value for name, value in seeded_state(shapes).items()}


@pytest.fixture(scope="module")
def speaker_encoder() -> SpeakerEncoder:
    config = SpeakerEncoderConfig.parse({"speaker_encoder_config": INFO["speaker_encoder_config"]}, "config.json")
    return SpeakerEncoder.from_state_dict(config, _seeded(SpeakerEncoder, config))


@pytest.fixture(scope="module")
def codec_encoder() -> CodecEncoder:
    config = CodecEncoderConfig.parse(INFO["speech_tokenizer_config"], "speech_tokenizer/config.json")
    return CodecEncoder.from_state_dict(config, _seeded(CodecEncoder, config))


# ---------------------------------------------------------------------------------------------
# Speaker encoder


def test_mel_filterbank_equals_librosa():
    ours = slaney_mel_filterbank()
    golden = GOLDEN["mel_filterbank"]
    assert ours.dtype == torch.float32 and ours.shape == golden.shape == (128, 513)
    assert (ours - golden).abs().max().item() <= 1e-9


@pytest.mark.parametrize("clip", CLIPS)
def test_log_mel_equals_official(clip):
    wave = GOLDEN[f"signal.{clip}"]
    mels = log_mel_spectrogram(wave)
    golden = GOLDEN[f"speaker.mels.{clip}"]
    assert mels.shape == golden.shape == (1, wave.shape[0] // 256, 128)
    assert (mels - golden).abs().max().item() <= 1e-5


@pytest.mark.parametrize("clip", CLIPS)
def test_speaker_embedding_equals_official(speaker_encoder, clip):
    embedding = speaker_encoder.embed(GOLDEN[f"signal.{clip}"])
    golden = GOLDEN[f"speaker.embedding.{clip}"]
    assert embedding.shape == golden.shape == (INFO["speaker_encoder_config"]["enc_dim"],)
    assert embedding.dtype == torch.float32
    assert ((embedding - golden).norm() / golden.norm()).item() <= 1e-4


def test_speaker_embeddings_differ_between_clips(speaker_encoder):
    a, b = (speaker_encoder.embed(GOLDEN[f"signal.{clip}"]) for clip in ("short", "long"))
    assert ((a - b).norm() / a.norm()).item() > 1e-2


@pytest.mark.parametrize("variant,talker_hidden", [("1.7b", 2048), ("0.6b", 1024)])
def test_real_base_speaker_encoder_shapes(variant, talker_hidden):
    """The released Base configs' speaker_encoder_config (enc_dim only, the rest official defaults):
    every official parameter name and shape, loaded from checkpoint-style tensors; the embedding has
    the talker's width."""
    real = INFO["real_speaker_encoders"][variant]
    config = {"tts_model_type": "base", "speaker_encoder_config": real["speaker_encoder_config"]}
    parsed = SpeakerEncoderConfig.parse(config, "config.json")
    assert parsed.enc_dim == talker_hidden
    tensors = _seeded(SpeakerEncoder, parsed, prefix="speaker_encoder.")
    assert {k[len("speaker_encoder."):]: list(v.shape) for k, v in tensors.items()} == real["parameters"]
    tensors["talker.codec_head.weight"] = torch.zeros(4, 4)  # other tensors of the checkpoint are ignored
    encoder = load_speaker_encoder(config, tensors)
    embedding = encoder.embed(GOLDEN["signal.short"])
    assert embedding.shape == (talker_hidden,) and embedding.dtype == torch.float32
    assert torch.isfinite(embedding).all() and embedding.abs().max() > 0


def test_speaker_encoder_errors(speaker_encoder):
    with pytest.raises(CheckpointError, match="no speaker_encoder_config"):
        load_speaker_encoder({"tts_model_type": "custom_voice"}, {}, "ckpt/config.json")
    config = {"speaker_encoder_config": INFO["speaker_encoder_config"]}
    tensors = _seeded(SpeakerEncoder, speaker_encoder.config, prefix="speaker_encoder.")
    del tensors["speaker_encoder.asp.conv.weight"]
    with pytest.raises(CheckpointError, match="asp.conv.weight is missing"):
        load_speaker_encoder(config, tensors)
    with pytest.raises(CheckpointError, match="mel_dim"):
        SpeakerEncoderConfig.parse({"speaker_encoder_config": {"mel_dim": 80}}, "config.json")
    with pytest.raises(ValueError, match="too short"):
        speaker_encoder.embed(torch.zeros(speaker_encoder.min_samples - 1))
    with pytest.raises(ValueError, match="mono"):
        speaker_encoder.embed(torch.zeros(2, 24000))
    # The shortest accepted clip runs (every reflect padding fits).
    assert speaker_encoder.embed(GOLDEN["signal.short"][:speaker_encoder.min_samples]).shape == (32,)


# ---------------------------------------------------------------------------------------------
# Codec encoder


@pytest.mark.parametrize("clip", CLIPS)
def test_codes_equal_official(codec_encoder, clip):
    wave = GOLDEN[f"signal.{clip}"]
    codes = codec_encoder.encode(wave)
    golden = GOLDEN[f"codec.codes.{clip}"]
    assert codes.dtype == torch.int64
    assert codes.shape == golden.shape == (math.ceil(wave.shape[0] / 1920), 16)
    assert torch.equal(codes, golden)


def test_batched_official_encode_differs_only_in_a_padded_last_frame(codec_encoder):
    """The official encodes a list right-padded with zeros: the 1.3 s clip's last frame then sees
    the padding. The whole-batch forward reproduces that; `encode` (one clip) is the unpadded one."""
    waves = [GOLDEN[f"signal.{clip}"] for clip in CLIPS]
    longest = max(w.shape[0] for w in waves)
    batch = torch.stack([torch.nn.functional.pad(w, (0, longest - w.shape[0])) for w in waves])
    with torch.inference_mode():
        codes = codec_encoder(batch)
    for clip, wave, row in zip(CLIPS, waves, codes):
        batched = GOLDEN[f"codec.batched_codes.{clip}"]
        assert torch.equal(row[:, :math.ceil(wave.shape[0] / 1920)].T, batched)
    single, batched = GOLDEN["codec.codes.short"], GOLDEN["codec.batched_codes.short"]
    assert torch.equal(single[:-1], batched[:-1]) and not torch.equal(single[-1], batched[-1])


def test_full_attention_window_as_the_official_loader(codec_encoder):
    """The official loader widens Mimi's sliding window to max_position_embeddings; the fixture's
    window (16) is shorter than the 3 s clip's 75 frames, so the narrow window gives other codes."""
    config = codec_encoder.config
    assert config.attention_window == INFO["loaded_sliding_window"] == 50
    narrow = CodecEncoder.from_state_dict(
        CodecEncoderConfig(**{**config.__dict__, "attention_window": 16}), codec_encoder.state_dict())
    assert not torch.equal(narrow.encode(GOLDEN["signal.long"]), GOLDEN["codec.codes.long"])


def test_codec_encoder_loads_official_tensor_names(codec_encoder, tmp_path):
    """speech_tokenizer/model.safetensors as the official save_pretrained writes it (every encoder.*
    name, decoder-half extras included) loads, and gives the same codes."""
    official = INFO["official_encoder_tensors"]
    ours = {"encoder." + k: v for k, v in codec_encoder.state_dict().items()}
    assert set(ours) <= set(official)
    assert all(list(v.shape) == official[k] for k, v in ours.items())
    tensors = {k: ours[k] if k in ours else torch.zeros(shape) for k, shape in official.items()}
    tensors["decoder.pre_conv.conv.weight"] = torch.zeros(2, 2, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(INFO["speech_tokenizer_config"]))
    loaded = load_codec_encoder(tmp_path)
    assert torch.equal(loaded.encode(GOLDEN["signal.short"]), GOLDEN["codec.codes.short"])

    del tensors["encoder.quantizer.acoustic_residual_vector_quantizer.layers.3.codebook.embed_sum"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*layers.3.codebook.embed_sum is missing"):
        load_codec_encoder(tmp_path)


def test_real_codec_encoder_shapes():
    """The released encoder_config: every tensor this module loads has the official name and shape
    (all of them but the 16 unused codebooks, output projections and flags), and 1 s of audio gives
    13 frames of 16 codes."""
    real = INFO["real_codec_encoder"]
    config = CodecEncoderConfig.parse(real["speech_tokenizer_config"], "speech_tokenizer/config.json")
    assert (config.attention_window, config.valid_quantizers, config.downsample_kernel) == (8000, 16, 4)
    state = _seeded(CodecEncoder, config, prefix="encoder.")
    official = real["encoder_tensors"]
    assert {k: list(v.shape) for k, v in state.items()} == {k: official[k] for k in state}
    unused = sorted(set(official) - set(state))
    assert len(unused) == 2 * 16 + 32 + 2, unused  # codebooks 16..31 (2 buffers each), 32 flags, 2 output projections
    encoder = CodecEncoder.from_state_dict(config, {k[len("encoder."):]: v for k, v in state.items()})
    codes = encoder.encode(GOLDEN["signal.short"][:24000])
    assert codes.shape == (13, 16) and codes.dtype == torch.int64
    assert 0 <= codes.min() and codes.max() < 2048


def test_codec_encoder_loads_the_tiny_customvoice_speech_tokenizer():
    """A speech tokenizer written by tools/make_golden.py (official classes, another Mimi config)."""
    encoder = load_codec_encoder(TINY_CUSTOMVOICE_TOKENIZER)
    codes = encoder.encode(GOLDEN["signal.even"])
    assert codes.shape == (25, 16) and codes.dtype == torch.int64
    assert 0 <= codes.min() and codes.max() < encoder.config.codebook_size


def test_codec_encoder_config_errors():
    config = json.loads(json.dumps(INFO["speech_tokenizer_config"]))
    config["encode_downsample_rate"] = 960
    with pytest.raises(CheckpointError, match="encode_downsample_rate is 960"):
        CodecEncoderConfig.parse(config, "speech_tokenizer/config.json")
    config = json.loads(json.dumps(INFO["speech_tokenizer_config"]))
    config["encoder_valid_num_quantizers"] = 21
    with pytest.raises(CheckpointError, match="encoder_valid_num_quantizers"):
        CodecEncoderConfig.parse(config, "speech_tokenizer/config.json")
    with pytest.raises(CheckpointError, match="missing field 'encoder_config'"):
        CodecEncoderConfig.parse({"encode_downsample_rate": 1920}, "speech_tokenizer/config.json")
